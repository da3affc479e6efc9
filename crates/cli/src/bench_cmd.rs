//! `switchyard bench`: open-loop replay of a workload against any
//! OpenAI-compatible server, measured from the stream (see docs/benchmarks.md).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use crate::workload_args::{workload_spec, WorkloadArgs};
use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use switchyard_loadgen::plan::write_plan;
use switchyard_loadgen::{discover_model, Api, Plan, PlanOptions, RunOptions};

/// Which endpoint requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ApiArg {
    /// POST /v1/chat/completions (messages).
    Chat,
    /// POST /v1/completions (prompt).
    Completions,
}

/// Arguments of `switchyard bench`.
#[derive(Debug, Clone, Args)]
#[command(
    about = "Open-loop load generator: replay a workload against an OpenAI-compatible server",
    long_about = "Open-loop load generator: replays a workload (trace, shared-prefix groups, \
chat sessions, JSONL file) against an OpenAI-compatible server, streaming, and measures TTFT, \
inter-token latency and end-to-end latency from the stream itself, plus errors by kind and the \
prompt / cached tokens the server reports in `usage`.\n\n\
Open loop: request i is sent at start + offset_i whatever happened to earlier ones; only the \
concurrency cap can hold a send back, and the report counts those (and every send late by \
more than 10 ms). The same --seed sends the same requests at the same offsets (--write-plan \
writes them). Prints a summary; --out DIR writes results.json and results.md."
)]
pub struct BenchArgs {
    /// Base URL of the server (e.g. http://127.0.0.1:8000); required unless --dry-run.
    /// Repeat it to spread the requests over several servers without a proxy: each request
    /// goes to one URL drawn uniformly by a random stream seeded from --seed (the model is
    /// discovered from the first).
    #[arg(long)]
    url: Vec<String>,
    /// Endpoint: chat (/v1/chat/completions) or completions (/v1/completions).
    #[arg(long, value_enum, default_value_t = ApiArg::Chat)]
    api: ApiArg,
    /// Model every request asks for (default: the first of the server's /v1/models; with
    /// --dry-run, each request's own).
    #[arg(long)]
    model: Option<String>,
    /// Name of the run in the report (default: the URL).
    #[arg(long)]
    label: Option<String>,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Divide every offset by this (2 = the whole workload twice as fast).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Send only requests due in the first this many seconds (after --time-scale).
    #[arg(long, value_name = "SECONDS")]
    duration: Option<f64>,
    /// Seconds a request may take from send to the end of its stream (then: timeout error).
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS")]
    timeout: f64,
    /// Most requests in flight at once; a send finding no free slot waits (and is counted).
    #[arg(long, default_value_t = 1024)]
    max_concurrency: usize,
    /// Workload seed: the same seed sends the same requests at the same offsets.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write results.json and results.md into this directory.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Write the planned requests (offset, path, body; one JSON a line) to this file.
    #[arg(long, value_name = "FILE")]
    write_plan: Option<PathBuf>,
    /// Build the plan (and write it with --write-plan) without sending anything.
    #[arg(long)]
    dry_run: bool,
    /// No progress bar and no progress messages on stderr.
    #[arg(long)]
    quiet: bool,
}

