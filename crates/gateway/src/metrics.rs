//! The gateway's own Prometheus metrics (`GET /metrics`), all prefixed `switchyard_`.
//!
//! Per-backend series are created once when a backend joins (handles are kept in
//! [`BackendMetrics`]) so the request path never hashes label sets; they are removed when the
//! backend leaves.

use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Labels `backend`, `outcome`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// Backend name (empty for requests the gateway answered itself).
    pub backend: String,
    /// What happened.
    pub outcome: &'static str,
}

/// Label `backend`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabel {
    /// Backend name.
    pub backend: String,
}

/// Labels `backend`, `result`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// Backend name.
    pub backend: String,
    /// Result of the attempt, scrape or check.
    pub result: &'static str,
}

/// Label `result`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// Result.
    pub result: &'static str,
}

/// Label `path` alone.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabel {
    /// Where the work was done.
    pub path: &'static str,
}

/// Labels `backend`, `adapter`, `action`, `outcome` (dynamic adapter placement).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlacementLabels {
    /// Backend name.
    pub backend: String,
    /// Adapter name.
    pub adapter: String,
    /// `load` or `unload`.
    pub action: &'static str,
    /// `ok` or `error`.
    pub outcome: &'static str,
}

/// Label `adapter`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdapterLabel {
    /// Adapter name.
    pub adapter: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 1 ms .. ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Request outcomes recorded per backend.
pub mod outcome {
    /// 2xx answered completely.
    pub const OK: &str = "ok";
    /// 4xx from the engine, passed through.
    pub const CLIENT_ERROR: &str = "client_error";
    /// 5xx/429 from the engine on the last attempt, passed through.
    pub const SERVER_ERROR: &str = "server_error";
    /// The engine's body failed after the response started.
    pub const STREAM_ERROR: &str = "stream_error";
    /// The client went away before the end.
    pub const CANCELLED: &str = "cancelled";
    /// The engine did not answer in time (504).
    pub const TIMEOUT: &str = "timeout";
    /// The engine stopped sending mid-body for `--stream-idle-timeout`; the gateway ended it.
    pub const STREAM_STALLED: &str = "stream_stalled";
}

/// All metric handles.
pub struct Metrics {
    registry: Registry,
    requests: Family<OutcomeLabels, Counter>,
    attempts: Family<ResultLabels, Counter>,
    /// Requests sent to another candidate after a failed attempt.
    pub retries: Counter,
    /// Requests that failed the same way on every candidate, not held against their health.
    pub request_blamed: Counter,
    /// Client connections answered 503 and closed at the `--max-connections` cap.
    pub connections_refused: Counter,
    /// Time spent in `Router::route`.
    pub decision_seconds: Histogram,
    /// Observed ÷ estimated TTFT of each routed request (`cost` only): 1 is a perfect estimate.
    pub ttft_prediction_ratio: Histogram,
    /// Replica sync: a peer's batch, from the peer's clock when it sent it to this replica's
    /// when it was applied (`--peer`; meaningful with synchronised clocks).
    pub peer_sync_lag: Histogram,
    /// |predicted − reported| cached tokens ÷ prompt tokens of each finished request.
    pub cached_prediction_error: Histogram,
    ttft: HistogramFamily<BackendLabel>,
    e2e: HistogramFamily<BackendLabel>,
    predicted_cached: Family<BackendLabel, Counter>,
    reported_cached: Family<BackendLabel, Counter>,
    prompt_tokens: Family<BackendLabel, Counter>,
    /// Requests waiting in the admission queue.
    pub admission_queue: Gauge,
    /// Request-body bytes held of `--max-body-memory` (set when rendered).
    pub body_memory: Gauge,
    healthy: Family<BackendLabel, Gauge>,
    in_flight: Family<BackendLabel, Gauge>,
    scrapes: Family<ResultLabels, Counter>,
    health_checks: Family<ResultLabels, Counter>,
    kv_events: KvEventFamilies,
    reloads: Family<ResultLabel, Counter>,
    /// Replica-sync messages by result (`--peer`).
    peer_messages: Family<ResultLabel, Counter>,
    /// `--peer-dns` lookups by result (`ok`, `failed`).
    peer_dns_lookups: Family<ResultLabel, Counter>,
    /// Prompts tokenized for exact matching (`--tokenizer`), by result.
    tokenized: Family<ResultLabel, Counter>,
    /// Chat answers tokenized into the piece cache for their conversation's next turn, by
    /// result.
    tokenizer_warmups: Family<ResultLabel, Counter>,
    /// Bytes of prompt text tokenized anew (not found in the piece cache), by path.
    tokenizer_new_bytes: Family<PathLabel, Counter>,
    /// Replicas the last successful `--peer-dns` lookup found (this one left out).
    pub peer_dns_peers: Gauge,
    /// Failed Kubernetes discovery calls (list, watch): one per failure, whatever the cause.
    pub discovery_errors: Counter,
    /// Unix time of the last successful Kubernetes discovery call (0: never).
    pub discovery_last_sync: Gauge<f64, AtomicU64>,
    /// Endpoints the Kubernetes pool currently asks for.
    pub discovery_endpoints: Gauge,
    placements: Family<PlacementLabels, Counter>,
    /// Placement series created, to remove a leaving backend's.
    placement_series: parking_lot::Mutex<Vec<PlacementLabels>>,
    adapter_demand: Family<AdapterLabel, Gauge<f64, AtomicU64>>,
    /// Adapters with a demand series.
    demand_series: parking_lot::Mutex<Vec<String>>,
}

