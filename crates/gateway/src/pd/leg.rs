//! One leg (prefill or decode) of a disaggregated request over its ranked candidates: each try
//! goes to the current candidate; a failure before the answer (connection refused, failed or
//! closed, 5xx, 429) is recorded and moves the leg to the next one; when none is left the
//! client gets the gateway's own error naming the leg and every failure.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, StatusCode};
use http_body_util::{BodyExt, Limited};
use switchyard_core::Observation;

use crate::backends::Backend;
use crate::error::ApiError;
use crate::forward::{attempt, Routed};
use crate::state::Gateway;
use crate::stream::RequestGuard;
use crate::upstream::UpstreamBody;

/// Largest part of a failed answer read to quote the engine's message.
const ERROR_BODY_LIMIT: usize = 8 << 10;
/// Longest wait for that part.
const ERROR_BODY_WAIT: Duration = Duration::from_secs(1);

/// What one try gave.
pub(crate) enum Try {
    /// An answer for the client's side of things: 2xx, or a 4xx (not 429) to pass through.
    Answered(RequestGuard, http::Response<UpstreamBody>),
    /// The candidate failed before answering; recorded, and the leg moved on.
    Failed,
    /// Give up: the leg has no candidate left, or the engine did not answer in time.
    Error(ApiError),
}

/// A leg and where it stands among its candidates.
pub(crate) struct Leg {
    gw: Arc<Gateway>,
    /// `prefill` or `decode`, for messages.
    name: &'static str,
    /// The router's request (its id, decision and ranked candidates).
    pub(crate) routed: Routed,
    /// Index of the current candidate.
    next: usize,
    /// The current candidate is already recorded as `Routed` (the router did it).
    routed_already: bool,
    /// Why each failed candidate failed.
    failures: Vec<String>,
    /// Every failure so far meant "cannot take it now" (unreachable or 429), not a fault.
    only_unavailable: bool,
    /// With `--peer`, for a leg the router did not record itself: its first pick is shared.
    pub(crate) shared: Option<Arc<super::SharedLeg>>,
}

impl Leg {
    /// A leg over `routed.candidates`; `routed_already`: the first is recorded as `Routed`.
    pub(crate) fn new(
        gw: &Arc<Gateway>,
        name: &'static str,
        routed: Routed,
        routed_already: bool,
    ) -> Self {
        Leg {
            gw: gw.clone(),
            name,
            routed,
            next: 0,
            routed_already,
            failures: Vec::new(),
            only_unavailable: true,
            shared: None,
        }
    }

    /// The candidate the next try goes to.
    pub(crate) fn current(&self) -> Option<&Arc<Backend>> {
        self.routed.candidates.get(self.next)
    }

    /// Sends `body` to the current candidate. A failure is recorded (metrics, health, the
    /// router) and moves the leg on; dropping the future abandons the try without blaming
    /// the candidate (the router sees the request `Failed`, the engine a closed connection).
    pub(crate) async fn try_current(
        &mut self,
        parts: &Parts,
        body: Bytes,
        request_id: &HeaderValue,
    ) -> Try {
        let Some(backend) = self.current().cloned() else {
            return Try::Error(self.exhausted());
        };
        if !std::mem::take(&mut self.routed_already) {
            self.gw.observe(Observation::Routed {
                request: self.routed.rid,
                instance: backend.id,
                plan: self.routed.plan_for(backend.id),
            });
            // The first pick goes to the peers; a retry's `Routed` (above) makes them forget it,
            // as for a request sent whole.
            if let (Some(peers), Some(shared), 0) = (&self.gw.peers, &self.shared, self.next) {
                peers.routed(
                    &self.gw.metrics,
                    self.routed.rid,
                    backend.name(),
                    shared.endpoint,
                    shared.session.as_deref(),
                    &shared.body,
                );
            }
        }
        let single = Routed {
            rid: self.routed.rid,
            decision: None,
            candidates: vec![backend.clone()],
            prompt_tokens: 0,
            explain: None,
            // The body was rewritten before the legs were built.
            upstream_model: None,
            // Disaggregated answers are not warmed.
            warm: None,
        };
        // One candidate: `attempt` handles the stale pooled connection, counts a failed
        // connection (metrics, health) and returns any answer as it is.
        match attempt(&self.gw, &single, parts, body, request_id).await {
            Err(e) if e.status == StatusCode::GATEWAY_TIMEOUT => Try::Error(e),
            Err(e) => {
                let unreachable = e.status == StatusCode::SERVICE_UNAVAILABLE;
                let why = if unreachable {
                    "unreachable".to_string()
                } else {
                    "connection closed before an answer".to_string()
                };
                self.failed(&backend, why, unreachable);
                Try::Failed
            }
            Ok((mut guard, response)) => {
                let status = response.status();
                let busy = status == StatusCode::TOO_MANY_REQUESTS;
                if !(busy || status.is_server_error()) {
                    return Try::Answered(guard, response);
                }
                let label = if busy { "status_429" } else { "status_5xx" };
                self.gw.metrics.upstream_failure(backend.name(), label);
                guard.fail();
                let why = format!("HTTP {}{}", status.as_u16(), engine_message(response).await);
                self.failed(&backend, why, busy);
                Try::Failed
            }
        }
    }

