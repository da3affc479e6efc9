//! The HTTP surface: OpenAI endpoints, models, health, metrics, admin, and OpenAI-shaped 404s.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;

use crate::admin;
use crate::errors::ApiError;
use crate::proxy::{self, Endpoint, REQUEST_ID};
use crate::state::Gateway;

/// Shared state as handlers receive it.
pub type Shared = State<Arc<Gateway>>;

/// Every route.
pub fn app(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/admin/fleet", get(admin::fleet))
        .route("/admin/drain/{name}", post(admin::drain))
        .route("/admin/undrain/{name}", post(admin::undrain))
        .route("/admin/policy", post(admin::policy))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(gw)
}

async fn completions(State(gw): Shared, request: Request) -> Response {
    proxy::handle(gw, Endpoint::Completions, request).await
}

async fn chat(State(gw): Shared, request: Request) -> Response {
    proxy::handle(gw, Endpoint::Chat, request).await
}

async fn embeddings(State(gw): Shared, request: Request) -> Response {
    proxy::handle(gw, Endpoint::Embeddings, request).await
}

/// The request id to echo on endpoints that do not proxy.
pub fn echo_id(gw: &Gateway, headers: &HeaderMap) -> HeaderValue {
    let rid = gw.next_request();
    proxy::request_id(gw, headers, rid)
}

/// Adds the request id to a response.
pub fn with_id(mut response: Response, id: HeaderValue) -> Response {
    response.headers_mut().insert(REQUEST_ID.clone(), id);
    response
}

/// `GET /v1/models`: the union of the fleet's base models and adapters (with `parent`).
async fn models(State(gw): Shared, headers: HeaderMap) -> Response {
    let id = echo_id(&gw, &headers);
    if !proxy::authorised(&gw, &headers) {
        return proxy::reject(&gw, ApiError::unauthorized(), &id);
    }
    let catalog = gw.brain.lock().catalog();
    let data: Vec<_> = catalog
        .into_iter()
        .map(|(name, parent)| {
            json!({
                "id": name,
                "object": "model",
                "created": gw.started_unix(),
                "owned_by": "switchyard",
                "root": name,
                "parent": parent,
            })
        })
        .collect();
    with_id(
        axum::Json(json!({"object": "list", "data": data})).into_response(),
        id,
    )
}

/// `GET /health`: 200 while some backend takes traffic, else 503 (and 503 once shutting down).
async fn health(State(gw): Shared) -> Response {
    let (total, healthy) = {
        let brain = gw.brain.lock();
        let healthy = brain
            .by_name
            .values()
            .filter(|b| b.core_health() == switchyard_core::Health::Healthy)
            .count();
        (brain.by_name.len(), healthy)
    };
    let ok = healthy > 0 && !gw.is_shutting_down();
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if ok { "ok" } else { "unavailable" },
        "backends": total,
        "healthy_backends": healthy,
    });
    (status, axum::Json(body)).into_response()
}

/// `GET /metrics`: the gateway's own metrics.
async fn metrics(State(gw): Shared) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        gw.metrics.render(),
    )
        .into_response()
}

async fn not_found(State(gw): Shared, request: Request) -> Response {
    let id = echo_id(&gw, request.headers());
    proxy::reject(&gw, ApiError::no_route(request.uri().path()), &id)
}

async fn method_not_allowed(State(gw): Shared, request: Request) -> Response {
    let id = echo_id(&gw, request.headers());
    proxy::reject(&gw, ApiError::method_not_allowed(), &id)
}
