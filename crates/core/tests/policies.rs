//! Documented behaviour of each policy, through the public API.

use std::collections::BTreeMap;

use switchyard_core::{
    EngineMetrics, Health, InstanceId, InstanceSpec, Observation, RequestId, Role, RouteRequest,
    Router, RouterConfig, Usage,
};

fn router(policy: &str, n: usize) -> (Router, Vec<InstanceId>) {
    router_with(
        RouterConfig {
            policy: policy.into(),
            ..Default::default()
        },
        n,
    )
}

/// `n` instances of model `m` behind a router with `config`.
fn router_with(config: RouterConfig, n: usize) -> (Router, Vec<InstanceId>) {
    let mut router = Router::new(config).unwrap();
    let ids = (0..n)
        .map(|i| {
            router
                .add_instance(InstanceSpec::new(format!("i{i}"), "m"))
                .unwrap()
        })
        .collect();
    (router, ids)
}

/// A prompt of about `tokens` tokens made of a shared `prefix` and a unique tail.
fn prompt(prefix: &str, tokens: usize, unique: u64) -> String {
    let mut text = String::new();
    while text.len() < tokens * 4 / 2 {
        text.push_str(prefix);
    }
    text.truncate(tokens * 4 / 2);
    let tail = format!("question {unique} ");
    while text.len() < tokens * 4 {
        text.push_str(&tail);
    }
    text
}

/// Routes and records the request at the best candidate; returns where it went.
fn send(router: &mut Router, id: u64, request: &RouteRequest<'_>, now: f64) -> InstanceId {
    let decision = router.route(request, now).unwrap();
    let pick = decision.best().expect("an eligible candidate");
    let plan = decision.plan_for(pick);
    router
        .observe(
            Observation::Routed {
                request: RequestId(id),
                instance: pick,
                plan,
            },
            now,
        )
        .unwrap();
    pick
}

fn finish(router: &mut Router, id: u64, now: f64) {
    router
        .observe(Observation::FirstToken(RequestId(id)), now)
        .unwrap();
    router
        .observe(Observation::Finished(RequestId(id), None), now)
        .unwrap();
}

/// First token and end of a 1,000-token prompt whose engine reported `cached` tokens from cache.
fn finish_with_cached(router: &mut Router, id: u64, cached: u32, first_token: f64, end: f64) {
    router
        .observe(Observation::FirstToken(RequestId(id)), first_token)
        .unwrap();
    let usage = Usage {
        prompt_tokens: 1000,
        cached_tokens: Some(cached),
        completion_tokens: 10,
    };
    router
        .observe(Observation::Finished(RequestId(id), Some(usage)), end)
        .unwrap();
}

#[test]
fn cost_follows_the_cached_prefix_when_instances_are_idle() {
    let (mut router, _) = router("cost", 4);
    let text = prompt("system prompt about ships. ", 2000, 1);
    let first = send(&mut router, 1, &RouteRequest::text("m", &text), 0.0);
    finish(&mut router, 1, 0.2);
    for id in 2..10 {
        let text = prompt("system prompt about ships. ", 2000, id);
        let pick = send(&mut router, id, &RouteRequest::text("m", &text), id as f64);
        finish(&mut router, id, id as f64 + 0.1);
        assert_eq!(
            pick, first,
            "request {id} should reuse the cached system prompt"
        );
    }
}

#[test]
fn cost_spreads_a_hot_prefix_once_its_holder_queues_up() {
    let (mut router, _) = router("cost", 4);
    let mut picks = BTreeMap::new();
    // 40 requests share a long prefix and arrive together: none finishes in between.
    for id in 0..40 {
        let text = prompt("the hot shared prefix. ", 4000, id);
        let pick = send(&mut router, id, &RouteRequest::text("m", &text), 0.0);
        *picks.entry(pick).or_insert(0) += 1;
    }
    assert_eq!(picks.len(), 4, "every instance takes part: {picks:?}");
    let max = *picks.values().max().unwrap();
    assert!(max <= 20, "no instance takes half of the burst: {picks:?}");
    // The prefix is now replicated: each instance holds it.
    let text = prompt("the hot shared prefix. ", 4000, 99);
    let decision = router.route(&RouteRequest::text("m", &text), 0.0).unwrap();
    for c in decision.eligible_candidates() {
        assert!(c.terms.cached_tokens > 1500, "{:?}", c.terms);
    }
}

#[test]
fn cost_ties_are_broken_at_random_not_to_the_first_instance() {
    let (mut router, _) = router("cost", 4);
    let mut seen = BTreeMap::new();
    for i in 0..200 {
        let text = format!("unrelated prompt number {i} with nothing shared at all");
        let decision = router.route(&RouteRequest::text("m", &text), 0.0).unwrap();
        *seen.entry(decision.best().unwrap()).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 4);
    assert!(seen.values().all(|&n| n > 25), "{seen:?}");
}

#[test]
fn cost_breaks_a_tie_toward_the_instance_holding_the_prompt() {
    let (mut router, _) = router("cost", 4);
    // A short prompt: what its cached prefix saves is within the tie tolerance.
    let first = "a short opening turn, cached where it went";
    let holder = send(&mut router, 1, &RouteRequest::text("m", first), 0.0);
    finish(&mut router, 1, 0.1);
    for i in 0..50 {
        let next = format!("{first}, and {i}");
        let decision = router.route(&RouteRequest::text("m", &next), 1.0).unwrap();
        let best = &decision.eligible_candidates()[0];
        assert!(best.terms.cached_tokens > 0, "{:?}", best.terms);
        assert_eq!(decision.best(), Some(holder), "follow-up {i}");
    }
}

/// Puts a request on `at` (whatever the policy would say) and, if `decoding`, starts its
/// answer.
fn place(
    router: &mut Router,
    id: u64,
    at: InstanceId,
    request: &RouteRequest<'_>,
    decoding: bool,
    now: f64,
) {
    let decision = router.route(request, now).unwrap();
    let plan = decision.plan_for(at);
    router
        .observe(
            Observation::Routed {
                request: RequestId(id),
                instance: at,
                plan,
            },
            now,
        )
        .unwrap();
    if decoding {
        router
            .observe(Observation::FirstToken(RequestId(id)), now)
            .unwrap();
    }
}

/// Two `cost` instances, the first decoding a 3,000-token conversation with a long answer.
fn cost_with_a_long_conversation_decoding_on_the_first() -> (Router, Vec<InstanceId>) {
    let (mut router, ids) = router("cost", 2);
    let long = prompt("a long conversation. ", 3000, 1);
    let long = RouteRequest {
        max_tokens: 1000,
        ..RouteRequest::text("m", &long)
    };
    place(&mut router, 1, ids[0], &long, true, 0.0);
    (router, ids)
}

#[test]
fn cost_sends_a_new_prompt_to_the_lighter_batch_among_instances_that_start_it_at_once() {
    // One request decoding on each instance: a long conversation with a long answer on the
    // first, a short one on the second. Neither queues anything, so a new prompt ties.
    let (mut router, ids) = cost_with_a_long_conversation_decoding_on_the_first();
    let short = RouteRequest {
        max_tokens: 50,
        ..RouteRequest::text("m", "a short one")
    };
    place(&mut router, 2, ids[1], &short, true, 0.0);
    // Chance would send half of these to the first instance, where every step attends over
    // the long context.
    for i in 0..20 {
        let text = format!("a new conversation, number {i}, nothing shared with the others");
        let decision = router.route(&RouteRequest::text("m", &text), 0.1).unwrap();
        assert_eq!(decision.best(), Some(ids[1]), "{}", decision.explain(2));
    }
    let explained = router
        .route(&RouteRequest::text("m", "one more new prompt"), 0.1)
        .unwrap()
        .explain(2);
    assert!(explained.contains("kv_held="), "{explained}");
}

#[test]
fn cost_does_not_order_a_tie_by_the_batch_of_an_instance_with_a_queue() {
    let (mut router, ids) = cost_with_a_long_conversation_decoding_on_the_first();
    // The second instance holds less KV, but a short prompt waits there for its prefill:
    // within the tie tolerance, yet a newcomer would queue behind it, by when its batch
    // will have changed.
    let queued = RouteRequest::text("m", "a short prompt still waiting for its prefill");
    place(&mut router, 2, ids[1], &queued, false, 0.0);
    let mut seen = BTreeMap::new();
    for i in 0..20 {
        let text = format!("a new conversation, number {i}, nothing shared with the others");
        let decision = router.route(&RouteRequest::text("m", &text), 0.1).unwrap();
        let candidates = decision.eligible_candidates();
        assert!(
            (candidates[0].score - candidates[1].score).abs() < 0.002,
            "the estimates tie: {}",
            decision.explain(2)
        );
        *seen.entry(decision.best().unwrap()).or_insert(0) += 1;
    }
    assert_eq!(seen.get(&ids[0]), Some(&20), "{seen:?}");
}

#[test]
fn cost_learns_a_slow_instance_and_moves_away_from_it() {
    let (mut router, ids) = router("cost", 2);
    let before = router.learned(ids[0]).unwrap().prefill_tokens_per_s;
    // Requests to instance 0 take 2 s to first token for 2000 tokens: 1000 tokens/s.
    let mut now = 0.0;
    for id in 0..30u64 {
        let text = prompt(&format!("distinct {id} "), 2000, id);
        let decision = router.route(&RouteRequest::text("m", &text), now).unwrap();
        let plan = decision.plan_for(ids[0]);
        router
            .observe(
                Observation::Routed {
                    request: RequestId(id),
                    instance: ids[0],
                    plan,
                },
                now,
            )
            .unwrap();
        now += 2.0;
        finish(&mut router, id, now);
    }
    let after = router.learned(ids[0]).unwrap().prefill_tokens_per_s;
    assert!(after < before / 4.0, "learned {after} from prior {before}");
    let text = prompt("fresh ", 2000, 1000);
    let decision = router.route(&RouteRequest::text("m", &text), now).unwrap();
    assert_eq!(decision.best(), Some(ids[1]));
}

