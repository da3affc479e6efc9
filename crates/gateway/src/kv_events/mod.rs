//! KV event subscription: for each backend with `kv_events=tcp://host:port`, a task subscribes
//! to the engine's ZeroMQ PUB socket, decodes vLLM's event batches ([`wire`]), feeds them to
//! the router as `Observation::KvEvents` (through [`Gateway::observe`], the one place that locks
//! it), and watches the stream's health ([`health`]).
//!
//! A forward sequence gap on a backend with `kv_events_replay=` is first asked of the engine's
//! replay endpoint ([`replay`]): if it sends every lost batch, they are applied in order and the
//! stream stays trusted; otherwise what it sent is applied and the gap is trouble as below.
//! Counted in `switchyard_kv_events_replays_total{outcome}`. Without a gap the message path is
//! the same as without replay.
//!
//! On trouble (a sequence gap, an undecodable batch, lag, silence while the engine reports
//! prompt work, a lost connection) the router is told `KvEventsLost`: the backend's exact view
//! is dropped and it is priced on the approximate index. A broken or silent connection is
//! resubscribed. The episode is logged once and counted in `switchyard_kv_events_fallbacks_total`;
//! after a clean probation with events the router is told `KvEventsTrusted`. A new subscription
//! starts untrusted too (the cache before it is unknown). Nothing is queued: each message is
//! decoded and applied as it arrives, and ZeroMQ drops what a slow reader does not take, which
//! shows as a gap.

pub mod health;
pub mod replay;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use switchyard_core::{KvEvent, Observation};
use zeromq::{Socket, SocketEvent, SocketRecv};

use crate::backends::Backend;
use crate::state::Gateway;
use health::{StreamHealth, Trouble};

/// How often silence and probation are checked.
const TICK: Duration = Duration::from_millis(250);

/// Longest wait between two subscription attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Most batches one replay may ask for (vLLM's default `buffer_steps`: an engine holds no more,
/// and a bigger gap is rather a restart).
const MAX_REPLAY_BATCHES: u64 = 10_000;

/// How long gaps are not asked of a replay endpoint that brought back nothing: each attempt on
/// an unreachable one holds the subscription for the whole timeout.
const REPLAY_PAUSE_S: f64 = 10.0;

/// Wall-clock seconds since the Unix epoch (batches carry their publication time in it).
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The stream's view as the router and the metrics see it, and the episode's log line.
struct Trust<'a> {
    gw: &'a Gateway,
    backend: &'a Backend,
    health: StreamHealth,
    /// The engine's replay endpoint (`kv_events_replay=`).
    replay: Option<&'a str>,
    /// Gateway time before which gaps are not asked of it (after a failed replay).
    replay_paused_until: f64,
}

