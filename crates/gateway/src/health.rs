//! Active health checks (`GET /health`): ejection after `eject_after` consecutive failures
//! (at once when the backend refuses connections), readmission after `readmit_after` passes.
//! Requests feed the same counters passively (see [`record_failure`]).

use std::sync::Arc;

use crate::backends::{Backend, HealthChange};
use crate::state::Gateway;
use crate::upstream::ProbeError;

/// Checks one backend until it leaves the fleet.
pub async fn run(gw: Arc<Gateway>, backend: Arc<Backend>) {
    let Ok(uri) = backend.base.uri("/health") else {
        return;
    };
    let mut tick = tokio::time::interval(gw.settings.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if backend.is_removed() {
            return;
        }
        let answer = gw
            .upstream
            .get(uri.clone(), gw.settings.probe_timeout, 64 << 10)
            .await;
        let change = match answer {
            Ok((status, _)) if status.is_success() => {
                backend.metrics.check_ok.inc();
                backend.record_check_success(gw.settings.readmit_after)
            }
            Ok((status, _)) => {
                backend.metrics.check_error.inc();
                tracing::debug!(backend = backend.name(), %status, "health check failed");
                backend.record_failure(false, gw.settings.eject_after)
            }
            Err(e) => {
                backend.metrics.check_error.inc();
                tracing::debug!(backend = backend.name(), "health check failed: {e}");
                backend.record_failure(e == ProbeError::Refused, gw.settings.eject_after)
            }
        };
        apply(&gw, &backend, change);
    }
}

/// Counts a failed request against a backend (`refused`: ejects at once).
pub fn record_failure(gw: &Gateway, backend: &Backend, refused: bool) {
    let change = backend.record_failure(refused, gw.settings.eject_after);
    apply(gw, backend, change);
}

fn apply(gw: &Gateway, backend: &Backend, change: HealthChange) {
    match change {
        HealthChange::None => {}
        HealthChange::Ejected => {
            tracing::warn!(backend = backend.name(), "backend ejected");
            gw.sync_health(backend);
        }
        HealthChange::Readmitted => {
            tracing::info!(backend = backend.name(), "backend readmitted");
            gw.sync_health(backend);
        }
    }
}
