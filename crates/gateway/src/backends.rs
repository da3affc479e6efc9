//! Backends: how one is described (CLI flag or fleet file) and its runtime state in the gateway.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU8, Ordering};

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Uri};
use serde::{Deserialize, Serialize};
use switchyard_core::{InstanceId, InstanceSpec, Role};
use thiserror::Error;

use crate::metrics::BackendMetrics;

/// How the prefill hands its KV cache to the decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PdStyle {
    /// vLLM NixlConnector: prefill first, its `kv_transfer_params` then go to decode.
    #[default]
    Nixl,
    /// SGLang: prefill and decode at once, paired by `bootstrap_host/port/room`.
    Sglang,
}

impl FromStr for PdStyle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "nixl" | "vllm" => Ok(PdStyle::Nixl),
            "sglang" => Ok(PdStyle::Sglang),
            _ => Err(format!("unknown disaggregation style `{s}` (nixl, sglang)")),
        }
    }
}

impl fmt::Display for PdStyle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PdStyle::Nixl => "nixl",
            PdStyle::Sglang => "sglang",
        })
    }
}

/// Which engine's metric names a backend exposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Detect from the metric name prefixes on the first scrape.
    #[default]
    Auto,
    /// vLLM (`vllm:`), also the Switchyard emulator.
    Vllm,
    /// SGLang (`sglang:`).
    Sglang,
    /// llama.cpp server (`llamacpp:`).
    Llamacpp,
    /// TensorRT-LLM (`trtllm_`).
    Trtllm,
}

impl EngineKind {
    fn code(self) -> u8 {
        match self {
            EngineKind::Auto => 0,
            EngineKind::Vllm => 1,
            EngineKind::Sglang => 2,
            EngineKind::Llamacpp => 3,
            EngineKind::Trtllm => 4,
        }
    }

    fn from_code(c: u8) -> Self {
        match c {
            1 => EngineKind::Vllm,
            2 => EngineKind::Sglang,
            3 => EngineKind::Llamacpp,
            4 => EngineKind::Trtllm,
            _ => EngineKind::Auto,
        }
    }
}

impl FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(EngineKind::Auto),
            "vllm" => Ok(EngineKind::Vllm),
            "sglang" => Ok(EngineKind::Sglang),
            "llamacpp" | "llama.cpp" => Ok(EngineKind::Llamacpp),
            "trtllm" => Ok(EngineKind::Trtllm),
            _ => Err(format!(
                "unknown kind `{s}` (auto, vllm, sglang, llamacpp, trtllm)"
            )),
        }
    }
}

/// A backend as configured: one engine endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackendSpec {
    /// Unique name (defaults to the address).
    pub name: String,
    /// Base URL, `http://host:port` (a bare `host:port` gets `http://`).
    pub address: String,
    /// Prefill, decode or both.
    pub role: Role,
    /// Served base models; empty: discovered from the backend's `/v1/models`.
    pub models: Vec<String>,
    /// LoRA adapters it serves; discovered too when `models` is empty.
    pub adapters: Vec<String>,
    /// Relative weight for load-balancing baselines.
    pub weight: f64,
    /// Free-form labels, shown in `/admin/fleet`.
    pub labels: BTreeMap<String, String>,
    /// Metric names to scrape.
    pub kind: EngineKind,
    /// Adapter slots (vLLM `--max-loras`), when known.
    pub adapter_slots: Option<u32>,
    /// KV capacity in tokens, when known (engines that publish it override this).
    pub kv_capacity_tokens: Option<u64>,
    /// SGLang disaggregation bootstrap port of a prefill server; setting it makes this
    /// backend's prefill legs SGLang-style (see [`PdStyle`]).
    pub bootstrap_port: Option<u16>,
    /// The engine's KV event publisher, `tcp://host:port` (vLLM `--kv-events-config`): the
    /// gateway subscribes and the router matches this backend exactly (see `kv_events`).
    pub kv_events: Option<String>,
    /// The engine's KV event replay endpoint, `tcp://host:port` (vLLM's `replay_endpoint`):
    /// batches a sequence gap lost are asked of it before falling back (needs `kv_events`).
    pub kv_events_replay: Option<String>,
}

