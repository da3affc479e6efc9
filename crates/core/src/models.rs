//! Model name resolution: what a request's `model` means for routing.
//!
//! In order: an alias (`--model-alias NAME=MODEL`, fleet file `model_aliases`) is replaced by its
//! target; the name (or target) is a base model some backend serves, else an adapter, which maps
//! to its base model; else, in a fleet serving exactly one base model and without
//! `--strict-models`, the request goes to that model. Anything else is unknown (404).
//!
//! [`resolve`] is the one function every driver calls (`serve`, `epp`, `switchyard route`): the
//! adapters it knows are the fleet's own ([`Fleet::adapter_base`]), kept by the router as
//! adapters are loaded and unloaded, so nothing else keeps a copy.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};

use crate::fleet::Fleet;

/// Most distinct names the single-model fallback remembers having logged.
pub const FALLBACK_LOG_CAP: usize = 1024;

/// How a requested name was resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// A base model some backend serves.
    Served,
    /// An adapter, routed on its base model.
    Adapter,
    /// An alias, replaced by its target (a base model or an adapter).
    Alias,
    /// Unknown, sent to the fleet's only base model.
    Fallback,
}

/// A requested model name resolved against the fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution<'a> {
    /// Base model to route on (owned only for the fallback, which names the fleet's model).
    pub model: Cow<'a, str>,
    /// Adapter asked for, if any.
    pub adapter: Option<&'a str>,
    /// Which rule applied.
    pub via: Via,
}

impl Resolution<'_> {
    /// The `model` the engine must see when it is not the requested name (an alias or the
    /// fallback applied): the alias target (base model or adapter), or the fleet's only model.
    pub fn upstream_model(&self) -> Option<&str> {
        match self.via {
            Via::Alias | Via::Fallback => Some(self.adapter.unwrap_or(&self.model)),
            Via::Served | Via::Adapter => None,
        }
    }
}

/// A name that resolves to nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// Neither a served model, an adapter nor an alias (or the fallback does not apply).
    #[error("no backend serves model `{0}`")]
    Unknown(String),
    /// An alias whose target no backend serves.
    #[error("model `{alias}` is an alias of `{target}`, which no backend serves")]
    AliasTarget {
        /// The requested name.
        alias: String,
        /// What it is an alias of.
        target: String,
    },
}

/// Resolves `requested` (see the module documentation). `aliases` maps alias names to targets;
/// `strict` turns the single-model fallback off.
pub fn resolve<'a>(
    fleet: &'a Fleet,
    aliases: &'a HashMap<String, String>,
    strict: bool,
    requested: &'a str,
) -> Result<Resolution<'a>, ModelError> {
    let (name, via) = match aliases.get(requested) {
        Some(target) => (target.as_str(), Via::Alias),
        None => (requested, Via::Served),
    };
    if !fleet.serving(name).is_empty() {
        return Ok(Resolution {
            model: Cow::Borrowed(name),
            adapter: None,
            via,
        });
    }
    if let Some(base) = fleet.adapter_base(name) {
        return Ok(Resolution {
            model: Cow::Borrowed(base),
            adapter: Some(name),
            via: if via == Via::Alias {
                Via::Alias
            } else {
                Via::Adapter
            },
        });
    }
    if via == Via::Alias {
        return Err(ModelError::AliasTarget {
            alias: requested.to_string(),
            target: name.to_string(),
        });
    }
    match only_model(fleet) {
        Some(only) if !strict => Ok(Resolution {
            model: Cow::Owned(only.to_string()),
            adapter: None,
            via: Via::Fallback,
        }),
        _ => Err(ModelError::Unknown(requested.to_string())),
    }
}

/// The fleet's base model when it serves exactly one.
fn only_model(fleet: &Fleet) -> Option<&str> {
    let mut models = fleet.models();
    let first = models.next()?;
    models.next().is_none().then_some(first)
}

/// Parses `NAME=MODEL` (a `--model-alias` value).
pub fn parse_alias(entry: &str) -> Result<(String, String), String> {
    let Some((name, target)) = entry.split_once('=') else {
        return Err(format!("`{entry}`: expected NAME=MODEL"));
    };
    let (name, target) = (name.trim(), target.trim());
    check_alias(name, target).map_err(|e| format!("`{entry}`: {e}"))?;
    Ok((name.to_string(), target.to_string()))
}

/// Checks one alias: both names non-empty, and not an alias of itself.
pub fn check_alias(name: &str, target: &str) -> Result<(), String> {
    if name.is_empty() || target.is_empty() {
        return Err("alias and model must not be empty".into());
    }
    if name == target {
        return Err(format!("`{name}` is an alias of itself"));
    }
    Ok(())
}

