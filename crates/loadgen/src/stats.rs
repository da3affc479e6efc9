//! Histograms and counters of a run.
//!
//! Latencies are recorded in microseconds in HDR histograms (3 significant
//! digits, 1 µs to one hour; larger values are clamped to the top). The
//! fixed-rate mode, which measures a proxy's added microseconds, records in
//! nanoseconds instead ([`LatencyHist::fine`]: 100 ns to 120 s).

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::client::{Failure, Success};

/// Largest latency recorded, in µs (one hour).
const MAX_US: u64 = 3_600_000_000;
/// Error messages kept as examples.
const EXAMPLES: usize = 5;
/// A send later than this after its scheduled time counts as late.
pub const LATE_AFTER: Duration = Duration::from_millis(10);

/// A latency histogram (3 significant digits) recording in a unit between bounds: microseconds
/// from 1 µs to one hour by default, nanoseconds from 100 ns to 120 s with [`LatencyHist::fine`].
/// Values outside the bounds are clamped to them.
#[derive(Clone, Debug)]
pub struct LatencyHist {
    h: Histogram<u64>,
    /// Nanoseconds per recorded unit.
    unit_ns: u64,
    /// Smallest and largest value recorded, in units.
    bounds: (u64, u64),
}

impl Default for LatencyHist {
    fn default() -> Self {
        Self::new(1000, 1, MAX_US)
    }
}

/// Smallest latency a [`LatencyHist::fine`] tells apart, in ns (shorter ones are recorded as it).
const FINE_MIN_NS: u64 = 100;
/// Largest latency a [`LatencyHist::fine`] records, in ns (120 s; longer ones are clamped to it).
const FINE_MAX_NS: u64 = 120_000_000_000;

impl LatencyHist {
    fn new(unit_ns: u64, low: u64, high: u64) -> Self {
        // Fixed, valid bounds (1 ≤ low, high ≥ 2·low, 3 significant digits).
        let h = Histogram::new_with_bounds(low, high, 3).expect("valid histogram bounds");
        Self {
            h,
            unit_ns,
            bounds: (low, high),
        }
    }

    /// In nanoseconds from 100 ns to 120 s: for the fixed-rate mode, which measures a proxy's
    /// added microseconds.
    pub fn fine() -> Self {
        Self::new(1, FINE_MIN_NS, FINE_MAX_NS)
    }

    /// Records one duration.
    pub fn record(&mut self, d: Duration) {
        let (low, high) = self.bounds;
        let units = u64::try_from(d.as_nanos() / u128::from(self.unit_ns))
            .unwrap_or(high)
            .clamp(low, high);
        self.h.saturating_record(units);
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.h.len()
    }

    fn us(&self, units: f64) -> f64 {
        units * self.unit_ns as f64 / 1000.0
    }

    /// The value at quantile `q` (0 to 1), in µs (0 without samples).
    pub fn quantile_us(&self, q: f64) -> f64 {
        self.us(self.h.value_at_quantile(q) as f64)
    }

    /// The largest sample, in µs (0 without samples).
    pub fn max_us(&self) -> f64 {
        self.us(self.h.max() as f64)
    }

    /// The mean, in µs (0 without samples).
    pub fn mean_us(&self) -> f64 {
        self.us(self.h.mean())
    }

    /// The summary in milliseconds, or `None` without samples.
    pub fn summary(&self) -> Option<Latency> {
        if self.h.is_empty() {
            return None;
        }
        let ms = |us: f64| us / 1000.0;
        let q = |p: f64| ms(self.quantile_us(p));
        Some(Latency {
            count: self.h.len(),
            mean_ms: ms(self.mean_us()),
            p50_ms: q(0.5),
            p90_ms: q(0.9),
            p95_ms: q(0.95),
            p99_ms: q(0.99),
            p999_ms: q(0.999),
            max_ms: ms(self.max_us()),
        })
    }
}

/// Quantiles of one latency, in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 95th percentile.
    pub p95_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Largest sample.
    pub max_ms: f64,
}

/// Everything a run counted.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Time to first content chunk, from the send.
    pub ttft: LatencyHist,
    /// Gaps between content chunks.
    pub itl: LatencyHist,
    /// Send to end of stream.
    pub e2e: LatencyHist,
    /// How late each send was against its schedule.
    pub lag: LatencyHist,
    /// Requests sent.
    pub sent: u64,
    /// Requests that succeeded.
    pub ok: u64,
    /// Failed requests by kind (see [`crate::client::ErrorKind::key`]).
    pub errors: BTreeMap<String, u64>,
    /// The first few error messages.
    pub error_examples: Vec<String>,
    /// Sends later than [`LATE_AFTER`].
    pub late_sends: u64,
    /// Sends that had to wait for a free slot under the concurrency cap.
    pub cap_waits: u64,
    /// Most requests in flight at once.
    pub peak_in_flight: u64,
    /// Sum of `usage.prompt_tokens` of successful requests.
    pub prompt_tokens: u64,
    /// Sum of `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Sum of `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// Successful requests whose stream carried no `usage`.
    pub without_usage: u64,
    /// Successful requests whose stream carried no generated text.
    pub without_content: u64,
    /// Chunks with generated text.
    pub content_chunks: u64,
}

