//! The watch loop: kube's watchers on the pool (by name) and the namespace's pods, folded into
//! [`Snapshot`]s; each change recomputes the wanted backends ([`mapping::desired`]) and hands
//! a changed set to the gateway's membership path, the one a fleet-file reload uses.
//!
//! kube's watcher relists after a `410 Gone` event, resumes from the last resource version
//! (bookmarks keep it fresh) when a watch ends, and with `default_backoff` waits longer after
//! each failure. Two things are added here: an HTTP 410 when a watch starts (kube retries that
//! resource version forever) rebuilds the watcher, which relists (a second rebuild within
//! 10 s waits 2 s first); and an outage is logged once
//! per resource, counted in `switchyard_discovery_errors_total`, and changes nothing: the last
//! known fleet keeps serving until the API server answers again.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use http::Uri;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use switchyard_gateway::{membership, BackendSpec, Gateway};

use super::cache::Snapshot;
use super::config::PoolSettings;
use super::mapping::{self, PodView, PoolView};
use super::pool::InferencePool;

type Events<K> = BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>;

/// The two things watched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Pool,
    Pods,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Pool => "inferencepools",
            Kind::Pods => "pods",
        }
    }
}

fn pool_events(api: &Api<InferencePool>, name: &str) -> Events<InferencePool> {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    watcher(api.clone(), config).default_backoff().boxed()
}

fn pod_events(api: &Api<Pod>) -> Events<Pod> {
    // Every pod of the namespace, filtered here: the pool's selector may change at any time
    // and a new selector must see every pod at once, without a second watch.
    watcher(api.clone(), watcher::Config::default())
        .default_backoff()
        .boxed()
}

/// Rebuilds of one watcher closer together than this wait [`REBUILD_PAUSE`] first, so an API
/// server (or a proxy) answering every watch with HTTP 410 is not asked in a tight loop.
const REBUILD_WINDOW: Duration = Duration::from_secs(10);
/// See [`REBUILD_WINDOW`].
const REBUILD_PAUSE: Duration = Duration::from_secs(2);

/// `events`, started after `pause` (none: at once).
fn after<K: Send + 'static>(pause: Option<Duration>, events: Events<K>) -> Events<K> {
    match pause {
        None => events,
        Some(d) => futures_util::stream::once(tokio::time::sleep(d))
            .filter_map(|()| std::future::ready(None))
            .chain(events)
            .boxed(),
    }
}

/// The pause before rebuilding a watcher last rebuilt at `last`.
fn pause_before_rebuild(last: Option<Instant>, now: Instant) -> Option<Duration> {
    last.filter(|t| now.duration_since(*t) < REBUILD_WINDOW)
        .map(|_| REBUILD_PAUSE)
}

/// Whether the API server said the resource version is too old (the watch must relist).
fn is_gone(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status))
        | watcher::Error::InitialListFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

/// Discovery's state between events.
struct Discovery {
    gw: Arc<Gateway>,
    pool: PoolSettings,
    pools: Snapshot<PoolView>,
    pods: Snapshot<PodView>,
    /// The set last handed to membership (`None`: nothing yet).
    applied: Option<Vec<BackendSpec>>,
    /// The peer pickers last handed to replica sync (`--peer-selector`).
    applied_peers: Option<Vec<String>>,
    /// Whether the pool was found at the last reconcile, to log its coming and going once.
    pool_found: Option<bool>,
    /// Per [`Kind`]: failing since the last success (an outage already logged).
    failing: [bool; 2],
    /// Per [`Kind`]: when its watcher was last rebuilt.
    rebuilt: [Option<Instant>; 2],
}

impl Discovery {
    fn succeeded(&mut self, kind: Kind) {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.gw.metrics.discovery_last_sync.set(secs);
        if std::mem::take(&mut self.failing[kind as usize]) {
            tracing::info!(
                resource = kind.as_str(),
                "kubernetes discovery: watching again"
            );
        }
    }

    /// Counts and logs a failure; whether the watcher must be rebuilt (to relist).
    fn failed(&mut self, kind: Kind, e: &watcher::Error) -> bool {
        if is_gone(e) {
            tracing::info!(
                resource = kind.as_str(),
                "kubernetes discovery: watch expired (410), relisting"
            );
            return matches!(e, watcher::Error::WatchStartFailed(_));
        }
        self.gw.metrics.discovery_errors.inc();
        if std::mem::replace(&mut self.failing[kind as usize], true) {
            tracing::debug!(resource = kind.as_str(), error = %e, "kubernetes discovery: still failing");
        } else {
            tracing::warn!(
                resource = kind.as_str(),
                error = %e,
                "kubernetes discovery failing: keeping the last known fleet, retrying with backoff"
            );
        }
        false
    }

