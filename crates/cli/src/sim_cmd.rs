//! `switchyard sim`: every routing policy over the same workload on a simulated fleet.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use switchyard_core::RouterConfig;
use switchyard_sim::config::{default_engine, groups_for_roles, parse_roles};
use switchyard_sim::switchyard_engine::{EngineConfig, Profile};
use switchyard_sim::switchyard_workload::WorkloadSpec;
use switchyard_sim::{FleetFile, InstanceGroup, KvEventsSim, SimConfig, Split};

use crate::workload_args::{workload_spec, WorkloadArgs};

/// Arguments of `switchyard sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Policies to compare, comma-separated (default: all; with --suite: the baselines kept).
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,

    #[command(flatten)]
    workload: WorkloadArgs,

    /// Instances (all both-role unless --roles or --fleet).
    #[arg(long, default_value_t = 8)]
    instances: u32,
    /// Engine profile file (JSON, or TOML by extension; with --suite: every engine's).
    #[arg(long, value_name = "FILE")]
    profile: Option<PathBuf>,
    /// KV cache blocks per instance.
    #[arg(long)]
    num_gpu_blocks: Option<u32>,
    /// Max running sequences per instance.
    #[arg(long)]
    max_num_seqs: Option<u32>,
    /// Token budget of one engine step.
    #[arg(long)]
    max_num_batched_tokens: Option<u32>,
    /// Longest prompt + output an instance accepts.
    #[arg(long)]
    max_model_len: Option<u32>,
    /// Adapter slots per instance.
    #[arg(long)]
    max_loras: Option<u32>,
    /// Role split such as 4p4d (prefill/decode/both counts); replaces --instances.
    #[arg(long)]
    roles: Option<String>,
    /// Fleet file: `{"groups": [{"count": N, "engine": {EngineConfig}}]}`; replaces the above.
    #[arg(long, value_name = "FILE")]
    fleet: Option<PathBuf>,

    /// Router settings file (JSON `RouterConfig`; its `policy` is ignored; with --suite: every run's).
    #[arg(long, value_name = "FILE")]
    router_config: Option<PathBuf>,
    /// Router replicas, each seeing its share of the traffic.
    #[arg(long, default_value_t = 1)]
    replicas: u32,
    /// How traffic is split among replicas: round-robin or random.
    #[arg(long, default_value = "round-robin")]
    split: Split,
    /// Replicas share every decision and its outcome at once (what `serve --peer` does, without
    /// its network delay: add --replica-sync-delay).
    #[arg(long)]
    replica_sync: bool,
    /// With --replica-sync: seconds from a replica's decision to the others applying it.
    #[arg(long, default_value_t = 0.0, value_name = "SECONDS")]
    replica_sync_delay: f64,
    /// Seconds between metrics scrapes of each instance.
    #[arg(long, default_value_t = 1.0)]
    scrape_interval: f64,
    /// Engines publish KV-cache events to every replica, which matches token prompts exactly.
    #[arg(long)]
    kv_events: bool,
    /// With --kv-events: seconds from a step to a replica applying its events.
    #[arg(long, default_value_t = 0.005, value_name = "SECONDS")]
    kv_event_delay: f64,
    /// With --kv-events: share of event batches lost on the way to each replica.
    #[arg(long, default_value_t = 0.0, value_name = "SHARE")]
    kv_event_loss: f64,
    /// With --kv-events: keep using a stream after a sequence gap (default: fall back to the
    /// approximate index for that engine until it has run 5 s without one).
    #[arg(long)]
    kv_event_no_fallback: bool,
    /// Tell the routers this `max_tokens` for every request while the engines generate the
    /// workload's answer lengths (a client's generous limit; default: each answer's length).
    #[arg(long, value_name = "TOKENS")]
    client_max_tokens: Option<u32>,
    /// The engines share this many cores: while more of them have requests, each step takes
    /// busy engines ÷ cores times its profile time (several llama.cpp servers on one machine);
    /// with --suite: every run's (default: a device each).
    #[arg(long, value_name = "CORES")]
    shared_cores: Option<f64>,
    /// Tell the router each instance's prefill speed from its profile (instead of its prior).
    #[arg(long)]
    prior_from_profile: bool,
    /// Seed of the workload, the replica split and the routers.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// TTFT SLO in seconds for the goodput columns.
    #[arg(long, default_value_t = 2.0)]
    ttft_slo: f64,
    /// Skip the lower-bound row (it keeps every prompt block hash seen in memory).
    #[arg(long)]
    no_lower_bound: bool,
    /// Policy whose per-instance queues are charted (default: cost, if run).
    #[arg(long)]
    queue_policy: Option<String>,
    /// Instances charted in the queue chart (the first ones).
    #[arg(long, default_value_t = 16)]
    queue_instances: usize,
    /// Write results.json, results.md and SVG charts here (with --suite: results.json, suite.md).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,

    /// No progress on stderr (it is drawn only when stderr is a terminal anyway).
    #[arg(long)]
    quiet: bool,

    /// Run the workload suite instead: `cost` against the baselines on ten workloads, at
    /// round-robin's calibrated capacity and in overload, over --seeds; prints one table of
    /// ratios. The workload, fleet and router flags above are ignored, except --router-config,
    /// --client-max-tokens, --profile and --shared-cores.
    #[arg(long)]
    suite: bool,
    /// Suite: seeds of the compared runs.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    seeds: Vec<u64>,
    /// Suite: multiply every workload's request count by this (0.1-0.3 for a quick look).
    #[arg(long, default_value_t = 1.0)]
    suite_scale: f64,
    /// Suite: only these workloads (mooncake, zipf, prefill-heavy, decode-heavy, bursty,
    /// long-tail, lora, few-slots, kv-bound, pd).
    #[arg(long, value_delimiter = ',', value_name = "NAME[,NAME]")]
    suite_only: Vec<String>,
    /// Suite: overload is this many times the calibrated knee rate.
    #[arg(long, default_value_t = 1.3)]
    suite_overload: f64,
    /// Suite: fixed knee rates (requests/s) instead of calibrating, e.g. zipf=80,pd=6.
    #[arg(long, value_delimiter = ',', value_name = "NAME=RATE")]
    suite_rates: Vec<String>,
    /// Suite: simulations run in parallel (results do not depend on it).
    #[arg(long, default_value_t = 1)]
    suite_jobs: usize,
}

