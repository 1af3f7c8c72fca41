//! smetric's prefix index: which leading blocks of a prompt each serving instance (and the shared
//! global KV tier) holds, over chained block keys.
//!
//! The crate is plain Rust (`keys`, `index`); the `python` feature adds the pyo3 bindings that
//! maturin builds into `smetric._prefix_index`.

pub mod copy;
pub mod index;
pub mod keys;
mod keytable;
pub mod request;

#[cfg(feature = "python")]
mod dataplane;
#[cfg(feature = "python")]
mod python;
#[cfg(feature = "upstream")]
pub mod upstream;

pub use index::{IndexError, IndexStats, InstanceStats, MatchResult, PrefixIndex, GLOBAL_TIER};
pub use keys::{chain_ids, hash_text, hash_tokens, sglang_page_hashes};
