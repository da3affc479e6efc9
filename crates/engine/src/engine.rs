//! The engine: the public face of the model, driving the scheduler through
//! virtual time.
//!
//! Timing rules:
//! * A step's composition is decided when it starts; requests submitted
//!   while a step is being computed join at its end.
//! * An idle engine that receives a request starts a step at the submission
//!   time. The start is a *wake-up*: `next_event_time` reports it and the
//!   caller's `advance` composes the step, so every request submitted at
//!   the same instant joins the same first step.
//! * Steps complete in `advance`; all events of a step carry its end time
//!   (`Preempted` carries its start time).
//! * Callers must `advance(now)` before `submit`/`abort`/adapter calls at
//!   `now`; a call that arrives late is applied at the engine's current step.

use crate::config::{ConfigError, EngineConfig};
use crate::events::{EngineEvent, KvEvent};
use crate::fast_forward::Run;
use crate::lora::AdapterError;
use crate::metrics::EngineMetrics;
use crate::request::{EngineRequest, RequestId, SubmitError};
use crate::scheduler::Scheduler;

/// What the GPU is computing.
#[derive(Debug)]
enum InFlight {
    /// One composed step (`Scheduler::plan`) ending at `end`.
    Step { end: f64 },
    /// A fast-forwarded stretch of pure-decode steps.
    Run(Run),
}

/// A model of one vLLM-like inference engine in virtual time.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    sched: Scheduler,
    inflight: Option<InFlight>,
    /// When an idle engine next has something to do (compose a step).
    wake: Option<f64>,
    /// Latest step boundary processed.
    clock: f64,
    /// The GPU is busy loading adapters until then.
    gpu_free_at: f64,
    /// Events produced outside `advance` (aborts), delivered by the next `advance`.
    pending: Vec<EngineEvent>,
    /// Debug switch: never fast-forward.
    step_by_step: bool,
    /// Each step takes this many times its profile time: the compute is shared with other
    /// engines ([`Engine::set_slowdown`]).
    slowdown: f64,
}

impl Engine {
    /// Build an engine, rejecting nonsensical configurations.
    pub fn new(config: EngineConfig) -> Result<Engine, ConfigError> {
        config.validate()?;
        Ok(Engine {
            sched: Scheduler::new(&config),
            cfg: config,
            inflight: None,
            wake: None,
            clock: 0.0,
            gpu_free_at: f64::NEG_INFINITY,
            pending: Vec::new(),
            step_by_step: false,
            slowdown: 1.0,
        })
    }

    /// The configuration the engine was built with.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Debug/testing switch: compute every step individually (no fast-forward).
    ///
    /// Results are the same either way (up to float rounding of times and
    /// the physical block ids chosen); only the cost differs.
    pub fn set_step_by_step(&mut self, on: bool) {
        self.step_by_step = on;
    }

    /// Shares the engine's compute with others: every step composed from now on takes `factor`
    /// times its profile time (1, the default: a device of its own). While above 1 steps are
    /// composed one by one, so a later change applies from the next step. Values below 1 or not
    /// finite are taken as 1.
    pub fn set_slowdown(&mut self, factor: f64) {
        self.slowdown = if factor.is_finite() {
            factor.max(1.0)
        } else {
            1.0
        };
    }

    /// Enqueue a request arriving at `now`.
    pub fn submit(&mut self, req: EngineRequest, now: f64) -> Result<(), SubmitError> {
        let now = self.sanitize(now);
        self.sched.add(req)?;
        self.interrupt(now);
        if self.inflight.is_none() {
            let w = now.max(self.clock);
            self.wake = Some(self.wake.map_or(w, |x| x.min(w)));
        }
        Ok(())
    }

    /// Abort a request; its `Finished { reason: Abort }` comes out of the next `advance`.
    pub fn abort(&mut self, id: RequestId, now: f64) -> bool {
        if !self.sched.contains(id) {
            return false;
        }
        let now = self.sanitize(now);
        self.interrupt(now);
        self.sched.abort(id, now, &mut self.pending)
    }

