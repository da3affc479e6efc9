//! The flags `switchyard serve` and `switchyard epp` share: the fleet, the router, admission,
//! probes, model names, shutdown.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use clap::Args;
use switchyard_core::models::{merge_aliases, parse_alias};
use switchyard_core::RouterConfig;
use switchyard_gateway::config::load_router_config;
use switchyard_gateway::{BackendSpec, Settings};

/// Parses seconds (fractions allowed) into a duration.
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(v.is_finite() && v >= 0.0) {
        return Err(format!("`{s}` must be >= 0"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Parses `--model-alias` values: each NAME=MODEL, a NAME given once (or twice alike), no alias
/// of an alias.
pub fn parse_model_aliases(entries: &[String]) -> Result<BTreeMap<String, String>> {
    let mut aliases = BTreeMap::new();
    for entry in entries {
        let (name, target) = parse_alias(entry).map_err(|e| anyhow!("--model-alias {e}"))?;
        if let Some(before) = aliases.insert(name.clone(), target.clone()) {
            if before != target {
                bail!("--model-alias: `{name}` is given as `{before}` and as `{target}`");
            }
        }
    }
    merge_aliases(&aliases, &BTreeMap::new()).map_err(|e| anyhow!("--model-alias: {e}"))?;
    Ok(aliases)
}

/// Fleet, router and admission flags of `serve` and `epp`.
#[derive(Debug, Clone, Args)]
pub struct FleetArgs {
    /// A backend: URL[,role=prefill|decode|both][,models=a+b][,adapters=x+y]
    /// [,kind=vllm|sglang|llamacpp|trtllm|auto][,name=N][,weight=W]
    /// [,kv_events=tcp://HOST:PORT][,kv_events_replay=tcp://HOST:PORT] (repeatable). Without
    /// models=, the models and adapters are discovered from the backend's /v1/models; with
    /// kv_events=, the engine's KV events are subscribed to for exact prefix matching, and with
    /// kv_events_replay= a sequence gap is first asked of the engine's replay endpoint.
    #[arg(long = "backend", value_name = "URL[,key=value...]")]
    pub backends: Vec<String>,
    /// Fleet file (YAML, or TOML/JSON by extension) with `backends: [...]`; watched and
    /// reloaded on change (or SIGHUP) without dropping traffic.
    #[arg(long, value_name = "FILE")]
    pub fleet_file: Option<PathBuf>,
    /// Router settings file (any subset of the keys in docs/core.md; TOML, JSON or YAML).
    #[arg(long, value_name = "FILE")]
    pub router_config: Option<PathBuf>,
    /// Routing policy (overrides the router settings): cost, round-robin, random, least-load,
    /// power-of-two, sglang-cache-aware, dynamo-kv, gie, gie-lora, kubeai-chwbl.
    #[arg(long)]
    pub policy: Option<String>,
    /// Router-side requests in flight at which a backend counts as saturated
    /// (router setting cost.max_in_flight).
    #[arg(long, value_name = "N")]
    pub max_in_flight: Option<u32>,
    /// Engine-reported waiting requests at which a backend counts as saturated
    /// (router setting cost.max_waiting).
    #[arg(long, value_name = "N")]
    pub max_waiting: Option<u32>,
    /// Requests that may wait for capacity when every backend is saturated (0: 429 at once).
    #[arg(long, default_value_t = 256)]
    pub queue_size: usize,
    /// Seconds a request may wait for capacity before 429 with Retry-After.
    #[arg(long, default_value = "10", value_parser = parse_secs)]
    pub queue_timeout: Duration,
    /// Largest accepted request body in bytes (413 above).
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Bytes of request bodies held at once over all requests (503 past it; 0: no limit).
    #[arg(long, default_value_t = 1024 * 1024 * 1024)]
    pub max_body_memory: usize,
    /// Seconds between engine metrics scrapes.
    #[arg(long, default_value = "0.5", value_parser = parse_secs)]
    pub scrape_interval: Duration,
    /// Seconds between active health checks (GET /health).
    #[arg(long, default_value = "2", value_parser = parse_secs)]
    pub health_interval: Duration,
    /// Seconds allowed for one health check, scrape or discovery call.
    #[arg(long, default_value = "2", value_parser = parse_secs)]
    pub probe_timeout: Duration,
    /// KV events (backends with kv_events=): seconds an engine may publish nothing while it
    /// reports uncached prompt work, or a batch may take to arrive, before its events are
    /// untrusted and the backend is routed on the approximate index.
    #[arg(long, default_value = "10", value_parser = parse_secs)]
    pub kv_events_silence: Duration,
    /// KV events: seconds a new or resubscribed stream must run clean, with events, before the
    /// backend is matched exactly again.
    #[arg(long, default_value = "5", value_parser = parse_secs)]
    pub kv_events_probation: Duration,
    /// A Hugging Face tokenizer.json for a served base model, MODEL=PATH (repeatable): text
    /// prompts of /v1/completions for MODEL, and chat messages when a tokenizer_config.json
    /// with a chat_template sits beside it, are tokenized (outside the router lock) so backends
    /// with kv_events= are matched exactly. Nothing is downloaded.
    #[arg(long = "tokenizer", value_name = "MODEL=PATH")]
    pub tokenizers: Vec<String>,
    /// MiB of tokenized prompt pieces each --tokenizer keeps (a conversation's earlier
    /// messages are not tokenized again); 0 keeps none.
    #[arg(long, default_value = "64", value_name = "MIB")]
    pub tokenizer_cache_mib: usize,
    /// Do not tokenize chat answers into the piece cache as they end (the next turn then
    /// tokenizes them on its way); saves the CPU spent on conversations that never go on.
    #[arg(long)]
    pub no_answer_warmup: bool,
    /// Seconds in-flight responses may take to finish after SIGINT/SIGTERM, or a removed
    /// backend to drain.
    #[arg(long, default_value = "30", value_parser = parse_secs)]
    pub drain_timeout: Duration,
    /// Token for /admin/* and /dashboard (sent as `Authorization: Bearer TOKEN`; the dashboard
    /// also takes it as an HTTP Basic password); without it both are disabled.
    #[arg(long, env = "SWITCHYARD_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// A model alias NAME=MODEL (repeatable): a request for NAME is routed as MODEL (a base
    /// model or an adapter) and sent to the engine with `model` set to MODEL. Merged with the
    /// fleet file's `model_aliases`.
    #[arg(long = "model-alias", value_name = "NAME=MODEL")]
    pub model_aliases: Vec<String>,
    /// Answer 404 model_not_found for a model name no backend serves even when the fleet serves
    /// a single base model (by default such a request goes to that model).
    #[arg(long)]
    pub strict_models: bool,
    /// Do not add `stream_options.include_usage` to streamed requests that lack it (the
    /// gateway otherwise adds it to learn from the engine's usage and strips that chunk).
    #[arg(long)]
    pub no_usage_injection: bool,
    /// Another replica in front of the same fleet, as http://HOST:PORT (its HTTP port; for
    /// `epp`, its metrics port), repeatable: every request routed here (its body and pick) and
    /// its first token and end are sent to it within milliseconds, and it sends its own, so the
    /// replicas' prefix indexes and load counts agree. Needs --admin-token, the same on every
    /// replica.
    #[arg(long = "peer", value_name = "URL")]
    pub peers: Vec<String>,
    /// Threads serving requests (default: one per CPU, or TOKIO_WORKER_THREADS). One thread
    /// spends the least CPU per request when the gateway shares a small machine.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,
}

/// How long a stopping server waits for work on tokio's blocking pool.
const BLOCKING_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Runs `main` on `runtime`, then stops the runtime without waiting long for blocking work: a
/// DNS lookup (`--peer-dns` asks the system resolver on tokio's blocking pool) cannot be
/// cancelled, and dropping the runtime would hold the exit for as long as the resolver retries.
pub fn serve_on<T>(
    runtime: tokio::runtime::Runtime,
    main: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let result = runtime.block_on(main);
    runtime.shutdown_timeout(BLOCKING_GRACE);
    result
}

impl FleetArgs {
    /// The runtime that serves: `--worker-threads 1` gets tokio's single-threaded scheduler
    /// (everything on the one thread, with none of the multi-threaded one's bookkeeping: it read
    /// the clock eight times a request); otherwise the multi-threaded one with that many workers.
    pub fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        let mut builder = match self.worker_threads {
            Some(1) => tokio::runtime::Builder::new_current_thread(),
            Some(n) => {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(usize::from(n));
                b
            }
            None => tokio::runtime::Builder::new_multi_thread(),
        };
        builder.enable_all().build()
    }

    /// The router settings: the file's (or the defaults), with the policy and saturation
    /// flags over them; not yet validated (callers may change more).
    pub fn router(&self) -> Result<RouterConfig> {
        let mut router = match &self.router_config {
            Some(path) => load_router_config(path)?,
            None => RouterConfig::default(),
        };
        if let Some(p) = &self.policy {
            router.policy = p.clone();
        }
        if self.max_in_flight.is_some() {
            router.cost.max_in_flight = self.max_in_flight;
        }
        if self.max_waiting.is_some() {
            router.cost.max_waiting = self.max_waiting;
        }
        Ok(router)
    }

    /// The settings these flags give (`router` validated here), the rest at their defaults.
    /// `need_backends`: whether `--backend` or `--fleet-file` must be given (not when the
    /// fleet is discovered some other way).
    pub fn settings(&self, router: RouterConfig, need_backends: bool) -> Result<Settings> {
        router.validate()?;
        let backends = self
            .backends
            .iter()
            .map(|b| BackendSpec::parse_flag(b))
            .collect::<Result<Vec<_>, _>>()?;
        if need_backends && backends.is_empty() && self.fleet_file.is_none() {
            bail!("no backends: give --backend URL (repeatable) or --fleet-file FILE");
        }
        if self.admin_token.as_deref().is_some_and(str::is_empty) {
            bail!("--admin-token must not be empty");
        }
        if self.scrape_interval.is_zero() || self.health_interval.is_zero() {
            bail!("--scrape-interval and --health-interval must be > 0");
        }
        let peers = self
            .peers
            .iter()
            .map(|p| match p.parse::<http::Uri>() {
                Ok(uri) if uri.scheme_str() == Some("http") && uri.authority().is_some() => Ok(uri),
                _ => Err(anyhow!("--peer `{p}`: expected http://HOST:PORT")),
            })
            .collect::<Result<Vec<_>>>()?;
        if !peers.is_empty() && self.admin_token.is_none() {
            bail!("--peer needs --admin-token (the same on every replica): peers sync through /admin/peer-sync");
        }
        Ok(Settings {
            router,
            backends,
            fleet_file: self.fleet_file.clone(),
            max_body_bytes: self.max_body_bytes,
            max_body_memory: self.max_body_memory,
            scrape_interval: self.scrape_interval,
            health_interval: self.health_interval,
            probe_timeout: self.probe_timeout,
            kv_events_silence: self.kv_events_silence,
            kv_events_probation: self.kv_events_probation,
            tokenizers: self
                .tokenizers
                .iter()
                .map(|t| match t.split_once('=') {
                    Some((model, path)) if !model.is_empty() && !path.is_empty() => {
                        Ok((model.to_string(), PathBuf::from(path)))
                    }
                    _ => Err(anyhow!("--tokenizer `{t}`: expected MODEL=PATH")),
                })
                .collect::<Result<_>>()?,
            tokenizer_cache_bytes: self.tokenizer_cache_mib.checked_mul(1 << 20).ok_or_else(
                || {
                    anyhow!(
                        "--tokenizer-cache-mib {}: too large",
                        self.tokenizer_cache_mib
                    )
                },
            )?,
            answer_warmup: !self.no_answer_warmup,
            queue_size: self.queue_size,
            queue_timeout: self.queue_timeout,
            drain_timeout: self.drain_timeout,
            admin_token: self.admin_token.clone(),
            inject_usage: !self.no_usage_injection,
            model_aliases: parse_model_aliases(&self.model_aliases)?,
            strict_models: self.strict_models,
            peers,
            ..Settings::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::sync::mpsc;

    /// The serve flags alone, to build the runtime `serve` and `epp` get.
    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        fleet: FleetArgs,
    }

    #[test]
    fn the_tokenizer_cache_flag_sets_the_bytes_and_defaults_as_the_settings_do() {
        let settings = |extra: &[&str]| {
            let argv = ["switchyard"].into_iter().chain(extra.iter().copied());
            let fleet = Flags::parse_from(argv).fleet;
            fleet.settings(fleet.router().expect("router"), false)
        };
        assert_eq!(
            settings(&[]).unwrap().tokenizer_cache_bytes,
            Settings::default().tokenizer_cache_bytes
        );
        let off = settings(&["--tokenizer-cache-mib", "0"]).unwrap();
        assert_eq!(off.tokenizer_cache_bytes, 0);
        let small = settings(&["--tokenizer-cache-mib", "3"]).unwrap();
        assert_eq!(small.tokenizer_cache_bytes, 3 << 20);
        let huge = usize::MAX.to_string();
        let err = settings(&["--tokenizer-cache-mib", &huge]).unwrap_err();
        assert!(err.to_string().contains("too large"), "{err}");
    }

    /// A hung system resolver cannot be arranged without changing the machine's DNS settings;
    /// a job stuck on the blocking pool is what `lookup_host` is while the resolver retries.
    #[test]
    fn a_lookup_stuck_on_the_blocking_pool_does_not_hold_the_exit() {
        // The single-threaded runtime (`--worker-threads 1`) and the multi-threaded one.
        for threads in [&["--worker-threads", "1"][..], &[]] {
            let argv = std::iter::once("switchyard").chain(threads.iter().copied());
            let runtime = Flags::parse_from(argv).fleet.runtime().expect("runtime");
            // Held until the end of the test: the job blocks until then.
            let (release, stuck) = mpsc::channel::<()>();
            let (done_tx, done) = mpsc::channel();
            std::thread::spawn(move || {
                let result = serve_on(runtime, async move {
                    let (running_tx, running) = tokio::sync::oneshot::channel();
                    // Detached, as the resolver's task is once the gateway aborts it.
                    drop(tokio::task::spawn_blocking(move || {
                        let _ = running_tx.send(());
                        let _ = stuck.recv();
                    }));
                    running.await?;
                    Ok(())
                });
                let _ = done_tx.send(result.is_ok());
            });
            // Well over BLOCKING_GRACE, well under forever.
            let returned = done.recv_timeout(Duration::from_secs(10));
            drop(release);
            assert_eq!(
                returned,
                Ok(true),
                "{threads:?}: serve_on waited on the job"
            );
        }
    }
}
