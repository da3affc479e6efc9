//! Routing policies: the default `cost` policy and the baselines it is measured against.
//!
//! Every policy sees the same candidates (already filtered for health, role and adapter) with
//! the shared prefix index's matches filled in, and gives each a score, lower is better. The
//! router then ranks by score with the policy's tie-break rule.

use rand::rngs::SmallRng;

use crate::config::RouterConfig;
use crate::decision::Candidate;
use crate::fleet::Slot;
use crate::fleet::{Fleet, Instance};
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

pub use crate::config::POLICY_NAMES;

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
    /// How much of its `max_tokens` an answer uses ([`crate::Router::output_share`]).
    pub output_share: f64,
    /// Which half is being placed.
    pub stage: Stage,
    /// Median learned prefill speed of the model's pool (its first instances; 0: unknown), the
    /// reference that tells noise from a real difference between instances.
    pub pool_speed: f64,
    /// Median short-prompt speed of the same pool (0: unknown): what an instance without a full
    /// speed sample is compared against.
    pub pool_short_speed: f64,
    /// Median trusted decode slope of the same pool (s per decoding sequence per step; 0:
    /// none trusted): what an instance's own slope is compared against.
    pub pool_decode_slope_s: f64,
    /// Seconds an adapter load takes: learned from the first tokens of requests that loaded
    /// one, `cost.adapter_load_s` until the first.
    pub adapter_load_s: f64,
    /// Median learned share of its speed an instance of the same pool loses per busy
    /// neighbour ([`crate::shared_compute`]; 0 on separate devices).
    pub pool_shared_share: f64,
    /// Requests of the same pool waiting for a first token (sent by this router).
    pub pool_waiting: u32,
    /// What the prefill a candidate adds beyond the cheapest candidate's is priced at, per
    /// estimated second ([`crate::calibration`]; 1: face value).
    pub prefill_factor: f64,
}

impl ScoringContext<'_> {
    /// The answer the request will probably hold in KV: its `max_tokens` at the measured share.
    pub fn expected_answer_tokens(&self) -> f64 {
        f64::from(self.request.max_tokens) * self.output_share
    }

    /// The instance behind a candidate. Candidates are built from current instances only.
    pub fn instance(&self, candidate: &Candidate) -> &Instance {
        // Invariant: the router builds candidates from the fleet just before scoring.
        self.fleet
            .get(candidate.instance)
            .expect("candidate of a current instance")
    }
}

/// How equal (or nearly equal) scores are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TieBreak {
    /// Candidates within `cost.tie_relative` × best + `cost.tie_absolute_s` of the best are
    /// tied: those expected to hold most of the prompt first (when the match is a full index
    /// block or half of a short prompt), at random among them. The scores themselves are kept,
    /// so the explanation shows each candidate's own estimate.
    Near,
    /// Pick uniformly among exactly equal scores.
    Exact,
    /// Keep candidate order (the fleet's order): the first wins.
    First,
}

/// What a policy is, fixed for its life: one description instead of a method per capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyTraits {
    /// The name it is selected by.
    pub name: &'static str,
    /// Whether candidates need the shared prefix index's matches (skipped otherwise).
    pub uses_prefix_index: bool,
    /// How equal scores are ordered.
    pub tie_break: TieBreak,
    /// Whether the policy prices running a request whole on a decode instance against the
    /// prefill/decode hand-off (selective disaggregation); routers that always split do not.
    pub prices_local_prefill: bool,
    /// Whether the policy may be given a shortlist of a large pool (prefix holders plus the
    /// least loaded) instead of every instance; policies that sample or cycle over the whole
    /// pool may not.
    pub scores_shortlist: bool,
}

/// A routing policy.
pub trait Policy: Send {
    /// What the policy is.
    fn traits(&self) -> &'static PolicyTraits;

    /// Scores the candidates of one request (lower is better) and may exclude some. Scoring
    /// must not change what the policy remembers: a dry run or a retry scores too.
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

    /// What the last [`Policy::score`] computed about the request that [`Policy::on_routed`]
    /// needs (e.g. the prompt's block hashes as the policy keys them); carried by the plan.
    fn memo(&mut self) -> Vec<u64> {
        Vec::new()
    }

    /// The request scored with `memo` was sent to `slot`: what a policy that remembers its
    /// picks records (as the SGLang and GIE routers record the prefixes they sent).
    fn on_routed(&mut self, _slot: Slot, _memo: &[u64]) {}

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
