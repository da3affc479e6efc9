//! End-to-end properties of the simulator on small workloads (seconds, not minutes).

use switchyard_sim::config::{default_engine, groups_for_roles, parse_roles};
use switchyard_sim::metrics::Outcome;
use switchyard_sim::switchyard_workload::{
    AdapterMix, ArrivalProcess, GroupSelection, SharedPrefixSpec, TraceSpec, WorkloadSpec,
};
use switchyard_sim::{run, simulate, InstanceGroup, SimConfig, Split};

fn shared_prefix(n: u64, rate: f64) -> WorkloadSpec {
    WorkloadSpec::SharedPrefix(SharedPrefixSpec {
        num_groups: 6,
        prompts_per_group: 10,
        system_prompt_len: 1024,
        question_len: 64,
        output_len: 32,
        num_requests: Some(n),
        group_selection: GroupSelection::Zipf { exponent: 1.2 },
        arrivals: ArrivalProcess::Poisson { rate },
        ..SharedPrefixSpec::default()
    })
}

fn trace(n: u64) -> WorkloadSpec {
    WorkloadSpec::Trace(TraceSpec {
        max_requests: Some(n),
        rate_scale: 4.0,
        ..TraceSpec::default()
    })
}

fn small_fleet(instances: u32) -> SimConfig {
    SimConfig {
        fleet: vec![InstanceGroup {
            count: instances,
            engine: default_engine(),
        }],
        ..SimConfig::default()
    }
}

fn all_policies() -> Vec<String> {
    switchyard_core::policy::POLICY_NAMES
        .iter()
        .map(|p| p.to_string())
        .collect()
}

#[test]
fn the_same_seed_gives_identical_json() {
    let config = small_fleet(3);
    let spec = shared_prefix(150, 40.0);
    let policies = all_policies();
    let a = run(&config, &spec, &policies, None).unwrap();
    let b = run(&config, &spec, &policies, None).unwrap();
    assert_eq!(a.results.json(), b.results.json());
    let other = SimConfig { seed: 2, ..config };
    let c = run(&other, &spec, &policies, None).unwrap();
    assert_ne!(a.results.json(), c.results.json());
}

#[test]
fn every_request_finishes_once_and_caches_at_most_its_prompt() {
    let config = small_fleet(4);
    for spec in [shared_prefix(200, 30.0), trace(60)] {
        let n = spec.build(config.seed).unwrap().count();
        for policy in ["cost", "round-robin", "sglang-cache-aware"] {
            let data = simulate(&config, policy, "base", spec.build(config.seed).unwrap()).unwrap();
            assert_eq!(data.records.len(), n, "{policy}");
            for r in &data.records {
                assert_eq!(r.outcome, Outcome::Finished, "{policy}: {r:?}");
                assert!(r.cached_tokens <= r.prompt_tokens, "{policy}: {r:?}");
                assert!(
                    r.arrival <= r.first_token && r.first_token <= r.finish,
                    "{r:?}"
                );
            }
            let submitted: u64 = data.instances.iter().map(|i| i.requests).sum();
            assert_eq!(submitted, n as u64);
            assert_eq!(data.unknown_observations, 0);
        }
    }
}

