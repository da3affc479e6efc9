//! Fleet file reloads: the file's directory is watched (editors and Kubernetes replace files
//! rather than write them in place), and SIGHUP also reloads. A file that fails to load keeps
//! the fleet as it was.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::config::load_fleet_file;
use crate::fleet;
use crate::state::Gateway;

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
            crate::models::merge_aliases(&gw.settings.model_aliases, &file.model_aliases)
                .map(|aliases| (file.backends, aliases))
                .map_err(|e| format!("{}: {e}", path.display()))
        });
    match loaded {
        Ok((specs, aliases)) => {
            gw.brain.lock().set_aliases(aliases);
            fleet::apply_file(gw, specs);
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
            // Let a burst of events (write, rename, chmod) settle, then read once.
            tokio::time::sleep(Duration::from_millis(50)).await;
            while rx.try_recv().is_ok() {}
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