impl Default for BackendSpec {
    fn default() -> Self {
        BackendSpec {
            name: String::new(),
            address: String::new(),
            role: Role::Both,
            models: Vec::new(),
            adapters: Vec::new(),
            weight: 1.0,
            labels: BTreeMap::new(),
            kind: EngineKind::Auto,
            adapter_slots: None,
            kv_capacity_tokens: None,
            bootstrap_port: None,
            kv_events: None,
            kv_events_replay: None,
        }
    }
}

/// A backend description that cannot be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SpecError {
    /// The address is not an `http://host:port` URL.
    #[error("backend `{0}`: address must be http://host:port[/prefix]: {1}")]
    Address(String, String),
    /// A `key=value` option is unknown or its value is invalid.
    #[error("backend `{0}`: {1}")]
    Option(String, String),
    /// Two backends share a name.
    #[error("two backends are named `{0}`")]
    Duplicate(String),
}

/// Where to send requests: scheme + authority + optional path prefix, pre-parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    authority: Authority,
    prefix: String,
    /// The `Host` header for requests to it (`host:port`, the port left out when 80).
    host: HeaderValue,
}

impl BaseUrl {
    /// Parses `http://host:port[/prefix]` or `host:port`.
    pub fn parse(address: &str) -> Result<BaseUrl, String> {
        let full = if address.contains("://") {
            address.to_string()
        } else {
            format!("http://{address}")
        };
        let uri: Uri = full.parse().map_err(|e| format!("{e}"))?;
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err("only http:// is supported".into());
        }
        let authority = uri.authority().cloned().ok_or("no host")?;
        if authority.port_u16().is_none() {
            return Err("the port is required".into());
        }
        let prefix = uri.path().trim_end_matches('/').to_string();
        let host = match authority.port_u16() {
            Some(80) => authority.host(),
            _ => authority.as_str(),
        };
        let host = HeaderValue::from_str(host).map_err(|e| format!("{e}"))?;
        Ok(BaseUrl {
            authority,
            prefix,
            host,
        })
    }

    /// The origin-form URI (`/prefix/path?query`) of `path_and_query` on this backend, for a
    /// request sent with [`crate::upstream::Upstream::send_to`].
    pub fn origin(&self, path_and_query: &PathAndQuery) -> Result<Uri, http::Error> {
        let pq = if self.prefix.is_empty() {
            path_and_query.clone()
        } else {
            PathAndQuery::from_str(&format!("{}{}", self.prefix, path_and_query.as_str()))?
        };
        Ok(Uri::from(pq))
    }

    /// The `Host` header for requests to this backend.
    pub fn host_header(&self) -> &HeaderValue {
        &self.host
    }

    /// The URI of `path_and_query` (starting with `/`) on this backend.
    pub fn uri(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        let pq = if self.prefix.is_empty() {
            PathAndQuery::from_str(path_and_query)?
        } else {
            PathAndQuery::from_str(&format!("{}{path_and_query}", self.prefix))?
        };
        Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(self.authority.clone())
            .path_and_query(pq)
            .build()
    }

    /// `host:port`.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }
}

impl BackendSpec {
    /// Fills defaults (name = address) and checks the address.
    pub fn normalise(mut self) -> Result<BackendSpec, SpecError> {
        let address = self.address.trim().trim_end_matches('/').to_string();
        if !address.contains("://") {
            self.address = format!("http://{address}");
        } else {
            self.address = address;
        }
        BaseUrl::parse(&self.address).map_err(|e| SpecError::Address(self.address.clone(), e))?;
        if self.name.is_empty() {
            self.name = self
                .address
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_string();
        }
        if !(self.weight.is_finite() && self.weight > 0.0) {
            return Err(SpecError::Option(self.name, "weight must be > 0".into()));
        }
        if let Some(endpoint) = &self.kv_events {
            check_kv_endpoint("kv_events", endpoint)
                .map_err(|why| SpecError::Option(self.name.clone(), why))?;
        }
        if let Some(endpoint) = &self.kv_events_replay {
            check_kv_endpoint("kv_events_replay", endpoint)
                .map_err(|why| SpecError::Option(self.name.clone(), why))?;
            if self.kv_events.is_none() {
                return Err(SpecError::Option(
                    self.name,
                    "kv_events_replay needs kv_events (the stream whose gaps it fills)".into(),
                ));
            }
        }
        Ok(self)
    }