impl Trust<'_> {
    /// The stream is untrusted from now: the router prices the backend on the approximate index.
    /// Its exact view is kept through a lost message (it is only a few blocks wrong, and an
    /// engine publishes a block once, when it stores it), and cleared when the engine's cache may
    /// be gone: a new subscription (after a lost connection or silence, the engine may have
    /// restarted) or sequence numbers that went back (it did). Counted and logged once per
    /// episode (a new subscription is not an episode).
    fn lose(&mut self, trouble: Option<&Trouble>) {
        let was_trusted = self.health.distrust(self.gw.now());
        let restarted = match trouble {
            None => true,
            Some(Trouble::Gap { expected, got }) => got < expected,
            Some(_) => false,
        };
        if restarted {
            self.gw.observe(Observation::KvEvents(
                self.backend.id,
                vec![KvEvent::AllCleared],
            ));
        }
        self.gw.observe(Observation::KvEventsLost(self.backend.id));
        let m = &self.backend.metrics.kv_events;
        m.exact.set(0);
        if let Some(trouble) = trouble {
            if matches!(trouble, Trouble::Gap { .. }) {
                m.gaps.inc();
            }
            if was_trusted {
                m.fallbacks.inc();
                tracing::warn!(
                    backend = self.backend.name(),
                    "KV events untrusted ({trouble}): routing on the approximate index until the stream runs clean"
                );
            } else {
                tracing::debug!(backend = self.backend.name(), "KV events: {trouble}");
            }
        }
    }

    /// Periodic check; `Err` when the stream needs a new subscription.
    fn tick(&mut self, work: &mut WorkMeter) -> Result<(), Trouble> {
        let now = self.gw.now();
        self.health.on_work(work.take(self.backend), now);
        match self.health.check(now) {
            Ok(true) => {
                self.gw
                    .observe(Observation::KvEventsTrusted(self.backend.id));
                self.backend.metrics.kv_events.exact.set(1);
                tracing::info!(
                    backend = self.backend.name(),
                    "KV events trusted: exact matching"
                );
                Ok(())
            }
            Ok(false) => Ok(()),
            Err(trouble) => {
                self.lose(Some(&trouble));
                Err(trouble)
            }
        }
    }

    /// One message off the socket: decoded, checked (a gap first asked of the replay endpoint),
    /// applied.
    async fn message(&mut self, frames: &[bytes::Bytes]) {
        let batch = match wire::decode_message(frames) {
            Ok(b) => b,
            Err(e) => {
                self.backend.metrics.kv_events.decode_errors.inc();
                // Its events are lost: as good as a gap.
                self.lose(Some(&Trouble::Undecodable(e.to_string())));
                return;
            }
        };
        if let Some(endpoint) = self.replay {
            if let Some(expected) = self.health.expected().filter(|&e| e < batch.seq) {
                if self.gw.now() >= self.replay_paused_until {
                    self.replay(endpoint, expected, batch.seq).await;
                }
            }
        }
        let block_size = block_size(&batch);
        if let Err(trouble) = self
            .health
            .on_batch(batch.seq, batch.ts, block_size, unix_now())
        {
            self.lose(Some(&trouble));
            // The view restarts from this batch: what it says is still true.
            let _ = self.health.on_batch(batch.seq, None, None, unix_now());
        }
        self.apply(batch.events);
    }

    /// Feeds a batch's events to the router.
    fn apply(&self, events: Vec<KvEvent>) {
        if !events.is_empty() {
            let m = &self.backend.metrics.kv_events;
            m.received.inc_by(events.len() as u64);
            self.gw
                .observe(Observation::KvEvents(self.backend.id, events));
        }
    }

    /// Asks the replay endpoint for batches `from..until` (a gap) and applies what comes back in
    /// order. When every one came, the stream expects `until` next and the gap is no trouble;
    /// otherwise it expects the first missing one, and the live batch shows the (smaller) gap.
    async fn replay(&mut self, endpoint: &str, from: u64, until: u64) {
        let m = &self.backend.metrics.kv_events;
        let wanted = until - from;
        let fetched = if wanted > MAX_REPLAY_BATCHES {
            replay::Fetched {
                stopped: Some(format!(
                    "{wanted} batches lost, more than a replay asks for"
                )),
                ..replay::Fetched::default()
            }
        } else {
            let timeout = self.gw.settings.probe_timeout.max(TICK);
            replay::fetch(endpoint, from, until, timeout).await
        };
        let got = fetched.batches.len() as u64;
        for batch in fetched.batches {
            // Replayed batches are old by nature: no lag check (the live batch has its own).
            let block_size = block_size(&batch);
            if self
                .health
                .on_batch(batch.seq, None, block_size, unix_now())
                .is_err()
            {
                // Invariant of `replay::fetch`: consecutive from `from`, which the stream expects.
                break;
            }
            self.apply(batch.events);
        }
        let backend = self.backend.name();
        if got == wanted {
            // The gap happened (counted) but lost nothing.
            m.gaps.inc();
            m.replays_filled.inc();
            tracing::debug!(backend, %endpoint, "KV events: gap {from}..{until} filled by replay");
        } else {
            let why = fetched.stopped.unwrap_or_default();
            if got > 0 {
                m.replays_partial.inc();
            } else {
                m.replays_failed.inc();
                self.replay_paused_until = self.gw.now() + REPLAY_PAUSE_S;
            }
            tracing::debug!(
                backend,
                %endpoint,
                "KV events: replay of {from}..{until} brought {got} batches: {why}"
            );
        }
    }
}

