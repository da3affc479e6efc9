//! Pure functions from Kubernetes objects to the fleet: which pods a pool selects, which of
//! them take traffic, and the backends (`ip:port`, one per target port) they become.
//!
//! Only these small views are kept between events, not whole pods, so memory stays at a few
//! hundred bytes per pod in the namespace.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Pod;
use switchyard_core::Role;
use switchyard_gateway::BackendSpec;

use super::pool::InferencePool;

/// The pod label llm-d sets for disaggregated serving.
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// What discovery keeps of a pool.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolView {
    /// `spec.selector.matchLabels`.
    pub selector: BTreeMap<String, String>,
    /// `spec.targetPorts[].number`, valid ones only, in order, without repeats.
    pub ports: Vec<u16>,
}

/// What discovery keeps of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// `metadata.name`.
    pub name: String,
    /// `status.podIP`, when set and valid.
    pub ip: Option<IpAddr>,
    /// Condition `Ready` is `True`.
    pub ready: bool,
    /// `metadata.deletionTimestamp` is set.
    pub terminating: bool,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// The container port named as in [`PEER_PORT_NAMES`], where a picker pod takes peer sync.
    pub metrics_port: Option<u16>,
    /// The container port named [`KV_EVENTS_PORT_NAME`]: the engine publishes its KV events
    /// there (vLLM `--kv-events-config`'s endpoint).
    pub kv_events_port: Option<u16>,
    /// The container port named [`KV_EVENTS_REPLAY_PORT_NAME`]: the engine's replay endpoint.
    pub kv_events_replay_port: Option<u16>,
}

/// The container port name of an engine pod's KV event publisher (ZeroMQ PUB): the pod's
/// backends are subscribed at `tcp://podIP:port` and matched exactly while the stream is
/// healthy, as a `--backend` with `kv_events=`.
pub const KV_EVENTS_PORT_NAME: &str = "kv-events";

/// The container port name of an engine pod's KV event replay endpoint (ZeroMQ ROUTER), as
/// `kv_events_replay=` (used only with [`KV_EVENTS_PORT_NAME`]).
pub const KV_EVENTS_REPLAY_PORT_NAME: &str = "kv-events-replay";

/// Container port names a picker pod's metrics (and `/admin/peer-sync`) port may carry, the
/// first found wins (deploy/kubernetes names it `http-metrics`).
pub const PEER_PORT_NAMES: [&str; 2] = ["http-metrics", "metrics"];

/// Which pods are this picker's peers (`--peer-selector`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSelector {
    /// Labels a peer pod carries (all of them; empty selects none).
    pub labels: BTreeMap<String, String>,
    /// The port a peer takes sync on when its pod names no port as in [`PEER_PORT_NAMES`].
    pub port: u16,
    /// This pod's own name (`POD_NAME`, else `HOSTNAME`): not a peer of itself.
    pub own_name: Option<String>,
}

impl PoolView {
    /// The view of a pool object.
    pub fn of(pool: &InferencePool) -> PoolView {
        let mut ports = Vec::new();
        for p in &pool.spec.target_ports {
            match u16::try_from(p.number) {
                Ok(n) if n > 0 && !ports.contains(&n) => ports.push(n),
                Ok(_) => {}
                Err(_) => tracing::warn!(port = p.number, "InferencePool target port out of range"),
            }
        }
        PoolView {
            selector: pool.spec.selector.match_labels.clone(),
            ports,
        }
    }

    /// Whether the pool selects a pod with these labels. An empty selector selects nothing:
    /// like a Service without a selector, not every pod in the namespace.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        !self.selector.is_empty()
            && self
                .selector
                .iter()
                .all(|(k, v)| labels.get(k).is_some_and(|l| l == v))
    }
}