#[test]
fn saturated_requests_wait_in_the_routers_line_as_the_gateways_do() {
    // One request in flight per instance: a burst far beyond it must wait, not be dropped.
    let mut config = small_fleet(2);
    config.router.cost.max_in_flight = Some(1);
    let spec = shared_prefix(60, 400.0);
    for policy in ["cost", "round-robin"] {
        let data = simulate(&config, policy, "base", spec.build(config.seed).unwrap()).unwrap();
        assert_eq!(data.records.len(), 60);
        for r in &data.records {
            assert_eq!(r.outcome, Outcome::Finished, "{policy}: {r:?}");
        }
        // Never more than one at a time per instance: each starts after the one before ends.
        let mut spans: Vec<Vec<(f64, f64)>> = vec![Vec::new(); 2];
        for r in &data.records {
            spans[r.instance as usize].push((r.first_token, r.finish));
        }
        for lane in &mut spans {
            lane.sort_by(|a, b| a.0.total_cmp(&b.0));
            for pair in lane.windows(2) {
                assert!(pair[0].1 <= pair[1].0, "{policy}: overlap {pair:?}");
            }
        }
        // The burst is far beyond two at a time: most of it waited.
        let waited = data
            .records
            .iter()
            .filter(|r| r.first_token - r.arrival > 0.05)
            .count();
        assert!(waited > 30, "{policy}: only {waited} waited");
    }
    // Two replicas (each counts only what it sent, and queues in its own line): every request
    // still finishes, and each instance runs at most one per replica at a time.
    let two = SimConfig {
        replicas: 2,
        ..config
    };
    let data = simulate(&two, "cost", "base", spec.build(two.seed).unwrap()).unwrap();
    assert!(data.records.iter().all(|r| r.outcome == Outcome::Finished));
    for replica in 0..2 {
        let mut spans: Vec<Vec<(f64, f64)>> = vec![Vec::new(); 2];
        for r in data.records.iter().filter(|r| r.replica == replica) {
            spans[r.instance as usize].push((r.first_token, r.finish));
        }
        for lane in &mut spans {
            lane.sort_by(|a, b| a.0.total_cmp(&b.0));
            for pair in lane.windows(2) {
                assert!(
                    pair[0].1 <= pair[1].0,
                    "replica {replica}: overlap {pair:?}"
                );
            }
        }
    }
}

#[test]
fn engines_that_share_cores_slow_each_other_down_only_when_oversubscribed() {
    let spec = trace(80);
    let mean_ttft = |cores: Option<f64>| {
        let config = SimConfig {
            shared_cores: cores,
            ..small_fleet(4)
        };
        let data = simulate(
            &config,
            "round-robin",
            "base",
            spec.build(config.seed).unwrap(),
        )
        .unwrap();
        assert!(data.records.iter().all(|r| r.outcome == Outcome::Finished));
        let n = data.records.len() as f64;
        data.records
            .iter()
            .map(|r| r.first_token - r.arrival)
            .sum::<f64>()
            / n
    };
    let alone = mean_ttft(None);
    // As many cores as engines: nobody waits for a core (steps composed one by one give the
    // fast-forwarded times up to rounding).
    let roomy = mean_ttft(Some(4.0));
    assert!((roomy - alone).abs() <= 1e-6 * alone, "{roomy} vs {alone}");
    let shared = mean_ttft(Some(1.0));
    assert!(
        shared > 1.2 * alone,
        "one core for four engines: {shared} vs {alone}"
    );
    let config = SimConfig {
        shared_cores: Some(0.0),
        ..small_fleet(4)
    };
    assert!(simulate(&config, "cost", "base", spec.build(1).unwrap()).is_err());
}

#[test]
fn the_lower_bound_is_below_every_policy() {
    let config = small_fleet(4);
    for spec in [shared_prefix(200, 60.0), trace(80)] {
        let out = run(&config, &spec, &all_policies(), None).unwrap();
        let lb = out.results.lower_bound.clone().unwrap();
        for p in &out.results.policies {
            assert!(
                lb.ttft.mean <= p.ttft.mean,
                "{}: {} > {}",
                p.policy,
                lb.ttft.mean,
                p.ttft.mean
            );
            assert!(lb.cache_share + 1e-9 >= p.cache_share, "{}", p.policy);
        }
    }
}

