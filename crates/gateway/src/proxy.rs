//! The serving path: read the body once, parse what routing needs, route (waiting for capacity
//! if saturated), then try the ranked candidates: a failure before the first response byte
//! moves to the next candidate (bounded by `max_retries`); the answer is streamed back as it
//! comes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::Response;
use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Request};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use switchyard_core::{Observation, PreparedPrompt, RequestId, RequestKind};

use crate::backends::Backend;
use crate::body_budget::{BodyBudget, BodyHold};
use crate::error::ApiError;
use crate::forward::forward;
pub use crate::forward::{reject, Routed, BACKEND, DECISION, REQUEST_ID};
use crate::parse::{self, ParsedRequest};
use crate::state::{Gateway, Target};

/// The OpenAI endpoints the gateway routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/embeddings` (routed by load only).
    Embeddings,
}

impl From<Endpoint> for crate::peers::WireEndpoint {
    fn from(e: Endpoint) -> Self {
        match e {
            Endpoint::Completions => Self::Completions,
            Endpoint::Chat => Self::Chat,
            Endpoint::Embeddings => Self::Embeddings,
        }
    }
}

/// `x-switchyard-phase` (see [`parse::phase_header`]).
static PHASE: HeaderName = HeaderName::from_static("x-switchyard-phase");

/// The client's `x-request-id` if usable, else a generated one.
pub fn request_id(gw: &Gateway, headers: &HeaderMap, rid: RequestId) -> HeaderValue {
    match headers.get(&REQUEST_ID) {
        Some(v) if !v.is_empty() && v.len() <= 256 && v.to_str().is_ok() => v.clone(),
        _ => gw.request_id_header(rid),
    }
}

/// Checks `Authorization: Bearer KEY` against the configured client keys.
pub fn authorised(gw: &Gateway, headers: &HeaderMap) -> bool {
    if gw.settings.api_keys.is_empty() {
        return true;
    }
    bearer(headers).is_some_and(|k| gw.settings.api_keys.contains(k))
}

/// The bearer token of a request, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Bytes the request's headers take on the wire, roughly (`name: value\r\n` each).
fn header_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum()
}

async fn read_body<B>(
    body: B,
    limit: usize,
    headers: &HeaderMap,
    budget: &BodyBudget,
) -> Result<(Bytes, BodyHold), ApiError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    // The whole body's memory is reserved before any of it is read: what it declares, or the
    // largest body allowed when it declares nothing (chunked uploads are rare from API clients).
    let mut hold = BodyHold::default();
    let reserve = declared.map_or(limit, |n| n as usize);
    if !budget.reserve(&mut hold, reserve) {
        return Err(ApiError::body_memory_exhausted(budget.limit()));
    }
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok((c.to_bytes(), hold)),
        Err(e) if e.is::<LengthLimitError>() => Err(ApiError::too_large(limit)),
        Err(e) => Err(ApiError::malformed(format!("cannot read the body: {e}"))),
    }
}

// Not boxed: the step is moved once per request, and boxing it cost an allocation.
#[allow(clippy::large_enum_variant)]
enum RouteStep {
    Go(Routed),
    Saturated,
    NoBackend,
}

/// A request ready to route: its model resolved and its prompt hashed (once, outside the lock,
/// however often it is routed).
struct Prepared {
    target: Target,
    prompt: PreparedPrompt,
    kind: RequestKind,
}

