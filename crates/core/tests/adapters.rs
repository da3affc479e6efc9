//! Adapters loaded and unloaded at runtime (dynamic placement) change where they may go.

use switchyard_core::{Exclusion, InstanceSpec, Observation, RouteRequest, Router, RouterConfig};

#[test]
fn loaded_adapters_are_servable_and_resident_unloaded_ones_are_not() {
    let mut router = Router::new(RouterConfig::default()).unwrap();
    let spec = |name: &str| InstanceSpec {
        adapter_slots: 2,
        ..InstanceSpec::new(name, "m")
    };
    let a = router.add_instance(spec("a")).unwrap();
    let request = RouteRequest {
        adapter: Some("sql"),
        ..RouteRequest::text("m", "select")
    };
    let decision = router.route(&request, 0.0).unwrap();
    assert_eq!(decision.best(), None);
    assert_eq!(
        decision.candidate(a).unwrap().excluded,
        Some(Exclusion::AdapterUnavailable)
    );

    router
        .observe(Observation::AdapterLoaded(a, "sql".into()), 1.0)
        .unwrap();
    let decision = router.route(&request, 2.0).unwrap();
    assert_eq!(decision.best(), Some(a));
    // Resident: no load time charged.
    assert_eq!(decision.candidate(a).unwrap().terms.adapter_s, 0.0);
    let instance = router.fleet().get(a).unwrap();
    assert_eq!(instance.adapters.last_load_at, Some(1.0));

    router
        .observe(Observation::AdapterUnloaded(a, "sql".into()), 3.0)
        .unwrap();
    let decision = router.route(&request, 4.0).unwrap();
    assert_eq!(decision.best(), None);
    assert!(router.fleet().get(a).unwrap().adapters.resident.is_empty());
}
