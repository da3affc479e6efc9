//! Fleet file reloads: the file's directory is watched (editors and Kubernetes replace files
//! rather than write them in place), and SIGHUP also reloads. A file that fails to load keeps
//! the fleet as it was, and so does one without a `backends` key (an empty file is what a
//! truncate-then-write editor leaves for a moment). Events are debounced: the file is read once
//! it has been quiet for [`QUIET`], so a file still being written is not applied half-way.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::config::load_fleet_file;
use crate::membership;
use crate::state::Gateway;

/// A change is applied once no event came for this long.
const QUIET: Duration = Duration::from_millis(200);

/// ... or at the latest this long after the first event of a burst (a file rewritten without
/// pause is still picked up).
const QUIET_AT_MOST: Duration = Duration::from_secs(2);

/// Waits until `rx` has been silent for [`QUIET`] (at most [`QUIET_AT_MOST`]); false when the
/// sender is gone.
async fn settle(rx: &mut mpsc::UnboundedReceiver<()>) -> bool {
    let give_up = tokio::time::Instant::now() + QUIET_AT_MOST;
    loop {
        let until = (tokio::time::Instant::now() + QUIET).min(give_up);
        match tokio::time::timeout_at(until, rx.recv()).await {
            Err(_) => return true,
            Ok(None) => return false,
            Ok(Some(())) if tokio::time::Instant::now() >= give_up => return true,
            Ok(Some(())) => {}
        }
    }
}

/// Keeps the watcher alive; dropping it stops watching.
pub struct FleetWatcher {
    _watcher: notify::RecommendedWatcher,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FleetWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Loads the file and applies it (backends and model aliases); false (and the fleet unchanged)
/// when it does not load or its aliases conflict with the flags'.
pub fn reload(gw: &Arc<Gateway>, path: &std::path::Path) -> bool {
    let loaded = load_fleet_file(path)
        .map_err(|e| e.to_string())
        .and_then(|file| {
            switchyard_core::models::merge_aliases(&gw.settings.model_aliases, &file.model_aliases)
                .map(|aliases| (file.backends, aliases))
                .map_err(|e| format!("{}: {e}", path.display()))
        });
    match loaded {
        Ok((specs, aliases)) => {
            gw.registry.lock().set_aliases(aliases);
            membership::apply_file(gw, specs);
            gw.metrics.reload(true);
            true
        }
        Err(e) => {
            tracing::error!("fleet file not reloaded: {e}");
            gw.metrics.reload(false);
            false
        }
    }
}

/// Starts watching `path`.
pub fn watch(gw: Arc<Gateway>, path: PathBuf) -> Result<FleetWatcher, notify::Error> {
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let hup = tx.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok_and(|e| !e.kind.is_access()) {
            let _ = tx.send(());
        }
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    #[cfg(unix)]
    tokio::spawn(async move {
        let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        else {
            return;
        };
        while s.recv().await.is_some() {
            if hup.send(()).is_err() {
                return;
            }
        }
    });
    #[cfg(not(unix))]
    drop(hup);
    let task = tokio::spawn(async move {
        let mut last = std::fs::read(&path).ok();
        while rx.recv().await.is_some() {
            // Let a burst of events (truncate, write, rename, chmod) settle, then read once.
            if !settle(&mut rx).await {
                return;
            }
            let now = std::fs::read(&path).ok();
            if now.is_none() || now == last {
                continue;
            }
            tracing::info!(file = %path.display(), "fleet file changed");
            if reload(&gw, &path) {
                last = now;
            }
        }
    });
    Ok(FleetWatcher {
        _watcher: watcher,
        task,
    })
}
