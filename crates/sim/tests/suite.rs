//! The workload suite on a tiny scale: every row present, every ratio finite, deterministic.

use switchyard_sim::suite::{run_suite, workload_names, SuiteOptions};

#[test]
fn a_tiny_suite_has_every_row_and_finite_ratios() {
    let names = workload_names();
    assert_eq!(names.len(), 10);
    let options = SuiteOptions {
        seeds: vec![1, 2],
        scale: 0.005,
        // Two baselines (and gie-lora where there are adapters) keep it to seconds in debug.
        policies: ["round-robin", "dynamo-kv", "gie-lora"]
            .map(String::from)
            .to_vec(),
        // Fixed rates for all but one workload, which is calibrated.
        rates: names
            .iter()
            .filter(|n| **n != "zipf")
            .map(|n| (n.to_string(), if *n == "pd" { 3.0 } else { 10.0 }))
            .collect(),
        ..SuiteOptions::default()
    };
    let results = run_suite(&options, &|_| {}).unwrap();
    assert_eq!(results.lines.len(), 2 * names.len());
    for (i, l) in results.lines.iter().enumerate() {
        assert_eq!(l.workload, names[i / 2]);
        assert_eq!(l.load, if i % 2 == 0 { "knee" } else { "overload" });
        for r in [&l.ttft_mean, &l.ttft_p99, &l.itl_p99] {
            assert!(
                r.median.is_finite() && r.min.is_finite() && r.max.is_finite(),
                "{l:?}"
            );
            assert!(r.min <= r.median && r.median <= r.max, "{l:?}");
            assert!(!r.best.is_empty() && r.best != "cost", "{l:?}");
        }
    }
    let zipf = results.workloads.iter().find(|w| w.name == "zipf").unwrap();
    assert!(zipf.calibration.steps.len() >= 3);
    assert!(zipf.calibration.knee_rate > 0.0);
    let lora = results.workloads.iter().find(|w| w.name == "lora").unwrap();
    assert!(lora.policies.iter().any(|p| p == "gie-lora"));
    assert!(!results.workloads[0]
        .policies
        .iter()
        .any(|p| p == "gie-lora"));
    // Every policy of every workload, load and seed has its row.
    let expected: usize = results
        .workloads
        .iter()
        .map(|w| w.policies.len() * 2 * 2)
        .sum();
    assert_eq!(results.runs.len(), expected);

    let text = results.text_table();
    assert!(text.starts_with("workload"));
    assert_eq!(text.lines().count(), 2 + results.lines.len());
    let first = text.lines().nth(1).unwrap();
    assert!(
        first.starts_with("mooncake ") && first.contains(" knee "),
        "{first}"
    );
    assert!(results.markdown().contains("| pd | overload |"));

    let dir = std::env::temp_dir().join(format!("sy-suite-{}", std::process::id()));
    results.write(&dir).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["lines"].as_array().unwrap().len(), 2 * names.len());
    assert!(std::fs::read_to_string(dir.join("suite.md"))
        .unwrap()
        .contains("## Every run"));
    std::fs::remove_dir_all(&dir).unwrap();

    // Same options, same results; threads do not change them.
    let again = run_suite(
        &SuiteOptions {
            jobs: 2,
            only: vec!["zipf".into(), "decode-heavy".into()],
            ..options.clone()
        },
        &|_| {},
    )
    .unwrap();
    let pick = |r: &switchyard_sim::suite::SuiteResults, name: &str| {
        serde_json::to_string(
            &r.lines
                .iter()
                .filter(|l| l.workload == name)
                .collect::<Vec<_>>(),
        )
        .unwrap()
    };
    for name in ["zipf", "decode-heavy"] {
        assert_eq!(pick(&results, name), pick(&again, name));
    }
}

#[test]
fn a_profile_runs_every_engine_of_the_suite_on_it() {
    let options = SuiteOptions {
        seeds: vec![1],
        scale: 0.005,
        only: vec!["decode-heavy".into()],
        policies: vec!["round-robin".into()],
        rates: vec![("decode-heavy".into(), 2.0)],
        ..SuiteOptions::default()
    };
    let default_engines = run_suite(&options, &|_| {}).unwrap();
    let slow = switchyard_engine::Profile {
        name: "ten-times-slower".into(),
        step_base_s: 0.055,
        prefill_s_per_token: 10.0 / 45_000.0,
        ..switchyard_engine::Profile::default()
    };
    let slow_engines = run_suite(
        &SuiteOptions {
            profile: Some(slow),
            ..options
        },
        &|_| {},
    )
    .unwrap();
    let ttft = |r: &switchyard_sim::suite::SuiteResults| {
        r.runs
            .iter()
            .find(|run| run.load == "knee" && run.summary.policy == "round-robin")
            .map(|run| run.summary.ttft.mean)
            .unwrap()
    };
    // The same requests at the same rate take several times as long on ten-times-slower steps.
    assert!(
        ttft(&slow_engines) > 5.0 * ttft(&default_engines),
        "{} vs {}",
        ttft(&slow_engines),
        ttft(&default_engines)
    );
    assert!(slow_engines
        .markdown()
        .contains("Engines: profile `ten-times-slower`."));
    assert!(!default_engines.markdown().contains("Engines: profile"));
}

#[test]
fn on_a_slow_engine_the_calibration_lowers_its_light_load_until_it_does_not_queue() {
    // Prefill forty times slower than the default H100 profile's.
    let slow = switchyard_engine::Profile {
        name: "slow-prefill".into(),
        prefill_s_per_token: 40.0 / 45_000.0,
        ..switchyard_engine::Profile::default()
    };
    let options = SuiteOptions {
        seeds: vec![1],
        scale: 0.1,
        only: vec!["prefill-heavy".into()],
        policies: vec!["round-robin".into()],
        profile: Some(slow),
        ..SuiteOptions::default()
    };
    let results = run_suite(&options, &|_| {}).unwrap();
    let calibration = &results.workloads[0].calibration;
    let steps = &calibration.steps;
    // The first light load (an eighth of the H100 guess) queues on these engines: lighter ones
    // follow it, and the thresholds come from the last of them, which did not queue.
    assert!(steps[1].rate < steps[0].rate, "{steps:?}");
    // Five times the first light load's p50 would be a threshold no load of this workload
    // crosses (its TTFT is bounded by the whole workload's work).
    assert!(
        calibration.threshold_p50_s < steps[0].ttft_p50,
        "{calibration:?}"
    );
    // The knee is found below that first light load, not by flooding the engines.
    assert!(calibration.knee_rate < steps[0].rate, "{calibration:?}");
    assert!(steps.iter().any(|s| s.saturated), "{steps:?}");
}
