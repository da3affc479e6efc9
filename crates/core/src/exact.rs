//! Exact prefix knowledge from engines' KV events (vLLM `BlockStored` / `BlockRemoved`).
//!
//! Engines hash blocks with their own algorithm and seed, so blocks are re-keyed by this
//! crate's chained hash of their token ids (what llm-d does); the engine's hashes are kept only
//! to resolve parents and removals. Matching needs the request's token ids.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::observe::KvEvent;
use crate::prefix::{chain_seed, token_block_hashes, BlockMatch, PrefixIndex, Slot};

/// Blocks each instance reported holding, keyed by our own hash of their tokens.
#[derive(Debug, Default)]
pub struct ExactIndex {
    index: PrefixIndex,
    /// (slot, engine block hash) -> our block hash.
    engine_to_own: FxHashMap<(Slot, u64), u64>,
    /// Tokens per block per publishing slot; a slot is in exact mode once it has published.
    block_size: FxHashMap<Slot, u32>,
    /// Slots whose event stream broke ([`ExactIndex::lose`]): events still build their view,
    /// but lookups fall back to the approximate index until [`ExactIndex::trust`].
    untrusted: FxHashSet<Slot>,
    scratch: Vec<u64>,
    matches: Vec<BlockMatch>,
    /// Blocks each slot holds of the prompt last passed to [`ExactIndex::look_up`], with the
    /// slot's block size (a route reads them per candidate without hashing again).
    looked_up: FxHashMap<Slot, (u32, u32)>,
}

fn seed(lora_name: Option<&str>) -> u64 {
    chain_seed("", lora_name, None)
}

/// A prompt's token ids hashed in an exact index's blocks, by the driver outside the router's
/// lock: a lookup given it only walks the index ([`ExactIndex::look_up`]).
#[derive(Debug, Clone, Default)]
pub struct ExactChain {
    block_tokens: u32,
    seed: u64,
    /// The ids of the blocks hashed so far (to tell whether new ids extend them).
    ids: Vec<u32>,
    hashes: Vec<u64>,
}

impl ExactChain {
    /// An empty chain for blocks of `block_tokens` under `adapter`.
    pub fn new(block_tokens: u32, adapter: Option<&str>) -> ExactChain {
        ExactChain {
            block_tokens: block_tokens.max(1),
            seed: seed(adapter),
            ids: Vec::new(),
            hashes: Vec::new(),
        }
    }

    /// Hashes the full blocks of `ids` not hashed yet: those past the blocks `ids` shares with
    /// the ids hashed before (a prompt tokenized further extends them; anything else is
    /// hashed again from where they differ).
    pub fn extend(&mut self, ids: &[u32]) {
        let size = self.block_tokens as usize;
        let same = self
            .ids
            .chunks_exact(size)
            .zip(ids.chunks_exact(size))
            .take_while(|(a, b)| a == b)
            .count();
        self.ids.truncate(same * size);
        self.hashes.truncate(same);
        let full = ids.len() / size * size;
        if full > self.ids.len() {
            let parent = self.hashes.last().copied().unwrap_or(self.seed);
            let new = &ids[self.ids.len()..full];
            token_block_hashes(new, parent, size, &mut self.hashes);
            self.ids.extend_from_slice(new);
        }
    }

    /// Block size the chain was hashed in.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// The chain of the full blocks of `ids`, if it is the one hashed here (the same adapter
    /// and these ids), else none.
    fn for_ids(&self, ids: &[u32], adapter: Option<&str>) -> Option<&[u64]> {
        let blocks = ids.len() / self.block_tokens as usize;
        (self.seed == seed(adapter)
            && self.hashes.len() >= blocks
            && self.ids[..blocks * self.block_tokens as usize]
                == ids[..blocks * self.block_tokens as usize])
            .then(|| &self.hashes[..blocks])
    }
}

