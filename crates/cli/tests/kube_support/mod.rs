//! A fake Kubernetes API server for the discovery tests (no real one can be installed here):
//! plain HTTP on 127.0.0.1, one namespace, pods and `InferencePool`s, speaking the list/watch
//! protocol as the API server does: lists with `metadata.resourceVersion`, `?watch=1` streams
//! of newline-delimited `ADDED`/`MODIFIED`/`DELETED`/`BOOKMARK` events resumed from a
//! `resourceVersion`, bookmarks only when `allowWatchBookmarks=true`, `fieldSelector`
//! `metadata.name=`, and `410 Gone` two ways: an `ERROR` event with a Status of code 410 on open
//! watches, or HTTP 410 for a watch resumed from a compacted resource version. It can stop
//! (an outage: open watches end, connections refused) and start again on the same port.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;

/// The namespace the fake serves.
pub const NAMESPACE: &str = "ml";

/// The two kinds of object served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// `v1` Pods.
    Pod,
    /// `inference.networking.k8s.io/v1` InferencePools.
    Pool,
}

impl Kind {
    fn api_version(self) -> &'static str {
        match self {
            Kind::Pod => "v1",
            Kind::Pool => "inference.networking.k8s.io/v1",
        }
    }
    fn kind(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Pool => "InferencePool",
        }
    }
}

/// How a `410 Gone` reaches the watchers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// Open watches get an `ERROR` event with a 410 Status and end.
    Event,
    /// Open watches end quietly (as at their timeout); resuming from their resource version
    /// then answers HTTP 410.
    Http,
}

/// What goes out to open watches.
#[derive(Debug, Clone)]
enum Frame {
    Event {
        kind: Kind,
        name: String,
        line: String,
    },
    Bookmark {
        rv: u64,
    },
    Gone,
    End,
}

#[derive(Default)]
struct Store {
    rv: u64,
    /// Resource versions at or below this were compacted away.
    compacted: u64,
    objects: BTreeMap<(Kind, String), Value>,
    /// Events after `compacted`, in order: (rv, frame).
    history: Vec<(u64, Frame)>,
    /// Lists served, per kind (each watcher start or relist is one).
    lists: HashMap<Kind, usize>,
}

struct Shared {
    store: Mutex<Store>,
    frames: broadcast::Sender<Frame>,
}

/// The fake API server; stopped when dropped.
pub struct FakeKube {
    /// The bound address.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<watch::Sender<bool>>,
    task: Option<JoinHandle<()>>,
}

impl FakeKube {
    /// Starts on an ephemeral port of 127.0.0.1.
    pub async fn start() -> FakeKube {
        let (frames, _) = broadcast::channel(1024);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            frames,
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut kube = FakeKube {
            addr,
            shared,
            stop: None,
            task: None,
        };
        kube.serve(listener);
        kube
    }

    fn serve(&mut self, listener: TcpListener) {
        let (stop, mut stopped) = watch::channel(false);
        let app = Router::new()
            .route("/api/v1/namespaces/{ns}/pods", get(pods))
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
                get(pools),
            )
            .with_state(self.shared.clone());
        self.task = Some(tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await;
        }));
        self.stop = Some(stop);
    }

    /// An outage: open watches end, the port refuses connections.
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        let _ = self.shared.frames.send(Frame::End);
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    }

    /// Back on the same port with the same objects.
    pub async fn restart(&mut self) {
        let listener = TcpListener::bind(self.addr).await.expect("rebind");
        self.serve(listener);
    }

    /// A kubeconfig file pointing at this server (plain HTTP, namespace [`NAMESPACE`]).
    pub fn kubeconfig(&self, dir: &std::path::Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: \
             http://{}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    \
             namespace: {NAMESPACE}\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.addr
        );
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }

    /// Lists served for `kind` so far.
    pub fn lists(&self, kind: Kind) -> usize {
        let store = self.shared.store.lock().expect("store");
        store.lists.get(&kind).copied().unwrap_or(0)
    }

    /// Creates or replaces an object (`ADDED` or `MODIFIED` to watchers).
    pub fn put(&self, kind: Kind, object: Value) {
        let name = object["metadata"]["name"]
            .as_str()
            .expect("metadata.name")
            .to_string();
        self.record(kind, name, Some(object));
    }

    /// Changes an object in place (`MODIFIED`).
    pub fn update(&self, kind: Kind, name: &str, change: impl FnOnce(&mut Value)) {
        let mut object = {
            let store = self.shared.store.lock().expect("store");
            store.objects[&(kind, name.to_string())].clone()
        };
        change(&mut object);
        self.record(kind, name.to_string(), Some(object));
    }

    /// Deletes an object (`DELETED`).
    pub fn delete(&self, kind: Kind, name: &str) {
        self.record(kind, name.to_string(), None);
    }

    fn record(&self, kind: Kind, name: String, object: Option<Value>) {
        let mut store = self.shared.store.lock().expect("store");
        store.rv += 1;
        let rv = store.rv;
        let key = (kind, name.clone());
        let (kind_of_event, mut object) = match object {
            Some(o) if store.objects.contains_key(&key) => ("MODIFIED", o),
            Some(o) => ("ADDED", o),
            None => (
                "DELETED",
                store.objects.remove(&key).expect("deleting a known object"),
            ),
        };
        object["apiVersion"] = json!(kind.api_version());
        object["kind"] = json!(kind.kind());
        object["metadata"]["namespace"] = json!(NAMESPACE);
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        if kind_of_event != "DELETED" {
            store.objects.insert(key, object.clone());
        }
        let line = json!({"type": kind_of_event, "object": object}).to_string();
        let frame = Frame::Event { kind, name, line };
        store.history.push((rv, frame.clone()));
        let _ = self.shared.frames.send(frame);
    }

    /// Changes objects without telling any watcher and compacts the history (as etcd does):
    /// watchers can only learn of the change by relisting.
    pub fn expire(&self, gone: Gone, change: impl FnOnce(&mut BTreeMap<(Kind, String), Value>)) {
        let mut store = self.shared.store.lock().expect("store");
        change(&mut store.objects);
        store.rv += 1;
        let rv = store.rv;
        for object in store.objects.values_mut() {
            object["metadata"]["resourceVersion"] = json!(rv.to_string());
        }
        store.compacted = rv;
        store.history.clear();
        let _ = self.shared.frames.send(match gone {
            Gone::Event => Frame::Gone,
            Gone::Http => Frame::End,
        });
    }

    /// A `BOOKMARK` at the current resource version to watches that allow them.
    pub fn bookmark(&self) {
        let rv = self.shared.store.lock().expect("store").rv;
        let _ = self.shared.frames.send(Frame::Bookmark { rv });
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        let _ = self.shared.frames.send(Frame::End);
    }
}

