//! Routing policies: the default `cost` policy and the baselines it is measured against.
//!
//! Every policy sees the same candidates (already filtered for health, role and adapter) with
//! the shared prefix index's matches filled in, and gives each a score, lower is better. The
//! router then ranks by score with the policy's tie-break rule.

use rand::rngs::SmallRng;

use crate::config::RouterConfig;
use crate::decision::Candidate;
use crate::fleet::{Fleet, Instance};
use crate::prefix::Slot;
use crate::request::RouteRequest;

mod baselines;
pub(crate) mod cost;
mod dynamo;
mod gie;
mod gie_lora;
mod kubeai;
mod routed_prefixes;
mod sglang;

pub use cost::{decode_terms, prefill_terms};

/// Names accepted by [`by_name`], the default first.
pub const POLICY_NAMES: &[&str] = &[
    "cost",
    "round-robin",
    "random",
    "least-load",
    "power-of-two",
    "sglang-cache-aware",
    "dynamo-kv",
    "gie",
    "gie-lora",
    "kubeai-chwbl",
];

/// Which half of a request is being placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Prefill and decode on one instance.
    Unified,
    /// The prefill half of a disaggregated request.
    Prefill,
    /// The decode half of a disaggregated request.
    Decode,
}

/// Everything a policy may read while scoring.
pub struct ScoringContext<'a> {
    /// Current time in seconds.
    pub now: f64,
    /// The request.
    pub request: &'a RouteRequest<'a>,
    /// The fleet.
    pub fleet: &'a Fleet,
    /// Settings.
    pub config: &'a RouterConfig,
    /// Estimated prompt tokens.
    pub prompt_tokens: u32,
    /// Learned bytes of prompt per token.
    pub bytes_per_token: f64,
    /// Which half is being placed.
    pub stage: Stage,
    /// Median learned prefill speed of the model's pool (its first instances; 0: unknown), the
    /// reference that tells noise from a real difference between instances.
    pub pool_speed: f64,
}

impl ScoringContext<'_> {
    /// The instance behind a candidate. Candidates are built from current instances only.
    pub fn instance(&self, candidate: &Candidate) -> &Instance {
        // Invariant: the router builds candidates from the fleet just before scoring.
        self.fleet
            .get(candidate.instance)
            .expect("candidate of a current instance")
    }
}

/// How equal scores are ordered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TieBreak {
    /// Pick uniformly among candidates within `relative` × best + `absolute` of the best.
    Near {
        /// Relative tolerance.
        relative: f64,
        /// Absolute tolerance.
        absolute: f64,
    },
    /// Pick uniformly among exactly equal scores.
    Exact,
    /// Keep candidate order (the fleet's order): the first wins.
    First,
}

/// A routing policy.
pub trait Policy: Send {
    /// The name it is selected by.
    fn name(&self) -> &'static str;

    /// Whether candidates need the shared prefix index's matches (skipped otherwise).
    fn uses_prefix_index(&self) -> bool;

    /// How equal scores are ordered.
    fn tie_break(&self) -> TieBreak;

    /// Scores the candidates of one request (lower is better) and may exclude some.
    fn score(&mut self, ctx: &ScoringContext<'_>, candidates: &mut [Candidate], rng: &mut SmallRng);

    /// Scores decode candidates of a disaggregated request; by default least in-flight first,
    /// which is what routers without a decode model do.
    fn score_decode(
        &mut self,
        ctx: &ScoringContext<'_>,
        candidates: &mut [Candidate],
        _rng: &mut SmallRng,
    ) {
        for c in candidates.iter_mut() {
            c.score = f64::from(ctx.instance(c).load.in_flight());
        }
    }

    /// Whether the policy prices running a request whole on a decode instance against the
    /// prefill/decode hand-off (selective disaggregation); routers that always split do not.
    fn prices_local_prefill(&self) -> bool {
        false
    }

    /// Whether the policy may be given a shortlist of a large pool (prefix holders plus the
    /// least loaded) instead of every instance; policies that sample or cycle over the whole
    /// pool may not.
    fn scores_shortlist(&self) -> bool {
        false
    }

    /// Drops whatever the policy keeps about an instance that left.
    fn forget_instance(&mut self, _slot: Slot) {}
}

/// Builds the policy called `name` from the settings.
pub fn by_name(name: &str, config: &RouterConfig) -> Option<Box<dyn Policy>> {
    Some(match name {
        "cost" => Box::new(cost::CostPolicy),
        "round-robin" => Box::new(baselines::RoundRobin::default()),
        "random" => Box::new(baselines::Random),
        "least-load" => Box::new(baselines::LeastLoad),
        "power-of-two" => Box::new(baselines::PowerOfTwo),
        "sglang-cache-aware" => Box::new(sglang::SglangCacheAware::new(config.sglang.clone())),
        "dynamo-kv" => Box::new(dynamo::DynamoKv::new(config.dynamo.clone())),
        "gie" => Box::new(gie::Gie::new(config.gie.clone())),
        "gie-lora" => Box::new(gie_lora::GieLora::new(config.gie.clone())),
        "kubeai-chwbl" => Box::new(kubeai::KubeAiChwbl::new(config.kubeai.clone())),
        _ => return None,
    })
}

/// Sets the pick's score to 0 and orders the rest by load after it: for policies that choose
/// one instance by rule rather than by a score (the rest is the retry order).
pub(crate) fn pick_then_by_load(
    ctx: &ScoringContext<'_>,
    candidates: &mut [Candidate],
    pick: usize,
) {
    for (i, c) in candidates.iter_mut().enumerate() {
        c.score = if i == pick {
            0.0
        } else {
            1.0 + f64::from(ctx.instance(c).load.in_flight())
        };
    }
}