    /// When `advance` next has something to do: the in-flight step (or
    /// fast-forwarded stretch) completes, or an idle engine wakes up to
    /// start a step (after a submission, an adapter load or a KV transfer).
    /// `None` when there is nothing to do.
    pub fn next_event_time(&self) -> Option<f64> {
        if let Some(t) = self.pending.iter().map(EngineEvent::time).reduce(f64::min) {
            return Some(t);
        }
        match &self.inflight {
            Some(InFlight::Step { end }) => Some(*end),
            Some(InFlight::Run(r)) => Some(r.end(&self.cfg.profile)),
            None => self.wake,
        }
    }

    /// Run everything that completes at or before `until`, appending its events to `out`.
    pub fn advance(&mut self, until: f64, out: &mut Vec<EngineEvent>) {
        if until.is_nan() {
            return;
        }
        out.append(&mut self.pending);
        loop {
            match self.inflight.take() {
                Some(InFlight::Step { end }) if end <= until => {
                    self.clock = self.clock.max(end);
                    self.sched.apply_plan(end, out);
                    self.start_next(end, out);
                }
                Some(InFlight::Run(mut r)) => {
                    let profile = &self.cfg.profile;
                    let end = r.end(profile);
                    if end <= until {
                        self.clock = self.clock.max(end);
                        let steps = r.steps;
                        r.apply(&mut self.sched, profile, steps, true, end, out);
                        r.recycle(&mut self.sched);
                        self.start_next(end, out);
                    } else {
                        // Bring counters and blocks up to `until` so metrics are current.
                        let j = r.steps_done_by(profile, until, false);
                        if j > 0 {
                            let t = r.start + r.cum(profile, j);
                            r.apply(&mut self.sched, profile, j, false, t, out);
                            self.clock = self.clock.max(t);
                        }
                        self.inflight = Some(InFlight::Run(r));
                        break;
                    }
                }
                Some(step) => {
                    self.inflight = Some(step);
                    break;
                }
                None => match self.wake {
                    Some(w) if w <= until => {
                        self.wake = None;
                        self.clock = self.clock.max(w);
                        self.start_next(w, out);
                    }
                    _ => break,
                },
            }
        }
    }

    /// Compose the step starting at `t`, or go idle until the next wake-up.
    fn start_next(&mut self, t: f64, out: &mut Vec<EngineEvent>) {
        self.wake = None;
        if self.gpu_free_at > t {
            self.wake = Some(self.gpu_free_at);
            return;
        }
        let profile = &self.cfg.profile;
        // A step that only preempted is retried at once (vLLM would run an
        // empty schedule and reschedule); the retry cannot preempt again
        // since it starts with an emptier running batch.
        for _ in 0..2 {
            self.sched.compose(t, profile, out);
            if !self.sched.plan.items.is_empty() {
                let fast =
                    !self.step_by_step && !self.cfg.emit_token_events && self.slowdown == 1.0;
                self.inflight = Some(
                    match fast.then(|| Run::try_start(&mut self.sched, t, profile)) {
                        Some(Some(run)) => InFlight::Run(run),
                        _ => InFlight::Step {
                            end: t + self.sched.plan.time * self.slowdown,
                        },
                    },
                );
                return;
            }
            if !self.sched.plan.preempted {
                break;
            }
        }
        // Nothing runnable now: wait for a KV transfer to land.
        self.wake = self.sched.next_transfer_ready();
    }

