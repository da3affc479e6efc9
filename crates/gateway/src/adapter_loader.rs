//! Dynamic LoRA adapter placement (`--dynamic-lora-placement`): every `placement.interval_s`
//! the core's [`Planner`](switchyard_core::placement::Planner) looks at per-adapter demand and at which backend holds which adapter,
//! and this task carries the plan out with vLLM's `POST /v1/load_lora_adapter
//! {lora_name, lora_path}` and `POST /v1/unload_lora_adapter {lora_name}`.
//!
//! Who holds which adapter is the core's (each instance's adapters, configured or discovered,
//! kept by `AdapterLoaded` / `AdapterUnloaded`); the registry keeps only the planner's demand
//! and plan. The view changes as soon as an action succeeds, not at the next scrape:
//!
//! * a successful load tells the router at once ([`Observation::AdapterLoaded`]): the backend
//!   is a candidate for the adapter, priced as resident;
//! * an unload takes the backend out of the adapter's candidates *before* the call
//!   ([`Observation::AdapterUnloaded`]: no request is sent there while it goes away), and puts
//!   it back if the call fails.
//!
//! Only adapters with a path (`--lora-path NAME=PATH`) are loaded or unloaded. Failures are
//! logged with the backend, adapter and answer, and counted in
//! `switchyard_adapter_placements_total{outcome="error"}`; the instance then waits out its
//! cooldown like after a success, so a failing engine is not hammered.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use switchyard_core::placement::{AdapterView, InstanceView, PlacementAction};
use switchyard_core::{Health, Observation};

use crate::backends::Backend;
use crate::state::Gateway;
use crate::upstream::{classify, Failure};

/// Plans and executes placements every `placement.interval_s` until shutdown.
pub async fn run(gw: Arc<Gateway>) {
    let period = Duration::from_secs_f64(gw.settings.router.placement.interval_s);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if gw.is_shutting_down() {
            return;
        }
        let (actions, demand) = plan(&gw);
        gw.metrics.set_adapter_demand(&demand);
        execute(&gw, actions).await;
    }
}

/// One plan under the lock: the fleet as placement sees it, and the demand per adapter.
fn plan(gw: &Gateway) -> (Vec<PlacementAction>, Vec<(String, f64)>) {
    let now = gw.now();
    let mut guard = gw.registry.lock();
    let catalog = guard.catalog();
    let registry = &mut *guard;
    let Some(state) = registry.placement.as_mut() else {
        return (Vec::new(), Vec::new());
    };
    let fleet = registry.router.fleet();
    let instances: Vec<InstanceView> = registry
        .by_name
        .values()
        .filter(|b| !registry.leaving.contains(b.name()))
        .filter_map(|b| {
            let i = fleet.get(b.id)?;
            Some(InstanceView {
                name: b.name().to_string(),
                models: b.spec.models.clone(),
                slots: i.adapter_slots(),
                adapters: i.spec.adapters.clone(),
                available: i.health == Health::Healthy,
                load: f64::from(i.load.in_flight()),
            })
        })
        .collect();
    let adapters: Vec<AdapterView> = catalog
        .into_iter()
        .filter_map(|(name, base)| {
            Some(AdapterView {
                loadable: gw.settings.lora_paths.contains_key(&name),
                base_model: base?,
                name,
            })
        })
        .collect();
    let actions = state.plan(&instances, &adapters, now);
    let demand = adapters
        .iter()
        .map(|a| (a.name.clone(), state.demand(&a.name, now)))
        .collect();
    (actions, demand)
}

/// Carries out a plan, one action after the other (an unload that makes room comes before the
/// load on the same backend, which is skipped if the unload failed).
async fn execute(gw: &Arc<Gateway>, actions: Vec<PlacementAction>) {
    let mut failed_unload: HashSet<String> = HashSet::new();
    for action in actions {
        if gw.is_shutting_down() {
            return;
        }
        let adapter = action.adapter().to_string();
        let name = action.instance().to_string();
        let backend = gw.registry.lock().by_name.get(&name).cloned();
        let Some(backend) = backend else {
            tracing::debug!(backend = %name, adapter = %adapter, "placement: backend left");
            continue;
        };
        let ok = match &action {
            PlacementAction::Load { .. } => {
                if failed_unload.contains(&name) {
                    tracing::info!(backend = %name, adapter = %adapter,
                        "placement: load skipped, making room failed");
                    continue;
                }
                load(gw, &backend, &adapter).await
            }
            PlacementAction::Unload { .. } => {
                let ok = unload(gw, &backend, &adapter).await;
                if !ok {
                    failed_unload.insert(name.clone());
                }
                ok
            }
        };
        let now = gw.now();
        if let Some(state) = gw.registry.lock().placement.as_mut() {
            state.applied(&action, ok, now);
        }
        gw.metrics.placement(&name, &adapter, action.kind(), ok);
        if ok {
            gw.live
                .placed(now, matches!(action, PlacementAction::Load { .. }));
        }
        gw.admission.wake();
    }
}

