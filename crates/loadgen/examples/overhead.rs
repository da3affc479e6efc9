//! Open-loop load generator for the gateway overhead benchmark (`bench/overhead.sh`,
//! `bench/epp.sh`): flag parsing over [`switchyard_loadgen::fixed`], which documents what is
//! sent and measured.
//!
//! Sends one chat request to `URL/v1/chat/completions` at a constant rate on a fixed schedule
//! (open loop) for `--warmup` + `--duration` seconds, and reports the latency of the measured
//! requests to the *complete* response body, from their scheduled time and from their send, and
//! the generator's own lateness. The schedule is kept by a `timerfd` on a single-threaded
//! runtime, or with `--spin` by busy-polling (for a generator pinned to a core of its own).
//!
//! ```text
//! cargo run --release -p switchyard-loadgen --example overhead -- \
//!     --url http://127.0.0.1:8080 --rate 2000 --duration 10 --warmup 2 [--label NAME] \
//!     [--model M] [--words 2048] [--max-tokens 4] [--stream] [--unique] [--conversations] \
//!     [--max-in-flight 256] [--spin]
//! ```
//!
//! The last line is machine-readable:
//! `RESULT label=... rate=... achieved=... p50_us=... p99_us=... p999_us=...`.

use switchyard_loadgen::fixed::{self, FixedOptions};
use switchyard_loadgen::{LoadgenError, PaceMode};

const USAGE: &str = "usage: overhead --url URL [--rate R] [--duration S] [--warmup S] [--label L] \
[--model M] [--words N] [--max-tokens N] [--stream] [--unique] [--conversations] \
[--max-in-flight N] [--drain S] [--spin] [--deciles]";

/// The options, and whether to print the deciles.
fn opts() -> Result<(FixedOptions, bool), String> {
    let mut o = FixedOptions::default();
    let mut deciles = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        let num = |s: String| s.parse::<f64>().map_err(|e| format!("{s}: {e}"));
        match a.as_str() {
            "--url" => o.url = value(&a)?,
            "--rate" => o.rate = num(value(&a)?)?,
            "--duration" => o.duration_s = num(value(&a)?)?,
            "--warmup" => o.warmup_s = num(value(&a)?)?,
            "--label" => o.label = value(&a)?,
            "--model" => o.model = value(&a)?,
            "--words" => o.words = num(value(&a)?)? as usize,
            "--max-tokens" => o.max_tokens = num(value(&a)?)? as u32,
            "--max-in-flight" => o.max_in_flight = (num(value(&a)?)? as usize).max(1),
            "--drain" => o.drain_s = num(value(&a)?)?,
            "--stream" => o.stream = true,
            "--unique" => o.unique = true,
            "--conversations" => o.conversations = true,
            "--spin" => o.pace = PaceMode::Spin,
            "--deciles" => deciles = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if o.url.is_empty() {
        return Err(USAGE.into());
    }
    if !(o.rate > 0.0 && o.duration_s > 0.0 && o.warmup_s >= 0.0 && o.drain_s >= 0.0) {
        return Err("--rate and --duration must be > 0, --warmup and --drain >= 0".into());
    }
    if o.rate * (o.duration_s + o.warmup_s) > 50_000_000.0 {
        return Err("more than 50 million requests: lower --rate or --duration".into());
    }
    Ok((o, deciles))
}

fn main() {
    let (o, deciles) = match opts() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    // Precise wake-ups for the runtime's epoll timeouts too (the pacer does not depend on it).
    if let Err(e) = switchyard_loadgen::pace::precise_timer_slack() {
        eprintln!("timer slack: {e}");
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("runtime: {e}");
            std::process::exit(1);
        }
    };
    let report = match runtime.block_on(fixed::run(&o)) {
        Ok(r) => r,
        Err(e @ (LoadgenError::Url { .. } | LoadgenError::Invalid(_))) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("{}: {e}", o.label());
            std::process::exit(1);
        }
    };
    eprintln!("{}", report.preflight_line());
    if report.ok == 0 {
        eprintln!("{}", report.no_success_line());
        println!("{}", report.result_line());
        std::process::exit(1);
    }
    print!("{}", report.text(deciles));
    println!("{}", report.result_line());
}
