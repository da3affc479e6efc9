//! `GET /metrics`: vLLM's Prometheus metrics, rendered with `prometheus-client`.
//!
//! Names, kinds and labels follow vLLM V1 (vllm/v1/metrics/loggers.py):
//! gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc`; counters `vllm:prefix_cache_queries`,
//! `vllm:prefix_cache_hits`, `vllm:num_preemptions`, `vllm:prompt_tokens`,
//! `vllm:generation_tokens` (exposed with the `_total` suffix, as vLLM's
//! Python client does); info gauges `vllm:lora_requests_info` and
//! `vllm:cache_config_info`; latency histograms with vLLM's buckets. Every
//! series carries `model_name` and `engine` labels.
//!
//! `vllm:request_queue_time_seconds` and `vllm:request_prefill_time_seconds`
//! are estimates: the engine model does not report when a request was
//! scheduled, so the runner splits each TTFT using the profile's isolated
//! prefill time (see `runner`).
//!
//! **All times are virtual seconds** (the engine model's clock): with
//! `--speed N` a histogram sample of 1.0 took 1/N s of wall time. Only the
//! value of `vllm:lora_requests_info` is a wall-clock Unix timestamp, because
//! consumers use it to pick the newest series.

use std::sync::Mutex;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use switchyard_engine::EngineMetrics;

/// Label set used for every family (dynamic, since info gauges vary).
type Labels = Vec<(String, String)>;

/// vLLM's time-to-first-token buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token-latency buckets.
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request-latency buckets (e2e, queue, prefill).
const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Histogram family constructor with fixed buckets (a fn pointer so the
/// family type stays nameable).
type HistFamily = Family<Labels, Histogram, fn() -> Histogram>;

fn ttft_hist() -> Histogram {
    Histogram::new(TTFT_BUCKETS.iter().copied())
}
fn itl_hist() -> Histogram {
    Histogram::new(ITL_BUCKETS.iter().copied())
}
fn request_hist() -> Histogram {
    Histogram::new(REQUEST_BUCKETS.iter().copied())
}

/// Engine totals last pushed into the counters (counters only go up, so each
/// scrape adds the difference).
#[derive(Debug, Default)]
struct LastTotals {
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    num_preemptions: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    lora_key: Option<Labels>,
    lora_series: usize,
    cache_key: Option<Labels>,
}

/// All metric families of one emulated engine.
pub struct Metrics {
    registry: Registry,
    base: Labels,
    running: Family<Labels, Gauge>,
    waiting: Family<Labels, Gauge>,
    kv_usage: Family<Labels, Gauge<f64, AtomicU64>>,
    prefix_queries: Family<Labels, Counter>,
    prefix_hits: Family<Labels, Counter>,
    preemptions: Family<Labels, Counter>,
    prompt_tokens: Family<Labels, Counter>,
    generation_tokens: Family<Labels, Counter>,
    lora_info: Family<Labels, Gauge<f64, AtomicU64>>,
    cache_info: Family<Labels, Gauge>,
    ttft: HistFamily,
    itl: HistFamily,
    e2e: HistFamily,
    queue: HistFamily,
    prefill: HistFamily,
    last: Mutex<LastTotals>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("labels", &self.base)
            .finish()
    }
}

