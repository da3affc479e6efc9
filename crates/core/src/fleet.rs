//! The router's view of the fleet: instances, what they serve, and what it knows of their load.

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::decode_slope::DecodeSlope;
use crate::prefix::CacheSurvival;
use crate::running_median::RunningMedian;
use crate::shared_compute::SharedCompute;

pub use crate::id::{InstanceId, Slot};

/// What part of inference an instance does (disaggregated serving splits them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill only: hands the KV cache over to a decode instance.
    Prefill,
    /// Decode only: takes over requests prefilled elsewhere.
    Decode,
    /// Both phases (an ordinary engine).
    #[default]
    Both,
}

impl Role {
    /// Whether this instance can run a request's prefill.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Whether this instance can run a request's decode.
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

/// Static description of an instance, as configured or discovered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InstanceSpec {
    /// Unique name (usually the address).
    pub name: String,
    /// Where to send requests (`host:port` or a URL); opaque to the core.
    pub address: String,
    /// Prefill, decode or both.
    pub role: Role,
    /// Served model names (base models).
    pub models: Vec<String>,
    /// Adapters the instance can serve (registered on the engine).
    pub adapters: Vec<String>,
    /// Whether adapters not in `adapters` may be loaded at runtime (the gateway does the loading).
    pub runtime_adapter_loading: bool,
    /// Adapter slots on the accelerator (vLLM `--max-loras`).
    pub adapter_slots: u32,
    /// KV cache capacity in tokens, if known (from `vllm:cache_config_info` or configuration).
    pub kv_capacity_tokens: Option<u64>,
    /// Maximum sequences running at once (vLLM `--max-num-seqs`), if known.
    pub max_running: Option<u32>,
    /// Prior prefill speed for this instance in tokens/s (overrides the router-wide prior).
    pub prefill_tokens_per_s: Option<f64>,
    /// Relative capacity for the load-balancing baselines (round-robin, random, least-load,
    /// power-of-two), as nginx and Envoy weigh servers (1.0 = normal); `cost` and the
    /// cache-aware policies use what they measure instead.
    pub weight: f64,
}

impl Default for InstanceSpec {
    fn default() -> Self {
        InstanceSpec {
            name: String::new(),
            address: String::new(),
            role: Role::Both,
            models: Vec::new(),
            adapters: Vec::new(),
            runtime_adapter_loading: false,
            adapter_slots: 1,
            kv_capacity_tokens: None,
            max_running: None,
            prefill_tokens_per_s: None,
            weight: 1.0,
        }
    }
}

impl InstanceSpec {
    /// A both-role instance serving one model.
    pub fn new(name: impl Into<String>, model: impl Into<String>) -> Self {
        let name = name.into();
        InstanceSpec {
            address: name.clone(),
            name,
            models: vec![model.into()],
            ..Self::default()
        }
    }
}

/// Engine-side signals from the last metrics scrape.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineMetrics {
    /// Requests waiting in the engine's queue.
    pub waiting: u32,
    /// Requests running (in the batch).
    pub running: u32,
    /// KV cache usage, 0..=1, if the engine reports it.
    pub kv_usage: Option<f64>,
    /// Adapters of running requests.
    pub running_adapters: Vec<String>,
    /// Adapters requests are waiting for.
    pub waiting_adapters: Vec<String>,
    /// Adapter slots the engine reports (vLLM `max_lora`).
    pub max_adapters: Option<u32>,
    /// KV capacity in tokens the engine reports (blocks × block size).
    pub kv_capacity_tokens: Option<u64>,
    /// Sequences the engine runs at once, where it says so (llama.cpp's `/props` `total_slots`).
    pub max_running: Option<u32>,
}

/// Router-side accounting for one instance: exact and immediate, but blind to other routers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouterLoad {
    /// Routed requests that have not produced a first token.
    pub pending_requests: u32,
    /// Predicted uncached prompt tokens of those requests: prefill work queued ahead.
    pub pending_tokens: u64,
    /// Requests past their first token and not finished (decoding).
    pub running_requests: u32,
    /// Prompt tokens of every in-flight request ...
    pub kv_prompt_tokens: u64,
    /// ... and their `max_tokens`: with the share of it answers use, the KV they will occupy.
    pub kv_output_budget: u64,
}

