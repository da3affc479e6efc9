//! The answer to "where should this request go?", with the reasons.

use std::sync::Arc;

use serde::Serialize;

use crate::fleet::InstanceId;

/// Why a candidate was not eligible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Exclusion {
    /// Failing health checks.
    Unhealthy,
    /// Draining: takes no new requests.
    Draining,
    /// Its role cannot run this phase (decode-only for a prefill, prefill-only for a decode).
    WrongRole,
    /// It cannot serve the requested adapter.
    AdapterUnavailable,
    /// Over its queue limit.
    Saturated,
    /// It would have to swap adapters again within the cooldown (thrashing guard).
    AdapterCooldown,
    /// A decode instance with more uncached prompt than `cost.local_prefill_max_tokens`, when
    /// the request runs whole on a decode instance (selective disaggregation).
    LocalPrefillTooLong,
}

/// The parts of a candidate's estimated time to first token, for the `cost` policy; baselines
/// fill what they use (at least `score`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CostTerms {
    /// Leading prompt blocks the prefix index believes the instance holds.
    pub matched_blocks: u32,
    /// Prompt tokens predicted to be served from its cache.
    pub cached_tokens: u32,
    /// Prompt tokens it would have to prefill.
    pub uncached_tokens: u32,
    /// Seconds of work queued ahead of the request.
    pub wait_s: f64,
    /// Seconds to prefill the uncached tokens.
    pub prefill_s: f64,
    /// Seconds to load the adapter (0 when resident), plus the swap margin.
    pub adapter_s: f64,
    /// Whether `adapter_s` is a load into a free adapter slot alone (no eviction, no wait for a
    /// slot): the first tokens the router learns the load time from.
    #[serde(skip)]
    pub loads_adapter: bool,
    /// Seconds to move the KV cache from the prefill instance (disaggregated decode only).
    pub transfer_s: f64,
    /// Delay inflicted on the sequences decoding there, weighted (decode-load protection).
    pub decode_penalty_s: f64,
    /// Preemption risk from projected KV usage, in seconds.
    pub kv_penalty_s: f64,
    /// The hits lost to the cache room spent storing again a prefix another candidate holds.
    pub cache_room_s: f64,
    /// The extra time the answer would take to decode in a batch larger than the candidates
    /// nothing pulls carry, charged where a shared prefix or an adapter pulls the request
    /// (packing guard).
    pub packing_s: f64,
    /// The wait and prefill estimates before calibration ([`crate::calibration`]): what the
    /// router learns the factors from.
    #[serde(skip)]
    pub raw_wait_prefill_s: (f64, f64),
    /// Whether the deepest block the instance holds of the prompt is one that different prompts
    /// continue (a shared prefix), not one conversation's own history.
    #[serde(skip)]
    pub shared_prefix: bool,
    /// Both views' cached-token predictions, where the instance publishes KV events and the
    /// request carries token ids (to learn which predicts better).
    #[serde(skip)]
    pub views: Option<ViewPredictions>,
}

/// What the exact view (KV events) and the approximate index each predicted cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ViewPredictions {
    /// From the engine's KV events.
    pub exact: u32,
    /// From the approximate prefix index.
    pub approx: u32,
}

/// One instance considered for a request.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Candidate {
    /// The instance.
    pub instance: InstanceId,
    /// The policy's score: lower is better (for `cost`, the estimated TTFT in seconds).
    pub score: f64,
    /// The breakdown behind the score.
    pub terms: CostTerms,
    /// Set when the candidate was ruled out.
    pub excluded: Option<Exclusion>,
    /// Orders equal scores (random or fleet order, per the policy's tie rule).
    #[serde(skip)]
    pub(crate) tie: u64,
    /// What the ranking sorts by: the score, or the best score for a near tie.
    #[serde(skip)]
    pub(crate) key: f64,
    /// Orders a near tie before chance does: the KV tokens the instance will hold for its
    /// requests in flight (0 when the policy does not say; `u64::MAX` sorts after every other value).
    #[serde(skip)]
    pub(crate) tie_load: u64,
}

/// Where a request should go: candidates best first, then the excluded ones with reasons.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// Policy that decided.
    pub policy: &'static str,
    /// Estimated prompt tokens.
    pub prompt_tokens: u32,
    /// Eligible candidates (the first `ranked` in order, best first), then excluded ones.
    /// For a disaggregated request these are the prefill candidates.
    pub candidates: Vec<Candidate>,
    /// Number of eligible candidates at the front of `candidates`.
    pub eligible: usize,
    /// Number of eligible candidates that are in rank order.
    pub ranked: usize,
    /// Decode candidates of a disaggregated request, ranked the same way; empty when unified.
    pub decode: Vec<Candidate>,
    /// Eligible decode candidates at the front of `decode`.
    pub decode_eligible: usize,
    /// True when every otherwise eligible candidate is over its queue limit: queue or shed.
    pub saturated: bool,
    /// Chained hashes of the prompt's blocks (what the routed instance will hold).
    #[serde(skip)]
    pub(crate) block_hashes: Arc<[u64]>,
    /// Rendered prompt bytes (for learning bytes per token).
    #[serde(skip)]
    pub(crate) prompt_bytes: usize,
    /// Adapter requested.
    #[serde(skip)]
    pub(crate) adapter: Option<String>,
    /// Output budget.
    #[serde(skip)]
    pub(crate) max_tokens: u32,
    /// Hash of the request's session key (model-scoped), if it had one.
    #[serde(skip)]
    pub(crate) session: Option<u64>,
    /// What the policy keeps for when the request is routed (see [`RoutePlan`]).
    #[serde(skip)]
    pub(crate) memo: Vec<u64>,
}