impl Metrics {
    /// Create the families for `model_name`; `engine` is vLLM's engine index ("0").
    pub fn new(model_name: &str, engine: &str) -> Self {
        let mut registry = Registry::default();
        let base: Labels = vec![
            ("model_name".to_string(), model_name.to_string()),
            ("engine".to_string(), engine.to_string()),
        ];
        let running = Family::<Labels, Gauge>::default();
        let waiting = Family::<Labels, Gauge>::default();
        let kv_usage = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        let prefix_queries = Family::<Labels, Counter>::default();
        let prefix_hits = Family::<Labels, Counter>::default();
        let preemptions = Family::<Labels, Counter>::default();
        let prompt_tokens = Family::<Labels, Counter>::default();
        let generation_tokens = Family::<Labels, Counter>::default();
        let lora_info = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        let cache_info = Family::<Labels, Gauge>::default();
        let ttft: HistFamily = Family::new_with_constructor(ttft_hist);
        let itl: HistFamily = Family::new_with_constructor(itl_hist);
        let e2e: HistFamily = Family::new_with_constructor(request_hist);
        let queue: HistFamily = Family::new_with_constructor(request_hist);
        let prefill: HistFamily = Family::new_with_constructor(request_hist);

        registry.register(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            running.clone(),
        );
        registry.register(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            waiting.clone(),
        );
        registry.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            kv_usage.clone(),
        );
        registry.register(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            prefix_queries.clone(),
        );
        registry.register(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            prefix_hits.clone(),
        );
        registry.register(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            preemptions.clone(),
        );
        registry.register(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            prompt_tokens.clone(),
        );
        registry.register(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            generation_tokens.clone(),
        );
        registry.register(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            lora_info.clone(),
        );
        registry.register(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            cache_info.clone(),
        );
        registry.register(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (virtual time).",
            ttft.clone(),
        );
        registry.register(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (virtual time).",
            itl.clone(),
        );
        registry.register(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds (virtual time).",
            e2e.clone(),
        );
        registry.register(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request (virtual time).",
            queue.clone(),
        );
        registry.register(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request (virtual time).",
            prefill.clone(),
        );
        Self {
            registry,
            base,
            running,
            waiting,
            kv_usage,
            prefix_queries,
            prefix_hits,
            preemptions,
            prompt_tokens,
            generation_tokens,
            lora_info,
            cache_info,
            ttft,
            itl,
            e2e,
            queue,
            prefill,
            last: Mutex::new(LastTotals::default()),
        }
    }

    /// Record a time to first token (virtual seconds).
    pub fn observe_ttft(&self, secs: f64) {
        self.ttft.get_or_create(&self.base).observe(secs.max(0.0));
    }

    /// Record one inter-token gap (virtual seconds).
    pub fn observe_itl(&self, secs: f64) {
        self.itl.get_or_create(&self.base).observe(secs.max(0.0));
    }

    /// Record an end-to-end latency (virtual seconds).
    pub fn observe_e2e(&self, secs: f64) {
        self.e2e.get_or_create(&self.base).observe(secs.max(0.0));
    }

    /// Record the time a request waited before it was scheduled (virtual seconds).
    pub fn observe_queue(&self, secs: f64) {
        self.queue.get_or_create(&self.base).observe(secs.max(0.0));
    }

    /// Record the time a request spent in prefill (virtual seconds).
    pub fn observe_prefill(&self, secs: f64) {
        self.prefill
            .get_or_create(&self.base)
            .observe(secs.max(0.0));
    }

    /// Bring gauges and counters up to `snap` and render the text exposition.
    ///
    /// `now_unix` is the wall-clock time used as the `lora_requests_info` value.
    pub fn render(&self, snap: &EngineMetrics, now_unix: f64) -> String {
        self.running
            .get_or_create(&self.base)
            .set(i64::from(snap.num_requests_running));
        self.waiting
            .get_or_create(&self.base)
            .set(i64::from(snap.num_requests_waiting));
        self.kv_usage
            .get_or_create(&self.base)
            .set(snap.kv_cache_usage);
        {
            // A poisoned lock only means another scrape panicked mid-update;
            // the totals are still usable.
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            bump(
                &self.prefix_queries,
                &self.base,
                &mut last.prefix_cache_queries,
                snap.prefix_cache_queries,
            );
            bump(
                &self.prefix_hits,
                &self.base,
                &mut last.prefix_cache_hits,
                snap.prefix_cache_hits,
            );
            bump(
                &self.preemptions,
                &self.base,
                &mut last.num_preemptions,
                snap.num_preemptions,
            );
            bump(
                &self.prompt_tokens,
                &self.base,
                &mut last.prompt_tokens,
                snap.prompt_tokens_total,
            );
            bump(
                &self.generation_tokens,
                &self.base,
                &mut last.generation_tokens,
                snap.generation_tokens_total,
            );
            // vLLM adds a new series (value = timestamp) whenever the adapter
            // sets change; consumers take the newest. Keep a bounded history.
            let lora_key: Labels = vec![
                ("max_lora".to_string(), snap.max_loras.to_string()),
                (
                    "running_lora_adapters".to_string(),
                    snap.running_lora_adapters.join(","),
                ),
                (
                    "waiting_lora_adapters".to_string(),
                    snap.waiting_lora_adapters.join(","),
                ),
            ];
            if last.lora_key.as_ref() != Some(&lora_key) {
                if last.lora_series >= 32 {
                    self.lora_info.clear();
                    last.lora_series = 0;
                }
                last.lora_series += 1;
                self.lora_info.get_or_create(&lora_key).set(now_unix);
                last.lora_key = Some(lora_key);
            }
            let mut cache_labels = self.base.clone();
            cache_labels.push(("block_size".to_string(), snap.block_size.to_string()));
            cache_labels.push((
                "num_gpu_blocks".to_string(),
                snap.num_gpu_blocks.to_string(),
            ));
            cache_labels.push(("enable_prefix_caching".to_string(), "True".to_string()));
            if last.cache_key.as_ref() != Some(&cache_labels) {
                self.cache_info.clear();
                self.cache_info.get_or_create(&cache_labels).set(1);
                last.cache_key = Some(cache_labels);
            }
        }
        let mut out = String::with_capacity(8192);
        // Writing into a String never fails.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Add the growth of an engine total to a counter.
fn bump(family: &Family<Labels, Counter>, labels: &Labels, last: &mut u64, now: u64) {
    let c = family.get_or_create(labels);
    if now > *last {
        c.inc_by(now - *last);
    }
    *last = (*last).max(now);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap() -> EngineMetrics {
        EngineMetrics {
            num_requests_running: 2,
            num_requests_waiting: 1,
            kv_cache_usage: 0.25,
            prefix_cache_queries: 100,
            prefix_cache_hits: 40,
            num_preemptions: 0,
            prompt_tokens_total: 100,
            generation_tokens_total: 10,
            running_lora_adapters: vec!["a".into()],
            waiting_lora_adapters: vec![],
            resident_lora_adapters: vec!["a".into()],
            max_loras: 2,
            num_gpu_blocks: 1000,
            block_size: 16,
        }
    }

    #[test]
    fn renders_vllm_names_and_labels() {
        let m = Metrics::new("my-model", "0");
        m.observe_ttft(0.12);
        m.observe_itl(0.02);
        m.observe_e2e(1.0);
        m.observe_queue(0.0);
        m.observe_prefill(0.1);
        let text = m.render(&snap(), 1000.0);
        for needle in [
            "vllm:num_requests_running{model_name=\"my-model\",engine=\"0\"} 2",
            "vllm:num_requests_waiting{model_name=\"my-model\",engine=\"0\"} 1",
            "vllm:kv_cache_usage_perc{model_name=\"my-model\",engine=\"0\"} 0.25",
            "vllm:prefix_cache_queries_total{model_name=\"my-model\",engine=\"0\"} 100",
            "vllm:prefix_cache_hits_total{model_name=\"my-model\",engine=\"0\"} 40",
            "vllm:num_preemptions_total",
            "vllm:prompt_tokens_total{model_name=\"my-model\",engine=\"0\"} 100",
            "vllm:generation_tokens_total{model_name=\"my-model\",engine=\"0\"} 10",
            "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a\",waiting_lora_adapters=\"\"} 1000",
            "num_gpu_blocks=\"1000\"",
            "block_size=\"16\"",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:time_to_first_token_seconds_count{model_name=\"my-model\",engine=\"0\"} 1",
            "vllm:inter_token_latency_seconds_sum",
            "vllm:e2e_request_latency_seconds_count",
            "vllm:request_queue_time_seconds_count",
            "vllm:request_prefill_time_seconds_count",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }

    #[test]
    fn counters_follow_engine_totals() {
        let m = Metrics::new("m", "0");
        let mut s = snap();
        m.render(&s, 1.0);
        s.prompt_tokens_total = 250;
        let text = m.render(&s, 2.0);
        assert!(text.contains("vllm:prompt_tokens_total{model_name=\"m\",engine=\"0\"} 250"));
    }

    #[test]
    fn lora_info_adds_newest_series() {
        let m = Metrics::new("m", "0");
        let mut s = snap();
        m.render(&s, 1.0);
        s.running_lora_adapters = vec!["a".into(), "b".into()];
        let text = m.render(&s, 2.0);
        assert!(text.contains("running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 2"));
        assert!(text.contains("running_lora_adapters=\"a\",waiting_lora_adapters=\"\"} 1"));
    }
}