impl PodView {
    /// The view of a pod object.
    pub fn of(pod: &Pod) -> PodView {
        let status = pod.status.as_ref();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let ip = status
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse().ok());
        let named_port = |name: &str| {
            pod.spec.as_ref().and_then(|spec| {
                spec.containers
                    .iter()
                    .flat_map(|c| c.ports.iter().flatten())
                    .find(|p| p.name.as_deref() == Some(name))
                    .and_then(|p| u16::try_from(p.container_port).ok())
                    .filter(|&p| p > 0)
            })
        };
        PodView {
            name: pod.metadata.name.clone().unwrap_or_default(),
            ip,
            ready,
            terminating: pod.metadata.deletion_timestamp.is_some(),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            metrics_port: PEER_PORT_NAMES.iter().find_map(|name| named_port(name)),
            kv_events_port: named_port(KV_EVENTS_PORT_NAME),
            kv_events_replay_port: named_port(KV_EVENTS_REPLAY_PORT_NAME),
        }
    }

    /// Whether the pod should take new requests: ready, addressed, not being deleted.
    pub fn serves(&self) -> bool {
        self.ready && self.ip.is_some() && !self.terminating
    }

    /// The role from [`ROLE_LABEL`]: `prefill`, `decode`; `prefill-decode`, absent or anything
    /// else serves both.
    pub fn role(&self) -> Role {
        match self.labels.get(ROLE_LABEL).map(String::as_str) {
            Some("prefill") => Role::Prefill,
            Some("decode") => Role::Decode,
            _ => Role::Both,
        }
    }
}

/// The backends a pool asks for: every selected pod that serves, once per target port, named
/// and addressed `ip:port`, models left empty so they are discovered from the engine as for a
/// `--backend` without `models=`, KV events from the pod's ports named
/// [`KV_EVENTS_PORT_NAME`] and [`KV_EVENTS_REPLAY_PORT_NAME`]. Sorted by name; a name two pods
/// share (host networking) goes to the pod whose name sorts first. No pool: no backends.
pub fn desired<'a>(
    pool: Option<&PoolView>,
    pods: impl IntoIterator<Item = &'a PodView>,
) -> Vec<BackendSpec> {
    let Some(pool) = pool else {
        return Vec::new();
    };
    let mut pods: Vec<&PodView> = pods
        .into_iter()
        .filter(|p| p.serves() && pool.selects(&p.labels))
        .collect();
    pods.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out: BTreeMap<String, BackendSpec> = BTreeMap::new();
    for pod in pods {
        let Some(ip) = pod.ip else { continue };
        let zmq = |port: u16| format!("tcp://{}", SocketAddr::new(ip, port));
        let kv_events = pod.kv_events_port.map(zmq);
        let kv_events_replay = pod
            .kv_events_replay_port
            .filter(|_| kv_events.is_some())
            .map(zmq);
        for &port in &pool.ports {
            let addr = SocketAddr::new(ip, port).to_string();
            out.entry(addr.clone()).or_insert_with(|| BackendSpec {
                name: addr.clone(),
                address: format!("http://{addr}"),
                role: pod.role(),
                labels: BTreeMap::from([("pod".to_string(), pod.name.clone())]),
                kv_events: kv_events.clone(),
                kv_events_replay: kv_events_replay.clone(),
                ..BackendSpec::default()
            });
        }
    }
    out.into_values().collect()
}

