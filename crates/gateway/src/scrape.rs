//! Engine metrics scraping: `GET /metrics` every `scrape_interval`, turned into the core's
//! [`EngineMetrics`] for vLLM, SGLang, llama.cpp and TensorRT-LLM names (`auto` detects the
//! engine from the prefixes). A failed scrape feeds nothing: the core treats stale metrics as
//! unknown, not idle.

use std::sync::Arc;

use switchyard_core::{EngineMetrics, Observation};

use crate::backends::{Backend, EngineKind};
use crate::promtext::{samples, Sample};
use crate::state::Gateway;

/// Scrapes one backend until it leaves the fleet.
pub async fn run(gw: Arc<Gateway>, backend: Arc<Backend>) {
    let Ok(uri) = backend.base.uri("/metrics") else {
        return;
    };
    let mut slots = SlotQuery::default();
    let mut tick = tokio::time::interval(gw.settings.scrape_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if backend.is_removed() {
            return;
        }
        // An ejected backend is not scraped: its last metrics go stale on their own.
        if !backend.is_healthy() {
            continue;
        }
        let answer = gw
            .upstream
            .get(uri.clone(), gw.settings.probe_timeout, 16 << 20)
            .await;
        let text = match answer {
            Ok((status, body)) if status.is_success() => body,
            Ok((status, _)) => {
                backend.metrics.scrape_error.inc();
                tracing::debug!(backend = backend.name(), %status, "scrape failed");
                continue;
            }
            Err(e) => {
                backend.metrics.scrape_error.inc();
                tracing::debug!(backend = backend.name(), "scrape failed: {e}");
                continue;
            }
        };
        let Ok(text) = std::str::from_utf8(&text) else {
            backend.metrics.scrape_error.inc();
            continue;
        };
        let (kind, metrics) = engine_metrics(text, backend.kind());
        if kind != backend.kind() {
            tracing::info!(backend = backend.name(), ?kind, "engine kind detected");
            backend.set_kind(kind);
        }
        if kind == EngineKind::Llamacpp {
            slots.ask(&gw, &backend).await;
        }
        match metrics {
            Some(mut m) => {
                m.max_running = slots.total;
                backend.metrics.scrape_ok.inc();
                gw.observe(Observation::MetricsScraped(backend.id, m));
                gw.admission.wake();
            }
            None => {
                backend.metrics.scrape_error.inc();
            }
        }
    }
}

/// llama.cpp's sequence slots, from `GET /props` (`total_slots`): its metrics show the busy
/// slots and the deferred requests but not how many slots there are, and at moderate load
/// requests rarely wait long enough for the router to learn the limit from two scrapes.
#[derive(Default)]
struct SlotQuery {
    /// What the engine said.
    total: Option<u32>,
    /// Asked and got an answer (or a refusal): not asked again.
    settled: bool,
}

impl SlotQuery {
    async fn ask(&mut self, gw: &Gateway, backend: &Backend) {
        if self.settled {
            return;
        }
        let Ok(uri) = backend.base.uri("/props") else {
            self.settled = true;
            return;
        };
        match gw
            .upstream
            .get(uri, gw.settings.probe_timeout, 1 << 20)
            .await
        {
            Ok((status, body)) if status.is_success() => {
                self.settled = true;
                self.total = total_slots(&body);
                match self.total {
                    Some(n) => tracing::info!(backend = backend.name(), slots = n, "engine slots"),
                    None => tracing::info!(backend = backend.name(), "no total_slots in /props"),
                }
            }
            // An engine without `/props` will not grow one; a transport error is asked again.
            Ok(_) => self.settled = true,
            Err(e) => tracing::debug!(backend = backend.name(), "/props failed: {e}"),
        }
    }
}

