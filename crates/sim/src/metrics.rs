//! Per-request records and their aggregation into one row of the results table.

use serde::Serialize;

/// What became of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Still in an engine (only seen mid-run).
    #[default]
    InFlight,
    /// Generated all its tokens.
    Finished,
    /// No instance could take it (no eligible candidate, or the engine refused it).
    Rejected,
}

/// Marks "no instance" in the instance fields of a record.
pub const NO_INSTANCE: u32 = u32::MAX;

/// What the simulator remembers per request (kept small: a million of them stay in memory).
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestRecord {
    /// Arrival time, seconds.
    pub arrival: f64,
    /// First token seen by the client, seconds (NaN until then).
    pub first_token: f64,
    /// Finish time, seconds (NaN until then).
    pub finish: f64,
    /// Prompt tokens as the engine counted them.
    pub prompt_tokens: u32,
    /// Prompt tokens the engine reported served from its cache (the prefill side's, when split).
    pub cached_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
    /// Instance that prefilled it.
    pub instance: u32,
    /// Instance that decoded it, when prefill and decode were split.
    pub decode_instance: u32,
    /// Router replica that routed it.
    pub replica: u16,
    /// What became of it.
    pub outcome: Outcome,
}

impl RequestRecord {
    /// Whether the request was split into a prefill and a decode half.
    pub fn is_split(&self) -> bool {
        self.decode_instance != NO_INSTANCE
    }
}

/// Per-instance totals gathered while simulating.
#[derive(Debug, Clone, Default, Serialize)]
pub struct InstanceStats {
    /// Seconds during which the engine had at least one request (queued or running).
    pub busy_s: f64,
    /// Requests (or request halves) submitted to it.
    pub requests: u64,
    /// Adapters loaded into a slot.
    pub adapter_loads: u64,
    /// Preemptions the engine reported.
    pub preemptions: u64,
}

/// TTFT-like distribution summary, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Dist {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Dist {
    /// Summary of `sorted` (ascending); zeros when empty.
    pub fn of_sorted(sorted: &[f64]) -> Dist {
        if sorted.is_empty() {
            return Dist::default();
        }
        Dist {
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: percentile(sorted, 0.50),
            p90: percentile(sorted, 0.90),
            p99: percentile(sorted, 0.99),
        }
    }
}

/// Nearest-rank percentile of ascending `sorted` (`q` in 0..=1); 0 when empty.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Instances with fewer finished requests than this are left out of the hot-spot indicator:
/// a p99 of a handful of samples is noise.
pub const HOT_SPOT_MIN_REQUESTS: usize = 20;

/// One row of the results table.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PolicySummary {
    /// Policy name.
    pub policy: String,
    /// Requests that arrived.
    pub requests: u64,
    /// Requests that finished.
    pub finished: u64,
    /// Requests no instance took.
    pub rejected: u64,
    /// Time to first token, seconds.
    pub ttft: Dist,
    /// Median inter-token latency, seconds ((e2e − ttft) / (completion − 1) per request).
    pub itl_p50: f64,
    /// 99th-percentile inter-token latency, seconds.
    pub itl_p99: f64,
    /// 99th-percentile end-to-end latency, seconds.
    pub e2e_p99: f64,
    /// Seconds from the first arrival to the last finish.
    pub makespan_s: f64,
    /// Finished requests per second of makespan.
    pub throughput_rps: f64,
    /// Generated tokens per second of makespan.
    pub output_tokens_per_s: f64,
    /// Share of arrived requests whose TTFT met the SLO.
    pub slo_share: f64,
    /// Requests meeting the TTFT SLO per second of makespan.
    pub goodput_rps: f64,
    /// Share of prompt tokens the engines reported served from their prefix caches.
    pub cache_share: f64,
    /// Max ÷ mean busy time over instances (1 = perfectly even).
    pub load_spread: f64,
    /// Worst instance's p99 TTFT ÷ fleet p99 TTFT (instances with enough requests).
    pub hot_spot: f64,
    /// Adapter loads across the fleet.
    pub adapter_loads: u64,
    /// Adapter loads per 1,000 requests.
    pub adapter_loads_per_1k: f64,
    /// Preemptions across the fleet.
    pub preemptions: u64,
    /// Median relative error of the router's TTFT estimate for the instance it chose
    /// (|estimated − observed| ÷ observed; none when the policy makes no estimate).
    pub ttft_error_p50: Option<f64>,
    /// 90th percentile of that error.
    pub ttft_error_p90: Option<f64>,
    /// Median |predicted − reported| cached tokens ÷ prompt tokens.
    pub cached_error_p50: Option<f64>,
    /// 90th percentile of that error.
    pub cached_error_p90: Option<f64>,
}