/// The block size a batch's events use, when it stores any.
fn block_size(batch: &wire::Batch) -> Option<u32> {
    batch.events.iter().find_map(|e| match e {
        KvEvent::Stored { block_size, .. } => Some(*block_size),
        _ => None,
    })
}

/// Uncached prompt tokens the engine reported (finished requests' usage), read from the
/// backend's own counters: work that must have stored blocks, so events must follow.
struct WorkMeter {
    prompt: u64,
    cached: u64,
}

impl WorkMeter {
    fn new(backend: &Backend) -> Self {
        WorkMeter {
            prompt: backend.metrics.prompt_tokens.get(),
            cached: backend.metrics.reported_cached.get(),
        }
    }

    /// Uncached tokens reported since the last call.
    fn take(&mut self, backend: &Backend) -> u64 {
        let (prompt, cached) = (
            backend.metrics.prompt_tokens.get(),
            backend.metrics.reported_cached.get(),
        );
        let work = (prompt - self.prompt).saturating_sub(cached - self.cached);
        (self.prompt, self.cached) = (prompt, cached);
        work
    }
}

/// Subscribes to one backend's KV events until it leaves the fleet.
pub async fn run(gw: Arc<Gateway>, backend: Arc<Backend>, endpoint: String) {
    let mut trust = Trust {
        health: StreamHealth::new(
            gw.settings.kv_events_silence.as_secs_f64(),
            gw.settings.kv_events_probation.as_secs_f64(),
            gw.now(),
        ),
        gw: &gw,
        backend: &backend,
        replay: backend.spec.kv_events_replay.as_deref(),
        replay_paused_until: f64::NEG_INFINITY,
    };
    let mut backoff = Duration::from_millis(100);
    while !backend.is_removed() {
        trust.lose(None);
        let mut socket = zeromq::SubSocket::new();
        let mut monitor = socket.monitor();
        let connected = async {
            socket.subscribe("").await?;
            socket.connect(&endpoint).await
        };
        match tokio::time::timeout(gw.settings.probe_timeout.max(TICK), connected).await {
            Ok(Ok(())) => backoff = Duration::from_millis(100),
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "connect timed out".into(),
                };
                tracing::debug!(backend = backend.name(), %endpoint, "KV events: subscribe failed: {why}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        }
        tracing::debug!(backend = backend.name(), %endpoint, "KV events subscribed");
        let mut work = WorkMeter::new(&backend);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let trouble = loop {
            tokio::select! {
                message = socket.recv() => match message {
                    Ok(m) => trust.message(&m.into_vec()).await,
                    Err(e) => break Trouble::Disconnected(e.to_string()),
                },
                Some(event) = futures_util::StreamExt::next(&mut monitor) => {
                    if let SocketEvent::Disconnected(_) = event {
                        break Trouble::Disconnected("the publisher went away".into());
                    }
                }
                _ = tick.tick() => {
                    if backend.is_removed() {
                        return;
                    }
                    if let Err(trouble) = trust.tick(&mut work) {
                        break trouble;
                    }
                }
            }
        };
        // Silence was counted when the tick found it.
        if !matches!(trouble, Trouble::Silent(_)) {
            trust.lose(Some(&trouble));
        }
        // Dropping the socket closes it; the next one starts over after a pause.
        drop(socket);
        tokio::time::sleep(backoff).await;
    }
}
