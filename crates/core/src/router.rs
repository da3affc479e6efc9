//! The routing brain: `route(request, now) -> Decision` and `observe(observation, now)`.

use std::collections::BTreeSet;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rustc_hash::FxHashMap;
use thiserror::Error;

use crate::calibration::{PredictionChoice, TtftCalibration};
use crate::config::{ConfigError, RouterConfig};
use crate::decision::{Candidate, CostTerms, Decision, Exclusion, RoutePlan, ViewPredictions};
use crate::exact::{ExactChain, ExactIndex};
use crate::fleet::{
    EngineMetrics, Fleet, Health, Instance, InstanceId, InstanceSpec, Learned, Role,
};
use crate::ladder::LoadLadder;
use crate::observe::{Observation, ObserveError, Prediction, Usage};
use crate::policy::{self, Policy, ScoringContext, Stage, TieBreak};
use crate::prefix::{
    chain_seed, tapered_depth, tapered_end, tapered_prompt_block_hashes, BlockMatch, PrefixIndex,
    Slot, LEADING_SPLITS,
};
use crate::request::{Phase, RequestId, RequestKind, RouteRequest};
use crate::running_median::RunningMedian;
use crate::shared_compute::BusyInstances;

/// Why a request could not be routed at all.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RouteError {
    /// No instance serves this model.
    #[error("no instance serves model `{0}`")]
    UnknownModel(String),
}

/// A prompt made ready for routing: its block hashes, the part of a route that reads every
/// byte of the prompt. Computed by [`prepare`] without the router, so a driver hashes outside
/// its lock, and once per request however often the request is routed (retries, the queue).
#[derive(Debug, Clone, Default)]
pub struct PreparedPrompt {
    /// Chain seed (model, adapter, cache salt) the hashes were made with.
    seed: u64,
    /// Index block size they were made with (0: not hashed).
    block_bytes: usize,
    /// Chained block hashes, shared with the decision and its plans.
    hashes: Arc<[u64]>,
    /// The prompt's token ids, when the driver tokenized it (used when the request has none):
    /// all of them, or the first ones when `token_count` says how many there are in all.
    token_ids: Option<Arc<[u32]>>,
    /// Bytes of the prompt's text past its first token ids, when `token_ids` holds only those
    /// (the driver stopped where [`Router::exact_horizon`] said the rest cannot match): their
    /// tokens are estimated at the router's learned bytes per token.
    untokenized_bytes: Option<usize>,
    /// The token ids hashed in the pool's exact block size by the driver, outside the lock.
    exact_chain: Option<Arc<ExactChain>>,
}

impl PreparedPrompt {
    /// Adds the prompt's token ids, from a tokenizer the driver ran outside the lock: exact
    /// matching against instances that publish KV events then works for text prompts too.
    pub fn with_token_ids(mut self, ids: Vec<u32>) -> Self {
        self.token_ids = (!ids.is_empty()).then(|| ids.into());
        self
    }

    /// Adds the prompt's first token ids and how many bytes of its text follow them: what a
    /// driver has when it tokenized only as far as [`Router::exact_horizon`] asked. The exact
    /// match is the same as with every id; the rest of the prompt's length is estimated.
    pub fn with_token_prefix(mut self, ids: Vec<u32>, untokenized_bytes: usize) -> Self {
        self.token_ids = (!ids.is_empty()).then(|| ids.into());
        self.untokenized_bytes = Some(untokenized_bytes);
        self
    }

    /// The token ids added with [`PreparedPrompt::with_token_ids`] or
    /// [`PreparedPrompt::with_token_prefix`].
    pub fn token_ids(&self) -> Option<&[u32]> {
        self.token_ids.as_deref()
    }

    /// Adds the token ids hashed in the exact index's blocks ([`Router::exact_block_tokens`]),
    /// so that a route walks the index without hashing them under the lock. Ignored where it
    /// is not the chain of the request's ids.
    pub fn with_exact_chain(mut self, chain: ExactChain) -> Self {
        self.exact_chain = Some(Arc::new(chain));
        self
    }

    /// Whether the token ids are only the prompt's first ones.
    pub fn token_ids_are_a_prefix(&self) -> bool {
        self.untokenized_bytes.is_some()
    }

    fn fits(&self, request: &RouteRequest<'_>, block_bytes: usize) -> bool {
        self.block_bytes == block_bytes
            && self.block_bytes > 0
            && self.seed == chain_seed(request.model, request.adapter, request.cache_salt)
    }
}

/// Hashes `request`'s prompt in blocks of `block_bytes` ([`Router::block_bytes`]) for
/// [`Router::route_prepared`].
pub fn prepare(request: &RouteRequest<'_>, block_bytes: usize) -> PreparedPrompt {
    let seed = chain_seed(request.model, request.adapter, request.cache_salt);
    let mut hashes = Vec::new();
    if request.kind == RequestKind::Generate {
        // Sized once (full blocks plus the tapered leading ones): growing it by doubling cost
        // five allocations for a 2k-token prompt.
        let blocks = request.prompt.rendered_len() / block_bytes.max(1);
        hashes.reserve_exact(blocks + LEADING_SPLITS as usize + 1);
        tapered_prompt_block_hashes(&request.prompt, seed, block_bytes, &mut hashes);
    }
    PreparedPrompt {
        seed,
        block_bytes,
        hashes: hashes.into(),
        token_ids: None,
        untokenized_bytes: None,
        exact_chain: None,
    }
}

/// What a request is matched on in the exact index: its token ids under its adapter.
#[derive(Debug, Clone, Copy)]
struct ExactKey<'a> {
    tokens: &'a [u32],
    adapter: Option<&'a str>,
}

/// What the router remembers about a request between `Routed` and its end.
#[derive(Debug)]
struct InFlight {
    instance: InstanceId,
    routed_at: f64,
    last_heard: f64,
    first_token_at: Option<f64>,
    prompt_bytes: usize,
    uncached_tokens: u32,
    /// Its prompt tokens and output budget, as added to the instance's KV reservation. The
    /// budget is also what its answer is measured against; 0 for a prefill leg (its engine
    /// generates one token whatever the request asked) and for a leg the router did not plan.
    kv_prompt_tokens: u64,
    kv_output_budget: u32,
    /// Prefill work (tokens) ahead of and including this request when it was routed.
    work_tokens: u64,
    /// Whether its TTFT measures a prefill here (not for the decode leg of a hand-off).
    learns_speed: bool,
    matched_blocks: u32,
    predicted_cached_tokens: u32,
    /// Both views' predictions, where there was an exact one.
    views: Option<ViewPredictions>,
    /// Touch sequence of each matched block when the request was routed.
    matched_seqs: Vec<u64>,
    /// The decision's TTFT estimate, if the policy made one ...
    estimated_ttft_s: Option<f64>,
    /// The estimate's raw wait and prefill ([`crate::calibration`]).
    raw_wait_prefill_s: (f64, f64),
    /// ... its adapter part, and whether that was a load into a free slot.
    adapter_s: f64,
    loads_adapter: bool,
    /// The instance's touch sequence when the request was routed (ages are counted from it).
    route_seq: u64,
    /// Oldest insert still awaiting its first token on the instance when this one was routed.
    pending_floor: Option<u64>,
    /// Key of this request in the instance's pending set.
    pending_key: (u64, u64),
    /// The instance's [`crate::fleet::WorkTotals`] at this request's first token.
    running_area_at_first_token: f64,
    prefilled_at_first_token: u64,
    /// The fleet's busy instance-seconds at the first token ([`BusyInstances`]).
    busy_area_at_first_token: f64,
}

/// The router: fleet view, prefix index, policy and learned estimates. Pure and single-threaded:
/// the caller serialises access and passes the time in.
pub struct Router {
    config: RouterConfig,
    fleet: Fleet,
    index: PrefixIndex,
    exact: ExactIndex,
    policy: Box<dyn Policy>,
    rng: SmallRng,
    in_flight: FxHashMap<RequestId, InFlight>,
    /// Per slot, the inserts whose requests have not produced a first token: (seq, request).
    pending_inserts: Vec<BTreeSet<(u64, u64)>>,
    bytes_per_token: f64,
    /// Moving sums of prompt bytes and reported prompt tokens: their ratio is `bytes_per_token`.
    prompt_bytes_seen: f64,
    prompt_tokens_seen: f64,
    /// Moving sums of generated tokens and of the `max_tokens` the same requests were told:
    /// their ratio turns a request's `max_tokens` into the answer it will probably produce.
    output_tokens_seen: f64,
    output_budget_seen: f64,
    observations_since_sweep: u32,
    matches: Vec<BlockMatch>,
    depth_by_slot: Vec<u32>,
    /// Healthy instances by estimated wait, for shortlisting large pools.
    ladder: LoadLadder,
    /// Reused list of the slots a request is scored on.
    slot_scratch: Vec<Slot>,
    /// Per session (hash of model and `session_id`), where its last request went.
    sessions: FxHashMap<u64, SessionMark>,
    /// Predictions against outcomes since the driver last took them (at most
    /// [`MAX_PREDICTIONS`]: a driver that never takes them loses the newest, not memory).
    predictions: Vec<Prediction>,
    /// How long an adapter load delays a first token, learned from requests that loaded one
    /// into a free slot (one figure for the fleet: loads read the same kind of files).
    adapter_load: RunningMedian,
    /// What the cost estimate's wait and prefill are worth in observed seconds.
    ttft_calibration: TtftCalibration,
    /// Which TTFT prediction is reported: face value or calibrated, by their recent errors.
    prediction_choice: PredictionChoice,
    /// How many instances are busy over time: what each answer's neighbours did meanwhile.
    busy: BusyInstances,
}

