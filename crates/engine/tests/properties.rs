//! Property tests of the engine model through its public API.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use proptest::prelude::*;
use switchyard_engine::{
    tokenizer, Engine, EngineConfig, EngineEvent, EngineRequest, FinishReason, KvEvent, KvTransfer,
    Profile, RequestId, RequestMode, Role,
};

// ---------------------------------------------------------------- workloads

/// One generated request and what happens to it.
#[derive(Debug, Clone)]
struct Spec {
    /// Gap since the previous arrival, seconds.
    gap: f64,
    /// Prefix group (shared leading tokens) and its length in tokens.
    group: u32,
    shared: usize,
    /// Unique tail length.
    tail: usize,
    max_tokens: u32,
    adapter: Option<u8>,
    /// 0 normal, 1 prefill-only, 2 decode-after-transfer.
    mode: u8,
    /// Abort this long after arrival, if set.
    abort_after: Option<f64>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        0.0f64..0.2,
        0u32..3,
        0usize..120,
        1usize..100,
        1u32..80,
        prop::option::weighted(0.3, 0u8..3),
        prop::sample::select(vec![0u8, 0, 0, 1, 2]),
        prop::option::weighted(0.2, 0.0f64..1.0),
    )
        .prop_map(
            |(gap, group, shared, tail, max_tokens, adapter, mode, abort_after)| Spec {
                gap,
                group,
                shared,
                tail,
                max_tokens,
                adapter,
                mode,
                abort_after,
            },
        )
}

/// A small engine configuration (small enough to preempt and evict).
#[derive(Debug, Clone)]
struct Cfg {
    blocks: u32,
    block_size: u32,
    max_seqs: u32,
    budget: u32,
    caching: bool,
    max_loras: u32,
}

fn cfg() -> impl Strategy<Value = Cfg> {
    (
        24u32..80,
        prop::sample::select(vec![4u32, 16]),
        1u32..8,
        16u32..300,
        any::<bool>(),
        0u32..3,
    )
        .prop_map(
            |(blocks, block_size, max_seqs, budget, caching, max_loras)| Cfg {
                blocks,
                block_size,
                max_seqs,
                budget: budget.max(max_seqs),
                caching,
                max_loras,
            },
        )
}

impl Cfg {
    fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            num_gpu_blocks: self.blocks,
            block_size: self.block_size,
            max_num_seqs: self.max_seqs,
            max_num_batched_tokens: self.budget,
            max_model_len: (self.blocks * self.block_size).min(384),
            enable_prefix_caching: self.caching,
            max_loras: self.max_loras,
            lora_load_time_s: 0.05,
            kv_bytes_per_token: 1e4,
            kv_transfer_bandwidth_bytes_per_s: 1e7,
            emit_kv_events: true,
            engine_id: "e0".into(),
            ..EngineConfig::default()
        }
    }
}

fn prompt(group: u32, shared: usize, id: u64, tail: usize) -> Arc<[u32]> {
    let mut v: Vec<u32> = (0..shared as u32).map(|i| group * 10_000 + i).collect();
    v.extend((0..tail as u32).map(|i| 1_000_000 + (id as u32) * 1000 + i));
    v.into()
}

/// Something the driver does at a time.
#[derive(Debug, Clone)]
enum Act {
    Submit(EngineRequest),
    Abort(RequestId),
    /// Advance to this time only (like a metrics scrape).
    Probe,
}

/// Build a timeline of actions from specs, fitting requests to the config.
fn timeline(specs: &[Spec], c: &Cfg, probes: &[f64]) -> Vec<(f64, Act)> {
    let max_len = (c.blocks * c.block_size).min(384) as usize;
    let mut t = 0.0;
    let mut acts = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        t += s.gap;
        let id = i as u64;
        let p = prompt(s.group, s.shared, id, s.tail);
        let p: Arc<[u32]> = if p.len() >= max_len {
            p[..max_len - 1].into()
        } else {
            p
        };
        let max_tokens = s.max_tokens.min((max_len - p.len()) as u32).max(1);
        let adapter = if c.max_loras > 0 {
            s.adapter.map(|a| format!("lora{a}"))
        } else {
            None
        };
        let mode = match s.mode {
            1 => RequestMode::PrefillOnly,
            2 => RequestMode::DecodeAfterTransfer(KvTransfer {
                remote_engine_id: "p".into(),
                remote_block_ids: vec![],
                remote_request_id: id.to_string(),
                num_tokens: p.len() as u32,
            }),
            _ => RequestMode::Normal,
        };
        acts.push((
            t,
            Act::Submit(EngineRequest {
                id,
                prompt_tokens: p,
                max_tokens,
                adapter,
                mode,
            }),
        ));
        if let Some(a) = s.abort_after {
            acts.push((t + a, Act::Abort(id)));
        }
    }
    for &p in probes {
        acts.push((p, Act::Probe));
    }
    acts.sort_by(|a, b| a.0.total_cmp(&b.0));
    acts
}

