//! Block keys: a prompt cut into fixed-size blocks, block `i` keyed by xxh3 of its bytes seeded
//! with the key of block `i - 1`. Because every key folds in the one before it, two chains share
//! key `i` exactly when they share blocks `0..=i` (up to a 64-bit collision), which is what lets
//! the index treat a single key as the name of a whole prefix.
//!
//! A trailing partial block gets no key: a cache can only reuse whole pages, and a partial block
//! would change its key as the prompt grows, so it could never match the next turn anyway.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// What the bytes of a chain are. The root seed mixes the domain and the block size, so chains
/// built with different settings never share a key (a text key can never match a token key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    Text,
    Tokens,
    Ids,
}

/// The seed of block 0 (the "key of the empty prefix") for a domain and block size.
pub fn root_seed(domain: Domain, block_size: usize) -> u64 {
    let tag: &[u8] = match domain {
        Domain::Text => b"smetric/text/v1",
        Domain::Tokens => b"smetric/tokens/v1",
        Domain::Ids => b"smetric/ids/v1",
    };
    xxh3_64_with_seed(tag, block_size as u64)
}

/// Chains the full `block_bytes`-sized blocks of `bytes`, starting from `seed`.
pub fn chain_blocks(bytes: &[u8], block_bytes: usize, seed: u64) -> Vec<u64> {
    assert!(block_bytes > 0, "block size must be positive");
    let mut keys = Vec::with_capacity(bytes.len() / block_bytes);
    chain_into(&mut keys, seed, bytes, block_bytes);
    keys
}

/// Chains the blocks of `bytes` (a whole number of them) onto `keys`, after the key `prev`;
/// returns the last key.
fn chain_into(keys: &mut Vec<u64>, mut prev: u64, bytes: &[u8], block_bytes: usize) -> u64 {
    for block in bytes.chunks_exact(block_bytes) {
        prev = xxh3_64_with_seed(block, prev);
        keys.push(prev);
    }
    prev
}

/// Keys of a text prompt: blocks of `block_bytes` UTF-8 bytes (a block may end inside a
/// multi-byte character; only equality matters).
pub fn hash_text(text: &[u8], block_bytes: usize) -> Vec<u64> {
    chain_blocks(text, block_bytes, root_seed(Domain::Text, block_bytes))
}

/// `hash_text` of the pieces one after the other, without putting them together: the blocks
/// inside a piece are hashed where they lie, and only a block across pieces is copied.
pub fn hash_text_pieces(pieces: &[&[u8]], block_bytes: usize) -> Vec<u64> {
    assert!(block_bytes > 0, "block size must be positive");
    let len: usize = pieces.iter().map(|p| p.len()).sum();
    let mut keys = Vec::with_capacity(len / block_bytes);
    let mut prev = root_seed(Domain::Text, block_bytes);
    // The start of a block that the next piece ends.
    let mut partial = Vec::with_capacity(block_bytes);
    for &piece in pieces {
        let mut rest = piece;
        if !partial.is_empty() {
            let take = rest.len().min(block_bytes - partial.len());
            partial.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if partial.len() < block_bytes {
                continue;
            }
            prev = chain_into(&mut keys, prev, &partial, block_bytes);
            partial.clear();
        }
        let whole = rest.len() - rest.len() % block_bytes;
        prev = chain_into(&mut keys, prev, &rest[..whole], block_bytes);
        partial.extend_from_slice(&rest[whole..]);
    }
    keys
}

/// Keys of a token-id prompt: blocks of `block_tokens` ids, each id as 4 little-endian bytes.
pub fn hash_tokens(tokens: &[u32], block_tokens: usize) -> Vec<u64> {
    assert!(block_tokens > 0, "block size must be positive");
    let seed = root_seed(Domain::Tokens, block_tokens);
    if cfg!(target_endian = "little") {
        chain_blocks(bytemuck::cast_slice(tokens), block_tokens * 4, seed)
    } else {
        let le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        chain_blocks(&le, block_tokens * 4, seed)
    }
}

/// Chains caller-supplied per-block ids (e.g. content hashes that are *not* already chained), one
/// id a block, each as 8 little-endian bytes.
pub fn chain_ids(ids: &[u64]) -> Vec<u64> {
    let mut keys = Vec::with_capacity(ids.len());
    let mut prev = root_seed(Domain::Ids, 1);
    for id in ids {
        prev = xxh3_64_with_seed(&id.to_le_bytes(), prev);
        keys.push(prev);
    }
    keys
}

