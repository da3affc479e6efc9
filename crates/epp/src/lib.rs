//! `switchyard epp`: the routing core as the endpoint picker of an Envoy-based gateway (the
//! Gateway API Inference Extension's protocol). Envoy streams each request to it over
//! `ext_proc`; it buffers the body, routes with the same core, admission queue and fleet
//! tracking as `serve`, and answers with the picked endpoints
//! (`x-gateway-destination-endpoint`, header and `envoy.lb` metadata); it then watches the
//! response as it passes to learn first token and usage.
//!
//! Where things happen: the gRPC service in [`service`], one request's exchange in
//! [`exchange`], the messages sent back in [`messages`]. The fleet (backends, health checks,
//! scrapes, the fleet file) is the gateway's ([`switchyard_gateway::launch`]); on Kubernetes
//! [`discovery`] keeps it in step with an `InferencePool`.
#![warn(missing_docs)]

pub mod discovery;
pub mod exchange;
pub mod messages;
pub mod service;
pub mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use switchyard_gateway::{launch, server, Fleet, Gateway, GatewayError, Settings};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::server::TcpIncoming;

pub use exchange::BodyWatch;
use service::Picker;

/// The gRPC service name Envoy's health checks and the GIE conventions use.
pub const SERVICE_NAME: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// What `switchyard epp` runs with.
#[derive(Debug, Clone)]
pub struct EppSettings {
    /// The fleet and routing settings (`listen` is not used).
    pub gateway: Settings,
    /// The ext_proc gRPC address (GIE convention: port 9002).
    pub grpc: SocketAddr,
    /// The gRPC health address (`grpc.health.v1`, GIE convention: port 9003).
    pub grpc_health: SocketAddr,
    /// Prometheus metrics, health and admin over HTTP (GIE convention: port 9090).
    pub metrics: SocketAddr,
    /// Whether Envoy sends response bodies (see [`BodyWatch`]).
    pub bodies: BodyWatch,
    /// The `InferencePool` to discover the fleet from (instead of backends and a fleet file).
    pub pool: Option<discovery::PoolSettings>,
    /// TLS on the ext_proc port (none: plaintext HTTP/2).
    pub tls: Option<tls::TlsSettings>,
}