impl RouterLoad {
    /// The KV the in-flight requests will occupy when answers use `output_share` of their
    /// `max_tokens` ([`crate::Router::output_share`]).
    pub fn kv_tokens(&self, output_share: f64) -> u64 {
        self.kv_prompt_tokens + (self.kv_output_budget as f64 * output_share).round() as u64
    }

    /// Every request in flight on the instance.
    pub fn in_flight(&self) -> u32 {
        self.pending_requests + self.running_requests
    }
}

/// Running totals of an instance's work, never reset: the difference between two readings is
/// what happened between them (the batch and the prefill beside one request's answer).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkTotals {
    /// Sequence-seconds decoded (the integral of the running count over time).
    pub running_area_s: f64,
    /// When `running_area_s` was last brought up to date (router clock, s).
    pub counted_at: f64,
    /// Uncached prompt tokens of every request that reached its first token here.
    pub prefilled_tokens: u64,
}

impl WorkTotals {
    /// Brings `running_area_s` up to `now` with `running` sequences decoding since the last
    /// reading; call before the running count changes.
    pub fn count_running(&mut self, running: u32, now: f64) {
        let dt = (now - self.counted_at).max(0.0);
        self.running_area_s += f64::from(running) * dt;
        self.counted_at = self.counted_at.max(now);
    }
}

/// What the router has learned about an instance from observed timings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Learned {
    /// Effective prefill throughput in tokens/s (includes queueing and batching effects).
    pub prefill_tokens_per_s: f64,
    /// Mean time a request holds a sequence slot (its prefill and decode, not its queueing), s.
    pub service_time_s: f64,
    /// Finished requests behind `service_time_s` (the prior counts until the first).
    pub service_samples: u32,
    /// Share of predicted cached tokens the engine actually reported as cached (0..=1).
    pub cache_trust: f64,
    /// Mean uncached prompt tokens per request sent here (to price engine-reported queues).
    pub mean_uncached_tokens: f64,
    /// How likely an indexed block is still held, by age, from the cached tokens reported.
    pub survival: CacheSurvival,
    /// Share of prompt tokens the engine reported served from its cache (moving average).
    pub hit_share: f64,
    /// The fewest cached tokens the engine ever reported above zero (0: none yet): the unit it
    /// caches in, at most (vLLM's 16-token blocks; a few tokens for llama.cpp).
    pub cache_unit_tokens: u32,
    /// Where the instance publishes KV events: how far the exact view's cached-token
    /// predictions missed the engine's reports (moving average of |predicted − reported| ÷
    /// prompt tokens) ...
    pub exact_error: f64,
    /// ... and the approximate index's, for the same requests: the view that predicts better
    /// is the one routed on.
    pub approx_error: f64,
    /// Finished requests behind those two averages.
    pub view_samples: u32,
    /// First tokens behind `prefill_tokens_per_s` (until it spans its averaging window, the
    /// speed is mostly the prior).
    pub speed_samples: u32,
    /// Sequences the engine runs at once, learned: the largest batch it reported while requests
    /// waited beside it for no other reason (llama.cpp's slots, vLLM's `max_num_seqs`).
    pub max_running: Option<u32>,
    /// How often every sequence slot is taken (a newcomer would wait for one).
    pub slot_pressure: SlotPressure,
    /// Tokens/s read off first tokens with less than `min_sample_tokens` of work (a moving
    /// average from the prior): mostly a step's time, not a prefill's, so never a speed itself;
    /// what it says is
    /// how this instance compares with the others, until it gives a full sample (the `cost` policy's
    /// priced speed).
    pub short_speed: f64,
    /// First tokens behind `short_speed`.
    pub short_samples: u32,
    /// What one more decoding sequence adds to every step here, learned.
    pub decode_slope: DecodeSlope,
    /// How much of its speed the instance loses per other busy instance, learned (0 on
    /// separate devices).
    pub shared_compute: SharedCompute,
    /// The part of its first tokens the `cost` estimate does not explain (HTTP, tokenizing,
    /// scheduling): the median of observed − estimated TTFT, added to the TTFT predictions the
    /// router reports (not to the scores: every candidate would pay it alike).
    pub ttft_fixed_s: RunningMedian,
    /// The same against the calibrated estimate ([`crate::calibration`]): each prediction
    /// carries its own fixed part.
    pub ttft_fixed_calibrated_s: RunningMedian,
}

