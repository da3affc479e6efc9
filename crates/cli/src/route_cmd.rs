//! `switchyard route`: what the router would decide for one request against a described fleet.
//!
//! A dry run of the routing registry, for checking a fleet file and a policy's reasoning without
//! any engine running.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use serde::Deserialize;
use switchyard_core::models::{resolve, ModelError, Resolution, Via};
use switchyard_core::{
    ChatMessage, EngineMetrics, InstanceSpec, Observation, Prompt, RouteError, RouteRequest,
    Router, RouterConfig,
};

/// Flags of `switchyard route`.
#[derive(Debug, Args)]
pub struct RouteArgs {
    /// Fleet file: the one `serve` and `epp` take (`backends: [...]`, YAML, or TOML/JSON by
    /// extension; every backend needs `models`, a dry run discovers nothing), or the JSON
    /// {"instances": [InstanceSpec...], "metrics": {"name": EngineMetrics}} (engine metrics to
    /// route against).
    #[arg(long)]
    fleet: PathBuf,
    /// Router settings file (JSON, any subset of the keys in docs/core.md).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Policy name (overrides the config): cost, round-robin, random, least-load, power-of-two,
    /// sglang-cache-aware, dynamo-kv, gie, gie-lora, kubeai-chwbl.
    #[arg(long)]
    policy: Option<String>,
    /// Model asked for, resolved as the gateway resolves a request's `model`: an alias
    /// (--model-alias), a base model, an adapter (routed on its base model), else the only base
    /// model of a single-model fleet (unless --strict-models).
    #[arg(long)]
    model: String,
    /// LoRA adapter asked for; --model is then taken as given (not resolved).
    #[arg(long)]
    adapter: Option<String>,
    /// A model alias NAME=MODEL (repeatable), as on `switchyard serve`.
    #[arg(long = "model-alias", value_name = "NAME=MODEL")]
    model_aliases: Vec<String>,
    /// No single-model fallback: an unknown --model is an error, as with `serve --strict-models`.
    #[arg(long)]
    strict_models: bool,
    /// Completion prompt text.
    #[arg(long, conflicts_with_all = ["prompt_file", "chat_file"])]
    prompt: Option<String>,
    /// File holding the completion prompt.
    #[arg(long, conflicts_with = "chat_file")]
    prompt_file: Option<PathBuf>,
    /// File holding chat messages as JSON: [{"role": "...", "content": "..."}].
    #[arg(long)]
    chat_file: Option<PathBuf>,
    /// Generation budget.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// Print the whole decision as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The dry run's own fleet file: instances as the core takes them, and engine metrics.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetFile {
    instances: Vec<InstanceSpec>,
    #[serde(default)]
    metrics: std::collections::BTreeMap<String, EngineMetrics>,
    #[serde(default)]
    model_aliases: std::collections::BTreeMap<String, String>,
}

/// Reads either fleet file: `serve`'s (`backends:`), or the dry run's own (`instances:`).
fn load_fleet(path: &PathBuf) -> anyhow::Result<FleetFile> {
    let text = read(path)?;
    if let Ok(own) = serde_json::from_str::<FleetFile>(&text) {
        return Ok(own);
    }
    let file = switchyard_gateway::config::load_fleet_file(path)
        .with_context(|| format!("invalid fleet file {}", path.display()))?;
    let mut instances = Vec::new();
    for backend in &file.backends {
        if backend.models.is_empty() {
            bail!(
                "{}: backend `{}` lists no models (a dry run cannot ask the engine; add models)",
                path.display(),
                backend.name
            );
        }
        instances.push(backend.instance_spec());
    }
    Ok(FleetFile {
        instances,
        metrics: Default::default(),
        model_aliases: file.model_aliases,
    })
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: String,
}

