//! Dynamic LoRA adapter placement: which adapter to load onto, or unload from, which instance.
//!
//! Pure, like the rest of the core: the caller passes the time in. The gateway feeds each
//! dispatched adapter request to [`Planner::record`], asks for a plan every
//! `placement.interval_s` ([`Planner::plan`]) with the fleet as it sees it, executes the actions
//! with vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, and reports each outcome
//! back ([`Planner::applied`]).
//!
//! Rules (settings in [`PlacementConfig`]):
//!
//! * **Demand** is an exponentially decayed request rate per adapter (half-life
//!   `half_life_s`); what matters is the demand per holder, `d / n`, with `n` the available
//!   instances that hold the adapter.
//! * **Scale up**: when `d / n > scale_up_rps` (or `n = 0` with demand), the adapter is loaded
//!   onto one more available instance serving its base model, into a free slot (least loaded
//!   first); with no free slot anywhere, it may take the slot of the coldest copy of another
//!   adapter, only if that copy is much colder (its demand per holder times `eviction_ratio` is
//!   at most the newcomer's, counted with the new holder) and losing it would not push that
//!   adapter over `scale_up_rps` itself.
//! * **Scale down**: when even one holder fewer would stay below `scale_down_rps`
//!   (`d / (n - 1) < scale_down_rps`), one copy is unloaded. `scale_down_rps < scale_up_rps`
//!   is the hysteresis band: with constant demand an adapter's holder count only ever moves
//!   towards the band and stops there, so the plan reaches a fixed point.
//! * **Guards**: an instance changed less than `cooldown_s` ago is not touched (a swap, an
//!   unload plus a load in one plan, is one change); a copy younger than `min_residency_s` is
//!   never unloaded; the last available holder of an adapter is never unloaded; only adapters
//!   with a known path (`loadable`) are loaded or unloaded; a load never goes where the adapter
//!   already is, nor beyond the instance's slots; at most `max_actions` actions per plan.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

pub use crate::config::PlacementConfig;

/// Exponentially decayed request rate per adapter: each request adds `ln 2 / half_life`, which
/// decays with the half-life, so a steady stream of `r` requests/s reads `r`.
#[derive(Debug, Clone)]
pub struct DemandTracker {
    /// Decay constant, `ln 2 / half_life` per second.
    lambda: f64,
    /// Adapter -> (rate at `at`, `at`).
    rates: FxHashMap<String, (f64, f64)>,
}

impl DemandTracker {
    /// A tracker with the given half-life in seconds (must be > 0).
    pub fn new(half_life_s: f64) -> Self {
        DemandTracker {
            lambda: std::f64::consts::LN_2 / half_life_s,
            rates: FxHashMap::default(),
        }
    }

    fn decayed(&self, value: f64, at: f64, now: f64) -> f64 {
        value * (-self.lambda * (now - at).max(0.0)).exp()
    }

    /// Counts one request for `adapter` at `now`.
    pub fn record(&mut self, adapter: &str, now: f64) {
        let lambda = self.lambda;
        match self.rates.get_mut(adapter) {
            Some((value, at)) => {
                let v = *value * (-lambda * (now - *at).max(0.0)).exp();
                *value = v + lambda;
                *at = now.max(*at);
            }
            None => {
                self.rates.insert(adapter.to_string(), (lambda, now));
            }
        }
    }

    /// The decayed request rate of `adapter` at `now`, in requests/s.
    pub fn rate(&self, adapter: &str, now: f64) -> f64 {
        self.rates
            .get(adapter)
            .map_or(0.0, |&(value, at)| self.decayed(value, at, now))
    }

    /// Forgets adapters whose rate fell below `below` (bounds memory).
    pub fn prune(&mut self, now: f64, below: f64) {
        let lambda = self.lambda;
        self.rates
            .retain(|_, &mut (value, at)| value * (-lambda * (now - at).max(0.0)).exp() >= below);
    }

    /// Adapters with a tracked rate.
    pub fn len(&self) -> usize {
        self.rates.len()
    }