/// The peer pickers' base URLs (`http://ip:port`): pods with the selector's labels that serve
/// (ready, addressed, not terminating), other than this one; sorted, without repeats. A pod
/// that is not ready yet is not a peer: a picker that is starting or draining is not routing.
pub fn peers<'a>(
    selector: &PeerSelector,
    pods: impl IntoIterator<Item = &'a PodView>,
) -> Vec<String> {
    if selector.labels.is_empty() {
        return Vec::new();
    }
    let mut urls: Vec<String> = pods
        .into_iter()
        .filter(|p| p.serves())
        .filter(|p| selector.own_name.as_deref() != Some(p.name.as_str()))
        .filter(|p| {
            selector
                .labels
                .iter()
                .all(|(k, v)| p.labels.get(k).is_some_and(|l| l == v))
        })
        .filter_map(|p| {
            let ip = p.ip?;
            let port = p.metrics_port.unwrap_or(selector.port);
            Some(format!("http://{}", SocketAddr::new(ip, port)))
        })
        .collect();
    urls.sort();
    urls.dedup();
    urls
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, ip: Option<&str>, ready: bool, labels: serde_json::Value) -> Pod {
        let mut status = json!({
            "phase": "Running",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": if ready { "True" } else { "False" }}
            ]
        });
        if let Some(ip) = ip {
            status["podIP"] = json!(ip);
        }
        serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "labels": labels},
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
            "status": status
        }))
        .expect("a pod")
    }

    fn pool(ports: &[i32]) -> PoolView {
        let pool: InferencePool = serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm"}},
                "targetPorts": ports.iter().map(|n| json!({"number": n})).collect::<Vec<_>>()
            }
        }))
        .expect("a pool");
        PoolView::of(&pool)
    }

    fn names(specs: &[BackendSpec]) -> Vec<&str> {
        specs.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn ready_pods_join_unready_and_unaddressed_ones_do_not() {
        let pods = [
            PodView::of(&pod("a", Some("10.0.0.1"), true, json!({"app": "vllm"}))),
            PodView::of(&pod("b", Some("10.0.0.2"), false, json!({"app": "vllm"}))),
            PodView::of(&pod("c", None, true, json!({"app": "vllm"}))),
        ];
        let specs = desired(Some(&pool(&[8000])), &pods);
        assert_eq!(names(&specs), ["10.0.0.1:8000"]);
        assert_eq!(specs[0].address, "http://10.0.0.1:8000");
        assert!(specs[0].models.is_empty(), "models are discovered");
        assert_eq!(specs[0].labels["pod"], "a");
    }

    #[test]
    fn peers_are_the_other_ready_pickers_on_their_metrics_port() {
        let picker = |name: &str, ip: Option<&str>, ready: bool, port: Option<i32>| {
            let mut p = pod(name, ip, ready, json!({"app": "switchyard-epp"}));
            if let Some(port) = port {
                p.spec.as_mut().unwrap().containers[0].ports = Some(vec![
                    serde_json::from_value(json!({"name": "grpc", "containerPort": 9002})).unwrap(),
                    serde_json::from_value(json!({"name": "http-metrics", "containerPort": port}))
                        .unwrap(),
                ]);
            }
            PodView::of(&p)
        };
        let pods = [
            picker("epp-0", Some("10.0.0.1"), true, Some(9190)),
            picker("epp-1", Some("10.0.0.2"), true, None),
            picker("epp-2", Some("10.0.0.3"), false, Some(9090)),
            picker("epp-3", None, true, Some(9090)),
            PodView::of(&pod(
                "engine",
                Some("10.0.0.9"),
                true,
                json!({"app": "vllm"}),
            )),
        ];
        let selector = PeerSelector {
            labels: BTreeMap::from([("app".to_string(), "switchyard-epp".to_string())]),
            port: 9090,
            own_name: Some("epp-1".to_string()),
        };
        assert_eq!(peers(&selector, &pods), ["http://10.0.0.1:9190"]);
        let anyone = PeerSelector {
            own_name: None,
            ..selector.clone()
        };
        assert_eq!(
            peers(&anyone, &pods),
            ["http://10.0.0.1:9190", "http://10.0.0.2:9090"],
            "without a metrics port the flag's port"
        );
        let empty = PeerSelector {
            labels: BTreeMap::new(),
            ..selector
        };
        assert!(
            peers(&empty, &pods).is_empty(),
            "an empty selector selects none"
        );
    }

    #[test]
    fn a_terminating_pod_leaves_even_while_ready() {
        let mut p = pod("a", Some("10.0.0.1"), true, json!({"app": "vllm"}));
        p.metadata.deletion_timestamp =
            Some(serde_json::from_value(json!("2026-12-04T12:00:00Z")).expect("a time"));
        let view = PodView::of(&p);
        assert!(view.terminating && view.ready);
        assert!(desired(Some(&pool(&[8000])), [&view]).is_empty());
    }

    #[test]
    fn one_backend_per_target_port_and_bad_ports_are_skipped() {
        let pods = [PodView::of(&pod(
            "a",
            Some("10.0.0.1"),
            true,
            json!({"app": "vllm"}),
        ))];
        let p = pool(&[8000, 8001, 8000, 0, 70000]);
        assert_eq!(p.ports, [8000, 8001]);
        assert_eq!(
            names(&desired(Some(&p), &pods)),
            ["10.0.0.1:8000", "10.0.0.1:8001"]
        );
    }

    #[test]
    fn ipv6_pods_get_bracketed_addresses() {
        let pods = [PodView::of(&pod(
            "a",
            Some("fd00::1"),
            true,
            json!({"app": "vllm"}),
        ))];
        let specs = desired(Some(&pool(&[8000])), &pods);
        assert_eq!(specs[0].address, "http://[fd00::1]:8000");
    }

    #[test]
    fn kv_events_come_from_the_engine_pods_named_ports() {
        let with_ports = |ports: serde_json::Value| {
            let mut p = pod("a", Some("10.0.0.1"), true, json!({"app": "vllm"}));
            let container = json!({"name": "vllm", "image": "vllm", "ports": ports});
            p.spec.as_mut().unwrap().containers = vec![serde_json::from_value(container).unwrap()];
            PodView::of(&p)
        };
        let both = with_ports(json!([
            {"name": "http", "containerPort": 8000},
            {"name": "kv-events", "containerPort": 5557},
            {"name": "kv-events-replay", "containerPort": 5558},
        ]));
        let specs = desired(Some(&pool(&[8000, 8001])), [&both]);
        assert_eq!(specs.len(), 2);
        for spec in &specs {
            assert_eq!(spec.kv_events.as_deref(), Some("tcp://10.0.0.1:5557"));
            assert_eq!(
                spec.kv_events_replay.as_deref(),
                Some("tcp://10.0.0.1:5558")
            );
        }
        // A replay endpoint alone means nothing; no named port, no events.
        let replay_only = with_ports(json!([{"name": "kv-events-replay", "containerPort": 5558}]));
        let specs = desired(Some(&pool(&[8000])), [&replay_only]);
        assert_eq!(
            (
                specs[0].kv_events.as_ref(),
                specs[0].kv_events_replay.as_ref()
            ),
            (None, None)
        );
        let plain = PodView::of(&pod("b", Some("10.0.0.2"), true, json!({"app": "vllm"})));
        assert_eq!(desired(Some(&pool(&[8000])), [&plain])[0].kv_events, None);
    }

    #[test]
    fn roles_come_from_the_llm_d_label() {
        let role = |labels| PodView::of(&pod("a", Some("10.0.0.1"), true, labels)).role();
        assert_eq!(role(json!({ROLE_LABEL: "prefill"})), Role::Prefill);
        assert_eq!(role(json!({ROLE_LABEL: "decode"})), Role::Decode);
        assert_eq!(role(json!({ROLE_LABEL: "prefill-decode"})), Role::Both);
        assert_eq!(role(json!({})), Role::Both);
        let pods = [PodView::of(&pod(
            "a",
            Some("10.0.0.1"),
            true,
            json!({"app": "vllm", ROLE_LABEL: "decode"}),
        ))];
        assert_eq!(desired(Some(&pool(&[8000])), &pods)[0].role, Role::Decode);
    }

    #[test]
    fn the_selector_needs_every_label_and_an_empty_one_selects_nothing() {
        let mut p = pool(&[8000]);
        p.selector.insert("tier".into(), "gpu".into());
        let both = BTreeMap::from([
            ("app".to_string(), "vllm".to_string()),
            ("tier".to_string(), "gpu".to_string()),
            ("extra".to_string(), "x".to_string()),
        ]);
        let one = BTreeMap::from([("app".to_string(), "vllm".to_string())]);
        let wrong = BTreeMap::from([
            ("app".to_string(), "sglang".to_string()),
            ("tier".to_string(), "gpu".to_string()),
        ]);
        assert!(p.selects(&both));
        assert!(!p.selects(&one));
        assert!(!p.selects(&wrong));
        assert!(!PoolView::default().selects(&both));
    }

    #[test]
    fn no_pool_no_backends_and_a_shared_ip_goes_to_the_first_pod() {
        let pods = [
            PodView::of(&pod("b", Some("10.0.0.1"), true, json!({"app": "vllm"}))),
            PodView::of(&pod(
                "a",
                Some("10.0.0.1"),
                true,
                json!({"app": "vllm", ROLE_LABEL: "prefill"}),
            )),
        ];
        assert!(desired(None, &pods).is_empty());
        let specs = desired(Some(&pool(&[8000])), &pods);
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].labels["pod"], "a");
    }
}
