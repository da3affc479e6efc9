//! The live dashboard: `GET /dashboard` (one HTML page with its script and styles, embedded in
//! the binary, nothing fetched from elsewhere), `GET /dashboard/snapshot` (the figures it shows,
//! as JSON) and `GET /dashboard/events` (the same JSON as server-sent events, one every
//! [`INTERVAL`]).
//!
//! Behind the admin token, sent either as `Authorization: Bearer TOKEN` (scripts) or as the
//! password of HTTP Basic credentials (any user name). A browser asks for the latter once, on
//! the 401's Basic challenge, and then sends them with every request of the page, its
//! `EventSource` included (which cannot set headers): the token never goes into a URL, where it
//! would end up in histories and logs.
//!
//! Built from what the gateway knows already (the router's fleet view, as `/admin/fleet`) and
//! the bounded rings of [`crate::live`]; reading it never changes a routing decision.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bytes::Bytes;
use serde_json::{json, Value};
use switchyard_core::{EngineMetrics, InstanceId};

use crate::admin::same;
use crate::backends::Backend;
use crate::error::ApiError;
use crate::live::{quantile, Second, SECONDS, WINDOW_S};
use crate::proxy::{self, echo_id, with_id, Shared};
use crate::state::Gateway;

/// How often an event stream sends a snapshot.
pub const INTERVAL: Duration = Duration::from_secs(1);
/// Event streams open at once, over all clients; one more is answered 503 (each costs a
/// snapshot per [`INTERVAL`]).
pub const MAX_STREAMS: usize = 16;
/// How long one event stream lasts; the browser's `EventSource` then reconnects by itself
/// (after the `retry` the stream announces), so a forgotten tab holds no stream for ever.
pub const STREAM_LIFETIME: Duration = Duration::from_secs(600);
/// Fewest TTFT samples an instance needs in the window to count for the hot-spot indicator
/// (a p99 of three samples says nothing).
///
/// The indicator is the worst instance's p99 TTFT over the median of the instances' p99s, as
/// the recording rule `job:switchyard_ttft_hot_spot:max_ratio_5m`, not over the fleet's p99:
/// with a few instances the slowest one makes the fleet's p99 itself, and the ratio stays near
/// 1 however slow it is.
pub const HOT_SPOT_MIN_SAMPLES: usize = 5;

/// The page: HTML, CSS and plain JavaScript in one file, no build step.
static PAGE: &str = include_str!("dashboard.html");

/// The admin token presented: a Bearer token, or the password of Basic credentials.
fn presented(headers: &HeaderMap) -> Option<String> {
    if let Some(t) = proxy::bearer(headers) {
        return Some(t.to_string());
    }
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, encoded) = v.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (_, password) = text.split_once(':')?;
    Some(password.to_string())
}

/// The answer to a request without the admin token, if it has none: 403 when the admin API is
/// off (no token configured), 401 with a Basic challenge when the token is missing or wrong.
fn refusal(gw: &Gateway, headers: &HeaderMap) -> Option<Response> {
    let id = echo_id(gw, headers);
    let Some(token) = &gw.settings.admin_token else {
        return Some(proxy::reject(
            gw,
            ApiError::forbidden("The dashboard is disabled; start with --admin-token."),
            &id,
        ));
    };
    match presented(headers) {
        Some(t) if same(t.as_bytes(), token.as_bytes()) => None,
        _ => {
            let mut r = proxy::reject(gw, ApiError::admin_unauthorized(), &id);
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(r#"Basic realm="switchyard admin", charset="UTF-8""#),
            );
            Some(r)
        }
    }
}

/// `GET /dashboard`: the page.
pub async fn page(State(gw): Shared, headers: HeaderMap) -> Response {
    if let Some(r) = refusal(&gw, &headers) {
        return r;
    }
    let response = (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            // Nothing on the page comes from elsewhere, and nothing may.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'",
            ),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        PAGE,
    )
        .into_response();
    with_id(response, echo_id(&gw, &headers))
}

/// `GET /dashboard/snapshot`: what the page shows, once, as JSON.
pub async fn snapshot_json(State(gw): Shared, headers: HeaderMap) -> Response {
    if let Some(r) = refusal(&gw, &headers) {
        return r;
    }
    let mut response = axum::Json(snapshot(&gw)).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    with_id(response, echo_id(&gw, &headers))
}

