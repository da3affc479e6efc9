//! SGLang style (what sglang-router's PD mode does): the prefill and the decode get the same
//! body at once, with `bootstrap_host` (the prefill backend's host), `bootstrap_port` (its
//! configured `bootstrap_port`, SGLang's default 8998 otherwise) and a random 63-bit
//! `bootstrap_room` that pairs them; the decode pulls the KV from the prefill through the
//! bootstrap server. The decode's answer streams to the client; the prefill's is drained in the
//! background and its usage recorded.
//!
//! The two legs are tied to each other by the room, so a failure re-runs the *pair*: the
//! decode's answer goes to the client only once both legs have answered 2xx; if the prefill
//! fails first (no answer, 5xx, 429) the decode is dropped (which aborts it) and the pair runs
//! again on the next prefill candidate and the same decode candidate, with a new room; if the
//! decode fails first the prefill is dropped and the pair runs again on the same prefill
//! candidate and the next decode candidate, with a new room. At most `max_retries` re-runs,
//! each leg over at most `max_retries + 1` candidates. A 4xx from either leg goes to the client.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::response::Response;
use bytes::Bytes;
use http::header;
use http_body_util::BodyExt;
use serde_json::json;

use super::body::RawObject;
use tokio::task::JoinHandle;

use super::leg::{exhausted, Leg, Try};
use super::{name_prefill, Request, DEFAULT_BOOTSTRAP_PORT};
use crate::backends::Backend;
use crate::error::ApiError;
use crate::forward::{reject, respond, Routed};
use crate::state::Gateway;
use crate::stream::{ObservedBody, RequestGuard};
use crate::upstream::UpstreamBody;

/// Where the decode finds the prefill's KV, and the room pairing the two.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// The prefill backend's host.
    pub host: String,
    /// Its bootstrap server's port.
    pub port: u16,
    /// The pair's room (below 2^63, as SGLang keeps it in an i64).
    pub room: u64,
}

impl Bootstrap {
    /// The bootstrap of a pair whose prefill runs on `prefill`, with a fresh room.
    pub fn for_prefill(prefill: &Backend) -> Self {
        Bootstrap {
            host: prefill.base.authority().host().to_string(),
            port: prefill
                .spec
                .bootstrap_port
                .unwrap_or(DEFAULT_BOOTSTRAP_PORT),
            room: new_room(),
        }
    }
}

/// A random room id below 2^63, distinct for every call in this process.
pub fn new_room() -> u64 {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    // RandomState is seeded from the OS per thread; hashing the counter with it is a keyed
    // random function of a value that never repeats.
    RandomState::new().hash_one((n, nanos)) >> 1
}

