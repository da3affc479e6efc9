//! Kubernetes discovery (`switchyard epp --pool-name`): the `InferencePool` and the pods it
//! selects, watched through the API server, become the fleet. Ready pods join as `ip:port`
//! (one backend per target port); pods that lose readiness, get a deletion timestamp or go
//! away drain and leave, through the same membership path as a fleet-file reload. The routing
//! core is not touched: discovery only produces membership changes.
//!
//! One job per module: [`pool`] the resource type, [`mapping`] pods to backends (pure),
//! [`cache`] the last known objects, [`config`] the pool and the API client, [`watch`] the
//! loop that ties them to the gateway.

pub mod cache;
pub mod config;
pub mod mapping;
pub mod pool;
pub mod watch;

pub use config::{client, default_namespace, PoolSettings};
use thiserror::Error;

/// Why discovery could not start.
#[derive(Debug, Error)]
pub enum DiscoveryError {
    /// No usable API server configuration (kubeconfig, in-cluster service account).
    #[error("kubernetes: {0}")]
    Config(String),
}