    /// The caller is about to change what later steps would do: apply the
    /// fast-forwarded steps completed by `now` and cut the run to the step
    /// in flight, whose end becomes the next composition point.
    fn interrupt(&mut self, now: f64) {
        if let Some(InFlight::Run(r)) = &mut self.inflight {
            let profile = &self.cfg.profile;
            // A step ending exactly at `now` stays in flight: as in
            // step-by-step mode, the caller's change applies after it.
            let j = r.steps_done_by(profile, now, true);
            if j > 0 {
                let t = r.start + r.cum(profile, j);
                // No member finishes before the run's last step, so no events.
                let mut sink = Vec::new();
                r.apply(&mut self.sched, profile, j, false, t, &mut sink);
                debug_assert!(sink.is_empty());
                self.clock = self.clock.max(t);
            }
            r.steps = 1;
        }
    }

    /// A snapshot of gauges and counters (as of the last `advance`).
    pub fn metrics(&self) -> EngineMetrics {
        let s = &self.sched;
        let total = s.cache.num_blocks();
        EngineMetrics {
            num_requests_running: s.running.len() as u32,
            num_requests_waiting: s.waiting.len() as u32,
            kv_cache_usage: f64::from(s.cache.num_used()) / f64::from(total.max(1)),
            prefix_cache_queries: s.counters.prefix_queries,
            prefix_cache_hits: s.counters.prefix_hits,
            num_preemptions: s.counters.preemptions,
            prompt_tokens_total: s.counters.prompt_tokens,
            generation_tokens_total: s.counters.generation_tokens,
            running_lora_adapters: s.loras.running(),
            waiting_lora_adapters: s.loras.waiting(),
            resident_lora_adapters: s.loras.resident(),
            max_loras: s.loras.max_loras(),
            num_gpu_blocks: total,
            block_size: s.cache.block_size(),
        }
    }

    /// Move buffered KV cache events (with `emit_kv_events`) to `out`.
    pub fn drain_kv_events(&mut self, out: &mut Vec<KvEvent>) {
        self.sched.cache.drain_events(out);
    }

    /// Make an adapter known so requests may use it; it is loaded on demand.
    pub fn register_adapter(&mut self, name: &str) {
        self.sched.loras.register(name);
    }

    /// Register an adapter and load it into a slot now (evicting the least
    /// recently used idle one); the GPU spends `lora_load_time_s` on it
    /// before its next step. Loading a resident adapter is a no-op.
    pub fn load_adapter(&mut self, name: &str, now: f64) -> Result<(), AdapterError> {
        let now = self.sanitize(now);
        self.interrupt(now);
        if self.sched.loras.load(name)? {
            let busy_from = match &self.inflight {
                Some(InFlight::Step { end }) => *end,
                Some(InFlight::Run(r)) => r.end(&self.cfg.profile),
                None => now.max(self.clock),
            };
            self.gpu_free_at = self.gpu_free_at.max(busy_from) + self.cfg.lora_load_time_s;
        }
        Ok(())
    }

    /// Unregister an adapter and free its slot; refused while requests use it.
    pub fn unload_adapter(&mut self, name: &str) -> Result<(), AdapterError> {
        self.sched.loras.unload(name)?;
        // A freed slot may let a waiting request in at the next step.
        if let Some(InFlight::Run(r)) = &mut self.inflight {
            r.steps = 1;
        }
        Ok(())
    }

    /// Registered adapter names, sorted.
    pub fn known_adapters(&self) -> Vec<String> {
        self.sched.loras.known()
    }

