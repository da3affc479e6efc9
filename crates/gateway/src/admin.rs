//! Admin endpoints, behind their own token (`Authorization: Bearer TOKEN`): the fleet as the
//! router sees it, draining a backend, switching the policy.

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::proxy::{self, echo_id, with_id, Shared};
use crate::state::Gateway;

/// Equal-time comparison, so the token cannot be guessed byte by byte from timings.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A backend name from the path, or why it could not be read (answered after the auth check,
/// in the OpenAI error shape, instead of axum's plain-text 400 before it).
type PathArg = Result<Path<String>, PathRejection>;

fn check(gw: &Gateway, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = &gw.settings.admin_token else {
        return Err(ApiError::forbidden(
            "The admin API is disabled; start the gateway with --admin-token.",
        ));
    };
    match proxy::bearer(headers) {
        Some(t) if same(t.as_bytes(), token.as_bytes()) => Ok(()),
        _ => Err(ApiError::forbidden("Missing or wrong admin token.")),
    }
}

/// `GET /admin/fleet`: every backend with its health, load, last engine metrics and what the
/// router learned.
pub async fn fleet(State(gw): Shared, headers: HeaderMap) -> Response {
    let id = echo_id(&gw, &headers);
    if let Err(e) = check(&gw, &headers) {
        return proxy::reject(&gw, e, &id);
    }
    let now = gw.now();
    let registry = gw.registry.lock();
    let router = &registry.router;
    let stale = router.config().estimates.metrics_stale_after_s;
    let mut backends = Vec::new();
    for b in registry.by_name.values() {
        let instance = router.fleet().get(b.id);
        let load = instance.map(|i| {
            json!({
                "pending_requests": i.load.pending_requests,
                "pending_tokens": i.load.pending_tokens,
                "running_requests": i.load.running_requests,
                "kv_tokens": i.load.kv_tokens(router.output_share()),
            })
        });
        let engine = instance.and_then(|i| i.engine.as_ref()).map(|(m, at)| {
            json!({
                "metrics": m,
                "age_s": now - at,
                "fresh": now - at <= stale,
            })
        });
        backends.push(json!({
            "name": b.name(),
            "address": b.spec.address,
            "role": b.spec.role,
            "models": b.spec.models,
            "adapters": b.spec.adapters,
            "resident_adapters": instance.map(|i| i.adapters.resident.clone()),
            "weight": b.spec.weight,
            "labels": b.spec.labels,
            "kind": b.kind(),
            "health": b.core_health(),
            "leaving": registry.leaving.contains(b.name()),
            "gateway_in_flight": b.in_flight(),
            "router_load": load,
            "engine": engine,
            "learned": router.learned(b.id),
            // With `kv_events=`: whether the router matches it exactly from its events now.
            // (and its replay endpoint, only when it has one).
            "kv_events": b.spec.kv_events.as_ref().map(|endpoint| {
                let mut kv = json!({
                    "endpoint": endpoint,
                    "exact": router.is_exact(b.id),
                });
                if let Some(replay) = &b.spec.kv_events_replay {
                    kv["replay"] = json!(replay);
                }
                kv
            }),
        }));
    }
    let pending: Vec<&String> = registry.pending.keys().collect();
    let mut body = json!({
        "policy": router.policy_name(),
        "router_in_flight": router.in_flight_len(),
        // How much of its `max_tokens` an answer uses, measured: it prices the KV reserved.
        "output_share": router.output_share(),
        // What an adapter load is priced at: learned once one was measured.
        "adapter_load_s": router.adapter_load_s(),
        // Observed first tokens against the estimate's wait and prefill: what each estimated
        // second has been worth (1 until the fit is trusted), and the factor `cost` prices a
        // hit's saved prefill at (1 unless `cost.calibrate_prefill`).
        "ttft_calibration": router.ttft_calibration(),
        // Both TTFT predictions' recent errors; the better is the one reported.
        "ttft_prediction": router.prediction_choice(),
        "prefill_factor": router.prefill_factor(),
        "admission_queue": gw.admission.len(),
        "backends": backends,
        "pending_discovery": pending,
    });
    drop(registry);
    // Replica sync (`--peer`): this replica's shared requests and those it holds for its peers.
    if let Some(peers) = &gw.peers {
        body["peers"] = json!({
            "urls": peers.urls().iter().map(ToString::to_string).collect::<Vec<_>>(),
            "shared_in_flight": peers.live_ids().len(),
            "held_for_peers": peers.held(),
        });
    }
    with_id(axum::Json(body).into_response(), id)
}