/// The share of recent time an instance had every sequence slot taken. Prefill work added there
/// holds a slot longer, and each request waiting for one inherits the delay: at share `p` about
/// `p / (1 - p)` of them in a row (a geometric chain), so the share prices extra prefill work
/// beyond the request's own wait.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct SlotPressure {
    /// Time-weighted share of the last window with every slot taken (0..=1).
    pub share: f64,
    /// When `full` was last updated (router clock, s).
    #[serde(skip)]
    at: f64,
    /// Whether every slot was taken at `at`.
    #[serde(skip)]
    full: bool,
}

impl SlotPressure {
    /// Accounts the time since the last update in the state then, and records the state now.
    pub fn advance(&mut self, now: f64, full: bool, window_s: f64) {
        let dt = (now - self.at).max(0.0);
        let keep = (-dt / window_s.max(f64::MIN_POSITIVE)).exp();
        let then = if self.full { 1.0 } else { 0.0 };
        self.share = self.share * keep + then * (1.0 - keep);
        self.at = self.at.max(now);
        self.full = full;
    }
}

/// Adapters believed resident on the accelerator, most recently used first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdapterResidency {
    /// Resident adapters, most recently used first; at most `slots` long.
    pub resident: Vec<String>,
    /// When the router last caused an adapter to be loaded here (for the thrashing cooldown).
    pub last_load_at: Option<f64>,
}

impl AdapterResidency {
    /// Whether `adapter` is believed resident.
    pub fn is_resident(&self, adapter: &str) -> bool {
        self.resident.iter().any(|a| a == adapter)
    }

    /// Marks `adapter` as used now; returns true when it had to be loaded.
    pub fn touch(&mut self, adapter: &str, slots: u32, now: f64) -> bool {
        if let Some(pos) = self.resident.iter().position(|a| a == adapter) {
            let name = self.resident.remove(pos);
            self.resident.insert(0, name);
            return false;
        }
        self.resident.insert(0, adapter.to_string());
        self.resident.truncate(slots.max(1) as usize);
        self.last_load_at = Some(now);
        true
    }
}

/// Health as the router tracks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Takes traffic.
    #[default]
    Healthy,
    /// Failing health checks or refusing connections: takes no traffic.
    Unhealthy,
    /// Finishing its in-flight requests before removal: takes no new traffic.
    Draining,
}

/// One instance with everything the router knows about it.
#[derive(Debug, Clone)]
pub struct Instance {
    /// Handle.
    pub id: InstanceId,
    /// Static description.
    pub spec: InstanceSpec,
    /// Health.
    pub health: Health,
    /// Router-side accounting.
    pub load: RouterLoad,
    /// Last scraped engine metrics and when they were scraped.
    pub engine: Option<(EngineMetrics, f64)>,
    /// The router's own accounting when those metrics arrived: what the engine showed beyond
    /// it was sent by someone else.
    pub load_at_scrape: RouterLoad,
    /// Running totals for learning what its decode batch costs.
    pub totals: WorkTotals,
    /// Learned speeds.
    pub learned: Learned,
    /// Adapter residency.
    pub adapters: AdapterResidency,
}

/// An instance's load as the router prices it: its own exact accounting plus the engine's
/// excess at the last fresh scrape (other routers' traffic).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LoadView {
    /// Prefill work queued ahead, in tokens.
    pub pending_tokens: f64,
    /// Sequences decoding.
    pub running: u32,
    /// Requests in the instance at all.
    pub in_system: u32,
    /// KV usage 0..1, if the engine reports it.
    pub kv_usage: Option<f64>,
}

impl Instance {
    /// The load to price. The router's own counts are exact and immediate; a scrape is up to
    /// an interval old, and taking the larger of the two made an instance that had just
    /// drained look busy until the next scrape. So only what the engine held beyond what this
    /// router had sent it at scrape time (another router's requests) is added, while fresh.
    pub fn load_view(&self, now: f64, stale_after: f64) -> LoadView {
        let load = &self.load;
        let mut view = LoadView {
            pending_tokens: load.pending_tokens as f64,
            running: load.running_requests,
            in_system: load.in_flight(),
            kv_usage: None,
        };
        if let Some(m) = self.fresh_metrics(now, stale_after) {
            let ours = &self.load_at_scrape;
            let others = (m.waiting + m.running).saturating_sub(ours.in_flight());
            // Ours that had no first token may be queued or prefilling on the engine: only a
            // queue longer than all of them holds someone else's requests.
            let others_waiting = m.waiting.saturating_sub(ours.pending_requests).min(others);
            view.pending_tokens += f64::from(others_waiting) * self.learned.mean_uncached_tokens;
            view.running += others - others_waiting;
            view.in_system += others;
            view.kv_usage = m.kv_usage;
        }
        view
    }

