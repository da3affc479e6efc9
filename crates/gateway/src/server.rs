//! The HTTP surface: OpenAI endpoints, models, health, metrics, admin, the dashboard, and
//! OpenAI-shaped 404s, and the server loop ([`serve`]) that answers them.

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::admin;
use crate::bare_errors::ShapedErrors;
use crate::dashboard;
use crate::drain::{self, Activity};
use crate::error::ApiError;
use crate::proxy::{self, Endpoint};
use crate::state::Gateway;

pub use crate::proxy::{echo_id, with_id, Shared};

/// Every route.
pub fn app(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .merge(ops_routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(gw)
}

/// Health, metrics, admin and the dashboard: part of [`app`], and all a driver whose requests arrive another
/// way serves (the Envoy endpoint picker's metrics port, [`ops_app`]).
fn ops_routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/admin/fleet", get(admin::fleet))
        .route("/admin/drain/{name}", post(admin::drain))
        .route("/admin/undrain/{name}", post(admin::undrain))
        .route("/admin/policy", post(admin::policy))
        // A batch carries whole request bodies.
        .route(
            "/admin/peer-sync",
            post(admin::peer_sync).layer(axum::extract::DefaultBodyLimit::max(64 << 20)),
        )
        .route("/dashboard", get(dashboard::page))
        .route("/dashboard/snapshot", get(dashboard::snapshot_json))
        .route("/dashboard/events", get(dashboard::events))
}

/// The operations routes alone (health, metrics, admin), for a driver whose requests arrive
/// another way (the Envoy endpoint picker's metrics port).
pub fn ops_app(gw: Arc<Gateway>) -> Router {
    ops_routes()
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(gw)
}

/// The OpenAI endpoint a request is for, if it is one (`POST` on its exact path): the same
/// routes [`app`] has, answered without going through axum's router.
fn openai_endpoint(request: &http::Request<Incoming>) -> Option<Endpoint> {
    if request.method() != Method::POST {
        return None;
    }
    match request.uri().path() {
        "/v1/chat/completions" => Some(Endpoint::Chat),
        "/v1/completions" => Some(Endpoint::Completions),
        "/v1/embeddings" => Some(Endpoint::Embeddings),
        _ => None,
    }
}

/// Serves HTTP/1.1 on `listener` until `shutdown` resolves, then stops accepting and waits for
/// the open connections to finish their requests (as `axum::serve(..).with_graceful_shutdown`
/// does). Accepted connections get `TCP_NODELAY` (small SSE chunks must not wait for Nagle).
///
/// The OpenAI endpoints go straight to [`proxy::handle`] on the connection's task; everything
/// else goes through [`app`]. Taking the hot path out of axum's router saves its per-request
/// route lookup, service clone, boxed future (a copy of the whole request future) and body
/// boxing: a few percent of the gateway's CPU per proxied request.
pub async fn serve(
    listener: TcpListener,
    gw: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = TowerToHyperService::new(app(gw.clone()));
    let (signal_tx, signal_rx) = watch::channel(());
    tokio::spawn(async move {
        shutdown.await;
        drop(signal_rx);
    });
    // Every connection task holds a receiver: all dropped = all connections done.
    let (close_tx, close_rx) = watch::channel(());
    let open = Arc::new(AtomicUsize::new(0));
    let header_timeout = Some(gw.settings.header_read_timeout).filter(|d| !d.is_zero());
    loop {
        let stream = tokio::select! {
            stream = accept(&listener) => stream,
            _ = signal_tx.closed() => break,
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!("set_nodelay: {e}");
        }
        let Some(slot) = ConnectionSlot::take(&open, gw.settings.max_connections) else {
            // Past the cap: a clear answer and the door closed, not a silent hang while the
            // process runs out of file descriptors.
            gw.metrics.connections_refused.inc();
            tokio::spawn(refuse_connection(stream));
            continue;
        };
        let gw = gw.clone();
        let router = router.clone();
        let signal_tx = signal_tx.clone();
        let close_rx = close_rx.clone();
        tokio::spawn(async move {
            let activity = Arc::new(Activity::default());
            let requests = activity.clone();
            let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                let gw = gw.clone();
                let router = router.clone();
                let guard = requests.begin();
                async move {
                    let response = match openai_endpoint(&request) {
                        Some(endpoint) => proxy::handle(gw.clone(), endpoint, request).await,
                        None => match hyper::service::Service::call(&router, request).await {
                            Ok(response) => response,
                            Err(never) => match never {},
                        },
                    };
                    Ok::<Response, Infallible>(drain::track(response, guard, gw.is_shutting_down()))
                }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(ShapedErrors::new(TokioIo::new(stream)), service)
                .with_upgrades();
            let mut connection = pin!(connection);
            let mut signal = pin!(signal_tx.closed());
            let mut quiet = pin!(activity.quiet());
            let (mut draining, mut closing) = (false, false);
            loop {
                tokio::select! {
                    result = connection.as_mut() => {
                        if let Err(e) = result {
                            tracing::trace!("connection: {e}");
                        }
                        break;
                    }
                    _ = &mut signal, if !draining => draining = true,
                    // Closed only when no request of the client's can be on its way (see
                    // `drain`); responses meanwhile carry `Connection: close`.
                    _ = &mut quiet, if draining && !closing => {
                        closing = true;
                        connection.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(close_rx);
            drop(slot);
        });
    }
    drop(close_rx);
    drop(listener);
    close_tx.closed().await;
    Ok(())
}

/// One open client connection, counted against `--max-connections` until dropped.
struct ConnectionSlot(Arc<AtomicUsize>);

impl ConnectionSlot {
    fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        let before = open.fetch_add(1, Ordering::AcqRel);
        if max > 0 && before >= max {
            open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(ConnectionSlot(open.clone()))
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Answers a connection over the cap with 503 `too_many_connections` and closes it, without
/// reading its request (at most a second is spent on it).
async fn refuse_connection(mut stream: TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = ApiError::too_many_connections().body();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(&body).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// The next connection; errors that concern one connection are skipped, others (out of file
/// descriptors...) are logged and retried after a second, as axum's and hyper's servers do.
async fn accept(listener: &TcpListener) -> TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => return stream,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                ) => {}
            Err(e) => {
                tracing::error!("accept error: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
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

/// `GET /v1/models`: the union of the fleet's base models and adapters (with `parent`), and the
/// model aliases whose target is served (`root` = the target).
async fn models(State(gw): Shared, headers: HeaderMap) -> Response {
    let id = echo_id(&gw, &headers);
    if !proxy::authorised(&gw, &headers) {
        return proxy::reject(&gw, ApiError::unauthorized(), &id);
    }
    let listing = gw.registry.lock().listing();
    let data: Vec<_> = listing
        .into_iter()
        .map(|(name, (root, parent))| {
            json!({
                "id": name,
                "object": "model",
                "created": gw.started_unix(),
                "owned_by": "switchyard",
                "root": root,
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
        let registry = gw.registry.lock();
        let healthy = registry
            .by_name
            .values()
            .filter(|b| b.core_health() == switchyard_core::Health::Healthy)
            .count();
        (registry.by_name.len(), healthy)
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
    gw.metrics
        .body_memory
        .set(i64::try_from(gw.body_budget.held_bytes()).unwrap_or(i64::MAX));
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
