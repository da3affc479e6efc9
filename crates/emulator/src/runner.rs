//! The task that owns the engine model and runs it in scaled real time.
//!
//! One dedicated OS thread owns the [`Engine`]. HTTP handlers talk to it over
//! an unbounded command channel (so a dropped request can abort from `Drop`).
//! The loop waits on the channel until the wall-clock instant of the
//! engine's next event (virtual time = `speed` × elapsed wall time), wakes
//! early when a command arrives, advances the engine to the current virtual
//! time and fans the per-request events out to each request's channel. A
//! request whose receiver is gone (client disconnected) is aborted in the
//! engine.
//!
//! A thread rather than a tokio task because tokio's timer has millisecond
//! granularity, which alone would add ~0.5 ms of error to every step; a
//! channel wait with a timeout wakes within tens of microseconds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use std::sync::mpsc as std_mpsc;
use std::time::Instant;
use switchyard_engine::{
    Engine, EngineEvent, EngineMetrics, EngineRequest, KvEvent, RequestId, RequestMode,
};

use tokio::sync::{mpsc, oneshot};

use crate::kv_events::KvEventPublisher;
use crate::metrics::Metrics;

/// Maps virtual engine time onto the wall clock.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
    speed: f64,
}

/// Waits longer than this end with a short spin for precise wake-ups.
const SPIN_THRESHOLD: Duration = Duration::from_micros(400);
/// How much of such a wait is spun rather than slept.
const SPIN_WINDOW: Duration = Duration::from_micros(250);

/// The longest single sleep; keeps far-future event times from overflowing.
const MAX_SLEEP: Duration = Duration::from_secs(3600);

impl Clock {
    /// A clock starting now, running `speed` times faster than real time.
    pub fn new(speed: f64) -> Self {
        let speed = if speed.is_finite() && speed > 0.0 {
            speed
        } else {
            1.0
        };
        Self {
            start: Instant::now(),
            speed,
        }
    }

    /// Current virtual time in seconds.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * self.speed
    }

    /// The speed factor.
    pub fn speed(&self) -> f64 {
        self.speed
    }

    /// Wall-clock time from now until virtual time `t` (zero if past, capped).
    pub fn wait_until(&self, t: f64) -> Duration {
        let wall = (t / self.speed - self.start.elapsed().as_secs_f64()).max(0.0);
        Duration::try_from_secs_f64(wall)
            .unwrap_or(MAX_SLEEP)
            .min(MAX_SLEEP)
    }
}

/// A message to the engine task.
#[derive(Debug)]
pub enum Command {
    /// Submit a request; events for it go to `events`.
    Submit {
        /// The request (its id already allocated).
        req: EngineRequest,
        /// Where its events are delivered.
        events: mpsc::UnboundedSender<EngineEvent>,
        /// Accepted, or the engine's refusal.
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Abort a request (client gone).
    Abort {
        /// The request to abort.
        id: RequestId,
    },
    /// Ask for a metrics snapshot at the current virtual time.
    Metrics {
        /// The snapshot.
        reply: oneshot::Sender<EngineMetrics>,
    },
    /// Make an adapter known, optionally loading it into a slot now.
    RegisterAdapter {
        /// Adapter name.
        name: String,
        /// Start loading it now (vLLM's `/v1/load_lora_adapter` does).
        preload: bool,
        /// Done.
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Unload an adapter.
    UnloadAdapter {
        /// Adapter name.
        name: String,
        /// Done, or the engine's refusal.
        reply: oneshot::Sender<Result<(), String>>,
    },
}

/// Cheap, clonable handle to the engine task.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: std_mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    clock: Clock,
}

/// Failure talking to the engine task.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RunnerError {
    /// The engine task has stopped.
    #[error("engine task is not running")]
    Gone,
    /// The engine refused the operation.
    #[error("{0}")]
    Refused(String),
}

/// A submitted request: its events, aborting the request when dropped early.
#[derive(Debug)]
pub struct Submission {
    /// The engine request id.
    pub id: RequestId,
    /// Events for this request, ending with `Finished`.
    pub events: mpsc::UnboundedReceiver<EngineEvent>,
    guard: AbortGuard,
}

impl Submission {
    /// Mark the request as finished so dropping it does not abort.
    pub fn disarm(&mut self) {
        self.guard.armed = false;
    }
}

/// Sends an abort for the request when dropped while still armed.
#[derive(Debug)]
struct AbortGuard {
    id: RequestId,
    tx: std_mpsc::Sender<Command>,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            // If the engine task is gone there is nothing left to abort.
            let _ = self.tx.send(Command::Abort { id: self.id });
        }
    }
}

impl EngineHandle {
    /// Current virtual time.
    pub fn now(&self) -> f64 {
        self.clock.now()
    }

