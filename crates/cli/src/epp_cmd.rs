//! `switchyard epp`: the routing core as the endpoint picker behind Envoy's external
//! processing (Gateway API Inference Extension).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use switchyard_epp::discovery::mapping::PeerSelector;
use switchyard_epp::discovery::{default_namespace, PoolSettings};
use switchyard_epp::tls::TlsSettings;
use switchyard_epp::{BodyWatch, EppSettings};
use switchyard_gateway::Settings;

use crate::fleet_args::FleetArgs;

/// Whether Envoy sends response bodies to the picker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ResponseBodies {
    /// Envoy sends them (`response_body_mode: FULL_DUPLEX_STREAMED`): first token and usage are
    /// read from them.
    Watch,
    /// Envoy does not (`response_body_mode: NONE`): response headers count as the first byte.
    Skip,
}

/// Flags of `switchyard epp`.
#[derive(Debug, Clone, Args)]
#[command(
    about = "Run the endpoint picker for an Envoy-based gateway (Gateway API Inference Extension)",
    long_about = "Run the endpoint picker: Envoy's ext_proc filter streams each request to it over \
gRPC (envoy.service.ext_proc.v3.ExternalProcessor/Process, body mode FULL_DUPLEX_STREAMED); it \
routes with the same core as `serve` and answers with x-gateway-destination-endpoint (header and \
envoy.lb metadata). Serves gRPC health (grpc.health.v1) on --grpc-health-port and /metrics, \
/health, /admin on --metrics-port. Prints `listening on http://METRICS_ADDR grpc=ADDR health=ADDR` \
on stdout once ready. SIGINT/SIGTERM report NOT_SERVING, stop accepting and let streams finish for \
up to --drain-timeout. See docs/epp.md."
)]
pub struct EppArgs {
    /// Address the three ports bind to.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// ext_proc gRPC port (0: ephemeral).
    #[arg(long, default_value_t = 9002)]
    pub grpc_port: u16,
    /// gRPC health port (grpc.health.v1; 0: ephemeral).
    #[arg(long, default_value_t = 9003)]
    pub grpc_health_port: u16,
    /// Prometheus metrics, /health and /admin over HTTP (0: ephemeral).
    #[arg(long, default_value_t = 9090)]
    pub metrics_port: u16,
    /// Whether Envoy's ext_proc filter sends response bodies (its response_body_mode).
    #[arg(long, value_enum, default_value = "watch")]
    pub response_bodies: ResponseBodies,
    /// Fallback endpoints after the first in x-gateway-destination-endpoint.
    #[arg(long, default_value_t = 2)]
    pub max_fallbacks: u32,
    /// Discover the fleet from this InferencePool (inference.networking.k8s.io/v1) and the
    /// ready pods it selects, instead of --backend / --fleet-file.
    #[arg(long, value_name = "NAME")]
    pub pool_name: Option<String>,
    /// The InferencePool's namespace (default: $NAMESPACE, $POD_NAMESPACE, the service
    /// account's namespace, else `default`).
    #[arg(long, value_name = "NAMESPACE", requires = "pool_name")]
    pub pool_namespace: Option<String>,
    /// Kubeconfig for reaching the API server from outside the cluster (default: $KUBECONFIG
    /// when set, else the in-cluster service account).
    #[arg(long, value_name = "FILE", requires = "pool_name")]
    pub kubeconfig: Option<PathBuf>,
    /// Share decisions with the other pickers: the ready pods of the pool's namespace carrying
    /// these labels (KEY=VALUE[,KEY=VALUE...]), reached on their container port named
    /// `http-metrics` or `metrics` (else --metrics-port), this pod (`$POD_NAME`, else
    /// `$HOSTNAME`) left out.
    /// Needs --admin-token, the same on every picker. See docs/epp.md, "Replicas".
    #[arg(long, value_name = "LABELS", requires = "pool_name")]
    pub peer_selector: Option<String>,
    /// Serve ext_proc over TLS, as GIE's reference picker does by default (with a self-signed
    /// certificate unless --cert-path names one); for Gateways configured to speak TLS to it.
    #[arg(long)]
    pub secure_serving: bool,
    /// Directory holding `tls.crt` and `tls.key` (PEM) for --secure-serving (a Kubernetes TLS
    /// secret mounted as a volume).
    #[arg(long, value_name = "DIR", requires = "secure_serving")]
    pub cert_path: Option<PathBuf>,
    #[command(flatten)]
    pub fleet: FleetArgs,
}

