//! The Switchyard gateway: an OpenAI-compatible HTTP router in front of a fleet of inference
//! engines, driving the routing core (`switchyard_core`).
//!
//! Where things happen:
//! * a request is read and parsed in [`parse`], routed in [`proxy`], sent in [`forward`]
//!   (candidates in turn, timeouts, failures held against engines), and its response watched on the way back in [`stream`] (first token, usage,
//!   client disconnect);
//! * saturated requests wait in [`admission`]; disaggregated ones (prefill and decode on
//!   different instances) are orchestrated in [`pd`];
//! * backends are described in [`backends`] and [`config`], join and leave in [`membership`]
//!   (models found by [`discovery`], fleet file reloads in [`watch`]);
//! * engines are scraped in [`scrape`] (Prometheus text parsed by [`promtext`]) and checked in
//!   [`health`]; their KV events are subscribed to in [`kv_events`]; text prompts are
//!   tokenized for exact matching in [`tokenize`]; LoRA adapters are loaded and unloaded by demand in [`adapter_loader`];
//! * a request's `model` is resolved (aliases, adapters, the single-model fallback) in
//!   `switchyard_core::models`;
//! * HTTP routes are in [`server`] and [`admin`], errors in [`error`], the gateway's own
//!   metrics in [`metrics`]; the shared state and the router lock in [`state`].
//!
//! The router is held in a mutex only for `route` / `observe`, never across an await.
#![warn(missing_docs)]

pub mod adapter_loader;
pub mod admin;
pub mod admission;
pub mod backends;
pub mod bare_errors;
pub mod body_budget;
pub mod config;
pub mod dashboard;
pub mod discovery;
pub mod drain;
pub mod error;
pub mod forward;
pub mod health;
mod json;
pub mod kv_events;
pub mod live;
pub mod membership;
pub mod metrics;
pub mod parse;
pub mod pd;
pub mod peer_dns;
pub mod peer_sync;
pub mod peers;
pub mod promtext;
pub mod proxy;
pub mod scrape;
pub mod server;
pub mod state;
pub mod stream;
pub mod tokenize;
pub mod upstream;
pub mod watch;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use switchyard_core::Router;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use backends::{BackendSpec, EngineKind};
pub use config::Settings;
pub use state::Gateway;

