//! The `InferencePool` resource (`inference.networking.k8s.io/v1`): just the fields discovery
//! reads. k8s-openapi has no type for it and kube's derive pulls in schema generation, so the
//! `Resource` impl is written out (five constants).

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::NamespaceResourceScope;
use kube::Resource;
use serde::Deserialize;

/// An `InferencePool` as the API server sends it (unknown fields ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct InferencePool {
    /// Standard object metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// What the pool selects.
    #[serde(default)]
    pub spec: InferencePoolSpec,
}

/// `spec` of an `InferencePool`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The pods of the pool.
    #[serde(default)]
    pub selector: LabelSelector,
    /// The ports the model servers listen on (one endpoint per pod and port).
    #[serde(default)]
    pub target_ports: Vec<TargetPort>,
    /// The picker that serves this pool (read for the log only: we are it).
    #[serde(default)]
    pub endpoint_picker_ref: Option<serde_json::Value>,
}

/// `spec.selector`: v1 pools select by exact labels only.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Every label here must be on a pod for the pool to select it.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// One of `spec.targetPorts`.
#[derive(Debug, Clone, Deserialize)]
pub struct TargetPort {
    /// The port number (1-65535; others are skipped).
    pub number: i32,
}

impl Resource for InferencePool {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "InferencePool".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "inference.networking.k8s.io".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "inferencepools".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_v1_pool_parses_and_has_the_right_path() {
        let pool: InferencePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "llama", "namespace": "ml", "resourceVersion": "7"},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm"}},
                "targetPorts": [{"number": 8000}, {"number": 8001}],
                "endpointPickerRef": {"name": "llama-epp", "port": {"number": 9002}}
            }
        }))
        .expect("parses");
        assert_eq!(pool.spec.selector.match_labels["app"], "vllm");
        assert_eq!(pool.spec.target_ports.len(), 2);
        assert_eq!(
            InferencePool::url_path(&(), Some("ml")),
            "/apis/inference.networking.k8s.io/v1/namespaces/ml/inferencepools"
        );
    }
}
