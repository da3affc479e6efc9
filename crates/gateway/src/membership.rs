//! Fleet membership: adding backends (after model discovery when needed), removing them with a
//! drain, and applying a reloaded fleet file as a diff, without dropping traffic.

use std::sync::Arc;
use std::time::Duration;

use switchyard_core::Observation;

use crate::backends::{Backend, BackendSpec};
use crate::state::Gateway;
use crate::{discovery, health, kv_events, scrape};

/// Adds a backend: at once when its models are known, else after discovery succeeds.
pub fn add(gw: &Arc<Gateway>, spec: BackendSpec) {
    if spec.models.is_empty() {
        gw.registry
            .lock()
            .pending
            .insert(spec.name.clone(), spec.clone());
        let gw = gw.clone();
        tokio::spawn(async move {
            let Some(found) = discovery::discover(&gw, &spec).await else {
                return;
            };
            if let Err(e) = join(&gw, spec, found, true) {
                tracing::warn!("discovery: {e}");
            }
        });
    } else if let Err(e) = join(gw, spec.clone(), spec, false) {
        tracing::error!("cannot add backend: {e}");
    }
}

/// Puts a backend with known models into the router and starts its health and scrape loops.
/// `configured` is the spec as written, `spec` has discovered models filled in; with
/// `from_discovery` it joins only if it is still the pending entry (not removed or replaced
/// while discovery ran).
pub fn join(
    gw: &Arc<Gateway>,
    configured: BackendSpec,
    spec: BackendSpec,
    from_discovery: bool,
) -> Result<Arc<Backend>, String> {
    let mut metrics = gw.metrics.for_backend(&spec.name);
    if spec.kv_events.is_some() {
        metrics.kv_events = gw
            .metrics
            .kv_events_for(&spec.name, spec.kv_events_replay.is_some());
    }
    let mut registry = gw.registry.lock();
    if from_discovery && registry.pending.get(&spec.name) != Some(&configured) {
        return Err(format!("`{}` left the fleet during discovery", spec.name));
    }
    registry.pending.remove(&spec.name);
    let id = registry
        .router
        .add_instance(spec.instance_spec())
        .map_err(|e| e.to_string())?;
    let backend = match Backend::new(configured, spec, id, metrics) {
        Ok(b) => Arc::new(b),
        Err(e) => {
            registry.observe(Observation::InstanceRemoved(id), gw.now());
            return Err(e.to_string());
        }
    };
    registry.insert(backend.clone());
    drop(registry);
    tracing::info!(
        backend = backend.name(),
        models = ?backend.spec.models,
        adapters = ?backend.spec.adapters,
        "backend joined"
    );
    tokio::spawn(health::run(gw.clone(), backend.clone()));
    tokio::spawn(scrape::run(gw.clone(), backend.clone()));
    if let Some(endpoint) = backend.spec.kv_events.clone() {
        tokio::spawn(kv_events::run(gw.clone(), backend.clone(), endpoint));
    }
    gw.admission.wake();
    Ok(backend)
}

/// Removes a backend now: the router forgets it; requests already streaming from it finish
/// (they hold their own handle), their observations are dropped.
pub fn evict(gw: &Gateway, name: &str) {
    let mut registry = gw.registry.lock();
    registry.pending.remove(name);
    let Some(backend) = registry.take(name) else {
        return;
    };
    registry.observe(Observation::InstanceRemoved(backend.id), gw.now());
    drop(registry);
    backend.mark_removed();
    gw.metrics.forget_backend(name);
    tracing::info!(backend = name, "backend removed");
}

/// Removes a backend gracefully: no new requests, then removal once its in-flight requests
/// end or `timeout` passes.
pub fn retire(gw: &Arc<Gateway>, name: &str, timeout: Duration) {
    let mut registry = gw.registry.lock();
    if registry.pending.remove(name).is_some() {
        return;
    }
    let Some(backend) = registry.by_name.get(name).cloned() else {
        return;
    };
    registry.leaving.insert(name.to_string());
    drop(registry);
    backend.set_draining(true);
    gw.sync_health(&backend);
    let gw = gw.clone();
    let name = name.to_string();
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + timeout;
        while backend.in_flight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Only if it was not re-added in the meantime.
        let still_leaving = {
            let registry = gw.registry.lock();
            registry.leaving.contains(&name)
                && registry
                    .by_name
                    .get(&name)
                    .is_some_and(|b| Arc::ptr_eq(b, &backend))
        };
        if still_leaving {
            evict(&gw, &name);
        }
    });
}

/// Applies the fleet file's backend list as a diff against what the file listed before:
/// new ones join, missing ones drain and leave, changed ones are replaced. Kubernetes
/// discovery (`switchyard epp --pool-name`, which excludes a fleet file) applies each new
/// desired set through here too, so both share one join/drain/leave path.
pub fn apply_file(gw: &Arc<Gateway>, specs: Vec<BackendSpec>) {
    let drain = gw.settings.drain_timeout;
    let mut to_add = Vec::new();
    let mut to_retire = Vec::new();
    let mut to_replace = Vec::new();
    let mut to_undrain = Vec::new();
    {
        let mut registry = gw.registry.lock();
        // Names a `--backend` already uses are not the file's to manage.
        let taken_by_flags = |name: &String| {
            !registry.from_file.contains(name)
                && (registry.by_name.contains_key(name) || registry.pending.contains_key(name))
        };
        let names: std::collections::HashSet<String> = specs
            .iter()
            .map(|s| s.name.clone())
            .filter(|n| !taken_by_flags(n))
            .collect();
        for old in registry.from_file.iter() {
            if !names.contains(old) {
                to_retire.push(old.clone());
            }
        }
        for spec in &specs {
            if !names.contains(&spec.name) {
                // A `--backend` of that name exists: reloads never touch those.
                tracing::error!(backend = %spec.name, "fleet file entry ignored: a --backend has this name");
                continue;
            }
            if let Some(pending) = registry.pending.get(&spec.name) {
                if pending != spec {
                    to_replace.push(spec.clone());
                }
                continue;
            }
            match registry.by_name.get(&spec.name) {
                None => to_add.push(spec.clone()),
                Some(b) => {
                    let same = b.configured == *spec;
                    let leaving = registry.leaving.contains(&spec.name);
                    if !same {
                        to_replace.push(spec.clone());
                    } else if leaving {
                        to_undrain.push(b.clone());
                    }
                }
            }
        }
        registry.from_file = names;
        for b in &to_undrain {
            registry.leaving.remove(b.name());
        }
    }
    for name in to_retire {
        retire(gw, &name, drain);
    }
    for b in to_undrain {
        b.set_draining(false);
        gw.sync_health(&b);
    }
    for spec in to_replace {
        evict(gw, &spec.name);
        add(gw, spec);
    }
    for spec in to_add {
        add(gw, spec);
    }
}
