//! Open-loop load generator for OpenAI-compatible inference endpoints.
//!
//! A run replays a [`switchyard_workload`] request stream against one base
//! URL: each request is sent at `start + offset` whatever happened to the
//! earlier ones (open loop), streamed (`stream: true`, with
//! `stream_options.include_usage`), and measured from the stream itself:
//! time to the first content chunk (TTFT), the gaps between content chunks
//! (inter-token latency) and the time to the end of the stream (end to end).
//! Errors are counted by kind (HTTP status, connect, timeout, broken stream).
//! Latencies go into HDR histograms; the [`Report`] serialises to JSON and
//! renders as Markdown.
//!
//! - [`plan`]: the deterministic list of (offset, request body) a run sends.
//! - [`sse`]: incremental parsing of an OpenAI streaming response.
//! - [`client`]: one streamed request over HTTP/1.1 and its measurements.
//! - [`stats`]: histograms and counters of a run.
//! - [`run`]: the open-loop dispatcher.
//! - [`pace`]: precise absolute-deadline sleeps (timerfd or busy-poll) keeping a schedule.
//! - [`fixed`]: one fixed request at a constant rate, latency to the complete body (the
//!   gateway overhead benchmark's generator, `examples/overhead.rs`).
//! - [`turns`]: two-turn conversations for it (the cost of a conversation's next turn).
//! - [`words`]: the prompt text both send.
//! - [`report`]: the run's summary as JSON and Markdown.

#![warn(missing_docs)]

pub mod client;
pub mod error;
pub mod fixed;
pub mod pace;
pub mod plan;
pub mod report;
pub mod run;
pub mod sse;
pub mod stats;
pub mod turns;
pub mod words;

pub use error::{LoadgenError, Result};
pub use fixed::{FixedOptions, FixedReport};
pub use pace::{PaceMode, Pacer};
pub use plan::{Api, Plan, PlanOptions, PlannedRequest};
pub use report::{Report, Summary};
pub use run::{discover_model, run, RunOptions};
pub use switchyard_workload;
