//! Modelled on the Gateway API Inference Extension's endpoint picker with its
//! `lora-affinity-scorer` added to the default profile (kubernetes-sigs/gateway-api-inference-extension,
//! `pkg/epp/scheduling/framework/plugins/loraaffinityscorer/lora_affinity.go`).
//!
//! The queue, KV-cache and prefix scorers are those of the `gie` baseline (weights 2, 2 and 3);
//! the LoRA affinity scorer adds `gie.lora_affinity_weight` × its score, read from the last
//! scrape of `vllm:lora_requests_info` exactly as the extension reads it:
//!
//! - 1.0 when the adapter is *active* on the pod (in `running_lora_adapters`: a running request
//!   uses it);
//! - 0.8 when the pod has room to load one more adapter: active + waiting adapters (the two
//!   lists' lengths, added as the extension adds them) < `max_lora`;
//! - 0.6 when the adapter is only *waiting* there (in `waiting_lora_adapters`);
//! - 0 otherwise.
//!
//! The extension compares the request's target model with those lists, so a base-model request
//! scores 0.8 or 0 by free capacity alone; that is kept. An instance without fresh metrics has
//! empty lists and its configured slots. Max score wins, ties at random; the prefix LRU records
//! the pick, as in the extension.

use rand::rngs::SmallRng;

use super::gie::score_weighted;
use super::routed_prefixes::RoutedPrefixes;
use super::{Policy, PolicyTraits, ScoringContext, TieBreak};
use crate::config::GieConfig;
use crate::decision::Candidate;
use crate::fleet::Instance;
use crate::fleet::Slot;

/// Score for the adapter being active (a running request uses it).
pub const LORA_ACTIVE: f64 = 1.0;
/// Score for a free adapter slot.
pub const LORA_FREE_SLOT: f64 = 0.8;
/// Score for the adapter only waiting (queued) on the instance.
pub const LORA_WAITING: f64 = 0.6;

/// The GIE default profile plus the LoRA affinity scorer, with its own prefix LRU.
pub struct GieLora {
    config: GieConfig,
    prefix: RoutedPrefixes,
}

impl GieLora {
    /// With the given weights.
    pub fn new(config: GieConfig) -> Self {
        let prefix = RoutedPrefixes::new(config.block_chars, config.lru_capacity_per_server);
        GieLora { config, prefix }
    }
}

/// The lora-affinity scorer's value for `target` (the adapter, or the model for a base-model
/// request) on `instance`, from metrics scraped within `stale_after` seconds.
pub fn lora_affinity(instance: &Instance, target: &str, now: f64, stale_after: f64) -> f64 {
    let metrics = instance.fresh_metrics(now, stale_after);
    let (active, waiting, max) = match metrics {
        Some(m) => (
            m.running_adapters.as_slice(),
            m.waiting_adapters.as_slice(),
            m.max_adapters.unwrap_or(instance.spec.adapter_slots),
        ),
        None => (&[][..], &[][..], instance.adapter_slots()),
    };
    let is_active = active.iter().any(|a| a == target);
    let is_waiting = waiting.iter().any(|a| a == target);
    if is_active {
        LORA_ACTIVE
    } else if active.len() + waiting.len() < max as usize {
        LORA_FREE_SLOT
    } else if is_waiting {
        LORA_WAITING
    } else {
        0.0
    }
}