    /// Parses the `--backend` flag: `URL[,role=prefill|decode|both][,models=a+b]
    /// [,adapters=x+y][,kind=vllm|sglang|llamacpp|trtllm|auto][,name=N][,weight=W]
    /// [,adapter_slots=N][,bootstrap_port=P][,kv_events=tcp://HOST:PORT]
    /// [,kv_events_replay=tcp://HOST:PORT]`.
    pub fn parse_flag(flag: &str) -> Result<BackendSpec, SpecError> {
        let mut parts = flag.split(',');
        let address = parts.next().unwrap_or_default().trim().to_string();
        let mut spec = BackendSpec {
            address: address.clone(),
            ..BackendSpec::default()
        };
        let list = |v: &str| -> Vec<String> {
            v.split('+')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        };
        for part in parts {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let (key, value) = part.split_once('=').ok_or_else(|| {
                SpecError::Option(address.clone(), format!("`{part}` is not key=value"))
            })?;
            let bad = |why: String| SpecError::Option(address.clone(), why);
            match key.trim() {
                "role" => {
                    spec.role = match value {
                        "prefill" => Role::Prefill,
                        "decode" => Role::Decode,
                        "both" => Role::Both,
                        _ => return Err(bad(format!("role `{value}` (prefill, decode, both)"))),
                    }
                }
                "models" | "model" => spec.models = list(value),
                "adapters" => spec.adapters = list(value),
                "kind" => spec.kind = value.parse().map_err(bad)?,
                "name" => spec.name = value.to_string(),
                "weight" => {
                    spec.weight = value
                        .parse()
                        .map_err(|_| bad(format!("weight `{value}` is not a number")))?
                }
                "adapter_slots" => {
                    spec.adapter_slots = Some(
                        value
                            .parse()
                            .map_err(|_| bad(format!("adapter_slots `{value}`")))?,
                    )
                }
                "bootstrap_port" => {
                    spec.bootstrap_port = Some(
                        value
                            .parse()
                            .map_err(|_| bad(format!("bootstrap_port `{value}` is not a port")))?,
                    )
                }
                "kv_events" => spec.kv_events = Some(value.trim().to_string()),
                "kv_events_replay" => spec.kv_events_replay = Some(value.trim().to_string()),
                other => {
                    return Err(bad(format!(
                        "unknown option `{other}` (role, models, adapters, kind, name, weight, adapter_slots, bootstrap_port, kv_events, kv_events_replay)"
                    )))
                }
            }
        }
        spec.normalise()
    }

    /// The core's description of this backend.
    pub fn instance_spec(&self) -> InstanceSpec {
        InstanceSpec {
            name: self.name.clone(),
            address: self.address.clone(),
            role: self.role,
            models: self.models.clone(),
            adapters: self.adapters.clone(),
            adapter_slots: self.adapter_slots.unwrap_or(1),
            kv_capacity_tokens: self.kv_capacity_tokens,
            weight: self.weight,
            ..InstanceSpec::default()
        }
    }
}

/// Checks a KV event endpoint (option `key`): `tcp://host:port` (the only transport the gateway
/// speaks).
fn check_kv_endpoint(key: &str, endpoint: &str) -> Result<(), String> {
    let bad = || format!("{key} `{endpoint}`: expected tcp://HOST:PORT");
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || host.contains('*') || !port.parse::<u16>().is_ok_and(|p| p != 0) {
        return Err(bad());
    }
    Ok(())
}

/// Checks that names are unique.
pub fn check_unique(specs: &[BackendSpec]) -> Result<(), SpecError> {
    let mut seen = std::collections::HashSet::new();
    for s in specs {
        if !seen.insert(s.name.as_str()) {
            return Err(SpecError::Duplicate(s.name.clone()));
        }
    }
    Ok(())
}

