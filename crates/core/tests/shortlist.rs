//! Scoring a large pool on a shortlist (prefix holders plus the least loaded) picks as well as
//! scoring every instance.

use proptest::prelude::*;
use switchyard_core::{
    InstanceId, InstanceSpec, Observation, RequestId, RoutePlan, RouteRequest, Router, RouterConfig,
};

fn router(n: usize, shortlist_len: usize) -> (Router, Vec<InstanceId>) {
    let mut config = RouterConfig::default();
    config.cost.shortlist_len = shortlist_len;
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

fn text(tokens: usize, seed: u64) -> String {
    let mut s = String::new();
    let mut i = 0u64;
    while s.len() < tokens * 4 {
        s.push_str(&format!("s{seed}w{i} "));
        i += 1;
    }
    s.truncate(tokens * 4);
    s
}

/// Queues `tokens` of prefill work on `instance` (a request with no first token yet).
fn queue(router: &mut Router, id: u64, instance: InstanceId, tokens: u32) {
    let plan = RoutePlan::unplanned(tokens);
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

/// Makes `instance` hold `prompt` (routed there, finished).
fn hold(router: &mut Router, id: u64, instance: InstanceId, prompt: &str) {
    let decision = router.route(&RouteRequest::text("m", prompt), 0.0).unwrap();
    let plan = decision.plan_for(instance);
    let request = RequestId(id);
    router
        .observe(
            Observation::Routed {
                request,
                instance,
                plan,
            },
            0.0,
        )
        .unwrap();
    router
        .observe(Observation::FirstToken(request), 0.5)
        .unwrap();
    router
        .observe(Observation::Finished(request, None), 1.0)
        .unwrap();
}

fn best_score(router: &mut Router, prompt: &str) -> f64 {
    let decision = router.route(&RouteRequest::text("m", prompt), 2.0).unwrap();
    // Near ties rank in random order: the best estimate is the least among them.
    decision
        .eligible_candidates()
        .iter()
        .map(|c| c.score)
        .fold(f64::INFINITY, f64::min)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_shortlist_finds_the_same_best_cost(
        n in 12usize..48,
        loads in proptest::collection::vec(0u32..30_000, 48),
        holders in proptest::collection::vec(0usize..48, 0..6),
        prefix_tokens in 500usize..6000,
    ) {
        let prefix = text(prefix_tokens, 1);
        let query = format!("{prefix}{}", text(200, 2));
        let mut scores = Vec::new();
        for shortlist_len in [0, 4] {
            let (mut r, ids) = router(n, shortlist_len);
            for (k, &h) in holders.iter().enumerate() {
                hold(&mut r, 1000 + k as u64, ids[h % n], &prefix);
            }
            for (i, &id) in ids.iter().enumerate() {
                if loads[i] > 0 {
                    queue(&mut r, i as u64, id, loads[i]);
                }
            }
            scores.push(best_score(&mut r, &query));
        }
        prop_assert!((scores[0] - scores[1]).abs() <= 1e-9 * scores[0].abs().max(1.0),
            "all: {} shortlist: {}", scores[0], scores[1]);
    }
}

#[test]
fn a_large_pool_is_scored_on_holders_plus_the_least_loaded() {
    let (mut r, ids) = router(200, 8);
    let prefix = text(4000, 7);
    hold(&mut r, 1, ids[150], &prefix);
    // Everyone but the holder and ten others is busy.
    for (i, &id) in ids.iter().enumerate() {
        if i != 150 && i >= 10 {
            queue(&mut r, 100 + i as u64, id, 5000);
        }
    }
    let decision = r
        .route(&RouteRequest::text("m", &format!("{prefix} and more")), 2.0)
        .unwrap();
    // The holder plus the eight least loaded.
    assert_eq!(decision.candidates.len(), 9);
    assert!(decision.candidate(ids[150]).is_some());
    assert!(decision
        .candidates
        .iter()
        .all(|c| c.instance == ids[150] || c.instance.slot < 10));
    assert_eq!(decision.best(), Some(ids[150]));
    // Off, every instance is a candidate.
    let (mut all, _) = router(200, 0);
    let decision = all.route(&RouteRequest::text("m", "x"), 0.0).unwrap();
    assert_eq!(decision.candidates.len(), 200);
}
