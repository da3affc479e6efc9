//! `switchyard demo`: a whole fleet in one command — emulated engines on ephemeral loopback
//! ports and the gateway in front of them — until Ctrl-C.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use switchyard_emulator::engine::{EngineConfig, Role};
use switchyard_emulator::{EmulatorConfig, RunningServer};
use switchyard_gateway::{BackendSpec, Settings};

/// Flags of `switchyard demo`.
#[derive(Debug, Clone, Args)]
#[command(
    about = "Start emulated engines and the gateway in one process, and print requests to try",
    long_about = "Start a small fleet of emulated engines (vLLM-compatible, on 127.0.0.1 \
ephemeral ports; the first one also serves two LoRA adapters) and the gateway in front of \
them, print curl lines to try, and run until Ctrl-C. Needs nothing else."
)]
pub struct DemoArgs {
    /// Gateway address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Number of emulated engines.
    #[arg(long, default_value_t = 3)]
    pub engines: usize,
    /// Served model name.
    #[arg(long, default_value = "demo-llama-8b")]
    pub model: String,
    /// Emulator speed (virtual time = speed x wall time).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Routing policy.
    #[arg(long, default_value = "cost")]
    pub policy: String,
    /// Admin token for /admin/* and /dashboard (printed).
    #[arg(long, default_value = "demo")]
    pub admin_token: String,
    /// Also start a prefill + decode pair serving MODEL-pd (disaggregated serving).
    #[arg(long)]
    pub pd: bool,
}

/// The adapters of the first engine.
const ADAPTERS: [(&str, &str); 2] = [
    ("sql-lora", "/adapters/sql"),
    ("chat-lora", "/adapters/chat"),
];

fn engine(model: &str, speed: f64, seed: u64, adapters: bool, role: Role) -> EmulatorConfig {
    EmulatorConfig {
        host: "127.0.0.1".into(),
        port: 0,
        engine: EngineConfig {
            model_name: model.to_string(),
            role,
            max_loras: 2,
            ..EngineConfig::default()
        },
        speed,
        instant: false,
        lora_modules: if adapters {
            ADAPTERS
                .iter()
                .map(|(n, p)| (n.to_string(), p.to_string()))
                .collect()
        } else {
            Vec::new()
        },
        kv_events: None,
        seed,
        max_body_bytes: 32 * 1024 * 1024,
        special_tokens: false,
    }
}

/// Runs `switchyard demo`.
pub fn run(args: DemoArgs) -> Result<()> {
    if !(args.speed.is_finite() && args.speed > 0.0) {
        anyhow::bail!("--speed must be a positive number");
    }
    let engines = args.engines.clamp(1, 16);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let signal = switchyard_emulator::shutdown_signal()?;
        let mut servers: Vec<RunningServer> = Vec::new();
        let mut backends = Vec::new();
        for i in 0..engines {
            let server = switchyard_emulator::start(engine(&args.model, args.speed, i as u64, i == 0, Role::Both)).await?;
            // Models and adapters are discovered from each engine's /v1/models.
            backends.push(BackendSpec::parse_flag(&format!("http://{},name=engine-{i}", server.addr))?);
            println!("engine-{i} on http://{}{}", server.addr, if i == 0 { " (adapters sql-lora, chat-lora)" } else { "" });
            servers.push(server);
        }
        let pd_model = format!("{}-pd", args.model);
        if args.pd {
            for (i, (role, flag)) in [(Role::Prefill, "prefill"), (Role::Decode, "decode")].into_iter().enumerate() {
                let server = switchyard_emulator::start(engine(&pd_model, args.speed, 100 + i as u64, false, role)).await?;
                backends.push(BackendSpec::parse_flag(&format!(
                    "http://{},name={flag}-0,role={flag}",
                    server.addr
                ))?);
                println!("{flag}-0 on http://{} ({pd_model}, {flag} only)", server.addr);
                servers.push(server);
            }
        }
        let mut settings = Settings {
            listen: args.listen,
            backends,
            admin_token: Some(args.admin_token.clone()),
            debug_header: true,
            scrape_interval: Duration::from_millis(250),
            health_interval: Duration::from_secs(1),
            ..Settings::default()
        };
        settings.router.policy = args.policy.clone();
        let gateway = switchyard_gateway::start(settings).await?;
        let url = format!("http://{}", gateway.addr);
        println!("listening on {url}");
        println!();
        println!("Try (the x-switchyard-decision header shows why a backend was picked):");
        println!(
            "  curl -si {url}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}],\"max_tokens\":32}}'",
            args.model
        );
        println!(
            "  curl -sN {url}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Stream to me\"}}],\"max_tokens\":32,\"stream\":true}}'",
            args.model
        );
        println!(
            "  curl -s {url}/v1/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"sql-lora\",\"prompt\":\"SELECT\",\"max_tokens\":16}}'"
        );
        if args.pd {
            println!(
                "  # prefill/decode pair: a short prompt runs whole on the decode instance (selective\n  # disaggregation); one over cost.local_prefill_max_tokens uncached tokens is split,\n  # and the x-switchyard-prefill header names the prefill instance"
            );
            println!(
                "  curl -si {url}/v1/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{pd_model}\",\"prompt\":\"Prefill here, decode there\",\"max_tokens\":16}}'"
            );
        }
        println!("  curl -s {url}/v1/models");
        println!("  curl -s {url}/admin/fleet -H 'authorization: Bearer {}'", args.admin_token);
        println!("  curl -s {url}/metrics | grep ^switchyard_");
        println!();
        println!(
            "Live dashboard: {url}/dashboard (the browser asks for credentials: any user name, \
             the admin token `{}` as password)",
            args.admin_token
        );
        println!();
        println!("Ctrl-C to stop.");
        gateway.run_until(signal).await?;
        for s in servers {
            let _ = s.shutdown_within(Duration::from_secs(2)).await;
        }
        Ok(())
    })
}
