//! Feedback against a reference engine: the index never drops what the engine holds (property
//! test), and the cached tokens it predicts come close to what the engine reports once it has
//! learned how the engine evicts.

use proptest::prelude::*;
use switchyard_core::prefix::{chain_seed, tapered_end, tapered_prompt_block_hashes};
use switchyard_core::{
    InstanceId, InstanceSpec, Observation, Prediction, Prompt, RequestId, RoutePlan, RouteRequest,
    Router, RouterConfig, Usage,
};

const BLOCK_BYTES: usize = 256;
const BYTES_PER_TOKEN: usize = 4;

/// Tokens in the first `elements` elements of a chain (the index's tapered blocks).
fn tokens(elements: usize) -> u32 {
    (tapered_end(elements as u32, BLOCK_BYTES) / BYTES_PER_TOKEN) as u32
}

/// Tells the router the request was sent where its plan says.
fn routed(router: &mut Router, request: RequestId, id: InstanceId, plan: RoutePlan, now: f64) {
    router
        .observe(
            Observation::Routed {
                request,
                instance: id,
                plan,
            },
            now,
        )
        .unwrap();
}

/// An LRU prefix cache of whole blocks, most recent first, as an engine keeps it.
struct ReferenceEngine {
    capacity: usize,
    blocks: Vec<u64>,
}

impl ReferenceEngine {
    /// Leading blocks held, then the prompt's blocks become the most recent (parents last, so
    /// a parent is never older than its child, as in the engine model and vLLM's free queue).
    fn serve(&mut self, chain: &[u64]) -> usize {
        let run = chain.iter().take_while(|h| self.blocks.contains(h)).count();
        for h in chain.iter().rev() {
            self.blocks.retain(|x| x != h);
            self.blocks.insert(0, *h);
        }
        self.blocks.truncate(self.capacity);
        run
    }

    fn run(&self, chain: &[u64]) -> usize {
        chain.iter().take_while(|h| self.blocks.contains(h)).count()
    }
}

/// Prompt `i` of the pool: one of a few shared prefixes and a private tail, in whole blocks.
fn prompt(prefix: u8, tail: u8, prefix_blocks: usize, tail_blocks: usize) -> String {
    let mut text = String::new();
    for b in 0..prefix_blocks {
        text.push_str(&format!("{:<256}", format!("prefix {prefix} block {b}")));
    }
    for b in 0..tail_blocks {
        text.push_str(&format!(
            "{:<256}",
            format!("tail {prefix}/{tail} block {b}")
        ));
    }
    text
}

fn chain(text: &str) -> Vec<u64> {
    let mut out = Vec::new();
    tapered_prompt_block_hashes(
        &Prompt::Text(text),
        chain_seed("m", None, None),
        BLOCK_BYTES,
        &mut out,
    );
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn feedback_is_sound_and_complete(
        engine_capacity in 4usize..40,
        requests in proptest::collection::vec((0u8..3, 0u8..4, 1usize..6, 0usize..6), 1..60),
    ) {
        let config = RouterConfig { policy: "cost".into(), ..Default::default() };
        let mut router = Router::new(config).unwrap();
        // The index may hold more than the engine really can: feedback must find that out.
        let spec = InstanceSpec { kv_capacity_tokens: Some(1_000_000), ..InstanceSpec::new("a", "m") };
        let id = router.add_instance(spec).unwrap();
        let mut engine = ReferenceEngine { capacity: engine_capacity, blocks: Vec::new() };
        let pool: Vec<String> = (0..3)
            .flat_map(|p| (0..4).map(move |t| prompt(p, t, 3, 2)))
            .collect();
        for (n, (p, t, prefix_blocks, tail_blocks)) in requests.into_iter().enumerate() {
            let text = prompt(p, t, prefix_blocks, tail_blocks);
            let blocks = chain(&text);
            let decision = router.route(&RouteRequest::text("m", &text), n as f64).unwrap();
            let plan = decision.plan_for(id);
            let predicted = plan.matched_blocks() as usize;
            let truly = engine.run(&blocks);
            prop_assert!(predicted >= truly, "the index lost a block the engine holds");
            router.observe(Observation::Routed { request: RequestId(n as u64), instance: id, plan }, n as f64).unwrap();
            let served = engine.serve(&blocks);
            prop_assert_eq!(served, truly);
            let cached = tokens(served);
            router.observe(Observation::FirstToken(RequestId(n as u64)), n as f64 + 0.1).unwrap();
            let usage = Usage { prompt_tokens: tokens(blocks.len()), cached_tokens: Some(cached), completion_tokens: 1 };
            router.observe(Observation::Finished(RequestId(n as u64), Some(usage)), n as f64 + 0.2).unwrap();

            for other in pool.iter().chain(std::iter::once(&text)) {
                let other_chain = chain(other);
                let index_run = other_chain.iter().take_while(|h| router.index().holds(id.slot, **h)).count();
                let engine_run = engine.run(&other_chain);
                // Sound: nothing the engine holds was dropped.
                prop_assert!(index_run >= engine_run, "index {} < engine {}", index_run, engine_run);
            }
        }
    }
}

