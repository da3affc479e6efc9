//! `switchyard bench` end to end: the real binary against real emulator
//! processes on loopback. Checks the JSON report (counts, no errors, TTFT,
//! cached tokens on a shared-prefix workload), model discovery, the
//! completions API on a trace, connect errors, and that a seed fixes the
//! request sequence byte for byte (`--write-plan`, `--dry-run`).

mod engine_support;
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use engine_support::Emulator;
use serde_json::Value;

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("sy-bench-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn bench(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("bench")
        .args(args)
        .output()
        .expect("run switchyard bench");
    assert!(
        out.status.success(),
        "bench {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn report(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("results.json")).expect("results.json");
    serde_json::from_str(&text).expect("results.json is JSON")
}

/// 48 shared-prefix requests (4 groups of 512-token system prompts, Zipf), 20 req/s.
/// The seed is given separately.
const SHARED: &[&str] = &[
    "--shared-prefix",
    "--groups",
    "4",
    "--prompts-per-group",
    "12",
    "--system-prompt-len",
    "512",
    "--question-len",
    "16",
    "--output-len",
    "16",
    "--zipf",
    "1.1",
    "--rate",
    "20",
];

#[test]
fn shared_prefix_run_reports_and_replays_deterministically() {
    let emu = Emulator::start(&["--model", "m", "--speed", "4"]);
    let dir = Scratch::new("shared");
    let out = dir.0.join("out");
    let plan_run = dir.0.join("run.plan.jsonl");
    let mut args = vec![
        "--url", &emu.base, "--model", "m", "--quiet", "--label", "e1", "--seed", "7",
    ];
    args.extend_from_slice(SHARED);
    let out_s = out.to_str().unwrap();
    let plan_s = plan_run.to_str().unwrap();
    args.extend_from_slice(&["--out", out_s, "--write-plan", plan_s]);
    let o = bench(&args);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("| TTFT | 48 |"), "{stdout}");

    let r = report(&out);
    let s = &r["summary"];
    assert_eq!(r["label"], "e1");
    assert_eq!(r["api"], "chat");
    assert_eq!(s["planned"], 48, "{s}");
    assert_eq!(s["sent"], 48);
    assert_eq!(s["ok"], 48);
    assert_eq!(s["failed"], 0, "{s}");
    assert_eq!(s["without_usage"], 0);
    assert_eq!(s["ttft"]["count"], 48);
    assert!(s["ttft"]["p50_ms"].as_f64().unwrap() > 0.0);
    assert!(s["itl"]["count"].as_u64().unwrap() >= 48 * 10, "{s}");
    assert!(s["e2e"]["p99_ms"].as_f64().unwrap() >= s["ttft"]["p99_ms"].as_f64().unwrap());
    assert_eq!(s["completion_tokens"], 48 * 16);
    // Every prompt is 528 content tokens plus the chat template's few.
    assert!(s["prompt_tokens"].as_u64().unwrap() >= 48 * 528);
    // 4 system prompts shared by 48 requests: most of each prompt comes from cache.
    let cached = s["cached_tokens"].as_u64().unwrap();
    assert!(cached > 48 * 256, "cached {cached}");
    assert!(out.join("results.md").exists());

    // The same seed plans the same requests at the same offsets, byte for byte,
    // with or without a server; another seed does not.
    let plan_a = dir.0.join("a.plan.jsonl");
    let plan_b = dir.0.join("b.plan.jsonl");
    let plan_c = dir.0.join("c.plan.jsonl");
    for (path, seed) in [(&plan_a, "7"), (&plan_b, "7"), (&plan_c, "8")] {
        let mut args = vec!["--dry-run", "--model", "m", "--quiet"];
        args.extend_from_slice(SHARED);
        args.extend_from_slice(&["--seed", seed, "--write-plan", path.to_str().unwrap()]);
        let o = bench(&args);
        assert!(String::from_utf8_lossy(&o.stdout).contains("dry run: 48 requests"));
    }
    let run_bytes = std::fs::read(&plan_run).unwrap();
    let a = std::fs::read(&plan_a).unwrap();
    assert_eq!(a, std::fs::read(&plan_b).unwrap());
    assert_eq!(a, run_bytes, "the run sent what the dry run plans");
    assert_ne!(a, std::fs::read(&plan_c).unwrap());
    let first: Value = serde_json::from_slice(a.split(|&b| b == b'\n').next().unwrap()).unwrap();
    assert_eq!(first["path"], "/v1/chat/completions");
    assert_eq!(first["offset_s"], 0.0);
    assert_eq!(first["body"]["stream_options"]["include_usage"], true);
}

#[test]
fn trace_over_completions_with_discovery_and_limits() {
    let emu = Emulator::start(&["--model", "served-model", "--speed", "20"]);
    let dir = Scratch::new("trace");
    let out = dir.0.join("out");
    // The first 6 rows of the Mooncake trace, 100x faster, no --model (discovered).
    bench(&[
        "--url",
        &emu.base,
        "--api",
        "completions",
        "--trace",
        "mooncake",
        "--max-requests",
        "6",
        "--time-scale",
        "100",
        "--timeout",
        "60",
        "--max-concurrency",
        "3",
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    let r = report(&out);
    let s = &r["summary"];
    assert_eq!(r["model"], "served-model");
    assert_eq!(r["api"], "completions");
    assert_eq!(
        (s["planned"].as_u64(), s["ok"].as_u64()),
        (Some(6), Some(6)),
        "{s}"
    );
    assert_eq!(s["ttft"]["count"], 6);
    assert!(s["peak_in_flight"].as_u64().unwrap() <= 3);
    // The first rows share their first 512-token block: the engine reports hits.
    assert!(s["cached_tokens"].as_u64().unwrap() >= 512, "{s}");

    // --duration keeps only what is due in the window.
    let o = bench(&[
        "--dry-run",
        "--trace",
        "mooncake",
        "--duration",
        "10",
        "--time-scale",
        "2",
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    let n: u64 = text
        .split_whitespace()
        .nth(2)
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!(n > 0 && n < 200, "{text}");
}

#[test]
fn connect_errors_are_counted_not_fatal() {
    // Bind then drop a listener: nothing listens on that port any more.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let dir = Scratch::new("refused");
    let out = dir.0.join("out");
    bench(&[
        "--url",
        &url,
        "--model",
        "m",
        "--chat",
        "--sessions",
        "2",
        "--turns",
        "2",
        "--think-time",
        "0.01",
        "--timeout",
        "5",
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    let s = &report(&out)["summary"];
    assert_eq!(s["planned"], 4);
    assert_eq!(s["ok"], 0);
    assert_eq!(s["errors"]["connect"], 4, "{s}");
}

#[test]
fn bad_invocations_fail_clearly() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .arg("bench")
            .args(args)
            .output()
            .unwrap()
    };
    let o = run(&["--url", "http://127.0.0.1:1"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("choose a workload"));
    let o = run(&["--shared-prefix"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--url"));
}
