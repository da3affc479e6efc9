//! Times the engine model: N requests (2,224 prompt tokens of which the first
//! 1,024 are one of 8 shared system prompts, 256 output tokens) arriving as a
//! Poisson stream, spread round-robin over E engines, fast-forward on.
//!
//! ```text
//! cargo run --release -p switchyard-engine --example throughput -- [N] [rate per engine] [E] [step]
//! ```
//! `NO_CACHE=1` turns prefix caching off, `BLOCK=64` uses 64-token blocks
//! (same capacity in tokens); a 4th argument `step` forces
//! step-by-step execution for comparison. Prompt generation (≈1 µs per
//! request) is included in the timing.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Instant;

use switchyard_engine::{Engine, EngineConfig, EngineEvent, EngineRequest, RequestMode};

/// Total order on finite event times for the heap.
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

fn prompt(i: u64) -> Arc<[u32]> {
    let group = (i % 8) as u32;
    let mut v: Vec<u32> = Vec::with_capacity(2224);
    v.extend((0..1024).map(|t| group * 1_000_000 + t));
    v.extend((0..1200).map(|t| (i as u32).wrapping_mul(7919) ^ (t << 20)));
    v.into()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    // Requests per second of virtual time per engine; 5 keeps an H100 busy but not overloaded.
    let rate: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(5.0);
    let num_engines: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1);
    let step_by_step = args.next().is_some_and(|a| a == "step");
    let no_cache = std::env::var_os("NO_CACHE").is_some();

    // BLOCK=64 trades prefix-cache granularity for speed (same KV capacity).
    let block_size: u32 = std::env::var("BLOCK")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(16);
    let default = EngineConfig::default();
    let cfg = EngineConfig {
        enable_prefix_caching: !no_cache,
        block_size,
        num_gpu_blocks: default.num_gpu_blocks * default.block_size / block_size,
        ..default
    };
    let mut engines: Vec<Engine> = (0..num_engines)
        .map(|_| {
            let mut e = Engine::new(cfg.clone()).expect("default config is valid");
            e.set_step_by_step(step_by_step);
            e
        })
        .collect();
    let mut heap: BinaryHeap<Reverse<(T, usize)>> = BinaryHeap::new();
    let mut scheduled: Vec<Option<f64>> = vec![None; num_engines];

    let start = Instant::now();
    let cpu_start = cpu_ns();
    let mut out = Vec::new();
    let mut lcg = 12345u64;
    let mut next_arrival = 0.0;
    let mut submitted = 0u64;
    let mut finished = 0u64;
    let mut last = 0.0;
    let mut arrival_of = vec![0.0f64; n as usize];
    let mut ttft_sum = 0.0;
    let total_rate = rate * num_engines as f64;
    loop {
        let engine_next = heap.peek().map(|Reverse((t, _))| t.0);
        let arrival = (submitted < n).then_some(next_arrival);
        let i = match (arrival, engine_next) {
            (None, None) => break,
            (Some(a), Some(e)) if e < a => heap.pop().map(|Reverse((_, i))| i),
            (None, Some(_)) => heap.pop().map(|Reverse((_, i))| i),
            _ => None,
        };
        let i = match i {
            Some(i) => {
                // Lazily drop superseded heap entries.
                let now = engine_next.unwrap_or(0.0);
                if scheduled[i] != Some(now) {
                    continue;
                }
                engines[i].advance(now, &mut out);
                i
            }
            None => {
                let now = next_arrival;
                let id = submitted;
                let i = (id % num_engines as u64) as usize;
                engines[i].advance(now, &mut out);
                let req = EngineRequest {
                    id,
                    prompt_tokens: prompt(id),
                    max_tokens: 256,
                    adapter: None,
                    mode: RequestMode::Normal,
                };
                engines[i].submit(req, now).expect("valid request");
                arrival_of[id as usize] = now;
                submitted += 1;
                lcg = lcg
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((lcg >> 11) as f64 / (1u64 << 53) as f64).max(1e-12);
                next_arrival += -u.ln() / total_rate;
                i
            }
        };
        let t = engines[i].next_event_time();
        if t != scheduled[i] {
            scheduled[i] = t;
            if let Some(t) = t {
                heap.push(Reverse((T(t), i)));
            }
        }
        for ev in out.drain(..) {
            match ev {
                EngineEvent::FirstToken { id, time, .. } => {
                    ttft_sum += time - arrival_of[id as usize]
                }
                EngineEvent::Finished { time, .. } => {
                    finished += 1;
                    last = f64::max(last, time);
                }
                _ => {}
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    // On a shared machine on-CPU time is the steadier figure.
    let cpu = match (cpu_start, cpu_ns()) {
        (Some(a), Some(b)) => (b - a) as f64 / 1e9,
        _ => wall,
    };
    let (mut hits, mut queries, mut preemptions) = (0u64, 0u64, 0u64);
    for e in &engines {
        let m = e.metrics();
        hits += m.prefix_cache_hits;
        queries += m.prefix_cache_queries;
        preemptions += m.num_preemptions;
    }
    println!(
        "{n} requests on {num_engines} engine(s) ({}, caching {}): {:.1} ms wall, {:.1} ms on CPU, \
         {:.0} requests/s simulated; virtual span {:.1} s, mean TTFT {:.1} ms, \
         prefix hits {:.1}%, preemptions {preemptions}",
        if step_by_step {
            "step-by-step"
        } else {
            "fast-forward"
        },
        if no_cache { "off" } else { "on" },
        wall * 1e3,
        cpu * 1e3,
        finished as f64 / cpu,
        last,
        ttft_sum / finished.max(1) as f64 * 1e3,
        100.0 * hits as f64 / queries.max(1) as f64,
    );
}

/// Nanoseconds this thread has spent on a CPU (Linux), if known.
fn cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}