/// Median and 90th percentile of relative errors (none when there are none).
pub fn error_quantiles(errors: &mut [f64]) -> (Option<f64>, Option<f64>) {
    if errors.is_empty() {
        return (None, None);
    }
    errors.sort_unstable_by(f64::total_cmp);
    let at = |q: f64| errors[((errors.len() - 1) as f64 * q).round() as usize];
    (Some(at(0.5)), Some(at(0.9)))
}

/// Aggregates one policy's run; also returns the sorted TTFTs (for the CDF chart).
pub fn summarize(
    policy: &str,
    records: &[RequestRecord],
    instances: &[InstanceStats],
    slo_s: f64,
) -> (PolicySummary, Vec<f64>) {
    let mut ttft = Vec::with_capacity(records.len());
    let mut itl = Vec::with_capacity(records.len());
    let mut e2e = Vec::with_capacity(records.len());
    let mut by_instance: Vec<(u32, f64)> = Vec::with_capacity(records.len());
    let (mut prompt, mut cached, mut output) = (0u64, 0u64, 0u64);
    let mut start = f64::INFINITY;
    let mut end = f64::NEG_INFINITY;
    let mut rejected = 0;
    let mut met = 0u64;
    for r in records {
        start = start.min(r.arrival);
        if r.outcome != Outcome::Finished {
            rejected += u64::from(r.outcome == Outcome::Rejected);
            continue;
        }
        end = end.max(r.finish);
        let t = r.first_token - r.arrival;
        ttft.push(t);
        met += u64::from(t <= slo_s);
        by_instance.push((r.instance, t));
        e2e.push(r.finish - r.arrival);
        if r.completion_tokens >= 2 {
            itl.push((r.finish - r.first_token) / f64::from(r.completion_tokens - 1));
        }
        prompt += u64::from(r.prompt_tokens);
        cached += u64::from(r.cached_tokens);
        output += u64::from(r.completion_tokens);
    }
    for v in [&mut ttft, &mut itl, &mut e2e] {
        v.sort_by(f64::total_cmp);
    }
    let finished = ttft.len() as u64;
    let makespan = if finished > 0 { end - start } else { 0.0 };
    let per_s = |x: f64| if makespan > 0.0 { x / makespan } else { 0.0 };
    let dist = Dist::of_sorted(&ttft);
    let requests = records.len() as u64;
    let adapter_loads = instances.iter().map(|i| i.adapter_loads).sum();
    let summary = PolicySummary {
        policy: policy.to_string(),
        requests,
        finished,
        rejected,
        ttft: dist,
        itl_p50: percentile(&itl, 0.5),
        itl_p99: percentile(&itl, 0.99),
        e2e_p99: percentile(&e2e, 0.99),
        makespan_s: makespan,
        throughput_rps: per_s(finished as f64),
        output_tokens_per_s: per_s(output as f64),
        slo_share: if requests > 0 {
            met as f64 / requests as f64
        } else {
            0.0
        },
        goodput_rps: per_s(met as f64),
        cache_share: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        load_spread: load_spread(instances),
        hot_spot: hot_spot(&mut by_instance, dist.p99),
        adapter_loads,
        adapter_loads_per_1k: if requests > 0 {
            adapter_loads as f64 * 1000.0 / requests as f64
        } else {
            0.0
        },
        preemptions: instances.iter().map(|i| i.preemptions).sum(),
        ..PolicySummary::default()
    };
    (summary, ttft)
}

