//! Router replicas that share their decisions (`--peer URL`).
//!
//! Replicas in front of one fleet do not see each other's requests: each would route the next
//! turn of a conversation another replica placed without knowing where it went, and count only
//! its own requests as load. Each replica therefore tells its peers, within milliseconds, every
//! request it routes (the request body and the backend it picked) and how it goes on (first
//! token, end with usage, failure). A peer prepares the request itself (its own prefix match)
//! and commits the same pick as a request of its own, so its prefix index and load accounting
//! learn what the deciding replica's do. The simulator measured why (docs/results.md §3): with
//! decisions shared within 5 ms, 4 replicas route as one; at 50 ms they already lose.
//!
//! Wire: `POST /admin/peer-sync` with the admin token, a body of JSON lines: a header
//! `{"origin": ID, "live": [ids] | null}` then one [`Message`] per line. Batches go out as soon
//! as a message is queued (each peer has one connection and one batch in flight) and as a
//! heartbeat every second. A heartbeat lists the requests still in flight at the origin, so a
//! peer that missed an end (a lost batch) forgets the request; an origin silent for
//! [`PEER_TIMEOUT`] is taken as gone and its requests end. Messages are never retried: a late
//! decision is worse than none.
//!
//! The peers are the `--peer` URLs, or (`switchyard epp --peer-selector`) the picker pods the
//! Kubernetes pod watch finds, a set that changes while running ([`Peers::set_urls`]).
//!
//! This module holds the wire format and what a replica remembers; `peer_sync` applies
//! batches to the router and sends them.
//!
//! A disaggregated request is shared as its two legs (each its own request in the router). A
//! retry moves nothing (the peers forget the request or leg instead). Every replica must have the same backends (by name), models and
//! aliases; a message about a backend a peer does not know is ignored and counted.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Uri;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use switchyard_core::{Observation, RequestId, Usage};
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// Between two heartbeats to a peer.
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// An origin heard from less recently than this is gone: its requests end.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(5);
/// Messages waiting for one peer; more are dropped (and counted) while it is slow or down.
const OUTBOX: usize = 4096;
/// Messages in one batch.
pub(crate) const BATCH: usize = 256;
/// Bytes of messages in one batch (the receiving route takes up to 64 MiB).
pub(crate) const BATCH_BYTES: usize = 8 << 20;
/// How long one batch may take to deliver.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// What one replica tells the others about one request.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Message {
    /// The origin sent request `id` to `backend`.
    Routed {
        /// The origin's request id.
        id: u64,
        /// Backend name.
        backend: String,
        /// Which endpoint the body was sent to.
        endpoint: WireEndpoint,
        /// The client's `x-session-id`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        session: Option<String>,
        /// The request body as the client sent it (JSON).
        body: Box<RawValue>,
    },
    /// Its first token arrived.
    FirstToken {
        /// The origin's request id.
        id: u64,
    },
    /// It finished, with the engine's usage when there was one.
    Finished {
        /// The origin's request id.
        id: u64,
        /// Prompt, cached and generated tokens.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<WireUsage>,
    },
    /// It failed, was cancelled, or moved to another backend.
    Failed {
        /// The origin's request id.
        id: u64,
    },
}

/// [`Endpoint`] on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireEndpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/embeddings`.
    Embeddings,
}

/// [`Usage`] on the wire.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct WireUsage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache, when reported.
    #[serde(default)]
    pub cached_tokens: Option<u32>,
    /// Generated tokens.
    pub completion_tokens: u32,
}

impl From<Usage> for WireUsage {
    fn from(u: Usage) -> Self {
        WireUsage {
            prompt_tokens: u.prompt_tokens,
            cached_tokens: u.cached_tokens,
            completion_tokens: u.completion_tokens,
        }
    }
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Self {
        Usage {
            prompt_tokens: u.prompt_tokens,
            cached_tokens: u.cached_tokens,
            completion_tokens: u.completion_tokens,
        }
    }
}