fn workload(args: &SimArgs) -> anyhow::Result<WorkloadSpec> {
    workload_spec(&args.workload)
}

/// Reads `--profile` (JSON, or TOML by extension).
fn read_profile(path: &std::path::Path) -> anyhow::Result<Profile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(if path.extension().is_some_and(|e| e == "toml") {
        Profile::from_toml_str(&text)?
    } else {
        Profile::from_json_str(&text)?
    })
}

fn engine_template(args: &SimArgs) -> anyhow::Result<EngineConfig> {
    let mut engine = default_engine();
    if let Some(path) = &args.profile {
        engine.profile = read_profile(path)?;
    }
    if let Some(v) = args.num_gpu_blocks {
        engine.num_gpu_blocks = v;
    }
    if let Some(v) = args.max_num_seqs {
        engine.max_num_seqs = v;
    }
    if let Some(v) = args.max_num_batched_tokens {
        engine.max_num_batched_tokens = v;
    }
    if let Some(v) = args.max_model_len {
        engine.max_model_len = v;
    }
    if let Some(v) = args.max_loras {
        engine.max_loras = v;
    }
    // Keep the default context limit within a smaller KV cache.
    let capacity = u64::from(engine.num_gpu_blocks) * u64::from(engine.block_size);
    if args.max_model_len.is_none() && u64::from(engine.max_model_len) > capacity {
        engine.max_model_len = capacity as u32;
    }
    Ok(engine)
}

fn sim_config(args: &SimArgs) -> anyhow::Result<SimConfig> {
    let fleet = if let Some(path) = &args.fleet {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        FleetFile::from_json_str(&text)?.groups
    } else if let Some(roles) = &args.roles {
        groups_for_roles(&parse_roles(roles)?, &engine_template(args)?)
    } else {
        vec![InstanceGroup {
            count: args.instances,
            engine: engine_template(args)?,
        }]
    };
    let router = router_settings(args)?;
    Ok(SimConfig {
        fleet,
        router,
        replicas: args.replicas,
        split: args.split,
        replica_sync: args.replica_sync,
        replica_sync_delay_s: args.replica_sync_delay,
        scrape_interval_s: args.scrape_interval,
        seed: args.seed,
        ttft_slo_s: args.ttft_slo,
        prior_from_profile: args.prior_from_profile,
        queue_chart_instances: args.queue_instances,
        lower_bound: !args.no_lower_bound,
        model: None,
        kv_events: args.kv_events.then(|| KvEventsSim {
            delay_s: args.kv_event_delay,
            loss: args.kv_event_loss,
            fallback: !args.kv_event_no_fallback,
            ..KvEventsSim::default()
        }),
        client_max_tokens: args.client_max_tokens,
        shared_cores: args.shared_cores,
    })
}

