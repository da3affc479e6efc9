//! Exact mode and its fallback: an instance's KV events drive the cached-token estimate of
//! requests with token ids until its stream is lost, then the approximate index does, until the
//! driver trusts the stream again.

use switchyard_core::{
    InstanceId, InstanceSpec, KvEvent, Observation, RouteRequest, Router, RouterConfig,
};

const BLOCK: u32 = 16;

fn fleet() -> (Router, InstanceId, InstanceId) {
    let mut router = Router::new(RouterConfig::default()).unwrap();
    let a = router.add_instance(InstanceSpec::new("a", "m")).unwrap();
    let b = router.add_instance(InstanceSpec::new("b", "m")).unwrap();
    (router, a, b)
}

fn stored(first_hash: u64, tokens: &[u32]) -> KvEvent {
    let blocks = tokens.len() as u64 / u64::from(BLOCK);
    KvEvent::Stored {
        block_hashes: (first_hash..first_hash + blocks).collect(),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: BLOCK,
        lora_name: None,
    }
}

/// Cached tokens the router expects on `on` for a request carrying `tokens`.
fn cached_on(router: &mut Router, on: InstanceId, text: &str, tokens: &[u32], now: f64) -> u32 {
    let mut request = RouteRequest::text("m", text);
    request.token_ids = Some(tokens);
    let decision = router.route(&request, now).unwrap();
    decision.candidate(on).unwrap().terms.cached_tokens
}

#[test]
fn events_drive_the_estimate_until_lost_and_again_once_trusted() {
    let (mut router, a, b) = fleet();
    let tokens: Vec<u32> = (0..64).collect();
    // Text the approximate index never saw: it predicts nothing anywhere.
    let text = "t ".repeat(64);
    router
        .observe(Observation::KvEvents(b, vec![stored(1000, &tokens)]), 1.0)
        .unwrap();
    assert!(router.is_exact(b) && !router.is_exact(a));
    let mut longer = tokens.clone();
    longer.extend(100..116);
    assert_eq!(cached_on(&mut router, b, &text, &longer, 1.0), 64);
    assert_eq!(cached_on(&mut router, a, &text, &longer, 1.0), 0);
    let decision = {
        let mut request = RouteRequest::text("m", &text);
        request.token_ids = Some(&longer);
        router.route(&request, 1.0).unwrap()
    };
    assert_eq!(
        decision.best(),
        Some(b),
        "the holder wins: {}",
        decision.explain(2)
    );

    // A broken stream: b is priced on the approximate index (which never saw this text).
    router.observe(Observation::KvEventsLost(b), 2.0).unwrap();
    assert!(!router.is_exact(b));
    assert_eq!(cached_on(&mut router, b, &text, &longer, 2.0), 0);
    // The engine restarted: its driver clears the view; events after it rebuild it unused.
    router
        .observe(Observation::KvEvents(b, vec![KvEvent::AllCleared]), 2.5)
        .unwrap();
    let half: Vec<u32> = (0..32).collect();
    router
        .observe(Observation::KvEvents(b, vec![stored(2000, &half)]), 3.0)
        .unwrap();
    assert_eq!(cached_on(&mut router, b, &text, &longer, 3.0), 0);
    router
        .observe(Observation::KvEventsTrusted(b), 4.0)
        .unwrap();
    assert!(router.is_exact(b));
    assert_eq!(cached_on(&mut router, b, &text, &longer, 4.0), 32);
}

#[test]
fn a_removed_publisher_leaves_no_exact_mode_to_its_slot() {
    let (mut router, _a, b) = fleet();
    let tokens: Vec<u32> = (0..32).collect();
    router
        .observe(Observation::KvEvents(b, vec![stored(1, &tokens)]), 1.0)
        .unwrap();
    router
        .observe(Observation::InstanceRemoved(b), 2.0)
        .unwrap();
    assert_eq!(
        router.observe(Observation::KvEventsLost(b), 2.0),
        Err(switchyard_core::ObserveError::UnknownInstance(b))
    );
    let c = router.add_instance(InstanceSpec::new("c", "m")).unwrap();
    assert_eq!(c.slot, b.slot, "the slot is reused");
    assert!(!router.is_exact(c), "the newcomer publishes nothing yet");
}

#[test]
fn salted_and_adapter_requests_are_not_matched_on_base_blocks() {
    let (mut router, _a, b) = fleet();
    let tokens: Vec<u32> = (0..64).collect();
    let text = "t ".repeat(64);
    router
        .observe(Observation::KvEvents(b, vec![stored(1, &tokens)]), 1.0)
        .unwrap();
    let mut longer = tokens.clone();
    longer.push(7);
    let mut salted = RouteRequest::text("m", &text);
    salted.token_ids = Some(&longer);
    salted.cache_salt = Some("tenant-1");
    let d = router.route(&salted, 1.0).unwrap();
    assert_eq!(
        d.candidate(b).unwrap().terms.cached_tokens,
        0,
        "{}",
        d.explain(2)
    );
    assert_eq!(
        cached_on(&mut router, b, &text, &longer, 1.0),
        64,
        "unsalted"
    );
}

