//! The step scheduler: which tokens of which requests the next forward pass
//! computes, and what happens when it completes.
//!
//! One step, as in vLLM V1's `Scheduler.schedule()`:
//! 1. Running requests, oldest first, each get `min(remaining, budget)`
//!    tokens (one for a decoding request, a chunk for a prefilling one).
//!    When the KV cache cannot grow for one of them, the newest running
//!    request is preempted (recompute: blocks freed, back to the head of the
//!    waiting queue) until it can, or until it is the victim itself.
//! 2. Unless something was preempted, waiting requests are admitted FCFS
//!    while `max_num_seqs` and the budget allow. A request whose adapter
//!    cannot get a slot, or whose KV transfer is still in flight, is skipped
//!    (it keeps its place); one whose blocks cannot be allocated stops
//!    admission. On first admission the longest cached prefix of full blocks
//!    is reused, capped so at least one token is computed.
//!
//! Progress guards (not in vLLM): when nothing is running and nothing has
//! been scheduled yet, a request that cannot get blocks is skipped instead
//! of stopping admission, so a request stuck behind transfers that hold
//! the cache cannot block the requests that would free it; and a running
//! request that would have to preempt itself first reclaims the blocks of
//! a waiting decode-side request (see `reclaim_waiting_blocks`).

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::config::{EngineConfig, Role};
use crate::events::{EngineEvent, FinishReason, KvEvent};
use crate::kv_cache::{adapter_salt, hash_block, hash_prompt_into, KvCache};
use crate::lora::Loras;
use crate::prefetch::{prefetch, prefetch_lines};
use crate::profile::Profile;
use crate::request::{EngineRequest, KvTransfer, RequestId, RequestMode, SubmitError};
use crate::seq::{Kind, Phase, Seq};
use crate::tokenizer;

/// Message of the invariant that every slot in a queue or plan lookup by queue is live.
const LIVE: &str = "invariant: slots in the waiting/running queues are live";

/// Tokens of one request computed by one step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Item {
    /// Slab slot of the request.
    pub slot: u32,
    /// Its submission key (detects a slot freed and reused meanwhile).
    pub key: u64,
    /// Tokens computed.
    pub tokens: u32,
}

/// The composition of the step being computed.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// What the step computes, in running-queue order.
    pub items: Vec<Item>,
    /// Requests admitted from the waiting queue by this step.
    pub admitted: u32,
    /// Whether the step preempted anything.
    pub preempted: bool,
    /// Adapters loaded by this step.
    pub lora_loads: u32,
    /// The waiting request at which admission stopped for lack of blocks.
    pub blocked: Option<u32>,
    /// Duration of the step, seconds.
    pub time: f64,
}

impl Plan {
    fn clear(&mut self) {
        self.items.clear();
        self.admitted = 0;
        self.preempted = false;
        self.lora_loads = 0;
        self.blocked = None;
        self.time = 0.0;
    }
}

/// Cumulative counters (vLLM's Prometheus counters).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Counters {
    /// Tokens of requests looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Of those, tokens found cached.
    pub prefix_hits: u64,
    /// Preemptions (including reclaimed transfers).
    pub preemptions: u64,
    /// Prompt tokens of requests that produced their first token.
    pub prompt_tokens: u64,
    /// Output tokens sampled.
    pub generation_tokens: u64,
}

/// Outcome of trying to admit one waiting request.
enum Admit {
    /// Admitted, computing this many tokens.
    Yes,
    /// Not enough free blocks.
    NoBlocks,
}

/// Outcome of trying to start a decode-side KV transfer.
enum Transfer {
    /// Blocks allocated, transfer in flight.
    Started,
    /// Not enough free blocks.
    NoBlocks,
    /// The local prefix cache already holds everything; admit normally.
    Nothing,
}

/// Requests, queues, KV cache and adapters of one engine.
#[derive(Debug)]
pub(crate) struct Scheduler {
    /// Tokens per block.
    pub bs: u32,
    budget: u32,
    max_seqs: u32,
    max_model_len: u32,
    role: Role,
    engine_id: String,
    emit_tokens: bool,
    kv_bytes_per_token: f64,
    transfer_bandwidth: f64,
    lora_load_time: f64,
    /// Live requests by slot.
    pub slab: Vec<Option<Seq>>,
    free_slots: Vec<u32>,
    /// Slot of each live request (Fx: ids are caller-chosen integers, no need for SipHash).
    ids: FxHashMap<RequestId, u32>,
    /// FCFS queue (preempted requests go back to the front).
    pub waiting: VecDeque<u32>,
    /// Running batch in admission order (the last is preempted first).
    pub running: Vec<u32>,
    /// The KV block pool and prefix cache.
    pub cache: KvCache,
    /// Adapter registry and slots.
    pub loras: Loras,
    /// Prometheus-style counters.
    pub counters: Counters,
    next_key: u64,
    /// When the inbound KV link is free (transfers are serialised on it).
    link_free_at: f64,
    /// Requests in `Phase::Transferring`.
    pub transferring: u32,
    /// The step being composed or computed.
    pub plan: Plan,
    byte_scratch: Vec<u8>,
    tok_scratch: Vec<u32>,
    hit_scratch: Vec<u32>,
    /// Scratch for fast-forward bounds.
    pub bucket_scratch: Vec<u64>,
    /// Buffer for the next fast-forward run's member list.
    pub spare_members: Vec<(u32, u64)>,
    /// Scratch of `prepare_apply`: requests with blocks to commit, and how many.
    fill_scratch: Vec<(u32, u32)>,
}