/// The KV event subscription's series, one of each per backend with `kv_events=`.
#[derive(Default)]
struct KvEventFamilies {
    received: Family<BackendLabel, Counter>,
    gaps: Family<BackendLabel, Counter>,
    decode_errors: Family<BackendLabel, Counter>,
    fallbacks: Family<BackendLabel, Counter>,
    exact: Family<BackendLabel, Gauge>,
    replays: Family<OutcomeLabels, Counter>,
}

/// Outcomes of asking an engine's replay endpoint for the batches a gap lost.
const REPLAY_OUTCOMES: [&str; 3] = ["filled", "partial", "failed"];

/// Handles for one backend's KV event series.
#[derive(Clone, Default)]
pub struct KvEventMetrics {
    /// Events decoded and fed to the router.
    pub received: Counter,
    /// Sequence numbers skipped (messages lost between the engine and the gateway).
    pub gaps: Counter,
    /// Messages that could not be decoded (dropped, handled as a loss).
    pub decode_errors: Counter,
    /// Episodes of falling back to the approximate index.
    pub fallbacks: Counter,
    /// 1 while the router matches this backend exactly from its events.
    pub exact: Gauge,
    /// Replays that brought back every batch of a gap (the stream stayed trusted).
    pub replays_filled: Counter,
    /// Replays that brought back some of a gap's batches (applied; then the fallback).
    pub replays_partial: Counter,
    /// Replays that brought back nothing (unreachable, timed out, buffer moved on).
    pub replays_failed: Counter,
}

/// Handles for one backend's series.
#[derive(Clone)]
pub struct BackendMetrics {
    /// Completed 2xx requests.
    pub ok: Counter,
    /// 4xx passed through.
    pub client_error: Counter,
    /// 5xx/429 passed through.
    pub server_error: Counter,
    /// Body failed mid-way.
    pub stream_error: Counter,
    /// Client disconnects.
    pub cancelled: Counter,
    /// Upstream timeouts.
    pub timeout: Counter,
    /// Bodies ended after the engine went silent.
    pub stream_stalled: Counter,
    /// Time to first body byte.
    pub ttft: Histogram,
    /// Time to the end of the body.
    pub e2e: Histogram,
    /// Cached prompt tokens the router predicted.
    pub predicted_cached: Counter,
    /// Cached prompt tokens the engine reported.
    pub reported_cached: Counter,
    /// Prompt tokens the engine reported.
    pub prompt_tokens: Counter,
    /// 1 when the backend takes traffic.
    pub healthy: Gauge,
    /// Requests in flight through the gateway.
    pub in_flight: Gauge,
    /// Successful scrapes.
    pub scrape_ok: Counter,
    /// Failed scrapes.
    pub scrape_error: Counter,
    /// Passed health checks.
    pub check_ok: Counter,
    /// Failed health checks.
    pub check_error: Counter,
    /// KV event subscription (series exist only for backends with `kv_events=`).
    pub kv_events: KvEventMetrics,
}

