//! `switchyard epp --pool-name` against a fake Kubernetes API server (kube_support: no real
//! one can be installed here) and emulated engines, each on its own loopback address
//! (127.0.0.2, .3, ...) and the pool's one target port, as pods would be: ready selected pods
//! join with their models discovered from the engine, an unready one drains, a terminating or
//! deleted one leaves, a pool port change re-evaluates every pod, a `410 Gone` (as an ERROR
//! event and as HTTP 410) relists and converges on changes the watch never saw, and an API
//! server outage keeps the last fleet, is counted, and ends in a relist when it comes back.

mod gateway_support;
mod kube_support;
mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use gateway_support::*;
use kube_support::{pod, pool, set_ready, FakeKube, Gone, Kind};
use serde_json::{json, Value};

const TOKEN: &str = "k8s-test-token";
const DEADLINE: Duration = Duration::from_secs(60);

/// The picker's `/admin/fleet`.
async fn admin_fleet(c: &reqwest::Client, epp: &Proc) -> Value {
    let auth = format!("Bearer {TOKEN}");
    get_with(c, &epp.url("/admin/fleet"), &[("authorization", &auth)])
        .await
        .json()
}

/// Backend names (`ip:port`) in the picker's fleet that are not leaving, once every one of
/// them has its models discovered.
async fn fleet(c: &reqwest::Client, epp: &Proc) -> Option<BTreeSet<String>> {
    let v = admin_fleet(c, epp).await;
    if !v["pending_discovery"].as_array()?.is_empty() {
        return None;
    }
    let mut names = BTreeSet::new();
    for b in v["backends"].as_array()? {
        if b["leaving"].as_bool()? {
            return None;
        }
        if b["models"] != json!([MODEL]) {
            return None;
        }
        names.insert(b["name"].as_str()?.to_string());
    }
    Some(names)
}

