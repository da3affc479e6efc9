//! `switchyard epp`: the routing core as the endpoint picker behind Envoy's external
//! processing (Gateway API Inference Extension).

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use switchyard_core::RouterConfig;
use switchyard_epp::{BodyWatch, EppSettings};
use switchyard_gateway::config::load_router_config;
use switchyard_gateway::{BackendSpec, Settings};

use crate::serve_cmd::{parse_model_aliases, parse_secs};

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
    /// A backend (an endpoint of the pool), as `serve --backend` takes it (repeatable).
    #[arg(long = "backend", value_name = "URL[,key=value...]")]
    pub backends: Vec<String>,
    /// Fleet file with `backends: [...]` (as for `serve`); watched and reloaded on change.
    #[arg(long, value_name = "FILE")]
    pub fleet_file: Option<PathBuf>,
    /// Router settings file (any subset of the keys in docs/core.md).
    #[arg(long, value_name = "FILE")]
    pub router_config: Option<PathBuf>,
    /// Routing policy (overrides the router settings): cost, round-robin, random, least-load,
    /// power-of-two, sglang-cache-aware, dynamo-kv, gie, gie-lora, kubeai-chwbl.
    #[arg(long)]
    pub policy: Option<String>,
    /// Router-side requests in flight at which a backend counts as saturated.
    #[arg(long, value_name = "N")]
    pub max_in_flight: Option<u32>,
    /// Engine-reported waiting requests at which a backend counts as saturated.
    #[arg(long, value_name = "N")]
    pub max_waiting: Option<u32>,
    /// Requests that may wait for capacity when every backend is saturated (0: 429 at once).
    #[arg(long, default_value_t = 256)]
    pub queue_size: usize,
    /// Seconds a request may wait for capacity before 429 with Retry-After.
    #[arg(long, default_value = "10", value_parser = parse_secs)]
    pub queue_timeout: Duration,
    /// Largest request body buffered, in bytes (413 above).
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Fallback endpoints after the first in x-gateway-destination-endpoint.
    #[arg(long, default_value_t = 2)]
    pub max_fallbacks: u32,
    /// Seconds between engine metrics scrapes.
    #[arg(long, default_value = "0.5", value_parser = parse_secs)]
    pub scrape_interval: Duration,
    /// Seconds between active health checks (GET /health).
    #[arg(long, default_value = "2", value_parser = parse_secs)]
    pub health_interval: Duration,
    /// Seconds allowed for one health check, scrape or discovery call.
    #[arg(long, default_value = "2", value_parser = parse_secs)]
    pub probe_timeout: Duration,
    /// Seconds streams in flight may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value = "30", value_parser = parse_secs)]
    pub drain_timeout: Duration,
    /// Token for /admin/* on the metrics port; without it the admin API is disabled.
    #[arg(long, env = "SWITCHYARD_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// A model alias NAME=MODEL (repeatable), as for `serve`.
    #[arg(long = "model-alias", value_name = "NAME=MODEL")]
    pub model_aliases: Vec<String>,
    /// Answer 404 for a model no backend serves even in a single-model fleet.
    #[arg(long)]
    pub strict_models: bool,
    /// Do not add `stream_options.include_usage` to streamed requests that lack it.
    #[arg(long)]
    pub no_usage_injection: bool,
    /// Threads serving the gRPC streams (default: one per CPU, or TOKIO_WORKER_THREADS).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,
}

/// The picker's settings from its flags.
pub fn settings(args: &EppArgs) -> Result<EppSettings> {
    let mut router = match &args.router_config {
        Some(path) => load_router_config(path)?,
        None => RouterConfig::default(),
    };
    if let Some(p) = &args.policy {
        router.policy = p.clone();
    }
    if args.max_in_flight.is_some() {
        router.cost.max_in_flight = args.max_in_flight;
    }
    if args.max_waiting.is_some() {
        router.cost.max_waiting = args.max_waiting;
    }
    router.validate()?;
    let backends = args
        .backends
        .iter()
        .map(|b| BackendSpec::parse_flag(b))
        .collect::<Result<Vec<_>, _>>()?;
    if backends.is_empty() && args.fleet_file.is_none() {
        bail!("no backends: give --backend URL (repeatable) or --fleet-file FILE");
    }
    if args.admin_token.as_deref().is_some_and(str::is_empty) {
        bail!("--admin-token must not be empty");
    }
    if args.scrape_interval.is_zero() || args.health_interval.is_zero() {
        bail!("--scrape-interval and --health-interval must be > 0");
    }
    let gateway = Settings {
        router,
        backends,
        fleet_file: args.fleet_file.clone(),
        max_body_bytes: args.max_body_bytes,
        max_retries: args.max_fallbacks,
        scrape_interval: args.scrape_interval,
        health_interval: args.health_interval,
        probe_timeout: args.probe_timeout,
        queue_size: args.queue_size,
        queue_timeout: args.queue_timeout,
        drain_timeout: args.drain_timeout,
        admin_token: args.admin_token.clone(),
        inject_usage: !args.no_usage_injection,
        model_aliases: parse_model_aliases(&args.model_aliases)?,
        strict_models: args.strict_models,
        ..Settings::default()
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
    })
}

/// Runs `switchyard epp`.
pub fn run(args: EppArgs) -> Result<()> {
    let settings = settings(&args)?;
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.worker_threads {
        builder.worker_threads(usize::from(n));
    }
    let runtime = builder.enable_all().build()?;
    runtime.block_on(async move {
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