fn new_engine(c: &Cfg, step_by_step: bool) -> Engine {
    let mut e = Engine::new(c.engine_config()).expect("generated configs are valid");
    for a in 0..3 {
        e.register_adapter(&format!("lora{a}"));
    }
    e.set_step_by_step(step_by_step);
    e
}

/// What a run produced, and checks made along the way.
struct Outcome {
    events: Vec<EngineEvent>,
    kv: Vec<KvEvent>,
    submitted: Vec<RequestId>,
}

/// Drive `engine` through `acts`, then to completion, checking invariants at every stop.
fn drive(engine: &mut Engine, acts: &[(f64, Act)]) -> Result<Outcome, TestCaseError> {
    let mut out = Vec::new();
    let mut kv = Vec::new();
    let mut submitted = Vec::new();
    let check = |e: &mut Engine, kv: &mut Vec<KvEvent>| -> Result<(), TestCaseError> {
        e.check_invariants().map_err(TestCaseError::fail)?;
        let m = e.metrics();
        prop_assert!((0.0..=1.0).contains(&m.kv_cache_usage));
        prop_assert!(m.num_requests_running <= e.config().max_num_seqs);
        e.drain_kv_events(kv);
        Ok(())
    };
    for (t, act) in acts {
        while let Some(te) = engine.next_event_time() {
            if te >= *t {
                break;
            }
            engine.advance(te, &mut out);
            check(engine, &mut kv)?;
        }
        match act {
            Act::Submit(r) => {
                engine
                    .submit(r.clone(), *t)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                submitted.push(r.id);
            }
            Act::Abort(id) => {
                engine.abort(*id, *t);
            }
            Act::Probe => engine.advance(*t, &mut out),
        }
        check(engine, &mut kv)?;
    }
    let mut guard = 0u64;
    while let Some(te) = engine.next_event_time() {
        engine.advance(te, &mut out);
        check(engine, &mut kv)?;
        guard += 1;
        prop_assert!(guard < 1_000_000, "engine does not settle");
    }
    Ok(Outcome {
        events: out,
        kv,
        submitted,
    })
}

fn rel_close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-3)
}

