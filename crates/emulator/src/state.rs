//! What every handler shares: the served model, the engine handle, metrics, known adapters.
//! Below the server and the handlers, so neither imports the other for it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use switchyard_engine::EngineConfig;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::pd::Advertised;
use crate::runner::EngineHandle;

/// State shared by all handlers.
#[derive(Debug)]
pub struct AppState {
    /// The served base model name.
    pub model: String,
    /// The engine configuration (limits, role, block size).
    pub engine_cfg: EngineConfig,
    /// Handle to the engine task.
    pub engine: EngineHandle,
    /// Prometheus families.
    pub metrics: Arc<Metrics>,
    /// Known adapters: name -> path (for `/v1/models`).
    pub adapters: RwLock<BTreeMap<String, String>>,
    /// Answer at once without engine timing.
    pub instant: bool,
    /// The chat template's markers are special tokens (`--special-tokens`).
    pub special_tokens: bool,
    /// Unix time the server started (`created` in `/v1/models`).
    pub created: u64,
    /// Where the prefill side says its KV lives.
    pub advertised: Advertised,
    /// Seed for generated ids.
    pub seed: u64,
    /// Counter for response ids.
    pub seq: AtomicU64,
}

impl AppState {
    /// A fresh response id with the given prefix (`cmpl`, `chatcmpl`).
    pub fn response_id(&self, prefix: &str) -> String {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:016x}{:08x}", self.seed, n)
    }

    /// Resolve a requested model name to `None` (base) or `Some(adapter)`.
    pub fn resolve_model(&self, model: &str) -> Result<Option<String>, ApiError> {
        if model == self.model {
            return Ok(None);
        }
        let known = self
            .adapters
            .read()
            .map(|a| a.contains_key(model))
            .unwrap_or(false);
        if known {
            Ok(Some(model.to_string()))
        } else {
            Err(ApiError::unknown_model(model))
        }
    }
}

/// Shared state as handlers receive it.
pub type SharedState = Arc<AppState>;