/// Most sessions remembered; past it the memory starts over (sessions are a soft signal).
pub const MAX_SESSIONS: usize = 65_536;

/// A session's last request: where it went, the instance's touch sequence after it, and its
/// rendered prompt length.
#[derive(Debug, Clone, Copy)]
struct SessionMark {
    instance: InstanceId,
    seq: u64,
    bytes: usize,
}

/// What a decision compares each instance of a model's pool against
/// ([`Router::pool_figures`]).
struct PoolFigures {
    speed: f64,
    short_speed: f64,
    decode_slope_s: f64,
    shared_share: f64,
    waiting: u32,
}

/// Most predictions kept between two [`Router::take_predictions`].
pub const MAX_PREDICTIONS: usize = 4096;

/// Instances of a model's pool whose learned speeds make its reference speed.
const POOL_SAMPLE: usize = 64;

/// Moves `current` towards `sample` by `rate`.
/// Requests waiting while the batch has room for them wait for a sequence slot, unless they
/// wait for an adapter slot or for KV space: then the batch they wait beside is the engine's
/// limit. But a request also waits between two scheduler steps, or for a step's token budget
/// (vLLM admits new requests at every step): that is no limit, and taking the batch of such a
/// moment for one priced a 256-sequence engine as a 2-slot one, which then got no requests to
/// grow its batch (seen on emulated engines). A request waiting for a slot waits until one frees,
/// about a service time: so only a batch that did not grow between two scrapes with requests
/// waiting at both is taken as full. The largest such batch is kept, and any larger batch seen
/// raises it.
fn learn_max_running(
    learned: &mut Learned,
    previous: Option<&EngineMetrics>,
    metrics: &EngineMetrics,
    kv_high_watermark: f64,
) {
    if let Some(max) = learned.max_running.filter(|&m| metrics.running > m) {
        learned.max_running = Some(metrics.running.max(max));
    }
    let waits_for_slot = |m: &EngineMetrics| {
        m.waiting > 0
            && m.running > 0
            && m.waiting_adapters.is_empty()
            && m.kv_usage.is_none_or(|u| u < kv_high_watermark)
    };
    let full_across_scrapes =
        previous.is_some_and(|p| waits_for_slot(p) && p.running >= metrics.running);
    if waits_for_slot(metrics) && full_across_scrapes {
        learned.max_running = Some(learned.max_running.unwrap_or(0).max(metrics.running));
    }
}

/// Answers shorter than this give no decode sample: their few gaps are mostly one step's phase.
const MIN_DECODE_SAMPLE_TOKENS: u32 = 8;

/// One finished answer's time per token against the batch it decoded in
/// ([`crate::decode_slope`]).
fn learn_decode_slope(
    instance: Option<&mut Instance>,
    record: &InFlight,
    first_token_at: f64,
    completion_tokens: u32,
    rate: f64,
    busy_area_now: f64,
    now: f64,
) {
    let Some(instance) = instance else { return };
    let decode_s = now - first_token_at;
    if completion_tokens < MIN_DECODE_SAMPLE_TOKENS || decode_s <= 0.0 {
        return;
    }
    // The area was counted at this request's end, before its own sequence left.
    let totals = &instance.totals;
    let batch = (totals.running_area_s - record.running_area_at_first_token) / decode_s;
    let gaps = f64::from(completion_tokens - 1);
    let per_token_s = decode_s / gaps;
    let prefilled = totals.prefilled_tokens - record.prefilled_at_first_token;
    let prefill_per_token = prefilled as f64 / gaps;
    instance
        .learned
        .decode_slope
        .observe(batch, prefill_per_token, per_token_s, rate);
    // The instance itself was busy throughout its answer.
    let neighbours = ((busy_area_now - record.busy_area_at_first_token) / decode_s - 1.0).max(0.0);
    instance.learned.shared_compute.observe(
        batch,
        prefill_per_token,
        neighbours,
        per_token_s,
        rate,
    );
}

fn ewma(current: f64, sample: f64, rate: f64) -> f64 {
    current + rate * (sample - current)
}

/// A moving average that starts as the plain mean of its first samples (`samples` taken so far)
/// until it has seen its window: a prior far from the engine's figure (a 10 s service time for a
/// model that answers in 50 ms) would otherwise steer the first hundred decisions.
/// The (upper) median of `values`, reordering them; 0 for none.
fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mid = values.len() / 2;
    *values.select_nth_unstable_by(mid, f64::total_cmp).1
}

fn warm_ewma(current: f64, sample: f64, rate: f64, samples: u32) -> f64 {
    ewma(current, sample, rate.max(1.0 / (f64::from(samples) + 1.0)))
}

impl Router {
    /// A router with the given settings and an empty fleet.
    pub fn new(config: RouterConfig) -> Result<Router, ConfigError> {
        config.validate()?;
        let policy = policy::by_name(&config.policy, &config).ok_or_else(|| ConfigError {
            key: "policy",
            reason: format!("unknown policy `{}`", config.policy),
        })?;
        Ok(Router {
            rng: SmallRng::seed_from_u64(config.seed),
            bytes_per_token: config.estimates.bytes_per_token,
            // The prior weighs as one token: the first real reports replace it.
            prompt_bytes_seen: config.estimates.bytes_per_token,
            prompt_tokens_seen: 1.0,
            // Equal priors: until answers are measured a request is expected to use its budget.
            output_tokens_seen: 1.0,
            output_budget_seen: 1.0,
            adapter_load: RunningMedian::new(config.cost.adapter_load_s),
            ttft_calibration: TtftCalibration::default(),
            prediction_choice: PredictionChoice::default(),
            busy: BusyInstances::default(),
            config,
            fleet: Fleet::default(),
            index: PrefixIndex::new(),
            exact: ExactIndex::default(),
            policy,
            in_flight: FxHashMap::default(),
            pending_inserts: Vec::new(),
            observations_since_sweep: 0,
            matches: Vec::new(),
            depth_by_slot: Vec::new(),
            ladder: LoadLadder::default(),
            slot_scratch: Vec::new(),
            predictions: Vec::new(),
            sessions: FxHashMap::default(),
        })
    }

    /// Settings in force.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The fleet view.
    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// The approximate prefix index.
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// Whether requests with token ids are matched exactly on this instance: it publishes KV
    /// events and its stream is trusted.
    pub fn is_exact(&self, id: InstanceId) -> bool {
        self.fleet.get(id).is_some() && self.exact.is_exact(id.slot)
    }

    /// How many leading token ids of a prompt for `model` (on `adapter`, with `cache_salt`)
    /// the exact match could still use, given its first `tokens`: a driver that tokenizes
    /// prompts (it has no ids from the client) stops once it has this many, so a new prompt
    /// costs the tokenizing of the blocks that could be cached, not of the whole text. 0 when
    /// nothing is matched exactly (no instance of the model publishes trusted KV events, the
    /// policy reads no prefix index, or a cache salt keeps the request off the engines'
    /// blocks).
    pub fn exact_horizon(
        &mut self,
        model: &str,
        adapter: Option<&str>,
        cache_salt: Option<&str>,
        tokens: &[u32],
        hashed: Option<&ExactChain>,
    ) -> usize {
        if cache_salt.is_some() || !self.policy.traits().uses_prefix_index {
            return 0;
        }
        let slots = self.fleet.serving(model);
        self.exact
            .horizon(slots.iter().copied(), tokens, adapter, hashed)
    }

    /// The block size of `model`'s instances that publish trusted KV events, when they share
    /// one: a driver hashes a prompt's ids in it outside the lock ([`ExactChain`]).
    pub fn exact_block_tokens(&self, model: &str) -> Option<u32> {
        self.exact
            .block_tokens(self.fleet.serving(model).iter().copied())
    }