/// Loads `adapter` onto `backend`; on success the fleet view holds it there at once.
async fn load(gw: &Gateway, backend: &Backend, adapter: &str) -> bool {
    let Some(path) = gw.settings.lora_paths.get(adapter) else {
        return false;
    };
    let body = serde_json::json!({"lora_name": adapter, "lora_path": path});
    let ok = match post(gw, backend, "/v1/load_lora_adapter", &body).await {
        Ok((status, _)) if status.is_success() => true,
        // vLLM: "The lora adapter 'x' has already been loaded." It is there: what we wanted.
        Ok((StatusCode::BAD_REQUEST, text)) if text.contains("already been loaded") => true,
        Ok((status, text)) => {
            tracing::warn!(backend = backend.name(), adapter, %status, answer = %snippet(&text),
                "placement: loading the adapter failed");
            false
        }
        Err(e) => {
            tracing::warn!(
                backend = backend.name(),
                adapter,
                "placement: loading the adapter failed: {e}"
            );
            false
        }
    };
    if ok {
        tracing::info!(
            backend = backend.name(),
            adapter,
            path,
            "placement: adapter loaded"
        );
        let now = gw.now();
        let mut guard = gw.registry.lock();
        let registry = &mut *guard;
        if registry.backend(backend.id).is_some() {
            registry.observe(
                Observation::AdapterLoaded(backend.id, adapter.to_string()),
                now,
            );
        }
    }
    ok
}

/// Unloads `adapter` from `backend`: no request goes there for it from now on, unless the
/// call fails.
async fn unload(gw: &Gateway, backend: &Backend, adapter: &str) -> bool {
    {
        let now = gw.now();
        let mut registry = gw.registry.lock();
        if registry.placement.is_none() {
            return false;
        }
        if registry.backend(backend.id).is_some() {
            registry.observe(
                Observation::AdapterUnloaded(backend.id, adapter.to_string()),
                now,
            );
        }
    }
    let body = serde_json::json!({"lora_name": adapter});
    let ok = match post(gw, backend, "/v1/unload_lora_adapter", &body).await {
        Ok((status, _)) if status.is_success() => true,
        // Not there (any more): what we wanted.
        Ok((StatusCode::NOT_FOUND, _)) => true,
        Ok((status, text)) => {
            tracing::warn!(backend = backend.name(), adapter, %status, answer = %snippet(&text),
                "placement: unloading the adapter failed");
            false
        }
        Err(e) => {
            tracing::warn!(
                backend = backend.name(),
                adapter,
                "placement: unloading the adapter failed: {e}"
            );
            false
        }
    };
    if ok {
        tracing::info!(
            backend = backend.name(),
            adapter,
            "placement: adapter unloaded"
        );
    } else {
        let now = gw.now();
        let mut registry = gw.registry.lock();
        // Still there: routable again (counted as a fresh load for the swap cooldown).
        if registry.backend(backend.id).is_some() {
            registry.observe(
                Observation::AdapterLoaded(backend.id, adapter.to_string()),
                now,
            );
        }
    }
    ok
}

fn snippet(text: &str) -> &str {
    let end = text.char_indices().nth(300).map_or(text.len(), |(i, _)| i);
    &text[..end]
}

/// POSTs JSON to the backend within the upstream timeout; a pooled connection the engine had
/// closed is retried once on a fresh one.
async fn post(
    gw: &Gateway,
    backend: &Backend,
    path: &str,
    body: &serde_json::Value,
) -> Result<(StatusCode, String), String> {
    let uri = backend.base.uri(path).map_err(|e| e.to_string())?;
    let bytes = Bytes::from(body.to_string());
    let build = || {
        Request::post(uri.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(bytes.clone()))
            .map_err(|e| e.to_string())
    };
    let call = async {
        let response = match gw.upstream.send(false, build()?).await {
            Ok(r) => r,
            Err(e) if classify(&e) == Failure::Closed => gw
                .upstream
                .send(true, build()?)
                .await
                .map_err(|e| e.to_string())?,
            Err(e) => return Err(e.to_string()),
        };
        let status = response.status();
        let body = Limited::new(response.into_body(), 64 << 10)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(gw.settings.upstream_timeout, call)
        .await
        .map_err(|_| "timed out".to_string())?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::BackendSpec;
    use crate::metrics::BackendMetrics;
    use switchyard_core::decision::Exclusion;
    use switchyard_core::{InstanceSpec, RouteRequest, Router, RouterConfig};

    fn backend(router: &mut Router, name: &str, adapters: &[&str]) -> Arc<Backend> {
        let spec = BackendSpec {
            name: name.into(),
            address: format!("http://127.0.0.1:1/{name}"),
            models: vec!["m".into()],
            adapters: adapters.iter().map(|a| a.to_string()).collect(),
            ..BackendSpec::default()
        };
        let id = router
            .add_instance(InstanceSpec {
                adapter_slots: 2,
                ..spec.instance_spec()
            })
            .unwrap();
        Arc::new(Backend::new(spec.clone(), spec, id, BackendMetrics::detached()).unwrap())
    }

    #[test]
    fn a_loaded_adapter_is_routable_at_once_and_an_unloaded_one_is_not() {
        let mut router = Router::new(RouterConfig::default()).unwrap();
        let a = backend(&mut router, "a", &["x"]);
        let b = backend(&mut router, "b", &[]);
        let request = RouteRequest {
            adapter: Some("x"),
            ..RouteRequest::text("m", "hello")
        };
        let d = router.route(&request, 0.0).unwrap();
        assert_eq!(d.eligible, 1);
        // Loaded onto b: a candidate at once, priced as resident.
        router
            .observe(Observation::AdapterLoaded(b.id, "x".into()), 1.0)
            .unwrap();
        let d = router.route(&request, 1.0).unwrap();
        assert_eq!(d.eligible, 2);
        assert_eq!(d.candidate(b.id).unwrap().terms.adapter_s, 0.0);
        // Unloaded from a: no longer a candidate.
        router
            .observe(Observation::AdapterUnloaded(a.id, "x".into()), 2.0)
            .unwrap();
        let d = router.route(&request, 2.0).unwrap();
        assert_eq!(d.eligible, 1);
        assert_eq!(d.best(), Some(b.id));
        assert_eq!(
            d.candidate(a.id).unwrap().excluded,
            Some(Exclusion::AdapterUnavailable)
        );
    }
}