/// A backend in the fleet, shared by the proxy, the health checker and the scraper.
pub struct Backend {
    /// As written in the flag or file (to tell a changed entry on reload).
    pub configured: BackendSpec,
    /// As configured, with discovered models filled in.
    pub spec: BackendSpec,
    /// Handle in the router.
    pub id: InstanceId,
    /// Parsed address.
    pub base: BaseUrl,
    /// Passes health checks (false: ejected).
    healthy: AtomicBool,
    /// Takes no new requests (admin drain or removal from the fleet file).
    draining: AtomicBool,
    /// Left the fleet; background tasks stop.
    removed: AtomicBool,
    /// Consecutive failures (health checks and 5xx answers).
    failures: AtomicU32,
    /// Consecutive passed checks while ejected.
    successes: AtomicU32,
    /// Ejections since the backend last served a request: each one doubles the passed checks
    /// it needs to come back (an engine whose checks pass while it fails requests flaps ever
    /// more slowly, as Envoy's outlier detection grows its ejection time).
    ejections: AtomicU32,
    /// Requests in flight through the gateway.
    in_flight: AtomicI64,
    /// Engine kind, detected when configured `auto`.
    kind: AtomicU8,
    /// Metric handles.
    pub metrics: BackendMetrics,
    /// Recent TTFTs, for the dashboard's percentiles.
    pub ttft: crate::live::TtftWindow,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("name", &self.spec.name)
            .field("id", &self.id)
            .finish()
    }
}

/// What a health event changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthChange {
    /// Nothing.
    None,
    /// Just ejected.
    Ejected,
    /// Just readmitted.
    Readmitted,
}

impl Backend {
    /// A backend that just joined the router as `id`.
    pub fn new(
        configured: BackendSpec,
        spec: BackendSpec,
        id: InstanceId,
        metrics: BackendMetrics,
    ) -> Result<Self, SpecError> {
        let base = BaseUrl::parse(&spec.address)
            .map_err(|e| SpecError::Address(spec.address.clone(), e))?;
        metrics.healthy.set(1);
        Ok(Backend {
            kind: AtomicU8::new(spec.kind.code()),
            configured,
            spec,
            id,
            base,
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            successes: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            in_flight: AtomicI64::new(0),
            metrics,
            ttft: Default::default(),
        })
    }

    /// Name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Whether it passes health checks.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// Whether it is draining.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Whether it left the fleet.
    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    /// Marks it removed (background tasks stop at their next tick).
    pub fn mark_removed(&self) {
        self.removed.store(true, Ordering::Release);
        self.update_gauge();
    }

    /// Sets or clears draining.
    pub fn set_draining(&self, on: bool) {
        self.draining.store(on, Ordering::Release);
        self.update_gauge();
    }

    /// The health the router should see.
    pub fn core_health(&self) -> switchyard_core::Health {
        if self.is_draining() {
            switchyard_core::Health::Draining
        } else if self.is_healthy() {
            switchyard_core::Health::Healthy
        } else {
            switchyard_core::Health::Unhealthy
        }
    }

    fn update_gauge(&self) {
        let up = self.is_healthy() && !self.is_draining() && !self.is_removed();
        self.metrics.healthy.set(i64::from(up));
    }

    /// Records a failure; `refused`: the backend refused the connection, which ejects at once.
    pub fn record_failure(&self, refused: bool, eject_after: u32) -> HealthChange {
        self.successes.store(0, Ordering::Relaxed);
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if (refused || n >= eject_after) && self.healthy.swap(false, Ordering::AcqRel) {
            self.ejections.fetch_add(1, Ordering::AcqRel);
            self.update_gauge();
            return HealthChange::Ejected;
        }
        HealthChange::None
    }

    /// Passed checks needed to come back: `readmit_after`, doubled for each ejection since the
    /// backend last served a request (at most 32 times).
    fn checks_to_readmit(&self, readmit_after: u32) -> u32 {
        let doublings = self
            .ejections
            .load(Ordering::Acquire)
            .saturating_sub(1)
            .min(5);
        readmit_after.saturating_mul(1 << doublings)
    }

    /// Records a passed health check.
    pub fn record_check_success(&self, readmit_after: u32) -> HealthChange {
        self.failures.store(0, Ordering::Relaxed);
        if self.is_healthy() {
            return HealthChange::None;
        }
        let n = self.successes.fetch_add(1, Ordering::AcqRel) + 1;
        if n >= self.checks_to_readmit(readmit_after) && !self.healthy.swap(true, Ordering::AcqRel)
        {
            self.successes.store(0, Ordering::Relaxed);
            self.update_gauge();
            return HealthChange::Readmitted;
        }
        HealthChange::None
    }