impl Scheduler {
    /// An empty scheduler for a validated configuration.
    pub(crate) fn new(cfg: &EngineConfig) -> Self {
        Self {
            bs: cfg.block_size,
            budget: cfg.max_num_batched_tokens,
            max_seqs: cfg.max_num_seqs,
            max_model_len: cfg.max_model_len,
            role: cfg.role,
            engine_id: cfg.engine_id.clone(),
            emit_tokens: cfg.emit_token_events,
            kv_bytes_per_token: cfg.kv_bytes_per_token,
            transfer_bandwidth: cfg.kv_transfer_bandwidth_bytes_per_s,
            lora_load_time: cfg.lora_load_time_s,
            slab: Vec::new(),
            free_slots: Vec::new(),
            ids: FxHashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            cache: KvCache::new(
                cfg.num_gpu_blocks,
                cfg.block_size,
                cfg.enable_prefix_caching,
                cfg.emit_kv_events,
            ),
            loras: Loras::new(cfg.max_loras),
            counters: Counters::default(),
            next_key: 0,
            link_free_at: f64::NEG_INFINITY,
            transferring: 0,
            plan: Plan::default(),
            byte_scratch: Vec::new(),
            tok_scratch: Vec::new(),
            hit_scratch: Vec::new(),
            bucket_scratch: Vec::new(),
            spare_members: Vec::new(),
            fill_scratch: Vec::new(),
        }
    }

    /// The live request in `slot`.
    pub(crate) fn seq(&self, slot: u32) -> &Seq {
        self.slab[slot as usize].as_ref().expect(LIVE)
    }

    fn seq_mut(&mut self, slot: u32) -> &mut Seq {
        self.slab[slot as usize].as_mut().expect(LIVE)
    }

    /// Whether a live request has this id.
    pub(crate) fn contains(&self, id: RequestId) -> bool {
        self.ids.contains_key(&id)
    }

    /// Number of live requests.
    pub(crate) fn num_live(&self) -> usize {
        self.ids.len()
    }

