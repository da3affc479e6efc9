//! Model discovery: a backend configured without models is asked for its `/v1/models` (base
//! models, and LoRA adapters as the entries with a `parent`) before it joins the router.

use serde::Deserialize;

use crate::backends::{BackendSpec, BaseUrl};
use crate::state::Gateway;

/// `/v1/models` as engines answer it.
#[derive(Debug, Deserialize)]
struct ModelList {
    #[serde(default)]
    data: Vec<ModelCard>,
}

#[derive(Debug, Deserialize)]
struct ModelCard {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

/// Splits a `/v1/models` body into (base models, adapters).
pub fn parse_models(body: &[u8]) -> Result<(Vec<String>, Vec<String>), String> {
    let list: ModelList = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let mut models = Vec::new();
    let mut adapters = Vec::new();
    for card in list.data {
        match card.parent {
            Some(p) if !p.is_empty() && p != card.id => adapters.push(card.id),
            _ => models.push(card.id),
        }
    }
    if models.is_empty() {
        return Err("the backend lists no base model".into());
    }
    Ok((models, adapters))
}

/// Asks the backend for its models until it answers (or leaves the fleet); returns its spec
/// with them filled in (`None`: it left, or its address is unusable). Joining the fleet is the
/// caller's (the membership module).
pub async fn discover(gw: &Gateway, configured: &BackendSpec) -> Option<BackendSpec> {
    let base = BaseUrl::parse(&configured.address).ok()?;
    let uri = base.uri("/v1/models").ok()?;
    let mut logged = false;
    loop {
        if gw.registry.lock().pending.get(&configured.name) != Some(configured) {
            return None;
        }
        let answer = gw
            .upstream
            .get(uri.clone(), gw.settings.probe_timeout, 4 << 20)
            .await;
        let found = match answer {
            Ok((status, body)) if status.is_success() => parse_models(&body),
            Ok((status, _)) => Err(format!("status {status}")),
            Err(e) => Err(e.to_string()),
        };
        match found {
            Ok((models, adapters)) => {
                let mut spec = configured.clone();
                spec.models = models;
                if spec.adapters.is_empty() {
                    spec.adapters = adapters;
                }
                return Some(spec);
            }
            Err(e) => {
                if !logged {
                    tracing::warn!(backend = %configured.name, "model discovery failed, retrying: {e}");
                    logged = true;
                }
            }
        }
        tokio::time::sleep(gw.settings.health_interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_are_the_entries_with_a_parent() {
        let body = br#"{"object":"list","data":[
            {"id":"base","parent":null,"root":"base"},
            {"id":"sql-lora","parent":"base","root":"/adapters/sql"},
            {"id":"other"}]}"#;
        let (m, a) = parse_models(body).unwrap();
        assert_eq!(m, vec!["base", "other"]);
        assert_eq!(a, vec!["sql-lora"]);
        assert!(parse_models(b"{\"data\":[]}").is_err());
        assert!(parse_models(b"nope").is_err());
    }
}