    /// A request that reached the engine and got an answer: clears the failure streak and the
    /// ejection count.
    pub fn record_request_success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
        if self.ejections.load(Ordering::Relaxed) != 0 {
            self.ejections.store(0, Ordering::Relaxed);
        }
    }

    /// Requests in flight through the gateway.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Counts a request in (the guard counts it out when dropped).
    pub fn enter(self: &std::sync::Arc<Self>) -> InFlightGuard {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.metrics.in_flight.inc();
        InFlightGuard(self.clone())
    }

    /// The engine kind (configured, or detected).
    pub fn kind(&self) -> EngineKind {
        EngineKind::from_code(self.kind.load(Ordering::Relaxed))
    }

    /// Records the detected kind.
    pub fn set_kind(&self, kind: EngineKind) {
        self.kind.store(kind.code(), Ordering::Relaxed);
    }
}

/// Holds one request's place in a backend's in-flight count.
#[derive(Debug)]
pub struct InFlightGuard(std::sync::Arc<Backend>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.in_flight.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_forms() {
        let s = BackendSpec::parse_flag("127.0.0.1:8001").unwrap();
        assert_eq!(s.address, "http://127.0.0.1:8001");
        assert_eq!(s.name, "127.0.0.1:8001");
        assert_eq!(s.role, Role::Both);
        assert!(s.models.is_empty());
        let s = BackendSpec::parse_flag(
            "http://127.0.0.1:8002/,role=prefill,models=a+b,kind=sglang,name=p1,weight=2,adapters=x",
        )
        .unwrap();
        assert_eq!(s.address, "http://127.0.0.1:8002");
        assert_eq!(s.role, Role::Prefill);
        assert_eq!(s.models, vec!["a", "b"]);
        assert_eq!(s.adapters, vec!["x"]);
        assert_eq!(s.kind, EngineKind::Sglang);
        assert_eq!(s.name, "p1");
        assert_eq!(s.weight, 2.0);
        assert_eq!(s.bootstrap_port, None);
        let s = BackendSpec::parse_flag("127.0.0.1:8003,role=prefill,bootstrap_port=9000").unwrap();
        assert_eq!(s.bootstrap_port, Some(9000));
        assert_eq!(s.kv_events, None);
        let s = BackendSpec::parse_flag("127.0.0.1:8004,kv_events=tcp://127.0.0.1:5557").unwrap();
        assert_eq!(s.kv_events.as_deref(), Some("tcp://127.0.0.1:5557"));
        assert_eq!(s.kv_events_replay, None);
        let s = BackendSpec::parse_flag(
            "127.0.0.1:8004,kv_events=tcp://127.0.0.1:5557,kv_events_replay=tcp://127.0.0.1:5558",
        )
        .unwrap();
        assert_eq!(s.kv_events_replay.as_deref(), Some("tcp://127.0.0.1:5558"));
        for bad in [
            "h:1,kv_events_replay=tcp://h:2",
            "h:1,kv_events=tcp://h:1,kv_events_replay=tcp://*:2",
            "h:1,kv_events=tcp://h:1,kv_events_replay=h:2",
            "127.0.0.1",
            "https://h:1",
            "h:1,role=x",
            "h:1,kind=tgi",
            "h:1,colour=red",
            "h:1,weight=0",
            "h:1,nokey",
            "h:1,bootstrap_port=70000",
            "h:1,bootstrap_port=x",
            "h:1,kv_events=127.0.0.1:5557",
            "h:1,kv_events=tcp://*:5557",
            "h:1,kv_events=tcp://h",
            "h:1,kv_events=tcp://h:0",
            "h:1,kv_events=ipc:///tmp/kv",
        ] {
            assert!(BackendSpec::parse_flag(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bootstrap_port_in_fleet_files() {
        let y: BackendSpec =
            serde_norway::from_str("address: h:1\nrole: prefill\nbootstrap_port: 8998\n").unwrap();
        assert_eq!((y.role, y.bootstrap_port), (Role::Prefill, Some(8998)));
        let t: BackendSpec = toml::from_str("address = \"h:1\"\nbootstrap_port = 9001\n").unwrap();
        assert_eq!(t.bootstrap_port, Some(9001));
        let none: BackendSpec = serde_norway::from_str("address: h:1\n").unwrap();
        assert_eq!(none.bootstrap_port, None);
        let kv: BackendSpec =
            serde_norway::from_str("address: h:1\nkv_events: tcp://10.0.0.1:5557\n").unwrap();
        assert_eq!(kv.kv_events.as_deref(), Some("tcp://10.0.0.1:5557"));
        let replay: BackendSpec = serde_norway::from_str(
            "address: h:1\nkv_events: tcp://10.0.0.1:5557\nkv_events_replay: tcp://10.0.0.1:5558\n",
        )
        .unwrap();
        assert_eq!(
            replay.normalise().unwrap().kv_events_replay.as_deref(),
            Some("tcp://10.0.0.1:5558")
        );
        assert!(BackendSpec {
            kv_events: Some("tcp://h".into()),
            ..kv
        }
        .normalise()
        .is_err());
        assert!(
            serde_norway::from_str::<BackendSpec>("address: h:1\nbootstrap_port: -1\n").is_err()
        );
    }

    #[test]
    fn uri_joins_prefix_and_path() {
        let b = BaseUrl::parse("http://h:1/base/").unwrap();
        assert_eq!(
            b.uri("/v1/models?x=1").unwrap().to_string(),
            "http://h:1/base/v1/models?x=1"
        );
        let b = BaseUrl::parse("h:2").unwrap();
        assert_eq!(b.uri("/health").unwrap().to_string(), "http://h:2/health");
    }

    #[test]
    fn ejection_and_readmission() {
        let spec = BackendSpec::parse_flag("h:1,models=m").unwrap();
        let id = InstanceId {
            slot: 0,
            generation: 0,
        };
        let b = Backend::new(spec.clone(), spec, id, BackendMetrics::detached()).unwrap();
        assert_eq!(b.record_failure(false, 3), HealthChange::None);
        assert_eq!(b.record_failure(false, 3), HealthChange::None);
        assert_eq!(b.record_failure(false, 3), HealthChange::Ejected);
        assert_eq!(b.record_failure(false, 3), HealthChange::None);
        assert_eq!(b.record_check_success(2), HealthChange::None);
        assert_eq!(b.record_check_success(2), HealthChange::Readmitted);
        assert!(b.is_healthy());
        assert_eq!(b.record_failure(true, 3), HealthChange::Ejected);
        b.set_draining(true);
        assert_eq!(b.core_health(), switchyard_core::Health::Draining);
    }

    #[test]
    fn each_ejection_without_a_served_request_doubles_the_way_back() {
        let spec = BackendSpec::parse_flag("h:1,models=m").unwrap();
        let id = InstanceId {
            slot: 0,
            generation: 0,
        };
        let b = Backend::new(spec.clone(), spec, id, BackendMetrics::detached()).unwrap();
        let checks_to_come_back = |b: &Backend| {
            (1..=100)
                .find(|_| b.record_check_success(2) == HealthChange::Readmitted)
                .unwrap()
        };
        assert_eq!(b.record_failure(true, 3), HealthChange::Ejected);
        assert_eq!(checks_to_come_back(&b), 2);
        assert_eq!(b.record_failure(true, 3), HealthChange::Ejected);
        assert_eq!(checks_to_come_back(&b), 4);
        assert_eq!(b.record_failure(true, 3), HealthChange::Ejected);
        assert_eq!(checks_to_come_back(&b), 8);
        // Serving a request proves it works again: back to the plain count.
        b.record_request_success();
        assert_eq!(b.record_failure(true, 3), HealthChange::Ejected);
        assert_eq!(checks_to_come_back(&b), 2);
        // Capped at 32 times.
        for _ in 0..10 {
            b.record_failure(true, 3);
            checks_to_come_back(&b);
        }
        assert_eq!(b.record_failure(true, 3), HealthChange::Ejected);
        assert_eq!(checks_to_come_back(&b), 64);
    }
}
