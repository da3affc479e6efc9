//! Live figures for the dashboard (`GET /dashboard`, in the `dashboard` module) that neither the
//! router nor the Prometheus metrics keep: the last decisions, per-second counts of where
//! requests went and of how far the TTFT estimates were off, and each backend's recent TTFTs.
//!
//! Every store is a fixed-size ring, so memory does not grow with traffic, uptime or the names
//! clients send: [`DECISIONS`] decisions, [`SECONDS`] one-second buckets (each with one counter
//! per router slot, bounded by [`MAX_SLOTS`]), [`TTFT_SAMPLES`] TTFTs per backend.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use switchyard_core::{Decision, RequestId};

/// Decisions kept for the dashboard's list.
pub const DECISIONS: usize = 50;
/// One-second buckets kept: the span of the dashboard's time series.
pub const SECONDS: usize = 120;
/// TTFT samples kept per backend (the most recent ones).
pub const TTFT_SAMPLES: usize = 256;
/// Seconds of samples a TTFT percentile or a traffic share is taken over.
pub const WINDOW_S: f64 = 60.0;
/// Router slots counted per bucket; requests to a higher slot are counted in the fleet total
/// only (a fleet that large would not fit on one dashboard row per instance anyway).
pub const MAX_SLOTS: usize = 1024;

/// One routing decision, as the dashboard lists it.
#[derive(Debug)]
pub struct DecisionRecord {
    /// Router clock when it was made, seconds.
    pub at_s: f64,
    /// The router's id of the request.
    pub request: RequestId,
    /// The base model routed on.
    pub model: String,
    /// The adapter asked for, if any.
    pub adapter: Option<String>,
    /// The decision itself (shared with the request, not copied).
    pub decision: Arc<Decision>,
    /// Its explanation, written the first time a dashboard asks (the same text as the
    /// `x-switchyard-decision` header), not on the request path.
    pub explained: OnceLock<String>,
}

/// Counts of one second of the router clock.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Second {
    /// Which second (`floor` of the router clock).
    pub at: u64,
    /// Requests routed, by router slot of the first choice (trailing zeros omitted).
    pub routed: Vec<u32>,
    /// Requests routed in all.
    pub total: u32,
    /// TTFT predictions compared with the observed TTFT.
    pub predictions: u32,
    /// Sum of ln(observed ÷ estimated) over them (exp of the mean: the typical ratio).
    pub log_ratio_sum: f64,
    /// Sum of |estimated − observed| ÷ observed over them.
    pub abs_error_sum: f64,
    /// Routed where the requested adapter was not resident (the engine loads it, evicting
    /// another when its slots are full).
    pub adapter_swaps: u32,
    /// Routed away from the eligible candidate predicted to hold the most of the prompt: the
    /// prefix is computed (and cached) again elsewhere, displacing other cache there.
    pub cache_moves: u32,
    /// Adapters loaded by dynamic placement.
    pub loads: u32,
    /// Adapters unloaded by dynamic placement.
    pub unloads: u32,
}

#[derive(Debug, Default)]
struct Inner {
    decisions: VecDeque<Arc<DecisionRecord>>,
    seconds: VecDeque<Second>,
}

impl Inner {
    /// The bucket of second `now` (created, and the oldest dropped, as time moves on).
    fn second(&mut self, now: f64) -> &mut Second {
        let at = now.max(0.0) as u64;
        if self.seconds.back().is_none_or(|s| s.at < at) {
            if self.seconds.len() == SECONDS {
                self.seconds.pop_front();
            }
            self.seconds.push_back(Second {
                at,
                ..Second::default()
            });
        }
        // A late observation (clock read before the last bucket opened) counts in the newest.
        self.seconds
            .back_mut()
            .expect("invariant: a bucket was pushed above if none existed")
    }
}

/// The gateway's live bookkeeping (one per gateway).
#[derive(Debug, Default)]
pub struct Live {
    inner: Mutex<Inner>,
    /// Dashboard event streams open now (the dashboard caps them).
    pub streams: Arc<std::sync::atomic::AtomicUsize>,
}

