//! Decision time of the `cost` policy for 16, 256 and 1024 instances with 2k- and 32k-token
//! prompts, on a fleet whose index is warm; the same for 16 instances in exact mode (KV
//! events, requests with token ids); and the index's memory per entry.
//!
//! `cargo bench -p switchyard-core --bench decision`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use switchyard_core::{
    InstanceSpec, Observation, Prompt, RequestId, RouteRequest, Router, RouterConfig,
};

const GROUPS: usize = 64;

/// Deterministic text of `bytes` bytes, distinct per `seed`.
fn text(seed: u64, bytes: usize) -> String {
    let mut out = String::with_capacity(bytes + 16);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < bytes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let word = [
            b'a' + (x % 26) as u8,
            b'a' + ((x >> 8) % 26) as u8,
            b'a' + ((x >> 16) % 26) as u8,
            b' ',
        ];
        out.push_str(std::str::from_utf8(&word).expect("ascii"));
    }
    out.truncate(bytes);
    out
}

struct Fleet {
    router: Router,
    prefixes: Vec<String>,
    suffix_bytes: usize,
}

/// A router with `instances` instances and a warm index: 4 requests per instance drawn from 64
/// shared-prefix groups (prefix = 3/4 of the prompt), the last quarter still in flight.
fn warm_fleet(instances: usize, prompt_tokens: usize) -> Fleet {
    let mut router = Router::new(RouterConfig::default()).expect("default config is valid");
    for i in 0..instances {
        let spec = InstanceSpec {
            kv_capacity_tokens: Some(400_000),
            max_running: Some(256),
            ..InstanceSpec::new(format!("10.0.{}.{}:8000", i / 256, i % 256), "llama")
        };
        router.add_instance(spec).expect("unique names");
    }
    let bytes = prompt_tokens * 4;
    let prefixes: Vec<String> = (0..GROUPS).map(|g| text(g as u64, bytes * 3 / 4)).collect();
    let suffix_bytes = bytes - bytes * 3 / 4;
    let warm = instances * 4;
    for n in 0..warm {
        let suffix = text(1_000_000 + n as u64, suffix_bytes);
        let pieces = [prefixes[n % GROUPS].as_str(), suffix.as_str()];
        let request = RouteRequest {
            prompt: Prompt::Pieces(&pieces),
            ..RouteRequest::text("llama", "")
        };
        let now = n as f64 * 0.01;
        let decision = router.route(&request, now).expect("model is served");
        let pick = decision.best().expect("healthy fleet");
        let plan = decision.plan_for(pick);
        let id = RequestId(n as u64);
        router
            .observe(
                Observation::Routed {
                    request: id,
                    instance: pick,
                    plan,
                },
                now,
            )
            .expect("fresh id");
        if n < warm * 3 / 4 {
            router
                .observe(Observation::FirstToken(id), now + 0.1)
                .expect("in flight");
            router
                .observe(Observation::Finished(id, None), now + 1.0)
                .expect("in flight");
        }
    }
    Fleet {
        router,
        prefixes,
        suffix_bytes,
    }
}

fn decision_time(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision");
    group.sample_size(30);
    for &instances in &[16usize, 256, 1024] {
        for &tokens in &[2_048usize, 32_768] {
            let mut fleet = warm_fleet(instances, tokens);
            let suffixes: Vec<String> = (0..16)
                .map(|i| text(9_000_000 + i, fleet.suffix_bytes))
                .collect();
            let mut n = 0usize;
            let label = format!("{instances}x{}k", tokens / 1024);
            group.bench_function(BenchmarkId::new("cost", label), |b| {
                b.iter(|| {
                    n += 1;
                    let pieces = [
                        fleet.prefixes[n % GROUPS].as_str(),
                        suffixes[n % suffixes.len()].as_str(),
                    ];
                    let request = RouteRequest {
                        prompt: Prompt::Pieces(&pieces),
                        ..RouteRequest::text("llama", "")
                    };
                    let decision = fleet.router.route(&request, 1_000.0).expect("served");
                    std::hint::black_box(decision.best())
                })
            });
        }
    }
    group.finish();
}

