//! The HTTP server: shared state, routes, startup and graceful shutdown.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use switchyard_engine::{Engine, EngineConfig};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::error::ApiError;
use crate::kv_events::{self, KvEventsError, PublisherConfig};
use crate::metrics::Metrics;
use crate::pd::Advertised;
use crate::runner;
use crate::{generate, info, sglang};

/// Everything needed to run one emulated engine server.
#[derive(Debug, Clone)]
pub struct EmulatorConfig {
    /// Address to listen on.
    pub host: String,
    /// Port (0 = ephemeral).
    pub port: u16,
    /// The engine model's configuration; `model_name` is the served name.
    pub engine: EngineConfig,
    /// Virtual seconds per wall second.
    pub speed: f64,
    /// Answer at once, bypassing the engine's timing.
    pub instant: bool,
    /// Adapters known at startup: (name, path).
    pub lora_modules: Vec<(String, String)>,
    /// Publish KV events over ZeroMQ.
    pub kv_events: Option<PublisherConfig>,
    /// Seed for ids and instant-mode output.
    pub seed: u64,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Tokenize the chat template's markers as special tokens
    /// ([`crate::chat_template::encode`]).
    pub special_tokens: bool,
}

/// Errors starting the server.
#[derive(Debug, Error)]
pub enum ServerError {
    /// The engine configuration was rejected.
    #[error("engine config: {0}")]
    Engine(String),
    /// Could not bind the HTTP listener.
    #[error("bind {addr}: {source}")]
    Bind {
        /// Address tried.
        addr: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// KV event publisher failed.
    #[error(transparent)]
    KvEvents(#[from] KvEventsError),
    /// The server stopped with an I/O error.
    #[error("serve: {0}")]
    Serve(std::io::Error),
}

pub use crate::state::{AppState, SharedState};

/// Build the router with every endpoint.
pub fn router(state: SharedState, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/completions", post(generate::completions))
        .route("/v1/chat/completions", post(generate::chat_completions))
        .route("/v1/completions/render", post(info::render_completion))
        .route("/v1/chat/completions/render", post(info::render_chat))
        .route("/v1/models", get(info::models))
        .route("/health", get(info::health))
        .route("/ping", get(info::health))
        .route("/version", get(info::version))
        .route("/metrics", get(info::metrics))
        .route("/v1/load_lora_adapter", post(info::load_lora))
        .route("/v1/unload_lora_adapter", post(info::unload_lora))
        .route("/tokenize", post(info::tokenize))
        .route("/detokenize", post(info::detokenize))
        .route("/health_generate", get(sglang::health_generate))
        .route("/get_server_info", get(sglang::server_info))
        .route("/server_info", get(sglang::server_info))
        .route("/get_model_info", get(sglang::model_info))
        .route("/model_info", get(sglang::model_info))
        .route("/get_load", get(sglang::get_load))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

async fn not_found() -> impl IntoResponse {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "Not Found".to_string(),
        param: None,
    }
}

/// A started server.
#[derive(Debug)]
pub struct RunningServer {
    /// The bound HTTP address.
    pub addr: SocketAddr,
    /// The resolved KV-events endpoint when the publisher bound one.
    pub kv_events_endpoint: Option<String>,
    /// The resolved KV-events replay endpoint, when replay is on.
    pub kv_events_replay_endpoint: Option<String>,
    /// Shared state (for in-process users such as the fidelity check).
    pub state: SharedState,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServerError>>,
}

impl RunningServer {
    /// Stop accepting, finish in-flight responses, and wait.
    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.wait().await
    }

    /// Wait until the server stops.
    pub async fn wait(self) -> Result<(), ServerError> {
        flatten(self.task.await)
    }

    /// Serve until `signal` resolves, then shut down gracefully, giving
    /// in-flight responses at most `grace` to finish.
    pub async fn run_until(
        mut self,
        signal: impl std::future::Future<Output = ()>,
        grace: std::time::Duration,
    ) -> Result<(), ServerError> {
        let stop = self.shutdown.take();
        let mut task = self.task;
        tokio::select! {
            r = &mut task => return flatten(r),
            _ = signal => {}
        }
        if let Some(tx) = stop {
            let _ = tx.send(());
        }
        match tokio::time::timeout(grace, &mut task).await {
            Ok(r) => flatten(r),
            Err(_) => {
                // Long streams hold a graceful shutdown open; cut them.
                task.abort();
                Ok(())
            }
        }
    }

    /// Shut down, waiting at most `grace` for in-flight responses.
    pub async fn shutdown_within(self, grace: std::time::Duration) -> Result<(), ServerError> {
        self.run_until(std::future::ready(()), grace).await
    }

    /// Take the trigger that stops the server (for signal handlers).
    pub fn take_shutdown(&mut self) -> Option<oneshot::Sender<()>> {
        self.shutdown.take()
    }
}

fn flatten(r: Result<Result<(), ServerError>, tokio::task::JoinError>) -> Result<(), ServerError> {
    match r {
        Ok(r) => r,
        Err(e) => Err(ServerError::Serve(std::io::Error::other(e.to_string()))),
    }
}

/// Bind, start the engine task and serve until shut down.
pub async fn start(cfg: EmulatorConfig) -> Result<RunningServer, ServerError> {
    let listener = TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|source| ServerError::Bind {
            addr: format!("{}:{}", cfg.host, cfg.port),
            source,
        })?;
    let addr = listener.local_addr().map_err(ServerError::Serve)?;