#[test]
fn token_ids_from_the_prepare_step_are_matched_exactly() {
    let (mut router, _a, b) = fleet();
    let tokens: Vec<u32> = (0..64).collect();
    let text = "t ".repeat(64);
    router
        .observe(Observation::KvEvents(b, vec![stored(1, &tokens)]), 1.0)
        .unwrap();
    let mut ids = tokens.clone();
    ids.push(7);
    let request = RouteRequest::text("m", &text);
    let plain = switchyard_core::prepare(&request, router.block_bytes());
    let d = router.route_prepared(&request, &plain, 1.0).unwrap();
    assert_eq!(
        d.candidate(b).unwrap().terms.cached_tokens,
        0,
        "no ids: approximate"
    );
    let tokenized = plain.with_token_ids(ids);
    let d = router.route_prepared(&request, &tokenized, 1.0).unwrap();
    assert_eq!(d.candidate(b).unwrap().terms.cached_tokens, 64);
    assert_eq!(d.prompt_tokens, 65, "counted from the ids");
}

/// A stream the sequence checks cannot fault but the engine contradicts (it publishes blocks it
/// does not serve from): once the exact view's predictions miss the engine's reports by more
/// than the approximate index's, the instance is priced on the approximate index.
#[test]
fn a_view_the_engine_contradicts_gives_way_to_the_approximate_index() {
    use switchyard_core::{RequestId, Usage};
    let (mut router, _a, b) = fleet();
    let tokens: Vec<u32> = (0..64).collect();
    router
        .observe(Observation::KvEvents(b, vec![stored(1000, &tokens)]), 1.0)
        .unwrap();
    let mut longer = tokens.clone();
    longer.extend(100..116);
    let text = "t ".repeat(80);
    assert_eq!(cached_on(&mut router, b, &text, &longer, 1.0), 64);
    let mut now = 2.0;
    for i in 0..20u64 {
        let mut request = RouteRequest::text("m", &text);
        request.token_ids = Some(&longer);
        let decision = router.route(&request, now).unwrap();
        let plan = decision.plan_for(b);
        let id = RequestId(i);
        router
            .observe(
                Observation::Routed {
                    request: id,
                    instance: b,
                    plan,
                },
                now,
            )
            .unwrap();
        router
            .observe(Observation::FirstToken(id), now + 0.1)
            .unwrap();
        // The engine serves nothing from its cache, whatever its events said.
        let usage = Usage {
            prompt_tokens: 80,
            cached_tokens: Some(0),
            completion_tokens: 1,
        };
        router
            .observe(Observation::Finished(id, Some(usage)), now + 0.2)
            .unwrap();
        now += 1.0;
    }
    let learned = router.learned(b).unwrap();
    assert!(
        learned.exact_error > learned.approx_error,
        "exact {} approx {}",
        learned.exact_error,
        learned.approx_error
    );
    assert!(router.is_exact(b), "the stream itself is still trusted");
    let predicted = cached_on(&mut router, b, &text, &longer, now);
    assert!(
        predicted < 64,
        "still priced on the contradicted view: {predicted}"
    );
}

#[test]
fn a_prompt_tokenized_to_the_horizon_matches_as_if_whole() {
    let (mut router, a, b) = fleet();
    let held: Vec<u32> = (0..64).collect();
    router
        .observe(Observation::KvEvents(b, vec![stored(1000, &held)]), 1.0)
        .unwrap();
    // The whole prompt: the held 64 tokens, then 1,000 new ones.
    let whole: Vec<u32> = (0..1064).collect();
    // Tokenized block by block, a driver stops one block past the holder's run.
    let mut needed = 0;
    for n in (BLOCK as usize..=whole.len()).step_by(BLOCK as usize) {
        let horizon = router.exact_horizon("m", None, None, &whole[..n], None);
        if n >= horizon {
            needed = n;
            break;
        }
    }
    assert_eq!(needed, 80, "the held run and one block past it");
    assert_eq!(
        router.exact_horizon("m", None, Some("salt"), &whole, None),
        0
    );
    assert_eq!(router.exact_horizon("other", None, None, &whole, None), 0);

    let text = "t ".repeat(1064);
    let request = RouteRequest::text("m", &text);
    let block_bytes = router.block_bytes();
    // The rest's bytes at the router's bytes per token (4 before it learns any).
    let rest_bytes = (whole.len() - needed) * 4;
    let prefix = switchyard_core::prepare(&request, block_bytes)
        .with_token_prefix(whole[..needed].to_vec(), rest_bytes);
    assert!(prefix.token_ids_are_a_prefix());
    let full = switchyard_core::prepare(&request, block_bytes).with_token_ids(whole.clone());
    let by_prefix = router.route_prepared(&request, &prefix, 1.0).unwrap();
    let by_whole = router.route_prepared(&request, &full, 1.0).unwrap();
    for on in [a, b] {
        let p = by_prefix.candidate(on).unwrap().terms;
        let w = by_whole.candidate(on).unwrap().terms;
        assert_eq!(p.cached_tokens, w.cached_tokens);
        assert_eq!(
            p.uncached_tokens, w.uncached_tokens,
            "the count stands in for the ids"
        );
    }
    assert_eq!(by_prefix.candidate(b).unwrap().terms.cached_tokens, 64);

    // Hashed by the driver in the pool's block size: the same decision without hashing.
    assert_eq!(router.exact_block_tokens("m"), Some(BLOCK));
    let mut chain = switchyard_core::ExactChain::new(BLOCK, None);
    chain.extend(&whole[..needed]);
    assert_eq!(
        router.exact_horizon("m", None, None, &whole[..needed], Some(&chain)),
        80
    );
    let hashed = switchyard_core::prepare(&request, block_bytes)
        .with_token_prefix(whole[..needed].to_vec(), rest_bytes)
        .with_exact_chain(chain);
    let by_hashed = router.route_prepared(&request, &hashed, 1.0).unwrap();
    for on in [a, b] {
        assert_eq!(
            by_hashed.candidate(on).unwrap().terms.cached_tokens,
            by_prefix.candidate(on).unwrap().terms.cached_tokens
        );
    }
}
