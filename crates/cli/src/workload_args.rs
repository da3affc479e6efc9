//! The workload flags `switchyard sim` and `switchyard bench` share, and the spec they describe.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use switchyard_loadgen::switchyard_workload::{
    AdapterMix, ArrivalProcess, ChatSpec, Count, Delay, GroupSelection, JsonlSpec, PopularityShift,
    SharedPrefixSpec, TraceSpec, WorkloadSpec,
};

/// Workload flags, the same for `switchyard sim` and `switchyard bench`.
#[derive(Debug, Clone, Args)]
pub struct WorkloadArgs {
    /// Workload spec file (JSON `WorkloadSpec`), or a request file ending in .jsonl or
    /// .jsonl.xz; overrides the workload flags below.
    #[arg(long, value_name = "FILE")]
    pub(crate) workload: Option<PathBuf>,
    /// Replay a trace: `mooncake` (the shipped conversation trace) or a Mooncake-format file.
    #[arg(long, value_name = "NAME|FILE")]
    pub(crate) trace: Option<String>,
    /// Trace arrival speed-up (2 = twice the trace's rate).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) rate_scale: f64,
    /// Send at most this many requests (for a trace: keep at most this many rows).
    #[arg(long)]
    pub(crate) max_requests: Option<u64>,
    /// Keep trace rows from this trace time on (seconds).
    #[arg(long)]
    pub(crate) start_s: Option<f64>,
    /// Keep trace rows before this trace time (seconds).
    #[arg(long)]
    pub(crate) end_s: Option<f64>,
    /// Generated shared-prefix groups (SGLang's generated-shared-prefix benchmark).
    #[arg(long)]
    pub(crate) shared_prefix: bool,
    /// Shared-prefix: number of groups (system prompts).
    #[arg(long, default_value_t = 64)]
    pub(crate) groups: u32,
    /// Shared-prefix: requests per group in one epoch.
    #[arg(long, default_value_t = 16)]
    pub(crate) prompts_per_group: u32,
    /// System prompt tokens (default 2048 with --shared-prefix, 0 with --chat).
    #[arg(long)]
    pub(crate) system_prompt_len: Option<u32>,
    /// Shared-prefix: question tokens.
    #[arg(long, default_value_t = 128)]
    pub(crate) question_len: u32,
    /// Output tokens per request (shared-prefix), or per assistant answer (chat).
    #[arg(long, default_value_t = 256)]
    pub(crate) output_len: u32,
    /// Shared-prefix: draw each request's group with Zipf popularity of this exponent.
    #[arg(long)]
    pub(crate) zipf: Option<f64>,
    /// Shared-prefix: total requests (default one epoch: groups × prompts per group).
    #[arg(long)]
    pub(crate) num_requests: Option<u64>,
    /// Multi-turn chat sessions (each turn's prompt is the whole conversation so far).
    #[arg(long)]
    pub(crate) chat: bool,
    /// Chat: number of sessions.
    #[arg(long, default_value_t = 100)]
    pub(crate) sessions: u64,
    /// Chat: turns per session.
    #[arg(long, default_value_t = 5)]
    pub(crate) turns: u32,
    /// Chat: tokens of each user message.
    #[arg(long, default_value_t = 128)]
    pub(crate) user_len: u32,
    /// Chat: mean seconds (exponential) from one turn's arrival to the next turn's.
    #[arg(long, default_value_t = 10.0)]
    pub(crate) think_time: f64,
    /// Poisson arrivals at this rate (requests/s, or sessions/s with --chat) for generated
    /// workloads (default: all at 0); for a trace or a .jsonl file, replaces its timestamps.
    #[arg(long)]
    pub(crate) rate: Option<f64>,
    /// With --rate: gamma-distributed gaps with this coefficient of variation instead of
    /// Poisson (1 = Poisson, > 1 burstier).
    #[arg(long)]
    pub(crate) arrival_cv: Option<f64>,
    /// Give requests LoRA adapters: this many, with Zipf popularity (see --adapter-zipf).
    #[arg(long)]
    pub(crate) adapters: Option<u32>,
    /// Zipf exponent of adapter popularity.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) adapter_zipf: f64,
    /// Popularity shift: after this fraction of the requests (0..=1) the adapter ranking is
    /// replaced by a seeded permutation with a different favourite (needs --adapters).
    #[arg(long, value_name = "FRACTION")]
    pub(crate) adapter_shift_at: Option<f64>,
}

/// Gap process for `--rate` and `--arrival-cv`.
fn arrivals(rate: f64, cv: Option<f64>) -> ArrivalProcess {
    match cv {
        Some(cv) if cv != 1.0 => ArrivalProcess::Gamma { rate, cv },
        _ => ArrivalProcess::Poisson { rate },
    }
}

/// The workload the flags describe.
pub fn workload_spec(a: &WorkloadArgs) -> anyhow::Result<WorkloadSpec> {
    let timed = a.rate.map(|r| arrivals(r, a.arrival_cv));
    let base = if let Some(path) = &a.workload {
        let name = path.to_string_lossy();
        if name.ends_with(".jsonl") || name.ends_with(".jsonl.xz") {
            WorkloadSpec::Jsonl(JsonlSpec {
                path: path.clone(),
                arrivals: timed,
            })
        } else {
            WorkloadSpec::from_file(path).with_context(|| format!("reading {}", path.display()))?
        }
    } else if let Some(trace) = &a.trace {
        WorkloadSpec::Trace(TraceSpec {
            path: if trace == "mooncake" {
                PathBuf::new()
            } else {
                PathBuf::from(trace)
            },
            rate_scale: a.rate_scale,
            start_s: a.start_s,
            end_s: a.end_s,
            max_requests: a.max_requests,
            arrivals: timed,
            ..TraceSpec::default()
        })
    } else if a.shared_prefix {
        WorkloadSpec::SharedPrefix(SharedPrefixSpec {
            num_groups: a.groups,
            prompts_per_group: a.prompts_per_group,
            system_prompt_len: a.system_prompt_len.unwrap_or(2048),
            question_len: a.question_len,
            output_len: a.output_len,
            num_requests: a.num_requests,
            group_selection: match a.zipf {
                Some(exponent) => GroupSelection::Zipf { exponent },
                None => GroupSelection::Shuffled,
            },
            arrivals: timed.unwrap_or(ArrivalProcess::Instant),
            ..SharedPrefixSpec::default()
        })
    } else if a.chat {
        WorkloadSpec::Chat(ChatSpec {
            sessions: a.sessions,
            turns: Count::Fixed(a.turns),
            system_prompt_len: a.system_prompt_len.unwrap_or(0),
            user_len: Count::Fixed(a.user_len),
            assistant_len: Count::Fixed(a.output_len),
            think_time: Delay::Exponential {
                mean_s: a.think_time,
            },
            arrivals: timed.unwrap_or(ArrivalProcess::Instant),
            ..ChatSpec::default()
        })
    } else {
        bail!("choose a workload: --workload FILE, --trace mooncake, --shared-prefix or --chat");
    };
    Ok(match a.adapters {
        Some(adapters) => WorkloadSpec::Adapters {
            workload: Box::new(base),
            mix: AdapterMix {
                adapters,
                zipf_exponent: a.adapter_zipf,
                shift: a
                    .adapter_shift_at
                    .map(|at_fraction| PopularityShift { at_fraction }),
                ..AdapterMix::default()
            },
        },
        None if a.adapter_shift_at.is_some() => bail!("--adapter-shift-at needs --adapters N"),
        None => base,
    })
}