    /// Whether no adapter has a tracked rate.
    pub fn is_empty(&self) -> bool {
        self.rates.is_empty()
    }
}

/// One instance as the planner sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceView {
    /// Unique name.
    pub name: String,
    /// Base models it serves.
    pub models: Vec<String>,
    /// Adapter slots (vLLM `max_lora`); the planner keeps at most this many adapters there.
    pub slots: u32,
    /// Adapters registered there now.
    pub adapters: Vec<String>,
    /// Takes traffic (healthy, not draining): only available instances count as holders and
    /// only they are changed.
    pub available: bool,
    /// Requests in flight there (prefers the least loaded target).
    pub load: f64,
}

/// One adapter as the planner sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterView {
    /// Adapter name.
    pub name: String,
    /// Base model it applies to.
    pub base_model: String,
    /// Whether its path is known, so that it can be loaded (and may therefore be unloaded).
    pub loadable: bool,
}

/// One step of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PlacementAction {
    /// Load `adapter` onto `instance`.
    Load {
        /// Adapter name.
        adapter: String,
        /// Instance name.
        instance: String,
    },
    /// Unload `adapter` from `instance`.
    Unload {
        /// Adapter name.
        adapter: String,
        /// Instance name.
        instance: String,
    },
}

impl PlacementAction {
    /// The adapter acted on.
    pub fn adapter(&self) -> &str {
        match self {
            PlacementAction::Load { adapter, .. } | PlacementAction::Unload { adapter, .. } => {
                adapter
            }
        }
    }

    /// The instance acted on.
    pub fn instance(&self) -> &str {
        match self {
            PlacementAction::Load { instance, .. } | PlacementAction::Unload { instance, .. } => {
                instance
            }
        }
    }

    /// `load` or `unload` (metric label).
    pub fn kind(&self) -> &'static str {
        match self {
            PlacementAction::Load { .. } => "load",
            PlacementAction::Unload { .. } => "unload",
        }
    }
}

/// The placement planner: demand, per-instance last change and per-copy age, and the plan.
#[derive(Debug, Clone)]
pub struct Planner {
    config: PlacementConfig,
    demand: DemandTracker,
    /// Instance -> when a plan last changed it.
    last_change: FxHashMap<String, f64>,
    /// (instance, adapter) -> since when the copy is there (load time, or first seen).
    since: FxHashMap<(String, String), f64>,
}

/// Rates below this are zero (pruned from the tracker).
const NEGLIGIBLE_RPS: f64 = 1e-6;

impl Planner {
    /// A planner with these settings (validated by [`PlacementConfig::validate`]).
    pub fn new(config: PlacementConfig) -> Self {
        Planner {
            demand: DemandTracker::new(config.half_life_s),
            config,
            last_change: FxHashMap::default(),
            since: FxHashMap::default(),
        }
    }

    /// Settings in force.
    pub fn config(&self) -> &PlacementConfig {
        &self.config
    }

    /// Counts one request for `adapter` at `now`.
    pub fn record(&mut self, adapter: &str, now: f64) {
        self.demand.record(adapter, now);
    }

    /// Demand of `adapter` at `now`, in requests/s.
    pub fn demand(&self, adapter: &str, now: f64) -> f64 {
        self.demand.rate(adapter, now)
    }

    /// When a plan last changed `instance`.
    pub fn last_change(&self, instance: &str) -> Option<f64> {
        self.last_change.get(instance).copied()
    }

    /// Records the outcome of an action: a successful load starts the copy's residency clock,
    /// a successful unload forgets it. Either way the instance's cooldown runs from the plan.
    pub fn applied(&mut self, action: &PlacementAction, ok: bool, now: f64) {
        if !ok {
            return;
        }
        let key = (action.instance().to_string(), action.adapter().to_string());
        match action {
            PlacementAction::Load { .. } => {
                self.since.insert(key, now);
            }
            PlacementAction::Unload { .. } => {
                self.since.remove(&key);
            }
        }
    }