impl Live {
    /// Records a decision whose first choice is `chosen` (router slot), made at `now`.
    pub fn decided(
        &self,
        now: f64,
        request: RequestId,
        model: &str,
        adapter: Option<&str>,
        decision: &Arc<Decision>,
    ) {
        let first = decision.ranked_candidates().next();
        let chosen = first.map(|c| c.instance.slot as usize);
        let adapter_swap = adapter.is_some() && first.is_some_and(|c| c.terms.adapter_s > 0.0);
        let most_cached = decision
            .eligible_candidates()
            .iter()
            .map(|c| c.terms.cached_tokens)
            .max()
            .unwrap_or(0);
        let cache_move = first.is_some_and(|c| c.terms.cached_tokens < most_cached);
        let record = Arc::new(DecisionRecord {
            at_s: now,
            request,
            model: model.to_string(),
            adapter: adapter.map(str::to_string),
            decision: decision.clone(),
            explained: OnceLock::new(),
        });
        let mut inner = self.inner.lock();
        if inner.decisions.len() == DECISIONS {
            inner.decisions.pop_front();
        }
        inner.decisions.push_back(record);
        let second = inner.second(now);
        second.total += 1;
        if let Some(slot) = chosen.filter(|&s| s < MAX_SLOTS) {
            if second.routed.len() <= slot {
                second.routed.resize(slot + 1, 0);
            }
            second.routed[slot] += 1;
        }
        second.adapter_swaps += u32::from(adapter_swap);
        second.cache_moves += u32::from(cache_move);
    }

    /// Records a TTFT estimate against what was observed.
    pub fn predicted(&self, now: f64, estimated_s: f64, observed_s: f64) {
        if !(estimated_s > 0.0 && observed_s > 0.0) {
            return;
        }
        let mut inner = self.inner.lock();
        let second = inner.second(now);
        second.predictions += 1;
        second.log_ratio_sum += (observed_s / estimated_s).ln();
        second.abs_error_sum += (estimated_s - observed_s).abs() / observed_s;
    }

    /// Records a dynamic placement action that succeeded (`load` or `unload`).
    pub fn placed(&self, now: f64, load: bool) {
        let mut inner = self.inner.lock();
        let second = inner.second(now);
        if load {
            second.loads += 1;
        } else {
            second.unloads += 1;
        }
    }

    /// The last decisions, oldest first.
    pub fn decisions(&self) -> Vec<Arc<DecisionRecord>> {
        self.inner.lock().decisions.iter().cloned().collect()
    }

    /// The one-second buckets, oldest first (seconds without any event have none).
    pub fn seconds(&self) -> Vec<Second> {
        self.inner.lock().seconds.iter().cloned().collect()
    }
}

/// A backend's most recent TTFTs, with when they were observed.
#[derive(Debug, Default)]
pub struct TtftWindow {
    samples: Mutex<VecDeque<(f64, f64)>>,
}

impl TtftWindow {
    /// Records a TTFT of `ttft_s` observed at `now`.
    pub fn record(&self, now: f64, ttft_s: f64) {
        let mut samples = self.samples.lock();
        if samples.len() == TTFT_SAMPLES {
            samples.pop_front();
        }
        samples.push_back((now, ttft_s));
    }

    /// The TTFTs observed since `since`, unordered.
    pub fn since(&self, since: f64) -> Vec<f64> {
        self.samples
            .lock()
            .iter()
            .filter(|(at, _)| *at >= since)
            .map(|(_, t)| *t)
            .collect()
    }
}