    /// Bytes of `prepared`'s prompt the approximate index says some instance holds (its
    /// deepest match): a driver that tokenizes as far as [`Router::exact_horizon`] asks sizes
    /// its first cut by it, so a conversation this router placed is tokenized in one pass
    /// (the exact view is what the horizon reads; this is only where to look first).
    pub fn approx_held_bytes(&mut self, prepared: &PreparedPrompt) -> usize {
        let block_bytes = self.block_bytes();
        if prepared.block_bytes != block_bytes || prepared.hashes.is_empty() {
            return 0;
        }
        self.index.lookup(&prepared.hashes, &mut self.matches);
        self.matches
            .iter()
            .map(|m| tapered_end(m.blocks, block_bytes))
            .max()
            .unwrap_or(0)
    }

    /// Name of the policy in force.
    pub fn policy_name(&self) -> &'static str {
        self.policy.traits().name
    }

    /// Learned bytes of prompt text per token.
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_per_token
    }

    /// What the `cost` policy prices an estimated second of prefill at: learned from first
    /// tokens where `cost.calibrate_prefill` is set and the fit is trusted
    /// ([`crate::calibration`]), else 1.
    pub fn prefill_factor(&self) -> f64 {
        if self.config.cost.calibrate_prefill {
            self.ttft_calibration.scale.prefill
        } else {
            1.0
        }
    }

    /// Which TTFT prediction the router reports, and both predictions' recent errors.
    pub fn prediction_choice(&self) -> &PredictionChoice {
        &self.prediction_choice
    }

    /// The fit of observed first tokens against the estimate's wait and prefill (for the fleet
    /// view: how far a user can trust the estimate, and which part misses).
    pub fn ttft_calibration(&self) -> &TtftCalibration {
        &self.ttft_calibration
    }

    /// Seconds an adapter load is priced at: learned once a request has loaded one, the
    /// configured `cost.adapter_load_s` until then.
    pub fn adapter_load_s(&self) -> f64 {
        if self.adapter_load.samples > 0 {
            self.adapter_load.value.max(0.0)
        } else {
            self.config.cost.adapter_load_s
        }
    }

    /// Moves the predictions recorded since the last call into `out` (appended).
    pub fn take_predictions(&mut self, out: &mut Vec<Prediction>) {
        out.append(&mut self.predictions);
    }

    fn record_prediction(&mut self, p: Prediction) {
        if self.predictions.len() < MAX_PREDICTIONS {
            self.predictions.push(p);
        }
    }

    /// Requests the router believes are in flight.
    pub fn in_flight_len(&self) -> usize {
        self.in_flight.len()
    }

    /// Switches policy at runtime (the fleet view and learned estimates are kept).
    pub fn set_policy(&mut self, name: &str) -> Result<(), ConfigError> {
        let policy = policy::by_name(name, &self.config).ok_or_else(|| ConfigError {
            key: "policy",
            reason: format!(
                "unknown policy `{name}`; choose one of {}",
                policy::POLICY_NAMES.join(", ")
            ),
        })?;
        self.config.policy = name.to_string();
        self.policy = policy;
        Ok(())
    }

    fn priors(&self, spec: &InstanceSpec) -> Learned {
        let e = &self.config.estimates;
        Learned {
            prefill_tokens_per_s: spec.prefill_tokens_per_s.unwrap_or(e.prefill_tokens_per_s),
            service_time_s: e.service_time_s,
            service_samples: 0,
            cache_trust: 1.0,
            mean_uncached_tokens: 1000.0,
            survival: Default::default(),
            hit_share: 0.0,
            cache_unit_tokens: 0,
            exact_error: 0.0,
            approx_error: 0.0,
            view_samples: 0,
            speed_samples: 0,
            max_running: None,
            slot_pressure: Default::default(),
            short_speed: spec.prefill_tokens_per_s.unwrap_or(e.prefill_tokens_per_s),
            short_samples: 0,
            decode_slope: Default::default(),
            shared_compute: Default::default(),
            ttft_fixed_s: RunningMedian::new(e.ttft_overhead_s),
            ttft_fixed_calibrated_s: RunningMedian::new(e.ttft_overhead_s),
        }
    }

    /// Blocks the index may hold for an instance, by configuration or the engine's report.
    fn index_capacity(&self, instance: &Instance) -> u32 {
        match instance.kv_capacity_tokens() {
            Some(tokens) => {
                let bytes = tokens as f64 * self.bytes_per_token;
                (bytes / self.config.index.block_bytes as f64)
                    .ceil()
                    .min(f64::from(u32::MAX)) as u32
            }
            None => self.config.index.default_capacity_blocks,
        }
    }

    /// The index's block size: what [`prepare`] needs to hash a prompt for this router.
    pub fn block_bytes(&self) -> usize {
        self.config.index.block_bytes
    }

    /// Routes one request: candidates ranked best first, with the reasons. Hashes the prompt
    /// itself; a driver that holds the router behind a lock calls [`prepare`] before taking it
    /// and [`Router::route_prepared`] under it.
    pub fn route(&mut self, request: &RouteRequest<'_>, now: f64) -> Result<Decision, RouteError> {
        let prepared = if self.uses_index(request) {
            prepare(request, self.block_bytes())
        } else {
            PreparedPrompt::default()
        };
        self.route_prepared(request, &prepared, now)
    }

    fn uses_index(&self, request: &RouteRequest<'_>) -> bool {
        request.kind == RequestKind::Generate && self.policy.traits().uses_prefix_index
    }

    /// Routes a request whose prompt was hashed by [`prepare`] (re-hashed here only if it was
    /// prepared for another model, adapter, salt or block size).
    pub fn route_prepared(
        &mut self,
        request: &RouteRequest<'_>,
        prepared: &PreparedPrompt,
        now: f64,
    ) -> Result<Decision, RouteError> {
        // Token ids the driver's tokenizer found, when the request itself carries none.
        let with_ids;
        let request = match (request.token_ids, prepared.token_ids()) {
            (None, Some(ids)) => {
                with_ids = RouteRequest {
                    token_ids: Some(ids),
                    ..*request
                };
                &with_ids
            }
            _ => request,
        };
        let pool_len = self.fleet.serving(request.model).len();
        if pool_len == 0 {
            return Err(RouteError::UnknownModel(request.model.to_string()));
        }
        let uses_index = self.uses_index(request);
        let fresh;
        let prepared = if !uses_index || prepared.fits(request, self.block_bytes()) {
            prepared
        } else {
            fresh = prepare(request, self.block_bytes());
            &fresh
        };
        // Cheap: a sum of piece lengths.
        let prompt_bytes = request.prompt.rendered_len();
        // Token ids, when the request carries them, count exactly; the driver's estimate when
        // it tokenized only the first ones; else the bytes estimate.
        let by_bytes = |bytes: usize| (bytes as f64 / self.bytes_per_token).ceil() as u32;
        let prompt_tokens = match (request.token_ids, prepared.untokenized_bytes) {
            (Some(ids), None) if !ids.is_empty() => u32::try_from(ids.len()).unwrap_or(u32::MAX),
            (Some(ids), Some(rest)) if prepared.token_ids() == Some(ids) => {
                u32::try_from(ids.len())
                    .unwrap_or(u32::MAX)
                    .saturating_add(by_bytes(rest))
            }
            _ => by_bytes(prompt_bytes).max(1),
        };
        let generates = request.kind == RequestKind::Generate;
        let hashes: &[u64] = if uses_index { &prepared.hashes } else { &[] };

        // The prompt's holders first: a shortlist is built around them.
        if uses_index {
            self.lookup_depths(hashes);
        }
        let shortlist_len = self.config.cost.shortlist_len;
        let mut slots = std::mem::take(&mut self.slot_scratch);
        slots.clear();
        // Adapter requests are scored on the whole pool: the ladder does not know residency.
        if uses_index
            && shortlist_len > 0
            && pool_len > 2 * shortlist_len
            && request.adapter.is_none()
            && self.policy.traits().scores_shortlist
        {
            self.shortlist(request.model, shortlist_len, &mut slots);
        } else {
            slots.extend_from_slice(self.fleet.serving(request.model));
        }

        // Which instances may take the request, and in which role.
        let mut unified = Vec::with_capacity(slots.len());
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        let mut excluded = Vec::new();
        for &slot in &slots {
            let Some(instance) = self.fleet.by_slot(slot) else {
                continue;
            };
            let candidate = |excluded| Candidate {
                instance: instance.id,
                score: f64::INFINITY,
                terms: CostTerms::default(),
                excluded,
                tie: u64::from(slot),
                key: f64::INFINITY,
                tie_load: 0,
            };
            let reason = match instance.health {
                Health::Unhealthy => Some(Exclusion::Unhealthy),
                Health::Draining => Some(Exclusion::Draining),
                Health::Healthy => match request.adapter {
                    Some(adapter) if !instance.can_serve_adapter(adapter) => {
                        Some(Exclusion::AdapterUnavailable)
                    }
                    _ => self.saturation(instance, now),
                },
            };
            if reason.is_some() {
                excluded.push(candidate(reason));
                continue;
            }
            match instance.spec.role {
                crate::fleet::Role::Both => unified.push(candidate(None)),
                crate::fleet::Role::Prefill => prefill.push(candidate(None)),
                crate::fleet::Role::Decode => decode.push(candidate(None)),
            }
        }
        self.slot_scratch = slots;
        let saturated = unified.is_empty()
            && (prefill.is_empty() || decode.is_empty())
            && excluded
                .iter()
                .any(|c| c.excluded == Some(Exclusion::Saturated));
        // Split only when there is no instance that does both and the pool has both halves.
        let disaggregate = generates
            && request.phase == Phase::Any
            && unified.is_empty()
            && !prefill.is_empty()
            && !decode.is_empty();
        // A request that must run whole (`Phase::Unified`) in a pool of prefill and decode
        // instances runs on a decode instance, as selective disaggregation does.
        let whole_on_decode = generates
            && request.phase == Phase::Unified
            && unified.is_empty()
            && !decode.is_empty();
        let (mut candidates, mut decode_candidates) = if disaggregate {
            (prefill, decode)
        } else if whole_on_decode {
            for c in prefill {
                excluded.push(Candidate {
                    excluded: Some(Exclusion::WrongRole),
                    ..c
                });
            }
            (decode, Vec::new())
        } else {
            for c in prefill.into_iter().chain(decode) {
                excluded.push(Candidate {
                    excluded: Some(Exclusion::WrongRole),
                    ..c
                });
            }
            (unified, Vec::new())
        };

        // Selective disaggregation: the decode instances are also scored as if they ran the
        // request whole, and the cheaper of that and the hand-off wins.
        let local_max = self.config.cost.local_prefill_max_tokens;
        let mut local =
            if disaggregate && local_max > 0 && self.policy.traits().prices_local_prefill {
                decode_candidates.clone()
            } else {
                Vec::new()
            };

        let session = request
            .session_id
            .map(|id| chain_seed(request.model, None, Some(id)));
        let mark = session.and_then(|h| self.sessions.get(&h).copied());
        if uses_index {
            // Engines' events carry no cache salt, so a salted request is never matched
            // exactly (its blocks are not the unsalted ones the events describe).
            let exact = request
                .token_ids
                .filter(|_| request.cache_salt.is_none())
                .map(|tokens| ExactKey {
                    tokens,
                    adapter: request.adapter,
                });
            if let Some(key) = exact {
                // Once for every candidate list below: the O(prompt) hashing and walk.
                let slots = self.fleet.serving(request.model);
                let hashed = prepared.exact_chain.as_deref();
                self.exact
                    .look_up(slots.iter().copied(), key.tokens, key.adapter, hashed);
            }
            self.apply_matches(hashes, &mut candidates, prompt_tokens, exact, mark);
            self.apply_matches(hashes, &mut decode_candidates, prompt_tokens, exact, mark);
            self.apply_matches(hashes, &mut local, prompt_tokens, exact, mark);
        } else {
            for c in candidates.iter_mut().chain(local.iter_mut()) {
                c.terms.uncached_tokens = prompt_tokens;
            }
        }
        let mut too_long = Vec::new();
        if !local.is_empty() {
            let (fit, over): (Vec<_>, Vec<_>) = local
                .into_iter()
                .partition(|c| c.terms.uncached_tokens <= local_max);
            local = fit;
            too_long = over;
        }

        let stage = if disaggregate {
            Stage::Prefill
        } else {
            Stage::Unified
        };
        let pool = self.pool_figures(request.model);
        let ctx = ScoringContext {
            now,
            request,
            fleet: &self.fleet,
            config: &self.config,
            prompt_tokens,
            bytes_per_token: self.bytes_per_token,
            output_share: self.output_share(),
            stage,
            pool_speed: pool.speed,
            pool_short_speed: pool.short_speed,
            pool_decode_slope_s: pool.decode_slope_s,
            adapter_load_s: self.adapter_load_s(),
            pool_shared_share: pool.shared_share,
            pool_waiting: pool.waiting,
            prefill_factor: self.prefill_factor(),
        };
        self.policy.score(&ctx, &mut candidates, &mut self.rng);
        let memo = self.policy.memo();
        if disaggregate {
            let decode_ctx = ScoringContext {
                stage: Stage::Decode,
                ..ctx
            };
            self.policy
                .score_decode(&decode_ctx, &mut decode_candidates, &mut self.rng);
        }
        if !local.is_empty() {
            let local_ctx = ScoringContext {
                stage: Stage::Unified,
                ..ctx
            };
            self.policy.score(&local_ctx, &mut local, &mut self.rng);
            // A hand-off pays a second engine's scheduling and the transfer's set-up on top of
            // the priced terms: without it a prompt of a few hundred tokens would be split to
            // save a millisecond of prefill.
            let split = best_score(&candidates)
                + best_score(&decode_candidates)
                + self.config.estimates.ttft_overhead_s;
            if best_score(&local) <= split {
                // Run it whole on a decode instance: the prefill instances cannot.
                for c in candidates.drain(..) {
                    excluded.push(Candidate {
                        excluded: Some(Exclusion::WrongRole),
                        ..c
                    });
                }
                for c in too_long {
                    excluded.push(Candidate {
                        excluded: Some(Exclusion::LocalPrefillTooLong),
                        score: f64::INFINITY,
                        ..c
                    });
                }
                candidates = local;
                decode_candidates.clear();
            }
        }
        let tie = Tie {
            rule: self.policy.traits().tie_break,
            relative: self.config.cost.tie_relative,
            absolute: self.config.cost.tie_absolute_s,
            // Only a match the index can vouch for: a full index block, or most of a short
            // prompt. A few shared bytes (a chat template's opening) would otherwise send every
            // idle request to whichever instance served the first one.
            significant_tokens: ((self.config.index.block_bytes as f64)
                .min(prompt_bytes as f64 / 2.0)
                / self.bytes_per_token)
                .ceil() as u32,
        };
        let ranked_len = self.config.ranked_candidates;
        let (eligible, ranked) = rank(&mut candidates, tie, ranked_len, &mut self.rng);
        let (decode_eligible, _) = rank(&mut decode_candidates, tie, ranked_len, &mut self.rng);
        candidates.extend(excluded);
        Ok(Decision {
            policy: self.policy.traits().name,
            prompt_tokens,
            candidates,
            eligible,
            ranked,
            decode: decode_candidates,
            decode_eligible,
            saturated,
            block_hashes: if uses_index {
                prepared.hashes.clone()
            } else {
                Arc::from([])
            },
            prompt_bytes,
            adapter: request.adapter.map(str::to_string),
            max_tokens: request.max_tokens,
            session,
            memo,
        })
    }

    /// How much of its `max_tokens` an answer produces, measured over the answers finished so
    /// far: clients send one generous limit (or none, and the gateway assumes one) while models
    /// stop by themselves, so the KV a request will hold is priced from the answers measured,
    /// not from the limit. 1 where answers use their whole budget (and until one is measured).
    pub fn output_share(&self) -> f64 {
        (self.output_tokens_seen / self.output_budget_seen).clamp(1e-3, 1e3)
    }

    /// Median learned prefill speed, median `short_speed` and median trusted decode slope (of
    /// the instances that have one) over the model's first [`POOL_SAMPLE`] instances, 0 where
    /// there is none: the same set whether the decision scores every instance or a shortlist,
    /// one pass, bounded work; and the same instances' median shared-compute share and
    /// requests waiting for a first token.
    fn pool_figures(&self, model: &str) -> PoolFigures {
        // Fixed arrays: this runs on every decision, and allocates nothing.
        let mut speeds = [0.0f64; POOL_SAMPLE];
        let mut shorts = [0.0f64; POOL_SAMPLE];
        let mut slopes = [0.0f64; POOL_SAMPLE];
        let (mut n, mut m, mut k) = (0, 0, 0);
        let mut shares = [0.0f64; POOL_SAMPLE];
        let mut waiting = 0u32;
        for &slot in self.fleet.serving(model).iter().take(POOL_SAMPLE) {
            if let Some(instance) = self.fleet.by_slot(slot) {
                let learned = &instance.learned;
                shares[n] = learned.shared_compute.share_per_neighbour;
                waiting += instance.load.pending_requests;
                speeds[n] = learned.prefill_tokens_per_s;
                n += 1;
                if learned.short_samples > 0 {
                    shorts[m] = learned.short_speed;
                    m += 1;
                }
                if learned.decode_slope.per_sequence_s > 0.0 {
                    slopes[k] = learned.decode_slope.per_sequence_s;
                    k += 1;
                }
            }
        }
        PoolFigures {
            speed: median(&mut speeds[..n]),
            short_speed: median(&mut shorts[..m]),
            decode_slope_s: median(&mut slopes[..k]),
            // The median instance's: engines share a host or they do not, and one fit's
            // chance excursion on a separate device must not price anything. Separate
            // devices (every share 0) skip the sort.
            shared_share: if shares[..n].iter().any(|&s| s > 0.0) {
                median(&mut shares[..n])
            } else {
                0.0
            },
            waiting,
        }
    }

    fn saturation(&self, instance: &Instance, now: f64) -> Option<Exclusion> {
        let cost = &self.config.cost;
        let over_in_flight = cost
            .max_in_flight
            .is_some_and(|max| instance.load.in_flight() >= max);
        let over_waiting = cost.max_waiting.is_some_and(|max| {
            instance
                .fresh_metrics(now, self.config.estimates.metrics_stale_after_s)
                .is_some_and(|m| m.waiting >= max)
        });
        (over_in_flight || over_waiting).then_some(Exclusion::Saturated)
    }

    /// Looks the prompt's block hashes up in the index: matched depth per slot.
    fn lookup_depths(&mut self, hashes: &[u64]) {
        self.index.lookup(hashes, &mut self.matches);
        self.depth_by_slot.clear();
        self.depth_by_slot.resize(self.fleet.slot_bound(), 0);
        for m in &self.matches {
            self.depth_by_slot[m.slot as usize] = m.blocks;
        }
    }

    /// The slots a large pool is scored on: every instance holding a prefix of the prompt, plus
    /// the `len` least loaded healthy instances of each role that hold none of it.
    fn shortlist(&self, model: &str, len: usize, out: &mut Vec<Slot>) {
        let serves = |slot: Slot| self.fleet.by_slot(slot).is_some_and(|i| i.serves(model));
        out.extend(
            self.matches
                .iter()
                .filter(|m| m.blocks > 0 && serves(m.slot))
                .map(|m| m.slot),
        );
        for role in [Role::Both, Role::Prefill, Role::Decode] {
            let rest = self
                .ladder
                .least_loaded(role)
                .filter(|&slot| self.depth_by_slot[slot as usize] == 0 && serves(slot))
                .take(len);
            out.extend(rest);
        }
    }

    /// Moves an instance on the load ladder after its load, health or speed changed.
    fn relevel(&mut self, id: InstanceId, now: f64) {
        let e = &self.config.estimates;
        if let Some(instance) = self.fleet.get_mut(id) {
            self.busy
                .set(id.slot as usize, instance.load.in_flight() > 0, now);
            let view = instance.load_view(now, e.metrics_stale_after_s);
            let full = instance
                .max_running()
                .is_some_and(|max| max > 0 && view.in_system >= max);
            let window_s = e.slot_pressure_window_s;
            instance.learned.slot_pressure.advance(now, full, window_s);
            let wait_s = crate::policy::cost::typical_wait_s(&self.config, instance, now);
            self.ladder.update(instance, wait_s);
        }
    }

    /// Fills each candidate's matched blocks and predicted cached tokens from the last
    /// [`Self::lookup_depths`] (exact where the instance publishes KV events and the request
    /// carries token ids).
    fn apply_matches(
        &mut self,
        hashes: &[u64],
        candidates: &mut [Candidate],
        prompt_tokens: u32,
        exact: Option<ExactKey<'_>>,
        session: Option<SessionMark>,
    ) {
        let block_bytes = self.config.index.block_bytes;
        let prompt_bytes = (f64::from(prompt_tokens) * self.bytes_per_token) as usize;
        // At least one prompt token is always computed, as engines do.
        let max_cached = prompt_tokens.saturating_sub(1);
        for c in candidates.iter_mut() {
            let slot = c.instance.slot;
            let blocks = self.depth_by_slot[slot as usize];
            let mut bytes = tapered_end(blocks, block_bytes) as f64;
            if let Some(instance) = self.fleet.get(c.instance) {
                if blocks > 0 {
                    bytes *= held_share(&self.index, slot, hashes, blocks, instance);
                }
                // The session's last instance likely holds the conversation even where the
                // prompt was edited (the index then matches less): its last prompt, discounted
                // by how likely a prompt of that age is still held, is a floor.
                if let Some(mark) = session.filter(|m| m.instance == c.instance) {
                    let age = self.index.current_seq(slot).saturating_sub(mark.seq);
                    let p = instance.learned.survival.p_held(age);
                    bytes = bytes.max(mark.bytes.min(prompt_bytes) as f64 * p);
                }
            }
            let approx = ((bytes / self.bytes_per_token) as u32).min(max_cached);
            let mut cached = approx;
            c.terms.views = None;
            if exact.is_some() {
                if let Some(exact) = self.exact.looked_up_tokens(slot) {
                    let exact = exact.min(max_cached);
                    c.terms.views = Some(ViewPredictions { exact, approx });
                    // The exact view is routed on unless its predictions have missed the
                    // engine's reports by more than the approximate index's: a view the
                    // sequence checks cannot fault (events from another cache, a lost
                    // stretch replayed wrong) is caught by what the engine reports.
                    // Judged once the averages span their window (1 / learning rate samples):
                    // one early miss is not a verdict.
                    let window = sample_window(&self.config);
                    let learned = self.fleet.get(c.instance).map(|i| i.learned);
                    let worse = learned.is_some_and(|l| {
                        l.view_samples >= window && l.exact_error > l.approx_error
                    });
                    if !worse {
                        cached = exact;
                    }
                }
            }
            c.terms.matched_blocks = blocks;
            c.terms.shared_prefix = blocks > 0
                && hashes
                    .get(blocks as usize - 1)
                    .is_some_and(|&h| self.index.branches(h) >= 2);
            c.terms.cached_tokens = cached.min(max_cached);
            c.terms.uncached_tokens = prompt_tokens - c.terms.cached_tokens;
        }
    }

    /// Applies one observation.
    pub fn observe(&mut self, observation: Observation, now: f64) -> Result<(), ObserveError> {
        self.observations_since_sweep += 1;
        if self.observations_since_sweep >= 4096 {
            self.observations_since_sweep = 0;
            self.expire_stale(now);
        }
        match observation {
            Observation::InstanceAdded(spec) => self.add_instance(spec).map(|_| ()),
            Observation::InstanceRemoved(id) => self.remove_instance(id),
            Observation::HealthChanged(id, health) => {
                let instance = self
                    .fleet
                    .get_mut(id)
                    .ok_or(ObserveError::UnknownInstance(id))?;
                instance.health = health;
                self.relevel(id, now);
                Ok(())
            }
            Observation::MetricsScraped(id, metrics) => {
                let instance = self
                    .fleet
                    .get_mut(id)
                    .ok_or(ObserveError::UnknownInstance(id))?;
                let previous = instance.engine.as_ref().map(|(m, _)| m);
                learn_max_running(
                    &mut instance.learned,
                    previous,
                    &metrics,
                    self.config.cost.kv_high_watermark,
                );
                let slots = metrics.max_adapters.unwrap_or(instance.spec.adapter_slots);
                for adapter in &metrics.running_adapters {
                    if !instance.adapters.is_resident(adapter) {
                        instance.adapters.resident.insert(0, adapter.clone());
                        instance.adapters.resident.truncate(slots.max(1) as usize);
                    }
                }
                instance.engine = Some((metrics, now));
                instance.load_at_scrape = instance.load.clone();
                self.resize_lane(id);
                self.relevel(id, now);
                Ok(())
            }
            Observation::Routed {
                request,
                instance,
                plan,
            } => self.on_routed(request, instance, plan, now),
            Observation::FirstToken(request) => self.on_first_token(request, now),
            Observation::Finished(request, usage) => self.on_end(request, usage, true, now),
            Observation::Failed(request) => self.on_end(request, None, false, now),
            Observation::AdapterLoaded(id, adapter) => {
                if !self.fleet.register_adapter(id, &adapter) {
                    return Err(ObserveError::UnknownInstance(id));
                }
                let instance = self
                    .fleet
                    .get_mut(id)
                    .ok_or(ObserveError::UnknownInstance(id))?;
                let slots = instance.adapter_slots();
                instance.adapters.touch(&adapter, slots, now);
                instance.adapters.last_load_at = Some(now);
                Ok(())
            }
            Observation::AdapterUnloaded(id, adapter) => {
                if !self.fleet.unregister_adapter(id, &adapter) {
                    return Err(ObserveError::UnknownInstance(id));
                }
                let instance = self
                    .fleet
                    .get_mut(id)
                    .ok_or(ObserveError::UnknownInstance(id))?;
                instance.adapters.resident.retain(|a| *a != adapter);
                Ok(())
            }
            Observation::KvEvents(id, _)
            | Observation::KvEventsLost(id)
            | Observation::KvEventsTrusted(id) => {
                self.fleet
                    .get(id)
                    .ok_or(ObserveError::UnknownInstance(id))?;
                match observation {
                    Observation::KvEvents(_, events) => self.exact.apply(id.slot, &events),
                    Observation::KvEventsLost(_) => self.exact.lose(id.slot),
                    _ => self.exact.trust(id.slot),
                }
                Ok(())
            }
        }
    }

    /// Adds an instance and returns its handle (also reachable as [`Observation::InstanceAdded`]).
    pub fn add_instance(&mut self, spec: InstanceSpec) -> Result<InstanceId, ObserveError> {
        if spec.name.is_empty() {
            return Err(ObserveError::InvalidInstance("the name is empty".into()));
        }
        if spec.models.is_empty() {
            return Err(ObserveError::InvalidInstance(format!(
                "`{}` serves no model",
                spec.name
            )));
        }
        if !(spec.weight.is_finite() && spec.weight > 0.0) {
            return Err(ObserveError::InvalidInstance(format!(
                "`{}` has weight {}; it must be a positive number",
                spec.name, spec.weight
            )));
        }
        let learned = self.priors(&spec);
        let id = self
            .fleet
            .add(spec, learned)
            .map_err(ObserveError::DuplicateInstance)?;
        let slot = id.slot as usize;
        if self.pending_inserts.len() <= slot {
            self.pending_inserts.resize_with(slot + 1, BTreeSet::new);
        }
        // Invariant: the instance was just added.
        let capacity = self.index_capacity(self.fleet.get(id).expect("just added"));
        self.index.set_capacity(id.slot, capacity);
        // A new instance has no scrape yet, so no clock is needed to price its load.
        self.relevel(id, 0.0);
        Ok(id)
    }

    fn remove_instance(&mut self, id: InstanceId) -> Result<(), ObserveError> {
        self.fleet
            .remove(id)
            .ok_or(ObserveError::UnknownInstance(id))?;
        self.index.clear_slot(id.slot);
        self.exact.forget_slot(id.slot);
        self.ladder.remove(id.slot);
        self.policy.forget_instance(id.slot);
        self.in_flight.retain(|_, r| r.instance != id);
        self.pending_inserts[id.slot as usize].clear();
        // No clock here: the area stops counting it as of the last update (time 0 is never
        // after it), a moment early at most.
        self.busy.set(id.slot as usize, false, 0.0);
        Ok(())
    }

    fn on_routed(
        &mut self,
        request: RequestId,
        id: InstanceId,
        plan: RoutePlan,
        now: f64,
    ) -> Result<(), ObserveError> {
        if self.in_flight.contains_key(&request) {
            return Err(ObserveError::DuplicateRequest(request));
        }
        // The policy that decided remembers the pick (a policy switched in since has its own
        // keys); a decode leg did not prefill the prompt there.
        if !plan.is_decode_only
            && plan.policy == self.policy.traits().name
            && self.fleet.get(id).is_some()
        {
            self.policy.on_routed(id.slot, &plan.memo);
        }
        let rate = self.config.estimates.learning_rate;
        let instance = self
            .fleet
            .get_mut(id)
            .ok_or(ObserveError::UnknownInstance(id))?;
        let uncached = if plan.is_decode_only {
            0
        } else {
            plan.prompt_tokens
                .saturating_sub(plan.predicted_cached_tokens)
        };
        let work_tokens = instance.load.pending_tokens + u64::from(uncached);
        // A prefill leg hands its KV over after one token: its answer grows on the decode side.
        let output_budget = if plan.is_prefill_leg {
            0
        } else {
            plan.max_tokens
        };
        instance.load.pending_requests += 1;
        instance.load.pending_tokens += u64::from(uncached);
        instance.load.kv_prompt_tokens += u64::from(plan.prompt_tokens);
        instance.load.kv_output_budget += u64::from(output_budget);
        if !plan.is_decode_only {
            instance.learned.mean_uncached_tokens = ewma(
                instance.learned.mean_uncached_tokens,
                f64::from(uncached),
                rate,
            );
        }
        if let Some(adapter) = &plan.adapter {
            let slots = instance.adapter_slots();
            instance.adapters.touch(adapter, slots, now);
        }
        let slot = id.slot;
        let matched = (plan.matched_blocks as usize).min(plan.block_hashes.len());
        let matched_seqs = plan.block_hashes[..matched]
            .iter()
            .map(|&h| self.index.seq_of(slot, h).unwrap_or(0))
            .collect();
        let pending = &mut self.pending_inserts[slot as usize];
        let pending_floor = pending.first().map(|&(seq, _)| seq);
        let route_seq = self.index.current_seq(slot);
        let pending_key = (route_seq + 1, request.0);
        pending.insert(pending_key);
        // A decode leg holds the prompt too once its KV has landed, so later turns can match it.
        self.index.insert(slot, &plan.block_hashes);
        if let Some(session) = plan.session {
            if self.sessions.len() >= MAX_SESSIONS && !self.sessions.contains_key(&session) {
                self.sessions.clear();
            }
            let mark = SessionMark {
                instance: id,
                seq: self.index.current_seq(slot),
                bytes: plan.prompt_bytes,
            };
            self.sessions.insert(session, mark);
        }
        self.in_flight.insert(
            request,
            InFlight {
                instance: id,
                routed_at: now,
                last_heard: now,
                first_token_at: None,
                prompt_bytes: plan.prompt_bytes,
                uncached_tokens: uncached,
                kv_prompt_tokens: u64::from(plan.prompt_tokens),
                kv_output_budget: output_budget,
                work_tokens,
                learns_speed: !plan.is_decode_only,
                matched_blocks: plan.matched_blocks,
                predicted_cached_tokens: plan.predicted_cached_tokens,
                views: plan.views,
                matched_seqs,
                estimated_ttft_s: plan.estimated_ttft_s,
                raw_wait_prefill_s: plan.raw_wait_prefill_s,
                adapter_s: plan.adapter_s,
                loads_adapter: plan.loads_adapter,
                route_seq,
                pending_floor,
                pending_key,
                running_area_at_first_token: 0.0,
                prefilled_at_first_token: 0,
                busy_area_at_first_token: 0.0,
            },
        );
        self.relevel(id, now);
        Ok(())
    }

    fn on_first_token(&mut self, request: RequestId, now: f64) -> Result<(), ObserveError> {
        let record = self
            .in_flight
            .get_mut(&request)
            .ok_or(ObserveError::UnknownRequest(request))?;
        record.last_heard = now;
        if record.first_token_at.is_some() {
            return Ok(());
        }
        record.first_token_at = Some(now);
        let observed_s = now - record.routed_at;
        // The prediction adds the instance's fixed part as learned before this sample, so the
        // error reported is out of sample; then the sample teaches it.
        // A first token behind an adapter load teaches the load time (what it took beyond the
        // rest of the estimate and the fixed part), not the fixed part.
        let rate = self.config.estimates.learning_rate;
        let estimate = match (record.estimated_ttft_s, self.fleet.get_mut(record.instance)) {
            (Some(raw), Some(instance)) => {
                let learned = &mut instance.learned;
                let fixed_s = learned.ttft_fixed_s.value.max(0.0);
                // The same with the wait and prefill at what an estimated second of each has
                // been worth, and its own fixed part.
                let (wait_s, prefill_s) = record.raw_wait_prefill_s;
                let scale = self.ttft_calibration.scale;
                let calibrated =
                    raw + (scale.wait - 1.0) * wait_s + (scale.prefill - 1.0) * prefill_s;
                let calibrated_fixed_s = learned.ttft_fixed_calibrated_s.value.max(0.0);
                let (face_value_s, calibrated_s) = (raw + fixed_s, calibrated + calibrated_fixed_s);
                let reported_s = if self.prediction_choice.calibrated() {
                    calibrated_s
                } else {
                    face_value_s
                };
                if record.loads_adapter {
                    let without_adapter = raw - record.adapter_s;
                    self.adapter_load
                        .update(observed_s - without_adapter - fixed_s, rate);
                } else {
                    learned.ttft_fixed_s.update(observed_s - raw, rate);
                    learned
                        .ttft_fixed_calibrated_s
                        .update(observed_s - calibrated, rate);
                    self.ttft_calibration.observe(wait_s, prefill_s, observed_s);
                    let error = |estimated_s: f64| {
                        Prediction::Ttft {
                            estimated_s,
                            observed_s,
                        }
                        .relative_error()
                    };
                    self.prediction_choice
                        .observe(error(face_value_s), error(calibrated_s));
                }
                Some(reported_s)
            }
            _ => None,
        };
        if let Some(estimated_s) = estimate {
            self.record_prediction(Prediction::Ttft {
                estimated_s,
                observed_s,
            });
        }
        let Some(record) = self.in_flight.get_mut(&request) else {
            return Ok(());
        };
        let e = &self.config.estimates;
        let Some(instance) = self.fleet.get_mut(record.instance) else {
            return Ok(());
        };
        instance.load.pending_requests -= 1;
        instance.load.pending_tokens -= u64::from(record.uncached_tokens);
        let totals = &mut instance.totals;
        totals.count_running(instance.load.running_requests, now);
        record.running_area_at_first_token = totals.running_area_s;
        record.prefilled_at_first_token = totals.prefilled_tokens;
        record.busy_area_at_first_token = self.busy.area_at(now);
        totals.prefilled_tokens += u64::from(record.uncached_tokens);
        instance.load.running_requests += 1;
        self.pending_inserts[record.instance.slot as usize].remove(&record.pending_key);
        // The fixed part is at most half of a first token that had `min_sample_tokens` of
        // prefill to do: on a small model's fast engine such first tokens come in 11-20 ms, and
        // the whole 10 ms prior taken off them turned a 285k tokens/s engine's samples into
        // millions, clamped, and the learned speed with them (the suite's long-tail workload on
        // a 1B profile: mean TTFT 1.78x the best baseline's, 0.95x with this bound).
        let observed_s = now - record.routed_at;
        let elapsed = observed_s - e.ttft_overhead_s.min(observed_s / 2.0);
        if record.learns_speed && record.work_tokens > 0 && elapsed > 0.0 {
            let prior = instance
                .spec
                .prefill_tokens_per_s
                .unwrap_or(e.prefill_tokens_per_s);
            let sample = (record.work_tokens as f64 / elapsed).clamp(prior / 16.0, prior * 16.0);
            let learned = &mut instance.learned;
            if record.work_tokens >= e.min_sample_tokens {
                learned.prefill_tokens_per_s =
                    ewma(learned.prefill_tokens_per_s, sample, e.learning_rate);
                learned.speed_samples = learned.speed_samples.saturating_add(1);
            } else {
                // Short prompts and long answers (chat) may never give a full sample; their
                // first tokens still tell a slow engine from a fast one.
                // From the prior, as the full speed moves, not warm-started: a warm start takes
                // the first few samples, each a step's phase off, at face value (a mixed fleet's
                // short-prompt chat: ITL p99 1.35x the best baseline's warm, 0.97x this way).
                learned.short_speed = ewma(learned.short_speed, sample, e.learning_rate);
                learned.short_samples = learned.short_samples.saturating_add(1);
            }
        }
        let id = record.instance;
        self.relevel(id, now);
        Ok(())
    }

    fn on_end(
        &mut self,
        request: RequestId,
        usage: Option<Usage>,
        finished: bool,
        now: f64,
    ) -> Result<(), ObserveError> {
        let record = self
            .in_flight
            .remove(&request)
            .ok_or(ObserveError::UnknownRequest(request))?;
        let rate = self.config.estimates.learning_rate;
        let slot = record.instance.slot;
        if record.first_token_at.is_none() {
            self.pending_inserts[slot as usize].remove(&record.pending_key);
        }
        let Some(instance) = self.fleet.get_mut(record.instance) else {
            return Ok(());
        };
        match record.first_token_at {
            None => {
                instance.load.pending_requests -= 1;
                instance.load.pending_tokens -= u64::from(record.uncached_tokens);
            }
            Some(_) => {
                let running = instance.load.running_requests;
                instance.totals.count_running(running, now);
                instance.load.running_requests -= 1;
            }
        }
        instance.load.kv_prompt_tokens -= record.kv_prompt_tokens;
        instance.load.kv_output_budget -= u64::from(record.kv_output_budget);
        if let (true, Some(first_token_at)) = (finished, record.first_token_at) {
            // How long the request held a sequence slot: its decode, plus the part of its time
            // to first token that was its own prefill. The time it queued for a slot is not
            // occupancy; counting it made a busy engine's slots look slower to free the longer
            // its queue grew, so the router fled cache holders exactly when hits paid most.
            let ttft_s = first_token_at - record.routed_at;
            let speed = instance.learned.prefill_tokens_per_s.max(1.0);
            let prefill_s = (f64::from(record.uncached_tokens) / speed).min(ttft_s);
            let occupancy_s = (now - first_token_at) + prefill_s;
            let learned = &mut instance.learned;
            learned.service_time_s = warm_ewma(
                learned.service_time_s,
                occupancy_s,
                rate,
                learned.service_samples,
            );
            learned.service_samples = learned.service_samples.saturating_add(1);
        }
        self.relevel(record.instance, now);
        if !finished {
            return Ok(());
        }
        let Some(usage) = usage else { return Ok(()) };
        // An engine that reports no generated tokens says nothing about answer lengths.
        if record.kv_output_budget > 0 && usage.completion_tokens > 0 {
            let (out, budget) = (usage.completion_tokens, record.kv_output_budget);
            self.output_tokens_seen = ewma(self.output_tokens_seen, f64::from(out), rate * 0.5);
            self.output_budget_seen = ewma(self.output_budget_seen, f64::from(budget), rate * 0.5);
        }
        if usage.prompt_tokens > 0 && record.prompt_bytes > 0 {
            // A ratio of moving sums weighs each request by its length, so short prompts (where
            // the chat template's tokens dominate) do not swing the estimate.
            let (bytes, tokens) = (record.prompt_bytes as f64, f64::from(usage.prompt_tokens));
            self.prompt_bytes_seen = ewma(self.prompt_bytes_seen, bytes, rate * 0.5);
            self.prompt_tokens_seen = ewma(self.prompt_tokens_seen, tokens, rate * 0.5);
            self.bytes_per_token =
                (self.prompt_bytes_seen / self.prompt_tokens_seen).clamp(0.5, 64.0);
        }
        if let (Some(first_token_at), true) = (record.first_token_at, record.kv_output_budget > 0) {
            let busy_area_now = self.busy.area_at(now);
            learn_decode_slope(
                self.fleet.get_mut(record.instance),
                &record,
                first_token_at,
                usage.completion_tokens,
                rate,
                busy_area_now,
                now,
            );
        }
        if let Some(cached) = usage.cached_tokens {
            if record.uncached_tokens > 0 || record.predicted_cached_tokens > 0 {
                self.record_prediction(Prediction::Cached {
                    predicted: record.predicted_cached_tokens,
                    reported: cached,
                    prompt: usage.prompt_tokens,
                });
            }
            if let Some(instance) = self.fleet.get_mut(record.instance) {
                let prompt = f64::from(usage.prompt_tokens.max(1));
                let share = f64::from(cached.min(usage.prompt_tokens)) / prompt;
                let learned = &mut instance.learned;
                learned.hit_share = ewma(learned.hit_share, share, rate);
                if let Some(v) = record.views {
                    let miss = |predicted: u32| f64::from(predicted.abs_diff(cached)) / prompt;
                    learned.exact_error = ewma(learned.exact_error, miss(v.exact), rate);
                    learned.approx_error = ewma(learned.approx_error, miss(v.approx), rate);
                    learned.view_samples = learned.view_samples.saturating_add(1);
                }
            }
            self.feedback(&record, cached);
        }
        Ok(())
    }

    /// Learns, from the cached-token count the engine reported, how likely the instance still
    /// holds an indexed block of a given age (see [`crate::prefix::CacheSurvival`]).
    ///
    /// Blocks before the reported count were held; the first block after it (one block of
    /// slack: tokenisation moves block boundaries a little) was not. Deeper ones say nothing
    /// more: a prefix cache cannot use them past a miss. Entries are not forgotten, only
    /// discounted: engines that are not one LRU (llama.cpp's slots) keep old prompts too.
    fn feedback(&mut self, record: &InFlight, cached: u32) {
        if self.config.index.disable_feedback || record.matched_blocks == 0 {
            return;
        }
        let rate = self.config.estimates.learning_rate;
        let cached_bytes = (f64::from(cached) * self.bytes_per_token) as usize;
        let reported = tapered_depth(cached_bytes, self.config.index.block_bytes) as usize;
        let matched = (record.matched_blocks as usize).min(record.matched_seqs.len());
        let age = |k: usize| record.route_seq.saturating_sub(record.matched_seqs[k]);
        let Some(instance) = self.fleet.get_mut(record.instance) else {
            return;
        };
        let unit = instance.learned.cache_unit_tokens;
        if cached > 0 {
            instance.learned.cache_unit_tokens = if unit == 0 { cached } else { unit.min(cached) };
        }
        // A shortfall smaller than the unit the engine caches in is no evidence of eviction:
        // vLLM reports none of an 8-token match (the chat template's opening, which the index's
        // first halvings match in every prompt), and counting those as evictions of the
        // youngest blocks taught every instance to hold nothing (a two-slot CPU engine's
        // conversations in the simulator: 11 % cached against 19 % without feedback). Until
        // the engine has reported a cached token, a full index block is the unit.
        let unit_bytes = if unit > 0 {
            f64::from(unit) * self.bytes_per_token
        } else {
            self.config.index.block_bytes as f64
        };
        let matched_bytes = tapered_end(matched as u32, self.config.index.block_bytes) as f64;
        let informative = matched_bytes >= cached_bytes as f64 + unit_bytes;
        let survival = &mut instance.learned.survival;
        let held = reported.min(matched);
        if held > 0 {
            survival.record_held(age(0));
            if held > 1 {
                survival.record_held(age(held - 1));
            }
        }
        if informative && reported + 1 < matched {
            let seq = record.matched_seqs[reported + 1];
            // A block a request still being prefilled touched may simply not be computed yet:
            // no evidence of eviction.
            if record.pending_floor.is_none_or(|floor| seq < floor) {
                survival.record_evicted(age(reported + 1));
            }
        }
        if record.predicted_cached_tokens > 0 {
            let share = (f64::from(cached) / f64::from(record.predicted_cached_tokens)).min(1.0);
            instance.learned.cache_trust = ewma(instance.learned.cache_trust, share, rate);
        }
    }

    /// Applies the instance's current index capacity to its lane.
    fn resize_lane(&mut self, id: InstanceId) {
        if let Some(instance) = self.fleet.get(id) {
            let capacity = self.index_capacity(instance);
            if capacity != self.index.capacity(id.slot) {
                self.index.set_capacity(id.slot, capacity);
            }
        }
    }

    /// Forgets in-flight requests not heard of within the configured time to live.
    pub fn expire_stale(&mut self, now: f64) -> usize {
        let ttl = self.config.in_flight_ttl_s;
        let stale: Vec<RequestId> = self
            .in_flight
            .iter()
            .filter(|(_, r)| now - r.last_heard > ttl)
            .map(|(&id, _)| id)
            .collect();
        for &id in &stale {
            // Invariant: the id was just read from the map.
            self.on_end(id, None, false, now)
                .expect("stale request is in flight");
        }
        stale.len()
    }

    /// What the router has learned about an instance.
    pub fn learned(&self, id: InstanceId) -> Option<Learned> {
        self.fleet.get(id).map(|i| i.learned)
    }
}