impl Decision {
    /// The best eligible candidate (for disaggregated requests, the prefill pick).
    pub fn best(&self) -> Option<InstanceId> {
        self.ranked_candidates().next().map(|c| c.instance)
    }

    /// The best eligible decode candidate of a disaggregated request.
    pub fn best_decode(&self) -> Option<InstanceId> {
        self.decode[..self.decode_eligible]
            .first()
            .map(|c| c.instance)
    }

    /// Whether this request is split into a prefill and a decode.
    pub fn is_disaggregated(&self) -> bool {
        !self.decode.is_empty()
    }

    /// Eligible candidates in rank order: the retry list.
    pub fn ranked_candidates(&self) -> impl Iterator<Item = &Candidate> {
        self.candidates[..self.ranked].iter()
    }

    /// Every eligible candidate, ranked ones first.
    pub fn eligible_candidates(&self) -> &[Candidate] {
        &self.candidates[..self.eligible]
    }

    /// The candidate entry for `instance`, among prefill/unified then decode candidates.
    pub fn candidate(&self, instance: InstanceId) -> Option<&Candidate> {
        self.candidates
            .iter()
            .chain(self.decode.iter())
            .find(|c| c.instance == instance)
    }

    /// What to record when the request is sent to `instance` (see [`crate::Observation::Routed`]).
    pub fn plan_for(&self, instance: InstanceId) -> RoutePlan {
        let terms = self
            .candidate(instance)
            .map(|c| c.terms)
            .unwrap_or_default();
        RoutePlan {
            block_hashes: self.block_hashes.clone(),
            prompt_bytes: self.prompt_bytes,
            prompt_tokens: self.prompt_tokens,
            matched_blocks: terms.matched_blocks,
            predicted_cached_tokens: terms.cached_tokens,
            views: terms.views,
            adapter: self.adapter.clone(),
            max_tokens: self.max_tokens,
            is_decode_only: self.decode.iter().any(|c| c.instance == instance)
                && !self.candidates.iter().any(|c| c.instance == instance),
            is_prefill_leg: self.is_disaggregated()
                && self.candidates.iter().any(|c| c.instance == instance),
            // Only a policy that prices prefill in seconds (`cost`) makes a TTFT estimate.
            session: self.session,
            // At face value (the prefill before `cost.calibrate_prefill`'s pricing): the router
            // calibrates its prediction itself when the first token comes.
            estimated_ttft_s: (terms.prefill_s > 0.0).then_some(
                terms.raw_wait_prefill_s.0
                    + terms.raw_wait_prefill_s.1
                    + terms.adapter_s
                    + terms.transfer_s,
            ),
            raw_wait_prefill_s: terms.raw_wait_prefill_s,
            adapter_s: terms.adapter_s,
            loads_adapter: terms.loads_adapter,
            policy: self.policy,
            memo: self.memo.clone(),
        }
    }

    /// A one-line summary for logs: the top candidates with their terms, instances as `slot#generation`.
    pub fn explain(&self, top: usize) -> String {
        self.explain_with(top, |id| format!("{}#{}", id.slot, id.generation))
    }

    /// Like [`Decision::explain`], with instances named by `name` (e.g. the backend's name).
    pub fn explain_with(&self, top: usize, name: impl Fn(InstanceId) -> String) -> String {
        let mut parts = Vec::new();
        for c in self.ranked_candidates().take(top) {
            let t = &c.terms;
            // What orders a near tie where the request would start at once.
            let held = match c.tie_load {
                0 | u64::MAX => String::new(),
                kv => format!(" kv_held={kv}"),
            };
            parts.push(format!(
                "{} score={:.4} wait={:.4} prefill={:.4} adapter={:.3} transfer={:.4} \
                 protect={:.4} cached={} uncached={}{}",
                name(c.instance),
                c.score,
                t.wait_s,
                t.prefill_s,
                t.adapter_s,
                t.transfer_s,
                t.decode_penalty_s + t.kv_penalty_s + t.cache_room_s + t.packing_s,
                t.cached_tokens,
                t.uncached_tokens,
                held
            ));
        }
        let excluded = self.candidates.len() - self.eligible;
        let mut explained = format!(
            "policy={} eligible={} excluded={} saturated={} [{}]",
            self.policy,
            self.eligible,
            excluded,
            self.saturated,
            parts.join("; ")
        );
        if self.decode_eligible > 0 {
            // Decode candidates mostly tie on their terms; what broke the tie is shown too.
            let decode: Vec<String> = self.decode[..self.decode_eligible]
                .iter()
                .take(top)
                .map(|c| {
                    format!(
                        "{} score={:.4} wait={:.4} transfer={:.4} protect={:.4} kv_held={}",
                        name(c.instance),
                        c.score,
                        c.terms.wait_s,
                        c.terms.transfer_s,
                        c.terms.decode_penalty_s + c.terms.kv_penalty_s,
                        c.tie_load
                    )
                })
                .collect();
            explained.push_str(&format!(" decode=[{}]", decode.join("; ")));
        }
        explained
    }
}

