//! The results table as text, Markdown and JSON.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::error::{Result, SimError};
use crate::lower_bound::LowerBound;
use crate::metrics::PolicySummary;

/// What a simulation command produced: deterministic for a seed (no wall-clock figures).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SimResults {
    /// The workload, as given.
    pub workload: serde_json::Value,
    /// Instances in the fleet.
    pub instances: usize,
    /// Instance roles, e.g. `8 both` or `4 prefill + 4 decode`.
    pub roles: String,
    /// Router replicas.
    pub replicas: u32,
    /// How traffic was split among replicas.
    pub split: String,
    /// Seconds between scrapes of an instance.
    pub scrape_interval_s: f64,
    /// Seed.
    pub seed: u64,
    /// TTFT SLO for goodput, seconds.
    pub ttft_slo_s: f64,
    /// One row per policy, in the order run.
    pub policies: Vec<PolicySummary>,
    /// The lower-bound row, when computed.
    pub lower_bound: Option<LowerBound>,
}

const HEADER: [&str; 24] = [
    "policy",
    "ttft_mean",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "e2e_p99",
    "req/s",
    "out_tok/s",
    "slo_met",
    "good_req/s",
    "cached",
    "spread",
    "hot_spot",
    "adapter_loads",
    "loads/1k",
    "preempt",
    "rejected",
    "finished",
    "ttft_err_p50",
    "ttft_err_p90",
    "cached_err_p50",
    "cached_err_p90",
];

fn secs(x: f64) -> String {
    format!("{x:.3}")
}

fn ms(x: f64) -> String {
    format!("{:.1}", x * 1000.0)
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn row(s: &PolicySummary) -> Vec<String> {
    vec![
        s.policy.clone(),
        secs(s.ttft.mean),
        secs(s.ttft.p50),
        secs(s.ttft.p90),
        secs(s.ttft.p99),
        ms(s.itl_p50),
        ms(s.itl_p99),
        secs(s.e2e_p99),
        format!("{:.2}", s.throughput_rps),
        format!("{:.0}", s.output_tokens_per_s),
        pct(s.slo_share),
        format!("{:.2}", s.goodput_rps),
        pct(s.cache_share),
        format!("{:.2}", s.load_spread),
        format!("{:.2}", s.hot_spot),
        s.adapter_loads.to_string(),
        format!("{:.1}", s.adapter_loads_per_1k),
        s.preemptions.to_string(),
        s.rejected.to_string(),
        s.finished.to_string(),
        err(s.ttft_error_p50),
        err(s.ttft_error_p90),
        err(s.cached_error_p50),
        err(s.cached_error_p90),
    ]
}

/// A relative prediction error as a percentage, `-` when the policy makes no prediction.
fn err(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{:.0}%", x * 100.0))
}

fn lower_bound_row(lb: &LowerBound) -> Vec<String> {
    let mut r = vec!["-".to_string(); HEADER.len()];
    r[0] = "lower-bound".into();
    r[1] = secs(lb.ttft.mean);
    r[2] = secs(lb.ttft.p50);
    r[3] = secs(lb.ttft.p90);
    r[4] = secs(lb.ttft.p99);
    r[12] = pct(lb.cache_share);
    r[19] = lb.requests.to_string();
    r
}

impl SimResults {
    fn rows(&self) -> Vec<Vec<String>> {
        let mut rows: Vec<Vec<String>> = self.policies.iter().map(row).collect();
        if let Some(lb) = &self.lower_bound {
            rows.push(lower_bound_row(lb));
        }
        rows
    }

    /// The table as aligned plain text (times in seconds, inter-token latency in ms).
    pub fn text_table(&self) -> String {
        let rows = self.rows();
        let widths: Vec<usize> = (0..HEADER.len())
            .map(|c| {
                rows.iter()
                    .map(|r| r[c].len())
                    .chain([HEADER[c].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        let line = |cells: Vec<&str>, out: &mut String| {
            let parts: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(c, cell)| {
                    if c == 0 {
                        format!("{cell:<w$}", w = widths[c])
                    } else {
                        format!("{cell:>w$}", w = widths[c])
                    }
                })
                .collect();
            out.push_str(parts.join("  ").trim_end());
            out.push('\n');
        };
        line(HEADER.to_vec(), &mut out);
        for r in &rows {
            line(r.iter().map(String::as_str).collect(), &mut out);
        }
        out
    }

    /// The table as Markdown, with a line on the setting.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} instances ({}), {} router replica(s) ({} split), scrape every {} s, seed {}, \
             TTFT SLO {} s. Times in seconds, inter-token latency (itl) in ms.\n",
            self.instances,
            self.roles,
            self.replicas,
            self.split,
            self.scrape_interval_s,
            self.seed,
            self.ttft_slo_s
        );
        let _ = writeln!(out, "| {} |", HEADER.join(" | "));
        let _ = writeln!(
            out,
            "|{}|",
            HEADER
                .iter()
                .enumerate()
                .map(|(i, _)| if i == 0 { "---" } else { "---:" })
                .collect::<Vec<_>>()
                .join("|")
        );
        for r in self.rows() {
            let _ = writeln!(out, "| {} |", r.join(" | "));
        }
        out
    }

    /// Pretty JSON.
    pub fn json(&self) -> String {
        // Invariant: every field is plain data (strings, numbers, a JSON value), which
        // serde_json always serialises.
        serde_json::to_string_pretty(self).expect("results serialise")
    }

    /// Writes `results.json` and `results.md` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|source| SimError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        for (name, text) in [
            ("results.json", self.json()),
            ("results.md", self.markdown()),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|source| SimError::Io { path, source })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_have_a_row_per_policy_and_the_bound() {
        let results = SimResults {
            instances: 2,
            policies: vec![
                PolicySummary {
                    policy: "cost".into(),
                    ..Default::default()
                },
                PolicySummary {
                    policy: "round-robin".into(),
                    ..Default::default()
                },
            ],
            lower_bound: Some(LowerBound::default()),
            ..Default::default()
        };
        let text = results.text_table();
        assert_eq!(text.lines().count(), 4);
        assert!(text.lines().nth(3).unwrap().starts_with("lower-bound"));
        let md = results.markdown();
        assert!(md.contains("| cost |"));
        assert!(md.contains("| lower-bound |"));
        let v: serde_json::Value = serde_json::from_str(&results.json()).unwrap();
        assert_eq!(v["policies"][1]["policy"], "round-robin");
    }
}