impl ExactIndex {
    /// Applies an instance's events in order.
    pub fn apply(&mut self, slot: Slot, events: &[KvEvent]) {
        for event in events {
            match event {
                KvEvent::Stored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_name,
                } => {
                    let size = (*block_size).max(1);
                    self.block_size.insert(slot, size);
                    if self.index.capacity(slot) == 0 {
                        self.index.set_capacity(slot, u32::MAX);
                    }
                    let parent = match parent_block_hash {
                        Some(p) => match self.engine_to_own.get(&(slot, *p)) {
                            Some(&own) => own,
                            // Parent unknown (evicted or published before we listened): the
                            // chain cannot be matched from the root, so skip it.
                            None => continue,
                        },
                        None => seed(lora_name.as_deref()),
                    };
                    self.scratch.clear();
                    token_block_hashes(token_ids, parent, size as usize, &mut self.scratch);
                    for (engine, own) in block_hashes.iter().zip(&self.scratch) {
                        self.engine_to_own.insert((slot, *engine), *own);
                    }
                    let chain = std::mem::take(&mut self.scratch);
                    self.index.insert(slot, &chain);
                    self.scratch = chain;
                }
                KvEvent::Removed { block_hashes } => {
                    for engine in block_hashes {
                        if let Some(own) = self.engine_to_own.remove(&(slot, *engine)) {
                            self.index.remove(slot, own);
                        }
                    }
                }
                KvEvent::AllCleared => self.clear_slot(slot),
            }
        }
    }

    /// Forgets the blocks an instance holds (it still publishes: `AllBlocksCleared`).
    pub fn clear_slot(&mut self, slot: Slot) {
        self.index.clear_slot(slot);
        self.engine_to_own.retain(|(s, _), _| *s != slot);
    }

    /// Forgets everything about an instance, its exact mode too (it left the fleet: the slot
    /// may be reused by an instance that publishes nothing).
    pub fn forget_slot(&mut self, slot: Slot) {
        self.clear_slot(slot);
        self.block_size.remove(&slot);
        self.untrusted.remove(&slot);
    }

    /// The instance's event stream broke (a gap, silence, lag, a lost connection): lookups fall
    /// back to the approximate index until [`ExactIndex::trust`]. The view is kept and events
    /// keep updating it: a lost message leaves it a few blocks wrong, while dropping it would
    /// lose every block stored before the gap that is still cached (an engine publishes a block
    /// once, when it stores it; docs/results.md §3). A driver that knows the engine's cache is
    /// gone (it restarted) sends [`KvEvent::AllCleared`] first.
    pub fn lose(&mut self, slot: Slot) {
        self.untrusted.insert(slot);
    }

    /// The instance's events are trusted again: lookups use the exact view.
    pub fn trust(&mut self, slot: Slot) {
        self.untrusted.remove(&slot);
    }

    /// The block size of the trusted publishers among `slots`, when they share one.
    pub fn block_tokens(&self, slots: impl Iterator<Item = Slot>) -> Option<u32> {
        let mut sizes = slots
            .filter(|slot| !self.untrusted.contains(slot))
            .filter_map(|slot| self.block_size.get(&slot).copied());
        let first = sizes.next()?;
        sizes.all(|size| size == first).then_some(first)
    }

    /// Whether lookups on `slot` are exact (it publishes and its stream is trusted).
    pub fn is_exact(&self, slot: Slot) -> bool {
        self.block_size.contains_key(&slot) && !self.untrusted.contains(&slot)
    }

    /// How many leading tokens of a prompt a lookup on `slots` could still use, given its
    /// first `tokens` (under `adapter`): past the blocks a trusted instance holds, one more
    /// block each. A prompt tokenized this far needs no more of its ids to be matched exactly
    /// (0 when none of `slots` is matched exactly).
    pub fn horizon(
        &mut self,
        slots: impl Iterator<Item = Slot> + Clone,
        tokens: &[u32],
        adapter: Option<&str>,
        hashed: Option<&ExactChain>,
    ) -> usize {
        self.look_up(slots.clone(), tokens, adapter, hashed);
        slots
            .filter_map(|slot| self.looked_up.get(&slot))
            .map(|&(blocks, size)| (blocks as usize + 1) * size as usize)
            .max()
            .unwrap_or(0)
    }

    /// Looks `tokens` (under `adapter`) up for every trusted publisher among `slots`, hashing
    /// them once per block size (not at all in the size of `hashed`, when that chain is of
    /// these tokens); [`ExactIndex::looked_up_tokens`] then reads each slot's result. The
    /// walk is O(prompt) and runs under the driver's lock, once per route instead of once per
    /// candidate.
    pub fn look_up(
        &mut self,
        slots: impl Iterator<Item = Slot>,
        tokens: &[u32],
        adapter: Option<&str>,
        hashed: Option<&ExactChain>,
    ) {
        self.looked_up.clear();
        let mut sizes: Vec<(u32, Slot)> = slots
            .filter(|slot| !self.untrusted.contains(slot))
            .filter_map(|slot| self.block_size.get(&slot).map(|&size| (size, slot)))
            .collect();
        sizes.sort_unstable();
        let mut hashed_size = 0u32;
        for (size, slot) in sizes {
            if size != hashed_size {
                hashed_size = size;
                let given = hashed
                    .filter(|c| c.block_tokens == size)
                    .and_then(|c| c.for_ids(tokens, adapter));
                if let Some(chain) = given {
                    self.index.lookup_consecutive(chain, &mut self.matches);
                } else {
                    self.scratch.clear();
                    token_block_hashes(tokens, seed(adapter), size as usize, &mut self.scratch);
                    let chain = std::mem::take(&mut self.scratch);
                    self.index.lookup_consecutive(&chain, &mut self.matches);
                    self.scratch = chain;
                }
            }
            let blocks = self
                .matches
                .iter()
                .find(|m| m.slot == slot)
                .map_or(0, |m| m.blocks);
            self.looked_up.insert(slot, (blocks, size));
        }
    }

    /// Cached prompt tokens on `slot` by the last [`ExactIndex::look_up`], if the slot was
    /// among its trusted publishers (None otherwise: fall back to the approximate index).
    pub fn looked_up_tokens(&self, slot: Slot) -> Option<u32> {
        self.looked_up
            .get(&slot)
            .map(|&(blocks, size)| blocks * size)
    }

    /// Cached prompt tokens on `slot` for a request with these token ids on `adapter` (blocks
    /// an adapter computed are its own), if the instance publishes trusted events (None
    /// otherwise: fall back to the approximate index).
    pub fn cached_tokens(
        &mut self,
        slot: Slot,
        tokens: &[u32],
        adapter: Option<&str>,
    ) -> Option<u32> {
        self.look_up(std::iter::once(slot), tokens, adapter, None);
        self.looked_up_tokens(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
        KvEvent::Stored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 2,
            lora_name: None,
        }
    }

    #[test]
    fn stored_blocks_match_by_tokens_and_removal_cuts_the_run() {
        let mut exact = ExactIndex::default();
        assert_eq!(
            exact.cached_tokens(0, &[1, 2, 3, 4], None),
            None,
            "not publishing yet"
        );
        exact.apply(
            0,
            &[
                stored(&[100, 101], None, &[1, 2, 3, 4]),
                stored(&[102], Some(101), &[5, 6]),
            ],
        );
        assert_eq!(
            exact.cached_tokens(0, &[1, 2, 3, 4, 5, 6, 7], None),
            Some(6)
        );
        assert_eq!(exact.cached_tokens(0, &[1, 2, 9, 9], None), Some(2));
        exact.apply(
            0,
            &[KvEvent::Removed {
                block_hashes: vec![101],
            }],
        );
        assert_eq!(
            exact.cached_tokens(0, &[1, 2, 3, 4, 5, 6], None),
            Some(2),
            "a hole ends the run"
        );
        exact.apply(0, &[KvEvent::AllCleared]);
        assert_eq!(exact.cached_tokens(0, &[1, 2], None), Some(0));
    }

    #[test]
    fn the_horizon_is_one_block_past_the_deepest_trusted_holder() {
        let mut exact = ExactIndex::default();
        assert_eq!(exact.horizon([0, 1].into_iter(), &[1, 2, 3], None, None), 0);
        exact.apply(
            0,
            &[
                stored(&[100, 101], None, &[1, 2, 3, 4]),
                stored(&[102], Some(101), &[5, 6]),
            ],
        );
        exact.apply(1, &[stored(&[200], None, &[1, 2])]);
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        // Slot 0 holds three blocks of 2: a fourth could still match.
        assert_eq!(exact.horizon([0, 1].into_iter(), &prompt, None, None), 8);
        assert_eq!(exact.horizon([1].into_iter(), &prompt, None, None), 4);
        assert_eq!(exact.horizon([0].into_iter(), &[9, 9], None, None), 2);
        // Another adapter's blocks are not these.
        assert_eq!(exact.horizon([0].into_iter(), &prompt, Some("a"), None), 2);
        exact.lose(0);
        assert_eq!(exact.horizon([0, 1].into_iter(), &prompt, None, None), 4);
        exact.lose(1);
        assert_eq!(exact.horizon([0, 1].into_iter(), &prompt, None, None), 0);
    }

    #[test]
    fn a_chain_hashed_outside_gives_the_same_lookups() {
        let mut exact = ExactIndex::default();
        exact.apply(0, &[stored(&[100, 101, 102], None, &[1, 2, 3, 4, 5, 6])]);
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8];
        let mut chain = ExactChain::new(2, None);
        chain.extend(&prompt[..3]);
        chain.extend(&prompt[..5]);
        chain.extend(&[1, 2, 9, 9]);
        chain.extend(&prompt);
        assert_eq!(exact.block_tokens([0].into_iter()), Some(2));
        assert_eq!(
            exact.horizon([0].into_iter(), &prompt, None, Some(&chain)),
            8
        );
        let mut whole = Vec::new();
        token_block_hashes(&prompt, seed(None), 2, &mut whole);
        assert_eq!(chain.hashes, whole, "extended, cut back and extended again");
        // Another adapter's chain, or other ids, are not used.
        let other = ExactChain::new(2, Some("a"));
        assert_eq!(other.for_ids(&prompt, None), None);
        assert_eq!(chain.for_ids(&[1, 2, 3, 9], None), None);
        exact.look_up([0].into_iter(), &prompt, None, Some(&chain));
        assert_eq!(exact.looked_up_tokens(0), Some(6));
    }

    #[test]
    fn a_lost_stream_falls_back_until_trusted_and_keeps_its_view() {
        let mut exact = ExactIndex::default();
        exact.apply(0, &[stored(&[100, 101], None, &[1, 2, 3, 4])]);
        exact.apply(1, &[stored(&[200], None, &[1, 2])]);
        assert!(exact.is_exact(0));
        exact.lose(0);
        assert!(!exact.is_exact(0));
        assert_eq!(
            exact.cached_tokens(0, &[1, 2, 3, 4], None),
            None,
            "approximate"
        );
        assert_eq!(
            exact.cached_tokens(1, &[1, 2], None),
            Some(2),
            "others untouched"
        );
        // Events during the fallback update the view; what it held before the gap stays.
        exact.apply(0, &[stored(&[300], None, &[9, 9])]);
        assert_eq!(exact.cached_tokens(0, &[9, 9], None), None);
        exact.trust(0);
        assert!(exact.is_exact(0));
        assert_eq!(exact.cached_tokens(0, &[9, 9], None), Some(2));
        assert_eq!(
            exact.cached_tokens(0, &[1, 2, 3, 4], None),
            Some(4),
            "kept through the loss"
        );
        // An engine that restarted is cleared by its driver.
        exact.lose(0);
        exact.apply(0, &[KvEvent::AllCleared]);
        exact.trust(0);
        assert_eq!(
            exact.cached_tokens(0, &[1, 2, 3, 4], None),
            Some(0),
            "cleared with the engine"
        );
        exact.forget_slot(0);
        assert_eq!(
            exact.cached_tokens(0, &[9, 9], None),
            None,
            "a reused slot starts blind"
        );
    }

    #[test]
    fn an_adapters_blocks_match_only_its_requests() {
        let mut exact = ExactIndex::default();
        let mut lora = stored(&[1], None, &[1, 2]);
        if let KvEvent::Stored { lora_name, .. } = &mut lora {
            *lora_name = Some("sql".into());
        }
        exact.apply(0, &[lora, stored(&[2], None, &[3, 4])]);
        assert_eq!(exact.cached_tokens(0, &[1, 2], Some("sql")), Some(2));
        assert_eq!(exact.cached_tokens(0, &[1, 2], None), Some(0));
        assert_eq!(exact.cached_tokens(0, &[3, 4], Some("sql")), Some(0));
        assert_eq!(exact.cached_tokens(0, &[3, 4], None), Some(2));
    }

    #[test]
    fn a_chain_with_an_unknown_parent_is_skipped() {
        let mut exact = ExactIndex::default();
        exact.apply(0, &[stored(&[7], Some(999), &[1, 2])]);
        assert_eq!(exact.cached_tokens(0, &[1, 2], None), Some(0));
    }
}