/// The first line of a batch.
#[derive(Debug, Serialize, Deserialize)]
pub struct Header {
    /// The sending replica (random per process).
    pub origin: u64,
    /// Heartbeats: the origin's shared requests still in flight.
    #[serde(default)]
    pub live: Option<Vec<u64>>,
    /// When the batch left, in seconds since the Unix epoch by the sender's clock.
    #[serde(default)]
    pub sent_unix_s: Option<f64>,
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Requests a peer told this replica about, as this replica's own.
#[derive(Default)]
struct Origin {
    last_heard: Option<Instant>,
    requests: HashMap<u64, RequestId>,
}

/// The replica-sync state of a gateway with `--peer`.
pub struct Peers {
    origin: u64,
    /// Each peer's URL and queue of encoded messages; dropping a queue ends its sender.
    outboxes: Mutex<Vec<(Uri, mpsc::Sender<Bytes>)>>,
    /// Receivers, taken when the senders start.
    inboxes: Mutex<Vec<(Uri, mpsc::Receiver<Bytes>)>>,
    /// This replica's shared requests still in flight (their outcomes go to the peers).
    live: Mutex<HashSet<u64>>,
    /// Requests heard of from each origin.
    origins: Mutex<HashMap<u64, Origin>>,
}

impl Peers {
    /// Queues for these peer base URLs (`http://host:port`); `origin` names this replica.
    pub fn new(urls: &[Uri], origin: u64) -> Self {
        let peers = Peers {
            origin,
            outboxes: Mutex::new(Vec::new()),
            inboxes: Mutex::new(Vec::new()),
            live: Mutex::new(HashSet::new()),
            origins: Mutex::new(HashMap::new()),
        };
        let added = peers.set_urls(urls);
        *peers.inboxes.lock() = added;
        peers
    }

    /// Makes `urls` the peers (discovered peers come and go): a peer no longer listed loses its
    /// queue, so its sender ends; a new one gets a queue, returned for a sender to start.
    /// Repeated URLs count once.
    pub fn set_urls(&self, urls: &[Uri]) -> Vec<(Uri, mpsc::Receiver<Bytes>)> {
        let mut outboxes = self.outboxes.lock();
        outboxes.retain(|(url, _)| urls.contains(url));
        let mut added = Vec::new();
        for url in urls {
            if outboxes.iter().any(|(u, _)| u == url) {
                continue;
            }
            let (tx, rx) = mpsc::channel(OUTBOX);
            outboxes.push((url.clone(), tx));
            added.push((url.clone(), rx));
        }
        added
    }

    /// The peers' base URLs.
    pub fn urls(&self) -> Vec<Uri> {
        self.outboxes
            .lock()
            .iter()
            .map(|(u, _)| u.clone())
            .collect()
    }

    /// This replica's name for its peers.
    pub fn origin(&self) -> u64 {
        self.origin
    }

    /// Each peer's URL and queue, once (for the senders).
    pub fn take_inboxes(&self) -> Vec<(Uri, mpsc::Receiver<Bytes>)> {
        std::mem::take(&mut *self.inboxes.lock())
    }

    /// This replica's shared requests still in flight (a heartbeat's list).
    pub fn live_ids(&self) -> Vec<u64> {
        self.live.lock().iter().copied().collect()
    }