/// `total_slots` from a llama.cpp `/props` body (a positive integer, else none).
pub fn total_slots(body: &[u8]) -> Option<u32> {
    #[derive(serde::Deserialize)]
    struct Props {
        total_slots: Option<u64>,
    }
    let props: Props = serde_json::from_slice(body).ok()?;
    props
        .total_slots
        .filter(|&n| n > 0)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// Detects the engine from metric name prefixes.
pub fn detect(text: &str) -> EngineKind {
    for s in samples(text) {
        if s.name.starts_with("vllm:") {
            return EngineKind::Vllm;
        }
        if s.name.starts_with("sglang:") {
            return EngineKind::Sglang;
        }
        if s.name.starts_with("llamacpp:") {
            return EngineKind::Llamacpp;
        }
        if s.name.starts_with("trtllm_") {
            return EngineKind::Trtllm;
        }
    }
    EngineKind::Auto
}

/// Reads the engine's load signals from a scrape; `kind` `Auto` detects first. Returns the
/// kind used and the metrics, or `None` when none of the engine's load gauges is present.
pub fn engine_metrics(text: &str, kind: EngineKind) -> (EngineKind, Option<EngineMetrics>) {
    let kind = match kind {
        EngineKind::Auto => detect(text),
        k => k,
    };
    let metrics = match kind {
        EngineKind::Auto => None,
        EngineKind::Vllm => vllm(text),
        EngineKind::Sglang => simple(
            text,
            "sglang:num_queue_reqs",
            "sglang:num_running_reqs",
            Some("sglang:token_usage"),
            Some("sglang:max_total_num_tokens"),
        ),
        EngineKind::Llamacpp => simple(
            text,
            "llamacpp:requests_deferred",
            "llamacpp:requests_processing",
            None,
            None,
        ),
        EngineKind::Trtllm => simple(
            text,
            "trtllm_num_requests_waiting",
            "trtllm_num_requests_running",
            Some("trtllm_kv_cache_utilization"),
            None,
        ),
    };
    (kind, metrics)
}

fn count(v: f64) -> u32 {
    if v.is_finite() && v > 0.0 {
        v.round().min(f64::from(u32::MAX)) as u32
    } else {
        0
    }
}

fn fraction(v: f64) -> Option<f64> {
    v.is_finite().then(|| v.clamp(0.0, 1.0))
}

/// Engines with one gauge per signal: counts are summed over series (data-parallel ranks),
/// usage is the highest.
fn simple(
    text: &str,
    waiting: &str,
    running: &str,
    usage: Option<&str>,
    capacity: Option<&str>,
) -> Option<EngineMetrics> {
    let mut m = EngineMetrics::default();
    let mut seen = false;
    for s in samples(text) {
        if s.name == waiting {
            m.waiting = m.waiting.saturating_add(count(s.value));
            seen = true;
        } else if s.name == running {
            m.running = m.running.saturating_add(count(s.value));
            seen = true;
        } else if Some(s.name) == usage {
            m.kv_usage = max_opt(m.kv_usage, fraction(s.value));
        } else if Some(s.name) == capacity && s.value.is_finite() && s.value > 0.0 {
            m.kv_capacity_tokens = Some(m.kv_capacity_tokens.unwrap_or(0) + s.value as u64);
        }
    }
    seen.then_some(m)
}

fn max_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

fn split_list(s: Option<&str>) -> Vec<String> {
    s.unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(String::from)
        .collect()
}

fn vllm(text: &str) -> Option<EngineMetrics> {
    let mut m = EngineMetrics::default();
    let mut seen = false;
    let mut newest_lora: Option<Sample<'_>> = None;
    let mut capacity: Option<u64> = None;
    for s in samples(text) {
        match s.name {
            "vllm:num_requests_waiting" => {
                m.waiting = m.waiting.saturating_add(count(s.value));
                seen = true;
            }
            "vllm:num_requests_running" => {
                m.running = m.running.saturating_add(count(s.value));
                seen = true;
            }
            // The older name, deprecated in V1.
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                m.kv_usage = max_opt(m.kv_usage, fraction(s.value));
            }
            // The value is a timestamp: the newest series is the current state.
            "vllm:lora_requests_info"
                if newest_lora.as_ref().is_none_or(|n| s.value >= n.value) =>
            {
                newest_lora = Some(s);
            }
            "vllm:cache_config_info" => {
                let blocks = s
                    .label("num_gpu_blocks")
                    .and_then(|v| v.parse::<u64>().ok());
                let size = s.label("block_size").and_then(|v| v.parse::<u64>().ok());
                if let (Some(b), Some(z)) = (blocks, size) {
                    // Engine-supplied labels: absurd values saturate instead of overflowing.
                    capacity = Some(capacity.unwrap_or(0).saturating_add(b.saturating_mul(z)));
                }
            }
            _ => {}
        }
    }
    if let Some(l) = newest_lora {
        m.running_adapters = split_list(l.label("running_lora_adapters"));
        m.waiting_adapters = split_list(l.label("waiting_lora_adapters"));
        m.max_adapters = l.label("max_lora").and_then(|v| v.parse().ok());
    }
    m.kv_capacity_tokens = capacity;
    seen.then_some(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 2.0
vllm:num_requests_waiting{model_name="m",engine="0"} 3.0
vllm:num_requests_waiting{model_name="m",engine="1"} 1.0
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.0e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",model_name="m"} 1.0
vllm:prefix_cache_hits_total{model_name="m"} 5
"#;

    #[test]
    fn vllm_gauges_adapters_and_capacity() {
        let (kind, m) = engine_metrics(VLLM, EngineKind::Auto);
        assert_eq!(kind, EngineKind::Vllm);
        let m = m.unwrap();
        assert_eq!(m.running, 2);
        assert_eq!(m.waiting, 4);
        assert_eq!(m.kv_usage, Some(0.25));
        assert_eq!(m.running_adapters, vec!["a", "b"]);
        assert_eq!(m.waiting_adapters, vec!["c"]);
        assert_eq!(m.max_adapters, Some(2));
        assert_eq!(m.kv_capacity_tokens, Some(16000));
    }

    #[test]
    fn absurd_cache_config_labels_saturate_instead_of_overflowing() {
        // Found by the prometheus_text fuzz target: block_size × num_gpu_blocks overflowed u64.
        let text = "vllm:num_requests_running 1\n\
                    vllm:cache_config_info{block_size=\"18446744073709551615\",num_gpu_blocks=\"2\"} 1\n\
                    vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"18446744073709551615\"} 1\n";
        let m = engine_metrics(text, EngineKind::Vllm).1.unwrap();
        assert_eq!(m.kv_capacity_tokens, Some(u64::MAX));
    }

    #[test]
    fn sglang_llamacpp_trtllm() {
        let sg = "sglang:num_queue_reqs{model_name=\"m\"} 5\nsglang:num_running_reqs{model_name=\"m\"} 7\nsglang:token_usage{model_name=\"m\"} 0.5\nsglang:max_total_num_tokens{model_name=\"m\"} 100000\n";
        let (k, m) = engine_metrics(sg, EngineKind::Auto);
        assert_eq!(k, EngineKind::Sglang);
        let m = m.unwrap();
        assert_eq!((m.waiting, m.running, m.kv_usage), (5, 7, Some(0.5)));
        assert_eq!(m.kv_capacity_tokens, Some(100_000));
        let ll = "# HELP llamacpp:requests_processing x\nllamacpp:requests_processing 1\nllamacpp:requests_deferred 2\nllamacpp:prompt_tokens_total 10\n";
        let (k, m) = engine_metrics(ll, EngineKind::Auto);
        assert_eq!(k, EngineKind::Llamacpp);
        let m = m.unwrap();
        assert_eq!((m.waiting, m.running, m.kv_usage), (2, 1, None));
        let trt = "trtllm_num_requests_waiting 1\ntrtllm_num_requests_running 2\ntrtllm_kv_cache_utilization 0.9\n";
        let m = engine_metrics(trt, EngineKind::Trtllm).1.unwrap();
        assert_eq!((m.waiting, m.running, m.kv_usage), (1, 2, Some(0.9)));
    }

    #[test]
    fn llamacpp_props_give_the_slot_count() {
        assert_eq!(
            total_slots(br#"{"total_slots":4,"model_path":"x"}"#),
            Some(4)
        );
        assert_eq!(total_slots(br#"{"total_slots":0}"#), None);
        assert_eq!(total_slots(br#"{"total_slots":-1}"#), None);
        assert_eq!(total_slots(br#"{"model_path":"x"}"#), None);
        assert_eq!(total_slots(b"not json"), None);
    }

    #[test]
    fn unknown_or_empty_scrapes_feed_nothing() {
        assert_eq!(
            engine_metrics("foo 1\n", EngineKind::Auto),
            (EngineKind::Auto, None)
        );
        assert_eq!(engine_metrics("", EngineKind::Vllm).1, None);
        // The configured kind wins over detection.
        assert_eq!(engine_metrics(VLLM, EngineKind::Sglang).1, None);
    }
}
