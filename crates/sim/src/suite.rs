//! The workload suite: `cost` against every baseline on eight kinds of workload, at two loads
//! each (near round-robin's capacity, and overload), over several seeds, summarised in one
//! table of ratios.
//!
//! Each workload is a [`WorkloadSpec`] built here with its own fleet. Its load is measured, not
//! guessed ([`calibrate`]): round-robin runs at a light rate, then the rate is searched
//! (doubling or halving, then geometric bisection) for the largest at which round-robin's TTFT
//! p50 and p99 both stay within [`KNEE_FACTOR`]× their light-load values (and the floors
//! [`KNEE_P50_FLOOR_S`], [`KNEE_P99_FLOOR_S`]; the p50 test matters where prompt lengths are
//! long-tailed and the p99 is a few huge prompts' own prefill). That rate is the `knee` load; `overload` is [`SuiteOptions::overload`] times it. Calibration always
//! uses seed [`CALIBRATION_SEED`], so the loads do not depend on `--seeds`, and round-robin does
//! not depend on the `cost` policy, so changing `cost` never moves them.
//!
//! For every workload × load and seed, each of `cost`'s mean TTFT, p99 TTFT and p99 inter-token
//! latency is divided by the best baseline's on that seed; the table gives the median and range
//! of those ratios over the seeds (below 1: `cost` is better) and which baseline was best.
//! Everything is deterministic per seed: no wall-clock figure enters [`SuiteResults`].

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use switchyard_core::RouterConfig;
use switchyard_engine::{Profile, Role};
use switchyard_workload::{
    read_trace, AdapterMix, ArrivalProcess, ChatSpec, Count, Delay, GroupSelection, RequestStream,
    SharedPrefixSpec, TraceReplay, TraceRow, TraceSpec, WorkloadSpec, DEFAULT_MODEL,
};

use crate::config::{default_engine, groups_for_roles, InstanceGroup, SimConfig};
use crate::driver::simulate;
use crate::error::{Result, SimError};
use crate::metrics::{summarize, PolicySummary};

/// Seed of every calibration run (the loads must not move with `--seeds`).
pub const CALIBRATION_SEED: u64 = 1;
/// Round-robin is saturated when its TTFT p50 or p99 exceeds this many times its light-load
/// value and the floor below.
pub const KNEE_FACTOR: f64 = 5.0;
/// Floor of the p50 threshold, seconds.
pub const KNEE_P50_FLOOR_S: f64 = 0.25;
/// Floor of the p99 threshold, seconds.
pub const KNEE_P99_FLOOR_S: f64 = 1.0;
/// The light load of calibration, as a fraction of the workload's starting guess.
const LIGHT_FRACTION: f64 = 0.125;
/// A light load is light when halving it leaves round-robin's TTFT p50 above this share of its
/// value: requests no longer queue. The starting guesses are an H100's; on a slower engine
/// (`SuiteOptions::profile`) the first light load can already queue, and thresholds taken from
/// it were never crossed (the search ran off to a flood of the whole workload at once).
const LIGHT_SETTLED: f64 = 0.8;
/// Halvings of the light load at most while it still queues (2^-8 of the first light load).
const MAX_LIGHT_HALVINGS: u32 = 8;
/// Geometric bisection steps after the bracket is found (a factor-2 bracket to 2^(1/16) ≈ 4 %).
const BISECTIONS: u32 = 4;
/// Fewest requests a scaled workload keeps.
const MIN_REQUESTS: u64 = 20;

/// One workload of the suite.
#[derive(Debug, Clone)]
pub struct SuiteWorkload {
    /// Short name (`--suite-only` takes these).
    pub name: &'static str,
    /// One line on what it is.
    pub about: &'static str,
    /// The workload at its starting guess of a rate ([`with_rate`] changes it).
    pub spec: WorkloadSpec,
    /// The fleet.
    pub fleet: Vec<InstanceGroup>,
    /// Starting guess of round-robin's capacity, requests/s (only where the search begins).
    pub guess_rate: f64,
    /// Policies run: `cost` first, then the baselines.
    pub policies: Vec<String>,
}

/// Every policy of the core, `cost` first; `gie-lora` only when `adapters`.
fn policies(adapters: bool) -> Vec<String> {
    switchyard_core::policy::POLICY_NAMES
        .iter()
        .filter(|p| adapters || **p != "gie-lora")
        .map(|p| p.to_string())
        .collect()
}

fn instances(count: u32) -> Vec<InstanceGroup> {
    vec![InstanceGroup {
        count,
        engine: default_engine(),
    }]
}

fn scaled(n: u64, scale: f64) -> u64 {
    ((n as f64 * scale).round() as u64).max(MIN_REQUESTS)
}

fn shared_prefix(n: u64, arrivals: ArrivalProcess) -> SharedPrefixSpec {
    SharedPrefixSpec {
        num_groups: 128,
        prompts_per_group: 16,
        system_prompt_len: 2048,
        question_len: 128,
        output_len: 256,
        num_requests: Some(n),
        group_selection: GroupSelection::Zipf { exponent: 1.1 },
        arrivals,
        ..SharedPrefixSpec::default()
    }
}

/// Single-turn chat requests without a system prompt: nothing shared between requests.
fn single_turns(n: u64, rate: f64, user_len: Count, assistant_len: Count) -> WorkloadSpec {
    WorkloadSpec::Chat(ChatSpec {
        sessions: n,
        turns: Count::Fixed(1),
        system_prompt_len: 0,
        user_len,
        assistant_len,
        think_time: Delay::Fixed { seconds: 0.0 },
        arrivals: ArrivalProcess::Poisson { rate },
        ..ChatSpec::default()
    })
}

