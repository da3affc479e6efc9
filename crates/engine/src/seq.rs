//! Per-request state inside the engine.

use std::sync::Arc;

use crate::request::RequestId;
use crate::tokenizer;

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(u8)] // tag first, so it lies in `Seq`'s first cache line
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
///
/// Laid out by hand (`repr(C)`, cache-line aligned): the fields every step
/// reads for every running request (`key` to `phase`'s tag) share the first
/// 64-byte line, so advancing a batch of cold requests costs one cache miss
/// each; the second line holds what sampling a token and hashing a filled
/// block need (`hashes` to `cached_tokens`); the rest is for admission and
/// the end.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct Seq {
    /// Unique per submission, so stale references to a reused slot are detected.
    pub key: u64,
    /// KV blocks held, in token order.
    pub blocks: Vec<u32>,
    /// Tokens whose KV is in the cache.
    pub computed: u32,
    /// Output tokens sampled.
    pub output: u32,
    /// Tokens to generate (1 for prefill-only).
    pub max_tokens: u32,
    /// Prompt length.
    pub prompt_len: u32,
    /// Leading full blocks already offered to the prefix cache.
    pub committed: u32,
    /// Whether `FirstToken` was emitted.
    pub first_token_sent: bool,
    /// Role in disaggregation.
    pub kind: Kind,
    /// Queue state.
    pub phase: Phase,
    /// Chained hashes of full blocks known so far (prompt blocks at submit, output blocks as they fill).
    pub hashes: Vec<u64>,
    /// Caller's id.
    pub id: RequestId,
    /// Hash salt of the adapter.
    pub salt: u64,
    /// Prompt tokens not computed here, fixed at first admission.
    pub cached_tokens: Option<u32>,
    /// Prompt tokens.
    pub prompt: Arc<[u32]>,
    /// Adapter index, if any.
    pub adapter: Option<u32>,
    /// Prompt tokens still to be pulled from a prefill instance (decode side, before its first admission).
    pub pending_transfer: Option<u32>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of};

    #[test]
    fn hot_fields_share_the_first_cache_line() {
        assert_eq!(align_of::<Seq>(), 64);
        // `Phase` is `repr(u8)`: its tag is its first byte.
        assert!(offset_of!(Seq, phase) < 64);
        for end in [
            offset_of!(Seq, key) + 8,
            offset_of!(Seq, blocks) + 24,
            offset_of!(Seq, committed) + 4,
            offset_of!(Seq, kind) + 1,
        ] {
            assert!(end <= 64, "hot field ends at byte {end}");
        }
        for end in [
            offset_of!(Seq, hashes) + 24,
            offset_of!(Seq, id) + 8,
            offset_of!(Seq, salt) + 8,
            offset_of!(Seq, cached_tokens) + 8,
        ] {
            assert!(end <= 128, "second-line field ends at byte {end}");
        }
        // The slab's `Option<Seq>` needs no room for its tag.
        assert_eq!(size_of::<Option<Seq>>(), size_of::<Seq>());
    }
}
