//! A run's summary, as JSON (`results.json`) and Markdown (`results.md`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};
use switchyard_workload::WorkloadSpec;

use crate::error::{LoadgenError, Result};
use crate::plan::{Api, PlanOptions};
use crate::stats::{Latency, Stats, LATE_AFTER};

/// Counts, throughput, tokens and latency quantiles of one run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests in the plan.
    pub planned: u64,
    /// Requests sent.
    pub sent: u64,
    /// Requests that succeeded.
    pub ok: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Failed requests by kind: `http_<status>`, `connect`, `timeout`, `io`, `stream`.
    pub errors: BTreeMap<String, u64>,
    /// The first few error messages.
    pub error_examples: Vec<String>,
    /// Sends more than `late_after_ms` after their scheduled time.
    pub late_sends: u64,
    /// The lateness threshold of `late_sends`.
    pub late_after_ms: f64,
    /// Sends that waited for a free slot under the concurrency cap.
    pub cap_waits: u64,
    /// Most requests in flight at once.
    pub peak_in_flight: u64,
    /// Seconds from the start to the last scheduled send.
    pub schedule_s: f64,
    /// Seconds from the start until the last request finished.
    pub wall_s: f64,
    /// Successful requests per second of `wall_s`.
    pub requests_per_s: f64,
    /// Generated tokens (usage) per second of `wall_s`.
    pub output_tokens_per_s: f64,
    /// Sum of `usage.prompt_tokens` over successful requests.
    pub prompt_tokens: u64,
    /// Sum of `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Sum of `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// `cached_tokens / prompt_tokens` (0 when no prompt tokens).
    pub cached_fraction: f64,
    /// Successful requests without `usage` in their stream.
    pub without_usage: u64,
    /// Successful requests without any generated text.
    pub without_content: u64,
    /// Time to first token (first chunk with generated text), from the send.
    pub ttft: Option<Latency>,
    /// Inter-token latency: gaps between chunks with generated text.
    pub itl: Option<Latency>,
    /// End to end: send to the end of the stream.
    pub e2e: Option<Latency>,
    /// Lateness of sends against the schedule.
    pub send_lag: Option<Latency>,
}

impl Summary {
    /// Summarises `stats` of a run whose plan held `planned` requests.
    pub fn new(stats: &Stats, planned: u64, schedule_s: f64, wall_s: f64) -> Self {
        let per_s = |n: u64| if wall_s > 0.0 { n as f64 / wall_s } else { 0.0 };
        Self {
            planned,
            sent: stats.sent,
            ok: stats.ok,
            failed: stats.failed(),
            errors: stats.errors.clone(),
            error_examples: stats.error_examples.clone(),
            late_sends: stats.late_sends,
            late_after_ms: LATE_AFTER.as_secs_f64() * 1000.0,
            cap_waits: stats.cap_waits,
            peak_in_flight: stats.peak_in_flight,
            schedule_s,
            wall_s,
            requests_per_s: per_s(stats.ok),
            output_tokens_per_s: per_s(stats.completion_tokens),
            prompt_tokens: stats.prompt_tokens,
            cached_tokens: stats.cached_tokens,
            completion_tokens: stats.completion_tokens,
            cached_fraction: if stats.prompt_tokens > 0 {
                stats.cached_tokens as f64 / stats.prompt_tokens as f64
            } else {
                0.0
            },
            without_usage: stats.without_usage,
            without_content: stats.without_content,
            ttft: stats.ttft.summary(),
            itl: stats.itl.summary(),
            e2e: stats.e2e.summary(),
            send_lag: stats.lag.summary(),
        }
    }
}

/// Everything about one run: what was asked and what was measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Name of the run (`--label`, else the URL).
    pub label: String,
    /// Base URL (the first one, with several).
    pub url: String,
    /// With several base URLs: all of them (requests went to one each, drawn at random).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub urls: Vec<String>,
    /// With several base URLs: requests sent to each, in the order of `urls`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sent_per_url: Vec<u64>,
    /// Endpoint used.
    pub api: Api,
    /// Model asked for (when one name was used for all requests).
    pub model: Option<String>,
    /// Workload seed.
    pub seed: u64,
    /// The workload.
    pub workload: WorkloadSpec,
    /// How the workload was planned.
    pub plan: PlanOptions,
    /// Per-request timeout in seconds.
    pub timeout_s: f64,
    /// Concurrency cap.
    pub max_concurrency: u64,
    /// Unix time the run started.
    pub started_unix_s: f64,
    /// The measurements.
    pub summary: Summary,
}

/// Formats a latency cell in ms.
fn ms(l: &Option<Latency>, f: fn(&Latency) -> f64) -> String {
    l.as_ref()
        .map_or_else(|| "—".into(), |l| format!("{:.1}", f(l)))
}

impl Report {
    /// The report as pretty JSON.
    pub fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// The latency table (Markdown), one row per metric.
    pub fn latency_table(&self) -> String {
        let s = &self.summary;
        let mut out = String::new();
        out.push_str("| metric (ms) | count | mean | p50 | p90 | p99 | p99.9 | max |\n");
        out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
        for (name, l) in [
            ("TTFT", &s.ttft),
            ("inter-token", &s.itl),
            ("end to end", &s.e2e),
            ("send lateness", &s.send_lag),
        ] {
            let count = l.as_ref().map_or(0, |l| l.count);
            let _ = writeln!(
                out,
                "| {name} | {count} | {} | {} | {} | {} | {} | {} |",
                ms(l, |l| l.mean_ms),
                ms(l, |l| l.p50_ms),
                ms(l, |l| l.p90_ms),
                ms(l, |l| l.p99_ms),
                ms(l, |l| l.p999_ms),
                ms(l, |l| l.max_ms),
            );
        }
        out
    }