/// The suite's workloads, in table order, with request counts multiplied by `scale`.
pub fn workloads(scale: f64) -> Vec<SuiteWorkload> {
    let trace = |n: u64| {
        WorkloadSpec::Trace(TraceSpec {
            max_requests: Some(scaled(n, scale)),
            ..TraceSpec::default()
        })
    };
    vec![
        SuiteWorkload {
            name: "mooncake",
            about: "prefix-heavy multi-turn: the first 2,000 Mooncake trace requests, rate-scaled",
            spec: trace(2000),
            fleet: instances(8),
            guess_rate: 10.0,
            policies: policies(false),
        },
        SuiteWorkload {
            name: "zipf",
            about: "shared prefix: 128 groups of 2,048-token system prompts, Zipf 1.1, Poisson",
            spec: WorkloadSpec::SharedPrefix(shared_prefix(
                scaled(8000, scale),
                ArrivalProcess::Poisson { rate: 80.0 },
            )),
            fleet: instances(8),
            guess_rate: 80.0,
            policies: policies(false),
        },
        SuiteWorkload {
            name: "prefill-heavy",
            about: "no reuse: 4k-8k-token prompts, 16-64 output tokens, Poisson",
            spec: single_turns(
                scaled(3000, scale),
                40.0,
                Count::Uniform {
                    min: 4096,
                    max: 8192,
                },
                Count::Uniform { min: 16, max: 64 },
            ),
            fleet: instances(8),
            guess_rate: 40.0,
            policies: policies(false),
        },
        SuiteWorkload {
            name: "decode-heavy",
            about: "no reuse: 128-256-token prompts, 512-1,024 output tokens, Poisson",
            spec: single_turns(
                scaled(6000, scale),
                40.0,
                Count::Uniform { min: 128, max: 256 },
                Count::Uniform {
                    min: 512,
                    max: 1024,
                },
            ),
            fleet: instances(4),
            guess_rate: 40.0,
            policies: policies(false),
        },
        SuiteWorkload {
            name: "bursty",
            about: "the zipf workload with gamma arrivals of CV 4",
            spec: WorkloadSpec::SharedPrefix(shared_prefix(
                scaled(8000, scale),
                ArrivalProcess::Gamma {
                    rate: 60.0,
                    cv: 4.0,
                },
            )),
            fleet: instances(8),
            guess_rate: 60.0,
            policies: policies(false),
        },
        SuiteWorkload {
            name: "long-tail",
            about: "no reuse: log-normal prompts (median 1,024, sigma 1.2, 32-32,768 tokens), \
                    32-512 output tokens, Poisson",
            spec: single_turns(
                scaled(4000, scale),
                30.0,
                Count::LogNormal {
                    median: 1024,
                    sigma: 1.2,
                    min: 32,
                    max: 32_768,
                },
                Count::Uniform { min: 32, max: 512 },
            ),
            fleet: instances(8),
            guess_rate: 30.0,
            policies: policies(false),
        },
        SuiteWorkload {
            name: "lora",
            about: "the zipf workload with 32 adapters (Zipf 1.0) on 8 instances of 4 slots",
            spec: WorkloadSpec::Adapters {
                workload: Box::new(WorkloadSpec::SharedPrefix(shared_prefix(
                    scaled(6000, scale),
                    ArrivalProcess::Poisson { rate: 40.0 },
                ))),
                mix: AdapterMix {
                    adapters: 32,
                    zipf_exponent: 1.0,
                    ..AdapterMix::default()
                },
            },
            fleet: vec![InstanceGroup {
                count: 8,
                engine: switchyard_engine::EngineConfig {
                    max_loras: 4,
                    ..default_engine()
                },
            }],
            guess_rate: 40.0,
            policies: policies(true),
        },
        SuiteWorkload {
            name: "few-slots",
            about: "the mooncake workload on engines of 4 sequence slots (llama.cpp-like): \
                    requests queue for a slot, not for prefill",
            spec: trace(2000),
            fleet: vec![InstanceGroup {
                count: 8,
                engine: switchyard_engine::EngineConfig {
                    max_num_seqs: 4,
                    ..default_engine()
                },
            }],
            guess_rate: 6.0,
            policies: policies(false),
        },
        SuiteWorkload {
            name: "kv-bound",
            about: "no reuse, KV-bound: log-normal prompts (median 200) and answers (median 400) \
                    on 4 engines of 2,000 KV blocks: the KV cache runs out before compute",
            spec: single_turns(
                scaled(4000, scale),
                35.0,
                Count::LogNormal {
                    median: 200,
                    sigma: 1.0,
                    min: 16,
                    max: 4096,
                },
                Count::LogNormal {
                    median: 400,
                    sigma: 0.8,
                    min: 16,
                    max: 2048,
                },
            ),
            fleet: vec![InstanceGroup {
                count: 4,
                engine: switchyard_engine::EngineConfig {
                    num_gpu_blocks: 2000,
                    max_model_len: 8192,
                    ..default_engine()
                },
            }],
            guess_rate: 35.0,
            policies: policies(false),
        },
        SuiteWorkload {
            name: "pd",
            about: "disaggregated 4 prefill + 4 decode: the mooncake workload",
            spec: trace(2000),
            fleet: groups_for_roles(&[(4, Role::Prefill), (4, Role::Decode)], &default_engine()),
            guess_rate: 6.0,
            policies: policies(false),
        },
    ]
}

