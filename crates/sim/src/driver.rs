//! The discrete-event loop for one policy: arrivals, engine steps and scrapes in virtual time.
//!
//! Pure and deterministic: the same configuration, workload and seed give the same records.
//! At equal times engine events come first (in instance order), then scrapes, then arrivals, so
//! a request arriving exactly when a step ends sees that step's results.

use std::collections::VecDeque;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rustc_hash::FxHashMap;
use switchyard_core::{
    EngineMetrics as CoreMetrics, InstanceId, KvEvent as CoreKvEvent, Observation, ObserveError,
    Phase, Prediction, RequestId, RouteRequest, Router, RouterConfig, Usage,
};
use switchyard_engine::{
    Engine, EngineEvent, EngineMetrics, EngineRequest, KvEvent, KvTransfer, RequestMode,
};
use switchyard_workload::Request;

use crate::config::{KvEventsSim, SimConfig, Split};
use crate::error::{Result, SimError};
use crate::events::{Event, EventQueue};
use crate::fleet::{self, Member};
use crate::metrics::{InstanceStats, Outcome, RequestRecord, NO_INSTANCE};
use crate::prompt::{encode_request, Pieces};

/// Per instance, the queue length (waiting, running) at each scrape: for the queue chart.
#[derive(Debug, Clone, Default)]
pub struct QueueTrace {
    /// Scrape times per recorded instance.
    pub times: Vec<Vec<f64>>,
    /// Waiting requests at those times.
    pub waiting: Vec<Vec<u32>>,
    /// Running requests at those times.
    pub running: Vec<Vec<u32>>,
}

/// Everything one policy's run produced.
#[derive(Debug, Clone, Default)]
pub struct RunData {
    /// Policy simulated.
    pub policy: String,
    /// One record per request, in arrival order.
    pub records: Vec<RequestRecord>,
    /// Per-instance totals.
    pub instances: Vec<InstanceStats>,
    /// Queue lengths over time of the first instances.
    pub queues: QueueTrace,
    /// Observations the router did not know the request of (expired as stale); should be 0.
    pub unknown_observations: u64,
    /// Prefill speed (tokens/s) the first replica learned per instance by the end.
    pub learned_prefill_tokens_per_s: Vec<f64>,
    /// Relative errors of the routers' TTFT estimates, one per routed request that had one.
    pub ttft_errors: Vec<f64>,
    /// Relative errors of the routers' cached-token predictions, one per finished request.
    pub cached_errors: Vec<f64>,
    /// KV-event batches lost on the way to a replica (summed over replicas).
    pub kv_batches_lost: u64,
    /// Times a replica fell back to the approximate index for an instance after a gap.
    pub kv_fallbacks: u64,
}

/// Router-side id of a request's unified or prefill half.
fn main_id(index: usize) -> RequestId {
    RequestId(2 * index as u64)
}

/// Router-side id of a split request's decode half.
fn decode_id(index: usize) -> RequestId {
    RequestId(2 * index as u64 + 1)
}

/// What a split request needs for its decode half once the prefill hands over.
struct Handoff {
    tokens: Arc<[u32]>,
    max_tokens: u32,
    adapter: Option<String>,
}

/// The state of one run.
struct Sim {
    engines: Vec<Engine>,
    routers: Vec<Router>,
    /// Replicas share decisions and outcomes ([`SimConfig::replica_sync`]), this late.
    replica_sync: bool,
    replica_sync_delay_s: f64,
    /// What the routers are told as every request's `max_tokens` ([`SimConfig::client_max_tokens`]).
    client_max_tokens: Option<u32>,
    /// Messages between replicas on their way, in sending order (one delay for all).
    peer_queue: VecDeque<PeerDelivery>,
    ids: Vec<InstanceId>,
    queue: EventQueue,
    records: Vec<RequestRecord>,
    stats: Vec<InstanceStats>,
    live: Vec<u32>,
    busy_since: Vec<f64>,
    live_total: u64,
    handoffs: FxHashMap<usize, Handoff>,
    /// Decode halves to submit after the current batch of events: (time, request, transfer).
    pending_decodes: Vec<(f64, usize, KvTransfer)>,
    events: Vec<EngineEvent>,
    track_adapters: bool,
    resident: Vec<Vec<String>>,
    known_adapters: Vec<Vec<String>>,
    queues: QueueTrace,
    unknown: u64,
    prediction_scratch: Vec<Prediction>,
    ttft_errors: Vec<f64>,
    cached_errors: Vec<f64>,
    kv: Option<KvDelivery>,
    /// Per replica, the requests that found every candidate saturated (`cost.max_in_flight` /
    /// `max_waiting`), in arrival order, as each gateway's admission line holds them:
    /// (record, request). Only a line's head routes again, after every event that may free
    /// capacity.
    admission: Vec<VecDeque<(usize, Request)>>,
    /// Cores the engines share ([`SimConfig::shared_cores`]), and how many engines have
    /// requests now.
    shared_cores: Option<f64>,
    busy_engines: u32,
}