/// A ready (or not) pod of the pool.
pub fn pod(name: &str, ip: &str, ready: bool, labels: Value) -> Value {
    json!({
        "metadata": {"name": name, "labels": labels, "uid": format!("uid-{name}")},
        "spec": {"containers": [{"name": "engine", "image": "switchyard"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
        }
    })
}

/// An `InferencePool` selecting `labels` on `ports`.
pub fn pool(name: &str, labels: Value, ports: &[u16]) -> Value {
    json!({
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
            "endpointPickerRef": {"name": "switchyard-epp", "port": {"number": 9002}}
        }
    })
}

/// Sets a pod's Ready condition.
pub fn set_ready(pod: &mut Value, ready: bool) {
    pod["status"]["conditions"][0]["status"] = json!(if ready { "True" } else { "False" });
}

type Params = Query<HashMap<String, String>>;

async fn pods(State(s): State<Arc<Shared>>, Query(q): Params) -> Response {
    serve_kind(&s, Kind::Pod, &q)
}

async fn pools(State(s): State<Arc<Shared>>, Query(q): Params) -> Response {
    serve_kind(&s, Kind::Pool, &q)
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code
    })
}

fn serve_kind(s: &Arc<Shared>, kind: Kind, q: &HashMap<String, String>) -> Response {
    let only = q
        .get("fieldSelector")
        .and_then(|f| f.strip_prefix("metadata.name="))
        .map(str::to_string);
    let watching = q.get("watch").is_some_and(|w| w == "1" || w == "true");
    if !watching {
        let mut store = s.store.lock().expect("store");
        *store.lists.entry(kind).or_default() += 1;
        let items: Vec<Value> = store
            .objects
            .iter()
            .filter(|((k, n), _)| *k == kind && only.as_ref().is_none_or(|o| o == n))
            .map(|(_, v)| v.clone())
            .collect();
        let body = json!({
            "apiVersion": kind.api_version(),
            "kind": format!("{}List", kind.kind()),
            "metadata": {"resourceVersion": store.rv.to_string()},
            "items": items,
        });
        return axum::Json(body).into_response();
    }
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
    // Subscribed before the history is read, so nothing falls between the two.
    let mut live = s.frames.subscribe();
    let backlog: Vec<Frame> = {
        let store = s.store.lock().expect("store");
        if from < store.compacted {
            let gone = status(410, "Expired", &format!("too old resource version: {from}"));
            return (StatusCode::GONE, axum::Json(gone)).into_response();
        }
        store
            .history
            .iter()
            .filter(|(rv, _)| *rv > from)
            .map(|(_, f)| f.clone())
            .collect()
    };
    let wanted = move |f: &Frame| -> Option<String> {
        match f {
            Frame::Event {
                kind: k,
                name,
                line,
            } => {
                (*k == kind && only.as_ref().is_none_or(|o| o == name)).then(|| format!("{line}\n"))
            }
            Frame::Bookmark { rv } => bookmarks.then(|| {
                let bm = json!({"type": "BOOKMARK", "object": {
                    "apiVersion": kind.api_version(), "kind": kind.kind(),
                    "metadata": {"resourceVersion": rv.to_string()}
                }});
                format!("{bm}\n")
            }),
            Frame::Gone => {
                let e = json!({"type": "ERROR", "object": status(410, "Expired", "too old resource version")});
                Some(format!("{e}\n"))
            }
            Frame::End => None,
        }
    };
    let stream = async_stream(backlog, move |tx| async move {
        loop {
            let frame = match live.recv().await {
                Ok(f) => f,
                Err(broadcast::error::RecvError::Lagged(_)) => Frame::Gone,
                Err(broadcast::error::RecvError::Closed) => Frame::End,
            };
            // A 410 or the server's end is the stream's last frame.
            let last = matches!(frame, Frame::Gone | Frame::End);
            if tx.send(frame).await.is_err() || last {
                return;
            }
        }
    });
    let body = futures_util::StreamExt::filter_map(stream, move |f| {
        let out = wanted(&f);
        async move { out }
    });
    let body = futures_util::StreamExt::map(body, Ok::<_, std::convert::Infallible>);
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(body))
        .expect("response")
}

/// The backlog, then what `feed` sends.
fn async_stream<F, Fut>(backlog: Vec<Frame>, feed: F) -> impl futures_util::Stream<Item = Frame>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Frame>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(feed(tx));
    let live = tokio_stream::wrappers::ReceiverStream::new(rx);
    futures_util::StreamExt::chain(futures_util::stream::iter(backlog), live)
}