/// The names of the suite's workloads.
pub fn workload_names() -> Vec<&'static str> {
    workloads(1.0).iter().map(|w| w.name).collect()
}

/// `spec` with its arrival rate set to `rate` requests/s. A trace keeps its own spacing and is
/// rate-scaled (its native rate is `trace_rate`, requests/s of the slice); chat sessions are
/// single-turn here, so the session rate is the request rate.
pub fn with_rate(spec: &WorkloadSpec, rate: f64, trace_rate: f64) -> WorkloadSpec {
    fn set(p: &ArrivalProcess, rate: f64) -> ArrivalProcess {
        match *p {
            ArrivalProcess::Gamma { cv, .. } => ArrivalProcess::Gamma { rate, cv },
            ArrivalProcess::Constant { .. } => ArrivalProcess::Constant { rate },
            _ => ArrivalProcess::Poisson { rate },
        }
    }
    match spec {
        WorkloadSpec::Trace(t) => WorkloadSpec::Trace(TraceSpec {
            rate_scale: rate / trace_rate,
            ..t.clone()
        }),
        WorkloadSpec::SharedPrefix(s) => WorkloadSpec::SharedPrefix(SharedPrefixSpec {
            arrivals: set(&s.arrivals, rate),
            ..s.clone()
        }),
        WorkloadSpec::Chat(c) => WorkloadSpec::Chat(ChatSpec {
            arrivals: set(&c.arrivals, rate),
            ..c.clone()
        }),
        WorkloadSpec::Jsonl(j) => WorkloadSpec::Jsonl(switchyard_workload::JsonlSpec {
            arrivals: Some(set(
                j.arrivals.as_ref().unwrap_or(&ArrivalProcess::Instant),
                rate,
            )),
            ..j.clone()
        }),
        WorkloadSpec::Adapters { workload, mix } => WorkloadSpec::Adapters {
            workload: Box::new(with_rate(workload, rate, trace_rate)),
            mix: mix.clone(),
        },
    }
}

/// What the suite runs.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteOptions {
    /// Seeds of the compared runs.
    pub seeds: Vec<u64>,
    /// Request counts are multiplied by this (quick mode: 0.1-0.3).
    pub scale: f64,
    /// Only these workloads (all when empty).
    pub only: Vec<String>,
    /// Only these policies where a workload runs them (all when empty; `cost` always runs).
    pub policies: Vec<String>,
    /// Overload = this × the knee rate.
    pub overload: f64,
    /// Fixed knee rates (requests/s) by workload name: those workloads skip calibration.
    pub rates: Vec<(String, f64)>,
    /// Runs in parallel (threads).
    #[serde(skip)]
    pub jobs: usize,
    /// Router settings of every run, baselines and calibration included (the policy of each
    /// run is its own): a changed default is judged on the same loads.
    pub router: RouterConfig,
    /// What every run's routers are told as each request's `max_tokens`
    /// ([`crate::SimConfig::client_max_tokens`]; `None`: each answer's length).
    pub client_max_tokens: Option<u32>,
    /// The step-time model of every engine (`None`: each workload's own, the default H100
    /// profile): the suite on an engine the defaults were not tuned on. Knee rates are
    /// calibrated on it, so the loads stay comparable.
    pub profile: Option<Profile>,
    /// Cores every run's engines share ([`crate::SimConfig::shared_cores`]; `None`: a device
    /// each).
    pub shared_cores: Option<f64>,
}

impl Default for SuiteOptions {
    fn default() -> Self {
        SuiteOptions {
            seeds: vec![1, 2, 3],
            scale: 1.0,
            only: Vec::new(),
            policies: Vec::new(),
            overload: 1.3,
            rates: Vec::new(),
            jobs: 1,
            router: RouterConfig::default(),
            client_max_tokens: None,
            profile: None,
            shared_cores: None,
        }
    }
}

/// One round-robin run of the calibration.
#[derive(Debug, Clone, Serialize)]
pub struct CalibrationStep {
    /// Offered rate, requests/s.
    pub rate: f64,
    /// Round-robin's TTFT p50, seconds.
    pub ttft_p50: f64,
    /// Round-robin's TTFT p99, seconds.
    pub ttft_p99: f64,
    /// Over the threshold.
    pub saturated: bool,
}

/// How a workload's knee rate was found.
#[derive(Debug, Clone, Serialize)]
pub struct Calibration {
    /// The knee rate, requests/s.
    pub knee_rate: f64,
    /// Round-robin's p50 TTFT threshold, seconds (0 when the rate was given).
    pub threshold_p50_s: f64,
    /// Round-robin's p99 TTFT threshold, seconds (0 when the rate was given).
    pub threshold_p99_s: f64,
    /// The runs, in order (the first is the light load); empty when the rate was given.
    pub steps: Vec<CalibrationStep>,
}

/// One policy's run at one load and seed.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteRun {
    /// Workload name.
    pub workload: String,
    /// `knee` or `overload`.
    pub load: String,
    /// Offered rate, requests/s.
    pub rate: f64,
    /// Seed.
    pub seed: u64,
    /// The results row.
    pub summary: PolicySummary,
}

/// Median, smallest and largest over the seeds, and the baseline that was best most often.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RatioStat {
    /// Median over seeds (`cost` ÷ best baseline; below 1 `cost` is better).
    pub median: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
    /// The baseline best on most seeds (ties: the first in policy order).
    pub best: String,
    /// On how many seeds it was best.
    pub best_seeds: usize,
}