/// What one router replica tells the others (`--replica-sync`).
enum PeerMessage {
    /// It sent request `index` to `pick` (with the token ids it matched, when it has them).
    Routed {
        request: Request,
        tokens: Option<Arc<[u32]>>,
        index: usize,
        pick: InstanceId,
    },
    /// A first token, an end or a failure of a request it routed.
    Outcome(Observation),
}

/// What a router sees of a workload request (`token_ids`: what a gateway with the model's
/// tokenizer would match; `client_max_tokens`: the limit every client sends instead of the
/// workload's answer length, [`SimConfig::client_max_tokens`]).
fn route_request<'a>(
    request: &'a Request,
    pieces: &'a Pieces<'a>,
    token_ids: Option<&'a [u32]>,
    client_max_tokens: Option<u32>,
) -> RouteRequest<'a> {
    RouteRequest {
        model: &request.model,
        adapter: request.adapter.as_deref(),
        prompt: pieces.router_prompt(),
        max_tokens: client_max_tokens.unwrap_or(request.max_tokens),
        cache_salt: request.cache_salt.as_deref(),
        session_id: request.session_id.as_deref(),
        phase: Phase::Any,
        token_ids,
        kind: Default::default(),
    }
}

/// A message between replicas on its way.
struct PeerDelivery {
    at: f64,
    origin: u16,
    message: PeerMessage,
}

/// One engine's batch of KV events on its way to one replica.
struct KvBatch {
    at: f64,
    replica: u16,
    instance: usize,
    seq: u64,
    events: Arc<[CoreKvEvent]>,
}

/// KV events from the engines to the replicas: a delay, losses, and each replica's view of each
/// stream's health (what the gateway's subscriber does, in virtual time).
struct KvDelivery {
    model: KvEventsSim,
    rng: ChaCha8Rng,
    scratch: Vec<KvEvent>,
    /// Next sequence number per instance.
    next_seq: Vec<u64>,
    /// In flight, in arrival order (one delay for all: publication order is arrival order).
    queue: VecDeque<KvBatch>,
    /// Per replica and instance: the next sequence number expected.
    expected: Vec<Vec<u64>>,
    /// Per replica and instance: when a fallen-back stream is trusted again (NaN: trusted).
    untrusted_until: Vec<Vec<f64>>,
    /// Batches lost, and fallbacks taken, over all replicas.
    lost: u64,
    fallbacks: u64,
}

/// Converts an engine's KV event into the router's.
fn core_kv_event(event: KvEvent) -> CoreKvEvent {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_name,
        } => CoreKvEvent::Stored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_name,
        },
        KvEvent::BlockRemoved { block_hashes } => CoreKvEvent::Removed { block_hashes },
        KvEvent::AllBlocksCleared => CoreKvEvent::AllCleared,
    }
}

/// Converts an engine snapshot into what a scrape of vLLM's `/metrics` gives the router.
pub fn scraped(m: &EngineMetrics) -> CoreMetrics {
    CoreMetrics {
        waiting: m.num_requests_waiting,
        running: m.num_requests_running,
        kv_usage: Some(m.kv_cache_usage),
        running_adapters: m.running_lora_adapters.clone(),
        waiting_adapters: m.waiting_lora_adapters.clone(),
        max_adapters: Some(m.max_loras),
        kv_capacity_tokens: Some(u64::from(m.num_gpu_blocks) * u64::from(m.block_size)),
        // vLLM's metrics do not carry `max_num_seqs` (the simulated fleet's spec does).
        max_running: None,
    }
}