/// The `q` quantile (0..=1) of `values` (sorted here), nearest rank; `None` when empty.
pub fn quantile(values: &mut [f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let rank = (q * values.len() as f64).ceil() as usize;
    Some(values[rank.clamp(1, values.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&mut v, 0.5), Some(50.0));
        assert_eq!(quantile(&mut v, 0.99), Some(99.0));
        assert_eq!(quantile(&mut v, 1.0), Some(100.0));
        assert_eq!(quantile(&mut [3.0], 0.99), Some(3.0));
        assert_eq!(quantile(&mut [], 0.5), None);
    }

    #[test]
    fn the_ttft_window_keeps_the_most_recent_samples() {
        let w = TtftWindow::default();
        for k in 0..(TTFT_SAMPLES * 3) {
            w.record(k as f64, k as f64);
        }
        let all = w.since(0.0);
        assert_eq!(all.len(), TTFT_SAMPLES);
        assert_eq!(all.first(), Some(&((TTFT_SAMPLES * 2) as f64)));
        assert_eq!(w.since((TTFT_SAMPLES * 3 - 10) as f64).len(), 10);
    }

    /// Routes `n` requests (recorded as routed, never finished, so load builds up) and keeps
    /// each decision in `live`.
    fn route_all(
        router: &mut switchyard_core::Router,
        live: &Live,
        request: &switchyard_core::RouteRequest<'_>,
        n: u64,
    ) -> Vec<switchyard_core::InstanceId> {
        let mut chosen = Vec::new();
        for k in 0..n {
            let now = k as f64 * 0.01;
            let decision = Arc::new(router.route(request, now).unwrap());
            live.decided(now, RequestId(k), request.model, request.adapter, &decision);
            let first = decision.best().unwrap();
            let plan = decision.plan_for(first);
            let routed = switchyard_core::Observation::Routed {
                request: RequestId(k + 1000 * u64::from(request.adapter.is_some())),
                instance: first,
                plan,
            };
            router.observe(routed, now).unwrap();
            chosen.push(first);
        }
        chosen
    }

    #[test]
    fn decisions_count_cache_moves_and_adapter_swaps() {
        use switchyard_core::{InstanceSpec, RouteRequest, Router};
        let mut router = Router::new(Default::default()).unwrap();
        for name in ["a", "b"] {
            let spec = InstanceSpec {
                models: vec!["m".into()],
                adapters: vec!["lora".into()],
                adapter_slots: 1,
                ..InstanceSpec::new(name, name)
            };
            router.add_instance(spec).unwrap();
        }
        let live = Live::default();
        // One long prompt again and again: it is cached where it went first, and moved to the
        // other instance once queueing there costs more than prefilling it again.
        let prompt = "the same long prompt ".repeat(400);
        let chosen = route_all(&mut router, &live, &RouteRequest::text("m", &prompt), 30);
        let moved = chosen.iter().filter(|&&c| c != chosen[0]).count() as u32;
        assert!(moved > 0, "never moved: the test needs another setup");
        let seconds = live.seconds();
        let moves: u32 = seconds.iter().map(|s| s.cache_moves).sum();
        assert!(
            moves > 0 && moves <= moved,
            "{moves} moves, {moved} away from the first"
        );
        assert_eq!(seconds.iter().map(|s| s.adapter_swaps).sum::<u32>(), 0);
        // The first request for an adapter loads it; the next ones find it resident.
        let with_adapter = RouteRequest {
            adapter: Some("lora"),
            ..RouteRequest::text("m", "short")
        };
        route_all(&mut router, &live, &with_adapter, 3);
        let swaps: u32 = live.seconds().iter().map(|s| s.adapter_swaps).sum();
        assert!((1..=2).contains(&swaps), "{swaps} swaps");
        let total: u32 = live.seconds().iter().map(|s| s.total).sum();
        assert_eq!(total, 33);
        assert_eq!(live.decisions().len(), 33);
    }

    #[test]
    fn the_decision_ring_keeps_the_last() {
        let mut router = switchyard_core::Router::new(Default::default()).unwrap();
        let spec = switchyard_core::InstanceSpec {
            models: vec!["m".into()],
            ..switchyard_core::InstanceSpec::new("a", "a")
        };
        router.add_instance(spec).unwrap();
        let live = Live::default();
        let request = switchyard_core::RouteRequest::text("m", "hi");
        route_all(&mut router, &live, &request, (DECISIONS * 3) as u64);
        let kept = live.decisions();
        assert_eq!(kept.len(), DECISIONS);
        assert_eq!(kept[0].request, RequestId((DECISIONS * 2) as u64));
        assert_eq!(
            kept[DECISIONS - 1].request,
            RequestId((DECISIONS * 3 - 1) as u64)
        );
    }

    #[test]
    fn buckets_stay_bounded_and_in_order() {
        let live = Live::default();
        for k in 0..(SECONDS * 2) {
            live.predicted(k as f64 + 0.5, 1.0, 2.0);
            live.placed(k as f64 + 0.6, k % 2 == 0);
        }
        // A late observation lands in the newest bucket, not in a new older one.
        live.predicted(3.0, 1.0, 1.0);
        let seconds = live.seconds();
        assert_eq!(seconds.len(), SECONDS);
        assert!(seconds.windows(2).all(|w| w[0].at + 1 == w[1].at));
        let last = seconds.last().unwrap();
        assert_eq!(last.at, (SECONDS * 2 - 1) as u64);
        assert_eq!(last.predictions, 2);
        assert!((last.log_ratio_sum - 2f64.ln()).abs() < 1e-9);
        assert_eq!(last.loads + last.unloads, 1);
        // Nonsense predictions are not counted.
        live.predicted(1e9, 0.0, 1.0);
        assert_eq!(live.seconds().len(), SECONDS);
    }
}
