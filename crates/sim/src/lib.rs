//! The Switchyard cluster simulator: many engine models and the routing core in virtual time.
//!
//! M engines ([`switchyard_engine`]) and one or more routers ([`switchyard_core`], any policy)
//! run over a workload ([`switchyard_workload`]) in a discrete-event loop. The router sees the
//! fleet as it would in production: its own accounting at once (routed, first token, finished
//! with the engine's usage), engine metrics only at each scrape. Router replicas each see their
//! share of the traffic and only their own accounting. Every policy runs on the same workload
//! and the results are one table, plus a lower bound and charts.
//!
//! - [`config`]: the fleet, replicas and observation model ([`SimConfig`]).
//! - [`fleet`]: engines and instance specs from the fleet groups.
//! - [`events`]: the O(log n) event queue.
//! - [`driver`]: the loop for one policy.
//! - [`metrics`]: per-request records and the summary row.
//! - [`lower_bound`]: the analytic lower-bound row.
//! - [`report`]: text, Markdown and JSON.
//! - [`suite`]: the workload suite (`cost` against the baselines on eight workloads).
//! - [`charts`]: SVG charts.
#![warn(missing_docs)]

pub mod charts;
pub mod config;
pub mod driver;
pub mod error;
pub mod events;
pub mod fleet;
pub mod lower_bound;
pub mod metrics;
pub mod prompt;
pub mod report;
pub mod suite;

use std::path::Path;
use std::time::Instant;

use switchyard_engine::Role;
use switchyard_workload::WorkloadSpec;

// Drivers of the simulator (the CLI) get the engine and workload types through this crate.
pub use switchyard_engine;
pub use switchyard_workload;

pub use config::{FleetFile, InstanceGroup, KvEventsSim, SimConfig, Split};
pub use driver::{simulate, QueueTrace, RunData};
pub use error::{Result, SimError};
pub use lower_bound::{lower_bound, LowerBound};
pub use metrics::{summarize, PolicySummary};
pub use report::SimResults;

/// Wall-clock cost of one part of a run (kept out of the results: they must be deterministic).
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    /// Policy name, or `lower-bound`.
    pub what: String,
    /// Wall seconds.
    pub wall_s: f64,
}

/// Everything a simulation command produced.
#[derive(Debug, Clone, Default)]
pub struct SimOutput {
    /// The table (deterministic).
    pub results: SimResults,
    /// Sorted TTFTs per policy, for the CDF chart.
    pub ttfts: Vec<(String, Vec<f64>)>,
    /// The policy whose queues were recorded, and its trace.
    pub queues: Option<(String, QueueTrace)>,
    /// Wall time of each part.
    pub timings: Vec<Timing>,
}

/// `8 both` / `4 prefill + 4 decode`.
fn roles_text(config: &SimConfig) -> String {
    let mut counts: Vec<(Role, u32)> = Vec::new();
    for g in &config.fleet {
        match counts.iter_mut().find(|(r, _)| *r == g.engine.role) {
            Some((_, c)) => *c += g.count,
            None => counts.push((g.engine.role, g.count)),
        }
    }
    counts
        .iter()
        .filter(|(_, c)| *c > 0)
        .map(|(r, c)| format!("{c} {r}"))
        .collect::<Vec<_>>()
        .join(" + ")
}

/// The model name the fleet serves: configured, or the workload's first request's.
fn fleet_model(config: &SimConfig, workload: &WorkloadSpec) -> Result<String> {
    if let Some(m) = &config.model {
        return Ok(m.clone());
    }
    let first = workload.build(config.seed)?.next();
    Ok(first.map_or_else(
        || switchyard_workload::DEFAULT_MODEL.to_string(),
        |r| r.model.to_string(),
    ))
}

/// Runs every policy in `policies` over `workload` (rebuilt from the same seed for each),
/// recording queues over time for `queue_policy` (default: `cost` if run, else the first).
pub fn run(
    config: &SimConfig,
    workload: &WorkloadSpec,
    policies: &[String],
    queue_policy: Option<&str>,
) -> Result<SimOutput> {
    run_with_progress(config, workload, policies, queue_policy, &mut |_, _, _| {})
}

/// [`run`], reporting (policy, requests arrived, simulated seconds) as each policy's run goes.
pub fn run_with_progress(
    config: &SimConfig,
    workload: &WorkloadSpec,
    policies: &[String],
    queue_policy: Option<&str>,
    progress: &mut dyn FnMut(&str, u64, f64),
) -> Result<SimOutput> {
    config.validate()?;
    for p in policies {
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
    let queue_policy = queue_policy
        .map(str::to_string)
        .or_else(|| {
            policies
                .iter()
                .find(|p| *p == "cost")
                .or(policies.first())
                .cloned()
        })
        .unwrap_or_default();
    let model = fleet_model(config, workload)?;
    let mut out = SimOutput {
        results: SimResults {
            workload: serde_json::to_value(workload).unwrap_or(serde_json::Value::Null),
            instances: config.instances(),
            roles: roles_text(config),
            replicas: config.replicas,
            split: match config.split {
                Split::RoundRobin => "round-robin".into(),
                Split::Random => "random".into(),
            },
            scrape_interval_s: config.scrape_interval_s,
            seed: config.seed,
            ttft_slo_s: config.ttft_slo_s,
            ..SimResults::default()
        },
        ..SimOutput::default()
    };
    for policy in policies {
        let started = Instant::now();
        let mut config = config.clone();
        if *policy != queue_policy {
            config.queue_chart_instances = 0;
        }
        let mut data = driver::simulate_with(
            &config,
            policy,
            &model,
            workload.build(config.seed)?,
            &mut |n, t| progress(policy, n, t),
        )?;
        let (mut summary, ttfts) =
            summarize(policy, &data.records, &data.instances, config.ttft_slo_s);
        (summary.ttft_error_p50, summary.ttft_error_p90) =
            metrics::error_quantiles(&mut data.ttft_errors);
        (summary.cached_error_p50, summary.cached_error_p90) =
            metrics::error_quantiles(&mut data.cached_errors);
        out.results.policies.push(summary);
        out.ttfts.push((policy.clone(), ttfts));
        if *policy == queue_policy {
            out.queues = Some((policy.clone(), data.queues));
        }
        out.timings.push(Timing {
            what: policy.clone(),
            wall_s: started.elapsed().as_secs_f64(),
        });
    }
    if config.lower_bound {
        let started = Instant::now();
        let engines = fleet::engine_configs(config);
        out.results.lower_bound = Some(lower_bound(workload.build(config.seed)?, &engines));
        out.timings.push(Timing {
            what: "lower-bound".into(),
            wall_s: started.elapsed().as_secs_f64(),
        });
    }
    Ok(out)
}

/// Writes `results.json`, `results.md`, `ttft_cdf.svg` and `queue_<policy>.svg` into `dir`.
pub fn write_outputs(dir: &Path, output: &SimOutput) -> Result<()> {
    output.results.write(dir)?;
    charts::ttft_cdf(&dir.join("ttft_cdf.svg"), &output.ttfts)?;
    if let Some((policy, trace)) = &output.queues {
        if !trace.times.is_empty() {
            charts::queue_over_time(&dir.join(format!("queue_{policy}.svg")), policy, trace)?;
        }
    }
    Ok(())
}

/// Peak resident memory of this process in KiB (`VmHWM` of /proc/self/status; Linux only).
pub fn peak_memory_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}