    /// Engine metrics if scraped within `stale_after` seconds of `now`; stale ones are unknown.
    pub fn fresh_metrics(&self, now: f64, stale_after: f64) -> Option<&EngineMetrics> {
        self.engine
            .as_ref()
            .filter(|(_, at)| now - at <= stale_after)
            .map(|(m, _)| m)
    }

    /// KV capacity in tokens: the engine's report wins over configuration.
    pub fn kv_capacity_tokens(&self) -> Option<u64> {
        self.engine
            .as_ref()
            .and_then(|(m, _)| m.kv_capacity_tokens)
            .or(self.spec.kv_capacity_tokens)
    }

    /// Sequences the instance runs at once: configured, else the engine's own figure, else
    /// learned from its reports of requests waiting beside a full batch.
    pub fn max_running(&self) -> Option<u32> {
        self.spec
            .max_running
            .or_else(|| self.engine.as_ref().and_then(|(m, _)| m.max_running))
            .or(self.learned.max_running)
    }

    /// Adapter slots: the engine's report wins over configuration.
    pub fn adapter_slots(&self) -> u32 {
        self.engine
            .as_ref()
            .and_then(|(m, _)| m.max_adapters)
            .unwrap_or(self.spec.adapter_slots)
    }

    /// Whether the instance can serve `adapter` (resident, registered, or loadable at runtime).
    pub fn can_serve_adapter(&self, adapter: &str) -> bool {
        self.spec.runtime_adapter_loading
            || self.spec.adapters.iter().any(|a| a == adapter)
            || self.adapters.is_resident(adapter)
    }

    /// Whether the instance serves `model` as a base model.
    pub fn serves(&self, model: &str) -> bool {
        self.spec.models.iter().any(|m| m == model)
    }
}

/// All instances, addressable by slot, with a per-model list of slots for fast filtering.
#[derive(Debug, Default)]
pub struct Fleet {
    slots: Vec<Option<Instance>>,
    generations: Vec<u32>,
    free: Vec<Slot>,
    by_name: FxHashMap<String, Slot>,
    by_model: FxHashMap<String, Vec<Slot>>,
    /// Instances that can serve each adapter (registered on the engine, configured or loaded
    /// at runtime): where an adapter's name resolves to its base model.
    by_adapter: FxHashMap<String, Vec<Slot>>,
}