/// Why the picker could not start or stopped.
#[derive(Debug, Error)]
pub enum EppError {
    /// The fleet could not be set up.
    #[error(transparent)]
    Gateway(#[from] GatewayError),
    /// Could not bind one of the ports.
    #[error("bind {addr}: {source}")]
    Bind {
        /// Address tried.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Kubernetes discovery could not start.
    #[error(transparent)]
    Discovery(#[from] discovery::DiscoveryError),
    /// A server stopped with an error.
    #[error("serve: {0}")]
    Serve(String),
    /// The ext_proc port's TLS could not be set up.
    #[error("TLS: {0}")]
    Tls(String),
}

/// A started picker.
pub struct RunningEpp {
    /// The bound ext_proc address.
    pub grpc_addr: SocketAddr,
    /// The bound gRPC health address.
    pub health_addr: SocketAddr,
    /// The bound metrics address.
    pub metrics_addr: SocketAddr,
    /// Shared state (fleet, router, metrics).
    pub gateway: Arc<Gateway>,
    _fleet: Fleet,
    stop: watch::Sender<bool>,
    health: tonic_health::server::HealthReporter,
    tasks: Vec<JoinHandle<Result<(), EppError>>>,
    /// The replica-sync senders and sweep (`--peer`), stopped at shutdown.
    peers: Vec<JoinHandle<()>>,
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, EppError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| EppError::Bind { addr, source })
}

fn local(l: &TcpListener, addr: SocketAddr) -> Result<SocketAddr, EppError> {
    l.local_addr()
        .map_err(|source| EppError::Bind { addr, source })
}

/// Sets up the fleet, binds the three ports and starts serving.
pub async fn start(settings: EppSettings) -> Result<RunningEpp, EppError> {
    // The API client first: a bad kubeconfig is reported before any port is taken.
    let kube = match &settings.pool {
        Some(pool) => Some((discovery::client(pool).await?, pool.clone())),
        None => None,
    };
    let fleet = launch(settings.gateway)?;
    let gw = fleet.gateway.clone();
    let grpc = bind(settings.grpc).await?;
    let health = bind(settings.grpc_health).await?;
    let metrics = bind(settings.metrics).await?;
    let (grpc_addr, health_addr, metrics_addr) = (
        local(&grpc, settings.grpc)?,
        local(&health, settings.grpc_health)?,
        local(&metrics, settings.metrics)?,
    );
    let (stop, stopped) = watch::channel(false);
    let until_stopped = move || {
        let mut rx = stopped.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };

    let (reporter, health_service) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<ExternalProcessorServer<Picker>>()
        .await;
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;

    let picker = ExternalProcessorServer::new(Picker::new(gw.clone(), settings.bodies))
        // A request body is buffered whole before routing; Envoy sends it in pieces, but the
        // answer carries it back in chunks of at most `messages::MAX_CHUNK`.
        .max_decoding_message_size(64 << 20);
    let mut tasks = Vec::new();
    if let Some((client, pool)) = kube {
        let shutdown = until_stopped();
        let gw = gw.clone();
        tasks.push(tokio::spawn(async move {
            discovery::watch::run(gw, client, pool, shutdown).await;
            Ok(())
        }));
    }
    let shutdown = until_stopped();
    let mut grpc_server = tonic::transport::Server::builder();
    if let Some(tls) = &settings.tls {
        grpc_server = grpc_server
            .tls_config(tls::server_config(tls)?)
            .map_err(|e| EppError::Tls(e.to_string()))?;
    }
    tasks.push(tokio::spawn(async move {
        grpc_server
            .add_service(picker)
            // Small messages both ways on one connection: Nagle would hold each answer back.
            .serve_with_incoming_shutdown(
                TcpIncoming::from(grpc).with_nodelay(Some(true)),
                shutdown,
            )
            .await
            .map_err(|e| EppError::Serve(format!("ext_proc: {e}")))
    }));
    let shutdown = until_stopped();
    tasks.push(tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(health_service)
            .serve_with_incoming_shutdown(TcpListenerStream::new(health), shutdown)
            .await
            .map_err(|e| EppError::Serve(format!("health: {e}")))
    }));
    let shutdown = until_stopped();
    let ops = server::ops_app(gw.clone());
    tasks.push(tokio::spawn(async move {
        axum::serve(metrics, ops)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(|e| EppError::Serve(format!("metrics: {e}")))
    }));
    let peers = switchyard_gateway::peer_sync::spawn(&gw);
    Ok(RunningEpp {
        peers,
        grpc_addr,
        health_addr,
        metrics_addr,
        gateway: gw,
        _fleet: fleet,
        stop,
        health: reporter,
        tasks,
    })
}

impl RunningEpp {
    /// Serves until `signal`, then reports not serving, stops accepting, and lets requests in
    /// flight finish for at most the drain timeout.
    pub async fn run_until(self, signal: impl Future<Output = ()>) -> Result<(), EppError> {
        signal.await;
        let grace = self.gateway.settings.drain_timeout;
        tracing::info!("shutting down: draining in-flight requests for up to {grace:?}");
        self.shutdown_within(grace).await
    }

    /// Shuts down now, waiting at most `grace` for requests in flight.
    pub async fn shutdown_within(self, grace: Duration) -> Result<(), EppError> {
        self.gateway.begin_shutdown();
        self.health
            .set_not_serving::<ExternalProcessorServer<Picker>>()
            .await;
        self.health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let _ = self.stop.send(true);
        for task in &self.peers {
            task.abort();
        }
        let all = futures_join(self.tasks);
        match tokio::time::timeout(grace, all).await {
            Ok(result) => result,
            Err(_) => {
                tracing::warn!("drain timeout: cutting the remaining streams");
                Ok(())
            }
        }
    }
}

/// Waits for every task; the first error wins.
async fn futures_join(tasks: Vec<JoinHandle<Result<(), EppError>>>) -> Result<(), EppError> {
    let mut first = Ok(());
    for t in tasks {
        let r = match t.await {
            Ok(r) => r,
            Err(e) => Err(EppError::Serve(e.to_string())),
        };
        if first.is_ok() {
            first = r;
        }
    }
    first
}