    /// Validate and enqueue a request.
    pub(crate) fn add(&mut self, req: EngineRequest) -> Result<(), SubmitError> {
        let prompt_len = req.prompt_tokens.len();
        if prompt_len == 0 {
            return Err(SubmitError::EmptyPrompt);
        }
        // A decode instance also runs plain requests whole, as vLLM's do: that is what lets a
        // router skip the hand-off for short or mostly cached prompts (selective disaggregation).
        let role_ok = matches!(
            (self.role, &req.mode),
            (Role::Both, _)
                | (Role::Prefill, RequestMode::PrefillOnly)
                | (
                    Role::Decode,
                    RequestMode::DecodeAfterTransfer(_) | RequestMode::Normal
                )
        );
        if !role_ok {
            return Err(SubmitError::WrongRole {
                role: self.role,
                mode: req.mode.name(),
            });
        }
        let (kind, max_tokens, pending_transfer) = match &req.mode {
            RequestMode::Normal => (Kind::Normal, req.max_tokens, None),
            // vLLM runs the prefill leg with max_tokens = 1.
            RequestMode::PrefillOnly => (Kind::PrefillOnly, 1, None),
            RequestMode::DecodeAfterTransfer(kv) => {
                (Kind::Decode, req.max_tokens, Some(kv.num_tokens))
            }
        };
        if max_tokens == 0 {
            return Err(SubmitError::ZeroMaxTokens);
        }
        if prompt_len as u64 + u64::from(max_tokens) > u64::from(self.max_model_len) {
            return Err(SubmitError::TooLong {
                prompt_tokens: prompt_len as u64,
                max_tokens,
                max_model_len: self.max_model_len,
            });
        }
        if self.ids.contains_key(&req.id) {
            return Err(SubmitError::DuplicateId(req.id));
        }
        let adapter = match &req.adapter {
            None => None,
            Some(_) if self.loras.max_loras() == 0 => return Err(SubmitError::LoraDisabled),
            Some(name) => Some(
                self.loras
                    .lookup(name)
                    .ok_or_else(|| SubmitError::UnknownAdapter(name.clone()))?,
            ),
        };
        let salt = adapter_salt(req.adapter.as_deref());
        // Sized for the whole life of the request (it always generates
        // `max_tokens`), so neither vector is reallocated as it grows.
        let total_tokens = prompt_len as u64 + u64::from(max_tokens);
        let hashes = if self.cache.prefix_caching() {
            let mut hashes = Vec::with_capacity((total_tokens / u64::from(self.bs)) as usize);
            hash_prompt_into(
                &req.prompt_tokens,
                self.bs as usize,
                salt,
                &mut self.byte_scratch,
                &mut hashes,
            );
            hashes
        } else {
            Vec::new()
        };
        let blocks = Vec::with_capacity(total_tokens.div_ceil(u64::from(self.bs)) as usize);
        if let Some(a) = adapter {
            self.loras.add_live(a);
        }
        self.next_key += 1;
        let seq = Seq {
            id: req.id,
            key: self.next_key,
            prompt: req.prompt_tokens,
            prompt_len: prompt_len as u32,
            max_tokens,
            adapter,
            salt,
            kind,
            pending_transfer,
            phase: Phase::Waiting,
            computed: 0,
            output: 0,
            blocks,
            hashes,
            committed: 0,
            cached_tokens: None,
            first_token_sent: false,
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slab[s as usize] = Some(seq);
                s
            }
            None => {
                self.slab.push(Some(seq));
                (self.slab.len() - 1) as u32
            }
        };
        self.ids.insert(req.id, slot);
        self.waiting.push_back(slot);
        Ok(())
    }

    /// Compose the step starting at `start` into `self.plan`.
    pub(crate) fn compose(&mut self, start: f64, profile: &Profile, events: &mut Vec<EngineEvent>) {
        self.plan.clear();
        if self.transferring > 0 {
            self.finish_transfers(start);
        }
        let mut budget = self.budget;
        // The next request to admit is cold: start fetching the index slot
        // of its first block while the running batch is composed.
        if let Some(s) = self
            .waiting
            .front()
            .and_then(|&w| self.slab[w as usize].as_ref())
        {
            if let Some(&h) = s.hashes.first() {
                self.cache.prefetch_lookup(h);
            }
        }

        // 1. Running requests.
        let mut i = 0;
        'running: while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let s = self.seq(slot);
            let tokens = (s.num_tokens() - s.computed).min(budget);
            let target = s.computed + tokens;
            while !self.grow(slot, target) {
                // The victim would be this request itself: first take the
                // blocks of a waiting request that holds some (a KV transfer),
                // or nothing running could ever finish.
                if self.running.last() == Some(&slot) && self.reclaim_waiting_blocks(start, events)
                {
                    continue;
                }
                let Some(victim) = self.running.pop() else {
                    break 'running;
                };
                self.preempt(victim, start, events);
                if victim == slot {
                    break 'running;
                }
            }
            self.push_item(slot, tokens, profile);
            budget -= tokens;
            i += 1;
        }

        // 2. Waiting requests, unless this step preempted.
        if !self.plan.preempted {
            let mut j = 0;
            while j < self.waiting.len() {
                if self.running.len() as u32 >= self.max_seqs || budget == 0 {
                    break;
                }
                let slot = self.waiting[j];
                let s = self.seq(slot);
                if matches!(s.phase, Phase::Transferring { .. }) {
                    j += 1;
                    continue;
                }
                if s.pending_transfer.is_some() {
                    match self.start_transfer(slot, start) {
                        Transfer::Started => {
                            j += 1;
                            continue;
                        }
                        Transfer::NoBlocks => {
                            if self.may_skip_blocked() {
                                j += 1;
                                continue;
                            }
                            self.plan.blocked = Some(slot);
                            break;
                        }
                        Transfer::Nothing => {}
                    }
                }
                let s = self.seq(slot);
                if let Some(a) = s.adapter {
                    if !self.loras.can_be_resident(a) {
                        j += 1;
                        continue;
                    }
                }
                match self.try_admit(slot, budget) {
                    Admit::Yes => {}
                    Admit::NoBlocks => {
                        if self.may_skip_blocked() {
                            j += 1;
                            continue;
                        }
                        self.plan.blocked = Some(slot);
                        break;
                    }
                }
                let s = self.seq(slot);
                let tokens = (s.num_tokens() - s.computed).min(budget);
                if let Some(a) = s.adapter {
                    if self.loras.make_resident(a) == Some(true) {
                        self.plan.lora_loads += 1;
                    }
                    self.loras.start_running(a);
                }
                self.seq_mut(slot).phase = Phase::Running;
                self.waiting.remove(j);
                self.running.push(slot);
                self.plan.admitted += 1;
                self.push_item(slot, tokens, profile);
                budget -= tokens;
            }
        }

        if !self.plan.items.is_empty() {
            self.plan.time +=
                profile.step_base_s + f64::from(self.plan.lora_loads) * self.lora_load_time;
        }
    }

    /// Whether a blocked waiting request may be skipped (see the deadlock guard).
    fn may_skip_blocked(&self) -> bool {
        self.running.is_empty() && self.plan.items.is_empty()
    }

    fn push_item(&mut self, slot: u32, tokens: u32, profile: &Profile) {
        let s = self.seq(slot);
        let key = s.key;
        self.plan.time += profile.chunk_time(u64::from(s.computed), u64::from(tokens));
        self.plan.items.push(Item { slot, key, tokens });
    }

    /// Make sure `slot` holds blocks for `tokens` tokens; false if the cache is full.
    pub(crate) fn grow(&mut self, slot: u32, tokens: u32) -> bool {
        let need = self.cache.blocks_for(tokens);
        let s = self.slab[slot as usize].as_mut().expect(LIVE);
        let have = s.blocks.len() as u32;
        if need <= have {
            return true;
        }
        self.cache.allocate(need - have, &mut s.blocks)
    }

    /// Preempt a running request (recompute policy).
    fn preempt(&mut self, slot: u32, time: f64, events: &mut Vec<EngineEvent>) {
        let s = self.slab[slot as usize].as_mut().expect(LIVE);
        self.cache.free(&s.blocks);
        s.blocks.clear();
        s.computed = 0;
        s.committed = 0;
        s.phase = Phase::Waiting;
        let (id, adapter) = (s.id, s.adapter);
        if let Some(a) = adapter {
            self.loras.stop_running(a);
        }
        self.waiting.push_front(slot);
        self.counters.preemptions += 1;
        self.plan.preempted = true;
        events.push(EngineEvent::Preempted { id, time });
    }

    /// The free (evictable) blocks among the cached prefix a fresh waiting
    /// request would reuse, sorted; empty if it is not fresh.
    pub(crate) fn evictable_hits(&self, slot: u32) -> Vec<u32> {
        let s = self.seq(slot);
        if s.computed != 0 || !s.blocks.is_empty() || !self.cache.prefix_caching() {
            return Vec::new();
        }
        let max = ((s.num_tokens() - 1) / self.bs) as usize;
        let mut hits = Vec::new();
        self.cache.find_prefix(&s.hashes, max, &mut hits);
        hits.retain(|&b| self.cache.is_free(b));
        hits.sort_unstable();
        hits
    }

    /// Free the blocks of the newest waiting request holding any (a decode-side
    /// KV transfer, landed or in flight); it will prefill locally instead.
    /// Reported as a preemption. False if no waiting request holds blocks.
    ///
    /// Not in vLLM, which can deadlock here; needed so the oldest running
    /// request can always finish.
    fn reclaim_waiting_blocks(&mut self, time: f64, events: &mut Vec<EngineEvent>) -> bool {
        let Some(j) = self
            .waiting
            .iter()
            .rposition(|&w| !self.seq(w).blocks.is_empty())
        else {
            return false;
        };
        let slot = self.waiting[j];
        let s = self.slab[slot as usize].as_mut().expect(LIVE);
        self.cache.free(&s.blocks);
        s.blocks.clear();
        s.computed = 0;
        s.committed = 0;
        s.pending_transfer = None;
        if matches!(s.phase, Phase::Transferring { .. }) {
            self.transferring -= 1;
        }
        s.phase = Phase::Waiting;
        let id = s.id;
        self.counters.preemptions += 1;
        self.plan.preempted = true;
        events.push(EngineEvent::Preempted { id, time });
        true
    }

    /// Look up the prefix cache for a fresh request and allocate the blocks of its first chunk.
    fn try_admit(&mut self, slot: u32, budget: u32) -> Admit {
        let bs = self.bs;
        let mut hits = std::mem::take(&mut self.hit_scratch);
        hits.clear();
        let s = self.slab[slot as usize].as_ref().expect(LIVE);
        let fresh = s.computed == 0 && s.blocks.is_empty();
        let num_tokens = s.num_tokens();
        let mut hit_blocks = 0;
        if fresh {
            // At least one token must be computed to sample from.
            let max = ((num_tokens - 1) / bs) as usize;
            hit_blocks = self.cache.find_prefix(&s.hashes, max, &mut hits) as u32;
        }
        let computed = if fresh { hit_blocks * bs } else { s.computed };
        let tokens = (num_tokens - computed).min(budget);
        let held = (s.blocks.len() + hits.len()) as u32;
        let need = self
            .cache
            .blocks_for(computed + tokens)
            .saturating_sub(held);
        if !self.cache.can_allocate(&hits, need) {
            self.hit_scratch = hits;
            return Admit::NoBlocks;
        }
        if fresh && self.cache.prefix_caching() {
            self.counters.prefix_queries += u64::from(num_tokens);
            self.counters.prefix_hits += u64::from(computed);
        }
        self.cache.touch(&hits);
        let s = self.slab[slot as usize].as_mut().expect(LIVE);
        s.blocks.extend_from_slice(&hits);
        let ok = self.cache.allocate(need, &mut s.blocks);
        debug_assert!(ok, "allocation checked above");
        if fresh {
            s.computed = computed;
            s.committed = hit_blocks;
        }
        if s.cached_tokens.is_none() {
            s.cached_tokens = Some(computed);
        }
        self.hit_scratch = hits;
        Admit::Yes
    }

    /// First admission of a decode-side request: reuse local cache hits,
    /// allocate blocks for the whole prompt and start pulling the rest.
    ///
    /// The whole prompt is allocated up front (vLLM allocates what the
    /// transfer fills plus the first computed token) so that a request
    /// whose KV has arrived never needs a block to produce its first token.
    fn start_transfer(&mut self, slot: u32, start: f64) -> Transfer {
        let bs = self.bs;
        let mut hits = std::mem::take(&mut self.hit_scratch);
        hits.clear();
        let s = self.slab[slot as usize].as_ref().expect(LIVE);
        let num_tokens = s.num_tokens();
        // The last prompt token is always computed locally (it samples the first token).
        let total = s
            .pending_transfer
            .unwrap_or(0)
            .min(s.prompt_len.saturating_sub(1));
        let max = ((num_tokens - 1) / bs) as usize;
        let hit_blocks = self.cache.find_prefix(&s.hashes, max, &mut hits) as u32;
        let local = hit_blocks * bs;
        if total <= local {
            let s = self.seq_mut(slot);
            s.pending_transfer = None;
            self.hit_scratch = hits;
            return Transfer::Nothing;
        }
        let need = self
            .cache
            .blocks_for(s.prompt_len)
            .saturating_sub(hits.len() as u32);
        if !self.cache.can_allocate(&hits, need) {
            self.hit_scratch = hits;
            return Transfer::NoBlocks;
        }
        if self.cache.prefix_caching() {
            self.counters.prefix_queries += u64::from(num_tokens);
            self.counters.prefix_hits += u64::from(local);
        }
        self.cache.touch(&hits);
        let s = self.slab[slot as usize].as_mut().expect(LIVE);
        s.blocks.extend_from_slice(&hits);
        let ok = self.cache.allocate(need, &mut s.blocks);
        debug_assert!(ok, "allocation checked above");
        s.computed = local;
        s.committed = hit_blocks;
        s.pending_transfer = None;
        s.cached_tokens = Some(total);
        let duration = f64::from(total - local) * self.kv_bytes_per_token / self.transfer_bandwidth;
        let ready_at = start.max(self.link_free_at) + duration;
        self.link_free_at = ready_at;
        s.phase = Phase::Transferring {
            ready_at,
            target: total,
        };
        self.transferring += 1;
        self.hit_scratch = hits;
        Transfer::Started
    }

    /// Mark transfers complete by `now` as schedulable and cache their blocks.
    fn finish_transfers(&mut self, now: f64) {
        for j in 0..self.waiting.len() {
            let slot = self.waiting[j];
            let s = self.seq_mut(slot);
            if let Phase::Transferring { ready_at, target } = s.phase {
                if ready_at <= now {
                    s.phase = Phase::Waiting;
                    s.computed = target;
                    self.transferring -= 1;
                    self.commit_blocks(slot);
                }
            }
        }
    }

    /// Earliest completion of an in-flight transfer.
    pub(crate) fn next_transfer_ready(&self) -> Option<f64> {
        if self.transferring == 0 {
            return None;
        }
        self.waiting
            .iter()
            .filter_map(|&slot| match self.seq(slot).phase {
                Phase::Transferring { ready_at, .. } => Some(ready_at),
                _ => None,
            })
            .min_by(f64::total_cmp)
    }

    /// Get ready to apply computed tokens to the running requests of
    /// `batch`, given as `(slot, key, new tokens)`: fetch their state and
    /// hash the blocks that fill, so that the cache misses of all of them
    /// overlap instead of being taken one request at a time.
    pub(crate) fn prepare_apply<I>(&mut self, batch: I)
    where
        I: Iterator<Item = (u32, u64, u32)> + Clone,
    {
        for (slot, _, _) in batch.clone() {
            if let Some(entry) = self.slab.get(slot as usize) {
                // The hot line, and the next one with `hashes` for blocks that fill.
                prefetch_lines(entry, 2);
            }
        }
        let bs = self.bs;
        let caching = self.cache.prefix_caching();
        // Blocks the batch may allocate: up to one token past its new end
        // (a run allocates the next step's block ahead).
        let mut new_blocks = 0u32;
        let mut filling = std::mem::take(&mut self.fill_scratch);
        filling.clear();
        for (slot, key, tokens) in batch {
            let Some(s) = self.running_seq(slot, key) else {
                continue;
            };
            let end = s.computed + tokens;
            new_blocks += self
                .cache
                .blocks_for(end + 1)
                .saturating_sub(s.blocks.len() as u32);
            let full = end / bs;
            if caching && s.committed < full {
                // What hashing and committing read first: the parent hash,
                // the first prompt hash to commit, the first block.
                if let Some(h) = s.hashes.last() {
                    prefetch(h);
                }
                if let Some(h) = s.hashes.get(s.committed as usize) {
                    prefetch(h);
                }
                if let Some(b) = s.blocks.get(s.committed as usize) {
                    prefetch(b);
                }
                filling.push((slot, full));
            }
        }
        self.cache.prefetch_allocation(new_blocks);
        for &(slot, full) in &filling {
            self.prepare_commit(slot, full);
        }
        self.fill_scratch = filling;
        self.cache.prefetch_evictions(new_blocks);
    }

    /// The request in `slot` if it is still submission `key` and running.
    pub(crate) fn running_seq(&self, slot: u32, key: u64) -> Option<&Seq> {
        self.slab
            .get(slot as usize)?
            .as_ref()
            .filter(|s| s.key == key && s.phase == Phase::Running)
    }

    /// Hash the first `full` blocks of `slot` and start fetching the index
    /// slots committing them will probe (see [`Scheduler::prepare_apply`]).
    fn prepare_commit(&mut self, slot: u32, full: u32) {
        let Some(s) = self.slab[slot as usize].as_mut() else {
            return;
        };
        let full = full as usize;
        hash_blocks_upto(
            s,
            full,
            self.bs as usize,
            &mut self.tok_scratch,
            &mut self.byte_scratch,
        );
        for &h in s.hashes.get(s.committed as usize..full).unwrap_or(&[]) {
            self.cache.prefetch_commit(h);
        }
    }

    /// Offer newly full, computed blocks of `slot` to the prefix cache (and report them).
    pub(crate) fn commit_blocks(&mut self, slot: u32) {
        if !self.cache.prefix_caching() {
            return;
        }
        let bs = self.bs as usize;
        let emit = self.cache.emits();
        let Some(s) = self.slab[slot as usize].as_mut() else {
            return;
        };
        let full = (s.computed as usize / bs).min(s.blocks.len());
        if (s.committed as usize) >= full {
            return;
        }
        hash_blocks_upto(s, full, bs, &mut self.tok_scratch, &mut self.byte_scratch);
        let mut ev_hashes: Vec<u64> = Vec::new();
        let mut ev_tokens: Vec<u32> = Vec::new();
        let mut ev_parent: Option<u64> = None;
        while (s.committed as usize) < full {
            let k = s.committed as usize;
            let parent = k.checked_sub(1).map(|p| s.hashes[p]);
            let h = s.hashes[k];
            // Blocks past the committed prefix were allocated to this
            // request, never found in the cache: they hold no hash yet.
            let stored = self.cache.commit_computed(s.blocks[k], h);
            if emit {
                if stored {
                    if ev_hashes.is_empty() {
                        ev_parent = parent;
                    }
                    ev_hashes.push(h);
                    ev_tokens.extend((k * bs..(k + 1) * bs).map(|p| s.token_at(p as u32)));
                } else if !ev_hashes.is_empty() {
                    let lora_name = s.adapter.map(|a| self.loras.name(a).to_string());
                    self.cache.push_event(KvEvent::BlockStored {
                        block_hashes: std::mem::take(&mut ev_hashes),
                        parent_block_hash: ev_parent,
                        token_ids: std::mem::take(&mut ev_tokens),
                        block_size: self.bs,
                        lora_name,
                    });
                }
            }
            s.committed += 1;
        }
        if !ev_hashes.is_empty() {
            let lora_name = s.adapter.map(|a| self.loras.name(a).to_string());
            self.cache.push_event(KvEvent::BlockStored {
                block_hashes: ev_hashes,
                parent_block_hash: ev_parent,
                token_ids: ev_tokens,
                block_size: self.bs,
                lora_name,
            });
        }
    }

    /// Apply the completed step `self.plan` at time `end`.
    pub(crate) fn apply_plan(&mut self, end: f64, out: &mut Vec<EngineEvent>) {
        let items = std::mem::take(&mut self.plan.items);
        self.prepare_apply(items.iter().map(|it| (it.slot, it.key, it.tokens)));
        let mut finished_any = false;
        for it in &items {
            let Some(s) = self.slab[it.slot as usize]
                .as_mut()
                .filter(|s| s.key == it.key && s.phase == Phase::Running)
            else {
                continue;
            };
            s.computed += it.tokens;
            let sampled = s.computed >= s.num_tokens();
            self.commit_blocks(it.slot);
            if sampled {
                finished_any |= self.sample(it.slot, end, out);
            }
        }
        self.plan.items = items;
        self.plan.items.clear();
        if finished_any {
            self.drop_dead_running();
        }
    }

    /// Remove freed slots from the running queue.
    pub(crate) fn drop_dead_running(&mut self) {
        let slab = &self.slab;
        self.running.retain(|&s| slab[s as usize].is_some());
    }

    /// The step sampled a token for `slot`; true if that finished it.
    fn sample(&mut self, slot: u32, time: f64, out: &mut Vec<EngineEvent>) -> bool {
        let emit_tokens = self.emit_tokens;
        let s = self.seq_mut(slot);
        let pos = s.output;
        s.output += 1;
        let first = !s.first_token_sent;
        s.first_token_sent = true;
        let (id, prompt_len, cached) = (s.id, s.prompt_len, s.cached_tokens.unwrap_or(0));
        let done = s.kind == Kind::PrefillOnly || s.output >= s.max_tokens;
        self.counters.generation_tokens += 1;
        if first {
            self.counters.prompt_tokens += u64::from(prompt_len);
            out.push(EngineEvent::FirstToken {
                id,
                time,
                prompt_tokens: prompt_len,
                cached_tokens: cached,
            });
        }
        if emit_tokens {
            out.push(EngineEvent::Tokens {
                id,
                time,
                tokens: vec![tokenizer::output_token(id, pos)],
            });
        }
        if done {
            self.finish(slot, time, FinishReason::Length, out);
        }
        done
    }

    /// Release a request and report it finished. The caller removes it from the queues.
    pub(crate) fn finish(
        &mut self,
        slot: u32,
        time: f64,
        reason: FinishReason,
        out: &mut Vec<EngineEvent>,
    ) {
        let Some(s) = self.slab[slot as usize].take() else {
            return;
        };
        self.free_slots.push(slot);
        self.ids.remove(&s.id);
        let kv_transfer =
            (s.kind == Kind::PrefillOnly && reason == FinishReason::Length).then(|| KvTransfer {
                remote_engine_id: self.engine_id.clone(),
                remote_block_ids: s.blocks.clone(),
                remote_request_id: s.id.to_string(),
                num_tokens: s.prompt_len,
            });
        // Prefill-only blocks stay in the prefix cache after release; vLLM
        // would pin them until the decode side has pulled them.
        self.cache.free(&s.blocks);
        if let Some(a) = s.adapter {
            if s.phase == Phase::Running {
                self.loras.stop_running(a);
            }
            self.loras.remove_live(a);
        }
        if matches!(s.phase, Phase::Transferring { .. }) {
            self.transferring -= 1;
        }
        out.push(EngineEvent::Finished {
            id: s.id,
            time,
            prompt_tokens: s.prompt_len,
            cached_tokens: s.cached_tokens.unwrap_or(0),
            completion_tokens: s.output,
            reason,
            kv_transfer,
        });
    }

    /// Abort a live request; false if unknown.
    pub(crate) fn abort(&mut self, id: RequestId, time: f64, out: &mut Vec<EngineEvent>) -> bool {
        let Some(&slot) = self.ids.get(&id) else {
            return false;
        };
        match self.seq(slot).phase {
            Phase::Running => {
                if let Some(p) = self.running.iter().position(|&s| s == slot) {
                    self.running.remove(p);
                }
            }
            Phase::Waiting | Phase::Transferring { .. } => {
                if let Some(p) = self.waiting.iter().position(|&s| s == slot) {
                    self.waiting.remove(p);
                }
            }
        }
        self.finish(slot, time, FinishReason::Abort, out);
        true
    }

    /// Check queues, reference counts and the cache agree.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut refs = vec![0u32; self.cache.num_blocks() as usize];
        let mut live = 0usize;
        let mut transferring = 0u32;
        for (slot, s) in self.slab.iter().enumerate() {
            let Some(s) = s else { continue };
            live += 1;
            if self.ids.get(&s.id) != Some(&(slot as u32)) {
                return Err(format!("request {} missing from the id map", s.id));
            }
            for &b in &s.blocks {
                match refs.get_mut(b as usize) {
                    Some(r) => *r += 1,
                    None => return Err(format!("request {} holds bad block {b}", s.id)),
                }
            }
            if s.computed > s.num_tokens() {
                return Err(format!("request {} computed past its tokens", s.id));
            }
            if (s.blocks.len() as u32) < self.cache.blocks_for(s.computed) {
                return Err(format!("request {} has too few blocks", s.id));
            }
            match s.phase {
                Phase::Running => {
                    if !self.running.contains(&(slot as u32)) {
                        return Err(format!("running request {} not in running queue", s.id));
                    }
                }
                Phase::Transferring { .. } => transferring += 1,
                Phase::Waiting => {
                    if s.pending_transfer.is_none() && s.computed == 0 && !s.blocks.is_empty() {
                        return Err(format!("waiting request {} holds blocks", s.id));
                    }
                }
            }
        }
        if live != self.ids.len() || live != self.running.len() + self.waiting.len() {
            return Err(format!(
                "{live} live requests, {} ids, {} running + {} waiting",
                self.ids.len(),
                self.running.len(),
                self.waiting.len()
            ));
        }
        if transferring != self.transferring {
            return Err("transferring count is stale".into());
        }
        if self.running.len() as u32 > self.max_seqs {
            return Err("more running requests than max_num_seqs".into());
        }
        for &w in &self.waiting {
            if self.seq(w).phase == Phase::Running {
                return Err("running request in waiting queue".into());
            }
        }
        self.cache.check(&refs)
    }
}