/// One routing attempt under the lock; the first candidate is recorded as `Routed` at once.
fn route_once(
    gw: &Gateway,
    parsed: &ParsedRequest<'_>,
    prepared: &Prepared,
    rid: RequestId,
) -> Result<RouteStep, ApiError> {
    let max = gw.settings.max_retries as usize + 1;
    let mut guard = gw.registry.lock();
    // One clock read for the router's time and the decision timer.
    let t0 = Instant::now();
    let now = gw.seconds_at(t0);
    let registry = &mut *guard;
    let mut candidates: Vec<Arc<Backend>> = Vec::with_capacity(max);
    let decision = registry.route(
        parsed,
        &prepared.target,
        &prepared.prompt,
        prepared.kind,
        now,
    )?;
    gw.metrics
        .decision_seconds
        .observe(t0.elapsed().as_secs_f64());
    if decision.eligible == 0 {
        return Ok(if decision.saturated {
            RouteStep::Saturated
        } else {
            RouteStep::NoBackend
        });
    }
    candidates.extend(
        decision
            .ranked_candidates()
            .take(max)
            .filter_map(|c| registry.backend(c.instance).cloned()),
    );
    let Some(first) = candidates.first().map(|b| b.id) else {
        return Ok(RouteStep::NoBackend);
    };
    let explain = gw.settings.debug_header.then(|| {
        decision.explain_with(3, |id| {
            registry
                .backend(id)
                .map_or_else(|| "?".to_string(), |b| b.name().to_string())
        })
    });
    let prompt_tokens = decision.prompt_tokens;
    let decision = Arc::new(decision);
    let kept = decision.clone();
    let routed = Routed {
        rid,
        decision: Some(decision),
        candidates,
        prompt_tokens,
        explain,
        upstream_model: prepared.target.upstream_model.clone(),
        warm: None,
    };
    let plan = routed.plan_for(first);
    registry.observe(
        Observation::Routed {
            request: rid,
            instance: first,
            plan,
        },
        now,
    );
    drop(guard);
    // After the router's lock: the dashboard's ring has its own.
    gw.live.decided(
        now,
        rid,
        &prepared.target.model,
        prepared.target.adapter.as_deref(),
        &kept,
    );
    Ok(RouteStep::Go(routed))
}

/// Routes, waiting in the admission queue while every candidate is saturated; the first
/// candidate is recorded as `Routed`. Errors are the client's answer (404, 429, 503...).
pub async fn route(
    gw: &Gateway,
    parsed: &ParsedRequest<'_>,
    endpoint: Endpoint,
    rid: RequestId,
) -> Result<Routed, ApiError> {
    let kind = if endpoint == Endpoint::Embeddings {
        RequestKind::Embed
    } else {
        RequestKind::Generate
    };
    // A short hold of the lock to resolve the name; the prompt is hashed without it.
    let target = gw.registry.lock().target(&parsed.model)?;
    let prompt = target.prepare(parsed, kind, gw.block_bytes);
    let prompt = gw.tokenize_off_worker(&target, parsed, kind, prompt).await;
    let warm = gw.answer_warm(&target, parsed, &prompt);
    let prepared = Prepared {
        target,
        prompt,
        kind,
    };
    // Requests already waiting for this model go first: a newcomer joins the end of the line.
    let mut routed = if gw.admission.has_line(&parsed.model) {
        Box::pin(queue(gw, parsed, &prepared, rid)).await?
    } else {
        match route_once(gw, parsed, &prepared, rid)? {
            RouteStep::Go(r) => r,
            RouteStep::NoBackend => return Err(ApiError::no_backend(&parsed.model)),
            // Rare: boxed, so the common request's future stays small.
            RouteStep::Saturated => Box::pin(queue(gw, parsed, &prepared, rid)).await?,
        }
    };
    routed.warm = warm;
    Ok(routed)
}

/// Waits in the admission queue (FIFO per model), routing again whenever it is this request's
/// turn and capacity may have freed up.
async fn queue(
    gw: &Gateway,
    parsed: &ParsedRequest<'_>,
    prepared: &Prepared,
    rid: RequestId,
) -> Result<Routed, ApiError> {
    let retry_after = gw.settings.queue_timeout.as_secs().clamp(1, 60) as u32;
    let Some(place) = gw.admission.enter(
        &parsed.model,
        gw.settings.queue_size,
        &gw.metrics.admission_queue,
    ) else {
        return Err(ApiError::saturated(retry_after));
    };
    let deadline = tokio::time::Instant::now() + gw.settings.queue_timeout;
    while place.turn(deadline).await {
        if gw.is_shutting_down() {
            return Err(ApiError::shutting_down());
        }
        match route_once(gw, parsed, prepared, rid)? {
            // Leaving the line (drop) gives the next request its turn.
            RouteStep::Go(r) => return Ok(r),
            RouteStep::Saturated => {}
            RouteStep::NoBackend => return Err(ApiError::no_backend(&parsed.model)),
        }
    }
    Err(ApiError::saturated(retry_after))
}

/// Shared state as handlers receive it.
pub type Shared = axum::extract::State<Arc<Gateway>>;