#[test]
fn a_fast_engine_does_not_teach_a_speed_from_its_first_tokens_minus_the_whole_fixed_part() {
    let (mut router, ids) = router("cost", 1);
    // A small model's engine: 1,000 tokens of prefill, first token after 11 ms. Taking the whole
    // 10 ms prior of the fixed part off it would read 1,000,000 tokens/s (clamped to 320,000);
    // the fixed part is taken as at most half, so the speed stays near what the engine shows.
    let mut now = 0.0;
    for id in 0..60u64 {
        let text = prompt(&format!("distinct {id} "), 1000, id);
        send(&mut router, id, &RouteRequest::text("m", &text), now);
        now += 0.011;
        finish(&mut router, id, now);
        now += 1.0;
    }
    let learned = router.learned(ids[0]).unwrap().prefill_tokens_per_s;
    assert!(
        (150_000.0..250_000.0).contains(&learned),
        "learned {learned} tokens/s"
    );
}

/// Sends `n` short prompts to each instance in turn, each answered after that instance's
/// first-token time; returns the time after the last.
fn short_prompts(router: &mut Router, ids: &[InstanceId], first_token_s: &[f64], n: u64) -> f64 {
    let mut now = 0.0;
    for k in 0..n {
        for (i, (&id, &ttft)) in ids.iter().zip(first_token_s).enumerate() {
            let rid = k * ids.len() as u64 + i as u64;
            let text = prompt(&format!("chat {rid} "), 100, rid);
            send_to(router, rid, &RouteRequest::text("m", &text), id, now);
            finish(router, rid, now + ttft);
            now += 1.0;
        }
    }
    now
}

#[test]
fn short_prompts_tell_a_slow_engine_from_a_fast_one() {
    // Chat with short prompts never gives a full speed sample (512 tokens of work), so both
    // instances keep the prior speed; their first tokens, 20 ms against 60 ms, still show one
    // engine about 4x slower, and a new prompt goes to the fast one.
    let (mut router, ids) = router("cost", 2);
    let now = short_prompts(&mut router, &ids, &[0.02, 0.06], 30);
    let (fast, slow) = (
        router.learned(ids[0]).unwrap(),
        router.learned(ids[1]).unwrap(),
    );
    assert_eq!((fast.speed_samples, slow.speed_samples), (0, 0));
    assert!(
        fast.short_speed > 2.0 * slow.short_speed,
        "{fast:?} {slow:?}"
    );
    let text = prompt("a new chat ", 100, 999);
    let decision = router.route(&RouteRequest::text("m", &text), now).unwrap();
    let prefill = |i: InstanceId| decision.candidate(i).unwrap().terms.prefill_s;
    assert!(prefill(ids[1]) > 2.0 * prefill(ids[0]), "{decision:?}");
    assert_eq!(decision.best(), Some(ids[0]));
}

#[test]
fn short_prompts_on_one_kind_of_engine_leave_the_speeds_alone() {
    // The same engine answering in 40 or 50 ms (a step's phase, a batch): inside the noise
    // band, both are priced at the pool's speed.
    let (mut router, ids) = router("cost", 2);
    let now = short_prompts(&mut router, &ids, &[0.04, 0.05], 30);
    let text = prompt("a new chat ", 100, 999);
    let decision = router.route(&RouteRequest::text("m", &text), now).unwrap();
    let prefill = |i: InstanceId| decision.candidate(i).unwrap().terms.prefill_s;
    assert_eq!(prefill(ids[0]), prefill(ids[1]));
}

#[test]
fn cost_prefers_a_resident_adapter_and_guards_against_thrashing() {
    let config = RouterConfig::default();
    let mut router = Router::new(config).unwrap();
    let mut ids = Vec::new();
    for i in 0..3 {
        let spec = InstanceSpec {
            adapters: vec!["a".into(), "b".into(), "c".into()],
            adapter_slots: 1,
            ..InstanceSpec::new(format!("i{i}"), "m")
        };
        ids.push(router.add_instance(spec).unwrap());
    }
    let with = |adapter| RouteRequest {
        adapter: Some(adapter),
        ..RouteRequest::text("m", "hello there")
    };
    let first = send(&mut router, 1, &with("a"), 0.0);
    finish(&mut router, 1, 0.5);
    // "a" is now resident on `first`, which wins although all are idle.
    for id in 2..6 {
        assert_eq!(send(&mut router, id, &with("a"), id as f64), first);
        finish(&mut router, id, id as f64 + 0.1);
    }
    // Load "b" elsewhere; right after, swapping that instance to "c" is refused while another
    // instance can take "c".
    let b_holder = send(&mut router, 10, &with("b"), 10.0);
    assert_ne!(b_holder, first);
    finish(&mut router, 10, 10.1);
    let decision = router.route(&with("c"), 10.2).unwrap();
    let cooled = decision.candidate(b_holder).unwrap();
    assert_eq!(
        cooled.excluded,
        Some(switchyard_core::Exclusion::AdapterCooldown)
    );
    assert_ne!(decision.best(), Some(b_holder));
}

#[test]
fn adapters_go_only_where_they_can_be_served() {
    let mut router = Router::new(RouterConfig::default()).unwrap();
    let plain = router
        .add_instance(InstanceSpec::new("plain", "m"))
        .unwrap();
    let lora = InstanceSpec {
        adapters: vec!["x".into()],
        ..InstanceSpec::new("lora", "m")
    };
    let lora = router.add_instance(lora).unwrap();
    let request = RouteRequest {
        adapter: Some("x"),
        ..RouteRequest::text("m", "hi")
    };
    let decision = router.route(&request, 0.0).unwrap();
    assert_eq!(decision.best(), Some(lora));
    assert_eq!(decision.eligible, 1);
    assert_eq!(
        decision.candidate(plain).unwrap().excluded,
        Some(switchyard_core::Exclusion::AdapterUnavailable)
    );
}

#[test]
fn unhealthy_and_draining_instances_are_never_picked() {
    let (mut router, ids) = router("cost", 3);
    router
        .observe(Observation::HealthChanged(ids[0], Health::Unhealthy), 0.0)
        .unwrap();
    router
        .observe(Observation::HealthChanged(ids[1], Health::Draining), 0.0)
        .unwrap();
    for i in 0..50 {
        let text = format!("prompt {i}");
        assert_eq!(
            router
                .route(&RouteRequest::text("m", &text), 0.0)
                .unwrap()
                .best(),
            Some(ids[2])
        );
    }
    router
        .observe(Observation::HealthChanged(ids[2], Health::Unhealthy), 0.0)
        .unwrap();
    let decision = router.route(&RouteRequest::text("m", "x"), 0.0).unwrap();
    assert_eq!(decision.best(), None);
    assert_eq!(
        decision.candidates.len(),
        3,
        "excluded candidates are explained"
    );
}

#[test]
fn unknown_model_is_an_error() {
    let (mut router, _) = router("cost", 1);
    assert!(router
        .route(&RouteRequest::text("other", "x"), 0.0)
        .is_err());
}

#[test]
fn disaggregated_pools_split_by_role() {
    let mut router = Router::new(RouterConfig::default()).unwrap();
    let p = router
        .add_instance(InstanceSpec {
            role: Role::Prefill,
            ..InstanceSpec::new("p", "m")
        })
        .unwrap();
    let d = router
        .add_instance(InstanceSpec {
            role: Role::Decode,
            ..InstanceSpec::new("d", "m")
        })
        .unwrap();
    // Longer than `cost.local_prefill_max_tokens`: running it whole on the decode instance is
    // not an option.
    let long = prompt("a long document. ", 12000, 0);
    let decision = router.route(&RouteRequest::text("m", &long), 0.0).unwrap();
    assert!(decision.is_disaggregated());
    assert_eq!(decision.best(), Some(p));
    assert_eq!(decision.best_decode(), Some(d));
    assert!(decision.decode[0].terms.transfer_s > 0.0);
    // A request that must not be split runs whole on a decode instance (there is no `both`
    // instance), however long: the prefill instance cannot run it.
    let unified = RouteRequest {
        phase: switchyard_core::Phase::Unified,
        ..RouteRequest::text("m", &long)
    };
    let decision = router.route(&unified, 0.0).unwrap();
    assert!(!decision.is_disaggregated());
    assert_eq!(decision.best(), Some(d));
    assert!(decision
        .candidates
        .iter()
        .filter(|c| c.instance == p)
        .all(|c| c.excluded == Some(switchyard_core::Exclusion::WrongRole)));
}

#[test]
fn feedback_discounts_what_the_engine_did_not_hold() {
    let (mut router, ids) = router("cost", 1);
    let older = prompt("an even older prompt. ", 2000, 0);
    let text = prompt("prefix that will be evicted. ", 2000, 1);
    let newer = prompt("something newer. ", 2000, 2);
    for (id, p) in [(0, &older), (1, &text), (2, &newer)] {
        send(&mut router, id, &RouteRequest::text("m", p), id as f64);
        finish(&mut router, id, id as f64 + 0.1);
    }
    // The index predicts a full match for `text`...
    let decision = router.route(&RouteRequest::text("m", &text), 3.0).unwrap();
    assert!(decision.candidate(ids[0]).unwrap().terms.cached_tokens > 1900);
    let plan = decision.plan_for(ids[0]);
    router
        .observe(
            Observation::Routed {
                request: RequestId(3),
                instance: ids[0],
                plan,
            },
            3.0,
        )
        .unwrap();
    router
        .observe(Observation::FirstToken(RequestId(3)), 3.1)
        .unwrap();
    // ...but the engine had evicted it: it reports nothing cached.
    let usage = Usage {
        prompt_tokens: 2000,
        cached_tokens: Some(0),
        completion_tokens: 10,
    };
    router
        .observe(Observation::Finished(RequestId(3), Some(usage)), 4.0)
        .unwrap();
    // An LRU engine that evicted `text` also evicted everything older: `older` is now expected
    // to be mostly gone (still indexed, only discounted). `text`, which request 3 just
    // recomputed, is expected in full; `newer` is as old as `text` was when found evicted, so it
    // is discounted too, never below `older`.
    let predicted = |router: &mut Router, p: &str| {
        let decision = router.route(&RouteRequest::text("m", p), 4.0).unwrap();
        let terms = decision.candidate(ids[0]).unwrap().terms;
        (terms.matched_blocks, terms.cached_tokens)
    };
    let (older_blocks, older_cached) = predicted(&mut router, &older);
    assert!(older_blocks > 25);
    assert!(older_cached < 1200, "{older_cached} of about 2000");
    assert!(predicted(&mut router, &newer).1 >= older_cached);
    let text_cached = predicted(&mut router, &text).1;
    assert!(
        text_cached as f64 > 1.5 * older_cached as f64,
        "{text_cached} vs {older_cached}"
    );
    assert!(router.learned(ids[0]).unwrap().cache_trust < 1.0);
}