/// SGLang's page hashes, as its KV events publish them (sglang >= 0.5.10, no LoRA / cache salt):
/// page `i`'s digest is SHA-256 of (digest of page `i - 1`, raw 32 bytes; nothing for page 0) then
/// the page's ids as little-endian u32; the event carries the digest's first 8 bytes read as a
/// big-endian signed int64, whose bit pattern is the key here. Keying token prompts this way puts
/// the router's predictions and the workers' `BlockStored` / `BlockRemoved` events in one space.
pub fn sglang_page_hashes(tokens: &[u32], page_size: usize) -> Vec<u64> {
    assert!(page_size > 0, "page size must be positive");
    let mut keys = Vec::with_capacity(tokens.len() / page_size);
    let mut prev: Option<[u8; 32]> = None;
    let mut page_bytes = Vec::with_capacity(page_size * 4);
    for page in tokens.chunks_exact(page_size) {
        page_bytes.clear();
        page_bytes.extend(page.iter().flat_map(|t| t.to_le_bytes()));
        let mut hasher = Sha256::new();
        if let Some(p) = &prev {
            hasher.update(p);
        }
        hasher.update(&page_bytes);
        let digest: [u8; 32] = hasher.finalize().into();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        keys.push(u64::from_be_bytes(first));
        prev = Some(digest);
    }
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_hash_as_their_concatenation() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        // Cuts of every kind: inside blocks, at their edges, empty pieces, one long piece.
        for cuts in [
            vec![],
            vec![0, 0, 1000],
            vec![1, 2, 3, 63, 64, 65, 127, 128, 129, 500],
            vec![64, 128, 192, 256],
            vec![10, 10, 11, 999],
        ] {
            let mut pieces = Vec::new();
            let mut start = 0;
            for &cut in &cuts {
                pieces.push(&text[start..cut]);
                start = cut;
            }
            pieces.push(&text[start..]);
            for block in [1, 7, 64, 100, 2000] {
                assert_eq!(
                    hash_text_pieces(&pieces, block),
                    hash_text(&text, block),
                    "{cuts:?} {block}"
                );
            }
        }
    }

    #[test]
    fn partial_trailing_block_gets_no_key() {
        assert_eq!(hash_text(&[b'a'; 63], 64).len(), 0);
        assert_eq!(hash_text(&[b'a'; 64], 64).len(), 1);
        assert_eq!(hash_text(&[b'a'; 191], 64).len(), 2);
        assert_eq!(hash_tokens(&[7; 31], 16).len(), 1);
    }

    #[test]
    fn extending_a_prompt_keeps_its_keys() {
        let short = hash_text(b"system prompt, then the first question......", 8);
        let long = hash_text(
            b"system prompt, then the first question...... and a follow-up",
            8,
        );
        assert_eq!(&long[..short.len()], &short[..]);
        assert!(long.len() > short.len());
    }

    #[test]
    fn a_changed_block_changes_every_later_key() {
        let a = hash_text(b"aaaaaaaabbbbbbbbcccccccc", 8);
        let b = hash_text(b"aaaaaaaaXbbbbbbbcccccccc", 8);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        // Same third block, different prefix: the chain keeps them apart.
        assert_ne!(a[2], b[2]);
    }

    #[test]
    fn domains_and_block_sizes_never_share_keys() {
        let bytes = [1u8, 0, 0, 0, 2, 0, 0, 0];
        let text = hash_text(&bytes, 8);
        let tokens = hash_tokens(&[1, 2], 2);
        assert_ne!(text[0], tokens[0]);
        assert_ne!(hash_text(&[0u8; 16], 8)[1], hash_text(&[0u8; 16], 16)[0]);
    }

    #[test]
    fn sglang_page_hashes_match_sglang_event_values() {
        // Values SGLang's hash_str_to_int64(get_hash_str(...)) gives for page size 4.
        let keys = sglang_page_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0] as i64, -3488128144981237669);
        assert_eq!(keys[1] as i64, 5674439469042975057);
    }

    #[test]
    fn chain_ids_is_a_prefix_chain() {
        let a = chain_ids(&[5, 6, 7]);
        let b = chain_ids(&[5, 6, 8]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(chain_ids(&[6])[0], a[1]);
    }
}