    fn in_cooldown(&self, instance: &str, now: f64) -> bool {
        self.last_change
            .get(instance)
            .is_some_and(|&at| now - at < self.config.cooldown_s)
    }

    fn old_enough(&self, instance: &str, adapter: &str, now: f64) -> bool {
        self.since
            .get(&(instance.to_string(), adapter.to_string()))
            .is_none_or(|&at| now - at >= self.config.min_residency_s)
    }

    /// Plans at most `max_actions` loads and unloads for the fleet as it is now; the instances
    /// acted on start their cooldown at `now` (whether or not the actions succeed). Actions on
    /// one instance come in the order to execute them (an unload that makes room first).
    pub fn plan(
        &mut self,
        instances: &[InstanceView],
        adapters: &[AdapterView],
        now: f64,
    ) -> Vec<PlacementAction> {
        self.demand.prune(now, NEGLIGIBLE_RPS);
        // Residency clocks: keep those of copies still there, start those of new ones.
        let mut since = FxHashMap::default();
        for i in instances {
            for a in &i.adapters {
                let key = (i.name.clone(), a.clone());
                let at = self.since.get(&key).copied().unwrap_or(now);
                since.insert(key, at);
            }
        }
        self.since = since;
        self.last_change
            .retain(|_, at| now - *at < self.config.cooldown_s);

        let cfg = self.config.clone();
        let by_name: BTreeMap<&str, &AdapterView> =
            adapters.iter().map(|a| (a.name.as_str(), a)).collect();
        let demand: BTreeMap<&str, f64> = by_name
            .keys()
            .map(|&a| (a, self.demand.rate(a, now)))
            .collect();
        // Available holders per adapter.
        let mut holders: BTreeMap<&str, usize> = by_name.keys().map(|&a| (a, 0)).collect();
        for i in instances.iter().filter(|i| i.available) {
            for a in &i.adapters {
                if let Some(n) = holders.get_mut(a.as_str()) {
                    *n += 1;
                }
            }
        }
        let mut held: Vec<Vec<&str>> = instances
            .iter()
            .map(|i| i.adapters.iter().map(String::as_str).collect())
            .collect();
        let mut touched = vec![false; instances.len()];
        let changeable: Vec<bool> = instances
            .iter()
            .map(|i| i.available && !self.in_cooldown(&i.name, now))
            .collect();
        let per_holder = |d: f64, n: usize| if n == 0 { f64::INFINITY } else { d / n as f64 };
        let mut actions = Vec::new();
        let mut budget = cfg.max_actions as usize;

        // Scale up, the hottest adapter (per holder) first.
        let mut hot: Vec<(&str, f64)> = by_name
            .values()
            .filter(|a| a.loadable)
            .map(|a| {
                let d = demand[a.name.as_str()];
                (a.name.as_str(), d)
            })
            .filter(|&(a, d)| d > NEGLIGIBLE_RPS && per_holder(d, holders[a]) > cfg.scale_up_rps)
            .collect();
        hot.sort_by(|x, y| {
            per_holder(y.1, holders[y.0])
                .total_cmp(&per_holder(x.1, holders[x.0]))
                .then(x.0.cmp(y.0))
        });
        for (adapter, d) in hot {
            if budget == 0 {
                break;
            }
            let base = by_name[adapter].base_model.as_str();
            let n = holders[adapter];
            let target_ok = |k: usize| {
                changeable[k]
                    && !touched[k]
                    && instances[k].slots > 0
                    && instances[k].models.iter().any(|m| m == base)
                    && !held[k].contains(&adapter)
            };
            // A free slot, least loaded first.
            let free = (0..instances.len())
                .filter(|&k| target_ok(k) && (held[k].len() as u32) < instances[k].slots)
                .min_by(|&x, &y| {
                    let (a, b) = (&instances[x], &instances[y]);
                    a.load
                        .total_cmp(&b.load)
                        .then(held[x].len().cmp(&held[y].len()))
                        .then(a.name.cmp(&b.name))
                });
            if let Some(k) = free {
                actions.push(PlacementAction::Load {
                    adapter: adapter.to_string(),
                    instance: instances[k].name.clone(),
                });
                budget -= 1;
                touched[k] = true;
                held[k].push(adapter);
                *holders.entry(adapter).or_default() += 1;
                continue;
            }
            if budget < 2 {
                continue;
            }
            // Otherwise the slot of a much colder copy: (instance, victim, its demand per holder).
            let newcomer = d / (n + 1) as f64;
            let mut best: Option<(usize, &str, f64)> = None;
            for k in (0..instances.len()).filter(|&k| target_ok(k)) {
                for &victim in &held[k] {
                    let Some(v) = by_name.get(victim) else {
                        continue;
                    };
                    let nv = holders[victim];
                    let dv = demand[victim];
                    let evictable = v.loadable
                        && nv >= 2
                        && self.old_enough(&instances[k].name, victim, now)
                        && dv / (nv - 1) as f64 <= cfg.scale_up_rps
                        && (dv / nv as f64) * cfg.eviction_ratio <= newcomer;
                    if !evictable {
                        continue;
                    }
                    let pv = dv / nv as f64;
                    let better = best.is_none_or(|(bk, bv, bp)| {
                        pv.total_cmp(&bp)
                            .then(instances[k].load.total_cmp(&instances[bk].load))
                            .then(instances[k].name.cmp(&instances[bk].name))
                            .then(victim.cmp(bv))
                            .is_lt()
                    });
                    if better {
                        best = Some((k, victim, pv));
                    }
                }
            }
            if let Some((k, victim, _)) = best {
                let instance = instances[k].name.clone();
                actions.push(PlacementAction::Unload {
                    adapter: victim.to_string(),
                    instance: instance.clone(),
                });
                actions.push(PlacementAction::Load {
                    adapter: adapter.to_string(),
                    instance,
                });
                budget -= 2;
                touched[k] = true;
                held[k].retain(|&a| a != victim);
                held[k].push(adapter);
                if let Some(nv) = holders.get_mut(victim) {
                    *nv -= 1;
                }
                *holders.entry(adapter).or_default() += 1;
            }
        }

        // Scale down: one copy of each adapter that would stay below the band without it.
        for a in by_name.values().filter(|a| a.loadable) {
            if budget == 0 {
                break;
            }
            let name = a.name.as_str();
            let n = holders[name];
            if n < 2 || demand[name] / (n - 1) as f64 >= cfg.scale_down_rps {
                continue;
            }
            let victim = (0..instances.len())
                .filter(|&k| {
                    changeable[k]
                        && !touched[k]
                        && held[k].contains(&name)
                        && self.old_enough(&instances[k].name, name, now)
                })
                .max_by(|&x, &y| {
                    let (a, b) = (&instances[x], &instances[y]);
                    a.load.total_cmp(&b.load).then(b.name.cmp(&a.name))
                });
            if let Some(k) = victim {
                actions.push(PlacementAction::Unload {
                    adapter: name.to_string(),
                    instance: instances[k].name.clone(),
                });
                budget -= 1;
                touched[k] = true;
                held[k].retain(|&x| x != name);
                if let Some(n) = holders.get_mut(name) {
                    *n -= 1;
                }
            }
        }

        for (k, t) in touched.iter().enumerate() {
            if *t {
                self.last_change.insert(instances[k].name.clone(), now);
            }
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const M: &str = "base";

    fn config() -> PlacementConfig {
        PlacementConfig {
            enabled: true,
            interval_s: 1.0,
            half_life_s: 10.0,
            scale_up_rps: 4.0,
            scale_down_rps: 1.0,
            cooldown_s: 30.0,
            min_residency_s: 60.0,
            max_actions: 4,
            eviction_ratio: 4.0,
        }
    }

    fn instance(name: &str, slots: u32, adapters: &[&str]) -> InstanceView {
        InstanceView {
            name: name.into(),
            models: vec![M.into()],
            slots,
            adapters: adapters.iter().map(|a| a.to_string()).collect(),
            available: true,
            load: 0.0,
        }
    }

    fn adapter(name: &str, loadable: bool) -> AdapterView {
        AdapterView {
            name: name.into(),
            base_model: M.into(),
            loadable,
        }
    }

    /// Feeds `rate` requests/s of `adapter` evenly over `[from, to)`.
    fn feed(p: &mut Planner, adapter: &str, rate: f64, from: f64, to: f64) {
        if rate <= 0.0 {
            return;
        }
        // Arrivals at k / rate: the same grid whatever the window, so windows chain evenly.
        let mut k = (from * rate).ceil();
        while k / rate < to {
            p.record(adapter, k / rate);
            k += 1.0;
        }
    }

    /// Applies actions to the views (all succeed).
    fn apply(p: &mut Planner, fleet: &mut [InstanceView], actions: &[PlacementAction], now: f64) {
        for a in actions {
            let i = fleet
                .iter_mut()
                .find(|i| i.name == a.instance())
                .expect("known instance");
            match a {
                PlacementAction::Load { adapter, .. } => i.adapters.push(adapter.clone()),
                PlacementAction::Unload { adapter, .. } => i.adapters.retain(|x| x != adapter),
            }
            p.applied(a, true, now);
        }
    }

    #[test]
    fn demand_reads_a_steady_rate_and_halves_with_the_half_life() {
        let mut d = DemandTracker::new(5.0);
        let mut t = 0.0;
        while t < 100.0 {
            d.record("x", t);
            t += 0.1;
        }
        let r = d.rate("x", 100.0);
        assert!((r - 10.0).abs() < 0.5, "{r}");
        let later = d.rate("x", 105.0);
        assert!((later - r / 2.0).abs() < 1e-9, "{later}");
        assert_eq!(d.rate("y", 100.0), 0.0);
        d.prune(1000.0, 1e-6);
        assert!(d.is_empty());
    }

    #[test]
    fn a_hot_adapter_gets_a_free_slot_on_the_least_loaded_instance() {
        let mut p = Planner::new(config());
        feed(&mut p, "x", 10.0, 0.0, 60.0);
        let mut busy = instance("b", 2, &[]);
        busy.load = 5.0;
        let fleet = vec![instance("a", 2, &["x"]), busy, instance("c", 2, &[])];
        let plan = p.plan(&fleet, &[adapter("x", true)], 60.0);
        assert_eq!(
            plan,
            vec![PlacementAction::Load {
                adapter: "x".into(),
                instance: "c".into()
            }]
        );
        assert_eq!(p.last_change("c"), Some(60.0));
    }

    #[test]
    fn an_adapter_without_a_path_is_never_loaded() {
        let mut p = Planner::new(config());
        feed(&mut p, "x", 50.0, 0.0, 60.0);
        let fleet = vec![instance("a", 2, &["x"]), instance("b", 2, &[])];
        assert!(p.plan(&fleet, &[adapter("x", false)], 60.0).is_empty());
    }

    #[test]
    fn moderate_demand_stays_put_inside_the_band() {
        let mut p = Planner::new(config());
        // 3 requests/s on one holder: under scale_up (4), over scale_down (1).
        feed(&mut p, "x", 3.0, 0.0, 100.0);
        let fleet = vec![instance("a", 2, &["x"]), instance("b", 2, &[])];
        assert!(p.plan(&fleet, &[adapter("x", true)], 100.0).is_empty());
    }

    #[test]
    fn a_cold_extra_copy_is_unloaded_but_never_the_last_one() {
        let mut p = Planner::new(config());
        let fleet = vec![instance("a", 2, &["x"]), instance("b", 2, &["x"])];
        let adapters = [adapter("x", true)];
        // Young copies (first seen now) are kept for min_residency_s.
        assert!(p.plan(&fleet, &adapters, 0.0).is_empty());
        let plan = p.plan(&fleet, &adapters, 61.0);
        assert_eq!(plan.len(), 1);
        assert!(matches!(plan[0], PlacementAction::Unload { .. }));
        let one = vec![instance("a", 2, &["x"]), instance("b", 2, &[])];
        assert!(p.plan(&one, &adapters, 200.0).is_empty());
    }

    #[test]
    fn cooldown_blocks_a_second_change_on_the_same_instance() {
        let mut p = Planner::new(config());
        feed(&mut p, "x", 20.0, 0.0, 60.0);
        feed(&mut p, "y", 20.0, 0.0, 60.0);
        let mut fleet = vec![instance("a", 2, &["x", "y"]), instance("b", 2, &[])];
        let adapters = [adapter("x", true), adapter("y", true)];
        let plan = p.plan(&fleet, &adapters, 60.0);
        // Only one change per instance per plan, and b is the only target.
        assert_eq!(plan.len(), 1, "{plan:?}");
        apply(&mut p, &mut fleet, &plan, 60.0);
        feed(&mut p, "x", 20.0, 60.0, 70.0);
        feed(&mut p, "y", 20.0, 60.0, 70.0);
        assert!(p.plan(&fleet, &adapters, 70.0).is_empty());
        // After the cooldown the other one follows.
        feed(&mut p, "x", 20.0, 70.0, 91.0);
        feed(&mut p, "y", 20.0, 70.0, 91.0);
        let plan = p.plan(&fleet, &adapters, 91.0);
        assert_eq!(plan.len(), 1, "{plan:?}");
        assert_eq!(plan[0].instance(), "b");
    }

    #[test]
    fn a_full_instance_swaps_only_a_much_colder_copy() {
        let adapters = [
            adapter("hot", true),
            adapter("warm", true),
            adapter("cold", true),
        ];
        // b's slot holds a copy of `cold` (also on a); `hot` lives on a only.
        let fleet = vec![
            instance("a", 3, &["hot", "warm", "cold"]),
            instance("b", 1, &["cold"]),
        ];
        let mut p = Planner::new(config());
        p.plan(&fleet, &adapters, 0.0);
        feed(&mut p, "hot", 20.0, 0.0, 100.0);
        feed(&mut p, "cold", 2.0, 0.0, 100.0);
        let plan = p.plan(&fleet, &adapters, 100.0);
        assert_eq!(
            plan,
            vec![
                PlacementAction::Unload {
                    adapter: "cold".into(),
                    instance: "b".into()
                },
                PlacementAction::Load {
                    adapter: "hot".into(),
                    instance: "b".into()
                },
            ]
        );
        // Not much colder: 8 requests/s on cold (4 per holder, times 4 > 10 per holder).
        let mut p = Planner::new(config());
        p.plan(&fleet, &adapters, 0.0);
        feed(&mut p, "hot", 20.0, 0.0, 100.0);
        feed(&mut p, "cold", 8.0, 0.0, 100.0);
        assert!(p.plan(&fleet, &adapters, 100.0).is_empty());
        // One action left in the budget: no half swap.
        let mut p = Planner::new(PlacementConfig {
            max_actions: 1,
            ..config()
        });
        p.plan(&fleet, &adapters, 0.0);
        feed(&mut p, "hot", 20.0, 0.0, 100.0);
        feed(&mut p, "cold", 2.0, 0.0, 100.0);
        assert!(p.plan(&fleet, &adapters, 100.0).is_empty());
    }

    #[test]
    fn unavailable_holders_do_not_count_and_are_not_changed() {
        let mut p = Planner::new(config());
        feed(&mut p, "x", 2.0, 0.0, 60.0);
        let mut down = instance("a", 1, &["x"]);
        down.available = false;
        let fleet = vec![down, instance("b", 1, &[])];
        // The only holder is down: x goes to b even at low demand.
        let plan = p.plan(&fleet, &[adapter("x", true)], 60.0);
        assert_eq!(plan.len(), 1);
        assert_eq!(plan[0].instance(), "b");
    }

    #[test]
    fn settings_are_validated() {
        let mut c = config();
        c.validate().unwrap();
        c.scale_down_rps = c.scale_up_rps;
        assert_eq!(c.validate().unwrap_err().key, "placement.scale_down_rps");
        let mut c = config();
        c.max_actions = 0;
        assert_eq!(c.validate().unwrap_err().key, "placement.max_actions");
        let mut c = config();
        c.eviction_ratio = 0.5;
        assert_eq!(c.validate().unwrap_err().key, "placement.eviction_ratio");
        let mut c = crate::RouterConfig::default();
        c.placement.half_life_s = 0.0;
        assert_eq!(c.validate().unwrap_err().key, "placement.half_life_s");
    }

    #[derive(Debug, Clone)]
    struct Setup {
        slots: Vec<u32>,
        /// Initial holder of each adapter (index into instances), plus extra copies.
        homes: Vec<usize>,
        extra: Vec<(usize, usize)>,
    }

    fn setup() -> impl Strategy<Value = Setup> {
        (2usize..5, 1usize..5).prop_flat_map(|(n_inst, n_ad)| {
            (
                proptest::collection::vec(1u32..4, n_inst),
                proptest::collection::vec(0..n_inst, n_ad),
                proptest::collection::vec((0..n_inst, 0..n_ad), 0..4),
            )
                .prop_map(|(slots, homes, extra)| Setup {
                    slots,
                    homes,
                    extra,
                })
        })
    }

    fn build(s: &Setup) -> (Vec<InstanceView>, Vec<AdapterView>) {
        let mut fleet: Vec<InstanceView> = s
            .slots
            .iter()
            .enumerate()
            .map(|(k, &slots)| instance(&format!("i{k}"), slots, &[]))
            .collect();
        let adapters: Vec<AdapterView> = (0..s.homes.len())
            .map(|a| adapter(&format!("a{a}"), true))
            .collect();
        for (a, &k) in s.homes.iter().enumerate() {
            fleet[k].adapters.push(format!("a{a}"));
        }
        for &(k, a) in &s.extra {
            let name = format!("a{a}");
            if !fleet[k].adapters.contains(&name) {
                fleet[k].adapters.push(name);
            }
        }
        (fleet, adapters)
    }

    /// Runs one plan and checks the invariants every plan must keep.
    fn checked_plan(
        p: &mut Planner,
        fleet: &mut [InstanceView],
        adapters: &[AdapterView],
        initial: &[usize],
        now: f64,
    ) -> Result<Vec<PlacementAction>, TestCaseError> {
        let cooldown = p.config().cooldown_s;
        let before: Vec<Option<f64>> = fleet.iter().map(|i| p.last_change(&i.name)).collect();
        let plan = p.plan(fleet, adapters, now);
        prop_assert!(plan.len() <= p.config().max_actions as usize);
        for a in &plan {
            let k = fleet
                .iter()
                .position(|i| i.name == a.instance())
                .expect("known instance");
            prop_assert!(
                before[k].is_none_or(|at| now - at >= cooldown),
                "acted inside the cooldown: {a:?}"
            );
            match a {
                PlacementAction::Load { adapter, .. } => {
                    prop_assert!(!fleet[k].adapters.contains(adapter), "loaded twice: {a:?}");
                }
                PlacementAction::Unload { adapter, .. } => {
                    prop_assert!(fleet[k].adapters.contains(adapter), "not there: {a:?}");
                    let holders = fleet
                        .iter()
                        .filter(|i| i.adapters.contains(adapter))
                        .count();
                    prop_assert!(holders >= 2, "unloaded the last holder: {a:?}");
                }
            }
            apply(p, fleet, std::slice::from_ref(a), now);
        }
        for (k, i) in fleet.iter().enumerate() {
            prop_assert!(
                i.adapters.len() <= (i.slots as usize).max(initial[k]),
                "{} holds {:?} with {} slots",
                i.name,
                i.adapters,
                i.slots
            );
            prop_assert!(adapters
                .iter()
                .all(|a| fleet.iter().any(|i| i.adapters.contains(&a.name))));
        }
        Ok(plan)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// Demand that swings between adapters faster than the cooldown: every instance
        /// changes at most once per cooldown, and no plan breaks the rules.
        #[test]
        fn swings_faster_than_the_cooldown_never_thrash(
            s in setup(),
            period in 2.0f64..20.0,
            high in 5.0f64..40.0,
            low in 0.0f64..2.0,
            max_actions in 1u32..5,
        ) {
            let cfg = PlacementConfig {
                half_life_s: 2.0,
                cooldown_s: 30.0,
                min_residency_s: 0.0,
                max_actions,
                ..config()
            };
            let mut p = Planner::new(cfg.clone());
            let (mut fleet, adapters) = build(&s);
            let initial: Vec<usize> = fleet.iter().map(|i| i.adapters.len()).collect();
            let mut changes: BTreeMap<String, Vec<f64>> = BTreeMap::new();
            let n = adapters.len();
            for tick in 0..300 {
                let now = f64::from(tick);
                // Square wave: adapter a is hot in phase a of the cycle, cold otherwise.
                let phase = ((now / period) as usize) % n.max(1);
                for (a, ad) in adapters.iter().enumerate() {
                    let rate = if a == phase { high } else { low };
                    feed(&mut p, &ad.name, rate, now - 1.0, now);
                }
                let plan = checked_plan(&mut p, &mut fleet, &adapters, &initial, now)?;
                let mut seen = std::collections::BTreeSet::new();
                for a in &plan {
                    if seen.insert(a.instance().to_string()) {
                        changes.entry(a.instance().to_string()).or_default().push(now);
                    }
                }
            }
            for (instance, times) in &changes {
                for w in times.windows(2) {
                    prop_assert!(
                        w[1] - w[0] >= cfg.cooldown_s,
                        "{instance} changed at {} and {}", w[0], w[1]
                    );
                }
            }
        }

        /// Constant demand: after convergence the plan is empty, tick after tick.
        #[test]
        fn constant_demand_reaches_a_fixed_point(
            s in setup(),
            rates in proptest::collection::vec(
                prop_oneof![Just(0.0), 0.1f64..2.0, 2.0f64..30.0], 4),
            cooldown in 0.0f64..20.0,
            min_residency in 0.0f64..40.0,
            max_actions in 1u32..5,
        ) {
            let cfg = PlacementConfig {
                half_life_s: 5.0,
                cooldown_s: cooldown,
                min_residency_s: min_residency,
                max_actions,
                ..config()
            };
            let mut p = Planner::new(cfg);
            let (mut fleet, adapters) = build(&s);
            let initial: Vec<usize> = fleet.iter().map(|i| i.adapters.len()).collect();
            let horizon = 600;
            let settled = horizon - 200;
            let mut late: BTreeMap<String, Vec<u32>> = BTreeMap::new();
            for tick in 0..horizon {
                let now = f64::from(tick);
                for (a, ad) in adapters.iter().enumerate() {
                    feed(&mut p, &ad.name, rates[a], now - 1.0, now);
                }
                let plan = checked_plan(&mut p, &mut fleet, &adapters, &initial, now)?;
                if tick >= settled {
                    for a in &plan {
                        late.entry(a.adapter().to_string()).or_default().push(tick);
                    }
                }
            }
            // Demand settles within ~10 half-lives (50 s) and every adapter's holder count then
            // only moves towards the band, so the plan falls quiet. The one exception is a rate
            // within the estimator's ripple (each request adds ln 2 / half-life) of a threshold:
            // as the arrivals' phase drifts against the ticks it may cross once, late (seen:
            // 1.0011 requests/s on two holders crossing scale_down_rps at tick 457). Once, not
            // back and forth: more than one late action on an adapter is an oscillation.
            prop_assert!(
                late.values().all(|ticks| ticks.len() <= 1),
                "still acting after tick {settled}: {late:?}, {fleet:?}"
            );
        }
    }
}