/// The router settings of `--router-config`, or the defaults.
fn router_settings(args: &SimArgs) -> anyhow::Result<RouterConfig> {
    Ok(match &args.router_config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str::<RouterConfig>(&text)
                .with_context(|| format!("parsing {}", path.display()))?
        }
        None => RouterConfig::default(),
    })
}

/// Runs `switchyard sim --suite`.
fn run_suite(args: &SimArgs) -> anyhow::Result<()> {
    let rates = args
        .suite_rates
        .iter()
        .map(|kv| {
            let (name, rate) = kv
                .split_once('=')
                .with_context(|| format!("--suite-rates: `{kv}` is not NAME=RATE"))?;
            let rate: f64 = rate
                .parse()
                .with_context(|| format!("--suite-rates: bad rate in `{kv}`"))?;
            if !(rate.is_finite() && rate > 0.0) {
                bail!("--suite-rates: rate in `{kv}` must be > 0");
            }
            Ok((name.to_string(), rate))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let options = switchyard_sim::suite::SuiteOptions {
        seeds: args.seeds.clone(),
        scale: args.suite_scale,
        only: args.suite_only.clone(),
        policies: args.policies.clone(),
        overload: args.suite_overload,
        rates,
        jobs: args.suite_jobs.max(1),
        router: router_settings(args)?,
        client_max_tokens: args.client_max_tokens,
        profile: args.profile.as_deref().map(read_profile).transpose()?,
        shared_cores: args.shared_cores,
    };
    let started = std::time::Instant::now();
    let results = switchyard_sim::suite::run_suite(&options, &|line| eprintln!("{line}"))?;
    print!("{}", results.text_table());
    println!("wall time: {:.1} s", started.elapsed().as_secs_f64());
    if let Some(dir) = &args.out {
        results.write(dir)?;
        println!("wrote {}", dir.display());
    }
    Ok(())
}

/// One spinner per policy on stderr while the simulation runs (requests so far and simulated
/// time), left on screen when the policy is done.
struct Progress {
    show: bool,
    current: Option<(String, indicatif::ProgressBar, std::time::Instant)>,
}

impl Progress {
    fn new(show: bool) -> Self {
        Progress {
            show,
            current: None,
        }
    }

    fn report(&mut self, policy: &str, requests: u64, clock: f64) {
        if !self.show {
            return;
        }
        if self.current.as_ref().is_none_or(|(p, _, _)| p != policy) {
            self.finish();
            let bar = indicatif::ProgressBar::new_spinner();
            bar.set_style(
                indicatif::ProgressStyle::with_template("{spinner} {prefix:<20} {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
            );
            bar.set_prefix(policy.to_string());
            bar.enable_steady_tick(std::time::Duration::from_millis(200));
            self.current = Some((policy.to_string(), bar, std::time::Instant::now()));
        }
        if let Some((_, bar, _)) = &self.current {
            bar.set_message(format!("{requests} requests, {clock:.0} s simulated"));
        }
    }

    fn finish(&mut self) {
        if let Some((_, bar, started)) = self.current.take() {
            let message = format!(
                "{} (done in {:.1} s)",
                bar.message(),
                started.elapsed().as_secs_f64()
            );
            bar.finish_with_message(message);
        }
    }
}

/// Runs `switchyard sim`.
pub fn run(args: SimArgs) -> anyhow::Result<()> {
    if args.suite {
        return run_suite(&args);
    }
    let spec = workload(&args)?;
    let config = sim_config(&args)?;
    let policies: Vec<String> = if args.policies.is_empty() {
        switchyard_core::policy::POLICY_NAMES
            .iter()
            .map(|p| p.to_string())
            .collect()
    } else {
        args.policies.clone()
    };
    let started = std::time::Instant::now();
    let mut bars = Progress::new(!args.quiet && std::io::stderr().is_terminal());
    let output = switchyard_sim::run_with_progress(
        &config,
        &spec,
        &policies,
        args.queue_policy.as_deref(),
        &mut |policy, requests, clock| bars.report(policy, requests, clock),
    )?;
    bars.finish();
    let wall = started.elapsed().as_secs_f64();
    print!("{}", output.results.text_table());
    let parts: Vec<String> = output
        .timings
        .iter()
        .map(|t| format!("{} {:.2}", t.what, t.wall_s))
        .collect();
    println!("wall time: {wall:.2} s ({})", parts.join(", "));
    match switchyard_sim::peak_memory_kib() {
        Some(kib) => println!("peak memory: {:.1} MiB", kib as f64 / 1024.0),
        None => println!("peak memory: unknown"),
    }
    if let Some(dir) = &args.out {
        switchyard_sim::write_outputs(dir, &output)?;
        println!("wrote {}", dir.display());
    }
    Ok(())
}