fn read(path: &PathBuf) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// Runs the command.
pub fn run(args: RouteArgs) -> anyhow::Result<()> {
    let mut config: RouterConfig = match &args.config {
        Some(path) => serde_json::from_str(&read(path)?)
            .with_context(|| format!("invalid config {}", path.display()))?,
        None => RouterConfig::default(),
    };
    if let Some(policy) = &args.policy {
        config.policy = policy.clone();
    }
    let mut router = Router::new(config)?;
    let fleet = load_fleet(&args.fleet)?;
    if fleet.instances.is_empty() {
        bail!("the fleet file lists no instances");
    }
    let mut names = Vec::new();
    let flag_aliases = crate::fleet_args::parse_model_aliases(&args.model_aliases)?;
    let aliases: HashMap<String, String> =
        switchyard_core::models::merge_aliases(&flag_aliases, &fleet.model_aliases)
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.fleet.display()))?;
    for spec in fleet.instances {
        let name = spec.name.clone();
        let id = router
            .add_instance(spec)
            .with_context(|| format!("instance `{name}`"))?;
        names.push((id, name));
    }
    for (name, metrics) in fleet.metrics {
        let Some(id) = router.fleet().id_of(&name) else {
            bail!("metrics given for unknown instance `{name}`");
        };
        router.observe(Observation::MetricsScraped(id, metrics), 0.0)?;
    }
    let text;
    let messages: Vec<Message>;
    let chat: Vec<ChatMessage<'_>>;
    let prompt = if let Some(path) = &args.chat_file {
        messages = serde_json::from_str(&read(path)?)
            .with_context(|| format!("invalid chat file {}", path.display()))?;
        chat = messages
            .iter()
            .map(|m| ChatMessage {
                role: &m.role,
                content: &m.content,
            })
            .collect();
        Prompt::Chat(&chat)
    } else {
        text = match (&args.prompt, &args.prompt_file) {
            (Some(p), _) => p.clone(),
            (None, Some(path)) => read(path)?,
            (None, None) => bail!("give --prompt, --prompt-file or --chat-file"),
        };
        Prompt::Text(&text)
    };
    let resolution = match &args.adapter {
        Some(adapter) => Resolution {
            model: Cow::Borrowed(args.model.as_str()),
            adapter: Some(adapter.as_str()),
            via: Via::Served,
        },
        // The core resolves adapters from the fleet, exactly as for `serve` and `epp`.
        None => resolve(router.fleet(), &aliases, args.strict_models, &args.model).map_err(
            |e| match e {
                // The router's own wording, as before names were resolved here.
                ModelError::Unknown(m) => anyhow::Error::new(RouteError::UnknownModel(m)),
                other => anyhow::Error::new(other),
            },
        )?,
    };
    let note = match resolution.via {
        Via::Served => None,
        Via::Adapter => Some("adapter"),
        Via::Alias => Some("alias"),
        Via::Fallback => Some("the fleet's only model"),
    };
    // Owned: the resolution borrows the fleet, which routing changes.
    let model = resolution.model.into_owned();
    let adapter = resolution.adapter.map(str::to_string);
    let request = RouteRequest {
        adapter: adapter.as_deref(),
        prompt,
        max_tokens: args.max_tokens,
        ..RouteRequest::text(&model, "")
    };
    let decision = router.route(&request, 0.0)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&decision)?);
        return Ok(());
    }
    let name_of = |id| {
        names
            .iter()
            .find(|(i, _)| *i == id)
            .map_or("?", |(_, n)| n.as_str())
    };
    if let Some(why) = note {
        let adapter = adapter.map_or_else(String::new, |a| format!(" adapter `{a}`"));
        println!("model `{}` -> `{model}`{adapter} ({why})", args.model);
    }
    println!(
        "policy {}  prompt ≈ {} tokens  saturated: {}",
        decision.policy, decision.prompt_tokens, decision.saturated
    );
    println!(
        "{:<4} {:<24} {:>10} {:>8} {:>8} {:>8} {:>8}  note",
        "rank", "instance", "score", "wait_s", "prefill", "adapter", "cached"
    );
    let rows = decision.candidates.iter().chain(decision.decode.iter());
    for (rank, c) in rows.enumerate() {
        let note = match c.excluded {
            Some(reason) => format!("excluded: {reason:?}"),
            None if decision.decode.iter().any(|d| d.instance == c.instance) => {
                "decode".to_string()
            }
            None => String::new(),
        };
        println!(
            "{:<4} {:<24} {:>10.4} {:>8.4} {:>8.4} {:>8.3} {:>8}  {note}",
            rank + 1,
            name_of(c.instance),
            c.score,
            c.terms.wait_s,
            c.terms.prefill_s,
            c.terms.adapter_s,
            c.terms.cached_tokens
        );
    }
    Ok(())
}