/// Extend `s.hashes` to the first `upto` blocks.
///
/// Blocks holding output tokens are hashed once, when they fill (prompt
/// blocks were hashed at submission).
fn hash_blocks_upto(
    s: &mut Seq,
    upto: usize,
    bs: usize,
    tok_scratch: &mut Vec<u32>,
    byte_scratch: &mut Vec<u8>,
) {
    while s.hashes.len() < upto {
        let k = s.hashes.len();
        let parent = k.checked_sub(1).map(|p| s.hashes[p]);
        tok_scratch.clear();
        let (start, end) = ((k * bs) as u32, ((k + 1) * bs) as u32);
        if start >= s.prompt_len {
            // All output: generate the tokens directly.
            let (id, first) = (s.id, start - s.prompt_len);
            tok_scratch
                .extend((first..first + (end - start)).map(|p| tokenizer::output_token(id, p)));
        } else {
            tok_scratch.extend((start..end).map(|pos| s.token_at(pos)));
        }
        let h = hash_block(parent, s.salt, tok_scratch, byte_scratch);
        s.hashes.push(h);
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::{drive, find, req, small_config, tokens, Act};
    use crate::{Engine, EngineConfig, EngineEvent, EngineRequest, FinishReason, SubmitError};

    fn time(e: &EngineEvent) -> f64 {
        e.time()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn lone_request_prefills_then_decodes_one_token_per_step() {
        let cfg = small_config();
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        let ev = drive(&mut e, vec![(1.0, Act::Submit(req(1, 1, 100, 5)))]);
        let t1 = 1.0 + p.step_base_s + p.chunk_time(0, 100);
        assert!(close(time(find(&ev, 1, "first")), t1));
        let mut t = t1;
        for i in 1..=4u64 {
            t += p.step_base_s + p.decode_token_time(100 + i);
        }
        match find(&ev, 1, "finished") {
            EngineEvent::Finished {
                time,
                completion_tokens,
                cached_tokens,
                prompt_tokens,
                reason,
                ..
            } => {
                assert!(close(*time, t), "{time} vs {t}");
                assert_eq!(*completion_tokens, 5);
                assert_eq!(*cached_tokens, 0);
                assert_eq!(*prompt_tokens, 100);
                assert_eq!(*reason, FinishReason::Length);
            }
            _ => unreachable!(),
        }
        let m = e.metrics();
        assert_eq!(m.generation_tokens_total, 5);
        assert_eq!(m.prompt_tokens_total, 100);
        assert_eq!(m.kv_cache_usage, 0.0);
    }

    #[test]
    fn long_prompt_is_prefilled_in_budget_sized_chunks() {
        let cfg = small_config(); // budget 512
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        let ev = drive(&mut e, vec![(0.0, Act::Submit(req(1, 1, 1200, 1)))]);
        let want = 3.0 * p.step_base_s
            + p.chunk_time(0, 512)
            + p.chunk_time(512, 512)
            + p.chunk_time(1024, 176);
        assert!(close(time(find(&ev, 1, "first")), want));
        assert!(close(time(find(&ev, 1, "finished")), want));
    }

    #[test]
    fn simultaneous_arrivals_share_the_first_step() {
        let cfg = small_config();
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        let ev = drive(
            &mut e,
            vec![
                (0.5, Act::Submit(req(1, 1, 100, 2))),
                (0.5, Act::Submit(req(2, 2, 200, 2))),
            ],
        );
        let want = 0.5 + p.step_base_s + p.chunk_time(0, 100) + p.chunk_time(0, 200);
        assert!(close(time(find(&ev, 1, "first")), want));
        assert!(close(time(find(&ev, 2, "first")), want));
    }

    #[test]
    fn arrival_during_a_step_joins_at_its_end() {
        let cfg = small_config();
        let p = cfg.profile.clone();
        let mut e = Engine::new(cfg).unwrap();
        let ev = drive(
            &mut e,
            vec![
                (0.0, Act::Submit(req(1, 1, 300, 3))),
                (0.001, Act::Submit(req(2, 2, 100, 3))),
            ],
        );
        let t1 = p.step_base_s + p.chunk_time(0, 300);
        assert!(close(time(find(&ev, 1, "first")), t1));
        // Step 2 decodes request 1 and prefills request 2.
        let t2 = t1 + p.step_base_s + p.decode_token_time(301) + p.chunk_time(0, 100);
        assert!(close(time(find(&ev, 2, "first")), t2));
    }

    #[test]
    fn max_num_seqs_bounds_the_running_batch() {
        let cfg = EngineConfig {
            max_num_seqs: 2,
            ..small_config()
        };
        let mut e = Engine::new(cfg).unwrap();
        for id in 0..3 {
            e.submit(req(id, id as u32, 50, 10), 0.0).unwrap();
        }
        let mut out = Vec::new();
        e.advance(0.0, &mut out);
        let m = e.metrics();
        assert_eq!((m.num_requests_running, m.num_requests_waiting), (2, 1));
        let t = e.next_event_time().unwrap();
        e.advance(t, &mut out);
        assert_eq!(e.metrics().num_requests_running, 2);
        while let Some(t) = e.next_event_time() {
            e.advance(t, &mut out);
        }
        let done = out
            .iter()
            .filter(|e| matches!(e, EngineEvent::Finished { .. }))
            .count();
        assert_eq!(done, 3);
        // The third request only started once one of the first two finished.
        let first3 = time(find(&out, 2, "first"));
        let fin0 = time(find(&out, 0, "finished"));
        assert!(first3 > fin0);
    }

    #[test]
    fn prefix_cache_reuses_full_blocks_but_recomputes_one_token() {
        let mut e = Engine::new(small_config()).unwrap();
        let ev = drive(
            &mut e,
            vec![
                (0.0, Act::Submit(req(1, 7, 100, 1))),
                (1.0, Act::Submit(req(2, 7, 100, 1))),
                (2.0, Act::Submit(req(3, 9, 32, 1))),
                (3.0, Act::Submit(req(4, 9, 32, 1))),
                // Same first 64 tokens as request 1, then different.
                (
                    4.0,
                    Act::Submit(EngineRequest {
                        prompt_tokens: {
                            let mut v = tokens(7, 64).to_vec();
                            v.extend_from_slice(&tokens(8, 50));
                            v.into()
                        },
                        ..req(5, 0, 1, 1)
                    }),
                ),
            ],
        );
        let cached = |id| match find(&ev, id, "first") {
            EngineEvent::FirstToken { cached_tokens, .. } => *cached_tokens,
            _ => unreachable!(),
        };
        assert_eq!(cached(1), 0);
        assert_eq!(cached(2), 96, "floor(99/16) blocks");
        assert_eq!(cached(3), 0);
        assert_eq!(
            cached(4),
            16,
            "a fully cached 32-token prompt still computes its last block"
        );
        assert_eq!(cached(5), 64);
        let m = e.metrics();
        assert_eq!(m.prefix_cache_queries, 100 + 100 + 32 + 32 + 114);
        assert_eq!(m.prefix_cache_hits, 96 + 16 + 64);
        // Cached-but-free blocks do not count as used.
        assert_eq!(m.kv_cache_usage, 0.0);
    }

    #[test]
    fn adapters_do_not_share_cached_blocks() {
        let cfg = EngineConfig {
            max_loras: 2,
            ..small_config()
        };
        let mut e = Engine::new(cfg).unwrap();
        e.register_adapter("x");
        let with = |id| EngineRequest {
            adapter: Some("x".into()),
            ..req(id, 3, 64, 1)
        };
        let ev = drive(
            &mut e,
            vec![
                (0.0, Act::Submit(with(1))),
                (1.0, Act::Submit(req(2, 3, 64, 1))),
                (2.0, Act::Submit(with(3))),
            ],
        );
        let cached = |id| match find(&ev, id, "first") {
            EngineEvent::FirstToken { cached_tokens, .. } => *cached_tokens,
            _ => unreachable!(),
        };
        assert_eq!((cached(1), cached(2), cached(3)), (0, 0, 48));
    }

    #[test]
    fn newest_running_request_is_preempted_and_recomputed() {
        let cfg = EngineConfig {
            num_gpu_blocks: 16,
            max_model_len: 256,
            enable_prefix_caching: false,
            ..small_config()
        };
        let mut e = Engine::new(cfg).unwrap();
        let acts = (0..4)
            .map(|id| (0.0, Act::Submit(req(id, id as u32, 40, 60))))
            .collect();
        let ev = drive(&mut e, acts);
        let first_preempted = ev
            .iter()
            .find(|e| matches!(e, EngineEvent::Preempted { .. }))
            .expect("the cache is too small for all four");
        assert_eq!(first_preempted.id(), 3);
        for id in 0..4 {
            match find(&ev, id, "finished") {
                EngineEvent::Finished {
                    completion_tokens,
                    reason,
                    ..
                } => assert_eq!((*completion_tokens, *reason), (60, FinishReason::Length)),
                _ => unreachable!(),
            }
            // One FirstToken per request even when recomputed.
            let firsts = ev
                .iter()
                .filter(|x| x.id() == id && matches!(x, EngineEvent::FirstToken { .. }))
                .count();
            assert_eq!(firsts, 1);
        }
        let m = e.metrics();
        assert!(m.num_preemptions >= 1);
        // Recompute samples the next token, never a duplicate.
        assert_eq!(m.generation_tokens_total, 4 * 60);
        assert_eq!(m.kv_cache_usage, 0.0);
    }

    #[test]
    fn abort_releases_running_and_waiting_requests() {
        let cfg = EngineConfig {
            max_num_seqs: 1,
            ..small_config()
        };
        let mut e = Engine::new(cfg).unwrap();
        let ev = drive(
            &mut e,
            vec![
                (0.0, Act::Submit(req(1, 1, 100, 1000))),
                (0.0, Act::Submit(req(2, 2, 100, 10))),
                (0.5, Act::Abort(2)),
                (1.0, Act::Abort(1)),
            ],
        );
        match find(&ev, 1, "finished") {
            EngineEvent::Finished {
                reason,
                completion_tokens,
                time,
                ..
            } => {
                assert_eq!(*reason, FinishReason::Abort);
                assert!(*completion_tokens > 10 && *completion_tokens < 1000);
                assert_eq!(*time, 1.0);
            }
            _ => unreachable!(),
        }
        match find(&ev, 2, "finished") {
            EngineEvent::Finished {
                reason,
                completion_tokens,
                ..
            } => assert_eq!((*reason, *completion_tokens), (FinishReason::Abort, 0)),
            _ => unreachable!(),
        }
        assert!(!e.abort(1, 2.0), "already gone");
        assert_eq!(e.metrics().kv_cache_usage, 0.0);
        assert_eq!(e.num_live_requests(), 0);
    }

    #[test]
    fn submit_rejects_invalid_requests() {
        let mut e = Engine::new(small_config()).unwrap(); // max_model_len 2048
        let empty = EngineRequest {
            prompt_tokens: Vec::new().into(),
            ..req(1, 1, 1, 1)
        };
        assert_eq!(e.submit(empty, 0.0), Err(SubmitError::EmptyPrompt));
        assert_eq!(
            e.submit(req(1, 1, 10, 0), 0.0),
            Err(SubmitError::ZeroMaxTokens)
        );
        assert!(matches!(
            e.submit(req(1, 1, 2000, 49), 0.0),
            Err(SubmitError::TooLong { .. })
        ));
        e.submit(req(1, 1, 2000, 48), 0.0).unwrap();
        assert_eq!(
            e.submit(req(1, 1, 10, 1), 0.0),
            Err(SubmitError::DuplicateId(1))
        );
        let unknown = EngineRequest {
            adapter: Some("nope".into()),
            ..req(2, 1, 10, 1)
        };
        assert_eq!(
            e.submit(unknown, 0.0),
            Err(SubmitError::UnknownAdapter("nope".into()))
        );
        let mut no_lora = Engine::new(EngineConfig {
            max_loras: 0,
            ..small_config()
        })
        .unwrap();
        no_lora.register_adapter("a");
        let with = EngineRequest {
            adapter: Some("a".into()),
            ..req(2, 1, 10, 1)
        };
        assert_eq!(no_lora.submit(with, 0.0), Err(SubmitError::LoraDisabled));
        // A refused request leaves no trace.
        assert_eq!(e.num_live_requests(), 1);
        e.check_invariants().unwrap();
    }

    #[test]
    fn non_finite_times_do_not_panic() {
        let mut e = Engine::new(small_config()).unwrap();
        e.submit(req(1, 1, 10, 3), f64::NAN).unwrap();
        let mut out = Vec::new();
        e.advance(f64::NAN, &mut out);
        e.advance(f64::INFINITY, &mut out);
        assert!(out
            .iter()
            .any(|x| matches!(x, EngineEvent::Finished { .. })));
        assert!(e.next_event_time().is_none());
    }
}