/// The body both legs get: the original with the bootstrap fields, and (when `inject_usage`,
/// for a client streaming without `stream_options`) a request for the final usage chunk.
pub fn pair_body(original: &RawObject<'_>, b: &Bootstrap, inject_usage: bool) -> Vec<u8> {
    let host = json!(b.host).to_string();
    let port = b.port.to_string();
    let room = b.room.to_string();
    let mut set = vec![
        ("bootstrap_host", host.as_str()),
        ("bootstrap_port", port.as_str()),
        ("bootstrap_room", room.as_str()),
    ];
    if inject_usage {
        set.push(("stream_options", r#"{"include_usage":true}"#));
    }
    original.with(&set, &[])
}

/// Serves a disaggregated request: pairs sent at once until one pair answers.
pub(crate) async fn serve(
    gw: &Arc<Gateway>,
    prefill: Routed,
    decode: Routed,
    req: Request<'_>,
) -> Response {
    let mut prefill = Leg::new(gw, "prefill", prefill, true);
    let mut decode = Leg::new(gw, "decode", decode, false);
    decode.shared = req.shared.clone();
    for run in 0..=gw.settings.max_retries {
        let Some(p) = prefill.current().cloned() else {
            break;
        };
        if decode.current().is_none() {
            break;
        }
        if run > 0 {
            gw.metrics.retries.inc();
        }
        let bootstrap = Bootstrap::for_prefill(&p);
        let body = Bytes::from(pair_body(&req.original, &bootstrap, req.strip_usage));
        match run_pair(gw, &mut prefill, &mut decode, &req, body).await {
            Pair::Failed => {}
            Pair::Error(e) => return reject(gw, e, req.request_id),
            Pair::Refused(leg, guard, response) => {
                let routed = match leg {
                    Side::Prefill => &prefill.routed,
                    Side::Decode => &decode.routed,
                };
                return respond(
                    gw,
                    routed,
                    guard,
                    response,
                    req.request_id,
                    false,
                    req.started,
                );
            }
            Pair::Answered(guard, response) => {
                let mut response = respond(
                    gw,
                    &decode.routed,
                    guard,
                    response,
                    req.request_id,
                    req.strip_usage,
                    req.started,
                );
                name_prefill(gw, &mut response, &p);
                return response;
            }
        }
    }
    reject(gw, pair_exhausted(&prefill, &decode), req.request_id)
}

/// Which leg.
enum Side {
    Prefill,
    Decode,
}

/// How one pair ended.
enum Pair {
    /// Both legs answered 2xx: the decode's answer, for the client (the prefill's is drained).
    Answered(RequestGuard, http::Response<UpstreamBody>),
    /// A leg answered 4xx: for the client.
    Refused(Side, RequestGuard, http::Response<UpstreamBody>),
    /// A leg failed (recorded by its [`Leg`]); the other was dropped. Run a new pair.
    Failed,
    /// Give up (a leg timed out or has no candidate left).
    Error(ApiError),
}

/// Sends one pair and waits until the decode's answer can go to the client or the pair failed.
async fn run_pair(
    gw: &Arc<Gateway>,
    prefill: &mut Leg,
    decode: &mut Leg,
    req: &Request<'_>,
    body: Bytes,
) -> Pair {
    let predicted = |leg: &Leg| {
        let id = leg.current().map(|b| b.id);
        leg.routed
            .decision
            .as_ref()
            .zip(id)
            .and_then(|(d, id)| d.candidate(id))
            .map_or(0, |c| c.terms.cached_tokens)
    };
    let prefill_predicted = predicted(prefill);
    let p = prefill.try_current(req.parts, body.clone(), req.request_id);
    let d = decode.try_current(req.parts, body, req.request_id);
    tokio::pin!(p, d);
    let mut drain: Option<Drain> = None;
    let mut decoded: Option<(RequestGuard, http::Response<UpstreamBody>)> = None;
    loop {
        tokio::select! {
            r = &mut p, if drain.is_none() => match r {
                Try::Answered(guard, response) if response.status().is_success() => {
                    drain = Some(Drain::start(gw, guard, response, req.started, prefill_predicted));
                }
                Try::Answered(guard, response) => return Pair::Refused(Side::Prefill, guard, response),
                // Dropping the decode (here or in `decoded`) aborts it.
                Try::Failed => return Pair::Failed,
                Try::Error(e) => return Pair::Error(e),
            },
            r = &mut d, if decoded.is_none() => match r {
                Try::Answered(guard, response) if response.status().is_success() => {
                    decoded = Some((guard, response));
                }
                Try::Answered(guard, response) => return Pair::Refused(Side::Decode, guard, response),
                Try::Failed => return Pair::Failed,
                Try::Error(e) => return Pair::Error(e),
            },
        }
        if let (Some(drain), Some(_)) = (drain.as_mut(), decoded.as_ref()) {
            drain.keep();
            if let Some((guard, response)) = decoded.take() {
                return Pair::Answered(guard, response);
            }
        }
    }
}

/// The prefill's answer, read to its end in the background (its usage recorded); aborted when
/// dropped before [`Drain::keep`] (the pair failed, so the prefill is of no use).
struct Drain {
    task: JoinHandle<()>,
    kept: bool,
}

impl Drain {
    fn start(
        gw: &Gateway,
        guard: RequestGuard,
        response: http::Response<UpstreamBody>,
        started: Instant,
        predicted: u32,
    ) -> Self {
        let sse = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let name = guard.backend.name().to_string();
        let mut body =
            ObservedBody::tracked(response.into_body(), guard, started, sse, false, predicted);
        let limit = gw.settings.upstream_timeout;
        let task = tokio::spawn(async move {
            let read = async {
                while let Some(frame) = body.frame().await {
                    if let Err(e) = frame {
                        tracing::warn!(backend = name, "prefill answer broke off: {e}");
                        break;
                    }
                }
            };
            if tokio::time::timeout(limit, read).await.is_err() {
                tracing::warn!(backend = name, "prefill answer did not end in time");
            }
        });
        Drain { task, kept: false }
    }

    fn keep(&mut self) {
        self.kept = true;
    }
}

impl Drop for Drain {
    fn drop(&mut self) {
        if !self.kept {
            self.task.abort();
        }
    }
}

/// The error when the pair ran out of tries.
fn pair_exhausted(prefill: &Leg, decode: &Leg) -> ApiError {
    if prefill.current().is_none() {
        return prefill.exhausted();
    }
    if decode.current().is_none() {
        return decode.exhausted();
    }
    let failures: Vec<String> = prefill
        .failures()
        .iter()
        .map(|f| format!("prefill {f}"))
        .chain(decode.failures().iter().map(|f| format!("decode {f}")))
        .collect();
    let model = prefill
        .routed
        .candidates
        .first()
        .and_then(|b| b.spec.models.first().cloned())
        .unwrap_or_default();
    exhausted(
        "prefill/decode pair",
        &model,
        &failures,
        prefill.only_unavailable() && decode.only_unavailable(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_legs_get_the_bootstrap_fields() {
        let body = serde_json::to_vec(
            &json!({"model": "m", "prompt": "p", "stream": true, "max_tokens": 9}),
        )
        .unwrap();
        let original = RawObject::parse(&body).unwrap();
        let b = Bootstrap {
            host: "10.0.0.1".into(),
            port: 8998,
            room: (1 << 62) + 5,
        };
        let v: serde_json::Value = serde_json::from_slice(&pair_body(&original, &b, true)).unwrap();
        assert_eq!(v["bootstrap_host"], "10.0.0.1");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["bootstrap_room"], (1u64 << 62) + 5);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(
            (v["stream"].clone(), v["max_tokens"].clone()),
            (json!(true), json!(9))
        );
        let v: serde_json::Value =
            serde_json::from_slice(&pair_body(&original, &b, false)).unwrap();
        assert!(v.get("stream_options").is_none());
    }

    #[test]
    fn rooms_are_63_bit_and_distinct() {
        let rooms: std::collections::HashSet<u64> = (0..1000).map(|_| new_room()).collect();
        assert_eq!(rooms.len(), 1000);
        assert!(rooms.iter().all(|&r| r < 1 << 63));
        // Random, not a counter: the top bits vary.
        assert!(rooms.iter().any(|&r| r > 1 << 40));
    }
}
