//! Times the engine model under the simulator's benchmark load: many engines
//! fed a shared-prefix stream (256 groups of a 2,048-token system prompt plus
//! a private 128-token question, 256 output tokens), Poisson arrivals, each
//! request routed to one of its group's engines (as a prefix-aware router
//! would), fast-forward on.
//!
//! ```text
//! cargo run --release -p switchyard-engine --example churn -- [N] [engines] [rate/s total]
//! ```
//! Defaults: 20,000 requests on 1,000 engines at 10,000 requests/s.
//! Environment knobs: `GROUPS` (256), `SPREAD` (fraction of requests sent to
//! a random engine instead, default 0.05), `BLOCKS` (KV blocks per engine,
//! default the engine default of 27,000), `EMIT_KV=1` (record KV events too),
//! `PD=1` (route every fourth request as a prefill-only request plus its
//! decode-side half on another engine).
//!
//! Prints wall and on-CPU time, requests/s, peak RSS, and a fingerprint of
//! every event produced (kinds, ids, exact time bits, token counts, KV event
//! contents), so two builds can be checked to behave identically.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Instant;

use switchyard_engine::{
    Engine, EngineConfig, EngineEvent, EngineRequest, KvEvent, KvTransfer, RequestMode,
};

/// Total order on event times for the heap.
struct T(f64);
impl PartialEq for T {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o).is_eq()
    }
}
impl Eq for T {}
impl PartialOrd for T {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for T {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// FNV-1a over u64 words: a cheap, order-sensitive fingerprint of the event stream.
struct Fingerprint(u64);
impl Fingerprint {
    fn add(&mut self, x: u64) {
        for b in x.to_le_bytes() {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }
}

/// SplitMix64: deterministic pseudo-random numbers for routing and arrivals.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64).max(1e-12)
    }
}

const SYSTEM_LEN: u32 = 2048;
const QUESTION_LEN: u32 = 128;
const OUTPUT_LEN: u32 = 256;

fn prompt(group: u32, id: u64) -> Arc<[u32]> {
    let mut v: Vec<u32> = Vec::with_capacity((SYSTEM_LEN + QUESTION_LEN) as usize);
    v.extend((0..SYSTEM_LEN).map(|t| (group << 16) | t));
    v.extend((0..QUESTION_LEN).map(|t| (id as u32).wrapping_mul(0x9E37_79B9) ^ (t << 24) ^ 1));
    v.into()
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn fingerprint_event(fp: &mut Fingerprint, ev: &EngineEvent, engine: usize) {
    fp.add(engine as u64);
    fp.add(ev.id());
    fp.add(ev.time().to_bits());
    match ev {
        EngineEvent::FirstToken {
            prompt_tokens,
            cached_tokens,
            ..
        } => {
            fp.add(1);
            fp.add(u64::from(*prompt_tokens));
            fp.add(u64::from(*cached_tokens));
        }
        EngineEvent::Finished {
            prompt_tokens,
            cached_tokens,
            completion_tokens,
            reason,
            kv_transfer,
            ..
        } => {
            fp.add(2);
            fp.add(u64::from(*prompt_tokens));
            fp.add(u64::from(*cached_tokens));
            fp.add(u64::from(*completion_tokens));
            fp.add(*reason as u64);
            if let Some(kv) = kv_transfer {
                fp.add(u64::from(kv.num_tokens));
                for &b in &kv.remote_block_ids {
                    fp.add(u64::from(b));
                }
            }
        }
        EngineEvent::Preempted { .. } => fp.add(3),
        EngineEvent::Tokens { tokens, .. } => {
            fp.add(4);
            for &t in tokens {
                fp.add(u64::from(t));
            }
        }
    }
}

fn fingerprint_kv(fp: &mut Fingerprint, ev: &KvEvent) {
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_name,
        } => {
            fp.add(10);
            for &h in block_hashes {
                fp.add(h);
            }
            fp.add(parent_block_hash.unwrap_or(0));
            fp.add(token_ids.len() as u64);
            for &t in token_ids {
                fp.add(u64::from(t));
            }
            fp.add(u64::from(*block_size));
            fp.add(lora_name.as_ref().map_or(0, |n| n.len() as u64));
        }
        KvEvent::BlockRemoved { block_hashes } => {
            fp.add(11);
            for &h in block_hashes {
                fp.add(h);
            }
        }
        KvEvent::AllBlocksCleared => fp.add(12),
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let num_engines: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let rate: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(10_000.0);
    let groups: u32 = env("GROUPS", 256);
    let spread: f64 = env("SPREAD", 0.05);
    let emit_kv = env("EMIT_KV", 0u32) != 0;
    let pd = env("PD", 0u32) != 0;
    let default = EngineConfig::default();
    let blocks = env("BLOCKS", default.num_gpu_blocks);
    let cfg = EngineConfig {
        num_gpu_blocks: blocks,
        max_model_len: default
            .max_model_len
            .min(blocks.saturating_mul(default.block_size)),
        emit_kv_events: emit_kv,
        ..default
    };

    let start = Instant::now();
    let cpu_start = cpu_ns();
    let mut engines: Vec<Engine> = (0..num_engines)
        .map(|i| {
            Engine::new(EngineConfig {
                engine_id: format!("e{i}"),
                ..cfg.clone()
            })
            .expect("default config is valid")
        })
        .collect();
    let build_cpu = cpu_ns()
        .zip(cpu_start)
        .map_or(0.0, |(b, a)| (b - a) as f64 / 1e9);
    let engines_per_group = (num_engines as u32).div_ceil(groups).max(1);
    let mut rr = vec![0u32; groups as usize];
    let mut heap: BinaryHeap<Reverse<(T, usize)>> = BinaryHeap::new();
    let mut scheduled: Vec<Option<f64>> = vec![None; num_engines];
    let mut out = Vec::new();
    let mut kv = Vec::new();
    let mut rng = Rng(12345);
    let mut fp = Fingerprint(0xcbf2_9ce4_8422_2325);
    let mut next_arrival = 0.0;
    let mut submitted = 0u64;
    let (mut finished, mut first_tokens, mut preempted, mut cached) = (0u64, 0u64, 0u64, 0u64);
    // Decode halves waiting for their prefill to finish: (engine, tokens) by request id.
    let mut handoff: Vec<Option<(usize, Arc<[u32]>)>> = vec![None; if pd { n as usize } else { 0 }];
    let mut next_id = n;
    let mut ready: Vec<(usize, EngineRequest)> = Vec::new();
    loop {
        let engine_next = heap.peek().map(|Reverse((t, _))| t.0);
        let arrival = (submitted < n).then_some(next_arrival);
        let from_heap = match (arrival, engine_next) {
            (None, None) => break,
            (Some(a), Some(e)) => e < a,
            (None, Some(_)) => true,
            (Some(_), None) => false,
        };
        let (i, now) = if from_heap {
            let Some(Reverse((T(now), i))) = heap.pop() else {
                break;
            };
            // Lazily drop superseded heap entries.
            if scheduled[i] != Some(now) {
                continue;
            }
            engines[i].advance(now, &mut out);
            (i, now)
        } else {
            let now = next_arrival;
            let id = submitted;
            let group = (rng.next() % u64::from(groups)) as u32;
            let i = if rng.unit() < spread {
                (rng.next() % num_engines as u64) as usize
            } else {
                let k = rr[group as usize];
                rr[group as usize] = (k + 1) % engines_per_group;
                ((group + k * groups) as usize) % num_engines
            };
            let tokens = prompt(group, id);
            let split = pd && id.is_multiple_of(4);
            if split {
                let other =
                    (i + 1 + (rng.next() % (num_engines as u64 - 1).max(1)) as usize) % num_engines;
                handoff[id as usize] = Some((other, tokens.clone()));
            }
            engines[i].advance(now, &mut out);
            let req = EngineRequest {
                id,
                prompt_tokens: tokens,
                max_tokens: OUTPUT_LEN,
                adapter: None,
                mode: if split {
                    RequestMode::PrefillOnly
                } else {
                    RequestMode::Normal
                },
            };
            engines[i].submit(req, now).expect("valid request");
            submitted += 1;
            next_arrival += -rng.unit().ln() / rate;
            (i, now)
        };
        for ev in out.drain(..) {
            fingerprint_event(&mut fp, &ev, i);
            match ev {
                EngineEvent::FirstToken { cached_tokens, .. } => {
                    first_tokens += 1;
                    cached += u64::from(cached_tokens);
                }
                EngineEvent::Finished {
                    id, kv_transfer, ..
                } => {
                    finished += 1;
                    if let (Some(kvt), Some(h)) = (kv_transfer, handoff.get_mut(id as usize)) {
                        if let Some((other, tokens)) = h.take() {
                            let req = EngineRequest {
                                id: next_id,
                                prompt_tokens: tokens,
                                max_tokens: OUTPUT_LEN,
                                adapter: None,
                                mode: RequestMode::DecodeAfterTransfer(KvTransfer { ..kvt }),
                            };
                            next_id += 1;
                            ready.push((other, req));
                        }
                    }
                }
                EngineEvent::Preempted { .. } => preempted += 1,
                EngineEvent::Tokens { .. } => {}
            }
        }
        if emit_kv {
            engines[i].drain_kv_events(&mut kv);
            for ev in kv.drain(..) {
                fingerprint_kv(&mut fp, &ev);
            }
        }
        let mut touched = vec![i];
        for (other, req) in ready.drain(..) {
            engines[other].advance(now, &mut out);
            engines[other]
                .submit(req, now)
                .expect("valid decode request");
            touched.push(other);
        }
        for i in touched {
            let t = engines[i].next_event_time();
            if t != scheduled[i] {
                scheduled[i] = t;
                if let Some(t) = t {
                    heap.push(Reverse((T(t), i)));
                }
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = match (cpu_start, cpu_ns()) {
        (Some(a), Some(b)) => (b - a) as f64 / 1e9,
        _ => wall,
    };
    for e in &engines {
        let m = e.metrics();
        fp.add(m.prefix_cache_hits);
        fp.add(m.prefix_cache_queries);
        fp.add(m.num_preemptions);
        fp.add(m.generation_tokens_total);
    }
    println!(
        "{n} requests on {num_engines} engines: {:.2} s wall, {:.2} s on CPU ({build_cpu:.2} s building engines), \
         {:.0} requests/s; first tokens {first_tokens}, finished {finished}, cached {:.1}%, preemptions {preempted}, \
         peak RSS {} MiB, fingerprint {:016x}",
        wall,
        cpu,
        n as f64 / cpu,
        100.0 * cached as f64 / (first_tokens.max(1) * u64::from(SYSTEM_LEN + QUESTION_LEN)) as f64,
        peak_rss_kib() / 1024,
        fp.0,
    );
}

/// Nanoseconds this thread has spent on a CPU (Linux), if known.
fn cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// Peak resident set size (VmHWM) in KiB, 0 if unknown.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}