impl Policy for GieLora {
    fn traits(&self) -> &'static PolicyTraits {
        const TRAITS: PolicyTraits = PolicyTraits {
            name: "gie-lora",
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
        let stale = ctx.config.estimates.metrics_stale_after_s;
        let target = ctx.request.adapter.unwrap_or(ctx.request.model);
        let weight = self.config.lora_affinity_weight;
        score_weighted(&self.config, &mut self.prefix, ctx, candidates, rng, |i| {
            weight * lora_affinity(i, target, ctx.now, stale)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{EngineMetrics, Fleet, InstanceSpec, Learned};
    use crate::{Observation, RouteRequest, Router, RouterConfig};
    use proptest::prelude::*;

    fn instance(slots: u32, metrics: Option<EngineMetrics>) -> Instance {
        let mut fleet = Fleet::default();
        let spec = InstanceSpec {
            adapter_slots: slots,
            ..InstanceSpec::new("i", "m")
        };
        let learned = Learned {
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
            slot_pressure: Default::default(),
            short_speed: 0.0,
            short_samples: 0,
            decode_slope: Default::default(),
            shared_compute: Default::default(),
            ttft_fixed_s: crate::running_median::RunningMedian::new(0.01),
            ttft_fixed_calibrated_s: crate::running_median::RunningMedian::new(0.01),
        };
        let id = fleet.add(spec, learned).unwrap();
        let mut i = fleet.remove(id).unwrap();
        i.engine = metrics.map(|m| (m, 0.0));
        i
    }

    fn lists(running: &[&str], waiting: &[&str], max: u32) -> EngineMetrics {
        EngineMetrics {
            running_adapters: running.iter().map(|s| s.to_string()).collect(),
            waiting_adapters: waiting.iter().map(|s| s.to_string()).collect(),
            max_adapters: Some(max),
            ..Default::default()
        }
    }

    /// The cases of the extension's own scorer test, same expectations.
    #[test]
    fn matches_the_extension_scorer_cases() {
        let score = |m: EngineMetrics| lora_affinity(&instance(1, Some(m)), "a1", 0.0, 5.0);
        assert_eq!(score(lists(&["a1"], &[], 5)), 1.0);
        assert_eq!(score(lists(&["a2"], &["a1"], 2)), 0.6);
        assert_eq!(score(lists(&["a2"], &["a3"], 2)), 0.0);
        assert_eq!(score(lists(&[], &[], 0)), 0.0);
        assert_eq!(score(lists(&["a2"], &["a1"], 5)), 0.8);
        assert_eq!(score(lists(&["a2"], &[], 2)), 0.8);
        assert_eq!(score(lists(&["a3"], &["a1"], 2)), 0.6);
        assert_eq!(score(lists(&["a4", "a5"], &[], 2)), 0.0);
    }

    fn adapter_list() -> impl Strategy<Value = Vec<&'static str>> {
        proptest::sample::subsequence(vec!["x", "y", "z", "w"], 0..=4)
    }

    proptest! {
        /// When the affinity weight dominates the other scorers (7 at most, against 20 for the
        /// smallest step between affinity levels), the pick has the best affinity of the fleet,
        /// and every candidate's affinity is one of the extension's four levels.
        #[test]
        fn a_dominant_affinity_weight_picks_the_best_affinity(
            fleet in proptest::collection::vec(
                (adapter_list(), adapter_list(), 0u32..4, 0u32..20, 0.0f64..1.0),
                1..8,
            ),
        ) {
            let mut config = RouterConfig { policy: "gie-lora".into(), ..Default::default() };
            config.gie.lora_affinity_weight = 100.0;
            let mut router = Router::new(config).unwrap();
            let mut ids = Vec::new();
            for (i, (running, waiting, max, queue, kv)) in fleet.iter().enumerate() {
                let spec = InstanceSpec {
                    runtime_adapter_loading: true,
                    ..InstanceSpec::new(format!("i{i}"), "m")
                };
                let id = router.add_instance(spec).unwrap();
                let m = EngineMetrics {
                    waiting: *queue,
                    kv_usage: Some(*kv),
                    running_adapters: running.iter().map(|a| a.to_string()).collect(),
                    waiting_adapters: waiting.iter().map(|a| a.to_string()).collect(),
                    max_adapters: Some(*max),
                    ..Default::default()
                };
                router.observe(Observation::MetricsScraped(id, m), 0.0).unwrap();
                ids.push(id);
            }
            let request = RouteRequest { adapter: Some("x"), ..RouteRequest::text("m", "hello") };
            let decision = router.route(&request, 0.0).unwrap();
            let affinity = |id| lora_affinity(router.fleet().get(id).unwrap(), "x", 0.0, 5.0);
            let best = ids.iter().map(|&id| affinity(id)).fold(0.0, f64::max);
            let pick = decision.best().unwrap();
            prop_assert_eq!(affinity(pick), best);
            for &id in &ids {
                prop_assert!([0.0, 0.6, 0.8, 1.0].contains(&affinity(id)));
            }
        }
    }

    #[test]
    fn stale_or_missing_metrics_mean_empty_lists_and_configured_slots() {
        assert_eq!(lora_affinity(&instance(2, None), "a1", 0.0, 5.0), 0.8);
        let full = lists(&["a1"], &[], 1);
        assert_eq!(
            lora_affinity(&instance(1, Some(full)), "a1", 10.0, 5.0),
            0.8
        );
        assert_eq!(lora_affinity(&instance(0, None), "a1", 0.0, 5.0), 0.0);
    }
}