/// One line of the suite table: one workload at one load.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SuiteLine {
    /// Workload name.
    pub workload: String,
    /// `knee` or `overload`.
    pub load: String,
    /// Offered rate, requests/s.
    pub rate: f64,
    /// Mean TTFT ratio.
    pub ttft_mean: RatioStat,
    /// p99 TTFT ratio.
    pub ttft_p99: RatioStat,
    /// p99 inter-token latency ratio.
    pub itl_p99: RatioStat,
    /// `cost`'s preemptions (median over seeds).
    pub cost_preemptions: f64,
    /// The best-on-mean-TTFT baseline's preemptions (median over seeds).
    pub best_preemptions: f64,
    /// `cost`'s cached share of prompt tokens (median over seeds).
    pub cost_cached: f64,
    /// The best-on-mean-TTFT baseline's cached share (median over seeds).
    pub best_cached: f64,
}

/// A workload's description in the results.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteWorkloadInfo {
    /// Name.
    pub name: String,
    /// What it is.
    pub about: String,
    /// Requests of one run.
    pub requests: u64,
    /// Instances and roles, e.g. `8 both`.
    pub fleet: String,
    /// Policies run.
    pub policies: Vec<String>,
    /// The workload at the knee rate.
    pub spec: serde_json::Value,
    /// How the knee was found.
    pub calibration: Calibration,
}

/// Everything the suite produced (deterministic per seed).
#[derive(Debug, Clone, Serialize)]
pub struct SuiteResults {
    /// The options.
    pub options: SuiteOptions,
    /// The workloads run.
    pub workloads: Vec<SuiteWorkloadInfo>,
    /// The table.
    pub lines: Vec<SuiteLine>,
    /// Every policy's run.
    pub runs: Vec<SuiteRun>,
}

fn fleet_text(fleet: &[InstanceGroup]) -> String {
    let mut counts: Vec<(Role, u32)> = Vec::new();
    for g in fleet {
        match counts.iter_mut().find(|(r, _)| *r == g.engine.role) {
            Some((_, c)) => *c += g.count,
            None => counts.push((g.engine.role, g.count)),
        }
    }
    counts
        .iter()
        .map(|(r, c)| format!("{c} {r}"))
        .collect::<Vec<_>>()
        .join(" + ")
}

/// A trace file and its block size.
type TraceKey = (std::path::PathBuf, u32);

/// A workload ready to run: the trace rows read once.
struct Prepared {
    workload: SuiteWorkload,
    rows: Option<Arc<Vec<TraceRow>>>,
    /// Native rate of the trace slice, requests/s (1 for generated workloads).
    trace_rate: f64,
    requests: u64,
    /// Router settings of every run (the policy comes from the run).
    router: RouterConfig,
    /// See [`SuiteOptions::client_max_tokens`].
    client_max_tokens: Option<u32>,
    /// See [`SuiteOptions::shared_cores`].
    shared_cores: Option<f64>,
}

impl Prepared {
    /// `traces` keeps the trace files read so far (by path and block size), read once each.
    fn new(
        workload: SuiteWorkload,
        traces: &mut Vec<(TraceKey, Arc<Vec<TraceRow>>)>,
    ) -> Result<Prepared> {
        let mut rows = None;
        let mut trace_rate = 1.0;
        if let WorkloadSpec::Trace(t) = &workload.spec {
            let key = (t.resolved_path(), t.block_tokens);
            let all = match traces.iter().find(|(k, _)| *k == key) {
                Some((_, rows)) => rows.clone(),
                None => {
                    let rows = Arc::new(read_trace(&key.0, key.1)?);
                    traces.push((key, rows.clone()));
                    rows
                }
            };
            let n = t
                .max_requests
                .map_or(all.len(), |m| all.len().min(m as usize));
            let kept: Vec<TraceRow> = all[..n].to_vec();
            let span = match (kept.first(), kept.last()) {
                (Some(a), Some(b)) => (b.timestamp - a.timestamp) / 1000.0,
                _ => 0.0,
            };
            if span > 0.0 {
                trace_rate = (kept.len() - 1) as f64 / span;
            }
            rows = Some(Arc::new(kept));
        }
        let requests = match &rows {
            Some(r) => r.len() as u64,
            None => workload.spec.build(CALIBRATION_SEED)?.count() as u64,
        };
        Ok(Prepared {
            workload,
            rows,
            trace_rate,
            requests,
            router: RouterConfig::default(),
            client_max_tokens: None,
            shared_cores: None,
        })
    }

    fn spec(&self, rate: f64) -> WorkloadSpec {
        with_rate(&self.workload.spec, rate, self.trace_rate)
    }

    fn stream(&self, rate: f64, seed: u64) -> Result<RequestStream> {
        let spec = self.spec(rate);
        match (&spec, &self.rows) {
            (WorkloadSpec::Trace(t), Some(rows)) => {
                Ok(Box::new(TraceReplay::new(rows.as_ref().clone(), t, seed)?))
            }
            _ => Ok(spec.build(seed)?),
        }
    }

    fn config(&self, seed: u64) -> SimConfig {
        SimConfig {
            fleet: self.workload.fleet.clone(),
            seed,
            queue_chart_instances: 0,
            lower_bound: false,
            model: Some(DEFAULT_MODEL.to_string()),
            router: self.router.clone(),
            client_max_tokens: self.client_max_tokens,
            shared_cores: self.shared_cores,
            ..SimConfig::default()
        }
    }

