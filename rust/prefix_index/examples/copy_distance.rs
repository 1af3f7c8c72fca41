//! How long a 122 KB copy takes at a few distances (destination past source, modulo 4 KiB):
//! `copy_from_slice` (glibc's `memcpy`) against `smetric_prefix_index::copy::copy`.
//!
//!     cargo run --release -p smetric-prefix-index --example copy_distance

use std::time::Instant;

fn main() {
    const LEN: usize = 122_000;
    const PAGE: usize = 4096;
    let src: Vec<u8> = (0..LEN).map(|i| i as u8).collect();
    let mut buf = vec![0u8; 4 << 20];
    for gap in [0usize, 8, 16, 64] {
        let want = (src.as_ptr() as usize + gap) % PAGE;
        let start = (want + PAGE - buf.as_ptr() as usize % PAGE) % PAGE + (1 << 20);
        for ours in [false, true] {
            let t0 = Instant::now();
            for _ in 0..200 {
                let dst = &mut buf[start..start + LEN];
                if ours {
                    smetric_prefix_index::copy::copy(dst, &src);
                } else {
                    dst.copy_from_slice(&src);
                }
                std::hint::black_box(&buf);
            }
            let us = t0.elapsed().as_secs_f64() / 200.0 * 1e6;
            let name = if ours {
                "copy::copy"
            } else {
                "copy_from_slice"
            };
            println!("distance {gap:>2}: {name:<15} {us:6.1} µs");
        }
    }
}