impl Sim {
    fn new(config: &SimConfig, policy: &str, model: &str) -> Result<Sim> {
        let members = fleet::build(config, model)?;
        let n = members.len();
        let mut routers = Vec::with_capacity(config.replicas as usize);
        for r in 0..config.replicas {
            let router_config = RouterConfig {
                policy: policy.to_string(),
                // Replicas make independent random choices, as separate processes would.
                seed: config.router.seed ^ config.seed.rotate_left(17) ^ u64::from(r),
                ..config.router.clone()
            };
            routers.push(Router::new(router_config)?);
        }
        let mut ids = Vec::with_capacity(n);
        let mut engines = Vec::with_capacity(n);
        for m in members {
            let Member { engine, spec } = m;
            let mut id = None;
            for router in routers.iter_mut() {
                let got = router.add_instance(spec.clone())?;
                // Every replica adds the same instances in the same order: same handles.
                debug_assert!(id.is_none_or(|i| i == got));
                id = Some(got);
            }
            ids.push(id.ok_or_else(|| SimError::Setting {
                key: "replicas",
                reason: "must be at least 1".into(),
            })?);
            engines.push(engine);
        }
        let mut queue = EventQueue::new(n);
        for i in 0..n {
            // Scrapes of different instances are spread over the interval, as a scraper
            // working through its targets would be, instead of all at one instant.
            queue.schedule_scrape(i, config.scrape_interval_s * i as f64 / n as f64);
        }
        let charted = config.queue_chart_instances.min(n);
        Ok(Sim {
            engines,
            routers,
            replica_sync: config.replica_sync,
            replica_sync_delay_s: config.replica_sync_delay_s,
            client_max_tokens: config.client_max_tokens,
            peer_queue: VecDeque::new(),
            ids,
            queue,
            records: Vec::new(),
            stats: vec![InstanceStats::default(); n],
            live: vec![0; n],
            busy_since: vec![0.0; n],
            live_total: 0,
            handoffs: FxHashMap::default(),
            pending_decodes: Vec::new(),
            events: Vec::new(),
            track_adapters: false,
            resident: vec![Vec::new(); n],
            known_adapters: vec![Vec::new(); n],
            queues: QueueTrace {
                times: vec![Vec::new(); charted],
                waiting: vec![Vec::new(); charted],
                running: vec![Vec::new(); charted],
            },
            unknown: 0,
            prediction_scratch: Vec::new(),
            ttft_errors: Vec::new(),
            cached_errors: Vec::new(),
            kv: config.kv_events.map(|model| KvDelivery {
                model,
                rng: ChaCha8Rng::seed_from_u64(config.seed ^ 0x4b56_4556_454e_5453),
                scratch: Vec::new(),
                next_seq: vec![0; n],
                queue: VecDeque::new(),
                expected: vec![vec![0; n]; config.replicas as usize],
                untrusted_until: vec![vec![f64::NAN; n]; config.replicas as usize],
                lost: 0,
                fallbacks: 0,
            }),
            admission: vec![VecDeque::new(); config.replicas as usize],
            shared_cores: config.shared_cores,
            busy_engines: 0,
        })
    }

    /// Sends what engine `i` published since the last look towards every replica.
    fn publish_kv_events(&mut self, i: usize, now: f64) {
        let Some(kv) = self.kv.as_mut() else {
            return;
        };
        self.engines[i].drain_kv_events(&mut kv.scratch);
        if kv.scratch.is_empty() {
            return;
        }
        let events: Arc<[CoreKvEvent]> = kv.scratch.drain(..).map(core_kv_event).collect();
        let seq = kv.next_seq[i];
        kv.next_seq[i] += 1;
        for replica in 0..self.routers.len() {
            if kv.model.loss > 0.0 && kv.rng.random::<f64>() < kv.model.loss {
                kv.lost += 1;
                continue;
            }
            kv.queue.push_back(KvBatch {
                at: now + kv.model.delay_s,
                replica: replica as u16,
                instance: i,
                seq,
                events: events.clone(),
            });
        }
    }

