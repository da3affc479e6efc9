//! `switchyard serve`: the gateway, an OpenAI-compatible router in front of a fleet of engines.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use switchyard_core::RouterConfig;
use switchyard_gateway::config::{parse_api_keys, PeerDns};
use switchyard_gateway::pd::PdStyle;
use switchyard_gateway::Settings;

use crate::fleet_args::{parse_secs, FleetArgs};

/// Flags of `switchyard serve`.
#[derive(Debug, Clone, Args)]
#[command(
    about = "Run the gateway: an OpenAI-compatible router and load balancer in front of inference engines",
    long_about = "Run the gateway: an OpenAI-compatible HTTP router in front of a fleet of inference \
engines (vLLM, SGLang, llama.cpp, the Switchyard emulator).\n\n\
Serves POST /v1/completions, /v1/chat/completions, /v1/embeddings; GET /v1/models, /health, \
/metrics; admin endpoints under /admin (with --admin-token). Prints `listening on http://ADDR` \
on stdout once ready. SIGINT/SIGTERM stop accepting and let in-flight responses finish for up \
to --drain-timeout; SIGHUP reloads the fleet file. See docs/gateway.md."
)]
pub struct ServeArgs {
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Address to listen on (port 0: ephemeral).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Largest request headers (all lines, bytes) forwarded to an engine; larger get 431.
    /// The default is what uvicorn (vLLM's and SGLang's server) accepts; 0: no limit.
    #[arg(long, default_value_t = 16 * 1024)]
    pub max_header_bytes: usize,
    /// Seconds a client has to send a request's headers, from the connection's start (slow or
    /// idle clients are disconnected; 0: no limit).
    #[arg(long, default_value = "30", value_parser = parse_secs)]
    pub header_read_timeout: Duration,
    /// Seconds a client has to send a request's body once its headers are in (408 after).
    #[arg(long, default_value = "60", value_parser = parse_secs)]
    pub body_read_timeout: Duration,
    /// Client connections open at once; more are answered 503 `too_many_connections` and
    /// closed (0: no limit).
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
    /// Further candidates tried when an attempt fails before its first byte.
    #[arg(long, default_value_t = 2)]
    pub max_retries: u32,
    /// Seconds to connect to a backend.
    #[arg(long, default_value = "2", value_parser = parse_secs)]
    pub connect_timeout: Duration,
    /// Seconds to wait for a backend's response headers (504 after).
    #[arg(long, default_value = "600", value_parser = parse_secs)]
    pub upstream_timeout: Duration,
    /// Seconds a backend may send nothing mid-body (between chunks, or before the first one
    /// after the headers) before the gateway ends the stream with an error event (0: never).
    #[arg(long, default_value = "120", value_parser = parse_secs)]
    pub stream_idle_timeout: Duration,
    /// Consecutive failures (checks or 5xx answers) that eject a backend; a refused
    /// connection ejects at once.
    #[arg(long, default_value_t = 3)]
    pub eject_after: u32,
    /// Consecutive passed health checks that readmit an ejected backend.
    #[arg(long, default_value_t = 2)]
    pub readmit_after: u32,
    /// File of client API keys (one per line, `#` comments); clients must send
    /// `Authorization: Bearer KEY`. Adds to SWITCHYARD_API_KEYS (comma-separated).
    #[arg(long, value_name = "FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Add `x-switchyard-decision` (the decision explained) and `x-switchyard-backend`
    /// response headers.
    #[arg(long)]
    pub debug_header: bool,
    /// How disaggregated requests hand the KV cache from prefill to decode: nixl (vLLM
    /// NixlConnector: prefill first, its kv_transfer_params to decode) or sglang (both at once
    /// with bootstrap_host/port/room). A prefill backend with bootstrap_port= is SGLang-style
    /// whatever this says.
    #[arg(long, default_value = "nixl", value_name = "nixl|sglang")]
    pub pd_style: PdStyle,
    /// Find the other replicas by DNS (a headless Service, a Compose service): every address
    /// HOST resolves to (its IPv4 ones when it has any, else its IPv6 ones) is a replica at
    /// http://ADDRESS:PORT, re-resolved every --peer-dns-interval. This replica is left out: on
    /// PORT, its --listen address, $POD_IP (or $POD_IPS), and with --listen on 0.0.0.0 or ::
    /// every address of this host. Adds to --peer; a failed resolution keeps the last peers.
    /// Needs --admin-token, the same on every replica.
    #[arg(long, value_name = "HOST:PORT")]
    pub peer_dns: Option<String>,
    /// Seconds between two resolutions of --peer-dns.
    #[arg(long, default_value = "5", value_parser = parse_secs, value_name = "SECS")]
    pub peer_dns_interval: Duration,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

/// Dynamic LoRA adapter placement flags of `switchyard serve` (router settings `placement.*`).
#[derive(Debug, Clone, Args)]
pub struct PlacementArgs {
    /// Load LoRA adapters onto more backends as their demand grows and unload cold copies, with
    /// hysteresis and a per-backend cooldown (router setting placement.enabled). Only adapters
    /// given a --lora-path are loaded or unloaded.
    #[arg(long)]
    pub dynamic_lora_placement: bool,
    /// Where a LoRA adapter's weights are, as NAME=PATH (repeatable): the `lora_path` sent to
    /// POST /v1/load_lora_adapter.
    #[arg(long = "lora-path", value_name = "NAME=PATH")]
    pub lora_paths: Vec<String>,
    /// Seconds between two placement plans (placement.interval_s).
    #[arg(long, value_name = "SECS")]
    pub placement_interval: Option<f64>,
    /// Half-life in seconds of the per-adapter request rate (placement.half_life_s).
    #[arg(long, value_name = "SECS")]
    pub placement_half_life: Option<f64>,
    /// Requests/s per holding backend above which an adapter is loaded onto one more
    /// (placement.scale_up_rps).
    #[arg(long, value_name = "RPS")]
    pub placement_scale_up_rps: Option<f64>,
    /// Requests/s per holding backend, counted with one fewer, below which a copy is unloaded;
    /// must be below the scale-up rate (placement.scale_down_rps).
    #[arg(long, value_name = "RPS")]
    pub placement_scale_down_rps: Option<f64>,
    /// Seconds a backend is left alone after a load or unload (placement.cooldown_s).
    #[arg(long, value_name = "SECS")]
    pub placement_cooldown: Option<f64>,
    /// Seconds an adapter stays on a backend before that copy may be unloaded
    /// (placement.min_residency_s).
    #[arg(long, value_name = "SECS")]
    pub placement_min_residency: Option<f64>,
    /// Most loads and unloads in one plan (placement.max_actions).
    #[arg(long, value_name = "N")]
    pub placement_max_actions: Option<u32>,
    /// How many times colder (per holding backend) a copy must be to give its slot to a hotter
    /// adapter (placement.eviction_ratio).
    #[arg(long, value_name = "X")]
    pub placement_eviction_ratio: Option<f64>,
}

impl PlacementArgs {
    /// Applies the flags to the router settings; returns the adapter paths.
    fn apply(
        &self,
        router: &mut RouterConfig,
    ) -> Result<std::collections::BTreeMap<String, String>> {
        let p = &mut router.placement;
        p.enabled |= self.dynamic_lora_placement;
        let set = |slot: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut p.interval_s, self.placement_interval);
        set(&mut p.half_life_s, self.placement_half_life);
        set(&mut p.scale_up_rps, self.placement_scale_up_rps);
        set(&mut p.scale_down_rps, self.placement_scale_down_rps);
        set(&mut p.cooldown_s, self.placement_cooldown);
        set(&mut p.min_residency_s, self.placement_min_residency);
        set(&mut p.eviction_ratio, self.placement_eviction_ratio);
        if let Some(n) = self.placement_max_actions {
            p.max_actions = n;
        }
        let mut paths = std::collections::BTreeMap::new();
        for entry in &self.lora_paths {
            let Some((name, path)) = entry
                .split_once('=')
                .map(|(n, p)| (n.trim(), p.trim()))
                .filter(|(n, p)| !n.is_empty() && !p.is_empty())
            else {
                bail!("--lora-path `{entry}`: expected NAME=PATH");
            };
            if paths.insert(name.to_string(), path.to_string()).is_some() {
                bail!("--lora-path: `{name}` is given twice");
            }
        }
        Ok(paths)
    }
}