    /// The clock.
    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// Allocate a fresh request id.
    pub fn next_id(&self) -> RequestId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Submit a request and get its event stream.
    pub async fn submit(
        &self,
        prompt_tokens: Arc<[u32]>,
        max_tokens: u32,
        adapter: Option<String>,
        mode: RequestMode,
    ) -> Result<Submission, RunnerError> {
        let id = self.next_id();
        let (etx, erx) = mpsc::unbounded_channel();
        let (rtx, rrx) = oneshot::channel();
        let req = EngineRequest {
            id,
            prompt_tokens,
            max_tokens,
            adapter,
            mode,
        };
        self.tx
            .send(Command::Submit {
                req,
                events: etx,
                reply: rtx,
            })
            .map_err(|_| RunnerError::Gone)?;
        match rrx.await {
            Ok(Ok(())) => Ok(Submission {
                id,
                events: erx,
                guard: AbortGuard {
                    id,
                    tx: self.tx.clone(),
                    armed: true,
                },
            }),
            Ok(Err(msg)) => Err(RunnerError::Refused(msg)),
            Err(_) => Err(RunnerError::Gone),
        }
    }

    /// A metrics snapshot.
    pub async fn metrics(&self) -> Result<EngineMetrics, RunnerError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::Metrics { reply: tx })
            .map_err(|_| RunnerError::Gone)?;
        rx.await.map_err(|_| RunnerError::Gone)
    }

    /// Make an adapter known (and start loading it when `preload`).
    pub async fn register_adapter(&self, name: &str, preload: bool) -> Result<(), RunnerError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::RegisterAdapter {
                name: name.to_string(),
                preload,
                reply: tx,
            })
            .map_err(|_| RunnerError::Gone)?;
        rx.await
            .map_err(|_| RunnerError::Gone)?
            .map_err(RunnerError::Refused)
    }

    /// Unload an adapter.
    pub async fn unload_adapter(&self, name: &str) -> Result<(), RunnerError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::UnloadAdapter {
                name: name.to_string(),
                reply: tx,
            })
            .map_err(|_| RunnerError::Gone)?;
        rx.await
            .map_err(|_| RunnerError::Gone)?
            .map_err(RunnerError::Refused)
    }
}

/// Per-request bookkeeping for latency histograms.
#[derive(Debug)]
struct Tracked {
    tx: mpsc::UnboundedSender<EngineEvent>,
    arrival: f64,
    last_token: Option<f64>,
}

/// The engine task's state.
struct Runner {
    engine: Engine,
    clock: Clock,
    requests: HashMap<RequestId, Tracked>,
    metrics: Arc<Metrics>,
    kv: Option<KvEventPublisher>,
    out: Vec<EngineEvent>,
    kv_buf: Vec<KvEvent>,
}

/// Start the engine thread.
pub fn spawn(
    engine: Engine,
    speed: f64,
    metrics: Arc<Metrics>,
    kv: Option<KvEventPublisher>,
) -> std::io::Result<EngineHandle> {
    let (tx, rx) = std_mpsc::channel();
    let clock = Clock::new(speed);
    let runner = Runner {
        engine,
        clock,
        requests: HashMap::new(),
        metrics,
        kv,
        out: Vec::new(),
        kv_buf: Vec::new(),
    };
    std::thread::Builder::new()
        .name("engine".to_string())
        .spawn(move || runner.run(rx))?;
    Ok(EngineHandle {
        tx,
        next_id: Arc::new(AtomicU64::new(1)),
        clock,
    })
}

impl Runner {
    fn run(mut self, rx: std_mpsc::Receiver<Command>) {
        loop {
            let next = self.engine.next_event_time();
            let cmd = match next {
                Some(t) => {
                    let wait = self.clock.wait_until(t);
                    // Sleep short of the deadline and spin the rest: a timed
                    // wait wakes tens of microseconds late, which would add
                    // up over a stream of short steps. Only long waits spin,
                    // so a high --speed never busy-loops.
                    let (sleep, spin) = if wait > SPIN_THRESHOLD {
                        (wait - SPIN_WINDOW, true)
                    } else {
                        (wait, false)
                    };
                    match rx.recv_timeout(sleep) {
                        Ok(cmd) => Some(cmd),
                        Err(std_mpsc::RecvTimeoutError::Timeout) if spin => self.spin_until(t, &rx),
                        Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                        Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                }
                None => match rx.recv() {
                    Ok(cmd) => Some(cmd),
                    Err(_) => break,
                },
            };
            if let Some(cmd) = cmd {
                self.handle(cmd);
                // Take everything else already queued before sleeping again.
                while let Ok(cmd) = rx.try_recv() {
                    self.handle(cmd);
                }
            }
            self.advance();
        }
        tracing::debug!("engine thread stopped");
    }

    /// Busy-wait until virtual time `t`, returning early with a command.
    fn spin_until(&self, t: f64, rx: &std_mpsc::Receiver<Command>) -> Option<Command> {
        while self.clock.now() < t {
            if let Ok(cmd) = rx.try_recv() {
                return Some(cmd);
            }
            std::hint::spin_loop();
        }
        None
    }

    /// Run the engine up to the current virtual time and deliver events.
    fn advance(&mut self) {
        let now = self.clock.now();
        self.engine.advance(now, &mut self.out);
        let events = std::mem::take(&mut self.out);
        for ev in events {
            self.deliver(ev);
        }
        self.flush_kv();
    }

    fn flush_kv(&mut self) {
        self.engine.drain_kv_events(&mut self.kv_buf);
        if self.kv_buf.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.kv_buf);
        if let Some(kv) = &self.kv {
            kv.publish(batch);
        }
    }