    /// When the next batch of KV events reaches a replica.
    fn next_kv_delivery(&self) -> Option<f64> {
        self.kv.as_ref()?.queue.front().map(|b| b.at)
    }

    /// Applies every batch due by `now`, watching each stream's sequence numbers.
    fn deliver_kv_events(&mut self, now: f64) -> Result<()> {
        let Some(kv) = self.kv.as_mut() else {
            return Ok(());
        };
        while kv.queue.front().is_some_and(|b| b.at <= now) {
            let Some(batch) = kv.queue.pop_front() else {
                break;
            };
            let (r, i) = (batch.replica as usize, batch.instance);
            let id = self.ids[i];
            let router = &mut self.routers[r];
            let gap = batch.seq != kv.expected[r][i];
            kv.expected[r][i] = batch.seq + 1;
            let until = &mut kv.untrusted_until[r][i];
            if kv.model.fallback {
                if gap {
                    if until.is_nan() {
                        router.observe(Observation::KvEventsLost(id), batch.at)?;
                        kv.fallbacks += 1;
                    }
                    *until = batch.at + kv.model.probation_s;
                } else if !until.is_nan() && batch.at >= *until {
                    router.observe(Observation::KvEventsTrusted(id), batch.at)?;
                    *until = f64::NAN;
                }
            }
            router.observe(Observation::KvEvents(id, batch.events.to_vec()), batch.at)?;
        }
        Ok(())
    }

    /// Queues a request's outcome (first token, end, failure) for the other replicas, as a
    /// replica that routed it would broadcast it.
    fn tell_peers(&mut self, origin: u16, observation: &Observation, now: f64) {
        if matches!(
            observation,
            Observation::Routed { .. } | Observation::KvEvents(..)
        ) {
            return;
        }
        self.peer_queue.push_back(PeerDelivery {
            at: now + self.replica_sync_delay_s,
            origin,
            message: PeerMessage::Outcome(observation.clone()),
        });
    }

    /// When the next message between replicas arrives.
    fn next_peer_delivery(&self) -> Option<f64> {
        self.peer_queue.front().map(|d| d.at)
    }

    /// Delivers every message between replicas due by `now`. A decision: each other replica
    /// prepares the request itself (its own prefix match and estimate of the pick) and commits
    /// the pick as if it had decided it, so it counts the request as its own in flight. An
    /// outcome: applied as the replica's own (one it never heard of is ignored). What the
    /// others predict is not scored: only the deciding replica's estimate is.
    fn deliver_peer_messages(&mut self, now: f64) {
        while self.peer_queue.front().is_some_and(|d| d.at <= now) {
            let Some(delivery) = self.peer_queue.pop_front() else {
                break;
            };
            let peers = self
                .routers
                .iter_mut()
                .enumerate()
                .filter(|&(q, _)| q != delivery.origin as usize)
                .map(|(_, router)| router);
            match &delivery.message {
                PeerMessage::Routed {
                    request,
                    tokens,
                    index,
                    pick,
                } => {
                    let pieces = Pieces::of(request);
                    let route =
                        route_request(request, &pieces, tokens.as_deref(), self.client_max_tokens);
                    for router in peers {
                        if let Ok(decision) = router.route(&route, delivery.at) {
                            let _ = router.observe(
                                Observation::Routed {
                                    request: main_id(*index),
                                    instance: *pick,
                                    plan: decision.plan_for(*pick),
                                },
                                delivery.at,
                            );
                        }
                        router.take_predictions(&mut self.prediction_scratch);
                        self.prediction_scratch.clear();
                    }
                }
                PeerMessage::Outcome(observation) => {
                    for router in peers {
                        let _ = router.observe(observation.clone(), delivery.at);
                        router.take_predictions(&mut self.prediction_scratch);
                        self.prediction_scratch.clear();
                    }
                }
            }
        }
    }