/// One open event stream, counted against [`MAX_STREAMS`] until dropped (with the body: at
/// the end of the stream, or when hyper drops it because the client went away).
struct StreamSlot(Arc<AtomicUsize>);

impl StreamSlot {
    fn take(open: &Arc<AtomicUsize>) -> Option<Self> {
        if open.fetch_add(1, Ordering::AcqRel) >= MAX_STREAMS {
            open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(StreamSlot(open.clone()))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What an event stream carries between two snapshots.
struct Streaming {
    gw: Arc<Gateway>,
    tick: tokio::time::Interval,
    until: tokio::time::Instant,
    first: bool,
    _slot: StreamSlot,
}

/// `GET /dashboard/events`: a snapshot every [`INTERVAL`] as server-sent events, until the
/// client goes away (noticed at the next write), [`STREAM_LIFETIME`] passes, or shutdown
/// begins (at once: a graceful shutdown must not wait for a dashboard).
pub async fn events(State(gw): Shared, headers: HeaderMap) -> Response {
    if let Some(r) = refusal(&gw, &headers) {
        return r;
    }
    let id = echo_id(&gw, &headers);
    if gw.is_shutting_down() {
        // Not 200: an `EventSource` given an error stops reconnecting.
        return proxy::reject(&gw, ApiError::shutting_down(), &id);
    }
    let Some(slot) = StreamSlot::take(&gw.live.streams) else {
        return proxy::reject(&gw, ApiError::too_many_streams(MAX_STREAMS), &id);
    };
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let state = Streaming {
        until: tokio::time::Instant::now() + STREAM_LIFETIME,
        gw: gw.clone(),
        tick,
        first: true,
        _slot: slot,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        tokio::select! {
            _ = s.tick.tick() => {}
            _ = s.gw.shutdown_begun() => return None,
        }
        if s.gw.is_shutting_down() || tokio::time::Instant::now() >= s.until {
            return None;
        }
        let data = serde_json::to_string(&snapshot(&s.gw)).unwrap_or_else(|_| "{}".into());
        // The first event also says how long the browser waits before reconnecting.
        let retry = if std::mem::take(&mut s.first) {
            "retry: 2000\n"
        } else {
            ""
        };
        let event = Bytes::from(format!("{retry}data: {data}\n\n"));
        Some((Ok::<_, Infallible>(event), s))
    });
    let mut response = Response::new(Body::from_stream(stream));
    *response.status_mut() = StatusCode::OK;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    // A buffering proxy in front (nginx) would hold the events back.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    with_id(response, id)
}

/// One backend's figures, read under the registry lock.
struct Row {
    backend: Arc<Backend>,
    leaving: bool,
    resident: Vec<String>,
    pending: u32,
    running: u32,
    kv_tokens: u64,
    engine: Option<(EngineMetrics, f64)>,
    prefill_tokens_per_s: f64,
    hit_share: f64,
}

/// The dashboard's state of the gateway now (see docs/observability.md for each field).
pub fn snapshot(gw: &Gateway) -> Value {
    let now = gw.now();
    // The lock held only to copy; percentiles and text are made after.
    let (rows, policy, router_in_flight, stale, names) = {
        let registry = gw.registry.lock();
        let router = &registry.router;
        let rows: Vec<Row> = registry
            .by_name
            .values()
            .map(|b| {
                let i = router.fleet().get(b.id);
                Row {
                    backend: b.clone(),
                    leaving: registry.leaving.contains(b.name()),
                    resident: i.map(|i| i.adapters.resident.clone()).unwrap_or_default(),
                    pending: i.map_or(0, |i| i.load.pending_requests),
                    running: i.map_or(0, |i| i.load.running_requests),
                    kv_tokens: i.map_or(0, |i| i.load.kv_tokens(router.output_share())),
                    engine: i.and_then(|i| i.engine.clone()),
                    prefill_tokens_per_s: i.map_or(0.0, |i| i.learned.prefill_tokens_per_s),
                    hit_share: i.map_or(0.0, |i| i.learned.hit_share),
                }
            })
            .collect();
        let names: HashMap<InstanceId, String> = registry
            .by_name
            .values()
            .map(|b| (b.id, b.name().to_string()))
            .collect();
        (
            rows,
            router.policy_name(),
            router.in_flight_len(),
            router.config().estimates.metrics_stale_after_s,
            names,
        )
    };
    let since = now - WINDOW_S;
    let seconds = gw.live.seconds();
    let recent: Vec<&Second> = seconds
        .iter()
        .filter(|s| s.at as f64 >= since.floor())
        .collect();
    let routed_recent: u64 = recent.iter().map(|s| u64::from(s.total)).sum();
    let routed_to = |slot: u32| -> u64 {
        recent
            .iter()
            .map(|s| u64::from(s.routed.get(slot as usize).copied().unwrap_or(0)))
            .sum()
    };

    let mut fleet_ttft = Vec::new();
    let mut worst_p99: Option<(f64, String)> = None;
    let mut p99s = Vec::new();
    let mut instances = Vec::with_capacity(rows.len());
    for r in &rows {
        let b = &r.backend;
        let mut ttft = b.ttft.since(since);
        fleet_ttft.extend_from_slice(&ttft);
        let samples = ttft.len();
        let p50 = quantile(&mut ttft, 0.5);
        let p99 = quantile(&mut ttft, 0.99);
        if let Some(p) = p99.filter(|_| samples >= HOT_SPOT_MIN_SAMPLES) {
            p99s.push(p);
            if worst_p99.as_ref().is_none_or(|(w, _)| p > *w) {
                worst_p99 = Some((p, b.name().to_string()));
            }
        }
        let state = if r.leaving {
            "leaving"
        } else if b.is_draining() {
            "drained"
        } else if !b.is_healthy() {
            "ejected"
        } else {
            "healthy"
        };
        let engine = r.engine.as_ref().map(|(m, at)| {
            json!({
                "waiting": m.waiting,
                "running": m.running,
                "kv_usage": m.kv_usage,
                "kv_capacity_tokens": m.kv_capacity_tokens,
                "max_running": m.max_running,
                "age_s": now - at,
                "fresh": now - at <= stale,
            })
        });
        let routed = routed_to(b.id.slot);
        instances.push(json!({
            "name": b.name(),
            "address": b.spec.address,
            "state": state,
            "role": b.spec.role,
            "kind": b.kind(),
            "models": b.spec.models,
            "adapters": b.spec.adapters,
            "resident_adapters": r.resident,
            "gateway_in_flight": b.in_flight(),
            "router": {
                "pending": r.pending,
                "running": r.running,
                "kv_tokens": r.kv_tokens,
            },
            "engine": engine,
            "prefix_hit_share": r.hit_share,
            "prefill_tokens_per_s": (r.prefill_tokens_per_s > 0.0).then_some(r.prefill_tokens_per_s),
            "routed_recent": routed,
            "traffic_share": (routed_recent > 0).then(|| routed as f64 / routed_recent as f64),
            "ttft_samples": samples,
            "ttft_p50_s": p50,
            "ttft_p99_s": p99,
        }));
    }
    let fleet_p50 = quantile(&mut fleet_ttft, 0.5);
    let fleet_p99 = quantile(&mut fleet_ttft, 0.99);
    let hot_spot = match (&worst_p99, median(&mut p99s)) {
        (Some((worst, name)), Some(typical)) if typical > 0.0 => json!({
            "ratio": worst / typical,
            "instance": name,
            "median_p99_s": typical,
        }),
        _ => Value::Null,
    };

    let sum = |f: fn(&Second) -> u32| -> u32 { recent.iter().map(|s| f(s)).sum() };
    let per_minute = json!({
        "window_s": WINDOW_S,
        "adapter_loads": sum(|s| s.loads),
        "adapter_unloads": sum(|s| s.unloads),
        "adapter_swaps": sum(|s| s.adapter_swaps),
        "cache_moves": sum(|s| s.cache_moves),
        "routed": routed_recent,
    });

    json!({
        "now_s": now,
        "interval_s": INTERVAL.as_secs_f64(),
        "policy": policy,
        "router_in_flight": router_in_flight,
        "admission_queue": gw.admission.len(),
        "shutting_down": gw.is_shutting_down(),
        "instances": instances,
        "fleet": {
            "ttft_samples": fleet_ttft.len(),
            "ttft_p50_s": fleet_p50,
            "ttft_p99_s": fleet_p99,
            "hot_spot": hot_spot,
        },
        "per_minute": per_minute,
        "series": series(now, &seconds, &rows),
        "decisions": decisions(gw, &names),
    })
}

/// The median of `values` (the mean of the middle two for an even count, as Prometheus'
/// `quantile(0.5, ...)`); `None` when empty.
fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// The last [`SECONDS`] seconds, one entry per second, oldest first (seconds with no event
/// are zeros): requests routed to each instance, the typical observed ÷ estimated TTFT and
/// the mean relative error of the estimates.
fn series(now: f64, seconds: &[Second], rows: &[Row]) -> Value {
    let end = now.max(0.0) as u64;
    let start = (end + 1).saturating_sub(SECONDS as u64);
    let len = (end + 1 - start) as usize;
    let mut total = vec![0u32; len];
    let mut ratio: Vec<Option<f64>> = vec![None; len];
    let mut error: Vec<Option<f64>> = vec![None; len];
    let mut routed: Vec<Vec<u32>> = vec![vec![0; len]; rows.len()];
    for s in seconds.iter().filter(|s| s.at >= start && s.at <= end) {
        let k = (s.at - start) as usize;
        total[k] = s.total;
        if s.predictions > 0 {
            let n = f64::from(s.predictions);
            ratio[k] = Some((s.log_ratio_sum / n).exp());
            error[k] = Some(s.abs_error_sum / n);
        }
        for (r, counts) in rows.iter().zip(routed.iter_mut()) {
            counts[k] = s
                .routed
                .get(r.backend.id.slot as usize)
                .copied()
                .unwrap_or(0);
        }
    }
    let by_instance: serde_json::Map<String, Value> = rows
        .iter()
        .zip(routed)
        .map(|(r, counts)| (r.backend.name().to_string(), json!(counts)))
        .collect();
    json!({
        "start_s": start,
        "step_s": 1,
        "routed": total,
        "routed_by_instance": by_instance,
        "ttft_ratio": ratio,
        "ttft_error": error,
    })
}

/// The last decisions, newest first, each with its explanation (as `x-switchyard-decision`).
fn decisions(gw: &Gateway, names: &HashMap<InstanceId, String>) -> Vec<Value> {
    let name = |id: InstanceId| names.get(&id).cloned().unwrap_or_else(|| "?".into());
    gw.live
        .decisions()
        .iter()
        .rev()
        .map(|d| {
            let explain = d.explained.get_or_init(|| d.decision.explain_with(3, name));
            let first = d.decision.ranked_candidates().next();
            json!({
                "at_s": d.at_s,
                "request": d.request.0,
                "model": d.model,
                "adapter": d.adapter,
                "backend": first.map(|c| name(c.instance)),
                "score": first.map(|c| c.score),
                "cached_tokens": first.map(|c| c.terms.cached_tokens),
                "prompt_tokens": d.decision.prompt_tokens,
                "eligible": d.decision.eligible,
                "explain": explain,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_as_prometheus_takes_them() {
        assert_eq!(median(&mut []), None);
        assert_eq!(median(&mut [3.0]), Some(3.0));
        assert_eq!(median(&mut [4.0, 1.0]), Some(2.5));
        assert_eq!(median(&mut [9.0, 1.0, 2.0]), Some(2.0));
    }

    #[test]
    fn the_token_comes_as_bearer_or_as_basic_password() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            presented(&h)
        };
        assert_eq!(with("Bearer abc").as_deref(), Some("abc"));
        // "admin:abc" and ":a:b" (a password may hold colons; the user name may be empty).
        assert_eq!(with("Basic YWRtaW46YWJj").as_deref(), Some("abc"));
        assert_eq!(with("basic OmE6Yg==").as_deref(), Some("a:b"));
        assert_eq!(with("Basic !!!"), None);
        // No colon: no password.
        assert_eq!(with("Basic YWJj"), None);
        assert_eq!(with("Digest abc"), None);
        assert_eq!(presented(&HeaderMap::new()), None);
    }
}
