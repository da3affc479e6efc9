//! Selective disaggregation: a request runs whole on a decode instance when its uncached prompt
//! there is short and that is cheaper than the prefill/decode hand-off.

use switchyard_core::{
    Exclusion, InstanceId, InstanceSpec, Observation, RequestId, Role, RouteRequest, Router,
    RouterConfig, Usage,
};

/// One prefill and two decode instances behind a router with the given local-prefill limit.
fn pd_router(local_prefill_max_tokens: u32) -> (Router, InstanceId, [InstanceId; 2]) {
    let mut config = RouterConfig::default();
    config.cost.local_prefill_max_tokens = local_prefill_max_tokens;
    let mut router = Router::new(config).unwrap();
    let spec = |name: &str, role| InstanceSpec {
        role,
        ..InstanceSpec::new(name, "m")
    };
    let p = router.add_instance(spec("p", Role::Prefill)).unwrap();
    let d0 = router.add_instance(spec("d0", Role::Decode)).unwrap();
    let d1 = router.add_instance(spec("d1", Role::Decode)).unwrap();
    (router, p, [d0, d1])
}

/// About `tokens` tokens of text, distinct per `seed`.
fn text(tokens: usize, seed: u64) -> String {
    let mut s = String::new();
    let mut i = 0u64;
    while s.len() < tokens * 4 {
        s.push_str(&format!("w{seed}x{i} "));
        i += 1;
    }
    s.truncate(tokens * 4);
    s
}

/// Records a routed request at `instance` (decode leg when `decode_leg`) and finishes it.
fn serve(router: &mut Router, id: u64, decision: &switchyard_core::Decision, now: f64) {
    let mut legs = vec![decision.best().unwrap()];
    legs.extend(decision.best_decode());
    for (n, instance) in legs.into_iter().enumerate() {
        let request = RequestId(id * 2 + n as u64);
        let plan = decision.plan_for(instance);
        router
            .observe(
                Observation::Routed {
                    request,
                    instance,
                    plan,
                },
                now,
            )
            .unwrap();
        router
            // About the prior prefill speed, so that nothing learns an unrealistic one.
            .observe(Observation::FirstToken(request), now + 0.3)
            .unwrap();
        router
            .observe(Observation::Finished(request, None), now + 1.0)
            .unwrap();
    }
}

#[test]
fn a_short_prompt_runs_whole_on_a_decode_instance() {
    let (mut router, p, d) = pd_router(2048);
    let decision = router
        .route(&RouteRequest::text("m", &text(200, 1)), 0.0)
        .unwrap();
    assert!(!decision.is_disaggregated(), "{}", decision.explain(5));
    let best = decision.best().unwrap();
    assert!(d.contains(&best));
    // The prefill instance cannot run it whole, and says so.
    assert_eq!(
        decision.candidate(p).unwrap().excluded,
        Some(Exclusion::WrongRole)
    );
    assert!(decision.decode.is_empty());
}

#[test]
fn a_long_uncached_prompt_is_handed_off() {
    let (mut router, p, d) = pd_router(2048);
    let decision = router
        .route(&RouteRequest::text("m", &text(6000, 2)), 0.0)
        .unwrap();
    assert!(decision.is_disaggregated());
    assert_eq!(decision.best(), Some(p));
    assert!(d.contains(&decision.best_decode().unwrap()));
}

#[test]
fn zero_limit_always_hands_off() {
    let (mut router, p, _) = pd_router(0);
    let decision = router
        .route(&RouteRequest::text("m", &text(50, 3)), 0.0)
        .unwrap();
    assert!(decision.is_disaggregated());
    assert_eq!(decision.best(), Some(p));
}

