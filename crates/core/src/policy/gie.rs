//! Modelled on the Gateway API Inference Extension's default endpoint picker profile
//! (kubernetes-sigs/gateway-api-inference-extension, `EndpointPickerConfig` with
//! `queue-scorer` weight 2, `kv-cache-utilization-scorer` weight 2, `prefix-cache-scorer`
//! weight 3, and the `max-score-picker`). The queue scorer maps the engine's waiting queue to
//! (max − q) / (max − min) over the candidates (1 when all are equal); the KV scorer is
//! 1 − KV usage; the prefix scorer is the share of the prompt's 64-character blocks that the
//! endpoint is believed to hold, from an LRU of blocks of prompts routed to it. Metrics come
//! only from scrapes, as in the extension. Ties at random.

use rand::rngs::SmallRng;
use rand::Rng;

use super::routed_prefixes::RoutedPrefixes;
use super::{Policy, PolicyTraits, ScoringContext, TieBreak};
use crate::config::GieConfig;
use crate::decision::Candidate;
use crate::fleet::Instance;
use crate::fleet::Slot;

/// The GIE-style weighted-scorer policy with its own prefix LRU.
pub struct Gie {
    config: GieConfig,
    prefix: RoutedPrefixes,
}

impl Gie {
    /// With the given weights.
    pub fn new(config: GieConfig) -> Self {
        let prefix = RoutedPrefixes::new(config.block_chars, config.lru_capacity_per_server);
        Gie { config, prefix }
    }
}

impl Policy for Gie {
    fn traits(&self) -> &'static PolicyTraits {
        const TRAITS: PolicyTraits = PolicyTraits {
            name: "gie",
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
        rng: &mut SmallRng,
    ) {
        score_weighted(&self.config, &mut self.prefix, ctx, candidates, rng, |_| {
            0.0
        });
    }

    fn memo(&mut self) -> Vec<u64> {
        self.prefix.take_hashes()
    }

    fn on_routed(&mut self, slot: Slot, memo: &[u64]) {
        self.prefix.record(slot, memo);
    }

    fn forget_instance(&mut self, slot: Slot) {
        self.prefix.forget(slot);
    }
}

/// The extension's weighted scorers (queue, KV, prefix) plus `extra` per instance, then the
/// max-score picker (uniform among the top scores); the prompt is recorded once routed.
pub(super) fn score_weighted(
    config: &GieConfig,
    prefix: &mut RoutedPrefixes,
    ctx: &ScoringContext<'_>,
    candidates: &mut [Candidate],
    rng: &mut SmallRng,
    extra: impl Fn(&Instance) -> f64,
) {
    if candidates.is_empty() {
        return;
    }
    let stale = ctx.config.estimates.metrics_stale_after_s;
    prefix.hash(ctx);
    prefix.lookup(ctx);
    let metrics: Vec<(f64, f64)> = candidates
        .iter()
        .map(|c| {
            ctx.instance(c)
                .fresh_metrics(ctx.now, stale)
                .map_or((0.0, 0.0), |m| {
                    (f64::from(m.waiting), m.kv_usage.unwrap_or(0.0))
                })
        })
        .collect();
    let max_q = metrics.iter().map(|m| m.0).fold(f64::MIN, f64::max);
    let min_q = metrics.iter().map(|m| m.0).fold(f64::MAX, f64::min);
    let total_blocks = prefix.prompt_blocks().max(1) as f64;
    let mut best = f64::MIN;
    for (c, (queue, kv)) in candidates.iter_mut().zip(&metrics) {
        let queue_score = if max_q > min_q {
            (max_q - queue) / (max_q - min_q)
        } else {
            1.0
        };
        let kv_score = 1.0 - kv.clamp(0.0, 1.0);
        let held = prefix.depth(c.instance.slot);
        let prefix_score = f64::from(held) / total_blocks;
        let total = config.queue_weight * queue_score
            + config.kv_cache_weight * kv_score
            + config.prefix_weight * prefix_score
            + extra(ctx.instance(c));
        c.terms.matched_blocks = held;
        c.score = -total;
        best = best.max(total);
    }
    let top: Vec<usize> = (0..candidates.len())
        .filter(|&i| -candidates[i].score >= best)
        .collect();
    let pick = top[rng.random_range(0..top.len())];
    candidates[pick].score -= 1e-9;
}