// ---------------------------------------------------------------- properties

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Every block is released and every request finishes exactly once,
    /// whatever the mix of preemptions, aborts, adapters and roles.
    #[test]
    fn no_block_leaks(c in cfg(), specs in prop::collection::vec(spec(), 1..25),
                      probes in prop::collection::vec(0.0f64..3.0, 0..5), step in any::<bool>()) {
        let mut e = new_engine(&c, step);
        let acts = timeline(&specs, &c, &probes);
        let o = drive(&mut e, &acts)?;
        let m = e.metrics();
        prop_assert_eq!(m.kv_cache_usage, 0.0);
        prop_assert_eq!(m.num_requests_running + m.num_requests_waiting, 0);
        prop_assert_eq!(e.num_live_requests(), 0);
        let mut finished: HashMap<RequestId, u32> = HashMap::new();
        for ev in &o.events {
            if let EngineEvent::Finished { id, .. } = ev {
                *finished.entry(*id).or_default() += 1;
            }
        }
        for id in &o.submitted {
            prop_assert_eq!(finished.get(id), Some(&1), "request {}", id);
        }
        // Once everything is free the cache can be reset.
        prop_assert!(e.reset_prefix_cache());
        // Stored and removed events pair up: what is removed was stored.
        let mut live: HashSet<u64> = HashSet::new();
        for ev in &o.kv {
            match ev {
                KvEvent::BlockStored { block_hashes, .. } => {
                    for h in block_hashes { prop_assert!(live.insert(*h)); }
                }
                KvEvent::BlockRemoved { block_hashes } => {
                    for h in block_hashes { prop_assert!(live.remove(h)); }
                }
                KvEvent::AllBlocksCleared => live.clear(),
            }
        }
    }

    /// Same inputs, same outputs: events and KV events are identical across runs.
    #[test]
    fn deterministic(c in cfg(), specs in prop::collection::vec(spec(), 1..20), step in any::<bool>()) {
        let acts = timeline(&specs, &c, &[]);
        let a = drive(&mut new_engine(&c, step), &acts)?;
        let b = drive(&mut new_engine(&c, step), &acts)?;
        prop_assert_eq!(a.events, b.events);
        prop_assert_eq!(a.kv, b.kv);
    }

    /// Fast-forward and step-by-step produce the same request events
    /// (times within 1e-9 relative), including around aborts and scrapes.
    #[test]
    fn fast_forward_matches_step_by_step(c in cfg(), specs in prop::collection::vec(spec(), 1..25),
                                         probes in prop::collection::vec(0.0f64..3.0, 0..8)) {
        let acts = timeline(&specs, &c, &probes);
        let ff = drive(&mut new_engine(&c, false), &acts)?;
        let st = drive(&mut new_engine(&c, true), &acts)?;
        prop_assert_eq!(ff.events.len(), st.events.len());
        for (a, b) in ff.events.iter().zip(&st.events) {
            prop_assert!(rel_close(a.time(), b.time()), "{:?} vs {:?}", a, b);
            match (a, b) {
                (EngineEvent::Finished { id: i1, prompt_tokens: p1, cached_tokens: c1, completion_tokens: n1,
                                         reason: r1, kv_transfer: k1, .. },
                 EngineEvent::Finished { id: i2, prompt_tokens: p2, cached_tokens: c2, completion_tokens: n2,
                                         reason: r2, kv_transfer: k2, .. }) => {
                    prop_assert_eq!((i1, p1, c1, n1, r1), (i2, p2, c2, n2, r2));
                    // Physical block ids may differ; what was transferred may not.
                    prop_assert_eq!(k1.as_ref().map(|k| k.num_tokens), k2.as_ref().map(|k| k.num_tokens));
                }
                (EngineEvent::FirstToken { id: i1, cached_tokens: c1, .. },
                 EngineEvent::FirstToken { id: i2, cached_tokens: c2, .. }) => {
                    prop_assert_eq!((i1, c1), (i2, c2));
                }
                (EngineEvent::Preempted { id: i1, .. }, EngineEvent::Preempted { id: i2, .. }) => {
                    prop_assert_eq!(i1, i2);
                }
                _ => prop_assert!(false, "{:?} vs {:?}", a, b),
            }
        }
        let (ma, mb) = (ff_metrics(&c, &acts)?, st_metrics(&c, &acts)?);
        prop_assert_eq!(ma, mb);
    }
}

fn ff_metrics(c: &Cfg, acts: &[(f64, Act)]) -> Result<(u64, u64, u64, u64), TestCaseError> {
    metrics_after(c, acts, false)
}

fn st_metrics(c: &Cfg, acts: &[(f64, Act)]) -> Result<(u64, u64, u64, u64), TestCaseError> {
    metrics_after(c, acts, true)
}

fn metrics_after(
    c: &Cfg,
    acts: &[(f64, Act)],
    step: bool,
) -> Result<(u64, u64, u64, u64), TestCaseError> {
    let mut e = new_engine(c, step);
    drive(&mut e, acts)?;
    let m = e.metrics();
    Ok((
        m.prefix_cache_queries,
        m.prefix_cache_hits,
        m.generation_tokens_total,
        m.num_preemptions,
    ))
}

// ------------------------------------------------- cached tokens vs reference

/// A naive model of the prefix cache for one request at a time: the free
/// queue as a list of block contents (the token prefix they end, plus the
/// adapter), LRU order, evicting from the front, freeing tail-first.
struct RefCache {
    bs: usize,
    budget: usize,
    queue: VecDeque<Option<(Option<String>, Vec<u32>)>>,
}

impl RefCache {
    fn new(blocks: usize, bs: usize, budget: usize) -> Self {
        Self {
            bs,
            budget,
            queue: (0..blocks).map(|_| None).collect(),
        }
    }

    fn present(&self, key: &(Option<String>, Vec<u32>)) -> bool {
        self.queue.iter().any(|e| e.as_ref() == Some(key))
    }

