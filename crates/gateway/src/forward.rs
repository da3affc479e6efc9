//! Sending a routed request: the ranked candidates tried in turn (a failure before the first
//! response byte moves to the next, bounded by `max_retries`), failures held against the
//! engines that caused them, and the answer streamed back as it comes. Below both the OpenAI
//! path (the proxy module) and the disaggregated one (`pd`), which share it.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::header::{self, HeaderName};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::Full;
use switchyard_core::{Decision, InstanceId, Observation, RequestId, RoutePlan};

use crate::backends::Backend;
use crate::error::ApiError;
use crate::health;
use crate::state::Gateway;
use crate::stream::{ObservedBody, RequestGuard};
use crate::upstream::Failure;

/// `x-request-id`.
pub static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// Debug header with the decision's explanation.
pub static DECISION: HeaderName = HeaderName::from_static("x-switchyard-decision");
/// Debug header naming the backend that answered.
pub static BACKEND: HeaderName = HeaderName::from_static("x-switchyard-backend");

/// An error answer, counted and carrying the request id.
pub fn reject(gw: &Gateway, e: ApiError, request_id: &HeaderValue) -> Response {
    gw.metrics.gateway_answer(e.code);
    let mut r = e.into_response();
    r.headers_mut()
        .insert(REQUEST_ID.clone(), request_id.clone());
    r
}

/// What routing produced for one request.
pub struct Routed {
    /// The router's id of the request.
    pub rid: RequestId,
    /// The decision (none for one leg of a disaggregated pair, routed already); shared by the
    /// two legs of a disaggregated request.
    pub decision: Option<Arc<Decision>>,
    /// Candidates to try, in order (the first already observed as `Routed`).
    pub candidates: Vec<Arc<Backend>>,
    /// Estimated prompt tokens (the plan of a request without a decision).
    pub prompt_tokens: u32,
    /// The decision explained, for the debug header.
    pub explain: Option<String>,
    /// The `model` to put in the body sent upstream, when an alias or the single-model
    /// fallback applied (else the body's own is right).
    pub upstream_model: Option<String>,
    /// What to keep to warm the piece cache with the answer (chat requests tokenized for
    /// exact matching; [`crate::state::Gateway::answer_warm`]).
    pub warm: Option<Arc<crate::state::AnswerWarm>>,
}

impl Routed {
    /// What to record when the request goes to `id`.
    pub fn plan_for(&self, id: InstanceId) -> RoutePlan {
        match &self.decision {
            Some(d) => d.plan_for(id),
            None => RoutePlan::unplanned(self.prompt_tokens),
        }
    }

    fn predicted_cached(&self, id: InstanceId) -> u32 {
        self.decision
            .as_ref()
            .and_then(|d| d.candidate(id))
            .map_or(0, |c| c.terms.cached_tokens)
    }
}

fn hop_by_hop(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::TRANSFER_ENCODING
        || name == header::TE
        || name == header::TRAILER
        || name == header::UPGRADE
        || name == header::PROXY_AUTHORIZATION
        || name == header::PROXY_AUTHENTICATE
        || name.as_str() == "keep-alive"
}