#[test]
fn a_next_turn_mostly_held_by_its_decode_instance_stays_there() {
    let (mut router, p, _) = pd_router(2048);
    // Turn one: long, so it is handed off; its KV lands on the decode instance.
    let first = text(6000, 4);
    let decision = router.route(&RouteRequest::text("m", &first), 0.0).unwrap();
    assert_eq!(decision.best(), Some(p));
    let holder = decision.best_decode().unwrap();
    serve(&mut router, 1, &decision, 0.0);
    // Turn two: the whole conversation plus a short new message.
    let second = format!("{first}{}", text(300, 5));
    let decision = router
        .route(&RouteRequest::text("m", &second), 10.0)
        .unwrap();
    assert!(!decision.is_disaggregated(), "{}", decision.explain(5));
    assert_eq!(decision.best(), Some(holder));
    let c = decision.candidate(holder).unwrap();
    assert!(c.terms.cached_tokens > 5000, "{:?}", c.terms);
    // The other decode instance holds nothing: too much to prefill there.
    let other = decision
        .candidates
        .iter()
        .find(|c| c.instance != holder && c.instance != p)
        .unwrap();
    assert_eq!(other.excluded, Some(Exclusion::LocalPrefillTooLong));
}

#[test]
fn baselines_always_hand_off() {
    let mut config = RouterConfig {
        policy: "least-load".into(),
        ..Default::default()
    };
    config.cost.local_prefill_max_tokens = 100_000;
    let mut router = Router::new(config).unwrap();
    let p = router
        .add_instance(InstanceSpec {
            role: Role::Prefill,
            ..InstanceSpec::new("p", "m")
        })
        .unwrap();
    router
        .add_instance(InstanceSpec {
            role: Role::Decode,
            ..InstanceSpec::new("d", "m")
        })
        .unwrap();
    let decision = router
        .route(&RouteRequest::text("m", &text(50, 6)), 0.0)
        .unwrap();
    assert!(decision.is_disaggregated());
    assert_eq!(decision.best(), Some(p));
}

#[test]
fn a_fast_prefill_instance_does_not_attract_short_prompts() {
    // The flaky gateway test's situation made exact: the prefill instance has learned that it
    // is many times faster than the prior (a long prompt came back quickly), the decode instances
    // know only the prior. A short prompt still runs whole: the hand-off's own overhead is more
    // than the prefill it would save.
    let (mut router, p, d) = pd_router(8192);
    for i in 0..30u64 {
        let t = i as f64;
        let long = router
            .route(&RouteRequest::text("m", &text(9000, 100 + i)), t)
            .unwrap();
        assert!(long.is_disaggregated(), "{}", long.explain(5));
        let request = RequestId(i);
        let plan = long.plan_for(p);
        router
            .observe(
                Observation::Routed {
                    request,
                    instance: p,
                    plan,
                },
                t,
            )
            .unwrap();
        // 9,000 tokens in 30 ms after the fixed part: 300k tokens/s, 15x the prior.
        router
            .observe(Observation::FirstToken(request), t + 0.04)
            .unwrap();
        router
            .observe(Observation::Finished(request, None), t + 0.05)
            .unwrap();
    }
    assert!(router.learned(p).unwrap().prefill_tokens_per_s > 40_000.0);
    for n in 0..3u64 {
        let short = router
            .route(&RouteRequest::text("m", &text(100, n)), 40.0)
            .unwrap();
        assert!(!short.is_disaggregated(), "{}", short.explain(5));
        assert!(d.contains(&short.best().unwrap()));
    }
}

#[test]
fn a_decode_instance_running_a_prompt_whole_pays_for_stalling_its_batch() {
    let (mut router, p, d) = pd_router(8192);
    let prompt = text(600, 4);
    // Idle decode instances run the prompt whole: the hand-off would only add its overhead.
    let idle = router
        .route(&RouteRequest::text("m", &prompt), 0.0)
        .unwrap();
    let whole = idle.best().unwrap();
    assert!(d.contains(&whole), "{}", idle.explain(5));
    assert_eq!(idle.best_decode(), None);
    // Four sequences decode on each decode instance.
    for id in 0..8u64 {
        let to = d[(id % 2) as usize];
        let request = RouteRequest::text("m", "a short question");
        let plan = router.route(&request, 0.0).unwrap().plan_for(to);
        let request = RequestId(1000 + id);
        router
            .observe(
                Observation::Routed {
                    request,
                    instance: to,
                    plan,
                },
                0.0,
            )
            .unwrap();
        router
            .observe(Observation::FirstToken(request), 0.0)
            .unwrap();
    }
    // Running it whole would stall four sequences for the whole prefill each, undiscounted
    // (their batch was set apart from prefills; `cost.decode_interference_weight` discounts
    // the stall of mixed batches only): the hand-off, which stalls none, wins.
    let busy = router
        .route(&RouteRequest::text("m", &prompt), 0.1)
        .unwrap();
    assert_eq!(busy.best(), Some(p), "{}", busy.explain(5));
    assert!(busy.best_decode().is_some(), "{}", busy.explain(5));
}