    let mut engine_cfg = cfg.engine.clone();
    // The emulator streams per-step tokens and publishes KV events.
    engine_cfg.emit_token_events = true;
    engine_cfg.emit_kv_events = cfg.kv_events.is_some();
    if engine_cfg.engine_id.is_empty() {
        engine_cfg.engine_id = format!("emulator-{}-{}", addr.port(), std::process::id());
    }
    let mut engine =
        Engine::new(engine_cfg.clone()).map_err(|e| ServerError::Engine(e.to_string()))?;
    let mut adapters = BTreeMap::new();
    for (name, path) in &cfg.lora_modules {
        engine.register_adapter(name);
        adapters.insert(name.clone(), path.clone());
    }

    let (kv, kv_endpoints) = match &cfg.kv_events {
        Some(kc) => {
            let (p, ep) = kv_events::start(kc.clone()).await?;
            (Some(p), ep)
        }
        None => (None, kv_events::Endpoints::default()),
    };

    let metrics = Arc::new(Metrics::new(&engine_cfg.model_name, "0"));
    let handle =
        runner::spawn(engine, cfg.speed, metrics.clone(), kv).map_err(ServerError::Serve)?;
    let advertised_host = if addr.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        addr.ip().to_string()
    };
    let state = Arc::new(AppState {
        model: engine_cfg.model_name.clone(),
        engine_cfg,
        engine: handle,
        metrics,
        adapters: RwLock::new(adapters),
        instant: cfg.instant,
        special_tokens: cfg.special_tokens,
        created: kv_events::unix_now() as u64,
        advertised: Advertised {
            host: advertised_host,
            port: addr.port(),
        },
        seed: cfg.seed,
        seq: AtomicU64::new(0),
    });
    let app = router(state.clone(), cfg.max_body_bytes);
    let (tx, rx) = oneshot::channel::<()>();
    // Without TCP_NODELAY, Nagle plus delayed ACKs hold small SSE chunks
    // back by ~40 ms, which would swamp the modelled token timing.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("set_nodelay: {e}");
        }
    });
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await
            .map_err(ServerError::Serve)
    });
    Ok(RunningServer {
        addr,
        kv_events_endpoint: kv_endpoints.events,
        kv_events_replay_endpoint: kv_endpoints.replay,
        state,
        shutdown: Some(tx),
        task,
    })
}
