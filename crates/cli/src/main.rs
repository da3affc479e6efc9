//! The `switchyard` command.

mod bench_cmd;
mod demo_cmd;
mod engine_cmd;
mod epp_cmd;
mod fleet_args;
mod route_cmd;
mod serve_cmd;
mod sim_cmd;
mod workload_args;

use clap::{Parser, Subcommand};

/// Switchyard: a router and load balancer for LLM inference fleets.
#[derive(Debug, Parser)]
#[command(name = "switchyard", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway: an OpenAI-compatible router in front of inference engines.
    Serve(serve_cmd::ServeArgs),
    /// Run the endpoint picker for an Envoy-based gateway (Gateway API Inference Extension).
    Epp(epp_cmd::EppArgs),
    /// Start emulated engines and the gateway in one process, and print requests to try.
    Demo(demo_cmd::DemoArgs),
    /// Run the engine emulator (vLLM-compatible server in scaled real time).
    Engine(engine_cmd::EngineArgs),
    /// Show what the router would decide for one request against a fleet file (dry run).
    Route(route_cmd::RouteArgs),
    /// Simulate a fleet in virtual time and compare routing policies on one workload.
    Sim(sim_cmd::SimArgs),
    /// Open-loop load generator: replay a workload against an OpenAI-compatible server.
    Bench(bench_cmd::BenchArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // kube's client logs every failed call to the API server at error level, each
                // retry of an outage again; discovery logs the outage once itself.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,kube_client=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => serve_cmd::run(args),
        Command::Epp(args) => epp_cmd::run(args),
        Command::Demo(args) => demo_cmd::run(args),
        Command::Engine(args) => engine_cmd::run(args),
        Command::Route(args) => route_cmd::run(args),
        Command::Sim(args) => sim_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
    }
}