/// Mean absolute error of predicted against reported cached tokens over a long run on an engine
/// that holds far less than the index would by default.
fn prediction_error(disable_feedback: bool) -> f64 {
    let mut config = RouterConfig {
        policy: "cost".into(),
        ..Default::default()
    };
    config.index.disable_feedback = disable_feedback;
    let mut router = Router::new(config).unwrap();
    let spec = InstanceSpec {
        kv_capacity_tokens: Some(1_000_000),
        ..InstanceSpec::new("a", "m")
    };
    let id = router.add_instance(spec).unwrap();
    let mut engine = ReferenceEngine {
        capacity: 24,
        blocks: Vec::new(),
    };
    let mut error = 0.0;
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let n = 600;
    for i in 0..n {
        // xorshift: a fixed, varied sequence of prompts from 6 prefixes x 8 tails.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let text = prompt((rng % 6) as u8, ((rng >> 8) % 8) as u8, 4, 2);
        let blocks = chain(&text);
        let decision = router
            .route(&RouteRequest::text("m", &text), i as f64)
            .unwrap();
        let plan = decision.plan_for(id);
        let predicted = plan.predicted_cached_tokens();
        let request = RequestId(i);
        routed(&mut router, request, id, plan, i as f64);
        let cached = tokens(engine.serve(&blocks));
        router
            .observe(Observation::FirstToken(request), i as f64 + 0.1)
            .unwrap();
        let usage = Usage {
            prompt_tokens: tokens(blocks.len()),
            cached_tokens: Some(cached),
            completion_tokens: 1,
        };
        router
            .observe(Observation::Finished(request, Some(usage)), i as f64 + 0.2)
            .unwrap();
        if i >= n / 3 {
            error += (f64::from(predicted) - f64::from(cached)).abs();
        }
    }
    error / f64::from(n as u32 - n as u32 / 3)
}

#[test]
fn learned_survival_predicts_an_lru_engine() {
    let learned = prediction_error(false);
    let blind = prediction_error(true);
    assert!(
        learned < 0.6 * blind,
        "learned {learned:.0} vs blind {blind:.0} tokens"
    );
}

#[test]
fn every_request_leaves_its_prediction_against_the_outcome() {
    let mut router = Router::new(RouterConfig::default()).unwrap();
    let id = router.add_instance(InstanceSpec::new("a", "m")).unwrap();
    let text = prompt(1, 1, 4, 2);
    for n in 0..2u64 {
        let decision = router
            .route(&RouteRequest::text("m", &text), n as f64)
            .unwrap();
        let plan = decision.plan_for(id);
        assert!(plan.estimated_ttft_s().is_some_and(|s| s > 0.0));
        let request = RequestId(n);
        routed(&mut router, request, id, plan, n as f64);
        router
            .observe(Observation::FirstToken(request), n as f64 + 0.25)
            .unwrap();
        let usage = Usage {
            prompt_tokens: tokens(10),
            cached_tokens: Some(if n == 0 { 0 } else { tokens(9) }),
            completion_tokens: 1,
        };
        router
            .observe(Observation::Finished(request, Some(usage)), n as f64 + 0.5)
            .unwrap();
    }
    let mut out = Vec::new();
    router.take_predictions(&mut out);
    let ttfts: Vec<_> = out
        .iter()
        .filter_map(|p| match p {
            Prediction::Ttft { observed_s, .. } => Some(*observed_s),
            _ => None,
        })
        .collect();
    assert_eq!(ttfts.len(), 2);
    assert!(ttfts.iter().all(|&s| (s - 0.25).abs() < 1e-9));
    let cached: Vec<_> = out
        .iter()
        .filter_map(|p| match p {
            Prediction::Cached {
                predicted,
                reported,
                ..
            } => Some((*predicted, *reported)),
            _ => None,
        })
        .collect();
    // The second request was predicted (close to) fully cached and was.
    assert_eq!(cached.len(), 2);
    assert_eq!(cached[0], (0, 0));
    assert!(cached[1].0 > 0 && cached[1].1 == tokens(9), "{cached:?}");
    assert!(out.iter().all(|p| p.relative_error().is_finite()));
    router.take_predictions(&mut out);
    assert_eq!(out.len(), 4, "taken predictions are not repeated");
}

#[test]
fn ttft_predictions_learn_the_engines_fixed_part() {
    // An idle engine whose first tokens take what the estimate says plus 40 ms it does not
    // model (HTTP, tokenizing, a shared CPU): four times the 10 ms prior.
    let mut router = Router::new(RouterConfig::default()).unwrap();
    let id = router.add_instance(InstanceSpec::new("a", "m")).unwrap();
    let mut errors = Vec::new();
    for n in 0..60u64 {
        let text = prompt(n as u8, 1, 2, 2);
        let now = n as f64;
        let decision = router.route(&RouteRequest::text("m", &text), now).unwrap();
        let plan = decision.plan_for(id);
        let raw = plan.estimated_ttft_s().expect("cost estimates a TTFT");
        let request = RequestId(n);
        routed(&mut router, request, id, plan, now);
        router
            .observe(Observation::FirstToken(request), now + raw + 0.040)
            .unwrap();
        router
            .observe(Observation::Finished(request, None), now + raw + 0.1)
            .unwrap();
        let mut out = Vec::new();
        router.take_predictions(&mut out);
        for p in out {
            if let Prediction::Ttft { .. } = p {
                errors.push(p.relative_error());
            }
        }
    }
    assert_eq!(errors.len(), 60);
    // The first prediction carries the prior's 30 ms shortfall; the last ones are close.
    assert!(errors[0] > 0.2, "first error {}", errors[0]);
    let late = &errors[40..];
    assert!(
        late.iter().all(|&e| e < 0.05),
        "late errors {late:?} (the fixed part was not learned)"
    );
}