/// Merges the aliases of the flags and of the fleet file: a name both give must have the same
/// target in both, and no target may itself be an alias (aliases are not followed).
pub fn merge_aliases(
    flags: &BTreeMap<String, String>,
    file: &BTreeMap<String, String>,
) -> Result<HashMap<String, String>, String> {
    let mut all: HashMap<String, String> = flags.clone().into_iter().collect();
    for (name, target) in file {
        match all.get(name) {
            Some(t) if t != target => {
                return Err(format!(
                    "model alias `{name}` is `{t}` on the command line and `{target}` in the fleet file"
                ))
            }
            _ => {
                all.insert(name.clone(), target.clone());
            }
        }
    }
    // Sorted, so the error names the same entry every time.
    let mut pairs: Vec<(&String, &String)> = all.iter().collect();
    pairs.sort();
    for (name, target) in pairs {
        if all.contains_key(target) {
            return Err(format!(
                "model alias `{name}` points to `{target}`, which is itself an alias (aliases are not followed)"
            ));
        }
    }
    Ok(all)
}

/// Remembers which names the single-model fallback has logged, so each is logged once; at most
/// [`FALLBACK_LOG_CAP`] names (then it starts over), reset when the fallback target changes.
#[derive(Debug, Default)]
pub struct FallbackLog {
    target: String,
    seen: HashSet<String>,
}

impl FallbackLog {
    /// Whether `name` sent to `target` is news (and remembers it).
    pub fn first_time(&mut self, name: &str, target: &str) -> bool {
        if self.target != target {
            self.target = target.to_string();
            self.seen.clear();
        }
        if self.seen.contains(name) {
            return false;
        }
        if self.seen.len() >= FALLBACK_LOG_CAP {
            self.seen.clear();
        }
        self.seen.insert(name.to_string());
        true
    }

    /// Names remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether no name is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{InstanceSpec, Router};

    /// Instances (name, base model, adapters).
    fn fleet(instances: &[(&str, &str, &[&str])]) -> Router {
        let mut r = Router::new(Default::default()).unwrap();
        for (name, model, adapters) in instances {
            let mut spec = InstanceSpec::new(*name, *model);
            spec.adapters = adapters.iter().map(|a| a.to_string()).collect();
            r.add_instance(spec).unwrap();
        }
        r
    }

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn served_models_and_adapters_resolve_as_before() {
        let f = fleet(&[("a", "llama", &["sql"]), ("b", "qwen", &[])]);
        let none = HashMap::new();
        let r = resolve(f.fleet(), &none, false, "qwen").unwrap();
        assert_eq!((&*r.model, r.adapter, r.via), ("qwen", None, Via::Served));
        assert_eq!(r.upstream_model(), None);
        let r = resolve(f.fleet(), &none, false, "sql").unwrap();
        assert_eq!(
            (&*r.model, r.adapter, r.via),
            ("llama", Some("sql"), Via::Adapter)
        );
        assert_eq!(r.upstream_model(), None);
        // A base model of that name wins over an adapter.
        let f = fleet(&[("a", "llama", &["qwen"]), ("b", "qwen", &[])]);
        let r = resolve(f.fleet(), &none, false, "qwen").unwrap();
        assert_eq!((&*r.model, r.adapter), ("qwen", None));
    }

    #[test]
    fn adapters_follow_loads_and_unloads() {
        use crate::Observation;
        let mut f = fleet(&[("a", "llama", &[]), ("b", "llama", &[])]);
        let none = HashMap::new();
        let a = f.fleet().id_of("a").unwrap();
        assert_eq!(
            resolve(f.fleet(), &none, true, "x").unwrap_err(),
            ModelError::Unknown("x".into())
        );
        f.observe(Observation::AdapterLoaded(a, "x".into()), 1.0)
            .unwrap();
        let r = resolve(f.fleet(), &none, true, "x").unwrap();
        assert_eq!((&*r.model, r.adapter), ("llama", Some("x")));
        f.observe(Observation::AdapterUnloaded(a, "x".into()), 2.0)
            .unwrap();
        assert!(resolve(f.fleet(), &none, true, "x").is_err());
        // An instance that leaves takes its adapters with it.
        f.observe(Observation::AdapterLoaded(a, "y".into()), 3.0)
            .unwrap();
        f.observe(Observation::InstanceRemoved(a), 4.0).unwrap();
        assert!(resolve(f.fleet(), &none, true, "y").is_err());
    }