    /// Applies an observation to one replica; an unknown request (expired in the router as
    /// stale) is counted, anything else is a simulator bug and stops the run.
    fn observe(&mut self, replica: u16, observation: Observation, now: f64) -> Result<()> {
        if self.replica_sync {
            self.tell_peers(replica, &observation, now);
        }
        let router = &mut self.routers[replica as usize];
        let applied = router.observe(observation, now);
        router.take_predictions(&mut self.prediction_scratch);
        for p in self.prediction_scratch.drain(..) {
            match p {
                Prediction::Ttft { .. } => self.ttft_errors.push(p.relative_error()),
                Prediction::Cached { .. } => self.cached_errors.push(p.relative_error()),
            }
        }
        match applied {
            Ok(()) => Ok(()),
            Err(ObserveError::UnknownRequest(_)) => {
                self.unknown += 1;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    fn mark_submitted(&mut self, i: usize, now: f64) {
        if self.live[i] == 0 {
            self.busy_since[i] = now;
            self.busy_engines += 1;
        }
        self.live[i] += 1;
        self.stats[i].requests += 1;
    }

    fn mark_done(&mut self, i: usize, now: f64) {
        self.live[i] -= 1;
        if self.live[i] == 0 {
            self.stats[i].busy_s += now - self.busy_since[i];
            self.busy_engines -= 1;
        }
    }

    /// Runs engine `i` up to `now`, handles what it reports, and requeues its next event.
    fn advance(&mut self, i: usize, now: f64) -> Result<()> {
        let mut events = std::mem::take(&mut self.events);
        if let Some(cores) = self.shared_cores {
            // Processor sharing: the steps composed now run at cores ÷ busy engines of speed.
            self.engines[i].set_slowdown(f64::from(self.busy_engines.max(1)) / cores);
        }
        self.engines[i].advance(now, &mut events);
        for event in events.drain(..) {
            self.on_engine_event(i, event)?;
        }
        self.events = events;
        self.publish_kv_events(i, now);
        if self.track_adapters {
            self.count_adapter_loads(i);
        }
        self.queue
            .schedule_engine(i, self.engines[i].next_event_time());
        Ok(())
    }

    /// Adapters that became resident since the last look count as loads (the engine has no
    /// load counter; a load and eviction inside one `advance` would be missed).
    fn count_adapter_loads(&mut self, i: usize) {
        let now = self.engines[i].metrics().resident_lora_adapters;
        let before = &self.resident[i];
        let loads = now.iter().filter(|a| !before.contains(a)).count();
        self.stats[i].adapter_loads += loads as u64;
        self.resident[i] = now;
    }

    fn on_engine_event(&mut self, i: usize, event: EngineEvent) -> Result<()> {
        match event {
            EngineEvent::FirstToken {
                id,
                time,
                cached_tokens,
                ..
            } => {
                let index = id as usize;
                let r = self.records[index];
                let prefill_half = r.is_split() && i == r.instance as usize;
                let rid = if r.is_split() && !prefill_half {
                    decode_id(index)
                } else {
                    main_id(index)
                };
                if prefill_half {
                    self.records[index].cached_tokens = cached_tokens;
                } else {
                    let rec = &mut self.records[index];
                    rec.first_token = time;
                    if !r.is_split() {
                        rec.cached_tokens = cached_tokens;
                    }
                }
                self.observe(r.replica, Observation::FirstToken(rid), time)
            }
            EngineEvent::Finished {
                id,
                time,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                kv_transfer,
                ..
            } => {
                let index = id as usize;
                let r = self.records[index];
                let prefill_half = r.is_split() && i == r.instance as usize;
                let usage = Usage {
                    prompt_tokens,
                    cached_tokens: Some(cached_tokens),
                    completion_tokens,
                };
                self.mark_done(i, time);
                if prefill_half {
                    self.observe(
                        r.replica,
                        Observation::Finished(main_id(index), Some(usage)),
                        time,
                    )?;
                    match kv_transfer {
                        Some(kv) => self.pending_decodes.push((time, index, kv)),
                        None => self.fail(index, time)?,
                    }
                    return Ok(());
                }
                let rid = if r.is_split() {
                    decode_id(index)
                } else {
                    main_id(index)
                };
                if r.outcome != Outcome::InFlight {
                    return Err(SimError::Conservation {
                        request: index as u64,
                    });
                }
                let rec = &mut self.records[index];
                rec.finish = time;
                rec.prompt_tokens = prompt_tokens;
                rec.completion_tokens = completion_tokens;
                rec.outcome = Outcome::Finished;
                if rec.first_token.is_nan() {
                    rec.first_token = time;
                }
                self.live_total -= 1;
                self.observe(r.replica, Observation::Finished(rid, Some(usage)), time)
            }
            EngineEvent::Preempted { .. } => {
                self.stats[i].preemptions += 1;
                Ok(())
            }
            EngineEvent::Tokens { .. } => Ok(()),
        }
    }

    /// A split request whose decode half cannot be placed: counts as rejected.
    fn fail(&mut self, index: usize, time: f64) -> Result<()> {
        self.handoffs.remove(&index);
        let r = self.records[index];
        self.records[index].outcome = Outcome::Rejected;
        self.live_total -= 1;
        if r.is_split() {
            self.observe(r.replica, Observation::Failed(decode_id(index)), time)?;
        }
        Ok(())
    }

    /// Submits the decode halves whose prefill just handed over.
    fn submit_decodes(&mut self) -> Result<()> {
        while let Some((time, index, kv)) = self.pending_decodes.pop() {
            let Some(h) = self.handoffs.remove(&index) else {
                continue;
            };
            let d = self.records[index].decode_instance as usize;
            self.advance(d, time)?;
            let request = EngineRequest {
                id: index as u64,
                prompt_tokens: h.tokens,
                max_tokens: h.max_tokens,
                adapter: h.adapter,
                mode: RequestMode::DecodeAfterTransfer(kv),
            };
            if self.engines[d].submit(request, time).is_err() {
                self.fail(index, time)?;
                continue;
            }
            self.mark_submitted(d, time);
            self.queue
                .schedule_engine(d, self.engines[d].next_event_time());
        }
        Ok(())
    }

    fn ensure_adapter(&mut self, i: usize, adapter: &str) {
        if !self.known_adapters[i].iter().any(|a| a == adapter) {
            self.engines[i].register_adapter(adapter);
            self.known_adapters[i].push(adapter.to_string());
        }
    }

    fn on_arrival(&mut self, request: &Request, replica: u16, now: f64) -> Result<()> {
        let index = self.records.len();
        self.records.push(RequestRecord {
            arrival: now,
            first_token: f64::NAN,
            finish: f64::NAN,
            instance: NO_INSTANCE,
            decode_instance: NO_INSTANCE,
            replica,
            ..RequestRecord::default()
        });
        // Requests already waiting go first: a newcomer joins the end of its replica's line.
        let line = replica as usize;
        if !self.admission[line].is_empty() || !self.dispatch(index, request, replica, now)? {
            self.live_total += 1;
            self.admission[line].push_back((index, request.clone()));
        }
        Ok(())
    }

    /// Routes the head of each replica's admission line again, as long as it finds capacity
    /// (the gateway routes its head on every request end and scrape).
    fn admit_waiting(&mut self, now: f64) -> Result<()> {
        for line in 0..self.admission.len() {
            while let Some((index, request)) = self.admission[line].pop_front() {
                self.live_total -= 1;
                if !self.dispatch(index, &request, line as u16, now)? {
                    self.live_total += 1;
                    self.admission[line].push_front((index, request));
                    break;
                }
            }
        }
        Ok(())
    }

    /// Routes request `index` and submits it; false when every candidate is saturated (the
    /// caller queues it). A request with no candidate at all is rejected.
    fn dispatch(
        &mut self,
        index: usize,
        request: &Request,
        replica: u16,
        now: f64,
    ) -> Result<bool> {
        let tokens = encode_request(request);
        self.records[index].prompt_tokens = tokens.len() as u32;
        let adapter = request.adapter.as_deref();
        if adapter.is_some() {
            self.track_adapters = true;
        }
        let pieces = Pieces::of(request);
        // With KV events the router sees token ids, as a gateway with the model's tokenizer.
        let token_ids = self.kv.is_some().then_some(&tokens[..]);
        let route = route_request(request, &pieces, token_ids, self.client_max_tokens);
        let router = &mut self.routers[replica as usize];
        let decision = match router.route(&route, now) {
            Ok(d) => d,
            Err(_) => {
                self.records[index].outcome = Outcome::Rejected;
                return Ok(true);
            }
        };
        if decision.eligible == 0 && decision.saturated {
            return Ok(false);
        }
        let Some(pick) = decision.best() else {
            self.records[index].outcome = Outcome::Rejected;
            return Ok(true);
        };
        let split = decision.is_disaggregated();
        let decode_pick = if split {
            match decision.best_decode() {
                Some(d) => Some(d),
                None => {
                    self.records[index].outcome = Outcome::Rejected;
                    return Ok(true);
                }
            }
        } else {
            None
        };
        let p = pick.slot as usize;
        router.observe(
            Observation::Routed {
                request: main_id(index),
                instance: pick,
                plan: decision.plan_for(pick),
            },
            now,
        )?;
        if self.replica_sync && decode_pick.is_none() {
            self.peer_queue.push_back(PeerDelivery {
                at: now + self.replica_sync_delay_s,
                origin: replica,
                message: PeerMessage::Routed {
                    request: request.clone(),
                    tokens: token_ids.map(|_| tokens.clone()),
                    index,
                    pick,
                },
            });
        }
        let router = &mut self.routers[replica as usize];
        if let Some(d) = decode_pick {
            router.observe(
                Observation::Routed {
                    request: decode_id(index),
                    instance: d,
                    plan: decision.plan_for(d),
                },
                now,
            )?;
            self.records[index].decode_instance = d.slot;
            self.handoffs.insert(
                index,
                Handoff {
                    tokens: tokens.clone(),
                    max_tokens: request.max_tokens,
                    adapter: adapter.map(str::to_string),
                },
            );
        }
        self.records[index].instance = p as u32;
        self.live_total += 1;
        self.advance(p, now)?;
        if let Some(a) = adapter {
            self.ensure_adapter(p, a);
            if let Some(d) = decode_pick {
                self.ensure_adapter(d.slot as usize, a);
            }
        }
        let request = EngineRequest {
            id: index as u64,
            prompt_tokens: tokens,
            max_tokens: if split { 1 } else { request.max_tokens },
            adapter: adapter.map(str::to_string),
            mode: if split {
                RequestMode::PrefillOnly
            } else {
                RequestMode::Normal
            },
        };
        if self.engines[p].submit(request, now).is_err() {
            let r = &mut self.records[index];
            r.outcome = Outcome::Rejected;
            self.live_total -= 1;
            self.handoffs.remove(&index);
            self.observe(replica, Observation::Failed(main_id(index)), now)?;
            if split {
                self.observe(replica, Observation::Failed(decode_id(index)), now)?;
            }
            return Ok(true);
        }
        self.mark_submitted(p, now);
        self.queue
            .schedule_engine(p, self.engines[p].next_event_time());
        self.submit_decodes()?;
        Ok(true)
    }

    fn on_scrape(&mut self, i: usize, now: f64, interval: f64) -> Result<()> {
        self.advance(i, now)?;
        self.submit_decodes()?;
        let m = self.engines[i].metrics();
        if i < self.queues.times.len() {
            self.queues.times[i].push(now);
            self.queues.waiting[i].push(m.num_requests_waiting);
            self.queues.running[i].push(m.num_requests_running);
        }
        let seen = scraped(&m);
        let id = self.ids[i];
        for r in 0..self.routers.len() {
            self.routers[r].observe(Observation::MetricsScraped(id, seen.clone()), now)?;
        }
        self.queue.schedule_scrape(i, now + interval);
        Ok(())
    }
}

/// Simulates `policy` over `workload`; `model` is the model name the fleet serves.
pub fn simulate(
    config: &SimConfig,
    policy: &str,
    model: &str,
    workload: impl Iterator<Item = Request>,
) -> Result<RunData> {
    simulate_with(config, policy, model, workload, &mut |_, _| {})
}

/// Requests between two progress reports.
const PROGRESS_EVERY: u64 = 4096;

/// [`simulate`], reporting progress as (requests arrived, simulated seconds) every
/// [`PROGRESS_EVERY`] arrivals and at the end.
pub fn simulate_with(
    config: &SimConfig,
    policy: &str,
    model: &str,
    workload: impl Iterator<Item = Request>,
    progress: &mut dyn FnMut(u64, f64),
) -> Result<RunData> {
    config.validate()?;
    let mut sim = Sim::new(config, policy, model)?;
    let mut split_rng = ChaCha8Rng::seed_from_u64(config.seed ^ 0x5350_4c49_5420_5250);
    let replicas = config.replicas;
    let mut workload = workload.peekable();
    let mut arrivals = 0u64;
    let mut clock = 0.0f64;
    loop {
        let next_arrival = workload.peek().map(|r| r.arrival_s.max(clock));
        if next_arrival.is_none() && sim.live_total == 0 {
            break;
        }
        let next_event = sim.queue.peek_time();
        // KV events and messages between replicas due before whatever comes next are applied
        // first.
        let next = next_event
            .into_iter()
            .chain(next_arrival)
            .fold(f64::INFINITY, f64::min);
        if let Some(due) = sim.next_kv_delivery() {
            if due <= next {
                sim.deliver_kv_events(due)?;
                clock = clock.max(due);
                continue;
            }
        }
        if let Some(due) = sim.next_peer_delivery() {
            if due <= next {
                sim.deliver_peer_messages(due);
                clock = clock.max(due);
                continue;
            }
        }
        let take_event = match (next_event, next_arrival) {
            (Some(e), Some(a)) => e <= a,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => {
                return Err(SimError::Stalled {
                    time: clock,
                    live: sim.live_total,
                })
            }
        };
        if take_event {
            let Some((time, event)) = sim.queue.pop() else {
                continue;
            };
            clock = clock.max(time);
            match event {
                Event::Engine(i) => {
                    sim.advance(i, clock)?;
                    sim.submit_decodes()?;
                    sim.admit_waiting(clock)?;
                }
                Event::Scrape(i) => {
                    // Scrapes alone never end: with no request left, stop.
                    if next_arrival.is_none() && sim.live_total == 0 {
                        break;
                    }
                    if next_arrival.is_none() && !sim.queue.has_engine_work() {
                        return Err(SimError::Stalled {
                            time: clock,
                            live: sim.live_total,
                        });
                    }
                    sim.on_scrape(i, clock, config.scrape_interval_s)?;
                    sim.admit_waiting(clock)?;
                }
            }
            continue;
        }
        let Some(request) = workload.next() else {
            continue;
        };
        clock = clock.max(request.arrival_s);
        let replica = match config.split {
            Split::RoundRobin => (arrivals % u64::from(replicas)) as u16,
            Split::Random => split_rng.random_range(0..replicas) as u16,
        };
        arrivals += 1;
        if arrivals.is_multiple_of(PROGRESS_EVERY) {
            progress(arrivals, clock);
        }
        sim.on_arrival(&request, replica, clock)?;
    }
    progress(arrivals, clock);
    let learned = sim
        .ids
        .iter()
        .map(|&id| {
            sim.routers[0]
                .learned(id)
                .map_or(0.0, |l| l.prefill_tokens_per_s)
        })
        .collect();
    let (kv_batches_lost, kv_fallbacks) = sim.kv.as_ref().map_or((0, 0), |k| (k.lost, k.fallbacks));
    Ok(RunData {
        policy: policy.to_string(),
        kv_batches_lost,
        kv_fallbacks,
        learned_prefill_tokens_per_s: learned,
        records: sim.records,
        instances: sim.stats,
        queues: sim.queues,
        unknown_observations: sim.unknown,
        ttft_errors: sim.ttft_errors,
        cached_errors: sim.cached_errors,
    })
}
