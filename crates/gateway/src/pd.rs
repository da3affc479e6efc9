//! Disaggregated serving, vLLM NixlConnector style: when the router splits a request, the
//! prefill instance gets it with `kv_transfer_params.do_remote_decode` (non-streamed, one
//! output token); the `kv_transfer_params` of its answer go with the original request to the
//! decode instance, whose answer is the client's. Each leg is retried over its own ranked
//! candidates and recorded in the router as its own request.

use std::sync::Arc;
use std::time::Instant;

use axum::response::Response;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue};
use http_body_util::{BodyExt, Limited};
use serde_json::{json, Map, Value};
use switchyard_core::Observation;

use crate::errors::ApiError;
use crate::proxy::{attempt, forward, reject, respond, Routed};
use crate::state::Gateway;
use crate::stream::read_usage;

/// Debug header naming the prefill backend of a disaggregated request.
pub static PREFILL: HeaderName = HeaderName::from_static("x-switchyard-prefill");

/// Largest prefill answer read.
const PREFILL_BODY_LIMIT: usize = 4 << 20;

/// The prefill leg's body: the original with `do_remote_decode`, no streaming, one token.
pub fn prefill_body(original: &Map<String, Value>) -> Vec<u8> {
    let mut body = original.clone();
    body.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    body.insert("stream".into(), Value::Bool(false));
    body.remove("stream_options");
    body.insert("max_tokens".into(), json!(1));
    if body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), json!(1));
    }
    Value::Object(body).to_string().into_bytes()
}

/// The decode leg's body: the original with the prefill's hand-off, and (when `inject_usage`
/// and the client streams without `stream_options`) a request for the final usage chunk.
pub fn decode_body(original: Map<String, Value>, kv: Value, inject_usage: bool) -> Vec<u8> {
    let mut body = original;
    body.insert("kv_transfer_params".into(), kv);
    if inject_usage {
        body.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Value::Object(body).to_string().into_bytes()
}

/// Serves a disaggregated request: prefill leg, then the decode leg streamed to the client.
pub(crate) async fn serve(
    gw: &Arc<Gateway>,
    mut routed: Routed,
    parts: &Parts,
    body: &[u8],
    request_id: &HeaderValue,
    inject_usage: bool,
    started: Instant,
) -> Response {
    let original = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => map,
        _ => {
            return reject(
                gw,
                ApiError::malformed("expected a JSON object"),
                request_id,
            )
        }
    };
    let streams = original.get("stream").and_then(Value::as_bool) == Some(true);
    let strip_usage = inject_usage && streams && !original.contains_key("stream_options");

    // Prefill leg.
    let prefill = Bytes::from(prefill_body(&original));
    let (mut guard, response) = match attempt(gw, &routed, parts, prefill, request_id).await {
        Ok(x) => x,
        Err(e) => return reject(gw, e, request_id),
    };
    if !response.status().is_success() {
        return respond(gw, &routed, guard, response, request_id, false, started);
    }
    let prefill_backend = guard.backend.clone();
    let read = tokio::time::timeout(
        gw.settings.upstream_timeout,
        Limited::new(response.into_body(), PREFILL_BODY_LIMIT).collect(),
    )
    .await;
    let answer = match read {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) => {
            prefill_backend.metrics.stream_error.inc();
            return reject(
                gw,
                ApiError::bad_gateway(format!("prefill answer: {e}")),
                request_id,
            );
        }
        Err(_) => {
            prefill_backend.metrics.timeout.inc();
            let secs = gw.settings.upstream_timeout.as_secs_f64();
            return reject(gw, ApiError::upstream_timeout(secs), request_id);
        }
    };
    guard.first_token();
    let elapsed = started.elapsed().as_secs_f64();
    prefill_backend.metrics.ttft.observe(elapsed);
    prefill_backend.metrics.e2e.observe(elapsed);
    prefill_backend.metrics.ok.inc();
    prefill_backend.record_request_success();
    guard.finish(read_usage(&answer).map(|(u, _)| u));
    drop(guard);
    let kv = serde_json::from_slice::<Value>(&answer)
        .ok()
        .and_then(|mut v| v.get_mut("kv_transfer_params").map(Value::take))
        .filter(Value::is_object);
    let Some(kv) = kv else {
        let e = ApiError::bad_gateway(format!(
            "the prefill backend `{}` returned no kv_transfer_params",
            prefill_backend.name()
        ));
        return reject(gw, e, request_id);
    };

    // Decode leg: its own request in the router, over the decode candidates.
    let Some(decision) = routed.decision.take() else {
        return reject(gw, ApiError::bad_gateway("no decision"), request_id);
    };
    let max = gw.settings.max_retries as usize + 1;
    let rid = gw.next_request();
    let candidates = {
        let now = gw.now();
        let mut brain = gw.brain.lock();
        let candidates: Vec<_> = decision.decode[..decision.decode_eligible]
            .iter()
            .take(max)
            .filter_map(|c| brain.backend(c.instance).cloned())
            .collect();
        if let Some(first) = candidates.first() {
            brain.observe(
                Observation::Routed {
                    request: rid,
                    instance: first.id,
                    plan: decision.plan_for(first.id),
                },
                now,
            );
        }
        candidates
    };
    if candidates.is_empty() {
        return reject(gw, ApiError::no_backend(&routed_model(&routed)), request_id);
    }
    let decode = Routed {
        rid,
        decision: Some(decision),
        candidates,
        prompt_tokens: routed.prompt_tokens,
        explain: routed.explain.take(),
    };
    let body = Bytes::from(decode_body(original, kv, strip_usage));
    let mut response = forward(gw, decode, parts, body, request_id, strip_usage, started).await;
    if gw.settings.debug_header {
        if let Ok(v) = HeaderValue::from_str(prefill_backend.name()) {
            response.headers_mut().insert(PREFILL.clone(), v);
        }
    }
    response
}

fn routed_model(routed: &Routed) -> String {
    routed
        .candidates
        .first()
        .and_then(|b| b.spec.models.first().cloned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn prefill_leg_asks_for_one_token_and_a_hand_off() {
        let original = map(json!({"model": "m", "messages": [], "stream": true,
            "stream_options": {"include_usage": true}, "max_completion_tokens": 50, "temperature": 0.1}));
        let v: Value = serde_json::from_slice(&prefill_body(&original)).unwrap();
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], false);
        assert_eq!(v["stream"], false);
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["max_completion_tokens"], 1);
        assert!(v.get("stream_options").is_none());
        assert_eq!(v["temperature"], 0.1);
    }

    #[test]
    fn decode_leg_carries_the_hand_off() {
        let original = map(json!({"model": "m", "prompt": "p", "stream": true}));
        let kv = json!({"do_remote_prefill": true, "remote_block_ids": [1, 2]});
        let v: Value =
            serde_json::from_slice(&decode_body(original.clone(), kv.clone(), true)).unwrap();
        assert_eq!(v["kv_transfer_params"], kv);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["prompt"], "p");
        let v: Value = serde_json::from_slice(&decode_body(original, kv, false)).unwrap();
        assert!(v.get("stream_options").is_none());
    }
}
