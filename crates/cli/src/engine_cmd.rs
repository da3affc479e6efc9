//! `switchyard engine`: run the engine emulator (a vLLM-compatible server in
//! scaled real time), or with `--fidelity` check it against the model.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use switchyard_emulator::engine::{EngineConfig, Profile, Role};
use switchyard_emulator::kv_events::{self, Format, PublisherConfig};
use switchyard_emulator::{fidelity, EmulatorConfig};

/// Instance role in disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    /// Prefill and decode (an ordinary engine).
    Both,
    /// Prefill only (answers `do_remote_decode` requests with KV hand-off params).
    Prefill,
    /// Decode only (accepts `do_remote_prefill` requests).
    Decode,
}

/// msgpack layout of published KV events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvFormatArg {
    /// Tagged positional arrays (vLLM's array_like structs).
    Array,
    /// Maps with a "type" tag (newer vLLM).
    Map,
}

/// Arguments of `switchyard engine`.
#[derive(Debug, Clone, Args)]
#[command(
    about = "Run the engine emulator: the engine model behind vLLM's HTTP API in scaled real time",
    long_about = "Run the engine emulator: one modelled inference engine behind an HTTP server \
speaking vLLM's OpenAI-compatible API (plus the SGLang worker endpoints sglang-router checks), \
in scaled real time.\n\n\
Prints `listening on http://HOST:PORT` on stdout once ready (with --port 0 the port is \
ephemeral). Times in /metrics are virtual seconds (virtual time = speed x wall time).\n\n\
With --fidelity it instead starts an emulator at --speed 1 on an ephemeral loopback port, \
measures TTFT and decode rate through HTTP for 512, 2048 and 8192-token prompts (cold, then \
fully cached), prints a table against the engine model's prediction and exits non-zero if \
any row is off by more than 10%. TTFT is judged net of the HTTP round trip (the time until \
the streaming response's headers arrive, shown in the `http` column), which a real engine \
behind HTTP pays too; build with --release, a debug build adds milliseconds."
)]
pub struct EngineArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = ephemeral); once ready the command prints one
    /// line `listening on http://HOST:PORT` on stdout.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Served model name.
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    pub model: String,
    /// Role in prefill/decode disaggregation.
    #[arg(long, value_enum, default_value_t = RoleArg::Both)]
    pub role: RoleArg,
    /// Run N times faster than real time (virtual time = N x elapsed); times
    /// in /metrics are virtual seconds.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Answer at once without the engine's timing (gateway overhead benchmarks).
    #[arg(long)]
    pub instant: bool,
    /// KV-cache blocks (engine default if omitted).
    #[arg(long)]
    pub num_gpu_blocks: Option<u32>,
    /// Tokens per KV block (engine default if omitted).
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Maximum running sequences.
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Token budget per step (chunked prefill size).
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// Context length (prompt + output).
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// LoRA adapter slots.
    #[arg(long)]
    pub max_loras: Option<u32>,
    /// Seconds (virtual) to load an adapter into a slot.
    #[arg(long)]
    pub lora_load_time: Option<f64>,
    /// Adapters known at start, as name=path (repeatable, or several after one flag).
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<String>,
    /// Step-time profile (JSON, or TOML when the file ends in .toml).
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// Publish KV events on this ZeroMQ endpoint (vLLM rule: bind if it has `*`, else connect).
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events_endpoint: Option<String>,
    /// Bind the KV-events endpoint even without a wildcard (prints `kv-events on ENDPOINT`).
    #[arg(long)]
    pub kv_events_bind: bool,
    /// Topic frame of KV-event messages.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// msgpack layout of KV events.
    #[arg(long, value_enum, default_value_t = KvFormatArg::Array)]
    pub kv_events_format: KvFormatArg,
    /// Serve replays of recent KV event batches on this ZeroMQ endpoint (vLLM's
    /// replay_endpoint: a ROUTER socket, always bound; prints `kv-events-replay on ENDPOINT`).
    #[arg(long, value_name = "ENDPOINT", requires = "kv_events_endpoint")]
    pub kv_events_replay_endpoint: Option<String>,
    /// KV event batches kept for replay (vLLM's buffer_steps).
    #[arg(long, default_value_t = kv_events::DEFAULT_REPLAY_BUFFER, value_name = "N")]
    pub kv_events_replay_buffer: usize,
    /// Fault injection for tests: do not send every Nth KV event batch (still kept for replay),
    /// so subscribers see sequence gaps. 0 sends every batch.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub kv_events_drop_every: u64,
    /// Write the emulator's vocabulary as a Hugging Face tokenizer.json to FILE, and its chat
    /// template as tokenizer_config.json beside it, before serving (for the gateway's
    /// --tokenizer: prompts and chat messages made of its words tokenize alike).
    #[arg(long, value_name = "FILE")]
    pub write_tokenizer: Option<PathBuf>,
    /// Tokenize the chat template's markers (`<|user|>`, `<|end|>`…) as special tokens: one
    /// token each, the text between them on its own, as a chat model's tokenizer does
    /// (--write-tokenizer then writes them as added tokens). Off: one 4-byte chunk stream.
    #[arg(long)]
    pub special_tokens: bool,
    /// Engine id reported in KV hand-offs (default derived from port and pid).
    #[arg(long)]
    pub engine_id: Option<String>,
    /// Seed for response ids and instant-mode output.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Largest accepted request body in bytes.
    #[arg(long, default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Run the fidelity check instead of serving, then exit.
    ///
    /// Starts an emulator with these flags at --speed 1 on an ephemeral
    /// loopback port, measures through HTTP (streamed /v1/completions) the
    /// time to first token and the decode rate for 512, 2048 and 8192-token
    /// prompts, first cold and then fully cached, and prints a table against
    /// what the engine model predicts for the same requests. A row PASSes
    /// within 10%; the command exits non-zero if any row fails. Use a
    /// release build: a debug build adds a millisecond or more of HTTP and
    /// JSON overhead, which shows up on the ~6 ms cached TTFTs. Times in
    /// /metrics are virtual seconds (virtual time = speed x wall time).
    #[arg(long)]
    pub fidelity: bool,
    /// Output tokens per fidelity request.
    #[arg(long, default_value_t = 64)]
    pub fidelity_max_tokens: u32,
    /// Repetitions per fidelity case (the table shows medians).
    #[arg(long, default_value_t = 3)]
    pub fidelity_repeats: u32,
}