/// Decision time where every instance publishes KV events and requests carry token ids (exact
/// mode): 16 instances, each holding one of 16 shared prefixes (3/4 of the prompt).
fn decision_time_exact(c: &mut Criterion) {
    use switchyard_core::KvEvent;
    let mut group = c.benchmark_group("decision_exact");
    group.sample_size(30);
    const INSTANCES: u32 = 16;
    const BLOCK: u32 = 16;
    for &tokens in &[2_048u32, 32_768] {
        let mut router = Router::new(RouterConfig::default()).expect("default config is valid");
        let prefix = |g: u32| -> Vec<u32> { (0..tokens * 3 / 4).map(|t| g << 20 | t).collect() };
        for i in 0..INSTANCES {
            let spec = InstanceSpec {
                kv_capacity_tokens: Some(400_000),
                max_running: Some(256),
                ..InstanceSpec::new(format!("10.0.0.{i}:8000"), "llama")
            };
            let id = router.add_instance(spec).expect("unique names");
            let held = prefix(i);
            let blocks = held.len() as u32 / BLOCK;
            let stored = KvEvent::Stored {
                block_hashes: (0..u64::from(blocks))
                    .map(|b| u64::from(i) << 32 | b)
                    .collect(),
                parent_block_hash: None,
                token_ids: held,
                block_size: BLOCK,
                lora_name: None,
            };
            router
                .observe(Observation::KvEvents(id, vec![stored]), 0.0)
                .expect("known instance");
        }
        let prompts: Vec<Vec<u32>> = (0..INSTANCES)
            .map(|g| {
                let mut ids = prefix(g);
                ids.extend((0..tokens / 4).map(|t| 0xFFF0_0000 | t));
                ids
            })
            .collect();
        let mut n = 0usize;
        group.bench_function(
            BenchmarkId::new("cost", format!("16x{}k", tokens / 1024)),
            |b| {
                b.iter(|| {
                    n += 1;
                    let request = RouteRequest {
                        token_ids: Some(&prompts[n % prompts.len()]),
                        ..RouteRequest::text("llama", "a short text")
                    };
                    let decision = router.route(&request, 1.0).expect("served");
                    std::hint::black_box(decision.best())
                })
            },
        );
        // The ids hashed by the driver outside the lock (`ExactChain`): what is left under it.
        let block_bytes = router.block_bytes();
        let prepared: Vec<_> = prompts
            .iter()
            .map(|ids| {
                let request = RouteRequest::text("llama", "a short text");
                let mut chain = switchyard_core::ExactChain::new(BLOCK, None);
                chain.extend(ids);
                switchyard_core::prepare(&request, block_bytes)
                    .with_token_ids(ids.clone())
                    .with_exact_chain(chain)
            })
            .collect();
        group.bench_function(
            BenchmarkId::new("cost_prehashed", format!("16x{}k", tokens / 1024)),
            |b| {
                b.iter(|| {
                    n += 1;
                    let request = RouteRequest::text("llama", "a short text");
                    let decision = router
                        .route_prepared(&request, &prepared[n % prepared.len()], 1.0)
                        .expect("served");
                    std::hint::black_box(decision.best())
                })
            },
        );
    }
    group.finish();
}

/// Not a timing: prints the index's memory per entry for the warm fleets.
fn index_memory(_c: &mut Criterion) {
    println!("\nindex memory (warm fleet, 4 requests per instance):");
    println!(
        "{:>9} {:>7} {:>10} {:>12} {:>11}",
        "instances", "prompt", "entries", "bytes", "bytes/entry"
    );
    for &instances in &[16usize, 256, 1024] {
        for &tokens in &[2_048usize, 32_768] {
            let fleet = warm_fleet(instances, tokens);
            let index = fleet.router.index();
            let entries = index.total_entries();
            let bytes = index.memory_bytes();
            println!(
                "{instances:>9} {:>6}k {entries:>10} {bytes:>12} {:>11.1}",
                tokens / 1024,
                bytes as f64 / entries.max(1) as f64
            );
        }
    }
}

criterion_group!(benches, index_memory, decision_time, decision_time_exact);
criterion_main!(benches);