fn set_draining(gw: &Gateway, headers: &HeaderMap, name: PathArg, on: bool) -> Response {
    let id = echo_id(gw, headers);
    if let Err(e) = check(gw, headers) {
        return proxy::reject(gw, e, &id);
    }
    // After the token check: a caller without it learns nothing, not even about the path.
    let name = match name {
        Ok(Path(name)) => name,
        Err(e) => return proxy::reject(gw, ApiError::bad_path(e.body_text()), &id),
    };
    let name = name.as_str();
    let backend = gw.registry.lock().by_name.get(name).cloned();
    let Some(backend) = backend else {
        return proxy::reject(gw, ApiError::unknown_backend(name), &id);
    };
    backend.set_draining(on);
    gw.sync_health(&backend);
    tracing::info!(backend = name, draining = on, "admin drain");
    let body = json!({
        "backend": name,
        "draining": on,
        "in_flight": backend.in_flight(),
    });
    with_id(axum::Json(body).into_response(), id)
}

/// `POST /admin/drain/{name}`: the backend takes no new requests (in-flight ones finish).
pub async fn drain(State(gw): Shared, name: PathArg, headers: HeaderMap) -> Response {
    set_draining(&gw, &headers, name, true)
}

/// `POST /admin/undrain/{name}`: the backend takes requests again.
pub async fn undrain(State(gw): Shared, name: PathArg, headers: HeaderMap) -> Response {
    set_draining(&gw, &headers, name, false)
}

#[derive(Deserialize)]
struct PolicyBody {
    policy: String,
}

/// `POST /admin/policy {"policy": NAME}`: switches the routing policy at runtime.
pub async fn policy(State(gw): Shared, headers: HeaderMap, body: Bytes) -> Response {
    let id = echo_id(&gw, &headers);
    if let Err(e) = check(&gw, &headers) {
        return proxy::reject(&gw, e, &id);
    }
    let wanted: PolicyBody = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return proxy::reject(&gw, ApiError::malformed(e), &id),
    };
    let result = gw.registry.lock().router.set_policy(&wanted.policy);
    match result {
        Ok(()) => {
            tracing::info!(policy = %wanted.policy, "policy switched");
            let body: Value = json!({"policy": wanted.policy});
            with_id(axum::Json(body).into_response(), id)
        }
        Err(e) => proxy::reject(&gw, ApiError::bad_admin(e.reason), &id),
    }
}

/// `POST /admin/peer-sync`: a batch of another replica's decisions and outcomes
/// ([`crate::peers`]); answers how many were applied and ignored.
pub async fn peer_sync(State(gw): Shared, headers: HeaderMap, body: Bytes) -> Response {
    let id = echo_id(&gw, &headers);
    if let Err(e) = check(&gw, &headers) {
        return proxy::reject(&gw, e, &id);
    }
    let Some(peers) = gw.peers.as_ref() else {
        let e = ApiError::bad_admin("replica sync is off: start the gateway with --peer");
        return proxy::reject(&gw, e, &id);
    };
    match crate::peer_sync::receive(&gw, peers, &body) {
        Ok((applied, ignored)) => {
            gw.metrics.peer_messages("applied", applied);
            gw.metrics.peer_messages("ignored", ignored);
            let body: Value = json!({"applied": applied, "ignored": ignored});
            with_id(axum::Json(body).into_response(), id)
        }
        Err(e) => proxy::reject(&gw, ApiError::malformed(e), &id),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn token_comparison() {
        assert!(super::same(b"abc", b"abc"));
        assert!(!super::same(b"abc", b"abd"));
        assert!(!super::same(b"abc", b"ab"));
    }
}
