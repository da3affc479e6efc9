//! Which pool to watch and how to reach the API server: in-cluster (the service account) by
//! default, a kubeconfig (`--kubeconfig`, or `KUBECONFIG`) out of the cluster.

use std::path::{Path, PathBuf};

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use super::DiscoveryError;

/// The namespace file of a pod's service account.
pub const SERVICE_ACCOUNT_NAMESPACE: &str =
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// What `switchyard epp --pool-name` watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSettings {
    /// The `InferencePool`'s name.
    pub name: String,
    /// Its namespace (the pods are looked for there too).
    pub namespace: String,
    /// A kubeconfig file; `None`: `KUBECONFIG` when set, else the in-cluster service account.
    pub kubeconfig: Option<PathBuf>,
    /// Other pickers to share decisions with, found among the namespace's pods
    /// (`--peer-selector`).
    pub peers: Option<super::mapping::PeerSelector>,
}

/// The pool's namespace when no flag names it: `NAMESPACE`, then `POD_NAMESPACE` (as the
/// reference picker's manifests set them), then the service account's namespace file, then
/// `default`. `env` and `read` are the environment and the file system (tests pass fakes).
pub fn default_namespace(
    env: impl Fn(&str) -> Option<String>,
    read: impl Fn(&Path) -> Option<String>,
) -> String {
    ["NAMESPACE", "POD_NAMESPACE"]
        .into_iter()
        .filter_map(&env)
        .chain(read(Path::new(SERVICE_ACCOUNT_NAMESPACE)))
        .map(|ns| ns.trim().to_string())
        .find(|ns| !ns.is_empty())
        .unwrap_or_else(|| "default".to_string())
}

/// A client for the API server these settings name.
pub async fn client(settings: &PoolSettings) -> Result<Client, DiscoveryError> {
    let config = match &settings.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path).map_err(|e| {
                DiscoveryError::Config(format!("kubeconfig {}: {e}", path.display()))
            })?;
            Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(|e| {
                    DiscoveryError::Config(format!("kubeconfig {}: {e}", path.display()))
                })?
        }
        None if std::env::var_os("KUBECONFIG").is_some() => Config::infer()
            .await
            .map_err(|e| DiscoveryError::Config(format!("KUBECONFIG: {e}")))?,
        None => Config::incluster().map_err(|e| {
            DiscoveryError::Config(format!(
                "in-cluster config (no --kubeconfig or KUBECONFIG given): {e}"
            ))
        })?,
    };
    Client::try_from(config).map_err(|e| DiscoveryError::Config(format!("client: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_namespace_comes_from_env_then_the_service_account_then_default() {
        let none = |_: &Path| None;
        let file = |_: &Path| Some("from-file\n".to_string());
        let env = |k: &str| (k == "POD_NAMESPACE").then(|| "pod-ns".to_string());
        let both = |k: &str| Some(k.to_lowercase());
        assert_eq!(default_namespace(both, file), "namespace");
        assert_eq!(default_namespace(env, file), "pod-ns");
        assert_eq!(default_namespace(|_| None, file), "from-file");
        assert_eq!(default_namespace(|_| Some(" ".into()), none), "default");
    }
}
