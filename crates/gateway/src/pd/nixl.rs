//! vLLM NixlConnector style: the prefill leg first (the original body with
//! `kv_transfer_params.do_remote_decode`, non-streamed, one output token); the
//! `kv_transfer_params` of its answer then go with the original body to the decode leg, whose
//! answer streams to the client.
//!
//! A prefill that fails (no answer, 5xx, 429, or an answer without `kv_transfer_params`) is
//! retried on the next prefill candidate. A decode that fails before its answer is retried on
//! the next decode candidate with the same `kv_transfer_params`: vLLM keeps the prefilled
//! blocks until a decode pulls them (or its abort timeout frees them), so the prefill is not
//! run again.

use std::sync::Arc;

use axum::response::Response;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde_json::{json, Value};

use super::body::RawObject;
use super::leg::{Leg, Try};
use super::{name_prefill, Request};
use crate::error::ApiError;
use crate::forward::{reject, respond, Routed};
use crate::state::Gateway;
use crate::stream::{read_usage, RequestGuard};
use crate::upstream::UpstreamBody;

/// Largest prefill answer read.
const PREFILL_BODY_LIMIT: usize = 4 << 20;

/// The prefill leg's body: the original with `do_remote_decode`, no streaming, one token.
pub fn prefill_body(original: &RawObject<'_>) -> Vec<u8> {
    let hand_off = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
    .to_string();
    let mut set = vec![
        ("kv_transfer_params", hand_off.as_str()),
        ("stream", "false"),
        ("max_tokens", "1"),
    ];
    if original.contains("max_completion_tokens") {
        set.push(("max_completion_tokens", "1"));
    }
    original.with(&set, &["stream_options"])
}

/// The decode leg's body: the original with the prefill's hand-off, and (when `inject_usage`
/// and the client streams without `stream_options`) a request for the final usage chunk.
pub fn decode_body(original: &RawObject<'_>, kv: &Value, inject_usage: bool) -> Vec<u8> {
    let kv = kv.to_string();
    let mut set = vec![("kv_transfer_params", kv.as_str())];
    if inject_usage {
        set.push(("stream_options", r#"{"include_usage":true}"#));
    }
    original.with(&set, &[])
}

/// Serves a disaggregated request: prefill leg, then the decode leg streamed to the client.
pub(crate) async fn serve(
    gw: &Arc<Gateway>,
    prefill: Routed,
    decode: Routed,
    req: Request<'_>,
) -> Response {
    let (parts, request_id, started) = (req.parts, req.request_id, req.started);
    let mut prefill = Leg::new(gw, "prefill", prefill, true);
    let body = Bytes::from(prefill_body(&req.original));
    let mut tries = 0;
    let (kv, prefill_backend) = loop {
        if tries > 0 && prefill.current().is_some() {
            gw.metrics.retries.inc();
        }
        tries += 1;
        let (guard, response) = match prefill.try_current(parts, body.clone(), request_id).await {
            Try::Answered(guard, response) => (guard, response),
            Try::Failed => continue,
            Try::Error(e) => return reject(gw, e, request_id),
        };
        if !response.status().is_success() {
            // The engine refused the request itself (4xx): the client's to see.
            return respond(
                gw,
                &prefill.routed,
                guard,
                response,
                request_id,
                false,
                started,
            );
        }
        match read_hand_off(gw, guard, response, started).await {
            Ok(found) => break found,
            Err(Unusable::Fatal(e)) => return reject(gw, e, request_id),
            Err(Unusable::Retry(guard, why)) => prefill.reject_answer(guard, why),
        }
    };

    let mut decode = Leg::new(gw, "decode", decode, false);
    decode.shared = req.shared.clone();
    let body = Bytes::from(decode_body(&req.original, &kv, req.strip_usage));
    let mut tries = 0;
    loop {
        if tries > 0 && decode.current().is_some() {
            gw.metrics.retries.inc();
        }
        tries += 1;
        match decode.try_current(parts, body.clone(), request_id).await {
            Try::Answered(guard, response) => {
                let mut response = respond(
                    gw,
                    &decode.routed,
                    guard,
                    response,
                    request_id,
                    req.strip_usage,
                    started,
                );
                name_prefill(gw, &mut response, &prefill_backend);
                return response;
            }
            Try::Failed => {}
            Try::Error(e) => return reject(gw, e, request_id),
        }
    }
}

/// Why a 2xx prefill answer cannot be used.
enum Unusable {
    /// Try the next prefill candidate (the answer is settled as failed by the leg).
    Retry(RequestGuard, String),
    /// Give up (the body did not come in time).
    Fatal(ApiError),
}

/// Reads a prefill answer: its `kv_transfer_params` and the backend, with the prefill
/// recorded as finished (usage, metrics).
async fn read_hand_off(
    gw: &Gateway,
    mut guard: RequestGuard,
    response: http::Response<UpstreamBody>,
    started: std::time::Instant,
) -> Result<(Value, Arc<crate::backends::Backend>), Unusable> {
    let backend = guard.backend.clone();
    let read = tokio::time::timeout(
        gw.settings.upstream_timeout,
        Limited::new(response.into_body(), PREFILL_BODY_LIMIT).collect(),
    )
    .await;
    let answer = match read {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) => {
            backend.metrics.stream_error.inc();
            return Err(Unusable::Retry(guard, format!("answer unreadable: {e}")));
        }
        Err(_) => {
            backend.metrics.timeout.inc();
            let secs = gw.settings.upstream_timeout.as_secs_f64();
            return Err(Unusable::Fatal(ApiError::upstream_timeout(secs)));
        }
    };
    let kv = serde_json::from_slice::<Value>(&answer)
        .ok()
        .and_then(|mut v| v.get_mut("kv_transfer_params").map(Value::take))
        .filter(Value::is_object);
    let Some(kv) = kv else {
        return Err(Unusable::Retry(
            guard,
            "answered without kv_transfer_params (is it running a NixlConnector?)".into(),
        ));
    };
    guard.first_token();
    let elapsed = started.elapsed().as_secs_f64();
    let m = &backend.metrics;
    m.ttft.observe(elapsed);
    backend.ttft.record(gw.now(), elapsed);
    m.e2e.observe(elapsed);
    m.ok.inc();
    let usage = read_usage(&answer).map(|(u, _)| u);
    if let Some(u) = usage {
        m.prompt_tokens.inc_by(u64::from(u.prompt_tokens));
    }
    backend.record_request_success();
    guard.finish(usage);
    Ok((kv, backend))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(v: Value) -> Vec<u8> {
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn prefill_leg_asks_for_one_token_and_a_hand_off() {
        let body = bytes(json!({"model": "m", "messages": [], "stream": true,
            "stream_options": {"include_usage": true}, "max_completion_tokens": 50, "temperature": 0.1}));
        let original = RawObject::parse(&body).unwrap();
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
        let body = bytes(json!({"model": "m", "prompt": "p", "stream": true}));
        let original = RawObject::parse(&body).unwrap();
        let kv = json!({"do_remote_prefill": true, "remote_block_ids": [1, 2]});
        let v: Value = serde_json::from_slice(&decode_body(&original, &kv, true)).unwrap();
        assert_eq!(v["kv_transfer_params"], kv);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["prompt"], "p");
        let v: Value = serde_json::from_slice(&decode_body(&original, &kv, false)).unwrap();
        assert!(v.get("stream_options").is_none());
    }
}