/// What the router records about a request sent to an instance. Only the router makes one (from
/// its decision, [`Decision::plan_for`]), so what it records is what it decided.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutePlan {
    /// Chained hashes of the prompt's blocks.
    pub(crate) block_hashes: Arc<[u64]>,
    /// Rendered prompt bytes.
    pub(crate) prompt_bytes: usize,
    /// Estimated prompt tokens.
    pub(crate) prompt_tokens: u32,
    /// Blocks predicted cached there.
    pub(crate) matched_blocks: u32,
    /// Tokens predicted cached there.
    pub(crate) predicted_cached_tokens: u32,
    /// Adapter requested.
    pub(crate) adapter: Option<String>,
    /// Output budget.
    pub(crate) max_tokens: u32,
    /// Sent as the decode half of a disaggregated request (no prefill work there).
    pub(crate) is_decode_only: bool,
    /// Sent as the prefill half of a disaggregated request (its engine generates one token).
    pub(crate) is_prefill_leg: bool,
    /// Seconds to the first token the decision expected there (wait + prefill + adapter +
    /// transfer), when the policy makes such an estimate.
    pub(crate) estimated_ttft_s: Option<f64>,
    /// The estimate's raw wait and prefill, learned from against the observed TTFT.
    pub(crate) raw_wait_prefill_s: (f64, f64),
    /// The adapter part of that estimate ...
    pub(crate) adapter_s: f64,
    /// ... and whether it was a plain load into a free slot (its first token measures one).
    pub(crate) loads_adapter: bool,
    /// Hash of the request's session key, if any: the routed instance becomes the session's
    /// last instance.
    pub(crate) session: Option<u64>,
    /// Both views' predictions there, when it had an exact one.
    pub(crate) views: Option<ViewPredictions>,
    /// The policy that decided, and what it keeps for its `on_routed` hook.
    pub(crate) policy: &'static str,
    /// What the policy computed while scoring, for that hook (`Policy::memo`).
    pub(crate) memo: Vec<u64>,
}

impl RoutePlan {
    /// A plan for a request the router did not decide (a leg sent where another decision
    /// said): its load is counted, nothing is predicted or indexed.
    pub fn unplanned(prompt_tokens: u32) -> RoutePlan {
        RoutePlan {
            block_hashes: Arc::from([]),
            prompt_bytes: 0,
            prompt_tokens,
            matched_blocks: 0,
            predicted_cached_tokens: 0,
            views: None,
            adapter: None,
            max_tokens: 0,
            is_decode_only: false,
            is_prefill_leg: false,
            estimated_ttft_s: None,
            raw_wait_prefill_s: (0.0, 0.0),
            adapter_s: 0.0,
            loads_adapter: false,
            session: None,
            policy: "",
            memo: Vec::new(),
        }
    }

    /// The adapter requested, if any.
    pub fn adapter(&self) -> Option<&str> {
        self.adapter.as_deref()
    }

    /// Whether this is the decode half of a disaggregated request.
    pub fn is_decode_only(&self) -> bool {
        self.is_decode_only
    }

    /// Estimated prompt tokens.
    pub fn prompt_tokens(&self) -> u32 {
        self.prompt_tokens
    }

    /// Output budget reserved.
    pub fn max_tokens(&self) -> u32 {
        self.max_tokens
    }

    /// Leading prompt blocks predicted held there.
    pub fn matched_blocks(&self) -> u32 {
        self.matched_blocks
    }

    /// Prompt tokens predicted served from its cache there.
    pub fn predicted_cached_tokens(&self) -> u32 {
        self.predicted_cached_tokens
    }

    /// The decision's time-to-first-token estimate there, if the policy makes one.
    pub fn estimated_ttft_s(&self) -> Option<f64> {
        self.estimated_ttft_s
    }

    /// Prompt blocks the routed instance will be indexed as holding.
    pub fn indexed_blocks(&self) -> usize {
        self.block_hashes.len()
    }
}
