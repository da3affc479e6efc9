//! Everything the router is told about the world, as plain data.

use thiserror::Error;

use crate::decision::RoutePlan;
use crate::fleet::{EngineMetrics, Health, InstanceId, InstanceSpec};
use crate::request::RequestId;

/// Token counts an engine reports for a finished request (OpenAI `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens served from the engine's prefix cache, when the engine reports them.
    pub cached_tokens: Option<u32>,
    /// Generated tokens.
    pub completion_tokens: u32,
}

/// One KV cache event from an engine (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks were stored; `token_ids` holds their tokens back to back.
    Stored {
        /// The engine's hashes of the stored blocks, in chain order.
        block_hashes: Vec<u64>,
        /// The engine's hash of the block before the first one, if any.
        parent_block_hash: Option<u64>,
        /// Tokens of the blocks.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Adapter the blocks belong to.
        lora_name: Option<String>,
    },
    /// Blocks were evicted.
    Removed {
        /// The engine's hashes of the removed blocks.
        block_hashes: Vec<u64>,
    },
    /// The whole cache was reset.
    AllCleared,
}

/// An observation fed to [`crate::Router::observe`].
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    /// A new instance joined the fleet.
    InstanceAdded(InstanceSpec),
    /// An instance left the fleet.
    InstanceRemoved(InstanceId),
    /// An instance's health changed.
    HealthChanged(InstanceId, Health),
    /// An instance's engine metrics were scraped.
    MetricsScraped(InstanceId, EngineMetrics),
    /// A request was sent to an instance (plan from [`crate::Decision::plan_for`]).
    Routed {
        /// The request.
        request: RequestId,
        /// Where it went.
        instance: InstanceId,
        /// What the decision predicted there.
        plan: RoutePlan,
    },
    /// The request's first token arrived.
    FirstToken(RequestId),
    /// The request finished; `usage` as the engine reported it, if it did.
    Finished(RequestId, Option<Usage>),
    /// The request failed or was cancelled before finishing.
    Failed(RequestId),
    /// KV cache events from an instance (exact mode).
    KvEvents(InstanceId, Vec<KvEvent>),
    /// The instance's KV event stream broke or is not yet trusted (a sequence gap, silence, lag,
    /// a new subscription): its exact view is dropped and its lookups use the approximate index
    /// until [`Observation::KvEventsTrusted`]; events keep rebuilding the view meanwhile.
    KvEventsLost(InstanceId),
    /// The instance's KV events are trusted again: exact lookups resume on it.
    KvEventsTrusted(InstanceId),
    /// An adapter was loaded onto an instance (e.g. by dynamic placement): it is registered
    /// and resident there from now on.
    AdapterLoaded(InstanceId, String),
    /// An adapter was unloaded from an instance: no longer registered or resident there.
    AdapterUnloaded(InstanceId, String),
}

/// An observation the router could not apply.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ObserveError {
    /// No current instance has this handle.
    #[error("unknown instance {0:?}")]
    UnknownInstance(InstanceId),
    /// An instance with this name exists already.
    #[error("an instance named `{0}` exists already")]
    DuplicateInstance(String),
    /// The spec is unusable.
    #[error("invalid instance spec: {0}")]
    InvalidInstance(String),
    /// No request in flight has this id.
    #[error("unknown request {0:?}")]
    UnknownRequest(RequestId),
    /// The request is already in flight.
    #[error("request {0:?} is already in flight")]
    DuplicateRequest(RequestId),
}

/// What the router predicted for a request against what happened: how a user tells whether to
/// trust it (drained with [`crate::Router::take_predictions`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Prediction {
    /// Estimated against observed time to first token, seconds (the estimate includes the
    /// instance's learned fixed part, `Learned::ttft_fixed_s`).
    Ttft {
        /// What the decision expected.
        estimated_s: f64,
        /// What was observed.
        observed_s: f64,
    },
    /// Predicted against engine-reported cached prompt tokens.
    Cached {
        /// What the index expected.
        predicted: u32,
        /// What the engine reported.
        reported: u32,
        /// Prompt tokens the engine reported.
        prompt: u32,
    },
}

impl Prediction {
    /// Relative error: |estimated − observed| ÷ observed for TTFT, |predicted − reported| ÷
    /// prompt tokens for cached tokens (so a prompt with nothing cached still counts).
    pub fn relative_error(&self) -> f64 {
        match *self {
            Prediction::Ttft {
                estimated_s,
                observed_s,
            } => (estimated_s - observed_s).abs() / observed_s.max(1e-6),
            Prediction::Cached {
                predicted,
                reported,
                prompt,
            } => (f64::from(predicted) - f64::from(reported)).abs() / f64::from(prompt.max(1)),
        }
    }
}
