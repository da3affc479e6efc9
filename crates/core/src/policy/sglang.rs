//! Modelled on SGLang router's `cache_aware` policy (sgl-project/sglang, sgl-router
//! `policies/cache_aware.rs`, and its README): the fleet is imbalanced when both
//! `max_load - min_load > balance_abs_threshold` and `max_load > balance_rel_threshold ×
//! min_load`; then the least-loaded worker wins. Otherwise the worker whose approximate radix
//! tree matches the longest prefix wins if the matched share of the prompt exceeds
//! `cache_threshold`, else the worker with the smallest tree. The chosen worker's tree gets the
//! prompt at selection time. Load is the router's count of running requests per worker. Ties
//! go to the first worker, as in SGLang.
//!
//! The tree is approximated by this crate's prefix index at `block_chars` granularity (16
//! characters by default) with an LRU bounded at `max_tree_chars` per worker.

use rand::rngs::SmallRng;

use super::routed_prefixes::RoutedPrefixes;
use super::{pick_then_by_load, Policy, PolicyTraits, ScoringContext, TieBreak};
use crate::config::SglangConfig;
use crate::decision::Candidate;
use crate::fleet::Slot;

/// The SGLang-style cache-aware policy with its own per-worker tree.
pub struct SglangCacheAware {
    config: SglangConfig,
    tree: RoutedPrefixes,
}

impl SglangCacheAware {
    /// With the given thresholds.
    pub fn new(config: SglangConfig) -> Self {
        let blocks = (config.max_tree_chars / config.block_chars as u64).max(1);
        let tree = RoutedPrefixes::new(config.block_chars, blocks.min(u64::from(u32::MAX)) as u32);
        SglangCacheAware { config, tree }
    }
}

/// Whether SGLang would switch to shortest-queue: both imbalance thresholds hold.
pub fn is_imbalanced(max_load: u32, min_load: u32, config: &SglangConfig) -> bool {
    max_load - min_load > config.balance_abs_threshold
        && f64::from(max_load) > config.balance_rel_threshold * f64::from(min_load)
}

impl Policy for SglangCacheAware {
    fn traits(&self) -> &'static PolicyTraits {
        const TRAITS: PolicyTraits = PolicyTraits {
            name: "sglang-cache-aware",
            uses_prefix_index: false,
            tie_break: TieBreak::First,
            prices_local_prefill: false,
            scores_shortlist: false,
        };
        &TRAITS
    }

    fn score(
        &mut self,
        ctx: &ScoringContext<'_>,
        candidates: &mut [Candidate],
        _rng: &mut SmallRng,
    ) {
        if candidates.is_empty() {
            return;
        }
        let loads: Vec<u32> = candidates
            .iter()
            .map(|c| ctx.instance(c).load.in_flight())
            .collect();
        let (max, min) = (
            *loads.iter().max().unwrap_or(&0),
            *loads.iter().min().unwrap_or(&0),
        );
        let first_least_loaded = || {
            loads
                .iter()
                .enumerate()
                .min_by_key(|(_, l)| **l)
                .map_or(0, |(i, _)| i)
        };
        let request = ctx.request;
        self.tree.hash(ctx);
        let pick = if is_imbalanced(max, min, &self.config) {
            first_least_loaded()
        } else {
            self.tree.lookup(ctx);
            let mut best: Option<(usize, u32)> = None;
            for (i, c) in candidates.iter().enumerate() {
                let blocks = self.tree.depth(c.instance.slot);
                if blocks > best.map_or(0, |b| b.1) {
                    best = Some((i, blocks));
                }
            }
            let chars = request.prompt.rendered_len().max(1) as f64;
            let rate = best.map_or(0.0, |(_, b)| {
                (b as usize * self.config.block_chars) as f64 / chars
            });
            match best {
                Some((i, _)) if rate > self.config.cache_threshold => i,
                _ => {
                    // The smallest tree: the worker that has been sent the least text.
                    let mut smallest = 0;
                    for (i, c) in candidates.iter().enumerate() {
                        if self.tree.held(c.instance.slot)
                            < self.tree.held(candidates[smallest].instance.slot)
                        {
                            smallest = i;
                        }
                    }
                    smallest
                }
            }
        };
        pick_then_by_load(ctx, candidates, pick);
    }

    fn memo(&mut self) -> Vec<u64> {
        self.tree.take_hashes()
    }

    fn on_routed(&mut self, slot: Slot, memo: &[u64]) {
        self.tree.record(slot, memo);
    }

    fn forget_instance(&mut self, slot: Slot) {
        self.tree.forget(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imbalance_needs_both_thresholds() {
        let c = SglangConfig::default(); // abs 64, rel 1.5
        assert!(is_imbalanced(200, 100, &c)); // diff 100 > 64 and 200 > 150
        assert!(!is_imbalanced(140, 100, &c)); // diff 40: absolute threshold fails
        assert!(!is_imbalanced(1000, 900, &c)); // diff 100 but 1000 < 1350: relative fails
        assert!(!is_imbalanced(64, 0, &c)); // diff must exceed 64
        assert!(is_imbalanced(65, 0, &c));
    }
}
