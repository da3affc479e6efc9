//! Per-request state inside the engine.

use std::sync::Arc;

use crate::request::RequestId;
use crate::tokenizer;

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Phase {
    /// In the waiting queue, schedulable.
    Waiting,
    /// In the waiting queue, holding blocks while its KV cache arrives; schedulable from `ready_at`.
    Transferring {
        /// When the transfer completes.
        ready_at: f64,
        /// Tokens whose KV will then be present (local hits plus transferred).
        target: u32,
    },
    /// In the running batch.
    Running,
}

/// What the request does after its prompt is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Prefill and decode here.
    Normal,
    /// Finish after the first token, handing the KV cache off.
    PrefillOnly,
    /// Decode side of a disaggregated request.
    Decode,
}

/// One live request.
#[derive(Debug)]
pub(crate) struct Seq {
    /// Caller's id.
    pub id: RequestId,
    /// Unique per submission, so stale references to a reused slot are detected.
    pub key: u64,
    /// Prompt tokens.
    pub prompt: Arc<[u32]>,
    /// Prompt length.
    pub prompt_len: u32,
    /// Tokens to generate (1 for prefill-only).
    pub max_tokens: u32,
    /// Adapter index, if any.
    pub adapter: Option<u32>,
    /// Hash salt of the adapter.
    pub salt: u64,
    /// Role in disaggregation.
    pub kind: Kind,
    /// Prompt tokens still to be pulled from a prefill instance (decode side, before its first admission).
    pub pending_transfer: Option<u32>,
    /// Queue state.
    pub phase: Phase,
    /// Tokens whose KV is in the cache.
    pub computed: u32,
    /// Output tokens sampled.
    pub output: u32,
    /// KV blocks held, in token order.
    pub blocks: Vec<u32>,
    /// Chained hashes of full blocks known so far (prompt blocks at submit, output blocks as they fill).
    pub hashes: Vec<u64>,
    /// Leading full blocks already offered to the prefix cache.
    pub committed: u32,
    /// Prompt tokens not computed here, fixed at first admission.
    pub cached_tokens: Option<u32>,
    /// Whether `FirstToken` was emitted.
    pub first_token_sent: bool,
}

impl Seq {
    /// Tokens known so far: prompt plus sampled output.
    pub(crate) fn num_tokens(&self) -> u32 {
        self.prompt_len + self.output
    }

    /// Token id at position `pos` (< `num_tokens`).
    pub(crate) fn token_at(&self, pos: u32) -> u32 {
        if pos < self.prompt_len {
            self.prompt[pos as usize]
        } else {
            tokenizer::output_token(self.id, pos - self.prompt_len)
        }
    }

    /// Whether its next step is a single decode token.
    pub(crate) fn is_decoding(&self) -> bool {
        self.output >= 1 && self.computed + 1 == self.num_tokens()
    }
}
