//! What a baseline remembers of the prompts it routed: SGLang's approximate tree and the
//! Gateway API Inference Extension's prefix plugin both keep, per instance, an LRU of the
//! prefixes sent there, independent of the router's shared index.

use super::ScoringContext;
use crate::prefix::{chain_seed, prompt_block_hashes, BlockMatch, PrefixIndex, Slot};

/// Per-instance LRU of routed prompt blocks, with the current request's hashes and matches.
pub(crate) struct RoutedPrefixes {
    index: PrefixIndex,
    block_bytes: usize,
    capacity: u32,
    hashes: Vec<u64>,
    matches: Vec<BlockMatch>,
    depth: Vec<u32>,
}

impl RoutedPrefixes {
    /// Blocks of `block_bytes`, at most `capacity` blocks per instance.
    pub(crate) fn new(block_bytes: usize, capacity: u32) -> Self {
        RoutedPrefixes {
            index: PrefixIndex::new(),
            block_bytes,
            capacity: capacity.max(1),
            hashes: Vec::new(),
            matches: Vec::new(),
            depth: Vec::new(),
        }
    }

    /// Hashes the request's prompt (model and adapter separate chains, as the peers key them).
    pub(crate) fn hash(&mut self, ctx: &ScoringContext<'_>) {
        self.hashes.clear();
        let seed = chain_seed(ctx.request.model, ctx.request.adapter, None);
        prompt_block_hashes(
            &ctx.request.prompt,
            seed,
            self.block_bytes,
            &mut self.hashes,
        );
    }

    /// Looks the hashed prompt up; afterwards [`Self::depth`] answers per instance.
    pub(crate) fn lookup(&mut self, ctx: &ScoringContext<'_>) {
        self.index.lookup(&self.hashes, &mut self.matches);
        self.depth.clear();
        self.depth.resize(ctx.fleet.slot_bound(), 0);
        for m in &self.matches {
            self.depth[m.slot as usize] = m.blocks;
        }
    }

    /// Leading blocks of the looked-up prompt that `slot` was sent before.
    pub(crate) fn depth(&self, slot: Slot) -> u32 {
        self.depth.get(slot as usize).copied().unwrap_or(0)
    }

    /// Full blocks in the hashed prompt.
    pub(crate) fn prompt_blocks(&self) -> usize {
        self.hashes.len()
    }

    /// Blocks remembered for `slot`.
    pub(crate) fn held(&self, slot: Slot) -> u32 {
        self.index.len(slot)
    }

    /// The hashed prompt's blocks, for the plan (the scratch is refilled by the next hash).
    pub(crate) fn take_hashes(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.hashes)
    }

    /// Remembers a prompt (its block hashes from [`Self::take_hashes`]) as sent to `slot`.
    pub(crate) fn record(&mut self, slot: Slot, hashes: &[u64]) {
        if self.index.capacity(slot) == 0 {
            self.index.set_capacity(slot, self.capacity);
        }
        self.index.insert(slot, hashes);
    }

    /// Forgets an instance that left.
    pub(crate) fn forget(&mut self, slot: Slot) {
        self.index.clear_slot(slot);
        self.index.set_capacity(slot, 0);
    }
}