/// Parse `name=path`.
fn parse_lora_module(s: &str) -> Result<(String, String)> {
    match s.split_once('=') {
        Some((n, p)) if !n.is_empty() && !p.is_empty() => Ok((n.to_string(), p.to_string())),
        _ => bail!("--lora-modules expects NAME=PATH, got `{s}`"),
    }
}

fn load_profile(path: &PathBuf) -> Result<Profile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading profile {}", path.display()))?;
    let is_toml = path.extension().and_then(|e| e.to_str()) == Some("toml");
    let p = if is_toml {
        Profile::from_toml_str(&text)
    } else {
        Profile::from_json_str(&text)
    };
    p.map_err(|e| anyhow!("profile {}: {e}", path.display()))
}

/// Build the engine configuration from the flags.
pub fn engine_config(args: &EngineArgs) -> Result<EngineConfig> {
    let mut c = EngineConfig {
        model_name: args.model.clone(),
        role: match args.role {
            RoleArg::Both => Role::Both,
            RoleArg::Prefill => Role::Prefill,
            RoleArg::Decode => Role::Decode,
        },
        ..EngineConfig::default()
    };
    if let Some(v) = args.num_gpu_blocks {
        c.num_gpu_blocks = v;
    }
    if let Some(v) = args.block_size {
        c.block_size = v;
    }
    if let Some(v) = args.max_num_seqs {
        c.max_num_seqs = v;
    }
    if let Some(v) = args.max_num_batched_tokens {
        c.max_num_batched_tokens = v;
    }
    if let Some(v) = args.max_model_len {
        c.max_model_len = v;
    }
    if let Some(v) = args.max_loras {
        c.max_loras = v;
    }
    if let Some(v) = args.lora_load_time {
        c.lora_load_time_s = v;
    }
    if let Some(p) = &args.profile {
        c.profile = load_profile(p)?;
    }
    if let Some(id) = &args.engine_id {
        c.engine_id = id.clone();
    }
    Ok(c)
}

/// Build the emulator configuration from the flags.
pub fn emulator_config(args: &EngineArgs) -> Result<EmulatorConfig> {
    if !(args.speed.is_finite() && args.speed > 0.0) {
        bail!("--speed must be a positive number");
    }
    let lora_modules = args
        .lora_modules
        .iter()
        .map(|s| parse_lora_module(s))
        .collect::<Result<Vec<_>>>()?;
    if args.kv_events_replay_buffer == 0 {
        bail!("--kv-events-replay-buffer must be at least 1");
    }
    let kv_events = args.kv_events_endpoint.as_ref().map(|ep| PublisherConfig {
        endpoint: ep.clone(),
        force_bind: args.kv_events_bind,
        topic: args.kv_events_topic.clone(),
        format: match args.kv_events_format {
            KvFormatArg::Array => Format::Array,
            KvFormatArg::Map => Format::Map,
        },
        replay_endpoint: args.kv_events_replay_endpoint.clone(),
        replay_buffer: args.kv_events_replay_buffer,
        drop_every: args.kv_events_drop_every,
    });
    Ok(EmulatorConfig {
        host: args.host.clone(),
        port: args.port,
        engine: engine_config(args)?,
        speed: args.speed,
        instant: args.instant,
        lora_modules,
        kv_events,
        seed: args.seed,
        max_body_bytes: args.max_body_bytes,
        special_tokens: args.special_tokens,
    })
}