    #[test]
    fn an_alias_is_routed_and_sent_as_its_target() {
        let f = fleet(&[("a", "llama", &[]), ("b", "qwen", &[])]);
        let aliases = map(&[("gpt-4o", "qwen"), ("llama", "qwen")]);
        let r = resolve(f.fleet(), &aliases, true, "gpt-4o").unwrap();
        assert_eq!((&*r.model, r.adapter, r.via), ("qwen", None, Via::Alias));
        assert_eq!(r.upstream_model(), Some("qwen"));
        // Aliases come first, even over a served name.
        let r = resolve(f.fleet(), &aliases, true, "llama").unwrap();
        assert_eq!(r.model, "qwen");
        assert_eq!(r.upstream_model(), Some("qwen"));
    }

    #[test]
    fn an_alias_may_name_an_adapter() {
        let f = fleet(&[("a", "llama", &["sql-lora"]), ("b", "qwen", &[])]);
        let aliases = map(&[("sql", "sql-lora")]);
        let r = resolve(f.fleet(), &aliases, false, "sql").unwrap();
        assert_eq!(
            (&*r.model, r.adapter, r.via),
            ("llama", Some("sql-lora"), Via::Alias)
        );
        // The engine is asked for the adapter, as vLLM takes it.
        assert_eq!(r.upstream_model(), Some("sql-lora"));
    }

    #[test]
    fn an_alias_to_a_missing_model_names_both() {
        // Not even the single-model fallback rescues a wrong alias.
        let f = fleet(&[("a", "llama", &[])]);
        let aliases = map(&[("gpt-4o", "qwen")]);
        let e = resolve(f.fleet(), &aliases, false, "gpt-4o").unwrap_err();
        assert_eq!(
            e,
            ModelError::AliasTarget {
                alias: "gpt-4o".into(),
                target: "qwen".into()
            }
        );
        let text = e.to_string();
        assert!(text.contains("gpt-4o") && text.contains("qwen"), "{text}");
    }

    #[test]
    fn a_single_model_fleet_takes_any_name_unless_strict() {
        let f = fleet(&[("a", "llama", &["sql"]), ("b", "llama", &[])]);
        let none = HashMap::new();
        let r = resolve(f.fleet(), &none, false, "gpt-4o").unwrap();
        assert_eq!(
            (&*r.model, r.adapter, r.via),
            ("llama", None, Via::Fallback)
        );
        assert_eq!(r.upstream_model(), Some("llama"));
        // Adapters still resolve as adapters.
        assert_eq!(
            resolve(f.fleet(), &none, false, "sql").unwrap().via,
            Via::Adapter
        );
        assert_eq!(
            resolve(f.fleet(), &none, true, "gpt-4o").unwrap_err(),
            ModelError::Unknown("gpt-4o".into())
        );
    }

    #[test]
    fn a_multi_model_fleet_refuses_unknown_names() {
        let f = fleet(&[("a", "llama", &[]), ("b", "qwen", &[])]);
        let none = HashMap::new();
        assert_eq!(
            resolve(f.fleet(), &none, false, "gpt-4o").unwrap_err(),
            ModelError::Unknown("gpt-4o".into())
        );
        let empty = fleet(&[]);
        assert_eq!(
            resolve(empty.fleet(), &none, false, "gpt-4o").unwrap_err(),
            ModelError::Unknown("gpt-4o".into())
        );
    }

    #[test]
    fn alias_entries_are_checked() {
        assert_eq!(
            parse_alias(" gpt-4o = llama ").unwrap(),
            ("gpt-4o".to_string(), "llama".to_string())
        );
        for bad in ["nomodel", "=llama", "gpt-4o=", "x=x"] {
            let e = parse_alias(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
        let flags: BTreeMap<String, String> = [("a".to_string(), "m".to_string())].into();
        let same: BTreeMap<String, String> = [("a".to_string(), "m".to_string())].into();
        let other: BTreeMap<String, String> = [("a".to_string(), "n".to_string())].into();
        let chain: BTreeMap<String, String> = [("b".to_string(), "a".to_string())].into();
        assert_eq!(merge_aliases(&flags, &same).unwrap().len(), 1);
        let e = merge_aliases(&flags, &other).unwrap_err();
        assert!(e.contains("`a`") && e.contains("`n`"), "{e}");
        let e = merge_aliases(&flags, &chain).unwrap_err();
        assert!(e.contains("`b`") && e.contains("itself an alias"), "{e}");
    }

    #[test]
    fn the_fallback_log_is_bounded() {
        let mut log = FallbackLog::default();
        assert!(log.first_time("x", "m"));
        assert!(!log.first_time("x", "m"));
        // A new target starts over.
        assert!(log.first_time("x", "n"));
        for i in 0..3 * FALLBACK_LOG_CAP {
            log.first_time(&format!("name-{i}"), "n");
            assert!(log.len() <= FALLBACK_LOG_CAP);
        }
    }
}