    /// Queues `message` for every peer; counts what could not be queued.
    fn broadcast(&self, metrics: &Metrics, message: &Message) {
        let mut line = match serde_json::to_vec(message) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("peer message not encoded: {e}");
                return;
            }
        };
        line.push(b'\n');
        let line = Bytes::from(line);
        for (_, outbox) in self.outboxes.lock().iter() {
            if outbox.try_send(line.clone()).is_err() {
                metrics.peer_messages("dropped", 1);
            }
        }
    }

    /// This replica routed request `rid` to `backend`: tells the peers, with the client's body.
    pub fn routed(
        &self,
        metrics: &Metrics,
        rid: RequestId,
        backend: &str,
        endpoint: WireEndpoint,
        session: Option<&str>,
        body: &[u8],
    ) {
        // The body parsed as JSON already; a body that is not UTF-8 is not shared.
        let Ok(text) = std::str::from_utf8(body) else {
            return;
        };
        // One message a line: a raw newline in JSON can only be whitespace between tokens.
        let text = if text.contains(['\n', '\r']) {
            text.replace(['\n', '\r'], " ")
        } else {
            text.to_string()
        };
        let Ok(body) = RawValue::from_string(text) else {
            return;
        };
        self.live.lock().insert(rid.0);
        self.broadcast(
            metrics,
            &Message::Routed {
                id: rid.0,
                backend: backend.to_string(),
                endpoint,
                session: session.map(str::to_string),
                body,
            },
        );
    }

    /// Passes on the outcome of a request this replica shared; a retry (a second `Routed`)
    /// makes the peers forget it.
    pub fn observed(&self, metrics: &Metrics, observation: &Observation) {
        let (id, message) = match observation {
            Observation::FirstToken(r) => (r.0, Message::FirstToken { id: r.0 }),
            Observation::Finished(r, usage) => (
                r.0,
                Message::Finished {
                    id: r.0,
                    usage: usage.map(WireUsage::from),
                },
            ),
            Observation::Failed(r) | Observation::Routed { request: r, .. } => {
                (r.0, Message::Failed { id: r.0 })
            }
            _ => return,
        };
        let ends = !matches!(message, Message::FirstToken { .. });
        {
            let mut live = self.live.lock();
            let shared = if ends {
                live.remove(&id)
            } else {
                live.contains(&id)
            };
            if !shared {
                return;
            }
        }
        self.broadcast(metrics, &message);
    }

    /// A batch from `origin` arrived.
    pub fn heard(&self, origin: u64, now: Instant) {
        self.origins.lock().entry(origin).or_default().last_heard = Some(now);
    }

    /// Remembers the origin's request `id` as this replica's `local`; returns the local id it
    /// replaces (the same request sent again), which must end.
    pub fn record(&self, origin: u64, id: u64, local: RequestId) -> Option<RequestId> {
        self.origins
            .lock()
            .entry(origin)
            .or_default()
            .requests
            .insert(id, local)
    }

    /// This replica's id for the origin's request `id`; `remove` when it ends.
    pub fn local(&self, origin: u64, id: u64, remove: bool) -> Option<RequestId> {
        let mut origins = self.origins.lock();
        let requests = &mut origins.get_mut(&origin)?.requests;
        if remove {
            requests.remove(&id)
        } else {
            requests.get(&id).copied()
        }
    }

    /// Forgets the origin's requests that its heartbeat no longer lists (their end was lost);
    /// returns their local ids, which must end.
    pub fn unlisted(&self, origin: u64, live: &[u64]) -> Vec<RequestId> {
        let live: HashSet<u64> = live.iter().copied().collect();
        let mut origins = self.origins.lock();
        let Some(o) = origins.get_mut(&origin) else {
            return Vec::new();
        };
        let mut gone = Vec::new();
        o.requests.retain(|id, local| {
            let keep = live.contains(id);
            if !keep {
                gone.push(*local);
            }
            keep
        });
        gone
    }

    /// Forgets the origins not heard from within [`PEER_TIMEOUT`] of `now`; returns their
    /// requests' local ids, which must end.
    pub fn expired(&self, now: Instant) -> Vec<RequestId> {
        let mut origins = self.origins.lock();
        let mut gone = Vec::new();
        origins.retain(|_, o| {
            let alive = o
                .last_heard
                .is_some_and(|t| now.saturating_duration_since(t) < PEER_TIMEOUT);
            if !alive {
                gone.extend(o.requests.values().copied());
            }
            alive
        });
        gone
    }

    /// Peer requests this replica holds as in flight.
    pub fn held(&self) -> usize {
        self.origins.lock().values().map(|o| o.requests.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_as_json_lines() {
        let body = RawValue::from_string(r#"{"model":"m","prompt":"hi"}"#.into()).unwrap();
        let m = Message::Routed {
            id: 7,
            backend: "b0".into(),
            endpoint: WireEndpoint::Completions,
            session: None,
            body,
        };
        let line = serde_json::to_string(&m).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(
            line,
            r#"{"routed":{"id":7,"backend":"b0","endpoint":"completions","body":{"model":"m","prompt":"hi"}}}"#
        );
        match serde_json::from_str::<Message>(&line).unwrap() {
            Message::Routed { id, body, .. } => {
                assert_eq!(id, 7);
                assert_eq!(body.get(), r#"{"model":"m","prompt":"hi"}"#);
            }
            other => panic!("{other:?}"),
        }
        let f: Message = serde_json::from_str(
            r#"{"finished":{"id":3,"usage":{"prompt_tokens":5,"completion_tokens":2}}}"#,
        )
        .unwrap();
        assert!(
            matches!(f, Message::Finished { id: 3, usage: Some(u) } if u.cached_tokens.is_none())
        );
    }

    #[test]
    fn only_shared_requests_are_passed_on_and_ends_leave_the_live_list() {
        let peers = Peers::new(&["http://127.0.0.1:1".parse().unwrap()], 1);
        let metrics = Metrics::new();
        let mut rx = peers.take_inboxes().pop().unwrap().1;
        let body = b"{\n\"model\": \"m\"}";
        peers.routed(&metrics, RequestId(4), "b0", WireEndpoint::Chat, None, body);
        let line = rx.try_recv().unwrap();
        assert!(
            !line[..line.len() - 1].contains(&b'\n'),
            "one message a line"
        );
        assert_eq!(peers.live_ids(), vec![4]);
        peers.observed(&metrics, &Observation::FirstToken(RequestId(9)));
        assert!(rx.try_recv().is_err(), "request 9 was never shared");
        peers.observed(&metrics, &Observation::FirstToken(RequestId(4)));
        assert!(rx.try_recv().is_ok());
        assert_eq!(peers.live_ids(), vec![4]);
        peers.observed(&metrics, &Observation::Finished(RequestId(4), None));
        assert!(rx.try_recv().is_ok());
        assert!(peers.live_ids().is_empty());
        peers.observed(&metrics, &Observation::Failed(RequestId(4)));
        assert!(
            rx.try_recv().is_err(),
            "an ended request is not passed on again"
        );
    }

    #[test]
    fn a_changed_peer_set_keeps_the_queues_of_peers_still_listed() {
        let (a, b, c): (Uri, Uri, Uri) = (
            "http://10.0.0.1:9090".parse().unwrap(),
            "http://10.0.0.2:9090".parse().unwrap(),
            "http://10.0.0.3:9090".parse().unwrap(),
        );
        let peers = Peers::new(&[a.clone(), b.clone(), a.clone()], 1);
        let mut started = peers.take_inboxes();
        assert_eq!(started.len(), 2, "a repeated URL is one peer");
        let metrics = Metrics::new();
        let added = peers.set_urls(&[b.clone(), c.clone()]);
        assert_eq!(added.len(), 1);
        assert_eq!(added[0].0, c);
        assert_eq!(peers.urls(), vec![b.clone(), c.clone()]);
        peers.routed(
            &metrics,
            RequestId(1),
            "b0",
            WireEndpoint::Chat,
            None,
            b"{}",
        );
        let (mut rx_b, mut rx_a) = (started.pop().unwrap().1, started.pop().unwrap().1);
        assert!(
            matches!(
                rx_a.try_recv(),
                Err(mpsc::error::TryRecvError::Disconnected)
            ),
            "a peer no longer listed has its queue closed, so its sender stops"
        );
        assert!(
            rx_b.try_recv().is_ok(),
            "a peer still listed keeps its queue"
        );
        let mut rx_c = added.into_iter().next().unwrap().1;
        assert!(rx_c.try_recv().is_ok());
        assert!(peers.set_urls(&[]).is_empty());
        assert!(peers.urls().is_empty());
    }

    #[test]
    fn heartbeats_and_silence_end_a_peers_requests() {
        let peers = Peers::new(&[], 1);
        let t0 = Instant::now();
        peers.heard(7, t0);
        assert_eq!(peers.record(7, 1, RequestId(100)), None);
        assert_eq!(peers.record(7, 2, RequestId(101)), None);
        assert_eq!(peers.record(7, 2, RequestId(102)), Some(RequestId(101)));
        assert_eq!(peers.local(7, 1, false), Some(RequestId(100)));
        assert_eq!(peers.unlisted(7, &[2]), vec![RequestId(100)]);
        assert_eq!(peers.held(), 1);
        assert!(peers.expired(t0 + PEER_TIMEOUT / 2).is_empty());
        assert_eq!(peers.expired(t0 + PEER_TIMEOUT), vec![RequestId(102)]);
        assert_eq!(peers.held(), 0);
        assert_eq!(peers.local(7, 2, true), None);
    }
}
