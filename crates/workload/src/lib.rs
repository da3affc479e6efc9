//! Request streams for the simulator and the load generator.
//!
//! Workloads are lazy iterators of [`Request`]s in arrival order, so a
//! million-request run is never held in memory unless a caller collects it.
//! Prompts are built from shared `Arc<str>` segments (system prompts, trace
//! blocks, earlier chat messages), so what requests have in common is stored
//! once. Text follows the project's token convention — 4 bytes a token, made
//! of 4-byte words — so token counts are exact and cheap ([`text_tokens`]).
//! Everything is deterministic in its seed.
//!
//! - [`trace`]: Mooncake-format trace replay ([`TraceSpec`]).
//! - [`shared_prefix`]: SGLang-style shared system prompts ([`SharedPrefixSpec`]).
//! - [`chat`]: multi-turn sessions ([`ChatSpec`]).
//! - [`adapters`]: LoRA adapter mixes over any workload ([`AdapterMix`]).
//! - [`arrivals`]: Poisson, gamma, constant and instant arrivals.
//! - [`jsonl`]: workloads to and from JSONL files.
//! - [`spec`]: [`WorkloadSpec`], any of the above as one JSON value.

#![warn(missing_docs)]

pub mod adapters;
pub mod arrivals;
pub mod cache;
pub mod chat;
pub mod error;
pub mod jsonl;
pub mod request;
pub mod sampling;
pub mod shared_prefix;
pub mod source;
pub mod spec;
pub mod text;
pub mod trace;

pub use adapters::{AdapterAssigner, AdapterMix, PopularityShift};
pub use arrivals::{ArrivalProcess, ArrivalTimes, Retimed};
pub use chat::{ChatSessions, ChatSpec};
pub use error::{Result, WorkloadError};
pub use jsonl::{open_jsonl, read_jsonl_file, write_jsonl, write_jsonl_file, JsonlReader};
pub use request::{ChatMessage, Prompt, Request, Role};
pub use sampling::{Count, Delay, ZipfRanks};
pub use shared_prefix::{GroupSelection, SharedPrefix, SharedPrefixSpec};
pub use spec::{JsonlSpec, RequestStream, WorkloadSpec};
pub use text::{text_tokens, TOKEN_BYTES};
pub use trace::{
    read_trace, shipped_mooncake_trace, TraceReplay, TraceRow, TraceSpec, MOONCAKE_BLOCK_TOKENS,
};

/// Model name generators use unless told otherwise.
pub const DEFAULT_MODEL: &str = "base";