impl Fleet {
    /// Adds an instance, returning its handle; `learned` gives its starting estimates.
    pub fn add(&mut self, spec: InstanceSpec, learned: Learned) -> Result<InstanceId, String> {
        if self.by_name.contains_key(&spec.name) {
            return Err(spec.name);
        }
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                self.generations.push(0);
                (self.slots.len() - 1) as Slot
            }
        };
        let generation = self.generations[slot as usize];
        let id = InstanceId { slot, generation };
        for model in &spec.models {
            self.by_model.entry(model.clone()).or_default().push(slot);
        }
        for adapter in &spec.adapters {
            self.by_adapter
                .entry(adapter.clone())
                .or_default()
                .push(slot);
        }
        self.by_name.insert(spec.name.clone(), slot);
        let residency = AdapterResidency::default();
        self.slots[slot as usize] = Some(Instance {
            id,
            spec,
            health: Health::Healthy,
            load: RouterLoad::default(),
            engine: None,
            load_at_scrape: RouterLoad::default(),
            totals: WorkTotals::default(),
            learned,
            adapters: residency,
        });
        Ok(id)
    }

    /// Removes an instance; returns it if the handle was current.
    pub fn remove(&mut self, id: InstanceId) -> Option<Instance> {
        self.get(id)?;
        let instance = self.slots[id.slot as usize].take()?;
        self.generations[id.slot as usize] = id.generation.wrapping_add(1);
        self.free.push(id.slot);
        self.by_name.remove(&instance.spec.name);
        for model in &instance.spec.models {
            unlist(&mut self.by_model, model, id.slot);
        }
        for adapter in &instance.spec.adapters {
            unlist(&mut self.by_adapter, adapter, id.slot);
        }
        Some(instance)
    }

    /// Records that the instance can serve `adapter` now (loaded at runtime).
    pub fn register_adapter(&mut self, id: InstanceId, adapter: &str) -> bool {
        let Some(instance) = self.get_mut(id) else {
            return false;
        };
        if !instance.spec.adapters.iter().any(|a| a == adapter) {
            instance.spec.adapters.push(adapter.to_string());
            self.by_adapter
                .entry(adapter.to_string())
                .or_default()
                .push(id.slot);
        }
        true
    }

    /// Records that the instance no longer serves `adapter` (unloaded).
    pub fn unregister_adapter(&mut self, id: InstanceId, adapter: &str) -> bool {
        let Some(instance) = self.get_mut(id) else {
            return false;
        };
        let before = instance.spec.adapters.len();
        instance.spec.adapters.retain(|a| a != adapter);
        if instance.spec.adapters.len() != before {
            unlist(&mut self.by_adapter, adapter, id.slot);
        }
        true
    }

    /// The base model an adapter runs on (that of the first instance serving it), if any
    /// instance serves it.
    pub fn adapter_base(&self, adapter: &str) -> Option<&str> {
        let slot = *self.by_adapter.get(adapter)?.first()?;
        self.by_slot(slot)?.spec.models.first().map(String::as_str)
    }

    /// Every adapter some instance serves, with its base model.
    pub fn adapters(&self) -> impl Iterator<Item = (&str, &str)> {
        self.by_adapter
            .keys()
            .filter_map(|a| Some((a.as_str(), self.adapter_base(a)?)))
    }

    /// The instance behind a handle, if it is still current.
    pub fn get(&self, id: InstanceId) -> Option<&Instance> {
        self.slots
            .get(id.slot as usize)?
            .as_ref()
            .filter(|i| i.id.generation == id.generation)
    }

    /// Mutable access to the instance behind a handle, if it is still current.
    pub fn get_mut(&mut self, id: InstanceId) -> Option<&mut Instance> {
        self.slots
            .get_mut(id.slot as usize)?
            .as_mut()
            .filter(|i| i.id.generation == id.generation)
    }

    /// The instance in a slot.
    pub fn by_slot(&self, slot: Slot) -> Option<&Instance> {
        self.slots.get(slot as usize)?.as_ref()
    }

    /// Handle of the instance with this name.
    pub fn id_of(&self, name: &str) -> Option<InstanceId> {
        let slot = *self.by_name.get(name)?;
        self.by_slot(slot).map(|i| i.id)
    }

    /// Slots of the instances serving `model`, in insertion order.
    pub fn serving(&self, model: &str) -> &[Slot] {
        self.by_model.get(model).map_or(&[], |v| v.as_slice())
    }

    /// Every instance.
    pub fn iter(&self) -> impl Iterator<Item = &Instance> {
        self.slots.iter().flatten()
    }

    /// Every served model name.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.by_model.keys().map(|m| m.as_str())
    }

    /// Number of instances.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether there are no instances.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// One past the largest slot in use (size for per-slot scratch arrays).
    pub fn slot_bound(&self) -> usize {
        self.slots.len()
    }
}