    /// Run one request alone to completion; returns its cached tokens.
    fn run(&mut self, id: u64, prompt: &[u32], max_tokens: u32, adapter: Option<String>) -> usize {
        let bs = self.bs;
        let p = prompt.len();
        let mut all = prompt.to_vec();
        all.extend((0..max_tokens).map(|k| tokenizer::output_token(id, k)));
        let key = |k: usize| (adapter.clone(), all[..(k + 1) * bs].to_vec());
        let max_hit = (p - 1) / bs;
        let mut held: Vec<Option<(Option<String>, Vec<u32>)>> = Vec::new();
        while held.len() < max_hit && self.present(&key(held.len())) {
            let k = key(held.len());
            let pos = self
                .queue
                .iter()
                .position(|e| e.as_ref() == Some(&k))
                .unwrap();
            self.queue.remove(pos);
            held.push(Some(k));
        }
        let hit = held.len();
        let last = p + max_tokens as usize - 1; // tokens whose KV is ever computed
        let mut f = hit * bs;
        let mut committed = hit;
        while f < last {
            let c = if f < p { (p - f).min(self.budget) } else { 1 };
            let need = (f + c).div_ceil(bs).saturating_sub(held.len());
            for _ in 0..need {
                self.queue.pop_front().expect("request fits");
                held.push(None);
            }
            f += c;
            while committed < f / bs {
                let k = key(committed);
                if !self.present(&k) && !held.contains(&Some(k.clone())) {
                    held[committed] = Some(k);
                }
                committed += 1;
            }
        }
        for e in held.into_iter().rev() {
            self.queue.push_back(e);
        }
        hit * bs
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Requests submitted one after another report exactly the cached
    /// tokens a naive LRU model of the cache predicts.
    #[test]
    fn cached_tokens_match_reference(
        blocks in 12u32..48,
        bs in prop::sample::select(vec![2u32, 4, 16]),
        budget in 8u32..200,
        reqs in prop::collection::vec(
            (prop::collection::vec(0u32..3, 1..12), 0usize..20, 1u32..30, any::<bool>()), 1..25),
    ) {
        let max_len = (blocks * bs).min(256) as usize;
        let cfg = EngineConfig {
            num_gpu_blocks: blocks,
            block_size: bs,
            max_num_seqs: 4,
            max_num_batched_tokens: budget.max(4),
            max_model_len: max_len as u32,
            max_loras: 1,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg).unwrap();
        e.register_adapter("a");
        let mut reference = RefCache::new(blocks as usize, bs as usize, budget.max(4) as usize);
        let mut t = 0.0;
        let mut out = Vec::new();
        for (i, (segments, extra, max_tokens, lora)) in reqs.into_iter().enumerate() {
            // Prompts from a tiny alphabet of 8-token segments share many prefixes.
            let mut p: Vec<u32> = segments.iter()
                .flat_map(|&s| (0..8).map(move |k| s * 100 + k)).collect();
            p.extend((0..extra as u32).map(|k| 50_000 + i as u32 * 100 + k));
            p.truncate(max_len - 1);
            let max_tokens = max_tokens.min((max_len - p.len()) as u32);
            let adapter = lora.then(|| "a".to_string());
            let want = reference.run(i as u64, &p, max_tokens, adapter.clone());
            e.submit(EngineRequest {
                id: i as u64,
                prompt_tokens: p.into(),
                max_tokens,
                adapter,
                mode: RequestMode::Normal,
            }, t).unwrap();
            out.clear();
            while let Some(te) = e.next_event_time() {
                e.advance(te, &mut out);
                t = te;
            }
            let got = out.iter().find_map(|ev| match ev {
                EngineEvent::FirstToken { cached_tokens, .. } => Some(*cached_tokens as usize),
                _ => None,
            });
            prop_assert_eq!(got, Some(want), "request {}", i);
            t += 1.0;
        }
    }
}

// ------------------------------------------------- timing follows the profile

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    /// An isolated request's TTFT is the profile's prefill time for its
    /// uncached tokens (chunked by the budget), and its decode steps each
    /// take one profile step time.
    #[test]
    fn isolated_request_follows_profile(
        prompt_len in 1usize..6000,
        shared in 0usize..6000,
        max_tokens in 2u32..200,
        budget in prop::sample::select(vec![512u32, 2048, 8192]),
        base_ms in 1.0f64..10.0,
    ) {
        let profile = Profile { step_base_s: base_ms / 1e3, ..Profile::h100_llama8b() };
        let cfg = EngineConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: 64,
            emit_token_events: true,
            profile: profile.clone(),
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg).unwrap();
        let shared = shared.min(prompt_len);
        // Prime the cache with the shared prefix (a different continuation).
        let primer: Vec<u32> = (0..shared as u32).chain([u32::MAX]).collect();
        e.submit(EngineRequest { id: 0, prompt_tokens: primer.into(), max_tokens: 1,
                                 adapter: None, mode: RequestMode::Normal }, 0.0).unwrap();
        let mut out = Vec::new();
        while let Some(te) = e.next_event_time() { e.advance(te, &mut out); }
        let p: Vec<u32> = (0..prompt_len as u32).collect();
        let expect_cached = ((shared / 16).min((prompt_len - 1) / 16) * 16) as u64;
        let t0 = 100.0;
        e.submit(EngineRequest { id: 1, prompt_tokens: p.into(), max_tokens,
                                 adapter: None, mode: RequestMode::Normal }, t0).unwrap();
        out.clear();
        while let Some(te) = e.next_event_time() { e.advance(te, &mut out); }
        let mut first = None;
        let mut token_times = Vec::new();
        for ev in &out {
            match ev {
                EngineEvent::FirstToken { time, cached_tokens, .. } => {
                    prop_assert_eq!(u64::from(*cached_tokens), expect_cached);
                    first = Some(*time);
                }
                EngineEvent::Tokens { time, .. } => token_times.push(*time),
                EngineEvent::Finished { reason, completion_tokens, .. } => {
                    prop_assert_eq!(*reason, FinishReason::Length);
                    prop_assert_eq!(*completion_tokens, max_tokens);
                }
                _ => {}
            }
        }
        let ttft = first.unwrap() - t0;
        let want = profile.isolated_prefill_time(prompt_len as u64, expect_cached, u64::from(budget));
        prop_assert!(rel_close(ttft, want), "ttft {} want {}", ttft, want);
        // Decode: the gap before output token k+1 is one step at context prompt_len + k.
        prop_assert_eq!(token_times.len(), max_tokens as usize);
        for (k, w) in token_times.windows(2).enumerate() {
            let step = profile.decode_step_time(1, prompt_len as u64 + k as u64 + 1);
            prop_assert!(rel_close(w[1] - w[0], step), "gap {} step {}", w[1] - w[0], step);
        }
    }

    /// N lone-ish identical decoders run in lock-step: the batch's step time
    /// is the profile's decode step for N sequences.
    #[test]
    fn batch_decode_rate_follows_profile(n in 1u64..64, ctx in 16usize..2000) {
        let profile = Profile::h100_llama8b();
        // A budget large enough to prefill everyone in the first step.
        let cfg = EngineConfig { max_num_seqs: 64, max_num_batched_tokens: 200_000, ..EngineConfig::default() };
        let mut e = Engine::new(cfg).unwrap();
        for id in 0..n {
            let p: Vec<u32> = (0..ctx as u32).map(|t| t + id as u32 * 100_000).collect();
            e.submit(EngineRequest { id, prompt_tokens: p.into(), max_tokens: 101,
                                     adapter: None, mode: RequestMode::Normal }, 0.0).unwrap();
        }
        let mut out = Vec::new();
        while let Some(te) = e.next_event_time() { e.advance(te, &mut out); }
        let first = out.iter().find_map(|e| match e { EngineEvent::FirstToken { time, .. } => Some(*time), _ => None }).unwrap();
        let fin = out.iter().find_map(|e| match e { EngineEvent::Finished { time, .. } => Some(*time), _ => None }).unwrap();
        // 100 decode steps; at step i each context is ctx + i.
        let want: f64 = (1..=100u64).map(|i| profile.decode_step_time(n, n * (ctx as u64 + i))).sum();
        prop_assert!(rel_close(fin - first, want), "{} vs {}", fin - first, want);
    }
}

/// Role errors surface through the public API (a quick sanity check of the re-exports).
#[test]
fn roles_are_enforced() {
    let engine = |role| {
        Engine::new(EngineConfig {
            role,
            ..EngineConfig::default()
        })
        .unwrap()
    };
    let request = |id, mode| EngineRequest {
        id,
        prompt_tokens: vec![1, 2, 3].into(),
        max_tokens: 1,
        adapter: None,
        mode,
    };
    // A decode instance refuses a prefill leg but runs a plain request whole, as vLLM's do.
    let mut d = engine(Role::Decode);
    assert!(d.submit(request(1, RequestMode::PrefillOnly), 0.0).is_err());
    assert!(d.submit(request(2, RequestMode::Normal), 0.0).is_ok());
    // A prefill instance runs only prefill legs.
    let mut p = engine(Role::Prefill);
    assert!(p.submit(request(3, RequestMode::Normal), 0.0).is_err());
    assert!(p.submit(request(4, RequestMode::PrefillOnly), 0.0).is_ok());
}