/// Run `switchyard engine`.
pub fn run(args: EngineArgs) -> Result<()> {
    let cfg = emulator_config(&args)?;
    if let Some(path) = &args.write_tokenizer {
        let json = switchyard_emulator::tokenizer_json::tokenizer_json_for(args.special_tokens);
        std::fs::write(path, json)
            .with_context(|| format!("--write-tokenizer {}", path.display()))?;
        // The chat template beside it, as in a Hugging Face model directory.
        let config = path.with_file_name("tokenizer_config.json");
        std::fs::write(
            &config,
            switchyard_emulator::tokenizer_json::tokenizer_config_json(),
        )
        .with_context(|| format!("--write-tokenizer: {}", config.display()))?;
    }
    if args.fidelity {
        return switchyard_emulator::block_on(run_fidelity(
            cfg,
            args.fidelity_max_tokens,
            args.fidelity_repeats,
        ))?;
    }
    switchyard_emulator::block_on(serve(cfg))?
}

async fn serve(cfg: EmulatorConfig) -> Result<()> {
    let server = switchyard_emulator::start(cfg).await?;
    // Handlers go in before the address is printed: whoever reads it may
    // signal at once.
    let signal = switchyard_emulator::shutdown_signal()?;
    let mut out = std::io::stdout().lock();
    if let Some(ep) = &server.kv_events_endpoint {
        writeln!(out, "kv-events on {ep}")?;
    }
    if let Some(ep) = &server.kv_events_replay_endpoint {
        writeln!(out, "kv-events-replay on {ep}")?;
    }
    writeln!(out, "listening on http://{}", server.addr)?;
    out.flush()?;
    drop(out);
    tracing::info!(addr = %server.addr, "engine emulator listening");
    server.run_until(signal, Duration::from_secs(5)).await?;
    tracing::info!("stopped");
    Ok(())
}

async fn run_fidelity(mut cfg: EmulatorConfig, max_tokens: u32, reps: u32) -> Result<()> {
    cfg.host = "127.0.0.1".to_string();
    cfg.port = 0;
    cfg.speed = 1.0;
    cfg.instant = false;
    cfg.kv_events = None;
    let need = 8192 + max_tokens + 16;
    cfg.engine.max_model_len = cfg.engine.max_model_len.max(need);
    let engine_cfg = cfg.engine.clone();
    let server = switchyard_emulator::start(cfg).await?;
    let url = format!("http://{}", server.addr);
    println!(
        "fidelity check against {url} (speed 1, {max_tokens} output tokens per request, \
         median of {reps})"
    );
    let cases = fidelity::standard_cases();
    let rows = fidelity::run(&url, &engine_cfg, &cases, reps, max_tokens).await;
    let _ = server.shutdown_within(Duration::from_secs(5)).await;
    let rows = rows?;
    print!("{}", fidelity::format_table(&rows));
    let failed = rows.iter().filter(|r| !r.pass()).count();
    if failed > 0 {
        bail!("{failed} of {} fidelity rows outside ±10%", rows.len());
    }
    println!("all {} rows within ±10%", rows.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: EngineArgs,
    }

    #[test]
    fn parses_flags() {
        let cli = Cli::try_parse_from([
            "x",
            "--port",
            "0",
            "--role",
            "decode",
            "--lora-modules",
            "a=/p/a",
            "b=/p/b",
            "--speed",
            "10",
            "--max-model-len",
            "4096",
        ])
        .unwrap();
        let cfg = emulator_config(&cli.args).unwrap();
        assert_eq!(cfg.port, 0);
        assert_eq!(cfg.lora_modules.len(), 2);
        assert_eq!(cfg.engine.max_model_len, 4096);
        assert_eq!(cfg.engine.role, Role::Decode);
    }

    #[test]
    fn rejects_bad_lora_module() {
        assert!(parse_lora_module("noequals").is_err());
        assert!(parse_lora_module("a=").is_err());
    }
}
