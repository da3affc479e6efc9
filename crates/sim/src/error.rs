//! Why a simulation could not run.

use thiserror::Error;

/// A simulation error.
#[derive(Debug, Error)]
pub enum SimError {
    /// The fleet description is unusable.
    #[error("invalid fleet: {0}")]
    Fleet(String),
    /// An engine configuration was refused by the engine model.
    #[error("instance {instance}: {source}")]
    Engine {
        /// Index of the instance.
        instance: usize,
        /// The engine model's reason.
        source: switchyard_engine::ConfigError,
    },
    /// The router configuration was refused.
    #[error("router: {0}")]
    Router(#[from] switchyard_core::ConfigError),
    /// The router refused an observation the simulator considers valid (a simulator bug).
    #[error("router observation: {0}")]
    Observe(#[from] switchyard_core::ObserveError),
    /// The workload could not be built.
    #[error("workload: {0}")]
    Workload(#[from] switchyard_workload::WorkloadError),
    /// A setting is out of range.
    #[error("invalid setting `{key}`: {reason}")]
    Setting {
        /// Which setting.
        key: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Requests are in flight but no engine has anything to do (an engine-model deadlock).
    #[error("stalled at t={time:.3}s with {live} requests in flight and no engine event pending")]
    Stalled {
        /// Virtual time of the stall.
        time: f64,
        /// Requests still in flight.
        live: u64,
    },
    /// An engine reported a request finished that was already finished or rejected.
    #[error("request {request} ended twice")]
    Conservation {
        /// The request.
        request: u64,
    },
    /// Writing results failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Drawing a chart failed.
    #[error("chart {path}: {reason}")]
    Chart {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        reason: String,
    },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, SimError>;
