//! What callers submit, and why a submission can be refused.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::Role;

/// Caller-chosen request identifier, unique among the engine's live requests.
pub type RequestId = u64;

/// One generation request as the engine sees it (already tokenized).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRequest {
    /// Identifier, unique among live requests of this engine.
    pub id: RequestId,
    /// Prompt token ids (shared, never copied).
    pub prompt_tokens: Arc<[u32]>,
    /// Tokens to generate (the model has no EOS: it always generates exactly this many).
    pub max_tokens: u32,
    /// LoRA adapter name, `None` for the base model.
    pub adapter: Option<String>,
    /// Normal, prefill-only, or decode of a transferred prefill.
    pub mode: RequestMode,
}

/// How a request takes part in disaggregated serving.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestMode {
    /// Prefill and decode here.
    #[default]
    Normal,
    /// vLLM `do_remote_decode`: finish after prefill (one token) and return a [`KvTransfer`].
    PrefillOnly,
    /// vLLM `do_remote_prefill`: pull the prompt's KV from the prefill instance instead of computing it.
    DecodeAfterTransfer(KvTransfer),
}

impl RequestMode {
    /// Short name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            RequestMode::Normal => "normal",
            RequestMode::PrefillOnly => "prefill_only",
            RequestMode::DecodeAfterTransfer(_) => "decode_after_transfer",
        }
    }
}

/// Where a prefilled KV cache lives, as vLLM's NixlConnector passes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTransfer {
    /// Engine holding the KV cache (its `EngineConfig::engine_id`).
    pub remote_engine_id: String,
    /// Its block ids holding the prompt.
    pub remote_block_ids: Vec<u32>,
    /// The request id on that engine.
    pub remote_request_id: String,
    /// Prompt tokens whose KV was computed there.
    pub num_tokens: u32,
}

/// Why `Engine::submit` refused a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// The prompt has no tokens.
    #[error("prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` is zero for a request that must generate.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// Prompt plus output exceeds `max_model_len`.
    #[error("prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({max_model_len})")]
    TooLong {
        /// Prompt length.
        prompt_tokens: u64,
        /// Requested output length.
        max_tokens: u32,
        /// The engine's limit.
        max_model_len: u32,
    },
    /// A live request already has this id.
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
    /// The adapter is not registered.
    #[error("unknown LoRA adapter '{0}'")]
    UnknownAdapter(String),
    /// An adapter was requested but `max_loras` is 0.
    #[error("LoRA is disabled on this engine (max_loras = 0)")]
    LoraDisabled,
    /// This instance's role does not serve this request mode.
    #[error("a {role} instance does not accept {mode} requests")]
    WrongRole {
        /// The instance role.
        role: Role,
        /// The refused mode's name.
        mode: &'static str,
    },
}