impl BackendMetrics {
    /// Handles registered nowhere (tests, tools).
    pub fn detached() -> Self {
        BackendMetrics {
            ok: Counter::default(),
            client_error: Counter::default(),
            server_error: Counter::default(),
            stream_error: Counter::default(),
            cancelled: Counter::default(),
            timeout: Counter::default(),
            stream_stalled: Counter::default(),
            ttft: latency_histogram(),
            e2e: latency_histogram(),
            predicted_cached: Counter::default(),
            reported_cached: Counter::default(),
            prompt_tokens: Counter::default(),
            healthy: Gauge::default(),
            in_flight: Gauge::default(),
            scrape_ok: Counter::default(),
            scrape_error: Counter::default(),
            check_ok: Counter::default(),
            check_error: Counter::default(),
            kv_events: KvEventMetrics::default(),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every family.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "switchyard_requests",
            "Requests by backend and outcome (backend empty: answered by the gateway)",
            requests.clone(),
        );
        let attempts = Family::<ResultLabels, Counter>::default();
        registry.register(
            "switchyard_upstream_failures",
            "Failed upstream attempts by backend and cause (refused, connect, closed, stale, status_5xx, status_429)",
            attempts.clone(),
        );
        let retries = Counter::default();
        registry.register(
            "switchyard_retries",
            "Attempts moved to the next candidate after a failure",
            retries.clone(),
        );
        let request_blamed = Counter::default();
        registry.register(
            "switchyard_request_blamed",
            "Requests that failed the same way on every candidate (the request, not the engines: not held against their health)",
            request_blamed.clone(),
        );
        let connections_refused = Counter::default();
        registry.register(
            "switchyard_connections_refused",
            "Client connections answered 503 and closed because --max-connections were open",
            connections_refused.clone(),
        );
        let decision_seconds = Histogram::new(exponential_buckets(1e-6, 2.0, 16));
        registry.register(
            "switchyard_decision_seconds",
            "Time to route one request (Router::route)",
            decision_seconds.clone(),
        );
        // 1/16 .. 16 in steps of sqrt(2): a ratio's median and p90 to within about 20 %.
        let ttft_prediction_ratio =
            Histogram::new(exponential_buckets(1.0 / 16.0, 2f64.sqrt(), 17));
        registry.register(
            "switchyard_ttft_prediction_ratio",
            "Observed over estimated time to first token of each routed request",
            ttft_prediction_ratio.clone(),
        );
        // 0.25 ms .. about 4 s: the simulator measured 5 ms as harmless and 50 ms as harmful.
        let peer_sync_lag = Histogram::new(exponential_buckets(0.000_25, 2.0, 15));
        registry.register(
            "switchyard_peer_sync_lag_seconds",
            "Replica sync (--peer): from a peer sending a batch to this replica applying it (by the two clocks)",
            peer_sync_lag.clone(),
        );
        let cached_prediction_error =
            Histogram::new([0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]);
        registry.register(
            "switchyard_cached_prediction_error",
            "Predicted minus reported cached tokens, absolute, over prompt tokens, per request",
            cached_prediction_error.clone(),
        );
        let ttft: HistogramFamily<BackendLabel> = Family::new_with_constructor(latency_histogram);
        registry.register(
            "switchyard_ttft_seconds",
            "Time from request arrival to the first response body byte, per backend",
            ttft.clone(),
        );
        let e2e: HistogramFamily<BackendLabel> = Family::new_with_constructor(latency_histogram);
        registry.register(
            "switchyard_e2e_seconds",
            "Time from request arrival to the end of the response, per backend",
            e2e.clone(),
        );
        let predicted_cached = Family::<BackendLabel, Counter>::default();
        registry.register(
            "switchyard_predicted_cached_tokens",
            "Prompt tokens the router predicted cached, for finished requests with usage",
            predicted_cached.clone(),
        );
        let reported_cached = Family::<BackendLabel, Counter>::default();
        registry.register(
            "switchyard_reported_cached_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
            reported_cached.clone(),
        );
        let prompt_tokens = Family::<BackendLabel, Counter>::default();
        registry.register(
            "switchyard_prompt_tokens",
            "Prompt tokens the engine reported, for finished requests with usage",
            prompt_tokens.clone(),
        );
        let admission_queue = Gauge::default();
        registry.register(
            "switchyard_admission_queue_length",
            "Requests waiting in the admission queue",
            admission_queue.clone(),
        );
        let body_memory = Gauge::default();
        registry.register(
            "switchyard_body_memory_bytes",
            "Request-body bytes held of --max-body-memory (bodies being received or sent)",
            body_memory.clone(),
        );
        let healthy = Family::<BackendLabel, Gauge>::default();
        registry.register(
            "switchyard_backend_healthy",
            "1 when the backend takes traffic, 0 when ejected or draining",
            healthy.clone(),
        );
        let in_flight = Family::<BackendLabel, Gauge>::default();
        registry.register(
            "switchyard_backend_in_flight",
            "Requests in flight through the gateway, per backend",
            in_flight.clone(),
        );
        let scrapes = Family::<ResultLabels, Counter>::default();
        registry.register(
            "switchyard_scrapes",
            "Engine metrics scrapes by backend and result (ok, error)",
            scrapes.clone(),
        );
        let health_checks = Family::<ResultLabels, Counter>::default();
        registry.register(
            "switchyard_health_checks",
            "Active health checks by backend and result (ok, error)",
            health_checks.clone(),
        );
        let kv_events = KvEventFamilies::default();
        for (name, help, family) in [
            (
                "switchyard_kv_events_received",
                "KV cache events decoded from a backend's ZeroMQ stream and fed to the router",
                &kv_events.received,
            ),
            (
                "switchyard_kv_events_gaps",
                "KV event messages lost: sequence numbers skipped in a backend's stream",
                &kv_events.gaps,
            ),
            (
                "switchyard_kv_events_decode_errors",
                "KV event messages that could not be decoded (dropped and handled as lost)",
                &kv_events.decode_errors,
            ),
            (
                "switchyard_kv_events_fallbacks",
                "Episodes of a backend's KV events becoming untrusted (gap, silence, lag, disconnection): its exact index is dropped and the approximate one used",
                &kv_events.fallbacks,
            ),
        ] {
            registry.register(name, help, family.clone());
        }
        registry.register(
            "switchyard_kv_events_exact",
            "1 while the router matches a backend exactly from its KV events, 0 while it falls back to the approximate index",
            kv_events.exact.clone(),
        );
        registry.register(
            "switchyard_kv_events_replays",
            "Sequence gaps asked of a backend's KV event replay endpoint, by outcome (filled: no fallback; partial; failed)",
            kv_events.replays.clone(),
        );
        let peer_messages = Family::<ResultLabel, Counter>::default();
        registry.register(
            "switchyard_peer_messages",
            "Replica-sync messages (--peer) by result: sent, dropped (a peer's queue full or its batch failed), applied and ignored (received)",
            peer_messages.clone(),
        );
        let peer_dns_lookups = Family::<ResultLabel, Counter>::default();
        registry.register(
            "switchyard_peer_dns_lookups",
            "--peer-dns lookups by result: ok, failed (the last peers are kept)",
            peer_dns_lookups.clone(),
        );
        let tokenized = Family::<ResultLabel, Counter>::default();
        registry.register(
            "switchyard_tokenized_prompts",
            "Prompts of models with a --tokenizer, by result: ids (tokenized whole), prefix (tokenized as far as an instance could hold it), not_needed (no instance of the model matched exactly), unknown (text outside the vocabulary), no_template (chat without a chat template), template_failed",
            tokenized.clone(),
        );
        let tokenizer_warmups = Family::<ResultLabel, Counter>::default();
        registry.register(
            "switchyard_tokenizer_warmups",
            "Chat answers tokenized into the piece cache after they end, for the next turn, by result: warmed, cached (nothing new), busy (a long one and every tokenizing thread taken), skipped (the answer is not in the template's rendering as sent, or the template failed)",
            tokenizer_warmups.clone(),
        );
        let tokenizer_new_bytes = Family::<PathLabel, Counter>::default();
        registry.register(
            "switchyard_tokenizer_new_bytes",
            "Bytes of prompt text tokenized anew (not found in the piece cache), by path: request (on the way to routing) or warmup (after an answer)",
            tokenizer_new_bytes.clone(),
        );
        let peer_dns_peers = Gauge::default();
        registry.register(
            "switchyard_peer_dns_peers",
            "Replicas the last successful --peer-dns lookup found, this one left out",
            peer_dns_peers.clone(),
        );
        let reloads = Family::<ResultLabel, Counter>::default();
        registry.register(
            "switchyard_fleet_reloads",
            "Fleet file reloads by result (ok, error)",
            reloads.clone(),
        );
        let discovery_errors = Counter::default();
        registry.register(
            "switchyard_discovery_errors",
            "Failed Kubernetes discovery calls (list or watch of the pool or its pods)",
            discovery_errors.clone(),
        );
        let discovery_last_sync = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "switchyard_discovery_last_sync_timestamp_seconds",
            "Unix time of the last successful Kubernetes discovery call (0: never)",
            discovery_last_sync.clone(),
        );
        let discovery_endpoints = Gauge::default();
        registry.register(
            "switchyard_discovery_endpoints",
            "Endpoints (ready pod x target port) the watched InferencePool selects",
            discovery_endpoints.clone(),
        );
        let placements = Family::<PlacementLabels, Counter>::default();
        registry.register(
            "switchyard_adapter_placements",
            "Dynamic LoRA placement actions by backend, adapter, action (load, unload) and outcome (ok, error)",
            placements.clone(),
        );
        let adapter_demand = Family::<AdapterLabel, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "switchyard_adapter_demand",
            "Decayed request rate per LoRA adapter (requests/s) at the last placement plan",
            adapter_demand.clone(),
        );
        Metrics {
            registry,
            placements,
            placement_series: parking_lot::Mutex::new(Vec::new()),
            adapter_demand,
            demand_series: parking_lot::Mutex::new(Vec::new()),
            requests,
            attempts,
            retries,
            request_blamed,
            connections_refused,
            decision_seconds,
            ttft_prediction_ratio,
            peer_sync_lag,
            cached_prediction_error,
            ttft,
            e2e,
            predicted_cached,
            reported_cached,
            prompt_tokens,
            admission_queue,
            body_memory,
            healthy,
            in_flight,
            scrapes,
            health_checks,
            kv_events,
            reloads,
            peer_messages,
            peer_dns_lookups,
            tokenized,
            tokenizer_warmups,
            tokenizer_new_bytes,
            peer_dns_peers,
            discovery_errors,
            discovery_last_sync,
            discovery_endpoints,
        }
    }

    /// Creates (or finds) the series of backend `name`.
    pub fn for_backend(&self, name: &str) -> BackendMetrics {
        let b = || BackendLabel {
            backend: name.to_string(),
        };
        let o = |outcome| OutcomeLabels {
            backend: name.to_string(),
            outcome,
        };
        let r = |result| ResultLabels {
            backend: name.to_string(),
            result,
        };
        BackendMetrics {
            ok: self.requests.get_or_create_owned(&o(outcome::OK)),
            client_error: self.requests.get_or_create_owned(&o(outcome::CLIENT_ERROR)),
            server_error: self.requests.get_or_create_owned(&o(outcome::SERVER_ERROR)),
            stream_error: self.requests.get_or_create_owned(&o(outcome::STREAM_ERROR)),
            cancelled: self.requests.get_or_create_owned(&o(outcome::CANCELLED)),
            timeout: self.requests.get_or_create_owned(&o(outcome::TIMEOUT)),
            stream_stalled: self
                .requests
                .get_or_create_owned(&o(outcome::STREAM_STALLED)),
            ttft: self.ttft.get_or_create_owned(&b()),
            e2e: self.e2e.get_or_create_owned(&b()),
            predicted_cached: self.predicted_cached.get_or_create_owned(&b()),
            reported_cached: self.reported_cached.get_or_create_owned(&b()),
            prompt_tokens: self.prompt_tokens.get_or_create_owned(&b()),
            healthy: self.healthy.get_or_create_owned(&b()),
            in_flight: self.in_flight.get_or_create_owned(&b()),
            scrape_ok: self.scrapes.get_or_create_owned(&r("ok")),
            scrape_error: self.scrapes.get_or_create_owned(&r("error")),
            check_ok: self.health_checks.get_or_create_owned(&r("ok")),
            check_error: self.health_checks.get_or_create_owned(&r("error")),
            kv_events: KvEventMetrics::default(),
        }
    }

    /// Creates (or finds) the KV event series of backend `name` (only backends that publish
    /// events get them; the replay series only those with a replay endpoint).
    pub fn kv_events_for(&self, name: &str, replay: bool) -> KvEventMetrics {
        let b = BackendLabel {
            backend: name.to_string(),
        };
        let k = &self.kv_events;
        let replays = |outcome: &'static str| {
            if replay {
                k.replays.get_or_create_owned(&OutcomeLabels {
                    backend: name.to_string(),
                    outcome,
                })
            } else {
                Counter::default()
            }
        };
        KvEventMetrics {
            received: k.received.get_or_create_owned(&b),
            gaps: k.gaps.get_or_create_owned(&b),
            decode_errors: k.decode_errors.get_or_create_owned(&b),
            fallbacks: k.fallbacks.get_or_create_owned(&b),
            exact: k.exact.get_or_create_owned(&b),
            replays_filled: replays(REPLAY_OUTCOMES[0]),
            replays_partial: replays(REPLAY_OUTCOMES[1]),
            replays_failed: replays(REPLAY_OUTCOMES[2]),
        }
    }

    /// Removes every series of backend `name` (it left the fleet).
    pub fn forget_backend(&self, name: &str) {
        let b = BackendLabel {
            backend: name.to_string(),
        };
        for outcome in [
            outcome::OK,
            outcome::CLIENT_ERROR,
            outcome::SERVER_ERROR,
            outcome::STREAM_ERROR,
            outcome::CANCELLED,
            outcome::TIMEOUT,
            outcome::STREAM_STALLED,
        ] {
            self.requests.remove(&OutcomeLabels {
                backend: name.to_string(),
                outcome,
            });
        }
        for result in [
            "refused",
            "connect",
            "closed",
            "stale",
            "status_5xx",
            "status_429",
        ] {
            self.attempts.remove(&ResultLabels {
                backend: name.to_string(),
                result,
            });
        }
        for result in ["ok", "error"] {
            let l = ResultLabels {
                backend: name.to_string(),
                result,
            };
            self.scrapes.remove(&l);
            self.health_checks.remove(&l);
        }
        self.ttft.remove(&b);
        self.e2e.remove(&b);
        self.predicted_cached.remove(&b);
        self.reported_cached.remove(&b);
        self.prompt_tokens.remove(&b);
        self.healthy.remove(&b);
        self.in_flight.remove(&b);
        let k = &self.kv_events;
        k.received.remove(&b);
        k.gaps.remove(&b);
        k.decode_errors.remove(&b);
        k.fallbacks.remove(&b);
        k.exact.remove(&b);
        for outcome in REPLAY_OUTCOMES {
            k.replays.remove(&OutcomeLabels {
                backend: name.to_string(),
                outcome,
            });
        }
        self.placement_series.lock().retain(|l| {
            if l.backend == name {
                self.placements.remove(l);
                false
            } else {
                true
            }
        });
    }

    /// Counts a dynamic placement action (`action`: load, unload) and its outcome.
    pub fn placement(&self, backend: &str, adapter: &str, action: &'static str, ok: bool) {
        let labels = PlacementLabels {
            backend: backend.to_string(),
            adapter: adapter.to_string(),
            action,
            outcome: if ok { "ok" } else { "error" },
        };
        let mut series = self.placement_series.lock();
        if !series.contains(&labels) {
            series.push(labels.clone());
        }
        self.placements.get_or_create(&labels).inc();
    }

    /// Sets the demand gauges to `demand` (adapter, requests/s); adapters not listed are removed.
    pub fn set_adapter_demand(&self, demand: &[(String, f64)]) {
        let mut series = self.demand_series.lock();
        series.retain(|adapter| {
            let listed = demand.iter().any(|(a, _)| a == adapter);
            if !listed {
                self.adapter_demand.remove(&AdapterLabel {
                    adapter: adapter.clone(),
                });
            }
            listed
        });
        for (adapter, rate) in demand {
            if !series.contains(adapter) {
                series.push(adapter.clone());
            }
            self.adapter_demand
                .get_or_create(&AdapterLabel {
                    adapter: adapter.clone(),
                })
                .set(*rate);
        }
    }

    /// Counts a request the gateway answered itself (`outcome` names the error code).
    pub fn gateway_answer(&self, outcome: &'static str) {
        self.requests
            .get_or_create(&OutcomeLabels {
                backend: String::new(),
                outcome,
            })
            .inc();
    }

    /// Counts a failed upstream attempt (`cause`: refused, connect, closed, stale, status_5xx,
    /// status_429).
    pub fn upstream_failure(&self, backend: &str, cause: &'static str) {
        self.attempts
            .get_or_create(&ResultLabels {
                backend: backend.to_string(),
                result: cause,
            })
            .inc();
    }

    /// Counts `n` replica-sync messages: `sent`, `dropped`, `applied` or `ignored`.
    pub fn peer_messages(&self, result: &'static str, n: u64) {
        self.peer_messages
            .get_or_create(&ResultLabel { result })
            .inc_by(n);
    }

    /// Counts a prompt tokenized for exact matching, by result.
    pub fn tokenized(&self, result: &'static str) {
        self.tokenized.get_or_create(&ResultLabel { result }).inc();
    }

    /// Counts a chat answer warmed into the piece cache, by result.
    pub fn tokenizer_warmup(&self, result: &'static str) {
        self.tokenizer_warmups
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Counts `bytes` of prompt text tokenized anew on `path` (`request` or `warmup`).
    pub fn tokenizer_new_bytes(&self, path: &'static str, bytes: usize) {
        if bytes > 0 {
            self.tokenizer_new_bytes
                .get_or_create(&PathLabel { path })
                .inc_by(bytes as u64);
        }
    }

    /// Counts a `--peer-dns` lookup.
    pub fn peer_dns_lookup(&self, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.peer_dns_lookups
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Counts a fleet file reload.
    pub fn reload(&self, ok: bool) {
        self.reloads
            .get_or_create(&ResultLabel {
                result: if ok { "ok" } else { "error" },
            })
            .inc();
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_series_appear_and_disappear() {
        let m = Metrics::new();
        let b = m.for_backend("b1");
        b.ok.inc();
        b.ttft.observe(0.01);
        m.gateway_answer("model_not_found");
        let text = m.render();
        assert!(text.contains("switchyard_requests_total{backend=\"b1\",outcome=\"ok\"} 1"));
        assert!(
            text.contains("switchyard_requests_total{backend=\"\",outcome=\"model_not_found\"} 1")
        );
        assert!(text.contains("switchyard_ttft_seconds_count{backend=\"b1\"} 1"));
        m.forget_backend("b1");
        assert!(!m.render().contains("backend=\"b1\""));
    }

    #[test]
    fn placement_series_are_counted_and_leave_with_their_backend() {
        let m = Metrics::new();
        m.placement("b1", "sql", "load", true);
        m.placement("b1", "sql", "load", true);
        m.placement("b2", "sql", "unload", false);
        m.set_adapter_demand(&[("sql".into(), 2.5)]);
        let text = m.render();
        assert!(text.contains(
            "switchyard_adapter_placements_total{backend=\"b1\",adapter=\"sql\",action=\"load\",outcome=\"ok\"} 2"
        ));
        assert!(text.contains(
            "switchyard_adapter_placements_total{backend=\"b2\",adapter=\"sql\",action=\"unload\",outcome=\"error\"} 1"
        ));
        assert!(text.contains("switchyard_adapter_demand{adapter=\"sql\"} 2.5"));
        m.forget_backend("b1");
        m.set_adapter_demand(&[]);
        let text = m.render();
        assert!(!text.contains("backend=\"b1\""));
        assert!(text.contains("backend=\"b2\""));
        assert!(!text.contains("switchyard_adapter_demand{"));
    }
}