/// Builds the gateway settings from the flags (and the environment for API keys).
pub fn settings(args: &ServeArgs) -> Result<Settings> {
    let mut router = args.fleet.router()?;
    let lora_paths = args.placement.apply(&mut router)?;
    let common = args.fleet.settings(router, true)?;
    let peer_dns = args
        .peer_dns
        .as_deref()
        .map(|text| -> Result<PeerDns> {
            if common.admin_token.is_none() {
                bail!("--peer-dns needs --admin-token (the same on every replica): peers sync through /admin/peer-sync");
            }
            if args.peer_dns_interval.is_zero() {
                bail!("--peer-dns-interval must be > 0");
            }
            PeerDns::parse(text, args.peer_dns_interval).map_err(|e| anyhow!("--peer-dns {e}"))
        })
        .transpose()?;
    let mut api_keys = match std::env::var("SWITCHYARD_API_KEYS") {
        Ok(v) => parse_api_keys(&v),
        Err(_) => Default::default(),
    };
    if let Some(path) = &args.api_keys_file {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let keys = parse_api_keys(&text);
        if keys.is_empty() {
            bail!("{} holds no API key", path.display());
        }
        api_keys.extend(keys);
    }
    Ok(Settings {
        listen: args.listen,
        max_header_bytes: args.max_header_bytes,
        header_read_timeout: args.header_read_timeout,
        body_read_timeout: args.body_read_timeout,
        max_connections: args.max_connections,
        max_retries: args.max_retries,
        connect_timeout: args.connect_timeout,
        upstream_timeout: args.upstream_timeout,
        stream_idle_timeout: args.stream_idle_timeout,
        eject_after: args.eject_after.max(1),
        readmit_after: args.readmit_after.max(1),
        api_keys,
        debug_header: args.debug_header,
        pd_style: args.pd_style,
        lora_paths,
        peer_discovery: common.peer_discovery || peer_dns.is_some(),
        peer_dns,
        ..common
    })
}