#[test]
fn disaggregated_fleets_finish_everything() {
    let config = SimConfig {
        fleet: groups_for_roles(&parse_roles("2p2d").unwrap(), &default_engine()),
        ..SimConfig::default()
    };
    let spec = shared_prefix(120, 30.0);
    for policy in ["cost", "round-robin", "dynamo-kv"] {
        let data = simulate(&config, policy, "base", spec.build(1).unwrap()).unwrap();
        assert!(
            data.records.iter().all(|r| r.outcome == Outcome::Finished),
            "{policy}"
        );
        // A split request prefills on 0..2 and decodes on 2..4; `cost` may also run a request
        // whole on a decode instance (selective disaggregation), the baselines never do.
        for r in &data.records {
            if r.is_split() {
                assert!(r.instance < 2 && (2..4).contains(&r.decode_instance));
            } else {
                assert_eq!(policy, "cost");
                assert!((2..4).contains(&r.instance));
            }
        }
        // These prompts are short: `cost` runs them whole where they are cheapest.
        if policy != "cost" {
            assert!(data.records.iter().all(|r| r.is_split()), "{policy}");
        }
        assert!(data.records.iter().any(|r| r.cached_tokens > 0), "{policy}");
    }
}

#[test]
fn replicas_split_the_traffic_and_everything_finishes() {
    for split in [Split::RoundRobin, Split::Random] {
        let config = SimConfig {
            replicas: 3,
            split,
            ..small_fleet(4)
        };
        let data = simulate(
            &config,
            "cost",
            "base",
            shared_prefix(150, 40.0).build(1).unwrap(),
        )
        .unwrap();
        let mut per_replica = [0u32; 3];
        for r in &data.records {
            assert_eq!(r.outcome, Outcome::Finished);
            per_replica[r.replica as usize] += 1;
        }
        assert!(
            per_replica.iter().all(|&n| n > 20),
            "{split:?}: {per_replica:?}"
        );
    }
}

#[test]
fn adapter_loads_are_counted() {
    let mut engine = default_engine();
    engine.max_loras = 2;
    let config = SimConfig {
        fleet: vec![InstanceGroup { count: 3, engine }],
        ..SimConfig::default()
    };
    let spec = WorkloadSpec::Adapters {
        workload: Box::new(shared_prefix(150, 30.0)),
        mix: AdapterMix {
            adapters: 8,
            ..AdapterMix::default()
        },
    };
    let out = run(&config, &spec, &["cost".into(), "round-robin".into()], None).unwrap();
    for p in &out.results.policies {
        assert_eq!(p.finished, 150, "{}", p.policy);
        assert!(p.adapter_loads >= 3, "{}: {}", p.policy, p.adapter_loads);
    }
}

