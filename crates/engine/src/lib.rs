//! A model of one LLM inference engine (vLLM V1-like) in virtual time.
//!
//! The model is a pure library: no I/O, no async, no wall clock. Time is an
//! `f64` number of seconds passed in by the caller. The emulator puts it
//! behind an HTTP server in scaled real time; the simulator runs thousands
//! of them in virtual time.
//!
//! # What is modelled
//! * **Continuous batching** with `max_num_seqs` and a per-step token budget
//!   (`max_num_batched_tokens`): running requests first (one decode token
//!   each, or the next prefill chunk), then waiting requests FCFS; long
//!   prompts are prefilled in chunks across steps.
//! * **Paged KV cache** of `num_gpu_blocks` × `block_size` tokens with
//!   **prefix caching** by chained block hashes (tokens, parent hash, LoRA
//!   adapter), reference-counted sharing, LRU eviction of cached free
//!   blocks, and **preemption by recompute** of the newest running request
//!   when blocks run out.
//! * **Step time** from a [`Profile`]: a base per step, prefill cost per
//!   token plus attention growing with context, decode cost per sequence
//!   plus per 1k context tokens; a mixed step costs the sum of its parts.
//! * **LoRA** slots (`max_loras`) with a load time, LRU eviction of idle
//!   adapters, and requests waiting for a slot.
//! * **Disaggregated prefill/decode** roles with a KV transfer hand-off.
//! * vLLM-style **metrics** and **KV cache events**.
//!
//! # Deliberate simplifications versus vLLM
//! * No EOS: a request always generates exactly `max_tokens` tokens
//!   (`FinishReason::Stop` is never produced by the model).
//! * Cached tokens are block-granular and capped so at least one token is
//!   computed: a prompt of `P` tokens can reuse at most
//!   `floor((P-1)/block_size)` full blocks (as vLLM's `max_cache_hit_length
//!   = num_tokens - 1`). A fully cached 32-token prompt with 16-token blocks
//!   reports 16 cached tokens.
//! * One block per hash: a newly filled block whose hash is already cached
//!   stays unregistered (vLLM keeps duplicates reachable). No null block.
//! * A one-token chunk is costed as a decode token, whatever its phase.
//! * LoRA: an on-demand load adds `lora_load_time_s` to the step that admits
//!   the request; an explicit [`Engine::load_adapter`] makes the adapter
//!   resident at once and delays the next step by the load time. No
//!   per-step LoRA compute overhead.
//! * Disaggregation: a `PrefillOnly` request frees its blocks (they stay in
//!   the prefix cache) when it finishes rather than pinning them until the
//!   decode side pulls them. On the decode side the transfer covers the
//!   prompt minus its last token and minus local prefix-cache hits; the
//!   last prompt token is computed locally to sample the first token (as
//!   with vLLM's NixlConnector). Transfers into one instance are serialised
//!   on one link of `kv_transfer_bandwidth_bytes_per_s`; the whole prompt's
//!   blocks are allocated when the transfer starts. Cached tokens reported
//!   on the decode side = local hits + transferred tokens.
//! * Roles are strict: a prefill instance accepts only `PrefillOnly`, a
//!   decode instance only `DecodeAfterTransfer`, `Both` accepts everything.
//! * Progress guards (vLLM can deadlock here): when nothing is running, a
//!   waiting request that cannot get blocks is skipped instead of blocking
//!   the queue; and when the only request left to preempt is the one that
//!   needs a block, the blocks of a waiting decode-side request (its KV
//!   transfer, landed or not) are reclaimed first; that request then
//!   prefills locally. Both are reported as preemptions.
//!
//! # Driving it
//! Call [`Engine::advance`]`(t)` whenever [`Engine::next_event_time`]
//! reaches `t`, and before `submit`/`abort`/adapter calls at `t`. A step's
//! composition is fixed when it starts: requests submitted while it runs
//! join at its end. An idle engine starts a step at the submission time
//! when `advance` reaches it, so requests submitted at the same instant
//! before that `advance` share the first step.
//!
//! # Cost
//! With `emit_token_events = false`, stretches of pure-decode steps are
//! fast-forwarded in closed form (see the `run` module docs), so the cost
//! is proportional to scheduling events (admissions, finishes,
//! preemptions, block-pressure points), not to tokens × sequences.
//! Simulations run a thousand engines whose state is cold in the CPU
//! cache whenever one's turn comes, so the hot paths are shaped for memory:
//! a new engine reserves its block pool and prefix index without touching
//! them, prefix lookups check a block's neighbours before the index, and a
//! step's updates fetch the cache lines of all its requests before using
//! any (see `examples/churn.rs` for the benchmark).

#![warn(missing_docs)]

mod block_index;
pub mod config;
mod engine;
pub mod events;
mod fast_forward;
mod kv_cache;
mod lora;
pub mod metrics;
mod prefetch;
pub mod profile;
pub mod request;
mod scheduler;
mod seq;
#[cfg(test)]
mod testutil;
pub mod tokenizer;

pub use config::{ConfigError, EngineConfig, Role};
pub use engine::Engine;
pub use events::{EngineEvent, FinishReason, KvEvent};
pub use lora::AdapterError;
pub use metrics::EngineMetrics;
pub use profile::{Profile, ProfileError};
pub use request::{EngineRequest, KvTransfer, RequestId, RequestMode, SubmitError};