    /// One line of counts, throughput and tokens.
    pub fn counts_line(&self) -> String {
        let s = &self.summary;
        let errors = if s.errors.is_empty() {
            "none".to_string()
        } else {
            s.errors
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "{} planned, {} sent, {} ok, {} failed (errors: {errors}); {} sends late by > {:.0} ms, \
             {} waited for a slot (cap {}), peak {} in flight; {:.2} req/s, {:.1} output tok/s over \
             {:.1} s; prompt tokens {} of which cached {} ({:.1} %)",
            s.planned,
            s.sent,
            s.ok,
            s.failed,
            s.late_sends,
            s.late_after_ms,
            s.cap_waits,
            self.max_concurrency,
            s.peak_in_flight,
            s.requests_per_s,
            s.output_tokens_per_s,
            s.wall_s,
            s.prompt_tokens,
            s.cached_tokens,
            100.0 * s.cached_fraction,
        )
    }

    /// The report as a Markdown page.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# switchyard bench: {}\n", self.label);
        let _ = writeln!(
            out,
            "- target: `{}{}`, model `{}`",
            self.url,
            self.api.path(),
            self.model.as_deref().unwrap_or("(per request)")
        );
        if !self.urls.is_empty() {
            let spread: Vec<String> = self
                .urls
                .iter()
                .zip(&self.sent_per_url)
                .map(|(u, n)| format!("`{u}` {n}"))
                .collect();
            let _ = writeln!(
                out,
                "- requests spread at random over {} URLs: {}",
                self.urls.len(),
                spread.join(", ")
            );
        }
        let workload = serde_json::to_string(&self.workload).unwrap_or_default();
        let _ = writeln!(out, "- workload (seed {}): `{workload}`", self.seed);
        let _ = writeln!(
            out,
            "- time scale {}, max requests {}, duration {}, timeout {} s, concurrency cap {}",
            self.plan.time_scale,
            self.plan
                .max_requests
                .map_or("none".into(), |n| n.to_string()),
            self.plan
                .duration_s
                .map_or("none".into(), |d| format!("{d} s")),
            self.timeout_s,
            self.max_concurrency
        );
        let _ = writeln!(out, "- {}\n", self.counts_line());
        out.push_str(&self.latency_table());
        if !self.summary.error_examples.is_empty() {
            out.push_str("\nFirst errors:\n\n");
            for e in &self.summary.error_examples {
                let _ = writeln!(out, "- `{e}`");
            }
        }
        out
    }

    /// Writes `results.json` and `results.md` into `dir` (created if missing).
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| LoadgenError::io(dir, e))?;
        let json = dir.join("results.json");
        std::fs::write(&json, self.to_json()? + "\n").map_err(|e| LoadgenError::io(&json, e))?;
        let md = dir.join("results.md");
        std::fs::write(&md, self.to_markdown()).map_err(|e| LoadgenError::io(&md, e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{ErrorKind, Failure, Success};
    use std::time::Duration;
    use switchyard_workload::SharedPrefixSpec;

    fn report() -> Report {
        let mut stats = Stats::default();
        stats.record_send(Duration::from_micros(300), false, 1);
        stats.record_send(Duration::from_micros(300), false, 2);
        stats.record(&Ok(Success {
            ttft: Some(Duration::from_millis(12)),
            itl: vec![Duration::from_millis(6)],
            e2e: Duration::from_millis(18),
            content_chunks: 2,
            usage: None,
        }));
        stats.record(&Err(Failure {
            kind: ErrorKind::Timeout,
            message: "slow".into(),
        }));
        Report {
            label: "t".into(),
            url: "http://127.0.0.1:1".into(),
            urls: Vec::new(),
            sent_per_url: Vec::new(),
            api: Api::Chat,
            model: Some("m".into()),
            seed: 1,
            workload: WorkloadSpec::SharedPrefix(SharedPrefixSpec::default()),
            plan: PlanOptions::default(),
            timeout_s: 30.0,
            max_concurrency: 16,
            started_unix_s: 0.0,
            summary: Summary::new(&stats, 2, 0.5, 2.0),
        }
    }

    #[test]
    fn json_roundtrip_and_fields() {
        let r = report();
        let j = r.to_json().unwrap();
        let back: Report = serde_json::from_str(&j).unwrap();
        assert_eq!(back, r);
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(v["summary"]["errors"]["timeout"], 1);
        assert_eq!(v["summary"]["requests_per_s"], 0.5);
        assert_eq!(v["summary"]["ttft"]["count"], 1);
        assert!(v["summary"]["ttft"]["p50_ms"].as_f64().unwrap() > 11.9);
    }

    #[test]
    fn markdown_has_the_table_and_errors() {
        let md = report().to_markdown();
        assert!(md.contains("| TTFT | 1 |"), "{md}");
        assert!(md.contains("errors: timeout 1"), "{md}");
        assert!(md.contains("`timeout: slow`"), "{md}");
    }
}
