//! The gateway side of replica sync (`--peer`, see [`crate::peers`]): applying a peer's batch
//! to the router, and the task per peer that sends this replica's.

use std::sync::Arc;
use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};
use http::{header, Request, Uri};
use http_body_util::{BodyExt, Full};
use serde_json::value::RawValue;
use switchyard_core::{Observation, RequestId, RequestKind, Usage};
use tokio::sync::mpsc;

use crate::peers::{
    unix_now, Header, Message, Peers, WireEndpoint, BATCH, BATCH_BYTES, HEARTBEAT, SEND_TIMEOUT,
};
use crate::state::Gateway;
use crate::upstream::Upstream;

/// Applies a batch from a peer; returns (applied, ignored) messages.
pub fn receive(gw: &Gateway, peers: &Peers, body: &[u8]) -> Result<(u64, u64), String> {
    let mut lines = body.split(|&b| b == b'\n').filter(|l| !l.is_empty());
    let header: Header = lines
        .next()
        .ok_or("empty batch")
        .and_then(|l| serde_json::from_slice(l).map_err(|_| "bad batch header"))
        .map_err(str::to_string)?;
    if header.origin == peers.origin() {
        return Err("a batch from this replica itself (a --peer names this replica)".into());
    }
    peers.heard(header.origin, Instant::now());
    let (mut applied, mut ignored) = (0, 0);
    for line in lines {
        let done = match serde_json::from_slice::<Message>(line) {
            Ok(message) => apply(gw, peers, header.origin, message),
            Err(e) => {
                tracing::debug!("peer message not decoded: {e}");
                false
            }
        };
        if done {
            applied += 1;
        } else {
            ignored += 1;
        }
    }
    if let Some(sent) = header.sent_unix_s {
        gw.metrics
            .peer_sync_lag
            .observe((unix_now() - sent).max(0.0));
    }
    if let Some(live) = header.live {
        let now = gw.now();
        for local in peers.unlisted(header.origin, &live) {
            end(gw, Observation::Failed(local), now);
        }
    }
    Ok((applied, ignored))
}

/// Applies one message from `origin`; false if it was ignored.
fn apply(gw: &Gateway, peers: &Peers, origin: u64, message: Message) -> bool {
    let now = gw.now();
    match message {
        Message::Routed {
            id,
            backend,
            endpoint,
            session,
            body,
        } => {
            let Some(local) = commit_peer_pick(gw, &backend, endpoint, session, &body) else {
                return false;
            };
            if let Some(old) = peers.record(origin, id, local) {
                end(gw, Observation::Failed(old), now);
            }
            true
        }
        Message::FirstToken { id } => peers
            .local(origin, id, false)
            .map(|l| end(gw, Observation::FirstToken(l), now))
            .is_some(),
        Message::Finished { id, usage } => peers
            .local(origin, id, true)
            .map(|l| end(gw, Observation::Finished(l, usage.map(Usage::from)), now))
            .is_some(),
        Message::Failed { id } => peers
            .local(origin, id, true)
            .map(|l| end(gw, Observation::Failed(l), now))
            .is_some(),
    }
}

/// Ends the requests of origins not heard from within [`crate::peers::PEER_TIMEOUT`]; returns
/// how many.
pub fn expire(gw: &Gateway, peers: &Peers) -> usize {
    let gone = peers.expired(Instant::now());
    let now = gw.now();
    for &local in &gone {
        end(gw, Observation::Failed(local), now);
    }
    gone.len()
}

/// Applies a peer request's outcome to the router (not to this replica's prediction metrics:
/// the timings are the origin's, seen late).
fn end(gw: &Gateway, observation: Observation, now: f64) {
    let mut registry = gw.registry.lock();
    registry.observe(observation, now);
    let mut discard = Vec::new();
    registry.router.take_predictions(&mut discard);
}

/// Prepares a peer's request as this replica would and commits the peer's pick as a request of
/// its own; the new local id, or none if the request or backend is unknown here.
fn commit_peer_pick(
    gw: &Gateway,
    backend: &str,
    endpoint: WireEndpoint,
    session: Option<String>,
    body: &RawValue,
) -> Option<RequestId> {
    let parsed = crate::parse::parse(body.get().as_bytes(), session.as_deref()).ok()?;
    let kind = if endpoint == WireEndpoint::Embeddings {
        RequestKind::Embed
    } else {
        RequestKind::Generate
    };
    let target = gw.registry.lock().target(&parsed.model).ok()?;
    let prompt = target.prepare(&parsed, kind, gw.block_bytes);
    let prompt = gw.tokenize(&target, &parsed, kind, prompt);
    let now = gw.now();
    let mut guard = gw.registry.lock();
    let registry = &mut *guard;
    let instance = registry.by_name.get(backend)?.id;
    let decision = registry.route(&parsed, &target, &prompt, kind, now).ok()?;
    let plan = decision.plan_for(instance);
    let local = gw.next_request();
    registry.observe(
        Observation::Routed {
            request: local,
            instance,
            plan,
        },
        now,
    );
    let mut discard = Vec::new();
    registry.router.take_predictions(&mut discard);
    Some(local)
}