/// Max ÷ mean busy time; 0 when nothing was busy.
fn load_spread(instances: &[InstanceStats]) -> f64 {
    let max = instances.iter().map(|i| i.busy_s).fold(0.0, f64::max);
    let mean = instances.iter().map(|i| i.busy_s).sum::<f64>() / instances.len().max(1) as f64;
    if mean > 0.0 {
        max / mean
    } else {
        0.0
    }
}

/// Worst per-instance p99 TTFT over the fleet p99; 0 when no instance has enough requests.
fn hot_spot(by_instance: &mut [(u32, f64)], fleet_p99: f64) -> f64 {
    if fleet_p99 <= 0.0 {
        return 0.0;
    }
    by_instance.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut worst: f64 = 0.0;
    for group in by_instance.chunk_by(|a, b| a.0 == b.0) {
        if group.len() < HOT_SPOT_MIN_REQUESTS {
            continue;
        }
        let rank = (0.99 * group.len() as f64).ceil() as usize;
        worst = worst.max(group[rank.clamp(1, group.len()) - 1].1);
    }
    worst / fleet_p99
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finished(instance: u32, arrival: f64, ttft: f64, e2e: f64, tokens: u32) -> RequestRecord {
        RequestRecord {
            arrival,
            first_token: arrival + ttft,
            finish: arrival + e2e,
            prompt_tokens: 100,
            cached_tokens: 40,
            completion_tokens: tokens,
            instance,
            decode_instance: NO_INSTANCE,
            replica: 0,
            outcome: Outcome::Finished,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert_eq!(percentile(&[3.0], 0.01), 3.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn a_small_run_adds_up() {
        let records = vec![
            finished(0, 0.0, 0.5, 2.5, 5),
            finished(1, 1.0, 1.5, 3.0, 1),
            RequestRecord {
                arrival: 2.0,
                outcome: Outcome::Rejected,
                ..Default::default()
            },
        ];
        let instances = vec![
            InstanceStats {
                busy_s: 3.0,
                ..Default::default()
            },
            InstanceStats {
                busy_s: 1.0,
                adapter_loads: 2,
                ..Default::default()
            },
        ];
        let (s, sorted) = summarize("p", &records, &instances, 1.0);
        assert_eq!(sorted, vec![0.5, 1.5]);
        assert_eq!((s.requests, s.finished, s.rejected), (3, 2, 1));
        assert_eq!(s.ttft.mean, 1.0);
        // Only the 5-token request has an inter-token latency: (2.5 - 0.5) / 4.
        assert_eq!(s.itl_p50, 0.5);
        assert_eq!(s.makespan_s, 4.0);
        assert_eq!(s.throughput_rps, 0.5);
        assert_eq!(s.output_tokens_per_s, 1.5);
        assert!((s.slo_share - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(s.cache_share, 0.4);
        assert_eq!(s.load_spread, 1.5);
        assert_eq!(s.adapter_loads, 2);
        assert!((s.adapter_loads_per_1k - 2000.0 / 3.0).abs() < 1e-9);
        assert_eq!(s.hot_spot, 0.0, "too few requests per instance");
    }

    #[test]
    fn hot_spot_compares_the_worst_instance_to_the_fleet() {
        let mut records = Vec::new();
        for i in 0..40 {
            records.push(finished(0, f64::from(i), 0.1, 1.0, 2));
            records.push(finished(
                1,
                f64::from(i),
                if i == 0 { 4.0 } else { 0.2 },
                5.0,
                2,
            ));
        }
        let instances = vec![InstanceStats::default(); 2];
        let (s, _) = summarize("p", &records, &instances, 1.0);
        // Fleet p99 of 80 samples is the 80th: 4.0; instance 1's p99 (40th of 40) is 4.0 too.
        assert_eq!(s.hot_spot, 1.0);
    }
}
