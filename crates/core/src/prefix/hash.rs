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

/// Halvings of the first block: the router's index also hashes the prompt at `block_bytes / 16`,
/// `/ 8`, `/ 4` and `/ 2`, so that a prompt shorter than one block (the first turn of most
/// conversations) is indexed too and its next turn finds where it went.
pub const LEADING_SPLITS: u32 = 4;

/// Bytes covered by the first `depth` elements of a tapered chain (see
/// [`tapered_prompt_block_hashes`]).
pub fn tapered_end(depth: u32, block_bytes: usize) -> usize {
    if block_bytes < 1 << LEADING_SPLITS {
        return depth as usize * block_bytes;
    }
    if depth <= LEADING_SPLITS {
        // depth 0 covers nothing; 1..=LEADING_SPLITS cover block_bytes / 16 ... / 2.
        return if depth == 0 {
            0
        } else {
            block_bytes >> (LEADING_SPLITS + 1 - depth)
        };
    }
    block_bytes * (depth - LEADING_SPLITS) as usize
}

/// Elements of a tapered chain that fit in the first `bytes` bytes.
pub fn tapered_depth(bytes: usize, block_bytes: usize) -> u32 {
    if block_bytes < 1 << LEADING_SPLITS {
        return (bytes / block_bytes.max(1)) as u32;
    }
    if bytes >= block_bytes {
        return (bytes / block_bytes) as u32 + LEADING_SPLITS;
    }
    (1..=LEADING_SPLITS)
        .take_while(|&d| tapered_end(d, block_bytes) <= bytes)
        .count() as u32
}

/// Like [`prompt_block_hashes`], but the first block is also cut at its halvings
/// ([`LEADING_SPLITS`]): chain element `k` covers bytes `tapered_end(k)..tapered_end(k + 1)`.
pub fn tapered_prompt_block_hashes(
    prompt: &Prompt<'_>,
    seed: u64,
    block_bytes: usize,
    out: &mut Vec<u64>,
) {
    let block_bytes = block_bytes.clamp(1, MAX_BLOCK_BYTES);
    let mut chain = ChainHasher::new(seed, block_bytes, out);
    if block_bytes >= 1 << LEADING_SPLITS {
        chain.taper = Some(0);
        chain.block_bytes = tapered_end(1, block_bytes);
    }
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
    /// Size of the element being filled.
    block_bytes: usize,
    /// Full block size, once the tapered leading elements are done.
    full_block: usize,
    /// Elements emitted so far, while the leading elements are tapered.
    taper: Option<u32>,
    /// A block straddling pieces (sized to the full block: a zeroed `MAX_BLOCK_BYTES` array
    /// cost more than hashing a 2k-token prompt's blocks).
    carry: Vec<u8>,
    carried: usize,
    out: &'o mut Vec<u64>,
}

impl<'o> ChainHasher<'o> {
    fn new(seed: u64, block_bytes: usize, out: &'o mut Vec<u64>) -> Self {
        ChainHasher {
            parent: seed,
            block_bytes: block_bytes.clamp(1, MAX_BLOCK_BYTES),
            full_block: block_bytes.clamp(1, MAX_BLOCK_BYTES),
            taper: None,
            carry: vec![0; block_bytes.clamp(1, MAX_BLOCK_BYTES)],
            carried: 0,
            out,
        }
    }

    fn emit(&mut self, block: &[u8]) {
        self.parent = chain(self.parent, block);
        self.out.push(self.parent);
        self.advance_taper();
    }

    /// After an element: the next one's size (doubling until the full block size).
    fn advance_taper(&mut self) {
        if let Some(done) = self.taper {
            let done = done + 1;
            if done > LEADING_SPLITS {
                self.taper = None;
                self.block_bytes = self.full_block;
            } else {
                self.taper = Some(done);
                self.block_bytes =
                    tapered_end(done + 1, self.full_block) - tapered_end(done, self.full_block);
            }
        }
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        // Tapered leading elements have varying sizes: take them one at a time.
        while self.taper.is_some() && !bytes.is_empty() {
            let take = (self.block_bytes - self.carried).min(bytes.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&bytes[..take]);
            self.carried += take;
            bytes = &bytes[take..];
            if self.carried == self.block_bytes {
                self.parent = chain(self.parent, &self.carry[..self.block_bytes]);
                self.out.push(self.parent);
                self.carried = 0;
                self.advance_taper();
            }
        }
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
    fn the_first_block_is_also_cut_at_its_halvings() {
        assert_eq!(
            (0..8).map(|d| tapered_end(d, 256)).collect::<Vec<_>>(),
            [0, 16, 32, 64, 128, 256, 512, 768]
        );
        for bytes in 0..1000 {
            let d = tapered_depth(bytes, 256);
            assert!(
                tapered_end(d, 256) <= bytes && tapered_end(d + 1, 256) > bytes,
                "{bytes}"
            );
        }
        let text = "x".repeat(700);
        let mut out = Vec::new();
        tapered_prompt_block_hashes(&Prompt::Text(&text), 1, 256, &mut out);
        assert_eq!(out.len() as u32, tapered_depth(700, 256));
        // A short prompt is a prefix of its continuation, element by element.
        let mut short = Vec::new();
        tapered_prompt_block_hashes(&Prompt::Text(&text[..100]), 1, 256, &mut short);
        assert_eq!(short.len(), 3);
        assert_eq!(short[..], out[..3]);
        // Small blocks are not tapered.
        assert_eq!(tapered_end(3, 8), 24);
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
            let tapered = |p: Prompt<'_>| {
                let mut out = Vec::new();
                tapered_prompt_block_hashes(&p, 3, block, &mut out);
                out
            };
            let whole = tapered(Prompt::Text(&text));
            prop_assert_eq!(tapered(Prompt::Pieces(&pieces)), whole.clone());
            prop_assert_eq!(whole.len() as u32, tapered_depth(text.len(), block));
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
