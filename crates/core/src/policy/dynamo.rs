//! Modelled on NVIDIA Dynamo's KV router as its documentation describes it ("Routing Concepts",
//! docs.nvidia.com/dynamo, KV Router cost calculation): `cost = overlap_score_weight ×
//! prefill_blocks + decode_blocks`, where prefill blocks are the prompt work already assigned
//! to the worker plus the request's uncached blocks, and decode blocks are the worker's active
//! blocks plus the request's; the lowest cost wins, deterministically at temperature 0 (ties at
//! random). Overlap comes from the shared approximate index (Dynamo's `--no-kv-events` mode).

use rand::rngs::SmallRng;

use super::{Policy, PolicyTraits, ScoringContext, TieBreak};
use crate::config::DynamoConfig;
use crate::decision::Candidate;

/// The Dynamo-style overlap-plus-load policy.
pub struct DynamoKv {
    config: DynamoConfig,
}

impl DynamoKv {
    /// With the given weights.
    pub fn new(config: DynamoConfig) -> Self {
        DynamoKv { config }
    }
}

impl Policy for DynamoKv {
    fn traits(&self) -> &'static PolicyTraits {
        const TRAITS: PolicyTraits = PolicyTraits {
            name: "dynamo-kv",
            uses_prefix_index: true,
            tie_break: TieBreak::Exact,
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
        let block = f64::from(self.config.block_tokens);
        for c in candidates.iter_mut() {
            let load = &ctx.instance(c).load;
            let prefill_blocks =
                (load.pending_tokens as f64 + f64::from(c.terms.uncached_tokens)) / block;
            let decode_blocks =
                (load.kv_tokens(ctx.output_share) as f64 + f64::from(ctx.prompt_tokens)) / block;
            c.score = self.config.overlap_score_weight * prefill_blocks + decode_blocks;
        }
    }
}