    /// The current candidate answered but the answer is unusable (e.g. a prefill without
    /// `kv_transfer_params`): settle it as failed and move on.
    pub(crate) fn reject_answer(&mut self, mut guard: RequestGuard, why: String) {
        guard.fail();
        let backend = guard.backend.clone();
        self.failed(&backend, why, false);
    }

    fn failed(&mut self, backend: &Backend, why: String, unavailable: bool) {
        tracing::warn!(
            leg = self.name,
            backend = backend.name(),
            "disaggregated leg failed: {why}"
        );
        self.failures.push(format!("{}: {why}", backend.name()));
        self.only_unavailable &= unavailable;
        self.next += 1;
    }

    /// Failures so far, `backend: why` each.
    pub(crate) fn failures(&self) -> &[String] {
        &self.failures
    }

    /// Whether every failure so far was an unreachable or busy (429) candidate.
    pub(crate) fn only_unavailable(&self) -> bool {
        self.only_unavailable
    }

    /// The error once no candidate is left.
    pub(crate) fn exhausted(&self) -> ApiError {
        exhausted(
            self.name,
            &self.model(),
            &self.failures,
            self.only_unavailable,
        )
    }

    fn model(&self) -> String {
        self.routed
            .candidates
            .first()
            .and_then(|b| b.spec.models.first().cloned())
            .unwrap_or_default()
    }
}

/// The gateway's answer when a leg (or an SGLang pair) ran out of tries: 503 when every
/// candidate was unreachable or busy, else 502; the message names the leg and each failure.
pub(crate) fn exhausted(
    leg: &str,
    model: &str,
    failures: &[String],
    only_unavailable: bool,
) -> ApiError {
    let detail = if failures.is_empty() {
        "no candidate".to_string()
    } else {
        failures.join("; ")
    };
    if only_unavailable {
        ApiError {
            message: format!(
                "No {leg} instance could take the request for model `{model}` ({detail})."
            ),
            ..ApiError::no_backend(model)
        }
    } else {
        ApiError {
            message: format!("The {leg} failed on every candidate: {detail}."),
            ..ApiError::bad_gateway("")
        }
    }
}

/// ` (message)` from an engine's error answer, when it reads as OpenAI's error shape in time.
async fn engine_message(response: http::Response<UpstreamBody>) -> String {
    let read = tokio::time::timeout(
        ERROR_BODY_WAIT,
        Limited::new(response.into_body(), ERROR_BODY_LIMIT).collect(),
    )
    .await;
    let Ok(Ok(body)) = read else {
        return String::new();
    };
    serde_json::from_slice::<serde_json::Value>(&body.to_bytes())
        .ok()
        .and_then(|v| {
            let e = v.get("error")?;
            e.get("message")
                .or(Some(e))
                .and_then(|m| m.as_str().map(String::from))
        })
        .map(|m| format!(" ({m})"))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhaustion_is_503_when_only_unavailable_else_502() {
        let f = vec!["p1: HTTP 429".to_string(), "p2: unreachable".to_string()];
        let e = exhausted("prefill", "m", &f, true);
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code, "no_healthy_backend");
        assert!(e.message.contains("prefill") && e.message.contains("p2: unreachable"));
        let e = exhausted("decode", "m", &["d1: HTTP 500 (boom)".to_string()], false);
        assert_eq!(e.status, StatusCode::BAD_GATEWAY);
        assert_eq!(e.code, "upstream_error");
        assert!(e.message.contains("decode") && e.message.contains("boom"));
    }
}