/// The request id to echo on endpoints that do not proxy.
pub fn echo_id(gw: &Gateway, headers: &HeaderMap) -> HeaderValue {
    let rid = gw.next_request();
    request_id(gw, headers, rid)
}

/// Adds the request id to a response.
pub fn with_id(mut response: Response, id: HeaderValue) -> Response {
    response.headers_mut().insert(REQUEST_ID.clone(), id);
    response
}

/// Serves one OpenAI request end to end.
pub async fn handle<B>(gw: Arc<Gateway>, endpoint: Endpoint, request: Request<B>) -> Response
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let started = Instant::now();
    let rid = gw.next_request();
    let (parts, body) = request.into_parts();
    let request_id = request_id(&gw, &parts.headers, rid);
    if gw.is_shutting_down() {
        return reject(&gw, ApiError::shutting_down(), &request_id);
    }
    if !authorised(&gw, &parts.headers) {
        return reject(&gw, ApiError::unauthorized(), &request_id);
    }
    let limit = gw.settings.max_header_bytes;
    if limit > 0 && header_bytes(&parts.headers) > limit {
        return reject(&gw, ApiError::headers_too_large(limit), &request_id);
    }
    let read = read_body(
        body,
        gw.settings.max_body_bytes,
        &parts.headers,
        &gw.body_budget,
    );
    // Zero: no limit (a century stands in for it; `Duration::MAX` would overflow the clock).
    let body_timeout = Some(gw.settings.body_read_timeout)
        .filter(|d| !d.is_zero())
        .unwrap_or(Duration::from_secs(100 * 365 * 24 * 3600));
    // `_hold` gives the body's memory back to the budget when this request is done with it.
    let (bytes, _hold) = match tokio::time::timeout(body_timeout, read).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return reject(&gw, e, &request_id),
        Err(_) => {
            let secs = gw.settings.body_read_timeout.as_secs_f64();
            return reject(&gw, ApiError::body_timeout(secs), &request_id);
        }
    };
    let session = parts
        .headers
        .get(&parse::SESSION_ID)
        .and_then(|v| v.to_str().ok());
    let mut parsed = match parse::parse(&bytes, session) {
        Ok(p) => p,
        Err(e) => return reject(&gw, e, &request_id),
    };
    parsed.phase = parse::phase_header(parts.headers.get(&PHASE).and_then(|v| v.to_str().ok()));
    let routed = match route(&gw, &parsed, endpoint, rid).await {
        Ok(r) => r,
        Err(e) => return reject(&gw, e, &request_id),
    };
    // A disaggregated request's prefill leg is `rid` on its first candidate; its decode leg is
    // shared when it is sent (`pd::leg`).
    if let (Some(peers), Some(first)) = (&gw.peers, routed.candidates.first()) {
        peers.routed(
            &gw.metrics,
            rid,
            first.name(),
            endpoint.into(),
            session,
            &bytes,
        );
    }

    // Ask for the usage chunk the client did not ask for, to learn from it; it is removed
    // again on the way back.
    let strip_usage = gw.settings.inject_usage
        && endpoint != Endpoint::Embeddings
        && parsed.stream
        && !parsed.has_stream_options;
    drop(parsed);
    // An alias or the single-model fallback applied: the engine gets the name it serves (vLLM
    // refuses others). Only then is the body copied.
    let bytes = match routed.upstream_model.as_deref() {
        Some(model) => Bytes::from(parse::with_model(&bytes, model)),
        None => bytes,
    };
    let upstream_body = match strip_usage
        .then(|| parse::with_include_usage(&bytes))
        .flatten()
    {
        Some(b) => Bytes::from(b),
        None => bytes.clone(),
    };
    if routed
        .decision
        .as_ref()
        .is_some_and(|d| d.is_disaggregated())
    {
        let inject = gw.settings.inject_usage;
        // Boxed: a large future most requests never need.
        return Box::pin(crate::pd::serve(
            &gw,
            routed,
            &parts,
            &bytes,
            &request_id,
            inject,
            started,
        ))
        .await;
    }
    forward(
        &gw,
        routed,
        &parts,
        upstream_body,
        &request_id,
        strip_usage,
        started,
    )
    .await
}
