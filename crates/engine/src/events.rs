//! What the engine reports: per-request events and KV cache events.

use serde::{Deserialize, Serialize};

use crate::request::{KvTransfer, RequestId};

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// It generated `max_tokens` tokens (the only natural end: the model has no EOS).
    Length,
    /// A stop condition matched; never produced by the model, kept for drivers that add stop strings.
    Stop,
    /// It was aborted by the caller.
    Abort,
}

/// A per-request event, stamped with the virtual time it happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum EngineEvent {
    /// The first output token was sampled (end of the step that finished the prefill).
    FirstToken {
        /// The request.
        id: RequestId,
        /// When.
        time: f64,
        /// Prompt length.
        prompt_tokens: u32,
        /// Prompt tokens not computed here: prefix-cache hits (plus transferred tokens on a decode instance).
        cached_tokens: u32,
    },
    /// Tokens sampled by one step (only with `emit_token_events`); follows `FirstToken` in the same step.
    Tokens {
        /// The request.
        id: RequestId,
        /// When.
        time: f64,
        /// The sampled token ids (see `tokenizer::decode_output`).
        tokens: Vec<u32>,
    },
    /// The request is done and its resources released.
    Finished {
        /// The request.
        id: RequestId,
        /// When.
        time: f64,
        /// Prompt length.
        prompt_tokens: u32,
        /// As reported in `FirstToken` (0 if never admitted).
        cached_tokens: u32,
        /// Output tokens generated.
        completion_tokens: u32,
        /// Why it ended.
        reason: FinishReason,
        /// For a prefill-only request: where its KV cache is.
        kv_transfer: Option<KvTransfer>,
    },
    /// The request lost its KV blocks and went back to the head of the queue (recompute).
    Preempted {
        /// The request.
        id: RequestId,
        /// When (start of the step that needed the blocks).
        time: f64,
    },
}

impl EngineEvent {
    /// The request this event is about.
    pub fn id(&self) -> RequestId {
        match self {
            EngineEvent::FirstToken { id, .. }
            | EngineEvent::Tokens { id, .. }
            | EngineEvent::Finished { id, .. }
            | EngineEvent::Preempted { id, .. } => *id,
        }
    }

    /// When it happened.
    pub fn time(&self) -> f64 {
        match self {
            EngineEvent::FirstToken { time, .. }
            | EngineEvent::Tokens { time, .. }
            | EngineEvent::Finished { time, .. }
            | EngineEvent::Preempted { time, .. } => *time,
        }
    }
}

/// A KV cache event, as vLLM publishes with `--kv-events-config`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    /// Consecutive full blocks of one sequence entered the prefix cache.
    BlockStored {
        /// Their chained hashes, in order.
        block_hashes: Vec<u64>,
        /// Hash of the block before the first one (`None` at the start of a sequence).
        parent_block_hash: Option<u64>,
        /// The tokens of all the blocks, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// LoRA adapter the blocks were computed with.
        lora_name: Option<String>,
    },
    /// Cached blocks were evicted.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<u64>,
    },
    /// The whole prefix cache was dropped (`Engine::reset_prefix_cache`).
    AllBlocksCleared,
}