#[test]
fn concurrent_requests_are_no_evidence_of_eviction() {
    let (mut router, ids) = router("cost", 1);
    let text = prompt("shared by two requests in flight. ", 2000, 1);
    send(&mut router, 1, &RouteRequest::text("m", &text), 0.0);
    // Request 2 is routed while request 1 is still prefilling: the engine cannot hit yet.
    send(&mut router, 2, &RouteRequest::text("m", &text), 0.0);
    finish(&mut router, 1, 1.0);
    router
        .observe(Observation::FirstToken(RequestId(2)), 1.0)
        .unwrap();
    let usage = Usage {
        prompt_tokens: 2000,
        cached_tokens: Some(0),
        completion_tokens: 10,
    };
    router
        .observe(Observation::Finished(RequestId(2), Some(usage)), 2.0)
        .unwrap();
    let decision = router.route(&RouteRequest::text("m", &text), 2.0).unwrap();
    assert!(decision.candidate(ids[0]).unwrap().terms.matched_blocks > 25);
}

#[test]
fn stale_engine_metrics_are_not_trusted() {
    let (mut router, ids) = router("cost", 2);
    let busy = EngineMetrics {
        waiting: 50,
        running: 100,
        ..Default::default()
    };
    router
        .observe(Observation::MetricsScraped(ids[0], busy), 0.0)
        .unwrap();
    let fresh = router.route(&RouteRequest::text("m", "x"), 1.0).unwrap();
    assert_eq!(
        fresh.best(),
        Some(ids[1]),
        "fresh metrics show instance 0 is busy"
    );
    let decision = router.route(&RouteRequest::text("m", "x"), 100.0).unwrap();
    let c0 = decision.candidate(ids[0]).unwrap();
    let c1 = decision.candidate(ids[1]).unwrap();
    assert_eq!(
        c0.terms.wait_s, c1.terms.wait_s,
        "stale metrics count as unknown"
    );
}