/// Runs `switchyard serve`.
pub fn run(args: ServeArgs) -> Result<()> {
    let settings = settings(&args)?;
    let runtime = args.fleet.runtime()?;
    crate::fleet_args::serve_on(runtime, async move {
        // Handlers first, so a signal right after the address line is not lost.
        let signal = switchyard_emulator::shutdown_signal()?;
        let gateway = switchyard_gateway::start(settings).await?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on http://{}", gateway.addr)?;
        out.flush()?;
        drop(out);
        tracing::info!(addr = %gateway.addr, "gateway listening");
        gateway.run_until(signal).await?;
        tracing::info!("stopped");
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ServeArgs,
    }

    #[test]
    fn flags_become_settings() {
        let cli = Cli::try_parse_from([
            "x",
            "--backend",
            "127.0.0.1:1,models=m",
            "--backend",
            "http://127.0.0.1:2,role=decode,models=m",
            "--policy",
            "least-load",
            "--max-in-flight",
            "4",
            "--queue-timeout",
            "0.25",
            "--max-retries",
            "1",
        ])
        .unwrap();
        let s = settings(&cli.args).unwrap();
        assert_eq!(s.backends.len(), 2);
        assert_eq!(s.router.policy, "least-load");
        assert_eq!(s.router.cost.max_in_flight, Some(4));
        assert_eq!(s.queue_timeout, Duration::from_millis(250));
        assert_eq!(s.max_retries, 1);
        assert_eq!(s.listen.to_string(), "127.0.0.1:8080");
    }

    #[test]
    fn every_flag_parses() {
        let dir =
            std::env::temp_dir().join(format!("switchyard-serve-flags-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let keys = dir.join("keys");
        std::fs::write(&keys, "k1\nk2\n").unwrap();
        let rc = dir.join("router.json");
        std::fs::write(&rc, r#"{"policy": "random"}"#).unwrap();
        let cli = Cli::try_parse_from([
            "x",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "h:1,models=m",
            "--fleet-file",
            "/nonexistent/fleet.yaml",
            "--router-config",
            rc.to_str().unwrap(),
            "--policy",
            "gie",
            "--max-in-flight",
            "3",
            "--max-waiting",
            "5",
            "--queue-size",
            "7",
            "--queue-timeout",
            "1.5",
            "--max-body-bytes",
            "1000",
            "--max-retries",
            "4",
            "--connect-timeout",
            "0.5",
            "--upstream-timeout",
            "9",
            "--scrape-interval",
            "0.2",
            "--health-interval",
            "0.3",
            "--probe-timeout",
            "0.4",
            "--eject-after",
            "5",
            "--readmit-after",
            "6",
            "--drain-timeout",
            "8",
            "--api-keys-file",
            keys.to_str().unwrap(),
            "--admin-token",
            "adm",
            "--debug-header",
            "--no-usage-injection",
            "--model-alias",
            "gpt-4o=m",
            "--strict-models",
        ])
        .unwrap();
        let s = settings(&cli.args).unwrap();
        assert_eq!(s.listen.port(), 0);
        assert_eq!(s.model_aliases["gpt-4o"], "m");
        assert!(s.strict_models);
        assert_eq!(s.backends[0].models, vec!["m"]);
        assert!(s.fleet_file.is_some());
        assert_eq!(s.router.policy, "gie");
        assert_eq!(s.router.cost.max_in_flight, Some(3));
        assert_eq!(s.router.cost.max_waiting, Some(5));
        assert_eq!(s.queue_size, 7);
        assert_eq!(s.queue_timeout, Duration::from_millis(1500));
        assert_eq!(s.max_body_bytes, 1000);
        assert_eq!(s.max_retries, 4);
        assert_eq!(s.connect_timeout, Duration::from_millis(500));
        assert_eq!(s.upstream_timeout, Duration::from_secs(9));
        assert_eq!(s.scrape_interval, Duration::from_millis(200));
        assert_eq!(s.health_interval, Duration::from_millis(300));
        assert_eq!(s.probe_timeout, Duration::from_millis(400));
        assert_eq!((s.eject_after, s.readmit_after), (5, 6));
        assert_eq!(s.drain_timeout, Duration::from_secs(8));
        assert!(s.api_keys.contains("k1") && s.api_keys.contains("k2"));
        assert_eq!(s.admin_token.as_deref(), Some("adm"));
        assert!(s.debug_header);
        assert!(!s.inject_usage);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn worker_threads_flag() {
        let cli = Cli::try_parse_from(["x", "--worker-threads", "1"]).unwrap();
        assert_eq!(cli.args.fleet.worker_threads, Some(1));
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(cli.args.fleet.worker_threads, None);
        assert!(Cli::try_parse_from(["x", "--worker-threads", "0"]).is_err());
        assert!(Cli::try_parse_from(["x", "--worker-threads", "many"]).is_err());
    }

    #[test]
    fn pd_style_flag() {
        let default = Cli::try_parse_from(["x", "--backend", "h:1"]).unwrap();
        assert_eq!(settings(&default.args).unwrap().pd_style, PdStyle::Nixl);
        let sglang =
            Cli::try_parse_from(["x", "--backend", "h:1", "--pd-style", "sglang"]).unwrap();
        assert_eq!(settings(&sglang.args).unwrap().pd_style, PdStyle::Sglang);
        assert!(Cli::try_parse_from(["x", "--backend", "h:1", "--pd-style", "nope"]).is_err());
    }

    #[test]
    fn placement_flags() {
        let off = Cli::try_parse_from(["x", "--backend", "h:1"]).unwrap();
        let s = settings(&off.args).unwrap();
        assert!(!s.router.placement.enabled);
        assert!(s.lora_paths.is_empty());
        let cli = Cli::try_parse_from([
            "x",
            "--backend",
            "h:1",
            "--dynamic-lora-placement",
            "--lora-path",
            "sql=/adapters/sql",
            "--lora-path",
            "chat = s3://bucket/chat",
            "--placement-interval",
            "0.5",
            "--placement-half-life",
            "20",
            "--placement-scale-up-rps",
            "6",
            "--placement-scale-down-rps",
            "2",
            "--placement-cooldown",
            "45",
            "--placement-min-residency",
            "90",
            "--placement-max-actions",
            "3",
            "--placement-eviction-ratio",
            "8",
        ])
        .unwrap();
        let s = settings(&cli.args).unwrap();
        let p = &s.router.placement;
        assert!(p.enabled);
        assert_eq!(s.lora_paths["sql"], "/adapters/sql");
        assert_eq!(s.lora_paths["chat"], "s3://bucket/chat");
        assert_eq!((p.interval_s, p.half_life_s), (0.5, 20.0));
        assert_eq!((p.scale_up_rps, p.scale_down_rps), (6.0, 2.0));
        assert_eq!((p.cooldown_s, p.min_residency_s), (45.0, 90.0));
        assert_eq!((p.max_actions, p.eviction_ratio), (3, 8.0));
        for bad in [
            vec!["--lora-path", "nopath"],
            vec!["--lora-path", "=p"],
            vec!["--lora-path", "a=p", "--lora-path", "a=q"],
            vec![
                "--placement-scale-up-rps",
                "1",
                "--placement-scale-down-rps",
                "1",
            ],
            vec!["--placement-max-actions", "0"],
        ] {
            let mut argv = vec!["x", "--backend", "h:1"];
            argv.extend(bad.iter().copied());
            let cli = Cli::try_parse_from(argv).unwrap();
            assert!(settings(&cli.args).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn model_alias_flags() {
        let off = Cli::try_parse_from(["x", "--backend", "h:1"]).unwrap();
        let s = settings(&off.args).unwrap();
        assert!(s.model_aliases.is_empty() && !s.strict_models);
        let cli = Cli::try_parse_from([
            "x",
            "--backend",
            "h:1",
            "--model-alias",
            "gpt-4o=llama",
            "--model-alias",
            " sql = sql-lora ",
            "--model-alias",
            "gpt-4o=llama",
        ])
        .unwrap();
        let s = settings(&cli.args).unwrap();
        assert_eq!(s.model_aliases.len(), 2);
        assert_eq!(s.model_aliases["sql"], "sql-lora");
        for (bad, names) in [
            (vec!["nomodel"], "nomodel"),
            (vec!["=m"], "=m"),
            (vec!["a=a"], "a=a"),
            (vec!["a=m", "a=n"], "`a`"),
            (vec!["a=m", "b=a"], "`b`"),
        ] {
            let mut argv = vec!["x", "--backend", "h:1"];
            for b in &bad {
                argv.extend(["--model-alias", b]);
            }
            let cli = Cli::try_parse_from(argv).unwrap();
            let e = settings(&cli.args).unwrap_err().to_string();
            assert!(
                e.contains("--model-alias") && e.contains(names),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn peer_dns_flags() {
        let off = Cli::try_parse_from(["x", "--backend", "h:1"]).unwrap();
        let s = settings(&off.args).unwrap();
        assert!(s.peer_dns.is_none() && !s.peer_discovery);
        let cli = Cli::try_parse_from([
            "x",
            "--backend",
            "h:1",
            "--admin-token",
            "t",
            "--peer-dns",
            "switchyard-peers.llm.svc.cluster.local:8080",
            "--peer",
            "http://10.0.0.1:8080",
        ])
        .unwrap();
        let s = settings(&cli.args).unwrap();
        let dns = s.peer_dns.expect("peer dns");
        assert_eq!(dns.host, "switchyard-peers.llm.svc.cluster.local");
        assert_eq!(dns.port, 8080);
        assert_eq!(dns.interval, Duration::from_secs(5));
        assert!(s.peer_discovery);
        assert_eq!(s.peers.len(), 1, "--peer and --peer-dns combine");
        let cli = Cli::try_parse_from([
            "x",
            "--backend",
            "h:1",
            "--admin-token",
            "t",
            "--peer-dns",
            "[::1]:9000",
            "--peer-dns-interval",
            "0.5",
        ])
        .unwrap();
        let dns = settings(&cli.args).unwrap().peer_dns.expect("peer dns");
        assert_eq!((dns.host.as_str(), dns.port), ("::1", 9000));
        assert_eq!(dns.interval, Duration::from_millis(500));
        for (bad, says) in [
            (vec!["--peer-dns", "peers:8080"], "needs --admin-token"),
            (
                vec!["--admin-token", "t", "--peer-dns", "peers"],
                "port is missing",
            ),
            (
                vec!["--admin-token", "t", "--peer-dns", "[::1]"],
                "port is missing",
            ),
            (
                vec!["--admin-token", "t", "--peer-dns", "peers:"],
                "not 1..65535",
            ),
            (
                vec!["--admin-token", "t", "--peer-dns", "peers:0"],
                "not 1..65535",
            ),
            (
                vec!["--admin-token", "t", "--peer-dns", "peers:http"],
                "not 1..65535",
            ),
            (
                vec!["--admin-token", "t", "--peer-dns", ":8080"],
                "not a host",
            ),
            (
                vec!["--admin-token", "t", "--peer-dns", "http://peers:8080"],
                "without a scheme",
            ),
            (
                vec!["--admin-token", "t", "--peer-dns", "::1:8080"],
                "in brackets",
            ),
            (
                vec!["--admin-token", "t", "--peer-dns", "[x]:8080"],
                "in brackets",
            ),
            (
                vec![
                    "--admin-token",
                    "t",
                    "--peer-dns",
                    "p:1",
                    "--peer-dns-interval",
                    "0",
                ],
                "--peer-dns-interval must be > 0",
            ),
        ] {
            let mut argv = vec!["x", "--backend", "h:1"];
            argv.extend(bad.iter().copied());
            let cli = Cli::try_parse_from(argv).unwrap();
            let e = settings(&cli.args).unwrap_err().to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
            assert!(e.contains("--peer-dns"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn refusals() {
        let none = Cli::try_parse_from(["x"]).unwrap();
        assert!(settings(&none.args).is_err());
        let bad = Cli::try_parse_from(["x", "--backend", "nohost"]).unwrap();
        assert!(settings(&bad.args).is_err());
        let policy = Cli::try_parse_from(["x", "--backend", "h:1", "--policy", "nope"]).unwrap();
        assert!(settings(&policy.args).is_err());
        assert!(parse_secs("-1").is_err());
        assert!(parse_secs("x").is_err());
    }
}