/// Runs `switchyard bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let spec = workload_spec(&args.workload)?;
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        bail!("--timeout must be > 0");
    }
    let api = match args.api {
        ApiArg::Chat => Api::Chat,
        ApiArg::Completions => Api::Completions,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let timeout = Duration::from_secs_f64(args.timeout);
    let model = match (&args.model, args.url.first(), args.dry_run) {
        (Some(m), _, _) => Some(m.clone()),
        (None, _, true) => None,
        (None, Some(url), false) => Some(
            runtime
                .block_on(discover_model(url, timeout.min(Duration::from_secs(30))))
                .context("no --model given")?,
        ),
        (None, None, false) => bail!("--url is required (or use --dry-run)"),
    };
    let plan = PlanOptions {
        api,
        model,
        time_scale: args.time_scale,
        max_requests: args.workload.max_requests,
        duration_s: args.duration,
    };
    if let Some(path) = &args.write_plan {
        let n = write_plan(path, api, Plan::new(&spec, args.seed, &plan)?)
            .with_context(|| format!("writing {}", path.display()))?;
        if !args.quiet {
            eprintln!("wrote the plan of {n} requests to {}", path.display());
        }
    }
    if args.dry_run {
        let (mut n, mut last, mut prompt, mut output) = (0u64, 0.0f64, 0u64, 0u64);
        for p in Plan::new(&spec, args.seed, &plan)? {
            n += 1;
            last = last.max(p.offset_s);
            prompt += p.prompt_tokens;
            output += u64::from(p.max_tokens);
        }
        println!(
            "dry run: {n} requests over {last:.3} s ({:.2} req/s), {prompt} prompt tokens, \
             {output} output tokens asked for",
            if last > 0.0 { n as f64 / last } else { 0.0 }
        );
        return Ok(());
    }
    let Some((url, extra_urls)) = args.url.split_first() else {
        bail!("--url is required (or use --dry-run)");
    };
    let options = RunOptions {
        url: url.clone(),
        extra_urls: extra_urls.to_vec(),
        label: args.label.clone(),
        plan,
        timeout,
        max_concurrency: args.max_concurrency,
        progress: !args.quiet && std::io::stderr().is_terminal(),
        ..RunOptions::default()
    };
    let report = runtime.block_on(switchyard_loadgen::run(&spec, args.seed, &options))?;
    println!("{}: {}", report.label, report.counts_line());
    print!("{}", report.latency_table());
    for e in &report.summary.error_examples {
        println!("  error: {e}");
    }
    if let Some(dir) = &args.out {
        report
            .write(dir)
            .with_context(|| format!("writing {}", dir.display()))?;
        if !args.quiet {
            eprintln!("wrote {}", dir.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use switchyard_loadgen::switchyard_workload::{
        ArrivalProcess, Count, Delay, GroupSelection, JsonlSpec, WorkloadSpec,
    };

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn parse(args: &[&str]) -> BenchArgs {
        Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied()))
            .unwrap()
            .args
    }

    #[test]
    fn shared_prefix_flags() {
        let a = parse(&[
            "--shared-prefix",
            "--groups",
            "8",
            "--prompts-per-group",
            "2",
            "--system-prompt-len",
            "100",
            "--question-len",
            "10",
            "--output-len",
            "7",
            "--zipf",
            "1.2",
            "--num-requests",
            "50",
            "--rate",
            "3",
            "--arrival-cv",
            "2",
        ]);
        let WorkloadSpec::SharedPrefix(s) = workload_spec(&a.workload).unwrap() else {
            panic!("shared prefix expected")
        };
        assert_eq!((s.num_groups, s.prompts_per_group), (8, 2));
        assert_eq!(
            (s.system_prompt_len, s.question_len, s.output_len),
            (100, 10, 7)
        );
        assert_eq!(s.num_requests, Some(50));
        assert_eq!(s.group_selection, GroupSelection::Zipf { exponent: 1.2 });
        assert_eq!(s.arrivals, ArrivalProcess::Gamma { rate: 3.0, cv: 2.0 });
    }

    #[test]
    fn trace_flags() {
        let a = parse(&[
            "--trace",
            "mooncake",
            "--rate-scale",
            "2",
            "--start-s",
            "10",
            "--end-s",
            "20",
            "--max-requests",
            "5",
        ]);
        let WorkloadSpec::Trace(t) = workload_spec(&a.workload).unwrap() else {
            panic!("trace expected")
        };
        assert_eq!(t.rate_scale, 2.0);
        assert_eq!(
            (t.start_s, t.end_s, t.max_requests),
            (Some(10.0), Some(20.0), Some(5))
        );
        assert!(t.path.as_os_str().is_empty());
        assert_eq!(t.arrivals, None);
    }

    #[test]
    fn chat_and_adapter_flags() {
        let a = parse(&[
            "--chat",
            "--sessions",
            "3",
            "--turns",
            "2",
            "--user-len",
            "9",
            "--think-time",
            "1.5",
            "--rate",
            "1",
            "--adapters",
            "4",
            "--adapter-zipf",
            "0.5",
        ]);
        let WorkloadSpec::Adapters { workload, mix } = workload_spec(&a.workload).unwrap() else {
            panic!("adapters expected")
        };
        assert_eq!((mix.adapters, mix.zipf_exponent), (4, 0.5));
        let WorkloadSpec::Chat(c) = *workload else {
            panic!("chat expected")
        };
        assert_eq!(
            (c.sessions, c.turns, c.user_len),
            (3, Count::Fixed(2), Count::Fixed(9))
        );
        assert_eq!(c.system_prompt_len, 0);
        assert_eq!(c.think_time, Delay::Exponential { mean_s: 1.5 });
        assert_eq!(c.arrivals, ArrivalProcess::Poisson { rate: 1.0 });
    }

    #[test]
    fn workload_files() {
        let a = parse(&["--workload", "w.jsonl", "--rate", "2"]);
        assert_eq!(
            workload_spec(&a.workload).unwrap(),
            WorkloadSpec::Jsonl(JsonlSpec {
                path: "w.jsonl".into(),
                arrivals: Some(ArrivalProcess::Poisson { rate: 2.0 })
            })
        );
        let a = parse(&["--workload", "/nonexistent/spec.json"]);
        assert!(workload_spec(&a.workload).is_err());
        let a = parse(&[]);
        assert!(workload_spec(&a.workload).is_err());
    }

    #[test]
    fn run_flags() {
        let a = parse(&[
            "--url",
            "http://127.0.0.1:1",
            "--api",
            "completions",
            "--model",
            "m",
            "--label",
            "L",
            "--time-scale",
            "4",
            "--duration",
            "9",
            "--timeout",
            "3",
            "--max-concurrency",
            "7",
            "--seed",
            "5",
            "--out",
            "/tmp/o",
            "--write-plan",
            "/tmp/p.jsonl",
            "--dry-run",
            "--quiet",
            "--shared-prefix",
        ]);
        assert_eq!(a.api, ApiArg::Completions);
        assert_eq!((a.time_scale, a.duration, a.timeout), (4.0, Some(9.0), 3.0));
        assert_eq!((a.max_concurrency, a.seed), (7, 5));
        assert!(a.dry_run && a.quiet);
        assert_eq!(a.label.as_deref(), Some("L"));
        assert_eq!(a.out, Some(PathBuf::from("/tmp/o")));
        assert_eq!(a.url, vec!["http://127.0.0.1:1".to_string()]);
        let a = parse(&[
            "--url",
            "http://a:1",
            "--url",
            "http://b:2",
            "--shared-prefix",
        ]);
        assert_eq!(
            a.url,
            vec!["http://a:1".to_string(), "http://b:2".to_string()]
        );
    }
}