#[test]
fn saturated_instances_are_excluded_and_the_decision_says_so() {
    let config = RouterConfig {
        cost: switchyard_core::config::CostConfig {
            max_in_flight: Some(2),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut router = Router::new(config).unwrap();
    router.add_instance(InstanceSpec::new("a", "m")).unwrap();
    for id in 0..2 {
        send(&mut router, id, &RouteRequest::text("m", "x"), 0.0);
    }
    let decision = router.route(&RouteRequest::text("m", "x"), 0.0).unwrap();
    assert!(decision.saturated);
    assert_eq!(decision.best(), None);
}

#[test]
fn round_robin_cycles_through_instances() {
    let (mut router, ids) = router("round-robin", 3);
    let picks: Vec<_> = (0..6)
        .map(|_| {
            router
                .route(&RouteRequest::text("m", "x"), 0.0)
                .unwrap()
                .best()
                .unwrap()
        })
        .collect();
    assert_eq!(picks, [ids[0], ids[1], ids[2], ids[0], ids[1], ids[2]]);
}

#[test]
fn least_load_picks_the_fewest_in_flight() {
    let (mut router, ids) = router("least-load", 3);
    for (id, &instance) in [ids[0], ids[0], ids[1]].iter().enumerate() {
        let decision = router.route(&RouteRequest::text("m", "x"), 0.0).unwrap();
        let plan = decision.plan_for(instance);
        router
            .observe(
                Observation::Routed {
                    request: RequestId(id as u64),
                    instance,
                    plan,
                },
                0.0,
            )
            .unwrap();
    }
    assert_eq!(
        router
            .route(&RouteRequest::text("m", "x"), 0.0)
            .unwrap()
            .best(),
        Some(ids[2])
    );
}

#[test]
fn power_of_two_never_picks_the_most_loaded_of_three() {
    let (mut router, ids) = router("power-of-two", 3);
    let loads = [5u64, 0, 2];
    let mut next = 0;
    for (i, &n) in loads.iter().enumerate() {
        for _ in 0..n {
            let decision = router.route(&RouteRequest::text("m", "x"), 0.0).unwrap();
            let plan = decision.plan_for(ids[i]);
            router
                .observe(
                    Observation::Routed {
                        request: RequestId(next),
                        instance: ids[i],
                        plan,
                    },
                    0.0,
                )
                .unwrap();
            next += 1;
        }
    }
    for _ in 0..100 {
        assert_ne!(
            router
                .route(&RouteRequest::text("m", "x"), 0.0)
                .unwrap()
                .best(),
            Some(ids[0])
        );
    }
}

/// Puts `n` unfinished requests on `instance` (they raise its load).
fn load_up(router: &mut Router, instance: InstanceId, n: u64, first_id: u64) {
    for id in first_id..first_id + n {
        let decision = router
            .route(&RouteRequest::text("m", "filler"), 0.0)
            .unwrap();
        let plan = decision.plan_for(instance);
        router
            .observe(
                Observation::Routed {
                    request: RequestId(id),
                    instance,
                    plan,
                },
                0.0,
            )
            .unwrap();
    }
}

#[test]
fn sglang_falls_back_to_least_load_exactly_when_both_thresholds_hold() {
    let text = prompt("cached everywhere? no, only on zero. ", 1000, 1);
    // Instance 0 holds the prompt; its load differs from instance 1's by `extra`.
    let case = |load0: u64, load1: u64| {
        let (mut router, ids) = router("sglang-cache-aware", 2);
        send(&mut router, 1000, &RouteRequest::text("m", &text), 0.0); // goes to 0 (smallest tree, first)
        finish(&mut router, 1000, 0.0);
        load_up(&mut router, ids[0], load0, 0);
        load_up(&mut router, ids[1], load1, 500);
        router
            .route(&RouteRequest::text("m", &text), 0.0)
            .unwrap()
            .best()
            .unwrap()
            == ids[0]
    };
    assert!(case(0, 0), "balanced: follows the cache");
    assert!(case(100, 40), "diff 60 <= 64: follows the cache");
    assert!(
        !case(100, 30),
        "diff 70 > 64 and 100 > 1.5 x 30: least load"
    );
    assert!(
        case(200, 134),
        "diff 66 > 64 but 200 <= 1.5 x 134: follows the cache"
    );
    assert!(!case(200, 133), "diff 67 > 64 and 200 > 199.5: least load");
}

#[test]
fn sglang_sends_unmatched_prompts_to_the_smallest_tree_and_ties_to_the_first() {
    let (mut router, ids) = router("sglang-cache-aware", 3);
    assert_eq!(
        send(
            &mut router,
            1,
            &RouteRequest::text("m", &"a".repeat(400)),
            0.0
        ),
        ids[0]
    );
    assert_eq!(
        send(
            &mut router,
            2,
            &RouteRequest::text("m", &"b".repeat(800)),
            0.0
        ),
        ids[1]
    );
    assert_eq!(
        send(
            &mut router,
            3,
            &RouteRequest::text("m", &"c".repeat(100)),
            0.0
        ),
        ids[2]
    );
    // Smallest tree is now instance 2 (100 chars).
    assert_eq!(
        send(
            &mut router,
            4,
            &RouteRequest::text("m", &"d".repeat(100)),
            0.0
        ),
        ids[2]
    );
    // A prompt matching instance 1's tree above the threshold goes there.
    let matching = format!("{}{}", "b".repeat(800), "z".repeat(100));
    assert_eq!(
        send(&mut router, 5, &RouteRequest::text("m", &matching), 0.0),
        ids[1]
    );
}

#[test]
fn dynamo_cost_is_prefill_blocks_plus_decode_blocks() {
    let (mut router, ids) = router("dynamo-kv", 2);
    load_up(&mut router, ids[0], 1, 0);
    let text = "q".repeat(4 * 320); // 320 tokens = 20 blocks of 16
    let decision = router.route(&RouteRequest::text("m", &text), 0.0).unwrap();
    let c1 = decision.candidate(ids[1]).unwrap();
    assert_eq!(
        c1.score,
        20.0 + 20.0,
        "idle: request's prefill blocks + its decode blocks"
    );
    let c0 = decision.candidate(ids[0]).unwrap();
    // The filler ("filler" = 2 tokens, max_tokens 128) adds its pending prefill and its KV.
    let filler_prefill = 2.0 / 16.0;
    let filler_kv = (2.0 + 128.0) / 16.0;
    assert!(
        (c0.score - (40.0 + filler_prefill + filler_kv)).abs() < 1e-9,
        "{}",
        c0.score
    );
    assert_eq!(decision.best(), Some(ids[1]));
}

#[test]
fn gie_weighs_queue_kv_and_prefix_scores() {
    let (mut router, ids) = router("gie", 2);
    let text = prompt("gie shared prefix. ", 1000, 1);
    let first = send(&mut router, 1, &RouteRequest::text("m", &text), 0.0);
    let other = if first == ids[0] { ids[1] } else { ids[0] };
    // Equal metrics: the prefix scorer (weight 3) decides.
    let again = prompt("gie shared prefix. ", 1000, 1);
    assert_eq!(
        router
            .route(&RouteRequest::text("m", &again), 0.0)
            .unwrap()
            .best(),
        Some(first)
    );
    // The holder's queue is the longest and its KV the fullest: 3 x ~1.0 prefix < 2 + 2.
    let busy = EngineMetrics {
        waiting: 10,
        kv_usage: Some(1.0),
        ..Default::default()
    };
    let idle = EngineMetrics {
        waiting: 0,
        kv_usage: Some(0.0),
        ..Default::default()
    };
    router
        .observe(Observation::MetricsScraped(first, busy), 0.0)
        .unwrap();
    router
        .observe(Observation::MetricsScraped(other, idle), 0.0)
        .unwrap();
    let decision = router.route(&RouteRequest::text("m", &again), 0.0).unwrap();
    assert_eq!(decision.best(), Some(other));
    let holder = decision.candidate(first).unwrap();
    assert!(
        (-holder.score - 3.0).abs() < 0.01,
        "prefix score ~1 x 3: {}",
        holder.score
    );
}

#[test]
fn kubeai_hashes_the_prefix_and_bounds_the_load() {
    let (mut router, _ids) = router("kubeai-chwbl", 4);
    let text = "same first hundred characters ".repeat(10);
    let home = router
        .route(&RouteRequest::text("m", &text), 0.0)
        .unwrap()
        .best()
        .unwrap();
    for _ in 0..5 {
        assert_eq!(
            router
                .route(&RouteRequest::text("m", &text), 0.0)
                .unwrap()
                .best(),
            Some(home)
        );
    }
    // Only the first 100 characters matter.
    let longer = format!("{text}and a different tail");
    assert_eq!(
        router
            .route(&RouteRequest::text("m", &longer), 0.0)
            .unwrap()
            .best(),
        Some(home)
    );
    // Load the home instance beyond 1.25 x the mean: the request moves on along the ring.
    load_up(&mut router, home, 3, 0);
    let moved = router
        .route(&RouteRequest::text("m", &text), 0.0)
        .unwrap()
        .best()
        .unwrap();
    assert_ne!(moved, home);
}

#[test]
fn a_decision_explains_itself() {
    let (mut router, _) = router("cost", 2);
    let decision = router
        .route(&RouteRequest::text("m", &prompt("x", 500, 1)), 0.0)
        .unwrap();
    let text = decision.explain(2);
    assert!(text.contains("policy=cost"), "{text}");
    assert!(text.contains("uncached="), "{text}");
    let json = serde_json::to_value(&decision).unwrap();
    assert!(
        json["candidates"][0]["terms"]["prefill_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

#[test]
fn policies_can_be_switched_at_runtime() {
    let (mut router, _) = router("cost", 2);
    router.set_policy("round-robin").unwrap();
    assert_eq!(router.policy_name(), "round-robin");
    assert!(router.set_policy("nonsense").is_err());
}

#[test]
fn lost_requests_expire_and_free_their_load() {
    let (mut router, ids) = router("cost", 1);
    send(&mut router, 1, &RouteRequest::text("m", "x"), 0.0);
    assert_eq!(router.fleet().get(ids[0]).unwrap().load.in_flight(), 1);
    assert_eq!(router.expire_stale(10_000.0), 1);
    assert_eq!(router.fleet().get(ids[0]).unwrap().load.in_flight(), 0);
    assert_eq!(router.in_flight_len(), 0);
}

#[test]
fn random_spreads_uniformly_whatever_the_load_or_cache() {
    let (mut router, ids) = router("random", 4);
    load_up(&mut router, ids[0], 20, 0);
    let mut counts = BTreeMap::new();
    for _ in 0..2000 {
        let pick = router
            .route(&RouteRequest::text("m", "same prompt"), 0.0)
            .unwrap()
            .best()
            .unwrap();
        *counts.entry(pick).or_insert(0u32) += 1;
    }
    // 500 expected each; 5 standard deviations is about ±100.
    assert!(
        counts.values().all(|&n| (400..=600).contains(&n)),
        "{counts:?}"
    );
}

/// A router with `n` instances of `slots` runtime-loadable adapter slots each.
fn lora_router(
    policy: &str,
    n: usize,
    slots: u32,
    config: RouterConfig,
) -> (Router, Vec<InstanceId>) {
    let mut router = Router::new(RouterConfig {
        policy: policy.into(),
        ..config
    })
    .unwrap();
    let ids = (0..n)
        .map(|i| {
            let spec = InstanceSpec {
                runtime_adapter_loading: true,
                adapter_slots: slots,
                ..InstanceSpec::new(format!("i{i}"), "m")
            };
            router.add_instance(spec).unwrap()
        })
        .collect();
    (router, ids)
}

/// What `vllm:lora_requests_info` and the queue gauges would show.
fn lora_metrics(running: &[&str], waiting: &[&str], max: u32, queue: u32) -> EngineMetrics {
    EngineMetrics {
        waiting: queue,
        kv_usage: Some(0.0),
        running_adapters: running.iter().map(|a| a.to_string()).collect(),
        waiting_adapters: waiting.iter().map(|a| a.to_string()).collect(),
        max_adapters: Some(max),
        ..Default::default()
    }
}

fn scrape(router: &mut Router, id: InstanceId, m: EngineMetrics, now: f64) {
    router
        .observe(Observation::MetricsScraped(id, m), now)
        .unwrap();
}

fn with_adapter(adapter: &str) -> RouteRequest<'_> {
    RouteRequest {
        adapter: Some(adapter),
        ..RouteRequest::text("m", "hello there")
    }
}

#[test]
fn gie_lora_prefers_active_then_free_slot_then_waiting() {
    let (mut router, ids) = lora_router("gie-lora", 4, 2, RouterConfig::default());
    // Queue, KV and prefix are equal everywhere: the LoRA affinity scorer decides.
    scrape(
        &mut router,
        ids[0],
        lora_metrics(&["y", "z"], &["x"], 2, 0),
        0.0,
    );
    scrape(&mut router, ids[1], lora_metrics(&["y"], &[], 2, 0), 0.0);
    scrape(&mut router, ids[2], lora_metrics(&["x"], &[], 2, 0), 0.0);
    scrape(
        &mut router,
        ids[3],
        lora_metrics(&["y", "z"], &[], 2, 0),
        0.0,
    );
    let decision = router.route(&with_adapter("x"), 0.0).unwrap();
    let order: Vec<InstanceId> = decision.ranked_candidates().map(|c| c.instance).collect();
    // Active 1.0, free slot 0.8, only waiting 0.6, full 0.
    assert_eq!(order, vec![ids[2], ids[1], ids[0], ids[3]]);
    let score = |i: usize| -decision.candidate(ids[i]).unwrap().score;
    assert!((score(2) - 5.0).abs() < 1e-6, "2 + 2 + 0 + 1 x 1.0");
    assert!((score(1) - 4.8).abs() < 1e-6);
    assert!((score(0) - 4.6).abs() < 1e-6);
    assert!((score(3) - 4.0).abs() < 1e-6);
}

#[test]
fn gie_lora_weighs_affinity_against_the_queue() {
    // The adapter is active on i0, which has the longest queue; i1 is idle with free slots.
    let setup = |weight: f64| {
        let mut config = RouterConfig::default();
        config.gie.lora_affinity_weight = weight;
        let (mut router, ids) = lora_router("gie-lora", 2, 4, config);
        scrape(&mut router, ids[0], lora_metrics(&["x"], &[], 4, 10), 0.0);
        scrape(&mut router, ids[1], lora_metrics(&[], &[], 4, 0), 0.0);
        let pick = router.route(&with_adapter("x"), 0.0).unwrap().best();
        (pick, ids)
    };
    // Weight 1 (the extension's default): 2 x queue outweighs 1.0 - 0.8 of affinity.
    let (pick, ids) = setup(1.0);
    assert_eq!(pick, Some(ids[1]));
    // Weight 20: 20 x 0.2 of affinity outweighs the queue's 2.
    let (pick, ids) = setup(20.0);
    assert_eq!(pick, Some(ids[0]));
}

#[test]
fn gie_lora_reads_only_fresh_scrapes() {
    let (mut router, ids) = lora_router("gie-lora", 2, 1, RouterConfig::default());
    // i0 was seen running "x" long ago, i1 is full of "y" now.
    scrape(&mut router, ids[0], lora_metrics(&["x"], &[], 1, 0), 0.0);
    scrape(&mut router, ids[1], lora_metrics(&["y"], &[], 1, 0), 100.0);
    let decision = router.route(&with_adapter("x"), 100.0).unwrap();
    // Stale: i0 counts as empty lists with a free slot (0.8), i1 as full (0).
    assert_eq!(decision.best(), Some(ids[0]));
    assert!((-decision.candidate(ids[0]).unwrap().score - 4.8).abs() < 1e-6);
}

#[test]
fn cost_does_not_send_an_adapter_where_every_slot_is_taken_by_running_adapters() {
    let (mut router, ids) = lora_router("cost", 2, 2, RouterConfig::default());
    // i0 is idle but both its slots hold adapters with running requests; i1 has work queued.
    scrape(
        &mut router,
        ids[0],
        lora_metrics(&["y", "z"], &[], 2, 0),
        0.0,
    );
    scrape(&mut router, ids[1], lora_metrics(&[], &[], 2, 0), 0.0);
    load_up(&mut router, ids[1], 3, 100);
    let decision = router.route(&with_adapter("x"), 0.5).unwrap();
    assert_eq!(decision.best(), Some(ids[1]));
    let pinned = decision.candidate(ids[0]).unwrap();
    let service = router.learned(ids[0]).unwrap().service_time_s;
    assert!(
        pinned.terms.adapter_s >= service,
        "waiting for a slot costs about a service time: {:?}",
        pinned.terms
    );
    // Adapters queued for a slot count too: one running + one waiting fill two slots.
    scrape(&mut router, ids[0], lora_metrics(&["y"], &["z"], 2, 1), 1.0);
    let decision = router.route(&with_adapter("x"), 1.0).unwrap();
    assert!(decision.candidate(ids[0]).unwrap().terms.adapter_s >= service);
    // Once a slot frees, i0 is an ordinary load again.
    scrape(&mut router, ids[0], lora_metrics(&["y"], &[], 2, 0), 2.0);
    let decision = router.route(&with_adapter("x"), 2.0).unwrap();
    assert!(decision.candidate(ids[0]).unwrap().terms.adapter_s < 2.0);
}

#[test]
fn cost_cooldown_never_funnels_requests_onto_an_instance_waiting_for_a_slot() {
    let (mut router, ids) = lora_router("cost", 3, 1, RouterConfig::default());
    // i0 and i1 just loaded an adapter (cooldown); i2 did not, but its only slot is pinned.
    for (i, a) in [(0, "a"), (1, "b")] {
        router
            .observe(Observation::AdapterLoaded(ids[i], a.into()), 0.0)
            .unwrap();
    }
    scrape(&mut router, ids[2], lora_metrics(&["c"], &[], 1, 0), 0.0);
    let decision = router.route(&with_adapter("x"), 1.0).unwrap();
    assert!(
        decision.candidates.iter().all(|c| c.excluded.is_none()),
        "no exclusion when the only instance left would wait for a slot"
    );
    assert_ne!(decision.best(), Some(ids[2]));
    // With a free instance available, the cooling ones are excluded as before.
    let (mut router, ids) = lora_router("cost", 3, 1, RouterConfig::default());
    for (i, a) in [(0, "a"), (1, "b")] {
        router
            .observe(Observation::AdapterLoaded(ids[i], a.into()), 0.0)
            .unwrap();
    }
    let decision = router.route(&with_adapter("x"), 1.0).unwrap();
    assert_eq!(decision.best(), Some(ids[2]));
    for &id in &ids[..2] {
        assert_eq!(
            decision.candidate(id).unwrap().excluded,
            Some(switchyard_core::Exclusion::AdapterCooldown)
        );
    }
}

#[test]
fn cost_prefers_evicting_a_replica_to_evicting_the_last_copy() {
    let (mut router, ids) = lora_router("cost", 3, 1, RouterConfig::default());
    // i0 holds the only copy of "y"; i1 and i2 both hold "z". Long before: no cooldown.
    for (i, a) in [(0, "y"), (1, "z"), (2, "z")] {
        router
            .observe(Observation::AdapterLoaded(ids[i], a.into()), 0.0)
            .unwrap();
    }
    let load_s = RouterConfig::default().cost.adapter_load_s;
    for n in 0..20 {
        let decision = router
            .route(&with_adapter("x"), 100.0 + f64::from(n))
            .unwrap();
        let last_copy = decision.candidate(ids[0]).unwrap().terms.adapter_s;
        let replica = decision.candidate(ids[1]).unwrap().terms.adapter_s;
        assert!(
            (last_copy - replica - load_s).abs() < 1e-9,
            "{last_copy} vs {replica}"
        );
        assert_ne!(decision.best(), Some(ids[0]));
    }
}

/// The SGLang and GIE baselines remember the prefixes they sent: only where a request was
/// routed, never for a dry run (a decision nobody followed), and at the instance a retry went to.
#[test]
fn baselines_remember_routed_prompts_not_dry_runs() {
    for policy in ["sglang-cache-aware", "gie"] {
        let (mut router, ids) = router(policy, 4);
        let text = prompt("remember me ", 2000, 1);
        let request = RouteRequest::text("m", &text);
        // Dry runs: nothing recorded, so no candidate is credited with the prompt (and
        // SGLang's smallest-tree rule keeps its first choice).
        let first = router.route(&request, 0.0).unwrap().best().unwrap();
        for _ in 0..3 {
            let decision = router.route(&request, 0.0).unwrap();
            if policy == "sglang-cache-aware" {
                assert_eq!(decision.best(), Some(first), "{policy}");
            }
            let credited = decision
                .eligible_candidates()
                .iter()
                .any(|c| c.terms.matched_blocks > 0);
            assert!(!credited, "{policy}: a dry run was remembered");
        }
        // Routed to another candidate than the first (a retry): that one is remembered.
        let decision = router.route(&request, 0.0).unwrap();
        let retry = *ids.iter().find(|&&id| id != first).unwrap();
        let plan = decision.plan_for(retry);
        router
            .observe(
                Observation::Routed {
                    request: RequestId(1),
                    instance: retry,
                    plan,
                },
                0.0,
            )
            .unwrap();
        finish(&mut router, 1, 0.1);
        assert_eq!(
            router.route(&request, 1.0).unwrap().best(),
            Some(retry),
            "{policy}: the prompt's holder is where it was sent"
        );
    }
}

/// A prompt prepared outside the router decides exactly as `route` does, and one prepared for
/// another model is hashed again rather than looked up under the wrong chain.
#[test]
fn prepared_prompts_route_like_route() {
    let (mut router, _) = router("cost", 4);
    for id in 0..20u64 {
        let text = prompt("shared system prompt ", 1500, id % 3);
        send(
            &mut router,
            id,
            &RouteRequest::text("m", &text),
            id as f64 * 0.01,
        );
    }
    let text = prompt("shared system prompt ", 1500, 1);
    let request = RouteRequest::text("m", &text);
    let direct = router.route(&request, 1.0).unwrap();
    let prepared = switchyard_core::prepare(&request, router.block_bytes());
    let via_prepared = router.route_prepared(&request, &prepared, 1.0).unwrap();
    let wrong = switchyard_core::prepare(&RouteRequest::text("other", &text), router.block_bytes());
    let via_wrong = router.route_prepared(&request, &wrong, 1.0).unwrap();
    let cached = |d: &switchyard_core::Decision| -> Vec<(InstanceId, u32)> {
        let mut v: Vec<_> = d
            .eligible_candidates()
            .iter()
            .map(|c| (c.instance, c.terms.cached_tokens))
            .collect();
        v.sort();
        v
    };
    assert!(
        cached(&direct).iter().any(|&(_, t)| t > 0),
        "the prompt is held somewhere"
    );
    assert_eq!(cached(&direct), cached(&via_prepared));
    assert_eq!(cached(&direct), cached(&via_wrong));
}

/// The load-balancing baselines honour instance weights, as nginx and Envoy do.
#[test]
fn baselines_honour_weights() {
    let weighted = |policy: &str| {
        let mut router = Router::new(RouterConfig {
            policy: policy.into(),
            ..Default::default()
        })
        .unwrap();
        let mut heavy = InstanceSpec::new("heavy", "m");
        heavy.weight = 3.0;
        let heavy = router.add_instance(heavy).unwrap();
        router
            .add_instance(InstanceSpec::new("light", "m"))
            .unwrap();
        (router, heavy)
    };
    // Round robin: exactly 3 of every 4.
    let (mut router, heavy) = weighted("round-robin");
    let picks: Vec<bool> = (0..8)
        .map(|i| {
            let id = send(&mut router, i, &RouteRequest::text("m", "x"), 0.0);
            finish(&mut router, i, 0.01);
            id == heavy
        })
        .collect();
    assert_eq!(picks.iter().filter(|&&h| h).count(), 6, "{picks:?}");
    // Random: about 3 in 4.
    let (mut router, heavy) = weighted("random");
    let n = 4000;
    let hits = (0..n)
        .filter(|_| {
            router
                .route(&RouteRequest::text("m", "x"), 0.0)
                .unwrap()
                .best()
                == Some(heavy)
        })
        .count();
    assert!((2850..3150).contains(&hits), "{hits} of {n}");
    // Least load: requests in flight count divided by the weight, so four open requests split
    // 3 : 1 whichever way the first tie falls.
    let (mut router, heavy) = weighted("least-load");
    let on_heavy = (0..4)
        .filter(|&i| send(&mut router, i, &RouteRequest::text("m", "x"), 0.0) == heavy)
        .count();
    assert_eq!(on_heavy, 3);
    // A weight must be a positive number.
    let mut bad = InstanceSpec::new("bad", "m");
    bad.weight = 0.0;
    assert!(Router::new(RouterConfig::default())
        .unwrap()
        .add_instance(bad)
        .is_err());
}

/// Routes `request` to `instance` (whatever the decision preferred) and records it.
fn send_to(router: &mut Router, id: u64, request: &RouteRequest<'_>, to: InstanceId, now: f64) {
    let plan = router.route(request, now).unwrap().plan_for(to);
    router
        .observe(
            Observation::Routed {
                request: RequestId(id),
                instance: to,
                plan,
            },
            now,
        )
        .unwrap();
}

#[test]
fn cost_sends_a_long_prompt_to_the_shorter_queue_even_where_more_sequences_decode() {
    let (mut router, ids) = router("cost", 2);
    // Instance 0: forty sequences decoding, nothing queued. Instance 1: one long prompt queued.
    for id in 0..40 {
        let text = prompt("decoding ", 200, id);
        send_to(
            &mut router,
            id,
            &RouteRequest::text("m", &text),
            ids[0],
            0.0,
        );
        router
            .observe(Observation::FirstToken(RequestId(id)), 0.0)
            .unwrap();
    }
    let queued = prompt("queued ", 8000, 100);
    send_to(
        &mut router,
        100,
        &RouteRequest::text("m", &queued),
        ids[1],
        0.0,
    );
    // A prompt no instance holds: its prefill stalls whichever batch it joins, so only the
    // queue ahead of it tells the instances apart.
    let long = prompt("a long document ", 30_000, 200);
    let decision = router.route(&RouteRequest::text("m", &long), 0.0).unwrap();
    let (busy, queued) = (
        decision.candidate(ids[0]).unwrap(),
        decision.candidate(ids[1]).unwrap(),
    );
    assert!(queued.terms.wait_s > busy.terms.wait_s);
    assert_eq!(busy.terms.decode_penalty_s, 0.0, "{}", decision.explain(2));
    assert_eq!(decision.best(), Some(ids[0]), "{}", decision.explain(2));
}

#[test]
fn cost_learns_an_engines_sequence_limit_from_requests_waiting_beside_a_full_batch() {
    let (mut router, ids) = router("cost", 4);
    let scrape = |router: &mut Router, id, running, waiting, kv: Option<f64>| {
        let m = EngineMetrics {
            running,
            waiting,
            kv_usage: kv,
            ..Default::default()
        };
        router
            .observe(Observation::MetricsScraped(id, m), 0.0)
            .unwrap();
    };
    // Two slots, both busy, a request waiting at two scrapes in a row (llama.cpp's
    // `requests_deferred`).
    scrape(&mut router, ids[0], 2, 1, None);
    scrape(&mut router, ids[0], 2, 1, None);
    // A full KV cache makes requests wait too: that is no sequence limit.
    scrape(&mut router, ids[1], 2, 1, Some(0.99));
    scrape(&mut router, ids[1], 2, 1, Some(0.99));
    // Two running, none waiting: no limit seen.
    scrape(&mut router, ids[2], 2, 0, None);
    // A request caught between two steps (vLLM admits it at the next one): the batch has grown
    // by the next scrape, so that was no limit.
    scrape(&mut router, ids[3], 2, 1, None);
    scrape(&mut router, ids[3], 3, 0, None);
    let decision = router
        .route(&RouteRequest::text("m", "hello"), 0.1)
        .unwrap();
    let wait = |i: usize| decision.candidate(ids[i]).unwrap().terms.wait_s;
    let no_slot_wait = wait(2);
    assert!(
        wait(0) > no_slot_wait + 0.1,
        "a request waits for one of two slots: {}",
        decision.explain(3)
    );
    assert!(wait(1) < wait(0), "{}", decision.explain(3));
    assert!(wait(3) < no_slot_wait + 1e-9, "{}", decision.explain(4));
    assert_eq!(router.learned(ids[3]).unwrap().max_running, None);
    // A smaller batch seen later with requests waiting does not lower the limit.
    scrape(&mut router, ids[0], 1, 3, None);
    // One running: under a limit of two there is a free slot (under one there would not be).
    scrape(&mut router, ids[0], 1, 0, None);
    let decision = router
        .route(&RouteRequest::text("m", "hello"), 0.2)
        .unwrap();
    let c0 = decision.candidate(ids[0]).unwrap();
    assert!(
        c0.terms.wait_s < no_slot_wait + 1e-9,
        "{}",
        decision.explain(3)
    );
}

#[test]
fn cost_prices_the_slots_an_engine_declares() {
    let (mut router, ids) = router("cost", 2);
    // Both engines run two sequences; only the first says it has two slots (llama.cpp's
    // `/props`), so only there does a third request wait for one.
    for (i, max_running) in [(0, Some(2)), (1, None)] {
        let m = EngineMetrics {
            running: 2,
            max_running,
            ..Default::default()
        };
        router
            .observe(Observation::MetricsScraped(ids[i], m), 0.0)
            .unwrap();
    }
    let decision = router
        .route(&RouteRequest::text("m", "hello"), 0.1)
        .unwrap();
    let wait = |i: usize| decision.candidate(ids[i]).unwrap().terms.wait_s;
    assert!(wait(0) > wait(1) + 0.1, "{}", decision.explain(2));
    assert_eq!(decision.best(), Some(ids[1]), "{}", decision.explain(2));
}

#[test]
fn a_slots_service_time_leaves_out_the_time_queued_for_it() {
    let (mut router, ids) = router("cost", 1);
    let rate = RouterConfig::default().estimates.learning_rate;
    // Queued for 5 s, then half a second of prefill and decode.
    let text = prompt("a short question ", 100, 1);
    send(&mut router, 1, &RouteRequest::text("m", &text), 0.0);
    router
        .observe(Observation::FirstToken(RequestId(1)), 5.0)
        .unwrap();
    router
        .observe(Observation::Finished(RequestId(1), None), 5.5)
        .unwrap();
    // The first sample replaces the prior: the decode (0.5 s) plus at most the prefill of 100
    // tokens.
    let first = router.learned(ids[0]).unwrap().service_time_s;
    assert!((0.5..=0.6).contains(&first), "{first}");
    // Later samples move it as a moving average, within its window as a plain mean.
    send(&mut router, 2, &RouteRequest::text("m", &text), 6.0);
    router
        .observe(Observation::FirstToken(RequestId(2)), 6.0)
        .unwrap();
    router
        .observe(Observation::Finished(RequestId(2), None), 7.5)
        .unwrap();
    let second = router.learned(ids[0]).unwrap().service_time_s;
    let expected = first + (1.0 / 2.0f64).max(rate) * (1.5 - first);
    assert!((second - expected).abs() < 0.06, "{second} vs {expected}");
}

#[test]
fn cost_prices_the_cache_room_a_second_copy_takes_by_the_hit_share_learned() {
    let (mut router, ids) = router("cost", 2);
    let shared = |n: u64| prompt("a long shared document about rivers. ", 3000, n);
    // The first instance holds the document.
    send_to(
        &mut router,
        1,
        &RouteRequest::text("m", &shared(1)),
        ids[0],
        0.0,
    );
    finish(&mut router, 1, 0.5);
    let room = |router: &mut Router, now: f64| {
        let decision = router
            .route(&RouteRequest::text("m", &shared(2)), now)
            .unwrap();
        let c = |i: usize| *decision.candidate(ids[i]).unwrap();
        (c(0), c(1))
    };
    // Nothing is learned of the second instance's reuse yet: a copy there costs no room.
    let (holder, other) = room(&mut router, 1.0);
    assert!(holder.terms.cached_tokens > 1000, "{:?}", holder.terms);
    assert_eq!(other.terms.cache_room_s, 0.0);
    // The second instance serves half of its prompts from cache: the room a copy of the document
    // takes there held prefixes it would have reused.
    for id in 10..40 {
        let text = prompt("another tenant's prompt. ", 1000, id);
        send_to(
            &mut router,
            id,
            &RouteRequest::text("m", &text),
            ids[1],
            1.0,
        );
        finish_with_cached(&mut router, id, 500, 1.1, 1.2);
    }
    let (holder, other) = room(&mut router, 2.0);
    assert_eq!(holder.terms.cache_room_s, 0.0, "{:?}", holder.terms);
    let h = router.learned(ids[1]).unwrap().hit_share;
    assert!(h > 0.3, "{h}");
    // The copy costs h / (1 − h) of the duplicated tokens' prefill.
    let duplicated = f64::from(holder.terms.cached_tokens - other.terms.cached_tokens);
    let per_token = other.terms.prefill_s / f64::from(other.terms.uncached_tokens);
    let expected = duplicated * per_token * h / (1.0 - h);
    assert!(
        (other.terms.cache_room_s - expected).abs() < 1e-9 * expected.max(1.0),
        "{} against {expected}",
        other.terms.cache_room_s
    );
}

/// A two-instance `cost` router with `history_room_weight` set, where the first instance holds
/// a document (continued by `continuations` different prompts) and the second has learned that
/// half of its prompt tokens come from cache: the second's cache room for the next copy.
fn cache_room_of_a_copy(history_room_weight: f64, continuations: u64) -> f64 {
    let mut config = RouterConfig {
        policy: "cost".into(),
        ..Default::default()
    };
    config.cost.history_room_weight = history_room_weight;
    let (mut router, ids) = router_with(config, 2);
    let document = |n: u64| prompt("a long document about rivers. ", 3000, n);
    for n in 1..=continuations {
        send_text_to(&mut router, n, &document(n), ids[0], 0.0);
        finish(&mut router, n, 0.5);
    }
    for id in 10..40 {
        let text = prompt("another tenant's prompt. ", 1000, id);
        send_text_to(&mut router, id, &text, ids[1], 1.0);
        finish_with_cached(&mut router, id, 500, 1.1, 1.2);
    }
    let decision = router
        .route(&RouteRequest::text("m", &document(100)), 2.0)
        .unwrap();
    let other = decision.candidate(ids[1]).unwrap();
    assert!(other.terms.cache_room_s > 0.0, "{:?}", other.terms);
    other.terms.cache_room_s
}

#[test]
fn a_copy_of_one_conversations_history_is_priced_at_its_own_weight() {
    // One earlier prompt: the document is one conversation's history, priced at
    // `history_room_weight`.
    let history = cache_room_of_a_copy(1.0, 1);
    let heavier = cache_room_of_a_copy(100.0, 1);
    assert!(
        (heavier / history - 100.0).abs() < 1e-6,
        "{heavier} against {history}"
    );
    // Two prompts continued it differently: a shared prefix keeps `cache_room_weight`, so a
    // popular prefix still spreads however sticky conversations are made.
    let shared = cache_room_of_a_copy(1.0, 2);
    let shared_heavier = cache_room_of_a_copy(100.0, 2);
    assert!(
        (shared_heavier - shared).abs() < 1e-9,
        "{shared_heavier} against {shared}"
    );
}

#[test]
fn cost_prices_extra_prefill_by_how_often_every_slot_was_taken() {
    let (mut router, ids) = router("cost", 3);
    // Every engine declares two sequence slots (llama.cpp's `/props`).
    for &id in &ids {
        let m = EngineMetrics {
            max_running: Some(2),
            ..Default::default()
        };
        router
            .observe(Observation::MetricsScraped(id, m), 0.0)
            .unwrap();
    }
    let doc = |n: u64| prompt("a long shared manual about pumps. ", 4000, n);
    // Instance 0 holds the manual; instance 1 had both slots taken for 30 s; instance 2 never.
    send_to(
        &mut router,
        1,
        &RouteRequest::text("m", &doc(1)),
        ids[0],
        0.0,
    );
    finish(&mut router, 1, 0.5);
    for id in [2, 3] {
        let text = prompt("a tenant's own prompt. ", 500, id);
        send_to(
            &mut router,
            id,
            &RouteRequest::text("m", &text),
            ids[1],
            1.0,
        );
    }
    finish(&mut router, 2, 31.0);
    finish(&mut router, 3, 31.0);
    let pressure = |i: usize| router.learned(ids[i]).unwrap().slot_pressure.share;
    let (p0, p1, p2) = (pressure(0), pressure(1), pressure(2));
    assert!(p1 > 0.5, "full for 30 s of the last 31: {p1}");
    assert!(p0 < 0.05 && p2 == 0.0, "{p0} {p2}");
    let decision = router
        .route(&RouteRequest::text("m", &doc(2)), 31.5)
        .unwrap();
    let c = |i: usize| *decision.candidate(ids[i]).unwrap();
    let (holder, pressed, free) = (c(0), c(1), c(2));
    // Both others prefill what the holder has cached; where slots are often all taken, that
    // extra work delays the requests that queue for them, about p / (1 - p) of them.
    let extra_s = pressed.terms.prefill_s - holder.terms.prefill_s;
    assert!(extra_s > 0.05, "{}", decision.explain(3));
    let p = router.learned(ids[1]).unwrap().slot_pressure.share;
    let charged = pressed.terms.decode_penalty_s - free.terms.decode_penalty_s;
    assert!(
        (charged - extra_s * p / (1.0 - p)).abs() < 1e-3,
        "{charged} vs {}: {}",
        extra_s * p / (1.0 - p),
        decision.explain(3)
    );
    assert!(pressed.score > free.score, "{}", decision.explain(3));
}

#[test]
fn cost_charges_no_prefill_backlog_where_the_queue_waits_for_a_slot() {
    let (mut router, ids) = router("cost", 2);
    // Instance 0 declares two sequence slots (llama.cpp's `/props`); instance 1 declares none.
    let slots = EngineMetrics {
        max_running: Some(2),
        ..Default::default()
    };
    router
        .observe(Observation::MetricsScraped(ids[0], slots), 0.0)
        .unwrap();
    // Each gets two running requests and two queued behind them.
    let mut next = 1;
    for &id in &ids {
        for k in 0..4 {
            let text = prompt("a tenant's own prompt. ", 400, next);
            send_to(&mut router, next, &RouteRequest::text("m", &text), id, 0.0);
            if k < 2 {
                router
                    .observe(Observation::FirstToken(RequestId(next)), 0.1)
                    .unwrap();
            }
            next += 1;
        }
    }
    let text = prompt("a new conversation. ", 400, next);
    let decision = router.route(&RouteRequest::text("m", &text), 0.2).unwrap();
    let (bound, open) = (
        *decision.candidate(ids[0]).unwrap(),
        *decision.candidate(ids[1]).unwrap(),
    );
    // Where the queue waits for the compute, the requests arriving behind this one wait for
    // its prefill too; where it waits for a slot, it drains as sequences end: the wait for
    // the slot is priced, not the prefill backlog.
    assert!(open.terms.decode_penalty_s > 0.0, "{}", decision.explain(2));
    assert_eq!(bound.terms.decode_penalty_s, 0.0, "{}", decision.explain(2));
    assert!(
        bound.terms.wait_s > open.terms.wait_s,
        "{}",
        decision.explain(2)
    );
}

/// Clients send one generous `max_tokens` while answers stop early: once answers are measured,
/// the KV reserved for the requests still in flight follows them, and an instance that only
/// looked full by the limit stops paying the KV penalty. A prefill leg's one token, or an
/// engine that reports no generated tokens, teaches nothing.
#[test]
fn the_kv_reservation_follows_the_answers_measured_not_the_limit() {
    let mut router = Router::new(RouterConfig::default()).unwrap();
    let spec = InstanceSpec {
        kv_capacity_tokens: Some(100_000),
        ..InstanceSpec::new("a", "m")
    };
    let a = router.add_instance(spec).unwrap();
    let texts: Vec<String> = (0..40).map(|i| prompt("words. ", 100, i)).collect();
    let generous = |text| RouteRequest {
        max_tokens: 4096,
        ..RouteRequest::text("m", text)
    };
    // 30 requests in flight reserve 30 × (100 + 4,096) tokens by the limit: past capacity.
    for (id, text) in texts.iter().enumerate().take(30) {
        send(&mut router, id as u64, &generous(text), 0.0);
    }
    let full = router.route(&generous(&texts[39]), 0.0).unwrap();
    assert!(full.candidate(a).unwrap().terms.kv_penalty_s > 0.0);
    assert_eq!(router.output_share(), 1.0, "nothing measured yet");
    let end = |router: &mut Router, id: u64, completion_tokens: u32| {
        router
            .observe(Observation::FirstToken(RequestId(id)), 1.0)
            .unwrap();
        let usage = Usage {
            prompt_tokens: 100,
            cached_tokens: None,
            completion_tokens,
        };
        router
            .observe(Observation::Finished(RequestId(id), Some(usage)), 2.0)
            .unwrap();
    };
    // Engines that count no generated tokens say nothing about answer lengths.
    end(&mut router, 0, 0);
    assert_eq!(router.output_share(), 1.0);
    // Answers of 128 tokens, a thirty-second of the limit; 22 requests stay in flight, still
    // past the watermark by the limit (22 × 4,196 + 4,196 tokens of 100,000).
    for id in 1..8 {
        end(&mut router, id, 128);
    }
    let share = router.output_share();
    assert!(share < 0.1, "{share}");
    let load = &router.fleet().get(a).unwrap().load;
    let reserved = load.kv_tokens(share);
    assert!(
        reserved < 22 * (100 + 4096) / 4,
        "the 22 in flight are re-priced: {reserved}"
    );
    let relieved = router.route(&generous(&texts[39]), 2.0).unwrap();
    assert_eq!(relieved.candidate(a).unwrap().terms.kv_penalty_s, 0.0);
}

#[test]
fn a_shortfall_below_the_engines_cache_unit_is_no_eviction() {
    let (mut router, ids) = router("cost", 2);
    let doc = |n: u64| prompt("a long shared document about rivers. ", 3000, n);
    send_to(
        &mut router,
        1,
        &RouteRequest::text("m", &doc(1)),
        ids[0],
        0.0,
    );
    finish(&mut router, 1, 0.5);
    // Unrelated prompts open alike (as a chat template does): the index matches their first
    // 32 bytes, about 8 tokens, which an engine caching 16-token blocks never reports.
    for id in 10..60 {
        let text = format!(
            "You are a helpful assistant, ok.{}",
            prompt(&format!("topic {id} "), 1000, id)
        );
        send_to(
            &mut router,
            id,
            &RouteRequest::text("m", &text),
            ids[0],
            id as f64,
        );
        // One answer in ten reuses a 16-token block: the engine's unit.
        let cached = if id % 10 == 0 { 16 } else { 0 };
        finish_with_cached(&mut router, id, cached, id as f64 + 0.1, id as f64 + 0.1);
    }
    assert_eq!(router.learned(ids[0]).unwrap().cache_unit_tokens, 16);
    let decision = router
        .route(&RouteRequest::text("m", &doc(2)), 100.0)
        .unwrap();
    let holder = decision.candidate(ids[0]).unwrap().terms;
    assert!(
        holder.cached_tokens > 1000,
        "the document is still believed held: {}",
        decision.explain(2)
    );
}

/// One round of 200-token prompts sent at `now`, one to each of `targets` (ids from `*next_id`,
/// prompts labelled `label`), first tokens 50 ms later and answers of 101 tokens `answer_s`
/// after that; returns the time 10 ms after they end.
fn answer_round(
    router: &mut Router,
    targets: &[InstanceId],
    label: &str,
    next_id: &mut u64,
    mut now: f64,
    answer_s: f64,
) -> f64 {
    let first = *next_id;
    for &to in targets {
        let id = *next_id;
        let text = prompt(&format!("{label} {id} "), 200, id);
        send_to(router, id, &RouteRequest::text("m", &text), to, now);
        *next_id += 1;
    }
    now += 0.05;
    for r in first..*next_id {
        router
            .observe(Observation::FirstToken(RequestId(r)), now)
            .unwrap();
    }
    now += answer_s;
    for r in first..*next_id {
        let usage = Usage {
            prompt_tokens: 200,
            cached_tokens: None,
            completion_tokens: 101,
        };
        router
            .observe(Observation::Finished(RequestId(r), Some(usage)), now)
            .unwrap();
    }
    now + 0.01
}

/// Answers of 101 tokens on instance `ids[0]`, in batches of 1 to 4 sequences decoding at once,
/// each token taking `per_sequence_s` per sequence in the batch: what a CPU engine does.
fn decode_in_batches(router: &mut Router, ids: &[InstanceId], per_sequence_s: f64) -> f64 {
    let mut now = 0.0;
    let mut id = 0u64;
    for round in 0..40u32 {
        let batch = 1 + round % 4;
        let targets = vec![ids[0]; batch as usize];
        let answer_s = 100.0 * per_sequence_s * f64::from(batch);
        now = answer_round(router, &targets, "batch", &mut id, now, answer_s);
    }
    now
}

#[test]
fn cost_learns_what_one_more_decoding_sequence_costs() {
    let (mut router, ids) = router("cost", 2);
    decode_in_batches(&mut router, &ids, 0.001);
    let slope = router.learned(ids[0]).unwrap().decode_slope.per_sequence_s;
    assert!(
        (slope - 0.001).abs() < 0.0001,
        "learned {slope} s per sequence"
    );
}

#[test]
fn cost_prices_the_decode_batch_a_first_token_comes_out_of() {
    // Instance 0 holds the prompt's first half (1,000 tokens: 50 ms of prefill at the prior
    // speed); instance 1 holds nothing. A hundred sequences decode on instance 0: where each
    // costs a millisecond a step, the first token there comes 100 ms later, more than the
    // prefill saved; where they cost nothing learned, the holder wins.
    for (per_sequence_s, expect_holder) in [(0.001, false), (0.0, true)] {
        let (mut router, ids) = router("cost", 2);
        let mut now = 0.0;
        if per_sequence_s > 0.0 {
            now = decode_in_batches(&mut router, &ids, per_sequence_s);
        }
        let shared = "shared system prompt. ";
        let text = prompt(shared, 2000, 10_000);
        let held = send(&mut router, 10_000, &RouteRequest::text("m", &text), now);
        finish(&mut router, 10_000, now + 0.01);
        let holder = usize::from(held != ids[0]);
        for id in 10_001..10_101u64 {
            let text = prompt(&format!("busy {id} "), 100, id);
            send_to(
                &mut router,
                id,
                &RouteRequest::text("m", &text),
                ids[holder],
                now,
            );
            router
                .observe(Observation::FirstToken(RequestId(id)), now + 0.01)
                .unwrap();
        }
        now += 0.02;
        let text = prompt(shared, 2000, 10_200);
        let decision = router.route(&RouteRequest::text("m", &text), now).unwrap();
        assert_eq!(
            decision.best() == Some(ids[holder]),
            expect_holder,
            "per sequence {per_sequence_s} s: {:?}",
            decision.candidates
        );
    }
}

/// Routes `text` and records it at `to`.
fn send_text_to(router: &mut Router, id: u64, text: &str, to: InstanceId, now: f64) {
    send_to(router, id, &RouteRequest::text("m", text), to, now);
}

/// Where the next prompt of `prefix` goes when instance 0 holds it (continued by
/// `continuations` earlier prompts) and decodes twenty sequences while instance 1 decodes none,
/// on engines whose learned step costs a millisecond per sequence.
fn prefix_holder_with_a_large_batch(prefix: &str, continuations: u64) -> switchyard_core::Decision {
    let (mut router, ids) = router("cost", 2);
    let mut now = decode_in_batches(&mut router, &ids, 0.001);
    for n in 0..continuations {
        let id = 20_000 + n;
        let text = prompt(prefix, 2000, id);
        send_text_to(&mut router, id, &text, ids[0], now);
        finish(&mut router, id, now + 0.01);
        now += 0.02;
    }
    for id in 30_000..30_020u64 {
        let text = prompt(&format!("busy {id} "), 100, id);
        send_text_to(&mut router, id, &text, ids[0], now);
        router
            .observe(Observation::FirstToken(RequestId(id)), now + 0.01)
            .unwrap();
    }
    now += 0.02;
    let text = prompt(prefix, 2000, 20_000 + continuations);
    router.route(&RouteRequest::text("m", &text), now).unwrap()
}

#[test]
fn cost_does_not_pack_the_holder_of_a_shared_prefix_but_keeps_a_conversation_there() {
    // A prefix two prompts have continued differently is shared: every request naming it is
    // pulled to the holder, so its batch above the other's (21 against 1 sequence) is charged
    // the answer's slower decode (about 100 tokens at a millisecond per extra sequence), which
    // outweighs the prefill it saves. One earlier prompt makes it one conversation's history,
    // which pulls nothing but its own next turn: no charge, the holder wins on its cache.
    let ids_of = |d: &switchyard_core::Decision| {
        d.ranked_candidates()
            .map(|c| (c.instance.slot, c.terms.packing_s))
            .collect::<Vec<_>>()
    };
    let shared = prefix_holder_with_a_large_batch("shared system prompt. ", 2);
    let best = shared.ranked_candidates().next().unwrap();
    assert_eq!(best.instance.slot, 1, "{:?}", ids_of(&shared));
    let holder = shared
        .candidates
        .iter()
        .find(|c| c.instance.slot == 0)
        .unwrap();
    assert!(holder.terms.packing_s > 0.5, "{:?}", holder.terms);
    assert_eq!(best.terms.packing_s, 0.0);

    let private = prefix_holder_with_a_large_batch("one conversation so far. ", 1);
    let best = private.ranked_candidates().next().unwrap();
    assert_eq!(best.instance.slot, 0, "{:?}", ids_of(&private));
    assert_eq!(best.terms.packing_s, 0.0);
}

#[test]
fn cost_learns_how_long_an_adapter_load_takes() {
    // The engine loads an adapter in 0.1 s where the settings guess 0.5 s.
    let (mut router, ids) = lora_router("cost", 1, 64, RouterConfig::default());
    assert_eq!(router.adapter_load_s(), 0.5);
    let names: Vec<String> = (0..40).map(|n| format!("a{n}")).collect();
    for (n, name) in names.iter().enumerate() {
        let now = n as f64;
        let request = with_adapter(name);
        let decision = router.route(&request, now).unwrap();
        let terms = decision.candidate(ids[0]).unwrap().terms;
        assert!(terms.adapter_s > 0.0, "a new adapter is loaded");
        let plan = decision.plan_for(ids[0]);
        let estimate = plan.estimated_ttft_s().unwrap();
        let id = RequestId(n as u64);
        router
            .observe(
                Observation::Routed {
                    request: id,
                    instance: ids[0],
                    plan,
                },
                now,
            )
            .unwrap();
        // The rest of the estimate, the fixed part's 10 ms prior, and the real load.
        let first_token = now + (estimate - terms.adapter_s) + 0.010 + 0.1;
        router
            .observe(Observation::FirstToken(id), first_token)
            .unwrap();
        router
            .observe(Observation::Finished(id, None), first_token + 0.05)
            .unwrap();
    }
    assert!(
        (router.adapter_load_s() - 0.1).abs() < 0.01,
        "learned {}",
        router.adapter_load_s()
    );
    let decision = router.route(&with_adapter("new"), 50.0).unwrap();
    let priced = decision.candidate(ids[0]).unwrap().terms.adapter_s;
    assert!((priced - 0.1).abs() < 0.01, "priced {priced}");
    // Loads teach the load time, not the instance's fixed part.
    let fixed = router.learned(ids[0]).unwrap().ttft_fixed_s;
    assert_eq!(fixed.samples, 0);
}

/// Rounds of answers of 101 tokens, one on each of 1-3 of the three instances at once, each token
/// taking 2 ms times (1 + `share` per other busy instance): engines that share a host's cores
/// lose `share` of their speed per busy neighbour; `share` 0 is a device each.
fn answers_beside_neighbours(router: &mut Router, ids: &[InstanceId], share: f64) -> f64 {
    let mut now = 0.0;
    let mut id = 0u64;
    for round in 0..90u32 {
        let busy = 1 + (round % 3) as usize;
        let start = (round / 3) as usize;
        let targets: Vec<InstanceId> = (0..busy).map(|k| ids[(start + k) % ids.len()]).collect();
        let jitter = if round % 2 == 0 { 0.00005 } else { -0.00005 };
        let answer_s = 100.0 * (0.002 * (1.0 + share * (busy - 1) as f64) + jitter);
        now = answer_round(router, &targets, "answer", &mut id, now, answer_s);
    }
    now
}

#[test]
fn cost_learns_how_much_engines_sharing_cores_slow_each_other() {
    for share in [0.5, 0.0] {
        let (mut router, ids) = router("cost", 3);
        answers_beside_neighbours(&mut router, &ids, share);
        for &id in &ids {
            let learned = router
                .learned(id)
                .unwrap()
                .shared_compute
                .share_per_neighbour;
            assert!(
                (learned - share).abs() < 0.1,
                "true share {share}, learned {learned} on {id:?}"
            );
        }
    }
}

#[test]
fn on_shared_cores_a_move_is_charged_the_stall_it_gives_first_tokens_elsewhere() {
    // Instance 0 holds a conversation and has a long prompt queued; instance 1 is idle; four
    // requests wait for a first token on instance 2. Moving the conversation to instance 1
    // prefills it again there, which on shared cores slows instance 2's prefills as well.
    let mut penalties = Vec::new();
    for share in [0.5, 0.0] {
        let (mut router, ids) = router("cost", 3);
        let mut now = answers_beside_neighbours(&mut router, &ids, share);
        let history = prompt("our conversation so far. ", 2000, 20_000);
        send_to(
            &mut router,
            20_000,
            &RouteRequest::text("m", &history),
            ids[0],
            now,
        );
        finish(&mut router, 20_000, now + 0.1);
        now += 0.2;
        let queued = prompt("queued ", 4000, 20_001);
        send_to(
            &mut router,
            20_001,
            &RouteRequest::text("m", &queued),
            ids[0],
            now,
        );
        for id in 20_002..20_006u64 {
            let text = prompt(&format!("waiting {id} "), 500, id);
            send_to(
                &mut router,
                id,
                &RouteRequest::text("m", &text),
                ids[2],
                now,
            );
        }
        let next_turn = format!("{history} and the next question");
        let decision = router
            .route(&RouteRequest::text("m", &next_turn), now)
            .unwrap();
        let holder = decision.candidate(ids[0]).unwrap().terms;
        let mover = decision.candidate(ids[1]).unwrap().terms;
        assert!(holder.cached_tokens > mover.cached_tokens + 1000);
        penalties.push((
            holder.decode_penalty_s,
            mover.decode_penalty_s,
            mover.prefill_s,
        ));
    }
    let [(holder_shared, mover_shared, prefill), (holder_apart, mover_apart, _)] = penalties[..]
    else {
        unreachable!()
    };
    // The holder prefills only the new question: nothing avoidable to charge.
    assert!((holder_shared - holder_apart).abs() < 1e-9, "{penalties:?}");
    // The mover's avoidable prefill (about its whole prefill) at half speed lost for each of
    // the five requests waiting for a first token (the four and the queued prompt): about two
    // and a half times its prefill more.
    let extra = mover_shared - mover_apart;
    assert!(
        extra > 2.0 * prefill && extra < 2.6 * prefill,
        "{penalties:?}"
    );
}

/// A `cost` router (`calibrate_prefill` as given) whose engines take twice the estimated prefill
/// and the estimated wait at face value: bursts of one to three prompts of varied lengths sent
/// to instance 0, each answered at the estimate's wait plus twice its prefill (speeds frozen at
/// the prior, so only the fit can learn the factor).
fn router_whose_prefill_takes_twice_its_estimate(calibrate: bool) -> (Router, Vec<InstanceId>) {
    let mut config = RouterConfig {
        policy: "cost".into(),
        ..Default::default()
    };
    config.cost.calibrate_prefill = calibrate;
    config.estimates.learning_rate = 1e-6;
    let (mut router, ids) = router_with(config, 2);
    let mut now = 0.0;
    let mut id = 0u64;
    for burst in 0..150u64 {
        let mut sent = Vec::new();
        for k in 0..=(burst % 3) {
            id += 1;
            let tokens = 200 + ((id * 7919) % 13) as usize * 150;
            let text = prompt(&format!("tenant {id} "), tokens, id);
            let request = RouteRequest::text("m", &text);
            let decision = router.route(&request, now).unwrap();
            let (wait_s, prefill_s) = decision.candidate(ids[0]).unwrap().terms.raw_wait_prefill_s;
            send_to(&mut router, id, &request, ids[0], now);
            sent.push((
                id,
                now + 0.005 + wait_s + 2.0 * prefill_s + 0.001 * k as f64,
            ));
        }
        for &(id, first_token) in &sent {
            router
                .observe(Observation::FirstToken(RequestId(id)), first_token)
                .unwrap();
        }
        let end = sent.iter().map(|&(_, t)| t).fold(now, f64::max) + 0.01;
        for &(id, _) in &sent {
            router
                .observe(Observation::Finished(RequestId(id), None), end)
                .unwrap();
        }
        now = end + 0.1;
    }
    (router, ids)
}

#[test]
fn cost_learns_what_an_estimated_second_of_prefill_is_worth_and_prices_hits_at_it_when_set() {
    let (off, _) = router_whose_prefill_takes_twice_its_estimate(false);
    let fit = off.ttft_calibration();
    assert!((fit.scale.prefill - 2.0).abs() < 0.1, "{fit:?}");
    assert!((fit.scale.wait - 1.0).abs() < 0.1, "{fit:?}");
    // Learned, shown, but not priced unless asked for.
    assert_eq!(off.prefill_factor(), 1.0);
    // Both TTFT predictions are scored on every first token (which one is reported:
    // `calibration::tests::the_prediction_that_has_predicted_better_is_reported`).
    assert_eq!(off.prediction_choice().samples, fit.samples);
    let (mut on, ids) = router_whose_prefill_takes_twice_its_estimate(true);
    let factor = on.prefill_factor();
    assert!((factor - 2.0).abs() < 0.1, "{factor}");
    // Instance 1 holds a manual; on instance 0 its prefill is avoidable, priced at the factor,
    // while the part every candidate pays stays at face value.
    let manual = |n: u64| prompt("a long shared manual about pumps. ", 3000, n);
    send_text_to(&mut on, 90_000, &manual(1), ids[1], 100.0);
    finish(&mut on, 90_000, 100.2);
    let factor = on.prefill_factor();
    let decision = on
        .route(&RouteRequest::text("m", &manual(2)), 101.0)
        .unwrap();
    let holder = decision.candidate(ids[1]).unwrap().terms;
    let other = decision.candidate(ids[0]).unwrap().terms;
    assert!(
        holder.cached_tokens > other.cached_tokens,
        "{holder:?} {other:?}"
    );
    let (_, holder_raw) = holder.raw_wait_prefill_s;
    let (_, other_raw) = other.raw_wait_prefill_s;
    assert!((holder.prefill_s - holder_raw).abs() < 1e-12, "{holder:?}");
    let expected = holder_raw + factor * (other_raw - holder_raw);
    assert!(
        (other.prefill_s - expected).abs() < 1e-9,
        "{} against {expected}",
        other.prefill_s
    );
}