/// Makes the `--peer` URLs and the `discovered` ones the peers (`switchyard epp
/// --peer-selector`, `switchyard serve --peer-dns`): senders start for new peers, and end for
/// peers no longer listed.
pub fn set_peers(gw: &Arc<Gateway>, discovered: &[Uri]) {
    let Some(peers) = gw.peers.as_ref() else {
        return;
    };
    let mut urls = gw.settings.peers.clone();
    urls.extend_from_slice(discovered);
    for (url, rx) in peers.set_urls(&urls) {
        tracing::info!(peer = %url, "sharing decisions with a new peer");
        tokio::spawn(send_loop(gw.clone(), url, rx));
    }
}

/// Starts one sender per peer and the sweep of silent origins; the handles stop them.
pub fn spawn(gw: &Arc<Gateway>) -> Vec<tokio::task::JoinHandle<()>> {
    let Some(peers) = gw.peers.as_ref() else {
        return Vec::new();
    };
    let mut tasks: Vec<_> = peers
        .take_inboxes()
        .into_iter()
        .map(|(url, rx)| tokio::spawn(send_loop(gw.clone(), url, rx)))
        .collect();
    let sweeper = gw.clone();
    tasks.push(tokio::spawn(async move {
        let mut tick = tokio::time::interval(HEARTBEAT);
        loop {
            tick.tick().await;
            if let Some(p) = sweeper.peers.as_ref() {
                let ended = expire(&sweeper, p);
                if ended > 0 {
                    tracing::info!(
                        ended,
                        "a peer went silent: its requests are no longer counted"
                    );
                }
            }
        }
    }));
    tasks
}

/// Delivers one peer's queue: a batch as soon as there is a message, a heartbeat (with the
/// requests still live) every [`HEARTBEAT`]; a failed batch is dropped and counted.
async fn send_loop(gw: Arc<Gateway>, base: Uri, mut rx: mpsc::Receiver<Bytes>) {
    let Ok(url) =
        format!("{}/admin/peer-sync", base.to_string().trim_end_matches('/')).parse::<Uri>()
    else {
        tracing::warn!(peer = %base, "not a usable peer URL");
        return;
    };
    let client = gw.upstream.clone();
    let mut last_beat = Instant::now() - HEARTBEAT;
    let mut failing = false;
    let mut pending: Vec<Bytes> = Vec::with_capacity(BATCH);
    loop {
        // Senders of discovered peers are not in the handles a shutdown aborts.
        if gw.is_shutting_down() {
            return;
        }
        let wait = HEARTBEAT.saturating_sub(last_beat.elapsed());
        match tokio::time::timeout(wait, rx.recv()).await {
            Ok(Some(line)) => pending.push(line),
            Ok(None) => return,
            Err(_) => {}
        }
        let mut bytes: usize = pending.first().map_or(0, Bytes::len);
        while pending.len() < BATCH && bytes < BATCH_BYTES {
            match rx.try_recv() {
                Ok(line) => {
                    bytes += line.len();
                    pending.push(line);
                }
                Err(_) => break,
            }
        }
        let beat = last_beat.elapsed() >= HEARTBEAT;
        if pending.is_empty() && !beat {
            continue;
        }
        let Some(peers) = gw.peers.as_ref() else {
            return;
        };
        let header = Header {
            origin: peers.origin(),
            live: beat.then(|| peers.live_ids()),
            sent_unix_s: Some(unix_now()),
        };
        if beat {
            last_beat = Instant::now();
        }
        let mut body = BytesMut::new();
        if serde_json::to_writer((&mut body).writer(), &header).is_err() {
            pending.clear();
            continue;
        }
        body.put_u8(b'\n');
        for line in &pending {
            body.put_slice(line);
        }
        let sent = pending.len();
        pending.clear();
        let ok = deliver(
            &client,
            &url,
            gw.settings.admin_token.as_deref(),
            body.freeze(),
        )
        .await;
        match ok {
            Ok(()) => {
                if failing {
                    tracing::info!(peer = %base, "peer reachable again");
                    failing = false;
                }
                gw.metrics.peer_messages("sent", sent as u64);
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(peer = %base, "peer sync failing (messages dropped until it answers): {e}");
                    failing = true;
                }
                gw.metrics.peer_messages("dropped", sent as u64);
            }
        }
    }
}

async fn deliver(
    client: &Upstream,
    url: &Uri,
    token: Option<&str>,
    body: Bytes,
) -> Result<(), String> {
    let mut request = Request::post(url.clone())
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    if let Some(t) = token {
        let value = format!("Bearer {t}").parse().map_err(|_| "bad token")?;
        request.headers_mut().insert(header::AUTHORIZATION, value);
    }
    let call = async {
        let response = client
            .send(false, request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        // Read the (short) answer so the connection goes back to the pool.
        let _ = response.into_body().collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("answered {status}"))
        }
    };
    tokio::time::timeout(SEND_TIMEOUT, call)
        .await
        .map_err(|_| "timed out".to_string())?
}