/// Samples an average with the configured learning rate needs before it says more about an
/// instance than its prior: the average's window, 1 / learning rate.
pub(crate) fn sample_window(config: &RouterConfig) -> u32 {
    (1.0 / config.estimates.learning_rate).ceil() as u32
}

/// Share of the matched run the instance is expected to still hold: the learned survival of its
/// blocks' ages, sampled at the first, middle and last block (one prompt's blocks are touched
/// together, so their ages differ little).
fn held_share(
    index: &PrefixIndex,
    slot: Slot,
    hashes: &[u64],
    blocks: u32,
    instance: &Instance,
) -> f64 {
    let survival = &instance.learned.survival;
    if survival.observations() == 0 {
        return 1.0;
    }
    let now = index.current_seq(slot);
    let p = |k: usize| {
        hashes
            .get(k)
            .and_then(|&h| index.seq_of(slot, h))
            .map_or(0.0, |seq| survival.p_held(now.saturating_sub(seq)))
    };
    let last = blocks as usize - 1;
    let (first, middle, deepest) = (p(0), p(last / 2), p(last));
    (first + 2.0 * middle + deepest) / 4.0
}

/// The lowest score among eligible candidates (infinity if none).
fn best_score(candidates: &[Candidate]) -> f64 {
    candidates
        .iter()
        .filter(|c| c.excluded.is_none())
        .map(|c| c.score)
        .fold(f64::INFINITY, f64::min)
}