    /// Notes a rebuild of `kind`'s watcher; the pause before it starts.
    fn rebuild(&mut self, kind: Kind) -> Option<Duration> {
        let now = Instant::now();
        pause_before_rebuild(self.rebuilt[kind as usize].replace(now), now)
    }

    /// Hands the peer pickers to replica sync when they changed.
    fn reconcile_peers(&mut self) {
        let Some(selector) = &self.pool.peers else {
            return;
        };
        let wanted = mapping::peers(selector, self.pods.values());
        if self.applied_peers.as_ref() == Some(&wanted) {
            return;
        }
        let urls: Vec<Uri> = wanted.iter().filter_map(|u| u.parse().ok()).collect();
        tracing::info!(peers = ?wanted, "peer pickers changed");
        switchyard_gateway::peer_sync::set_peers(&self.gw, &urls);
        self.applied_peers = Some(wanted);
    }

    /// Applies the wanted set when both lists are complete and it changed.
    fn reconcile(&mut self) {
        if !(self.pools.synced() && self.pods.synced()) {
            return;
        }
        self.reconcile_peers();
        let pool = self.pools.single();
        if self.pool_found != Some(pool.is_some()) {
            self.pool_found = Some(pool.is_some());
            if pool.is_some() {
                tracing::info!(pool = %self.pool.name, namespace = %self.pool.namespace, "InferencePool found");
            } else {
                tracing::warn!(pool = %self.pool.name, namespace = %self.pool.namespace, "InferencePool not found: no endpoints");
            }
        }
        let wanted = mapping::desired(pool, self.pods.values());
        if self.applied.as_ref() == Some(&wanted) {
            return;
        }
        tracing::info!(endpoints = wanted.len(), "pool membership changed");
        self.gw
            .metrics
            .discovery_endpoints
            .set(i64::try_from(wanted.len()).unwrap_or(i64::MAX));
        membership::apply_file(&self.gw, wanted.clone());
        self.applied = Some(wanted);
    }
}

/// Watches the pool and its pods until `shutdown`, keeping the gateway's fleet in step.
pub async fn run(
    gw: Arc<Gateway>,
    client: Client,
    pool: PoolSettings,
    shutdown: impl Future<Output = ()>,
) {
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &pool.namespace);
    let pods: Api<Pod> = Api::namespaced(client, &pool.namespace);
    let mut pool_stream = pool_events(&pools, &pool.name);
    let mut pod_stream = pod_events(&pods);
    tracing::info!(pool = %pool.name, namespace = %pool.namespace, "kubernetes discovery started");
    let mut d = Discovery {
        gw,
        pool,
        pools: Snapshot::default(),
        pods: Snapshot::default(),
        applied: None,
        applied_peers: None,
        pool_found: None,
        failing: [false; 2],
        rebuilt: [None; 2],
    };
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            Some(event) = pool_stream.next() => match event {
                Ok(event) => {
                    d.succeeded(Kind::Pool);
                    if d.pools.apply(event, |p| (p.metadata.name.clone().unwrap_or_default(), PoolView::of(p))) {
                        d.reconcile();
                    }
                }
                Err(e) => {
                    if d.failed(Kind::Pool, &e) {
                        pool_stream = after(d.rebuild(Kind::Pool), pool_events(&pools, &d.pool.name));
                    }
                }
            },
            Some(event) = pod_stream.next() => match event {
                Ok(event) => {
                    d.succeeded(Kind::Pods);
                    if d.pods.apply(event, |p| { let v = PodView::of(p); (v.name.clone(), v) }) {
                        d.reconcile();
                    }
                }
                Err(e) => {
                    if d.failed(Kind::Pods, &e) {
                        pod_stream = after(d.rebuild(Kind::Pods), pod_events(&pods));
                    }
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn status(code: u16) -> Box<Status> {
        Box::new(serde_json::from_value(serde_json::json!({"code": code})).expect("a status"))
    }

    #[test]
    fn only_410s_are_gone() {
        assert!(is_gone(&watcher::Error::WatchError(status(410))));
        assert!(is_gone(&watcher::Error::WatchStartFailed(
            kube::Error::Api(status(410))
        )));
        assert!(!is_gone(&watcher::Error::WatchError(status(500))));
        assert!(!is_gone(&watcher::Error::WatchStartFailed(
            kube::Error::Api(status(403))
        )));
        assert!(!is_gone(&watcher::Error::NoResourceVersion));
    }

    #[test]
    fn rebuilds_close_together_pause() {
        let now = Instant::now();
        assert_eq!(pause_before_rebuild(None, now), None);
        assert_eq!(
            pause_before_rebuild(Some(now - Duration::from_secs(1)), now),
            Some(REBUILD_PAUSE)
        );
        assert_eq!(pause_before_rebuild(Some(now - REBUILD_WINDOW), now), None);
    }
}