async fn wait_fleet(c: &reqwest::Client, epp: &Proc, want: &[&str], what: &str) {
    let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
    let last = std::sync::Mutex::new(None);
    let ok = poll(DEADLINE, || async {
        let got = fleet(c, epp).await;
        let done = got.as_ref() == Some(&want);
        *last.lock().expect("last") = got;
        done.then_some(())
    })
    .await;
    let last = last.lock().expect("last").clone();
    assert!(ok.is_some(), "{what}: want {want:?}, last seen {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_join_drain_leave_and_survive_410_and_outages() {
    let mut kube = FakeKube::start().await;
    let dir = std::env::temp_dir().join(format!("switchyard-kube-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let kubeconfig = kube.kubeconfig(&dir);

    // Pods' engines: one port shared, one loopback address each.
    let a = engine_at("127.0.0.2", 0, &["--speed", "100"]);
    let port = a.port();
    let b = engine_at("127.0.0.3", port, &["--speed", "100"]);
    let c_engine = engine_at("127.0.0.4", port, &["--speed", "100"]);
    let ep = |p: &Proc| p.authority();
    let (ea, eb, ec) = (ep(&a), ep(&b), ep(&c_engine));

    let app = json!({"app": "vllm"});
    kube.put(Kind::Pool, pool("llama", app.clone(), &[port]));
    kube.put(
        Kind::Pool,
        pool("other-pool", json!({"app": "sglang"}), &[port]),
    );
    kube.put(
        Kind::Pod,
        pod(
            "a",
            "127.0.0.2",
            true,
            json!({"app": "vllm", "llm-d.ai/role": "decode"}),
        ),
    );
    kube.put(
        Kind::Pod,
        pod(
            "b",
            "127.0.0.3",
            true,
            json!({"app": "vllm", "llm-d.ai/role": "prefill-decode"}),
        ),
    );
    kube.put(Kind::Pod, pod("c", "127.0.0.4", false, app.clone()));
    // Ready, but not the pool's.
    kube.put(
        Kind::Pod,
        pod("stranger", "127.0.0.5", true, json!({"app": "sglang"})),
    );

    let kubeconfig = kubeconfig.to_str().expect("utf-8 path");
    let epp = epp(&[
        "--drain-timeout",
        "1",
        "--admin-token",
        TOKEN,
        "--pool-name",
        "llama",
        "--pool-namespace",
        "ml",
        "--kubeconfig",
        kubeconfig,
    ]);
    let c = client();

    wait_fleet(&c, &epp, &[&ea, &eb], "ready selected pods join").await;
    let admin = admin_fleet(&c, &epp).await;
    let role = |addr: &str| {
        admin["backends"]
            .as_array()
            .and_then(|bs| bs.iter().find(|b| b["name"] == addr))
            .map(|b| b["role"].clone())
    };
    assert_eq!(role(&ea), Some(json!("decode")), "{admin}");
    assert_eq!(role(&eb), Some(json!("both")), "prefill-decode: {admin}");

    kube.update(Kind::Pod, "c", |p| set_ready(p, true));
    wait_fleet(&c, &epp, &[&ea, &eb, &ec], "a pod turning ready joins").await;

    kube.update(Kind::Pod, "b", |p| set_ready(p, false));
    wait_fleet(
        &c,
        &epp,
        &[&ea, &ec],
        "a pod losing readiness drains and leaves",
    )
    .await;

    kube.update(Kind::Pod, "a", |p| {
        p["metadata"]["deletionTimestamp"] = json!("2026-12-04T12:00:00Z");
    });
    wait_fleet(&c, &epp, &[&ec], "a terminating pod leaves").await;
    kube.delete(Kind::Pod, "a");
    kube.bookmark();

    // A new pod, then a pool selector change: every pod is looked at again.
    kube.put(Kind::Pod, pod("d", "127.0.0.2", true, app.clone()));
    wait_fleet(&c, &epp, &[&ea, &ec], "a new pod joins").await;
    kube.update(Kind::Pool, "llama", |p| {
        p["spec"]["selector"]["matchLabels"] = json!({"app": "sglang"});
    });
    // `stranger` (127.0.0.5) has no engine: it stays in discovery, so only the leaving is
    // checked here.
    let left = poll(DEADLINE, || async {
        let v = admin_fleet(&c, &epp).await;
        (v["backends"].as_array()?.is_empty()
            && v["pending_discovery"] == json!([format!("127.0.0.5:{port}")]))
        .then_some(())
    })
    .await;
    assert!(left.is_some(), "a selector change re-evaluates every pod");
    kube.update(Kind::Pool, "llama", |p| {
        p["spec"]["selector"]["matchLabels"] = app.clone();
    });
    wait_fleet(&c, &epp, &[&ea, &ec], "the selector back, the pods back").await;

    // 410 as an ERROR event: `b` turned ready again and `d` went, unseen by any watch.
    let lists = kube.lists(Kind::Pod);
    kube.expire(Gone::Event, |objects| {
        set_ready(objects.get_mut(&(Kind::Pod, "b".into())).expect("b"), true);
        objects.remove(&(Kind::Pod, "d".into()));
    });
    wait_fleet(
        &c,
        &epp,
        &[&eb, &ec],
        "a relist after a 410 event converges",
    )
    .await;
    assert!(kube.lists(Kind::Pod) > lists, "the pods were listed again");

    // 410 as HTTP on resuming the watch: `c` went unseen.
    let lists = kube.lists(Kind::Pod);
    kube.expire(Gone::Http, |objects| {
        objects.remove(&(Kind::Pod, "c".into()));
    });
    wait_fleet(&c, &epp, &[&eb], "a relist after an HTTP 410 converges").await;
    assert!(kube.lists(Kind::Pod) > lists, "the pods were listed again");

    // Outage: the fleet stays while discovery fails and counts it.
    let errors_before = metric(&c, &epp, "switchyard_discovery_errors_total")
        .await
        .expect("metric");
    let synced = metric(&c, &epp, "switchyard_discovery_last_sync_timestamp_seconds")
        .await
        .expect("metric");
    assert!(synced > 0.0, "a successful sync is recorded");
    kube.stop().await;
    let counted = poll(DEADLINE, || async {
        let n = metric(&c, &epp, "switchyard_discovery_errors_total").await?;
        (n > errors_before).then_some(n)
    })
    .await;
    assert!(counted.is_some(), "failures during the outage are counted");
    assert_eq!(
        fleet(&c, &epp).await,
        Some(BTreeSet::from([eb.clone()])),
        "the last fleet stays"
    );
    assert_eq!(
        metric(&c, &epp, "switchyard_discovery_endpoints").await,
        Some(1.0)
    );

    // Back, with a change made meanwhile and the history compacted: a relist finds it.
    kube.expire(Gone::Http, |objects| {
        let mut c_pod = pod("c", "127.0.0.4", true, app.clone());
        c_pod["metadata"]["resourceVersion"] = json!("1");
        objects.insert((Kind::Pod, "c".into()), c_pod);
    });
    kube.restart().await;
    wait_fleet(
        &c,
        &epp,
        &[&eb, &ec],
        "after the outage the fleet converges",
    )
    .await;
    drop(epp);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A picker pod: ready, labelled `app: switchyard-epp`, its metrics port named `metrics`
/// (deploy/kubernetes names it `http-metrics`; the unit tests cover that name).
fn picker_pod(name: &str, metrics_port: u16) -> Value {
    let mut p = pod(name, "127.0.0.1", true, json!({"app": "switchyard-epp"}));
    p["spec"]["containers"][0]["ports"] = json!([
        {"name": "grpc", "containerPort": 9002},
        {"name": "metrics", "containerPort": metrics_port}
    ]);
    p
}

/// `peers.urls` in a picker's `/admin/fleet`.
async fn peer_urls(c: &reqwest::Client, epp: &Proc) -> Option<Vec<String>> {
    let v = admin_fleet(c, epp).await;
    let urls = v["peers"]["urls"].as_array()?;
    Some(
        urls.iter()
            .filter_map(|u| u.as_str().map(String::from))
            .collect(),
    )
}

/// Batches (heartbeats included) a picker received from its peers.
async fn batches_received(c: &reqwest::Client, epp: &Proc) -> f64 {
    metric(c, epp, "switchyard_peer_sync_lag_seconds_count")
        .await
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pickers_find_each_other_as_peers_through_their_pods() {
    let kube = FakeKube::start().await;
    let dir = std::env::temp_dir().join(format!("switchyard-kube-peers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let kubeconfig = kube.kubeconfig(&dir);
    let kubeconfig = kubeconfig.to_str().expect("utf-8 path");
    let engine = engine_at("127.0.0.2", 0, &["--speed", "100"]);
    kube.put(
        Kind::Pool,
        pool("llama", json!({"app": "vllm"}), &[engine.port()]),
    );
    kube.put(
        Kind::Pod,
        pod("engine", "127.0.0.2", true, json!({"app": "vllm"})),
    );
    // Each picker is told its pod's name as Kubernetes tells a pod (`HOSTNAME`).
    let picker = |name: &str| {
        let args: Vec<String> = [
            "epp",
            "--host",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--grpc-health-port",
            "0",
            "--metrics-port",
            "0",
            "--admin-token",
            TOKEN,
            "--pool-name",
            "llama",
            "--pool-namespace",
            "ml",
            "--kubeconfig",
            kubeconfig,
            "--peer-selector",
            "app=switchyard-epp",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        Proc::start_with_env(&args, &[("HOSTNAME", name), ("POD_NAME", "")])
    };
    let a = picker("epp-a");
    kube.put(Kind::Pod, picker_pod("epp-a", a.port()));
    let b = picker("epp-b");
    kube.put(Kind::Pod, picker_pod("epp-b", b.port()));
    let c = client();
    let url_of = |p: &Proc| format!("http://127.0.0.1:{}/", p.port());
    for (me, other, what) in [(&a, &b, "a finds b"), (&b, &a, "b finds a")] {
        let want = vec![url_of(other)];
        let found = poll(DEADLINE, || async {
            (peer_urls(&c, me).await.as_ref() == Some(&want)).then_some(())
        })
        .await;
        assert!(
            found.is_some(),
            "{what}: last {:?}",
            peer_urls(&c, me).await
        );
        // Heartbeats reach the peer within a second or two.
        let heard = poll(DEADLINE, || async {
            (batches_received(&c, other).await > 0.0).then_some(())
        })
        .await;
        assert!(heard.is_some(), "{what}: its batches arrive");
    }
    // A picker that stops being ready is no peer any more; a deleted one neither.
    kube.update(Kind::Pod, "epp-b", |p| set_ready(p, false));
    let gone = poll(DEADLINE, || async {
        (peer_urls(&c, &a).await == Some(Vec::new())).then_some(())
    })
    .await;
    assert!(gone.is_some(), "an unready picker leaves the peers");
    kube.update(Kind::Pod, "epp-b", |p| set_ready(p, true));
    let back = poll(DEADLINE, || async {
        (peer_urls(&c, &a).await == Some(vec![url_of(&b)])).then_some(())
    })
    .await;
    assert!(back.is_some(), "ready again, a peer again");
    kube.delete(Kind::Pod, "epp-b");
    let gone = poll(DEADLINE, || async {
        (peer_urls(&c, &a).await == Some(Vec::new())).then_some(())
    })
    .await;
    assert!(gone.is_some(), "a deleted picker leaves the peers");
    drop((a, b, engine));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_peer_selector_needs_the_admin_token_and_labels() {
    let err = fails(&["epp", "--pool-name", "p", "--peer-selector", "app=epp"]);
    assert!(err.contains("--admin-token"), "{err}");
    let err = fails(&[
        "epp",
        "--pool-name",
        "p",
        "--admin-token",
        "t",
        "--peer-selector",
        "app",
    ]);
    assert!(err.contains("KEY=VALUE"), "{err}");
    let err = fails(&[
        "epp",
        "--backend",
        "http://127.0.0.1:1",
        "--peer-selector",
        "a=b",
    ]);
    assert!(err.contains("--pool-name"), "{err}");
}

#[test]
fn pool_name_and_a_static_fleet_are_refused_together() {
    let err = fails(&[
        "epp",
        "--pool-name",
        "llama",
        "--backend",
        "http://127.0.0.1:1",
    ]);
    assert!(
        err.contains("--pool-name") && err.contains("--backend"),
        "{err}"
    );
}

#[test]
fn a_missing_kubeconfig_is_a_clear_error() {
    let err = fails(&[
        "epp",
        "--metrics-port",
        "0",
        "--grpc-port",
        "0",
        "--grpc-health-port",
        "0",
        "--pool-name",
        "llama",
        "--kubeconfig",
        "/nonexistent/kubeconfig",
    ]);
    assert!(err.contains("kubeconfig /nonexistent/kubeconfig"), "{err}");
}