/// Orders eligible candidates first, the best `ranked_len` of them sorted by score with the tie
/// rule, in place; returns (eligible count, ranked count).
/// How [`rank`] breaks ties for one decision.
#[derive(Debug, Clone, Copy)]
struct Tie {
    rule: TieBreak,
    relative: f64,
    absolute: f64,
    /// Predicted cached tokens from which a holder is preferred within a near tie.
    significant_tokens: u32,
}

fn rank(
    candidates: &mut [Candidate],
    tie: Tie,
    ranked_len: usize,
    rng: &mut SmallRng,
) -> (usize, usize) {
    // Policies may exclude (e.g. the adapter cooldown): those go after the eligible ones.
    let mut eligible = 0;
    for i in 0..candidates.len() {
        if candidates[i].excluded.is_none() {
            candidates.swap(eligible, i);
            eligible += 1;
        }
    }
    let head = &mut candidates[..eligible];
    for c in head.iter_mut() {
        c.key = c.score;
    }
    match tie.rule {
        TieBreak::First => {}
        TieBreak::Exact => head.iter_mut().for_each(|c| c.tie = rng.random()),
        TieBreak::Near => near_ties(head, tie, rng),
    }
    let better =
        |a: &Candidate, b: &Candidate| a.key.total_cmp(&b.key).then(a.tie.cmp(&b.tie)).is_lt();
    let ranked = ranked_len.min(eligible);
    // One pass keeps the best `ranked` positions in order (ranked is small, eligible may be
    // thousands), then they are swapped to the front.
    let mut best: Vec<usize> = Vec::with_capacity(ranked + 1);
    for i in 0..head.len() {
        if best.len() == ranked && !better(&head[i], &head[best[ranked - 1]]) {
            continue;
        }
        let at = best.partition_point(|&j| !better(&head[i], &head[j]));
        best.insert(at, i);
        best.truncate(ranked);
    }
    for j in 0..best.len() {
        let from = best[j];
        head.swap(j, from);
        // The element that was at `j` now lives at `from`; if it is ranked later, follow it.
        if let Some(later) = best[j + 1..].iter_mut().find(|k| **k == j) {
            *later = from;
        }
    }
    (eligible, ranked)
}