/// Why the gateway could not start or stopped.
#[derive(Debug, Error)]
pub enum GatewayError {
    /// Settings, router settings or the fleet file are unusable.
    #[error("{0}")]
    Config(String),
    /// Could not bind the listener.
    #[error("bind {addr}: {source}")]
    Bind {
        /// Address tried.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Could not watch the fleet file.
    #[error("watch fleet file: {0}")]
    Watch(#[from] notify::Error),
    /// The server stopped with an I/O error.
    #[error("serve: {0}")]
    Serve(std::io::Error),
}

/// A started gateway.
pub struct RunningGateway {
    /// The bound address.
    pub addr: SocketAddr,
    /// Shared state (fleet, router, metrics).
    pub gateway: Arc<Gateway>,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), GatewayError>>,
    _watcher: Option<watch::FleetWatcher>,
    /// The dynamic adapter placement task, stopped at shutdown.
    placement: Option<JoinHandle<()>>,
    /// The replica-sync senders and sweep (`--peer`) and the `--peer-dns` resolver, stopped at
    /// shutdown.
    peers: Vec<JoinHandle<()>>,
}

/// The fleet side of a gateway, without a listener: the router with the configured backends
/// (health checks and scrapes running), the fleet file watched. `serve` and `epp` both start
/// from it.
pub struct Fleet {
    /// Shared state (fleet, router, metrics).
    pub gateway: Arc<Gateway>,
    /// Keeps the fleet file watched while alive.
    pub watcher: Option<watch::FleetWatcher>,
}

/// Builds the router and adds the configured backends (and the fleet file's).
pub fn launch(settings: Settings) -> Result<Fleet, GatewayError> {
    let router =
        Router::new(settings.router.clone()).map_err(|e| GatewayError::Config(e.to_string()))?;
    let file = match &settings.fleet_file {
        Some(path) => {
            Some(config::load_fleet_file(path).map_err(|e| GatewayError::Config(e.to_string()))?)
        }
        None => None,
    };
    let no_aliases = Default::default();
    let aliases = switchyard_core::models::merge_aliases(
        &settings.model_aliases,
        file.as_ref().map_or(&no_aliases, |f| &f.model_aliases),
    )
    .map_err(|e| match &settings.fleet_file {
        Some(path) => GatewayError::Config(format!("{}: {e}", path.display())),
        None => GatewayError::Config(e),
    })?;
    let mut all: Vec<BackendSpec> = settings.backends.clone();
    all.extend(file.iter().flat_map(|f| f.backends.iter().cloned()));
    backends::check_unique(&all).map_err(|e| GatewayError::Config(e.to_string()))?;
    let tokenizers =
        tokenize::Tokenizers::load_with_cache(&settings.tokenizers, settings.tokenizer_cache_bytes)
            .map_err(|e| GatewayError::Config(e.to_string()))?;
    let gw = Gateway::with_tokenizers(settings, router, tokenizers);
    gw.registry.lock().set_aliases(aliases);
    for spec in gw.settings.backends.clone() {
        membership::add(&gw, spec);
    }
    let watcher = match (&gw.settings.fleet_file, file) {
        (Some(path), Some(file)) => {
            membership::apply_file(&gw, file.backends);
            Some(watch::watch(gw.clone(), path.clone())?)
        }
        _ => None,
    };
    Ok(Fleet {
        gateway: gw,
        watcher,
    })
}

/// Builds the router, adds the configured backends, binds and starts serving.
pub async fn start(settings: Settings) -> Result<RunningGateway, GatewayError> {
    let listen = settings.listen;
    // Settings and the fleet file are checked before the port is taken.
    let Fleet {
        gateway: gw,
        watcher,
    } = launch(settings)?;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| GatewayError::Bind {
            addr: listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(GatewayError::Serve)?;

    let (tx, rx) = oneshot::channel::<()>();
    let serving = gw.clone();
    let task = tokio::spawn(async move {
        server::serve(listener, serving, async move {
            let _ = rx.await;
        })
        .await
        .map_err(GatewayError::Serve)
    });
    let placement = gw
        .settings
        .router
        .placement
        .enabled
        .then(|| tokio::spawn(adapter_loader::run(gw.clone())));
    let mut peers = peer_sync::spawn(&gw);
    peers.extend(peer_dns::spawn(&gw, addr));
    Ok(RunningGateway {
        addr,
        gateway: gw,
        shutdown: Some(tx),
        task,
        _watcher: watcher,
        placement,
        peers,
    })
}

impl RunningGateway {
    /// Serves until `signal`, then stops accepting and lets in-flight responses finish for at
    /// most the drain timeout.
    pub async fn run_until(
        mut self,
        signal: impl std::future::Future<Output = ()>,
    ) -> Result<(), GatewayError> {
        let stop = self.shutdown.take();
        let grace = self.gateway.settings.drain_timeout;
        tokio::select! {
            r = &mut self.task => return flatten(r),
            _ = signal => {}
        }
        tracing::info!("shutting down: draining in-flight requests for up to {grace:?}");
        self.gateway.begin_shutdown();
        self.stop_placement();
        if let Some(tx) = stop {
            let _ = tx.send(());
        }
        match tokio::time::timeout(grace, &mut self.task).await {
            Ok(r) => flatten(r),
            Err(_) => {
                tracing::warn!("drain timeout: cutting the remaining responses");
                self.task.abort();
                Ok(())
            }
        }
    }

    /// Shuts down now, waiting at most `grace` for in-flight responses.
    pub async fn shutdown_within(mut self, grace: Duration) -> Result<(), GatewayError> {
        self.gateway.begin_shutdown();
        self.stop_placement();
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match tokio::time::timeout(grace, &mut self.task).await {
            Ok(r) => flatten(r),
            Err(_) => {
                self.task.abort();
                Ok(())
            }
        }
    }
}

impl RunningGateway {
    /// Stops the placement task (an action in progress is abandoned; the engine finishes it)
    /// and the replica sync.
    fn stop_placement(&mut self) {
        for task in self.peers.drain(..) {
            task.abort();
        }
        if let Some(task) = self.placement.take() {
            task.abort();
        }
    }
}

impl Drop for RunningGateway {
    fn drop(&mut self) {
        self.stop_placement();
    }
}

fn flatten(
    r: Result<Result<(), GatewayError>, tokio::task::JoinError>,
) -> Result<(), GatewayError> {
    match r {
        Ok(r) => r,
        Err(e) => Err(GatewayError::Serve(std::io::Error::other(e.to_string()))),
    }
}