    /// Drop the whole prefix cache (vLLM's `/reset_prefix_cache`); refused
    /// (false) while any request holds blocks. Emits `AllBlocksCleared`.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.sched.cache.reset()
    }

    /// Requests submitted and not yet finished or aborted.
    pub fn num_live_requests(&self) -> usize {
        self.sched.num_live()
    }

    /// Latest virtual time the engine has processed (a step boundary or wake-up).
    pub fn clock(&self) -> f64 {
        self.clock
    }

    /// Self-check of the internal bookkeeping (queues, block reference
    /// counts, free queue, prefix-cache map); for tests and debugging, O(blocks).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.sched.check()
    }

    fn sanitize(&self, now: f64) -> f64 {
        if now.is_finite() {
            now
        } else {
            self.clock
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{drive, find, req, small_config, Act};
    use crate::{tokenizer, FinishReason, KvTransfer, RequestMode, Role};

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    fn lora_engine() -> Engine {
        let mut e = Engine::new(EngineConfig {
            max_loras: 1,
            lora_load_time_s: 0.5,
            ..small_config()
        })
        .unwrap();
        e.register_adapter("a");
        e.register_adapter("b");
        e
    }

    fn with(adapter: &str, r: EngineRequest) -> EngineRequest {
        EngineRequest {
            adapter: Some(adapter.into()),
            ..r
        }
    }

    #[test]
    fn lora_requests_wait_for_a_slot_and_pay_the_load() {
        let mut e = lora_engine();
        let p = e.config().profile.clone();
        e.submit(with("a", req(1, 1, 100, 20)), 0.0).unwrap();
        e.submit(with("b", req(2, 2, 100, 2)), 0.0).unwrap();
        let mut out = Vec::new();
        e.advance(0.0, &mut out);
        let m = e.metrics();
        assert_eq!(m.running_lora_adapters, vec!["a"]);
        assert_eq!(m.waiting_lora_adapters, vec!["b"]);
        assert_eq!(m.resident_lora_adapters, vec!["a"]);
        let ev = drive(&mut e, vec![]);
        let first1 = find(&ev, 1, "first").time();
        assert!(close(first1, p.step_base_s + p.chunk_time(0, 100) + 0.5));
        let fin1 = find(&ev, 1, "finished").time();
        let first2 = find(&ev, 2, "first").time();
        assert!(close(
            first2,
            fin1 + p.step_base_s + p.chunk_time(0, 100) + 0.5
        ));
        assert_eq!(e.metrics().resident_lora_adapters, vec!["b"]);
        // A resident adapter costs nothing to use.
        let t0 = e.clock() + 1.0;
        let ev = drive(
            &mut e,
            vec![(t0, Act::Submit(with("b", req(3, 3, 100, 1))))],
        );
        assert!(close(
            find(&ev, 3, "first").time(),
            t0 + p.step_base_s + p.chunk_time(0, 100)
        ));
    }

    #[test]
    fn explicit_load_blocks_the_gpu_and_unload_checks_use() {
        let mut e = lora_engine();
        let p = e.config().profile.clone();
        e.load_adapter("a", 1.0).unwrap();
        assert_eq!(e.metrics().resident_lora_adapters, vec!["a"]);
        let ev = drive(&mut e, vec![(1.0, Act::Submit(req(1, 1, 100, 1)))]);
        assert!(close(
            find(&ev, 1, "first").time(),
            1.5 + p.step_base_s + p.chunk_time(0, 100)
        ));
        e.submit(with("a", req(2, 2, 10, 50)), 5.0).unwrap();
        assert_eq!(e.unload_adapter("a"), Err(AdapterError::Busy("a".into())));
        assert_eq!(
            e.unload_adapter("zz"),
            Err(AdapterError::Unknown("zz".into()))
        );
        // Loading "b" while "a" runs has no free slot.
        let mut out = Vec::new();
        e.advance(5.0, &mut out);
        assert_eq!(
            e.load_adapter("b", 5.0),
            Err(AdapterError::NoFreeSlot("b".into()))
        );
        drive(&mut e, vec![]);
        e.unload_adapter("a").unwrap();
        assert_eq!(e.known_adapters(), vec!["b"]);
        assert_eq!(
            e.submit(with("a", req(3, 3, 10, 1)), 9.0),
            Err(SubmitError::UnknownAdapter("a".into()))
        );
    }

    #[test]
    fn a_shared_engine_takes_longer_for_every_step() {
        let p = small_config().profile;
        let first_and_end = |factor: f64| {
            let mut e = Engine::new(small_config()).unwrap();
            e.set_slowdown(factor);
            let ev = drive(&mut e, vec![(0.0, Act::Submit(req(1, 1, 100, 20)))]);
            (
                find(&ev, 1, "first").time(),
                find(&ev, 1, "finished").time(),
            )
        };
        let (first, end) = first_and_end(1.0);
        assert!(close(first, p.step_base_s + p.chunk_time(0, 100)));
        // Twice the time for every step: the prefill's and each decode step's.
        let (first2, end2) = first_and_end(2.0);
        assert!(close(first2, 2.0 * first), "{first2} vs {first}");
        assert!(close(end2, 2.0 * end), "{end2} vs {end}");
        // Nonsense leaves the engine a device of its own.
        assert_eq!(first_and_end(f64::NAN), (first, end));
        assert_eq!(first_and_end(0.5), (first, end));
    }

    #[test]
    fn prefill_role_returns_a_kv_transfer() {
        let mut e = Engine::new(EngineConfig {
            role: Role::Prefill,
            engine_id: "p0".into(),
            ..small_config()
        })
        .unwrap();
        let p = e.config().profile.clone();
        assert!(matches!(
            e.submit(req(9, 1, 10, 5), 0.0),
            Err(SubmitError::WrongRole { .. })
        ));
        let r = EngineRequest {
            mode: RequestMode::PrefillOnly,
            ..req(1, 1, 100, 500)
        };
        let ev = drive(&mut e, vec![(0.0, Act::Submit(r))]);
        let t = p.step_base_s + p.chunk_time(0, 100);
        assert!(close(find(&ev, 1, "first").time(), t));
        match find(&ev, 1, "finished") {
            EngineEvent::Finished {
                time,
                completion_tokens,
                reason,
                kv_transfer: Some(kv),
                ..
            } => {
                assert!(close(*time, t));
                assert_eq!((*completion_tokens, *reason), (1, FinishReason::Length));
                assert_eq!(kv.remote_engine_id, "p0");
                assert_eq!(kv.remote_request_id, "1");
                assert_eq!(kv.num_tokens, 100);
                assert_eq!(kv.remote_block_ids.len(), 7);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn decode_role_pays_transfer_instead_of_prefill() {
        let cfg = EngineConfig {
            role: Role::Decode,
            kv_bytes_per_token: 1000.0,
            kv_transfer_bandwidth_bytes_per_s: 1e6,
            ..small_config()
        };
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        let kv = KvTransfer {
            remote_engine_id: "p0".into(),
            remote_block_ids: vec![0, 1, 2, 3, 4, 5, 6],
            remote_request_id: "1".into(),
            num_tokens: 100,
        };
        assert!(matches!(
            e.submit(
                EngineRequest {
                    mode: RequestMode::PrefillOnly,
                    ..req(9, 1, 10, 1)
                },
                0.0
            ),
            Err(SubmitError::WrongRole { .. })
        ));
        let r = EngineRequest {
            mode: RequestMode::DecodeAfterTransfer(kv),
            ..req(1, 1, 100, 3)
        };
        let ev = drive(&mut e, vec![(2.0, Act::Submit(r))]);
        // 99 tokens × 1000 B at 1 MB/s, then one step computing the last prompt token.
        let t1 = 2.0 + 0.099 + p.step_base_s + p.decode_token_time(100);
        match find(&ev, 1, "first") {
            EngineEvent::FirstToken {
                time,
                cached_tokens,
                ..
            } => {
                assert!(close(*time, t1), "{time} vs {t1}");
                assert_eq!(*cached_tokens, 99);
            }
            _ => unreachable!(),
        }
        match find(&ev, 1, "finished") {
            EngineEvent::Finished {
                completion_tokens, ..
            } => assert_eq!(*completion_tokens, 3),
            _ => unreachable!(),
        }
    }

    #[test]
    fn decode_role_runs_a_plain_request_whole() {
        let cfg = EngineConfig {
            role: Role::Decode,
            ..small_config()
        };
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        let ev = drive(&mut e, vec![(1.0, Act::Submit(req(1, 1, 100, 3)))]);
        // Prefilled locally: no transfer, nothing cached.
        let t = 1.0 + p.step_base_s + p.chunk_time(0, 100);
        match find(&ev, 1, "first") {
            EngineEvent::FirstToken {
                time,
                cached_tokens,
                ..
            } => {
                assert!(close(*time, t), "{time} vs {t}");
                assert_eq!(*cached_tokens, 0);
            }
            _ => unreachable!(),
        }
        match find(&ev, 1, "finished") {
            EngineEvent::Finished {
                completion_tokens,
                kv_transfer,
                ..
            } => {
                assert_eq!(*completion_tokens, 3);
                assert!(kv_transfer.is_none());
            }
            _ => unreachable!(),
        }
    }

    #[test]
    fn decode_side_transfers_only_what_it_does_not_cache() {
        let cfg = EngineConfig {
            kv_bytes_per_token: 1000.0,
            kv_transfer_bandwidth_bytes_per_s: 1e6,
            ..small_config()
        };
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        let kv = KvTransfer {
            remote_engine_id: "p0".into(),
            remote_block_ids: vec![],
            remote_request_id: "x".into(),
            num_tokens: 100,
        };
        let r = EngineRequest {
            mode: RequestMode::DecodeAfterTransfer(kv),
            ..req(2, 5, 100, 1)
        };
        // Request 1 caches the first 96 tokens locally.
        let ev = drive(
            &mut e,
            vec![(0.0, Act::Submit(req(1, 5, 100, 1))), (5.0, Act::Submit(r))],
        );
        let t1 = 5.0 + 0.003 + p.step_base_s + p.decode_token_time(100);
        assert!(close(find(&ev, 2, "first").time(), t1));
    }

    #[test]
    fn both_role_accepts_every_mode() {
        let mut e = Engine::new(small_config()).unwrap();
        let kv = KvTransfer {
            remote_engine_id: "p".into(),
            remote_block_ids: vec![],
            remote_request_id: "r".into(),
            num_tokens: 10,
        };
        for (id, mode) in [
            RequestMode::Normal,
            RequestMode::PrefillOnly,
            RequestMode::DecodeAfterTransfer(kv),
        ]
        .into_iter()
        .enumerate()
        {
            e.submit(
                EngineRequest {
                    mode,
                    ..req(id as u64, 1, 20, 2)
                },
                0.0,
            )
            .unwrap();
        }
        let ev = drive(&mut e, vec![]);
        assert_eq!(
            ev.iter()
                .filter(|x| matches!(x, EngineEvent::Finished { .. }))
                .count(),
            3
        );
    }

    #[test]
    fn kv_events_report_stored_and_removed_blocks() {
        let mut e = Engine::new(EngineConfig {
            emit_kv_events: true,
            num_gpu_blocks: 8,
            max_model_len: 128,
            ..small_config()
        })
        .unwrap();
        let r = req(1, 4, 40, 30);
        let prompt = r.prompt_tokens.clone();
        drive(&mut e, vec![(0.0, Act::Submit(r))]);
        let mut kv = Vec::new();
        e.drain_kv_events(&mut kv);
        // 40 + 29 computed tokens = 4 full blocks; the third mixes prompt and output.
        let mut want_tokens: Vec<u32> = prompt[..40].to_vec();
        want_tokens.extend((0..24).map(|k| tokenizer::output_token(1, k)));
        let mut got_tokens = Vec::new();
        let mut hashes = Vec::new();
        let mut prev_last: Option<u64> = None;
        for ev in &kv {
            match ev {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_name,
                } => {
                    assert_eq!(*parent_block_hash, prev_last);
                    assert_eq!(*block_size, 16);
                    assert_eq!(token_ids.len(), 16 * block_hashes.len());
                    assert!(lora_name.is_none());
                    got_tokens.extend_from_slice(token_ids);
                    hashes.extend_from_slice(block_hashes);
                    prev_last = block_hashes.last().copied();
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(got_tokens, want_tokens);
        assert_eq!(hashes.len(), 4);
        // A different 128-token request needs all 8 blocks: the cached ones are evicted.
        drive(&mut e, vec![(10.0, Act::Submit(req(2, 99, 100, 28)))]);
        kv.clear();
        e.drain_kv_events(&mut kv);
        let mut removed: Vec<u64> = kv
            .iter()
            .filter_map(|x| match x {
                KvEvent::BlockRemoved { block_hashes } => Some(block_hashes.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        removed.sort();
        hashes.sort();
        assert_eq!(removed, hashes);
        assert!(e.reset_prefix_cache());
        kv.clear();
        e.drain_kv_events(&mut kv);
        assert_eq!(kv, vec![KvEvent::AllBlocksCleared]);
    }

    #[test]
    fn kv_events_are_not_buffered_when_off() {
        let mut e = Engine::new(small_config()).unwrap();
        drive(&mut e, vec![(0.0, Act::Submit(req(1, 4, 40, 30)))]);
        let mut kv = Vec::new();
        e.drain_kv_events(&mut kv);
        assert!(kv.is_empty());
    }

    #[test]
    fn token_events_stream_each_step() {
        let cfg = EngineConfig {
            emit_token_events: true,
            ..small_config()
        };
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        let ev = drive(&mut e, vec![(0.0, Act::Submit(req(7, 1, 10, 5)))]);
        let toks: Vec<(f64, u32)> = ev
            .iter()
            .filter_map(|x| match x {
                EngineEvent::Tokens { time, tokens, .. } => Some((*time, tokens[0])),
                _ => None,
            })
            .collect();
        assert_eq!(toks.len(), 5);
        let ids: Vec<u32> = toks.iter().map(|x| x.1).collect();
        let want: Vec<u32> = (0..5).map(|k| tokenizer::output_token(7, k)).collect();
        assert_eq!(ids, want);
        assert_eq!(tokenizer::decode_output(&ids).len(), 20);
        for (i, w) in toks.windows(2).enumerate() {
            let gap = w[1].0 - w[0].0;
            let want = p.step_base_s + p.decode_token_time(10 + 1 + i as u64);
            assert!(close(gap, want), "{gap} vs {want}");
        }
        // Order within a step: FirstToken, Tokens, ... Finished last.
        assert!(matches!(ev[0], EngineEvent::FirstToken { .. }));
        assert!(matches!(ev.last(), Some(EngineEvent::Finished { .. })));
    }

    #[test]
    fn metrics_mid_fast_forward_match_step_by_step() {
        let mk = |step| {
            let mut e = Engine::new(small_config()).unwrap();
            e.set_step_by_step(step);
            for id in 0..4 {
                e.submit(req(id, id as u32, 100 + 50 * id as usize, 300), 0.0)
                    .unwrap();
            }
            e
        };
        let (mut a, mut b) = (mk(false), mk(true));
        let (mut oa, mut ob) = (Vec::new(), Vec::new());
        for t in [0.0, 0.3, 0.7, 1.1, 1.9] {
            a.advance(t, &mut oa);
            b.advance(t, &mut ob);
            let (ma, mb) = (a.metrics(), b.metrics());
            assert_eq!(
                ma.generation_tokens_total, mb.generation_tokens_total,
                "at {t}"
            );
            assert_eq!(ma.kv_cache_usage, mb.kv_cache_usage, "at {t}");
            a.check_invariants().unwrap();
        }
        assert_eq!(oa.len(), ob.len());
    }

    #[test]
    fn rejects_bad_config() {
        let err = Engine::new(EngineConfig {
            num_gpu_blocks: 0,
            ..EngineConfig::default()
        })
        .unwrap_err();
        assert_eq!(err, ConfigError::Zero("num_gpu_blocks"));
    }
}