    fn deliver(&mut self, ev: EngineEvent) {
        let id = event_id(&ev);
        let Some(t) = self.requests.get_mut(&id) else {
            return;
        };
        let mut finished = false;
        match &ev {
            EngineEvent::FirstToken {
                time,
                prompt_tokens,
                cached_tokens,
                ..
            } => {
                let ttft = time - t.arrival;
                self.metrics.observe_ttft(ttft);
                // The engine reports no "scheduled" moment, so TTFT is split
                // into prefill and queueing with the profile's estimate of
                // this prefill alone on the engine: prefill = min(TTFT,
                // isolated prefill time), queue = the rest.
                let cfg = self.engine.config();
                let prefill = cfg
                    .profile
                    .isolated_prefill_time(
                        u64::from(*prompt_tokens),
                        u64::from(*cached_tokens),
                        u64::from(cfg.max_num_batched_tokens),
                    )
                    .min(ttft)
                    .max(0.0);
                self.metrics.observe_prefill(prefill);
                self.metrics.observe_queue(ttft - prefill);
                t.last_token = Some(*time);
            }
            EngineEvent::Tokens { time, tokens, .. } => {
                if let Some(prev) = t.last_token {
                    if *time > prev && !tokens.is_empty() {
                        // One step produced `tokens.len()` tokens; vLLM
                        // observes the gap once per generated token.
                        let gap = (time - prev) / tokens.len() as f64;
                        for _ in 0..tokens.len() {
                            self.metrics.observe_itl(gap);
                        }
                    }
                }
                t.last_token = Some(*time);
            }
            EngineEvent::Finished { time, .. } => {
                self.metrics.observe_e2e(time - t.arrival);
                finished = true;
            }
            EngineEvent::Preempted { .. } => {}
        }
        let gone = t.tx.send(ev).is_err();
        if finished {
            self.requests.remove(&id);
        } else if gone {
            let now = self.clock.now();
            self.engine.abort(id, now);
            self.requests.remove(&id);
        }
    }

    fn handle(&mut self, cmd: Command) {
        // Bring the engine up to date first so the command sees the present.
        self.advance();
        let now = self.clock.now();
        match cmd {
            Command::Submit { req, events, reply } => {
                let id = req.id;
                match self.engine.submit(req, now) {
                    Ok(()) => {
                        self.requests.insert(
                            id,
                            Tracked {
                                tx: events,
                                arrival: now,
                                last_token: None,
                            },
                        );
                        let _ = reply.send(Ok(()));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e.to_string()));
                    }
                }
            }
            Command::Abort { id } => {
                if self.requests.remove(&id).is_some() {
                    self.engine.abort(id, now);
                }
            }
            Command::Metrics { reply } => {
                let _ = reply.send(self.engine.metrics());
            }
            Command::RegisterAdapter {
                name,
                preload,
                reply,
            } => {
                self.engine.register_adapter(&name);
                if preload {
                    // All slots busy is not an error for registration: the
                    // adapter is then loaded on demand, as in vLLM.
                    if let Err(e) = self.engine.load_adapter(&name, now) {
                        tracing::debug!("adapter {name} not preloaded: {e}");
                    }
                }
                let _ = reply.send(Ok(()));
            }
            Command::UnloadAdapter { name, reply } => {
                let r = self.engine.unload_adapter(&name).map_err(|e| e.to_string());
                let _ = reply.send(r);
            }
        }
        self.flush_kv();
    }
}

/// The request an event belongs to.
pub fn event_id(ev: &EngineEvent) -> RequestId {
    match ev {
        EngineEvent::FirstToken { id, .. }
        | EngineEvent::Tokens { id, .. }
        | EngineEvent::Finished { id, .. }
        | EngineEvent::Preempted { id, .. } => *id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_scales_time() {
        let c = Clock::new(10.0);
        std::thread::sleep(Duration::from_millis(20));
        let now = c.now();
        assert!((0.2..2.0).contains(&now), "{now}");
        let wait = c.wait_until(now + 1.0).as_secs_f64();
        assert!(wait > 0.05 && wait <= 0.1, "{wait}");
        assert_eq!(c.wait_until(0.0), Duration::ZERO);
    }

    #[test]
    fn clock_rejects_bad_speed() {
        assert_eq!(Clock::new(0.0).speed(), 1.0);
        assert_eq!(Clock::new(f64::NAN).speed(), 1.0);
    }

    #[test]
    fn far_future_is_capped() {
        let c = Clock::new(1.0);
        assert_eq!(c.wait_until(1e300), MAX_SLEEP);
        assert_eq!(c.wait_until(f64::INFINITY), MAX_SLEEP);
    }
}