/// Randomised tie-break among near-equal candidates: every candidate within the tolerance of
/// the best ranks as the best, in random order, instead of always the first (no herding onto
/// one instance). Within the tie, the candidates expected to hold most of the prompt go first:
/// at the same estimated TTFT, the others would store a second copy of the prefix and evict
/// something of their own for it. A holder only wins a tie, so a hot prefix still spreads once
/// its holders' wait grows.
fn near_ties(head: &mut [Candidate], tie: Tie, rng: &mut SmallRng) {
    let best = head.iter().map(|c| c.score).fold(f64::INFINITY, f64::min);
    if !best.is_finite() {
        return;
    }
    let limit = best + best.abs() * tie.relative + tie.absolute;
    let most_cached = head
        .iter()
        .filter(|c| c.score <= limit)
        .map(|c| c.terms.cached_tokens)
        .max()
        .unwrap_or(0);
    let most_cached = if most_cached >= tie.significant_tokens.max(1) {
        most_cached
    } else {
        0
    };
    for c in head.iter_mut().filter(|c| c.score <= limit) {
        c.key = best;
        // The top bit ranks holders of less of the prompt after the best holders; then the
        // instances holding the least KV for their requests in flight (the decode batch the
        // request joins, whose attention sets its inter-token time), then chance.
        let behind = u64::from(c.terms.cached_tokens < most_cached) << 63;
        // Holders of the prompt keep a random order among themselves: ordered by load as
        // well, the suite's conversation trace lost (mooncake knee ITL p99 0.64 -> 0.98x the
        // best baseline's, docs/results.md).
        let load = if most_cached > 0 {
            0
        } else {
            c.tie_load.min((1 << 31) - 1) << 32
        };
        c.tie = behind | load | (rng.random::<u64>() >> 32);
    }
}