/// The pool to discover, when `--pool-name` is given (which excludes a static fleet).
fn pool(args: &EppArgs) -> Result<Option<PoolSettings>> {
    let Some(name) = &args.pool_name else {
        if args.fleet.backends.is_empty() && args.fleet.fleet_file.is_none() {
            bail!("no backends: give --pool-name NAME (Kubernetes), --backend URL or --fleet-file FILE");
        }
        return Ok(None);
    };
    if !args.fleet.backends.is_empty() || args.fleet.fleet_file.is_some() {
        bail!(
            "--pool-name discovers the fleet from Kubernetes: give it without --backend and \
             --fleet-file (or drop --pool-name to list the backends yourself)"
        );
    }
    if name.is_empty() {
        bail!("--pool-name must not be empty");
    }
    let namespace = match &args.pool_namespace {
        Some(ns) if ns.is_empty() => bail!("--pool-namespace must not be empty"),
        Some(ns) => ns.clone(),
        None => default_namespace(
            |k| std::env::var(k).ok(),
            |p| std::fs::read_to_string(p).ok(),
        ),
    };
    let peers = match &args.peer_selector {
        None => None,
        Some(text) => {
            if args.fleet.admin_token.is_none() {
                bail!("--peer-selector needs --admin-token (the same on every picker): peers sync through /admin/peer-sync");
            }
            let own_name = ["POD_NAME", "HOSTNAME"]
                .into_iter()
                .filter_map(|k| std::env::var(k).ok())
                .map(|v| v.trim().to_string())
                .find(|v| !v.is_empty());
            Some(PeerSelector {
                labels: parse_labels(text)?,
                port: args.metrics_port,
                own_name,
            })
        }
    };
    Ok(Some(PoolSettings {
        name: name.clone(),
        namespace,
        kubeconfig: args.kubeconfig.clone(),
        peers,
    }))
}

/// `KEY=VALUE[,KEY=VALUE...]`, as a label selector's equality terms.
fn parse_labels(text: &str) -> Result<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        match term.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() && !v.trim().is_empty() => {
                labels.insert(k.trim().to_string(), v.trim().to_string());
            }
            _ => bail!("--peer-selector: `{term}` is not KEY=VALUE"),
        }
    }
    if labels.is_empty() {
        bail!("--peer-selector: give at least one KEY=VALUE label");
    }
    Ok(labels)
}

/// The picker's settings from its flags.
pub fn settings(args: &EppArgs) -> Result<EppSettings> {
    let pool = pool(args)?;
    let gateway = Settings {
        max_retries: args.max_fallbacks,
        peer_discovery: pool.as_ref().is_some_and(|p| p.peers.is_some()),
        ..args.fleet.settings(args.fleet.router()?, pool.is_none())?
    };
    Ok(EppSettings {
        gateway,
        grpc: SocketAddr::new(args.host, args.grpc_port),
        grpc_health: SocketAddr::new(args.host, args.grpc_health_port),
        metrics: SocketAddr::new(args.host, args.metrics_port),
        bodies: match args.response_bodies {
            ResponseBodies::Watch => BodyWatch::Watch,
            ResponseBodies::Skip => BodyWatch::Skip,
        },
        pool,
        tls: args.secure_serving.then(|| match &args.cert_path {
            Some(dir) => TlsSettings::Files(dir.clone()),
            None => TlsSettings::SelfSigned,
        }),
    })
}

/// Runs `switchyard epp`.
pub fn run(args: EppArgs) -> Result<()> {
    let settings = settings(&args)?;
    let runtime = args.fleet.runtime()?;
    crate::fleet_args::serve_on(runtime, async move {
        let signal = switchyard_emulator::shutdown_signal()?;
        let epp = switchyard_epp::start(settings).await?;
        let mut out = std::io::stdout().lock();
        // The metrics address first, as `serve` prints its address; the gRPC ports after it.
        writeln!(
            out,
            "listening on http://{} grpc={} health={}",
            epp.metrics_addr, epp.grpc_addr, epp.health_addr
        )?;
        out.flush()?;
        drop(out);
        tracing::info!(grpc = %epp.grpc_addr, "endpoint picker listening");
        epp.run_until(signal).await?;
        tracing::info!("stopped");
        Ok(())
    })
}
