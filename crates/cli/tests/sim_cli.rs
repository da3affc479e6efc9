//! `switchyard sim` end to end: the table on stdout and the files in --out.

use std::process::Command;

#[test]
fn sim_prints_the_table_and_writes_results() {
    let dir = std::env::temp_dir().join(format!("sy-sim-cli-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "sim",
            "--shared-prefix",
            "--groups",
            "4",
            "--prompts-per-group",
            "10",
            "--system-prompt-len",
            "512",
            "--output-len",
            "16",
            "--rate",
            "20",
            "--instances",
            "2",
            "--policies",
            "cost,round-robin",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("policy") && lines[0].contains("ttft_p99"));
    assert!(lines[1].starts_with("cost"));
    assert!(lines[2].starts_with("round-robin"));
    assert!(lines[3].starts_with("lower-bound"));
    assert!(stdout.contains("wall time:") && stdout.contains("peak memory:"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["policies"][0]["finished"], 40);
    assert_eq!(json["instances"], 2);
    for f in ["results.md", "ttft_cdf.svg", "queue_cost.svg"] {
        assert!(dir.join(f).exists(), "{f}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sim_refuses_an_unknown_policy() {
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "sim",
            "--shared-prefix",
            "--groups",
            "1",
            "--prompts-per-group",
            "1",
        ])
        .args(["--policies", "nope"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown policy"));
}

#[test]
fn sim_suite_prints_one_table() {
    let dir = std::env::temp_dir().join(format!("sy-sim-suite-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "sim",
            "--suite",
            "--suite-only",
            "zipf,decode-heavy",
            "--suite-scale",
            "0.005",
            "--seeds",
            "1,2",
            "--suite-rates",
            "zipf=20,decode-heavy=10",
            "--policies",
            "round-robin,least-load",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("workload") && lines[0].contains("p99_ttft"));
    assert!(lines[1].starts_with("zipf") && lines[1].contains("knee"));
    assert!(lines[2].starts_with("zipf") && lines[2].contains("overload"));
    assert!(lines[3].starts_with("decode-heavy") && lines[4].contains("overload"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["lines"].as_array().unwrap().len(), 4);
    assert_eq!(json["workloads"][0]["calibration"]["knee_rate"], 20.0);
    assert!(dir.join("suite.md").exists());
    std::fs::remove_dir_all(&dir).unwrap();

    let bad = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["sim", "--suite", "--suite-only", "nope"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown suite workload"));
}