    fn run(&self, policy: &str, rate: f64, seed: u64) -> Result<PolicySummary> {
        let config = self.config(seed);
        let mut data = simulate(&config, policy, DEFAULT_MODEL, self.stream(rate, seed)?)?;
        let mut summary = summarize(policy, &data.records, &data.instances, config.ttft_slo_s).0;
        (summary.ttft_error_p50, summary.ttft_error_p90) =
            crate::metrics::error_quantiles(&mut data.ttft_errors);
        (summary.cached_error_p50, summary.cached_error_p90) =
            crate::metrics::error_quantiles(&mut data.cached_errors);
        Ok(summary)
    }
}

/// Finds the knee rate of a workload: see the module docs.
fn calibrate(p: &Prepared, log: &(dyn Fn(&str) + Sync)) -> Result<Calibration> {
    let mut steps: Vec<CalibrationStep> = Vec::new();
    let mut probe = |rate: f64, (t50, t99): (f64, f64)| -> Result<CalibrationStep> {
        let s = p.run("round-robin", rate, CALIBRATION_SEED)?;
        let saturated = s.ttft.p50 > t50 || s.ttft.p99 > t99;
        log(&format!(
            "  {} calibration: round-robin at {rate:.3} req/s: TTFT p50 {:.3} s, p99 {:.3} s{}",
            p.workload.name,
            s.ttft.p50,
            s.ttft.p99,
            if saturated { " (saturated)" } else { "" }
        ));
        let step = CalibrationStep {
            rate,
            ttft_p50: s.ttft.p50,
            ttft_p99: s.ttft.p99,
            saturated,
        };
        steps.push(step.clone());
        Ok(step)
    };
    let guess = p.workload.guess_rate;
    let unsaturable = (f64::INFINITY, f64::INFINITY);
    let mut light_rate = guess * LIGHT_FRACTION;
    let mut light = probe(light_rate, unsaturable)?;
    for _ in 0..MAX_LIGHT_HALVINGS {
        let lighter = probe(light_rate / 2.0, unsaturable)?;
        if lighter.ttft_p50 >= LIGHT_SETTLED * light.ttft_p50 {
            break;
        }
        light = lighter;
        light_rate /= 2.0;
    }
    // The search starts no higher than eight times the light load.
    let guess = guess.min(light_rate / LIGHT_FRACTION);
    let threshold = (
        (KNEE_FACTOR * light.ttft_p50).max(KNEE_P50_FLOOR_S),
        (KNEE_FACTOR * light.ttft_p99).max(KNEE_P99_FLOOR_S),
    );
    // Bracket: lo not saturated, hi saturated.
    let (mut lo, mut hi);
    if probe(guess, threshold)?.saturated {
        hi = guess;
        lo = guess / 2.0;
        while probe(lo, threshold)?.saturated {
            hi = lo;
            lo /= 2.0;
            if lo < light_rate {
                // Saturated at the light load's order: keep the light rate.
                lo = light_rate;
                break;
            }
        }
    } else {
        lo = guess;
        hi = guess * 2.0;
        while !probe(hi, threshold)?.saturated {
            lo = hi;
            hi *= 2.0;
            if hi > guess * 64.0 {
                break;
            }
        }
    }
    for _ in 0..BISECTIONS {
        let mid = (lo * hi).sqrt();
        if probe(mid, threshold)?.saturated {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(Calibration {
        knee_rate: lo,
        threshold_p50_s: threshold.0,
        threshold_p99_s: threshold.1,
        steps,
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// `cost` ÷ best baseline per seed: `rows[s]` is seed `s`'s summaries, `cost` first.
fn ratio(rows: &[&[PolicySummary]], metric: fn(&PolicySummary) -> f64) -> RatioStat {
    let mut ratios = Vec::new();
    let mut wins: Vec<(String, usize)> = Vec::new();
    for seed_rows in rows {
        let Some((cost, baselines)) = seed_rows.split_first() else {
            continue;
        };
        let Some(best) = baselines
            .iter()
            .min_by(|a, b| metric(a).total_cmp(&metric(b)))
        else {
            continue;
        };
        ratios.push(metric(cost) / metric(best));
        match wins.iter_mut().find(|(n, _)| *n == best.policy) {
            Some((_, c)) => *c += 1,
            None => wins.push((best.policy.clone(), 1)),
        }
    }
    // Ties go to the first in policy order (the order of first appearance is seed order).
    let order = |n: &str| {
        rows.first()
            .and_then(|r| r.iter().position(|s| s.policy == n))
            .unwrap_or(usize::MAX)
    };
    wins.sort_by(|a, b| b.1.cmp(&a.1).then(order(&a.0).cmp(&order(&b.0))));
    let (best, best_seeds) = wins.first().cloned().unwrap_or_default();
    RatioStat {
        min: ratios.iter().copied().fold(f64::INFINITY, f64::min),
        max: ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        median: median(&mut ratios),
        best,
        best_seeds,
    }
}

fn line(workload: &str, load: &str, rate: f64, rows: &[&[PolicySummary]]) -> SuiteLine {
    let best_on_mean = |r: &[PolicySummary]| -> Option<PolicySummary> {
        r.get(1..)?
            .iter()
            .min_by(|a, b| a.ttft.mean.total_cmp(&b.ttft.mean))
            .cloned()
    };
    let of = |f: fn(&PolicySummary) -> f64, cost: bool| {
        let mut v: Vec<f64> = rows
            .iter()
            .filter_map(|r| {
                if cost {
                    r.first().map(f)
                } else {
                    best_on_mean(r).map(|s| f(&s))
                }
            })
            .collect();
        median(&mut v)
    };
    SuiteLine {
        workload: workload.to_string(),
        load: load.to_string(),
        rate,
        ttft_mean: ratio(rows, |s| s.ttft.mean),
        ttft_p99: ratio(rows, |s| s.ttft.p99),
        itl_p99: ratio(rows, |s| s.itl_p99),
        cost_preemptions: of(|s| s.preemptions as f64, true),
        best_preemptions: of(|s| s.preemptions as f64, false),
        cost_cached: of(|s| s.cache_share, true),
        best_cached: of(|s| s.cache_share, false),
    }
}

/// Runs the suite; `log` gets progress lines (with wall times: keep them out of results).
pub fn run_suite(options: &SuiteOptions, log: &(dyn Fn(&str) + Sync)) -> Result<SuiteResults> {
    if options.seeds.is_empty() {
        return Err(SimError::Setting {
            key: "seeds",
            reason: "needs at least one seed".into(),
        });
    }
    if !(options.scale.is_finite() && options.scale > 0.0) {
        return Err(SimError::Setting {
            key: "suite-scale",
            reason: "must be > 0".into(),
        });
    }
    if !(options.overload.is_finite() && options.overload > 0.0) {
        return Err(SimError::Setting {
            key: "suite-overload",
            reason: "must be > 0".into(),
        });
    }
    let all = workloads(options.scale);
    for name in options
        .only
        .iter()
        .chain(options.rates.iter().map(|(n, _)| n))
    {
        if !all.iter().any(|w| w.name == name) {
            return Err(SimError::Setting {
                key: "suite-only",
                reason: format!(
                    "unknown suite workload `{name}`; choose from {}",
                    workload_names().join(", ")
                ),
            });
        }
    }
    for p in &options.policies {
        if !switchyard_core::policy::POLICY_NAMES.contains(&p.as_str()) {
            return Err(SimError::Setting {
                key: "policies",
                reason: format!(
                    "unknown policy `{p}`; choose from {}",
                    switchyard_core::policy::POLICY_NAMES.join(", ")
                ),
            });
        }
    }
    let chosen: Vec<SuiteWorkload> = all
        .into_iter()
        .filter(|w| options.only.is_empty() || options.only.iter().any(|n| n == w.name))
        .map(|mut w| {
            if !options.policies.is_empty() {
                w.policies
                    .retain(|p| p == "cost" || options.policies.contains(p));
            }
            if let Some(profile) = &options.profile {
                for group in &mut w.fleet {
                    group.engine.profile = profile.clone();
                }
            }
            w
        })
        .collect();
    if let Some(w) = chosen.iter().find(|w| w.policies.len() < 2) {
        return Err(SimError::Setting {
            key: "policies",
            reason: format!("workload `{}` would run no baseline", w.name),
        });
    }
    let mut traces = Vec::new();
    let prepared = chosen
        .into_iter()
        .map(|w| {
            Prepared::new(w, &mut traces).map(|p| Prepared {
                router: options.router.clone(),
                client_max_tokens: options.client_max_tokens,
                shared_cores: options.shared_cores,
                ..p
            })
        })
        .collect::<Result<Vec<_>>>()?;

    // Calibrate (each workload's search is sequential; workloads run in parallel).
    let calibrations: Vec<Calibration> = parallel(options.jobs, prepared.len(), |i| {
        let p = &prepared[i];
        match options.rates.iter().find(|(n, _)| n == p.workload.name) {
            Some(&(_, rate)) => Ok(Calibration {
                knee_rate: rate,
                threshold_p50_s: 0.0,
                threshold_p99_s: 0.0,
                steps: Vec::new(),
            }),
            None => {
                let c = calibrate(p, log)?;
                log(&format!(
                    "{}: knee at {:.3} req/s (round-robin TTFT thresholds p50 {:.3} s, p99 {:.3} s)",
                    p.workload.name, c.knee_rate, c.threshold_p50_s, c.threshold_p99_s
                ));
                Ok(c)
            }
        }
    })?;

    // Every (workload, load, seed, policy).
    let loads = [("knee", 1.0), ("overload", options.overload)];
    let mut jobs = Vec::new();
    for (w, p) in prepared.iter().enumerate() {
        for (l, &(_, factor)) in loads.iter().enumerate() {
            for &seed in &options.seeds {
                for policy in &p.workload.policies {
                    jobs.push((w, l, calibrations[w].knee_rate * factor, seed, policy));
                }
            }
        }
    }
    let done = AtomicUsize::new(0);
    let summaries = parallel(options.jobs, jobs.len(), |j| {
        let (w, l, rate, seed, policy) = jobs[j];
        let started = std::time::Instant::now();
        let s = prepared[w].run(policy, rate, seed)?;
        let n = done.fetch_add(1, Ordering::Relaxed) + 1;
        log(&format!(
            "  [{n}/{}] {} {} seed {seed} {policy}: TTFT mean {:.3} s, p99 {:.3} s ({:.1} s)",
            jobs.len(),
            prepared[w].workload.name,
            loads[l].0,
            s.ttft.mean,
            s.ttft.p99,
            started.elapsed().as_secs_f64()
        ));
        Ok(s)
    })?;

    let mut runs = Vec::with_capacity(jobs.len());
    let mut lines = Vec::new();
    let mut k = 0;
    for (w, p) in prepared.iter().enumerate() {
        for &(load, factor) in &loads {
            let rate = calibrations[w].knee_rate * factor;
            let per_seed = p.workload.policies.len();
            let block = &summaries[k..k + per_seed * options.seeds.len()];
            let rows: Vec<&[PolicySummary]> = block.chunks(per_seed).collect();
            lines.push(line(p.workload.name, load, rate, &rows));
            for (i, s) in block.iter().enumerate() {
                runs.push(SuiteRun {
                    workload: p.workload.name.to_string(),
                    load: load.to_string(),
                    rate,
                    seed: options.seeds[i / per_seed],
                    summary: s.clone(),
                });
            }
            k += block.len();
        }
    }
    let workloads = prepared
        .iter()
        .zip(&calibrations)
        .map(|(p, c)| SuiteWorkloadInfo {
            name: p.workload.name.to_string(),
            about: p.workload.about.to_string(),
            requests: p.requests,
            fleet: fleet_text(&p.workload.fleet),
            policies: p.workload.policies.clone(),
            spec: serde_json::to_value(p.spec(c.knee_rate)).unwrap_or(serde_json::Value::Null),
            calibration: c.clone(),
        })
        .collect();
    Ok(SuiteResults {
        options: options.clone(),
        workloads,
        lines,
        runs,
    })
}

/// `f(0..n)` on `jobs` threads, results in index order; the first error wins.
fn parallel<T: Send>(
    jobs: usize,
    n: usize,
    f: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    if jobs <= 1 || n <= 1 {
        return (0..n).map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<Result<T>>>> = Mutex::new((0..n).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(n) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let r = f(i);
                let failed = r.is_err();
                // A poisoned lock means another job panicked; that panic propagates from scope.
                if let Ok(mut s) = slots.lock() {
                    s[i] = Some(r);
                }
                if failed {
                    next.store(n, Ordering::Relaxed);
                }
            });
        }
    });
    let slots = slots.into_inner().unwrap_or_default();
    let mut out = Vec::with_capacity(n);
    for s in slots {
        match s {
            Some(r) => out.push(r?),
            None => {
                return Err(SimError::Setting {
                    key: "suite-jobs",
                    reason: "a run did not complete".into(),
                })
            }
        }
    }
    Ok(out)
}

fn ratio_text(r: &RatioStat, seeds: usize) -> [String; 2] {
    let f = |x: f64| {
        if x.is_finite() {
            format!("{x:.2}")
        } else {
            "-".into()
        }
    };
    let range = if seeds > 1 {
        format!("{} ({}-{})", f(r.median), f(r.min), f(r.max))
    } else {
        f(r.median)
    };
    let best = if seeds > 1 && r.best_seeds < seeds {
        format!("{} {}/{seeds}", r.best, r.best_seeds)
    } else {
        r.best.clone()
    };
    [range, best]
}

const HEADER: [&str; 11] = [
    "workload",
    "load",
    "req/s",
    "mean_ttft",
    "best",
    "p99_ttft",
    "best",
    "itl_p99",
    "best",
    "preempt",
    "cached",
];

impl SuiteResults {
    fn rows(&self) -> Vec<Vec<String>> {
        let seeds = self.options.seeds.len();
        self.lines
            .iter()
            .map(|l| {
                let [m, mb] = ratio_text(&l.ttft_mean, seeds);
                let [p, pb] = ratio_text(&l.ttft_p99, seeds);
                let [i, ib] = ratio_text(&l.itl_p99, seeds);
                vec![
                    l.workload.clone(),
                    l.load.clone(),
                    format!("{:.2}", l.rate),
                    m,
                    mb,
                    p,
                    pb,
                    i,
                    ib,
                    format!("{:.0}/{:.0}", l.cost_preemptions, l.best_preemptions),
                    format!(
                        "{:.1}%/{:.1}%",
                        l.cost_cached * 100.0,
                        l.best_cached * 100.0
                    ),
                ]
            })
            .collect()
    }

    fn legend(&self) -> String {
        let engines = self.options.profile.as_ref().map_or(String::new(), |p| {
            format!(" Engines: profile `{}`.", p.name)
        });
        format!(
            "cost ÷ best baseline per seed: median (min-max) over seeds {:?}; below 1 cost is \
             better; best: the baseline best on most seeds (n/{} when not all). preempt and \
             cached: cost / the best-on-mean-TTFT baseline (medians). knee: round-robin's \
             capacity (calibrated); overload: {}× it.{engines}",
            self.options.seeds,
            self.options.seeds.len(),
            self.options.overload
        )
    }

    /// The table as aligned plain text, with a legend line.
    pub fn text_table(&self) -> String {
        let rows = self.rows();
        let widths: Vec<usize> = (0..HEADER.len())
            .map(|c| {
                rows.iter()
                    .map(|r| r[c].chars().count())
                    .chain([HEADER[c].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        let mut put = |cells: Vec<&str>| {
            let parts: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(c, cell)| {
                    let pad = widths[c].saturating_sub(cell.chars().count());
                    if c < 2 || HEADER[c] == "best" {
                        format!("{cell}{}", " ".repeat(pad))
                    } else {
                        format!("{}{cell}", " ".repeat(pad))
                    }
                })
                .collect();
            out.push_str(parts.join("  ").trim_end());
            out.push('\n');
        };
        put(HEADER.to_vec());
        for r in &rows {
            put(r.iter().map(String::as_str).collect());
        }
        out.push_str(&self.legend());
        out.push('\n');
        out
    }

    /// The table as Markdown, then the workloads and their calibration.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{}\n", self.legend());
        let _ = writeln!(out, "| {} |", HEADER.join(" | "));
        let align: Vec<&str> = HEADER
            .iter()
            .enumerate()
            .map(|(c, h)| if c < 2 || *h == "best" { "---" } else { "---:" })
            .collect();
        let _ = writeln!(out, "|{}|", align.join("|"));
        for r in self.rows() {
            let _ = writeln!(out, "| {} |", r.join(" | "));
        }
        let _ = writeln!(
            out,
            "\n| workload | fleet | requests | knee req/s | what |\n|---|---|---:|---:|---|"
        );
        for w in &self.workloads {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.2} | {} |",
                w.name, w.fleet, w.requests, w.calibration.knee_rate, w.about
            );
        }
        out
    }

    /// Every run as Markdown rows (workload, load, seed, policy and the main columns).
    pub fn runs_markdown(&self) -> String {
        let mut out = String::from(
            "| workload | load | req/s | seed | policy | ttft_mean | ttft_p50 | ttft_p99 | \
             itl_p99 | req/s done | cached | preempt | rejected | ttft_err p50/p90 | \
             cached_err p50/p90 |\n\
             |---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let err = |p50: Option<f64>, p90: Option<f64>| match (p50, p90) {
            (Some(a), Some(b)) => format!("{:.0}% / {:.0}%", a * 100.0, b * 100.0),
            _ => "-".to_string(),
        };
        for r in &self.runs {
            let s = &r.summary;
            let _ = writeln!(
                out,
                "| {} | {} | {:.2} | {} | {} | {:.3} | {:.3} | {:.3} | {:.1} | {:.2} | {:.1}% \
                 | {} | {} | {} | {} |",
                r.workload,
                r.load,
                r.rate,
                r.seed,
                s.policy,
                s.ttft.mean,
                s.ttft.p50,
                s.ttft.p99,
                s.itl_p99 * 1000.0,
                s.throughput_rps,
                s.cache_share * 100.0,
                s.preemptions,
                s.rejected,
                err(s.ttft_error_p50, s.ttft_error_p90),
                err(s.cached_error_p50, s.cached_error_p90)
            );
        }
        out
    }

    /// Pretty JSON.
    pub fn json(&self) -> String {
        // Invariant: plain data only, which serde_json always serialises (NaN becomes null).
        serde_json::to_string_pretty(self).expect("suite results serialise")
    }

    /// Writes `results.json` and `suite.md` (the table, the workloads, every run) into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|source| SimError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let md = format!(
            "# Workload suite\n\n{}\n## Every run\n\n{}",
            self.markdown(),
            self.runs_markdown()
        );
        for (name, text) in [("results.json", self.json()), ("suite.md", md)] {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|source| SimError::Io { path, source })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(policy: &str, mean: f64, p99: f64, itl: f64) -> PolicySummary {
        let mut s = PolicySummary {
            policy: policy.into(),
            itl_p99: itl,
            ..Default::default()
        };
        s.ttft.mean = mean;
        s.ttft.p99 = p99;
        s
    }

    #[test]
    fn ratios_are_per_seed_against_the_best_baseline() {
        let seed1 = vec![
            summary("cost", 1.0, 4.0, 0.02),
            summary("a", 2.0, 2.0, 0.04),
            summary("b", 4.0, 8.0, 0.01),
        ];
        let seed2 = vec![
            summary("cost", 1.0, 4.0, 0.02),
            summary("a", 0.5, 8.0, 0.04),
            summary("b", 4.0, 1.0, 0.01),
        ];
        let seed3 = vec![
            summary("cost", 3.0, 4.0, 0.02),
            summary("a", 1.0, 2.0, 0.04),
            summary("b", 4.0, 8.0, 0.01),
        ];
        let rows: Vec<&[PolicySummary]> = vec![&seed1, &seed2, &seed3];
        let mean = ratio(&rows, |s| s.ttft.mean);
        assert_eq!((mean.median, mean.min, mean.max), (2.0, 0.5, 3.0));
        assert_eq!((mean.best.as_str(), mean.best_seeds), ("a", 3));
        let p99 = ratio(&rows, |s| s.ttft.p99);
        assert_eq!((p99.median, p99.min, p99.max), (2.0, 2.0, 4.0));
        assert_eq!((p99.best.as_str(), p99.best_seeds), ("a", 2));
        let l = line("w", "knee", 1.0, &rows);
        assert_eq!(l.itl_p99.median, 2.0);
        assert_eq!(ratio_text(&l.ttft_p99, 3)[1], "a 2/3");
    }

    #[test]
    fn with_rate_sets_every_kind_of_arrivals() {
        for w in workloads(0.01) {
            let spec = with_rate(&w.spec, 7.0, 2.0);
            let text = serde_json::to_string(&spec).unwrap();
            match &spec {
                WorkloadSpec::Trace(t) => assert_eq!(t.rate_scale, 3.5),
                _ => assert!(text.contains("\"rate\":7.0"), "{text}"),
            }
            if w.name == "bursty" {
                assert!(text.contains("\"cv\":4.0"), "{text}");
            }
        }
    }

    #[test]
    fn unknown_workloads_are_refused() {
        let options = SuiteOptions {
            only: vec!["nope".into()],
            ..SuiteOptions::default()
        };
        let e = run_suite(&options, &|_| {}).unwrap_err();
        assert!(e.to_string().contains("unknown suite workload"), "{e}");
    }
}
