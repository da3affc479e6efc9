//! Chained block hashes of a prompt: block k's hash covers every byte before it and the seed.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Chains a block onto its parent. The block is hashed with xxh3's default secret and only the
/// 8-byte digest is seeded with the parent: a seeded hash of a long input derives a fresh
/// secret on every call, which costs more than hashing the block itself.
#[inline]
fn chain(parent: u64, block: &[u8]) -> u64 {
    xxh3_64_with_seed(&xxh3_64(block).to_le_bytes(), parent)
}

use crate::request::Prompt;

/// Largest block size accepted, so that a block straddling pieces fits a fixed buffer.
pub const MAX_BLOCK_BYTES: usize = 4096;

/// The seed of a chain: requests for different models, adapters or cache salts never share blocks.
pub fn chain_seed(model: &str, adapter: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut key = Vec::with_capacity(model.len() + 64);
    key.extend_from_slice(model.as_bytes());
    key.push(0);
    key.extend_from_slice(adapter.unwrap_or("").as_bytes());
    key.push(0);
    key.extend_from_slice(cache_salt.unwrap_or("").as_bytes());
    xxh3_64(&key)
}

/// Appends to `out` the chained hash of every full `block_bytes`-byte block of the prompt's
/// canonical rendering; a partial last block is not hashed (an engine caches only full blocks).
pub fn prompt_block_hashes(prompt: &Prompt<'_>, seed: u64, block_bytes: usize, out: &mut Vec<u64>) {
    let mut chain = ChainHasher::new(seed, block_bytes, out);
    prompt.for_each_piece(|piece| chain.feed(piece));
}

/// Chained hashes of blocks of already-tokenized content (exact mode: the engine's token ids).
pub fn token_block_hashes(tokens: &[u32], seed: u64, block_tokens: usize, out: &mut Vec<u64>) {
    let mut parent = seed;
    let mut bytes = Vec::with_capacity(block_tokens * 4);
    for block in tokens.chunks_exact(block_tokens.max(1)) {
        bytes.clear();
        block
            .iter()
            .for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
        parent = chain(parent, &bytes);
        out.push(parent);
    }
}

/// Streams bytes into fixed-size blocks and emits each block's chained hash.
struct ChainHasher<'o> {
    parent: u64,
    block_bytes: usize,
    carry: [u8; MAX_BLOCK_BYTES],
    carried: usize,
    out: &'o mut Vec<u64>,
}

impl<'o> ChainHasher<'o> {
    fn new(seed: u64, block_bytes: usize, out: &'o mut Vec<u64>) -> Self {
        ChainHasher {
            parent: seed,
            block_bytes: block_bytes.clamp(1, MAX_BLOCK_BYTES),
            carry: [0; MAX_BLOCK_BYTES],
            carried: 0,
            out,
        }
    }

    fn emit(&mut self, block: &[u8]) {
        self.parent = chain(self.parent, block);
        self.out.push(self.parent);
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        if self.carried > 0 {
            let take = (self.block_bytes - self.carried).min(bytes.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&bytes[..take]);
            self.carried += take;
            bytes = &bytes[take..];
            if self.carried < self.block_bytes {
                return;
            }
            self.parent = chain(self.parent, &self.carry[..self.block_bytes]);
            self.out.push(self.parent);
            self.carried = 0;
        }
        let mut blocks = bytes.chunks_exact(self.block_bytes);
        for block in &mut blocks {
            self.emit(block);
        }
        let rest = blocks.remainder();
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carried = rest.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hashes(prompt: Prompt<'_>, seed: u64, block: usize) -> Vec<u64> {
        let mut out = Vec::new();
        prompt_block_hashes(&prompt, seed, block, &mut out);
        out
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert_eq!(hashes(Prompt::Text("abcdefghij"), 1, 4).len(), 2);
        assert!(hashes(Prompt::Text("abc"), 1, 4).is_empty());
    }

    #[test]
    fn seed_separates_models_adapters_and_salts() {
        let a = chain_seed("m", None, None);
        assert_ne!(a, chain_seed("m", Some("lora"), None));
        assert_ne!(a, chain_seed("m", None, Some("salt")));
        assert_ne!(a, chain_seed("n", None, None));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(
            chain_seed("ab", Some("c"), None),
            chain_seed("a", Some("bc"), None)
        );
    }

    #[test]
    fn a_block_hash_depends_on_everything_before_it() {
        let a = hashes(Prompt::Text("xxxxyyyy"), 7, 4);
        let b = hashes(Prompt::Text("zzzzyyyy"), 7, 4);
        assert_ne!(a[1], b[1], "same second block, different first block");
    }

    proptest! {
        #[test]
        fn piece_boundaries_do_not_change_hashes(
            text in "[a-z ]{0,300}",
            cuts in proptest::collection::vec(0usize..300, 0..6),
            block in 1usize..40,
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(text.len())).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut start = 0;
            for cut in cuts {
                pieces.push(&text[start..cut]);
                start = cut;
            }
            pieces.push(&text[start..]);
            prop_assert_eq!(
                hashes(Prompt::Pieces(&pieces), 3, block),
                hashes(Prompt::Text(&text), 3, block)
            );
        }

        #[test]
        fn shared_prefix_gives_shared_leading_hashes(
            common in "[a-z]{0,200}", a in "[a-z]{0,100}", b in "[a-z]{0,100}", block in 1usize..32,
        ) {
            let x = hashes(Prompt::Text(&format!("{common}{a}")), 9, block);
            let y = hashes(Prompt::Text(&format!("{common}{b}")), 9, block);
            let shared = common.len() / block;
            prop_assert_eq!(&x[..shared], &y[..shared]);
        }
    }
}
