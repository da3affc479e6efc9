//! Helpers for unit tests: build requests and drive an engine through a timeline.

use std::sync::Arc;

use crate::{Engine, EngineConfig, EngineEvent, EngineRequest, RequestId, RequestMode};

/// A request with `len` prompt tokens derived from `seed` (same seed ⇒ same tokens).
pub(crate) fn req(id: RequestId, seed: u32, len: usize, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        id,
        prompt_tokens: tokens(seed, len),
        max_tokens,
        adapter: None,
        mode: RequestMode::Normal,
    }
}

/// `len` tokens derived from `seed`.
pub(crate) fn tokens(seed: u32, len: usize) -> Arc<[u32]> {
    (0..len as u32)
        .map(|i| seed.wrapping_mul(1_000_003).wrapping_add(i))
        .collect()
}

/// A small engine configuration for tests.
pub(crate) fn small_config() -> EngineConfig {
    EngineConfig {
        num_gpu_blocks: 256,
        block_size: 16,
        max_num_seqs: 8,
        max_num_batched_tokens: 512,
        max_model_len: 2048,
        ..EngineConfig::default()
    }
}

/// Something the driver does at a time.
pub(crate) enum Act {
    Submit(EngineRequest),
    Abort(RequestId),
}

/// Run `acts` (sorted by time) and then everything to completion; returns all events.
/// Checks the engine's invariants after every advance.
pub(crate) fn drive(engine: &mut Engine, acts: Vec<(f64, Act)>) -> Vec<EngineEvent> {
    let mut out = Vec::new();
    for (t, act) in acts {
        while let Some(te) = engine.next_event_time() {
            // Actions at a time come before the engine's events at that
            // time, so simultaneous arrivals share a step.
            if te >= t {
                break;
            }
            engine.advance(te, &mut out);
            engine.check_invariants().unwrap();
        }
        match act {
            Act::Submit(r) => engine.submit(r, t).unwrap(),
            Act::Abort(id) => {
                engine.abort(id, t);
            }
        }
        engine.check_invariants().unwrap();
    }
    while let Some(te) = engine.next_event_time() {
        engine.advance(te, &mut out);
        engine.check_invariants().unwrap();
    }
    out
}

/// The first event of `kind` for request `id`.
pub(crate) fn find<'a>(events: &'a [EngineEvent], id: RequestId, kind: &str) -> &'a EngineEvent {
    events
        .iter()
        .find(|e| {
            e.id() == id
                && matches!(
                    (kind, e),
                    ("first", EngineEvent::FirstToken { .. })
                        | ("finished", EngineEvent::Finished { .. })
                        | ("preempted", EngineEvent::Preempted { .. })
                )
        })
        .unwrap_or_else(|| panic!("no {kind} event for {id} in {events:#?}"))
}