impl Stats {
    /// Records a send `lag` after its schedule.
    pub fn record_send(&mut self, lag: Duration, waited_for_slot: bool, in_flight: u64) {
        self.sent += 1;
        self.lag.record(lag);
        self.late_sends += u64::from(lag > LATE_AFTER);
        self.cap_waits += u64::from(waited_for_slot);
        self.peak_in_flight = self.peak_in_flight.max(in_flight);
    }

    /// Records a finished request.
    pub fn record(&mut self, outcome: &std::result::Result<Success, Failure>) {
        match outcome {
            Ok(s) => {
                self.ok += 1;
                match s.ttft {
                    Some(t) => self.ttft.record(t),
                    None => self.without_content += 1,
                }
                s.itl.iter().for_each(|&d| self.itl.record(d));
                self.e2e.record(s.e2e);
                self.content_chunks += s.content_chunks;
                match s.usage {
                    Some(u) => {
                        self.prompt_tokens += u.prompt_tokens;
                        self.cached_tokens += u.cached_tokens;
                        self.completion_tokens += u.completion_tokens;
                    }
                    None => self.without_usage += 1,
                }
            }
            Err(f) => {
                *self.errors.entry(f.kind.key()).or_default() += 1;
                if self.error_examples.len() < EXAMPLES {
                    self.error_examples
                        .push(format!("{}: {}", f.kind.key(), f.message));
                }
            }
        }
    }

    /// Failed requests of every kind.
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ErrorKind;
    use crate::sse::Usage;

    #[test]
    fn quantiles_in_ms() {
        let mut h = LatencyHist::default();
        for ms in 1..=100u64 {
            h.record(Duration::from_millis(ms));
        }
        let s = h.summary().unwrap();
        assert_eq!(s.count, 100);
        assert!((s.p50_ms - 50.0).abs() < 0.1, "{s:?}");
        assert!((s.p99_ms - 99.0).abs() < 0.1, "{s:?}");
        assert!((s.mean_ms - 50.5).abs() < 0.1, "{s:?}");
        assert!(LatencyHist::default().summary().is_none());
        // Out of range values are clamped, not lost.
        h.record(Duration::from_secs(10_000));
        h.record(Duration::ZERO);
        assert_eq!(h.count(), 102);
    }

    #[test]
    fn fine_quantiles_in_us() {
        let mut h = LatencyHist::fine();
        assert_eq!((h.count(), h.quantile_us(0.5), h.max_us()), (0, 0.0, 0.0));
        for us in 1..=100u64 {
            h.record(Duration::from_nanos(us * 1000 + 400));
        }
        // Sub-microsecond resolution (3 significant digits).
        assert!(
            (h.quantile_us(0.5) - 50.4).abs() < 0.11,
            "{}",
            h.quantile_us(0.5)
        );
        assert!((h.max_us() - 100.4).abs() < 0.11, "{}", h.max_us());
        assert!((h.mean_us() - 50.9).abs() < 0.11, "{}", h.mean_us());
        // Out of range values are clamped, not lost.
        h.record(Duration::from_secs(1000));
        h.record(Duration::ZERO);
        assert_eq!(h.count(), 102);
        assert!((h.max_us() - 120e6).abs() < 120e3, "{}", h.max_us());
    }

    #[test]
    fn counts_outcomes() {
        let mut s = Stats::default();
        s.record_send(Duration::from_millis(1), false, 1);
        s.record_send(Duration::from_millis(50), true, 2);
        s.record(&Ok(Success {
            ttft: Some(Duration::from_millis(20)),
            itl: vec![Duration::from_millis(5); 3],
            e2e: Duration::from_millis(40),
            content_chunks: 4,
            usage: Some(Usage {
                prompt_tokens: 100,
                completion_tokens: 4,
                cached_tokens: 64,
            }),
        }));
        s.record(&Err(Failure {
            kind: ErrorKind::Http(503),
            message: "busy".into(),
        }));
        assert_eq!((s.sent, s.ok, s.failed()), (2, 1, 1));
        assert_eq!((s.late_sends, s.cap_waits, s.peak_in_flight), (1, 1, 2));
        assert_eq!((s.prompt_tokens, s.cached_tokens), (100, 64));
        assert_eq!(s.itl.count(), 3);
        assert_eq!(s.errors["http_503"], 1);
        assert_eq!(s.error_examples, ["http_503: busy"]);
    }
}