/// The request for `backend`: origin-form URI (its path prefix added), the client's headers
/// but hop-by-hop ones, `Host`, `content-length` and our `x-request-id`.
fn upstream_request(
    backend: &Backend,
    parts: &Parts,
    body: Bytes,
    request_id: &HeaderValue,
    strip_auth: bool,
) -> Result<Request<Full<Bytes>>, http::Error> {
    let root = PathAndQuery::from_static("/");
    let uri = backend
        .base
        .origin(parts.uri.path_and_query().unwrap_or(&root))?;
    let len = body.len();
    let mut request = Request::new(Full::new(body));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    let headers = request.headers_mut();
    headers.reserve(parts.headers.len() + 3);
    for (name, value) in &parts.headers {
        if hop_by_hop(name)
            || name == header::HOST
            || name == header::CONTENT_LENGTH
            // The usage scan reads plain bodies.
            || name == header::ACCEPT_ENCODING
            || name == REQUEST_ID
            || (strip_auth && name == header::AUTHORIZATION)
        {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    headers.insert(REQUEST_ID.clone(), request_id.clone());
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    headers.insert(header::HOST, backend.base.host_header().clone());
    Ok(request)
}

/// The first answer from the candidates that is not a retryable failure, with its guard, or
/// the error to send when every attempt failed.
pub(crate) type Attempt =
    Result<(RequestGuard, http::Response<crate::upstream::UpstreamBody>), ApiError>;

/// Tries the candidates in order (the first already recorded as `Routed`): a failure before
/// the response moves on to the next; the last candidate's answer is returned whatever it is.
pub(crate) async fn attempt(
    gw: &Arc<Gateway>,
    routed: &Routed,
    parts: &Parts,
    body: Bytes,
    request_id: &HeaderValue,
) -> Attempt {
    let strip_auth = !gw.settings.api_keys.is_empty();
    let last = routed.candidates.len().saturating_sub(1);
    let mut all_unreachable = true;
    let mut last_error = String::new();
    // Failures are held against an engine's health once the outcome shows they were the
    // engine's: see `blame`.
    let mut failed: Vec<(&Arc<Backend>, Blame)> = Vec::new();
    for (i, backend) in routed.candidates.iter().enumerate() {
        if i > 0 {
            gw.metrics.retries.inc();
            gw.observe(Observation::Routed {
                request: routed.rid,
                instance: backend.id,
                plan: routed.plan_for(backend.id),
            });
        }
        let mut guard = RequestGuard::new(gw.clone(), routed.rid, backend.clone());
        let mut fresh = false;
        loop {
            let request = upstream_request(backend, parts, body.clone(), request_id, strip_auth)
                .map_err(ApiError::bad_gateway)?;
            guard.set_awaiting_head(true);
            let sent = tokio::time::timeout(
                gw.settings.upstream_timeout,
                gw.upstream
                    .send_to(fresh, backend.base.authority(), request),
            )
            .await;
            guard.set_awaiting_head(false);
            let response = match sent {
                Err(_) => {
                    // No answer in time is the engine's failure, as a 5xx is (a hung engine's
                    // health checks may well pass): consecutive ones eject it.
                    failed.push((backend, Blame::Timeout));
                    blame(gw, &failed, false);
                    backend.metrics.timeout.inc();
                    let secs = gw.settings.upstream_timeout.as_secs_f64();
                    return Err(ApiError::upstream_timeout(secs));
                }
                Ok(Ok(r)) => r,
                Ok(Err(e)) => {
                    let failure = crate::upstream::classify(&e);
                    if failure == Failure::Closed && !fresh {
                        // A pooled connection the engine had closed (llama.cpp does after every
                        // stream): the request never ran. Again on a new connection, and not
                        // held against the engine's health.
                        gw.metrics.upstream_failure(backend.name(), "stale");
                        tracing::debug!(
                            backend = backend.name(),
                            "retrying on a fresh connection: {e}"
                        );
                        fresh = true;
                        continue;
                    }
                    gw.metrics.upstream_failure(backend.name(), failure.label());
                    tracing::warn!(backend = backend.name(), "upstream attempt failed: {e}");
                    last_error = format!("{}: {e}", backend.name());
                    all_unreachable &= failure != Failure::Closed;
                    failed.push((backend, Blame::Connection(failure)));
                    break;
                }
            };
            let status = response.status();
            let retryable = status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS;
            if status.is_server_error() {
                failed.push((backend, Blame::Status(status)));
            }
            if retryable && i < last {
                gw.metrics.upstream_failure(
                    backend.name(),
                    if status == StatusCode::TOO_MANY_REQUESTS {
                        "status_429"
                    } else {
                        "status_5xx"
                    },
                );
                tracing::debug!(backend = backend.name(), %status, "retrying on the next candidate");
                break;
            }
            // A 5xx passed on is no answer either.
            blame(gw, &failed, !status.is_server_error());
            return Ok((guard, response));
        }
        guard.fail();
    }
    blame(gw, &failed, false);
    if all_unreachable {
        let model = routed
            .candidates
            .first()
            .and_then(|b| b.spec.models.first().cloned())
            .unwrap_or_default();
        return Err(ApiError::no_backend(&model));
    }
    Err(ApiError::bad_gateway(last_error))
}

/// How an attempt failed, for the health decision.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Blame {
    /// No answer: refused, could not connect, or closed before a response.
    Connection(Failure),
    /// A 5xx answer.
    Status(StatusCode),
    /// No response head within `--upstream-timeout`.
    Timeout,
}

/// Holds the failed attempts of one request against the engines' health, unless the request
/// itself is the likelier cause: when it failed the same way on two or more candidates and
/// none answered (an oversized or malformed request that every engine drops), counting it
/// would let one client get healthy engines ejected for everyone. A refused connection is
/// always the engine's (nothing listens), and a request another candidate served shows the
/// failures were the engines'.
fn blame(gw: &Gateway, failed: &[(&Arc<Backend>, Blame)], served: bool) {
    let same_everywhere = !served
        && failed.len() >= 2
        && failed.iter().all(|(_, b)| *b == failed[0].1)
        && failed[0].1 != Blame::Connection(Failure::Refused);
    if same_everywhere {
        tracing::info!(
            candidates = failed.len(),
            "the request failed the same way on every candidate: not held against their health"
        );
        gw.metrics.request_blamed.inc();
        return;
    }
    for (backend, b) in failed {
        health::record_failure(gw, backend, *b == Blame::Connection(Failure::Refused));
    }
}

/// Sends to the candidates and streams the answer back.
pub(crate) async fn forward(
    gw: &Arc<Gateway>,
    routed: Routed,
    parts: &Parts,
    body: Bytes,
    request_id: &HeaderValue,
    strip_usage: bool,
    started: Instant,
) -> Response {
    match attempt(gw, &routed, parts, body, request_id).await {
        Ok((guard, response)) => respond(
            gw,
            &routed,
            guard,
            response,
            request_id,
            strip_usage,
            started,
        ),
        Err(e) => reject(gw, e, request_id),
    }
}

/// Turns an engine response into the client's, streaming the body through.
pub(crate) fn respond(
    gw: &Arc<Gateway>,
    routed: &Routed,
    mut guard: RequestGuard,
    response: http::Response<crate::upstream::UpstreamBody>,
    request_id: &HeaderValue,
    strip_usage: bool,
    started: Instant,
) -> Response {
    let (mut parts, incoming) = response.into_parts();
    let status = parts.status;
    let backend = guard.backend.clone();
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let body = if status.is_success() {
        if strip_usage && sse {
            parts.headers.remove(header::CONTENT_LENGTH);
        }
        let predicted = routed.predicted_cached(backend.id);
        ObservedBody::tracked(incoming, guard, started, sse, strip_usage && sse, predicted)
            .with_idle_timeout(gw.settings.stream_idle_timeout)
            .with_answer_warm(routed.warm.clone())
    } else {
        // The engine answered: an error is the client's to see, never held against health
        // (4xx), and the request is over as far as the router is concerned.
        if status.is_client_error() && status != StatusCode::TOO_MANY_REQUESTS {
            backend.metrics.client_error.inc();
            backend.record_request_success();
        } else {
            backend.metrics.server_error.inc();
        }
        guard.fail();
        ObservedBody::passthrough(incoming, guard)
            .with_idle_timeout(gw.settings.stream_idle_timeout)
    };
    parts.headers.retain_hop_by_hop();
    parts.headers.insert(REQUEST_ID.clone(), request_id.clone());
    if gw.settings.debug_header {
        if let Ok(v) = HeaderValue::from_str(backend.name()) {
            parts.headers.insert(BACKEND.clone(), v);
        }
        if let Some(v) = routed
            .explain
            .as_deref()
            .and_then(|e| HeaderValue::from_str(e).ok())
        {
            parts.headers.insert(DECISION.clone(), v);
        }
    }
    Response::from_parts(parts, Body::new(body))
}

/// Removes hop-by-hop headers in place.
trait RetainHopByHop {
    fn retain_hop_by_hop(&mut self);
}

impl RetainHopByHop for HeaderMap {
    fn retain_hop_by_hop(&mut self) {
        // Usually there is none: one look at the few names beats seven removals.
        if !self
            .keys()
            .any(|name| hop_by_hop(name) && name != header::PROXY_AUTHORIZATION)
        {
            return;
        }
        for name in [
            header::CONNECTION,
            header::TRANSFER_ENCODING,
            header::TE,
            header::TRAILER,
            header::UPGRADE,
            header::PROXY_AUTHENTICATE,
        ] {
            self.remove(name);
        }
        self.remove("keep-alive");
    }
}