#[test]
fn outputs_are_written() {
    let dir = std::env::temp_dir().join(format!("sy-sim-out-{}", std::process::id()));
    let out = run(
        &small_fleet(2),
        &shared_prefix(40, 20.0),
        &["cost".into()],
        None,
    )
    .unwrap();
    switchyard_sim::write_outputs(&dir, &out).unwrap();
    for f in [
        "results.json",
        "results.md",
        "ttft_cdf.svg",
        "queue_cost.svg",
    ] {
        assert!(dir.join(f).exists(), "{f}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Cache share, mean TTFT, lost batches and fallbacks of `cost` over the shared-prefix workload.
fn replicas_run(
    replicas: u32,
    kv_events: Option<switchyard_sim::KvEventsSim>,
) -> (f64, f64, u64, u64) {
    replicas_run_at(replicas, kv_events, false, 60.0)
}

fn replicas_run_at(
    replicas: u32,
    kv_events: Option<switchyard_sim::KvEventsSim>,
    replica_sync: bool,
    rate: f64,
) -> (f64, f64, u64, u64) {
    let config = SimConfig {
        replicas,
        kv_events,
        replica_sync,
        ..small_fleet(4)
    };
    let spec = shared_prefix(600, rate);
    let data = simulate(&config, "cost", "base", spec.build(1).unwrap()).unwrap();
    let (mut prompt, mut cached, mut ttft) = (0u64, 0u64, 0.0);
    for r in &data.records {
        assert_eq!(r.outcome, Outcome::Finished, "{r:?}");
        prompt += u64::from(r.prompt_tokens);
        cached += u64::from(r.cached_tokens);
        ttft += r.first_token - r.arrival;
    }
    assert_eq!(data.unknown_observations, 0);
    (
        cached as f64 / prompt as f64,
        ttft / data.records.len() as f64,
        data.kv_batches_lost,
        data.kv_fallbacks,
    )
}

#[test]
fn replicas_that_share_their_decisions_route_like_one() {
    let rate = 180.0;
    let (_, one, ..) = replicas_run_at(1, None, false, rate);
    let (_, apart, ..) = replicas_run_at(4, None, false, rate);
    let (_, synced, ..) = replicas_run_at(4, None, true, rate);
    eprintln!("mean TTFT: one {one:.4}, four apart {apart:.4}, four synced {synced:.4}");
    assert!(apart > one * 1.1, "one {one:.4}, four apart {apart:.4}");
    assert!(synced < apart, "synced {synced:.4}, apart {apart:.4}");
    assert!(synced < one * 1.05, "synced {synced:.4}, one {one:.4}");
    // Messages that never arrive in time change nothing.
    let config = SimConfig {
        replicas: 4,
        replica_sync: true,
        replica_sync_delay_s: 1e9,
        ..small_fleet(4)
    };
    let data = simulate(
        &config,
        "cost",
        "base",
        shared_prefix(600, rate).build(1).unwrap(),
    )
    .unwrap();
    let never = data
        .records
        .iter()
        .map(|r| r.first_token - r.arrival)
        .sum::<f64>()
        / data.records.len() as f64;
    assert_eq!(never, apart);
}

#[test]
fn kv_events_give_replicas_the_cache_view_they_lack() {
    let events = switchyard_sim::KvEventsSim::default();
    let (alone, ..) = replicas_run(4, None);
    let (shared, _, lost, fallbacks) = replicas_run(4, Some(events));
    assert_eq!((lost, fallbacks), (0, 0));
    assert!(
        shared > alone + 0.01,
        "events: {shared:.3} cached, without: {alone:.3}"
    );
    // Losses make gaps; with the fallback on, replicas leave exact mode and say so.
    let lossy = switchyard_sim::KvEventsSim {
        loss: 0.05,
        ..events
    };
    let (_, _, lost, fallbacks) = replicas_run(4, Some(lossy));
    assert!(
        lost > 0 && fallbacks > 0,
        "lost {lost}, fallbacks {fallbacks}"
    );
    let (_, _, lost_quiet, no_fallbacks) = replicas_run(
        4,
        Some(switchyard_sim::KvEventsSim {
            fallback: false,
            ..lossy
        }),
    );
    // Routing differs once a replica falls back, so the batches (and losses) differ a little.
    assert!(lost_quiet > 0);
    assert_eq!(no_fallbacks, 0);
}

/// `client_max_tokens` changes what the routers are told, not what the engines generate.
#[test]
fn a_client_limit_is_told_to_the_router_and_answers_keep_their_length() {
    let oracle = small_fleet(4);
    let told = SimConfig {
        // Far past any instance's KV: the router reserves it until answers are measured.
        client_max_tokens: Some(1_000_000),
        ..small_fleet(4)
    };
    let spec = shared_prefix(200, 30.0);
    let run = |config: &SimConfig| {
        simulate(config, "cost", "base", spec.build(config.seed).unwrap()).unwrap()
    };
    let (a, b) = (run(&oracle), run(&told));
    for (x, y) in a.records.iter().zip(&b.records) {
        assert_eq!(x.completion_tokens, 32);
        assert_eq!(y.completion_tokens, 32);
    }
    let picks =
        |d: &switchyard_sim::RunData| d.records.iter().map(|r| r.instance).collect::<Vec<_>>();
    assert_ne!(picks(&a), picks(&b), "the limit reached the router");
}
