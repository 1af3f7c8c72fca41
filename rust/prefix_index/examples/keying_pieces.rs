//! How long keying a request body takes, in its parts: `view_body` (validating the JSON,
//! decoding its strings, putting the prompt together), the chained hashes of the prompt's text
//! on their own, and the two together as the router runs them. A file whose name has `compl`
//! in it is a `/v1/completions` body; any other, a chat body.
//!
//!     cargo run --release -p smetric-prefix-index --example keying_pieces -- BODY.json...
//!
//! Prints, per body, the minimum and the median of 15 rounds of 500 calls each.

use std::time::Instant;

use smetric_prefix_index::keys::hash_text_pieces;
use smetric_prefix_index::request::{view_body, Api, Prompt, Scratch};

fn rounds(mut f: impl FnMut()) -> (f64, f64) {
    const CALLS: u32 = 500;
    let mut us: Vec<f64> = (0..15)
        .map(|_| {
            let t0 = Instant::now();
            for _ in 0..CALLS {
                f();
            }
            t0.elapsed().as_secs_f64() / f64::from(CALLS) * 1e6
        })
        .collect();
    us.sort_by(f64::total_cmp);
    (us[0], us[us.len() / 2])
}

fn keys(prompt: &Prompt<'_>) -> Vec<u64> {
    match prompt {
        Prompt::Text(text) => smetric_prefix_index::hash_text(text, 64),
        Prompt::Pieces(pieces) => hash_text_pieces(pieces, 64),
        Prompt::Tokens(_) => panic!("not a text prompt"),
    }
}

fn main() {
    let mut scratch = Scratch::default();
    for path in std::env::args().skip(1) {
        let body = std::fs::read(&path).expect("a body to read");
        let api = if path.contains("compl") {
            Api::Completions
        } else {
            Api::Chat
        };
        let mut view = || {
            let v = view_body(api, std::hint::black_box(&body), &mut scratch);
            std::hint::black_box(v.expect("a body the fast path keys").prompt);
        };
        let view_us = rounds(&mut view);
        let text = match view_body(api, &body, &mut scratch).map(|v| v.prompt) {
            Some(Prompt::Text(text)) => text.to_vec(),
            Some(Prompt::Pieces(pieces)) => pieces.concat(),
            _ => panic!("{path}: not a text prompt"),
        };
        let hash_us = rounds(|| {
            std::hint::black_box(smetric_prefix_index::hash_text(
                std::hint::black_box(&text),
                64,
            ));
        });
        let both_us = rounds(|| {
            let v = view_body(api, std::hint::black_box(&body), &mut scratch);
            std::hint::black_box(keys(&v.expect("a body the fast path keys").prompt));
        });
        println!(
            "{path}: {} B body, {} B text; min/median us: view_body {:.1}/{:.1}, hash_text \
             {:.1}/{:.1}, both {:.1}/{:.1}",
            body.len(),
            text.len(),
            view_us.0,
            view_us.1,
            hash_us.0,
            hash_us.1,
            both_us.0,
            both_us.1
        );
    }
}