/// Removes `slot` from `key`'s list (and the key with its last slot).
fn unlist(index: &mut FxHashMap<String, Vec<Slot>>, key: &str, slot: Slot) {
    if let Some(slots) = index.get_mut(key) {
        slots.retain(|&s| s != slot);
        if slots.is_empty() {
            index.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn learned() -> Learned {
        Learned {
            prefill_tokens_per_s: 1000.0,
            service_time_s: 1.0,
            service_samples: 0,
            cache_trust: 1.0,
            mean_uncached_tokens: 100.0,
            survival: Default::default(),
            hit_share: 0.0,
            cache_unit_tokens: 0,
            exact_error: 0.0,
            approx_error: 0.0,
            view_samples: 0,
            speed_samples: 0,
            max_running: None,
            slot_pressure: SlotPressure::default(),
            short_speed: 0.0,
            short_samples: 0,
            decode_slope: Default::default(),
            shared_compute: Default::default(),
            ttft_fixed_s: crate::running_median::RunningMedian::new(0.01),
            ttft_fixed_calibrated_s: crate::running_median::RunningMedian::new(0.01),
        }
    }

    #[test]
    fn slot_pressure_is_the_time_share_with_every_slot_taken() {
        let mut p = SlotPressure::default();
        // Full for 1 s, free for 1 s, over many windows: half the time.
        for k in 0..200 {
            p.advance(f64::from(k), k % 2 == 0, 30.0);
        }
        assert!((p.share - 0.5).abs() < 0.02, "{}", p.share);
        // Free for a whole window: most of it is forgotten; an update from the past changes
        // nothing (clocks of two drivers).
        p.advance(230.0, false, 30.0);
        let free = p.share;
        assert!(free < 0.5 * (-1.0f64).exp() + 0.01, "{free}");
        p.advance(100.0, true, 30.0);
        assert_eq!(p.share, free);
    }

    #[test]
    fn removed_handles_never_match_a_reused_slot() {
        let mut fleet = Fleet::default();
        let a = fleet.add(InstanceSpec::new("a", "m"), learned()).unwrap();
        fleet.remove(a).unwrap();
        let b = fleet.add(InstanceSpec::new("b", "m"), learned()).unwrap();
        assert_eq!(a.slot, b.slot);
        assert!(fleet.get(a).is_none());
        assert_eq!(fleet.get(b).unwrap().spec.name, "b");
        assert!(fleet.remove(a).is_none());
        assert_eq!(fleet.serving("m"), &[b.slot]);
    }

    #[test]
    fn duplicate_names_are_refused() {
        let mut fleet = Fleet::default();
        fleet.add(InstanceSpec::new("a", "m"), learned()).unwrap();
        assert!(fleet.add(InstanceSpec::new("a", "n"), learned()).is_err());
    }

    #[test]
    fn adapter_residency_is_an_lru_of_slots() {
        let mut r = AdapterResidency::default();
        assert!(r.touch("x", 2, 1.0));
        assert!(r.touch("y", 2, 2.0));
        assert!(!r.touch("x", 2, 3.0));
        assert!(r.touch("z", 2, 4.0)); // evicts y, the least recently used
        assert_eq!(r.resident, vec!["z".to_string(), "x".to_string()]);
        assert_eq!(r.last_load_at, Some(4.0));
    }

    #[test]
    fn stale_metrics_are_unknown() {
        let mut fleet = Fleet::default();
        let a = fleet.add(InstanceSpec::new("a", "m"), learned()).unwrap();
        fleet.get_mut(a).unwrap().engine = Some((EngineMetrics::default(), 10.0));
        let i = fleet.get(a).unwrap();
        assert!(i.fresh_metrics(12.0, 5.0).is_some());
        assert!(i.fresh_metrics(15.5, 5.0).is_none());
    }

    #[test]
    fn the_load_view_adds_only_what_the_engine_held_beyond_this_router() {
        let mut fleet = Fleet::default();
        let a = fleet.add(InstanceSpec::new("a", "m"), learned()).unwrap();
        let i = fleet.get_mut(a).unwrap();
        i.learned.mean_uncached_tokens = 100.0;
        // At the scrape the router had 3 requests without a first token and 1 decoding; the
        // engine showed exactly those.
        i.load = RouterLoad {
            pending_requests: 3,
            pending_tokens: 300,
            running_requests: 1,
            kv_prompt_tokens: 0,
            kv_output_budget: 0,
        };
        i.load_at_scrape = i.load.clone();
        let metrics = |waiting, running| EngineMetrics {
            waiting,
            running,
            ..EngineMetrics::default()
        };
        i.engine = Some((metrics(2, 2), 10.0));
        let v = i.load_view(10.5, 5.0);
        assert_eq!((v.pending_tokens, v.running, v.in_system), (300.0, 1, 4));
        // They all finished before the next scrape: the instance is idle, not as busy as the
        // scrape said.
        i.load = RouterLoad::default();
        let v = i.load_view(10.6, 5.0);
        assert_eq!((v.pending_tokens, v.running, v.in_system), (0.0, 0, 0));
        // Another router's requests: 5 more than ours; at least 2 of them queued (ours without
        // a first token may have been the other 3 in the queue).
        i.engine = Some((metrics(5, 4), 10.0));
        let v = i.load_view(10.6, 5.0);
        assert_eq!((v.pending_tokens, v.running, v.in_system), (200.0, 3, 5));
        // Once stale, only the router's own view is left.
        assert_eq!(i.load_view(16.0, 5.0).in_system, 0);
    }
}