/// The prefill leg of a hand-off generates one token whatever the request asked and hands its
/// KV over: only the decode instance reserves room for the answer, and only the decode leg's
/// answer says how much of `max_tokens` answers use.
/// Records request `id` as routed to `instance`, with the plan `decision` made for it.
fn record_routed(
    router: &mut Router,
    id: u64,
    decision: &switchyard_core::Decision,
    instance: InstanceId,
) {
    let plan = decision.plan_for(instance);
    let routed = Observation::Routed {
        request: RequestId(id),
        instance,
        plan,
    };
    router.observe(routed, 0.0).unwrap();
}

#[test]
fn only_the_decode_leg_reserves_and_teaches_the_answer() {
    let (mut router, p, _) = pd_router(0);
    let prompt = text(500, 4);
    let request = RouteRequest {
        max_tokens: 400,
        ..RouteRequest::text("m", &prompt)
    };
    let decision = router.route(&request, 0.0).unwrap();
    assert_eq!(decision.best(), Some(p));
    let decode = decision.best_decode().unwrap();
    let legs = [(1, p, 1), (2, decode, 400)];
    for (id, instance, _) in legs {
        record_routed(&mut router, id, &decision, instance);
    }
    let budget = |i| router.fleet().get(i).unwrap().load.kv_output_budget;
    assert_eq!((budget(p), budget(decode)), (0, 400));
    for (id, _, completion_tokens) in legs {
        let request = RequestId(id);
        router
            .observe(Observation::FirstToken(request), 0.3)
            .unwrap();
        let usage = Usage {
            prompt_tokens: 500,
            cached_tokens: None,
            completion_tokens,
        };
        router
            .observe(Observation::Finished(request, Some(usage)), 1.0)
            .unwrap();
    }
    assert_eq!(router.output_share(), 1.0);
}

#[test]
fn a_near_tie_between_decode_instances_goes_to_the_one_holding_less_kv() {
    let (mut router, p, [d0, d1]) = pd_router(0);
    // One decode leg in flight on each decode instance: a long conversation on d0, a short
    // one on d1. Both batches run one sequence, so the TTFT estimates tie.
    for (id, instance, tokens) in [(1, d0, 3000), (2, d1, 100)] {
        let prompt = text(tokens, 10 + id);
        let request = RouteRequest {
            max_tokens: 200,
            ..RouteRequest::text("m", &prompt)
        };
        let decision = router.route(&request, 0.0).unwrap();
        record_routed(&mut router, id, &decision, instance);
    }
    let kv = |i| router.fleet().get(i).unwrap().load.kv_prompt_tokens;
    let (kv0, kv1) = (kv(d0), kv(d1));
    assert!(kv0 > 10 * kv1, "{kv0} against {kv1}");
    // Chance would send about half of these to d0; its longer context makes every step
    // there slower.
    let prompt = text(300, 99);
    let request = RouteRequest {
        max_tokens: 200,
        ..RouteRequest::text("m", &prompt)
    };
    for _ in 0..20 {
        let decision = router.route(&request, 0.1).unwrap();
        assert_eq!(decision.best(), Some(p));
        assert_eq!(decision.best_decode(), Some(d1), "{}", decision.explain(4));
    }
    // The explanation shows what broke the tie.
    let explained = router.route(&request, 0.1).unwrap().explain(4);
    let decode = explained.split(" decode=[").nth(1).expect(&explained);
    let first = format!("{}#{} ", d1.slot, d1.generation);
    assert!(decode.starts_with(&first), "{explained}");
    let held = format!("kv_held={}", kv0 + 200);
    assert!(decode.contains(&held), "{explained}");
}
