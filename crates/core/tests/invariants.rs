//! Routing invariants that hold for every policy on any fleet (property tests).

use proptest::prelude::*;
use switchyard_core::policy::POLICY_NAMES;
use switchyard_core::{
    EngineMetrics, Health, InstanceSpec, Observation, Phase, RequestId, Role, RouteRequest, Router,
    RouterConfig, Usage,
};

#[derive(Debug, Clone)]
struct Spec {
    role: Role,
    health: Health,
    models: Vec<&'static str>,
    adapters: Vec<&'static str>,
    runtime_loading: bool,
    metrics: Option<(u32, u32, f64)>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        prop_oneof![Just(Role::Both), Just(Role::Prefill), Just(Role::Decode)],
        prop_oneof![3 => Just(Health::Healthy), 1 => Just(Health::Unhealthy), 1 => Just(Health::Draining)],
        proptest::sample::subsequence(vec!["m1", "m2"], 1..=2),
        proptest::sample::subsequence(vec!["a1", "a2", "a3"], 0..=3),
        any::<bool>(),
        proptest::option::of((0u32..20, 0u32..50, 0.0f64..1.0)),
    )
        .prop_map(|(role, health, models, adapters, runtime_loading, metrics)| Spec {
            role,
            health,
            models,
            adapters,
            runtime_loading,
            metrics,
        })
}

#[derive(Debug, Clone)]
struct Req {
    model: &'static str,
    adapter: Option<&'static str>,
    text: String,
    unified: bool,
    outcome: u8,
}

fn req() -> impl Strategy<Value = Req> {
    (
        prop_oneof![Just("m1"), Just("m2")],
        proptest::option::of(prop_oneof![Just("a1"), Just("a2"), Just("a3")]),
        "[ab ]{0,600}",
        any::<bool>(),
        0u8..4,
    )
        .prop_map(|(model, adapter, text, unified, outcome)| Req {
            model,
            adapter,
            text,
            unified,
            outcome,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_pick_respects_health_role_model_and_adapter(
        policy in proptest::sample::select(POLICY_NAMES.to_vec()),
        specs in proptest::collection::vec(spec(), 1..8),
        requests in proptest::collection::vec(req(), 1..40),
    ) {
        let mut router = Router::new(RouterConfig { policy: policy.into(), ..Default::default() }).unwrap();
        let mut ids = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            let spec = InstanceSpec {
                role: s.role,
                models: s.models.iter().map(|m| m.to_string()).collect(),
                adapters: s.adapters.iter().map(|a| a.to_string()).collect(),
                runtime_adapter_loading: s.runtime_loading,
                kv_capacity_tokens: Some(50_000),
                max_running: Some(8),
                ..InstanceSpec::new(format!("i{i}"), "unused")
            };
            let id = router.add_instance(spec).unwrap();
            router.observe(Observation::HealthChanged(id, s.health), 0.0).unwrap();
            if let Some((waiting, running, kv)) = s.metrics {
                let m = EngineMetrics { waiting, running, kv_usage: Some(kv), ..Default::default() };
                router.observe(Observation::MetricsScraped(id, m), 0.0).unwrap();
            }
            ids.push(id);
        }
        let mut open = Vec::new();
        for (n, r) in requests.iter().enumerate() {
            let now = n as f64 * 0.1;
            let request = RouteRequest {
                adapter: r.adapter,
                phase: if r.unified { Phase::Unified } else { Phase::Any },
                ..RouteRequest::text(r.model, &r.text)
            };
            let Ok(decision) = router.route(&request, now) else {
                prop_assert!(!specs.iter().any(|s| s.models.contains(&r.model)));
                continue;
            };
            let check = |id, prefill: bool, decode: bool| -> Result<(), TestCaseError> {
                let i = ids.iter().position(|&x| x == id).unwrap();
                let s = &specs[i];
                prop_assert_eq!(s.health, Health::Healthy);
                prop_assert!(s.models.contains(&r.model));
                if prefill { prop_assert!(s.role != Role::Decode, "prefill on a decode-only instance"); }
                if decode { prop_assert!(s.role != Role::Prefill, "decode on a prefill-only instance"); }
                if let Some(a) = r.adapter {
                    prop_assert!(s.runtime_loading || s.adapters.contains(&a), "adapter {} not servable", a);
                }
                Ok(())
            };
            let split = decision.is_disaggregated();
            prop_assert!(!(split && r.unified), "a unified request was split");
            for c in decision.eligible_candidates() {
                prop_assert!(c.excluded.is_none());
                let i = ids.iter().position(|&x| x == c.instance).unwrap();
                // A request run whole on a decode instance (selective disaggregation, or one
                // that must run whole in a pool without unified instances) prefills its own
                // prompt there; no other prefill ever reaches a decode-only instance.
                let whole_on_decode = !split && specs[i].role == Role::Decode;
                if whole_on_decode {
                    // No instance that does both could take it.
                    let no_unified = decision.candidates.iter().all(|c| {
                        let j = ids.iter().position(|&x| x == c.instance).unwrap();
                        specs[j].role != Role::Both || c.excluded.is_some()
                    });
                    prop_assert!(
                        (!r.unified && policy == "cost") || (r.unified && no_unified),
                        "whole request on a decode-only instance"
                    );
                }
                check(c.instance, !whole_on_decode, !split)?;
            }
            for c in &decision.decode[..decision.decode_eligible] {
                check(c.instance, false, true)?;
            }
            prop_assert!(decision.ranked <= decision.eligible);
            // Ranked by score, except that candidates near the best (the tie tolerance) come
            // first in any order.
            let scores: Vec<f64> = decision.ranked_candidates().map(|c| c.score).collect();
            let best = decision.eligible_candidates().iter().map(|c| c.score).fold(f64::INFINITY, f64::min);
            let tol = &RouterConfig::default().cost;
            let limit = best + best.abs() * tol.tie_relative + tol.tie_absolute_s;
            let key = |s: f64| if s <= limit { best } else { s };
            prop_assert!(scores.windows(2).all(|w| key(w[0]) <= key(w[1])), "ranked out of order: {:?}", scores);
            if let Some(pick) = decision.best() {
                let plan = decision.plan_for(pick);
                router.observe(Observation::Routed { request: RequestId(n as u64), instance: pick, plan }, now).unwrap();
                open.push((n as u64, r.outcome));
            }
        }
        // Whatever happens to the requests, the books balance when they are all over.
        for (id, outcome) in open {
            let id = RequestId(id);
            match outcome {
                0 => router.observe(Observation::Failed(id), 10.0).unwrap(),
                1 => router.observe(Observation::Finished(id, None), 10.0).unwrap(),
                _ => {
                    router.observe(Observation::FirstToken(id), 9.0).unwrap();
                    let usage = Usage { prompt_tokens: 100, cached_tokens: Some(u32::from(outcome) * 7), completion_tokens: 3 };
                    router.observe(Observation::Finished(id, Some(usage)), 10.0).unwrap();
                }
            }
        }
        prop_assert_eq!(router.in_flight_len(), 0);
        for instance in router.fleet().iter() {
            prop_assert_eq!(&instance.load, &Default::default());
        }
    }
}
