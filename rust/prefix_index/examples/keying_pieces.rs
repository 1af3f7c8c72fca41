//! How long keying a chat body takes, in its two parts: `view_body` (validating the JSON,
//! decoding its strings, the chat serialization) and the chained hashes of the text.
//!
//!     cargo run --release -p smetric-prefix-index --example keying_pieces -- BODY.json...
//!
//! Prints, per body, the minimum and the median of 15 rounds of 500 calls each.

use std::time::Instant;

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

fn main() {
    let mut scratch = Scratch::default();
    for path in std::env::args().skip(1) {
        let body = std::fs::read(&path).expect("a body to read");
        let (view_min, view_med) = rounds(|| {
            let v = view_body(Api::Chat, std::hint::black_box(&body), &mut scratch);
            std::hint::black_box(v.expect("a chat body the fast path keys"));
        });
        let text = match view_body(Api::Chat, &body, &mut scratch).map(|v| v.prompt) {
            Some(Prompt::Text(text)) => text.to_vec(),
            _ => panic!("{path}: not a chat body"),
        };
        let (hash_min, hash_med) = rounds(|| {
            std::hint::black_box(smetric_prefix_index::hash_text(
                std::hint::black_box(&text),
                64,
            ));
        });
        println!(
            "{path}: {} B body, {} B text; view_body min {view_min:.1} median {view_med:.1} us; \
             hash_text min {hash_min:.1} median {hash_med:.1} us",
            body.len(),
            text.len()
        );
    }
}
