//! The routing brain of Switchyard: fleet view, prefix index, policies. Pure: no I/O, no
//! async, no clock — time is an argument, so the simulator runs exactly what production runs.
//!
//! ```
//! use switchyard_core::{InstanceSpec, Observation, RequestId, RouteRequest, Router, RouterConfig};
//!
//! let mut router = Router::new(RouterConfig::default()).unwrap();
//! let a = router.add_instance(InstanceSpec::new("10.0.0.1:8000", "llama")).unwrap();
//! router.add_instance(InstanceSpec::new("10.0.0.2:8000", "llama")).unwrap();
//! let request = RouteRequest::text("llama", "You are a helpful assistant. Hello!");
//! let decision = router.route(&request, 0.0).unwrap();
//! let pick = decision.best().unwrap();
//! router.observe(Observation::Routed { request: RequestId(1), instance: pick, plan: decision.plan_for(pick) }, 0.0).unwrap();
//! router.observe(Observation::FirstToken(RequestId(1)), 0.05).unwrap();
//! router.observe(Observation::Finished(RequestId(1), None), 1.0).unwrap();
//! # let _ = a;
//! ```
#![warn(missing_docs)]

pub mod calibration;
pub mod config;
pub mod decision;
pub mod decode_slope;
pub mod exact;
pub mod fleet;
pub mod id;
mod ladder;
pub mod models;
pub mod observe;
pub mod placement;
pub mod policy;
pub mod prefix;
pub mod request;
pub mod router;
pub mod running_median;
pub mod shared_compute;

pub use config::{ConfigError, RouterConfig};
pub use decision::{Candidate, CostTerms, Decision, Exclusion, RoutePlan, ViewPredictions};
pub use exact::ExactChain;
pub use fleet::{EngineMetrics, Health, Instance, InstanceId, InstanceSpec, Role};
pub use observe::{KvEvent, Observation, ObserveError, Prediction, Usage};
pub use request::{ChatMessage, Phase, Prompt, RequestId, RequestKind, RouteRequest};
pub use router::{prepare, PreparedPrompt, RouteError, Router};
