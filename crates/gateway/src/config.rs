//! Gateway settings, the fleet file (YAML or TOML) and router settings files.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use switchyard_core::RouterConfig;
use thiserror::Error;

use crate::backends::{check_unique, BackendSpec, SpecError};

/// Everything `switchyard serve` can set.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Router settings (policy, cost knobs, saturation limits).
    pub router: RouterConfig,
    /// Backends given on the command line.
    pub backends: Vec<BackendSpec>,
    /// Fleet file, watched and reloaded.
    pub fleet_file: Option<PathBuf>,
    /// Largest accepted request body (413 above).
    pub max_body_bytes: usize,
    /// Bytes of request bodies held at once, over all requests being read or sent (503
    /// `body_memory_exhausted` past it; 0: no limit).
    pub max_body_memory: usize,
    /// Largest request headers forwarded (431 above; 0: no limit).
    pub max_header_bytes: usize,
    /// Time a client has to send a request's headers, counted from the connection's start (0:
    /// no limit).
    pub header_read_timeout: Duration,
    /// Time a client has to send a request's body once its headers are in (408 after).
    pub body_read_timeout: Duration,
    /// Client connections open at once; more are answered 503 and closed (0: no limit).
    pub max_connections: usize,
    /// Further candidates tried after a failed attempt.
    pub max_retries: u32,
    /// TCP connect timeout to a backend.
    pub connect_timeout: Duration,
    /// Time allowed for a backend's response headers (504 after).
    pub upstream_timeout: Duration,
    /// Longest silence of a backend mid-body before the gateway ends it (zero: never).
    pub stream_idle_timeout: Duration,
    /// Engine metrics scrape period.
    pub scrape_interval: Duration,
    /// Active health check period.
    pub health_interval: Duration,
    /// Timeout of one health check or scrape.
    pub probe_timeout: Duration,
    /// Consecutive failures that eject a backend.
    pub eject_after: u32,
    /// Consecutive passed checks that readmit an ejected backend.
    pub readmit_after: u32,
    /// Requests that may wait for capacity when every backend is saturated (0: shed at once).
    pub queue_size: usize,
    /// How long a request may wait for capacity before 429.
    pub queue_timeout: Duration,
    /// On SIGINT/SIGTERM, how long in-flight responses may take to finish.
    pub drain_timeout: Duration,
    /// Client API keys (empty: no authentication).
    pub api_keys: HashSet<String>,
    /// Token for `/admin/*` (none: admin endpoints are refused).
    pub admin_token: Option<String>,
    /// Add `x-switchyard-decision` and `x-switchyard-backend` to responses.
    pub debug_header: bool,
    /// Ask engines for the usage chunk of streams the client did not ask usage for, and strip it.
    pub inject_usage: bool,
    /// How disaggregated requests are handed from prefill to decode (a prefill backend's own
    /// `bootstrap_port` makes it SGLang-style whatever this says).
    pub pd_style: crate::backends::PdStyle,
    /// LoRA adapter name -> path sent as `lora_path` to `/v1/load_lora_adapter`; dynamic
    /// placement (`router.placement`) loads and unloads only these adapters.
    pub lora_paths: std::collections::BTreeMap<String, String>,
    /// Model aliases from `--model-alias NAME=MODEL` (alias -> target); the fleet file's
    /// `model_aliases` are merged in.
    pub model_aliases: BTreeMap<String, String>,
    /// Refuse unknown model names (404) even when the fleet serves a single base model.
    pub strict_models: bool,
    /// KV events: how long an engine may publish nothing while it reports prompt work that
    /// must have stored blocks, or how old a batch may arrive, before its events are untrusted.
    pub kv_events_silence: Duration,
    /// KV events: how long a (re)subscribed stream must run clean, with events, before the
    /// router matches its backend exactly again.
    pub kv_events_probation: Duration,
    /// Hugging Face tokenizer.json per served base model (`--tokenizer MODEL=PATH`): text
    /// prompts for it are tokenized for exact matching.
    pub tokenizers: BTreeMap<String, PathBuf>,
    /// Bytes of tokenized prompt pieces each tokenizer keeps (`--tokenizer-cache-mib`).
    pub tokenizer_cache_bytes: usize,
    /// Tokenize chat answers into the piece cache as they end (off: `--no-answer-warmup`).
    pub answer_warmup: bool,
    /// Other replicas in front of the same fleet (`--peer URL`): decisions and outcomes are
    /// shared with them (the `peers` module).
    pub peers: Vec<http::Uri>,
    /// Peers are discovered while running (`switchyard epp --peer-selector`, `switchyard serve
    /// --peer-dns`): replica sync is on even while none is known.
    pub peer_discovery: bool,
    /// Peers found by resolving a DNS name (`--peer-dns HOST:PORT`), added to `peers`.
    pub peer_dns: Option<PeerDns>,
}

/// Peers found by DNS (`switchyard serve --peer-dns HOST:PORT`): every address the name
/// resolves to is a replica, reached at `http://ADDRESS:PORT` (the `peer_dns` module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerDns {
    /// The name to resolve (a headless Service, a Compose service, or an address).
    pub host: String,
    /// The peers' HTTP port.
    pub port: u16,
    /// Time between two resolutions.
    pub interval: Duration,
}

impl PeerDns {
    /// Parses `HOST:PORT` (an IPv6 address in brackets, `[::1]:8080`), resolved every
    /// `interval`; the error says what is wrong with the text.
    pub fn parse(text: &str, interval: Duration) -> Result<PeerDns, String> {
        let text = text.trim();
        if text.contains("://") {
            return Err(format!(
                "`{text}`: expected HOST:PORT without a scheme (peers are reached over http)"
            ));
        }
        let Some((host, port)) = text.rsplit_once(':').filter(|_| !text.ends_with(']')) else {
            return Err(format!("`{text}`: expected HOST:PORT, the port is missing"));
        };
        let host = match host.strip_prefix('[') {
            Some(inner) => inner
                .strip_suffix(']')
                .filter(|h| h.parse::<std::net::Ipv6Addr>().is_ok())
                .ok_or_else(|| format!("`{text}`: `{host}` is not an IPv6 address in brackets"))?,
            None if host.contains(':') => {
                return Err(format!(
                    "`{text}`: expected HOST:PORT (an IPv6 address goes in brackets: [::1]:8080)"
                ))
            }
            None => host,
        };
        if host.is_empty() || host.contains(|c: char| c.is_whitespace() || "/?#@[]".contains(c)) {
            return Err(format!("`{text}`: `{host}` is not a host name or address"));
        }
        let port = match port.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(format!("`{text}`: the port `{port}` is not 1..65535")),
        };
        if interval.is_zero() {
            return Err("the resolution interval must be > 0".into());
        }
        Ok(PeerDns {
            host: host.to_string(),
            port,
            interval,
        })
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            router: RouterConfig::default(),
            backends: Vec::new(),
            fleet_file: None,
            max_body_bytes: 16 * 1024 * 1024,
            max_body_memory: 1024 * 1024 * 1024,
            // What uvicorn (vLLM's and SGLang's server) accepts by default (h11's limit).
            max_header_bytes: 16 * 1024,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(60),
            max_connections: 4096,
            max_retries: 2,
            connect_timeout: Duration::from_secs(2),
            upstream_timeout: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(120),
            scrape_interval: Duration::from_millis(500),
            health_interval: Duration::from_secs(2),
            probe_timeout: Duration::from_secs(2),
            eject_after: 3,
            readmit_after: 2,
            queue_size: 256,
            queue_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(30),
            api_keys: HashSet::new(),
            admin_token: None,
            debug_header: false,
            inject_usage: true,
            pd_style: crate::backends::PdStyle::Nixl,
            lora_paths: std::collections::BTreeMap::new(),
            model_aliases: BTreeMap::new(),
            strict_models: false,
            kv_events_silence: Duration::from_secs(10),
            kv_events_probation: Duration::from_secs(5),
            tokenizers: BTreeMap::new(),
            tokenizer_cache_bytes: crate::tokenize::DEFAULT_CACHE_BYTES,
            answer_warmup: true,
            peers: Vec::new(),
            peer_discovery: false,
            peer_dns: None,
        }
    }
}

/// A settings or fleet file that cannot be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// Could not read the file.
    #[error("cannot read {0}: {1}")]
    Read(PathBuf, std::io::Error),
    /// The file does not parse.
    #[error("invalid {0}: {1}")]
    Parse(PathBuf, String),
    /// A backend entry is unusable.
    #[error("{0}: {1}")]
    Backend(PathBuf, SpecError),
    /// Router settings out of range.
    #[error("{0}: {1}")]
    Router(PathBuf, switchyard_core::ConfigError),
    /// The fleet file names no `backends` at all (empty, comments only, or half written).
    #[error(
        "{0}: no `backends` key (an empty or half-written file would remove every backend; \
         write `backends: []` to run with none)"
    )]
    NoBackends(PathBuf),
    /// A `model_aliases` entry is unusable.
    #[error("{0}: model_aliases: {1}")]
    Alias(PathBuf, String),
}

/// The fleet file: `backends: [{address, name, role, models, adapters, weight, labels, kind}]`
/// and `model_aliases: {NAME: MODEL}`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetFile {
    /// The backends; the key must be present (`backends: []` for none).
    #[serde(default)]
    pub backends: Option<Vec<BackendSpec>>,
    /// Model aliases: a request for NAME is routed (and sent) as MODEL.
    #[serde(default)]
    pub model_aliases: BTreeMap<String, String>,
}

/// A fleet file as loaded and checked.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct FleetConfig {
    /// The backends, normalised.
    pub backends: Vec<BackendSpec>,
    /// Model aliases (alias -> target), each checked alone; merged with the flags' by the caller.
    pub model_aliases: BTreeMap<String, String>,
}

fn parse_by_extension<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
) -> Result<T, ConfigError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let parsed = match ext {
        "toml" => toml::from_str(text).map_err(|e| e.to_string()),
        "json" => serde_json::from_str(text).map_err(|e| e.to_string()),
        _ => serde_norway::from_str(text).map_err(|e| e.to_string()),
    };
    parsed.map_err(|e| ConfigError::Parse(path.to_path_buf(), e))
}

/// Reads a fleet file (`.toml`, `.json`, else YAML) and checks every backend and alias.
pub fn load_fleet_file(path: &Path) -> Result<FleetConfig, ConfigError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.to_path_buf(), e))?;
    parse_fleet_file(path, &text)
}

/// Parses a fleet file's `text`, in the format `path`'s extension names, and checks every
/// backend and alias (`path` only names the file in errors).
pub fn parse_fleet_file(path: &Path, text: &str) -> Result<FleetConfig, ConfigError> {
    // An empty file parses as nothing in YAML; a truncate-then-write editor shows one for a
    // moment. Either way it is not "no backends" unless the file says so.
    let no_backends = || ConfigError::NoBackends(path.to_path_buf());
    if text.trim().is_empty() {
        return Err(no_backends());
    }
    let file: FleetFile = parse_by_extension(path, text).map_err(|e| match e {
        // A YAML file of comments only is an empty document: the same case.
        ConfigError::Parse(..) if is_comments_only(text) => no_backends(),
        other => other,
    })?;
    let specs = file
        .backends
        .ok_or_else(no_backends)?
        .into_iter()
        .map(BackendSpec::normalise)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ConfigError::Backend(path.to_path_buf(), e))?;
    check_unique(&specs).map_err(|e| ConfigError::Backend(path.to_path_buf(), e))?;
    for (name, target) in &file.model_aliases {
        switchyard_core::models::check_alias(name, target)
            .map_err(|e| ConfigError::Alias(path.to_path_buf(), format!("`{name}`: {e}")))?;
    }
    Ok(FleetConfig {
        backends: specs,
        model_aliases: file.model_aliases,
    })
}

/// Whether every line is blank or a `#` comment.
fn is_comments_only(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .all(|l| l.is_empty() || l.starts_with('#'))
}

/// Reads router settings (`.toml`, `.json`, else YAML; any subset of the keys in docs/core.md).
pub fn load_router_config(path: &Path) -> Result<RouterConfig, ConfigError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.to_path_buf(), e))?;
    let config: RouterConfig = parse_by_extension(path, &text)?;
    config
        .validate()
        .map_err(|e| ConfigError::Router(path.to_path_buf(), e))?;
    Ok(config)
}

/// Parses API keys: one per line (or comma-separated); blank lines and `#` comments skipped.
pub fn parse_api_keys(text: &str) -> HashSet<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .flat_map(|l| l.split(','))
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .map(String::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::Role;

    /// A file named `*name` holding `text`, removed when the returned path is dropped.
    fn write(name: &str, text: &str) -> tempfile::TempPath {
        let file = tempfile::Builder::new()
            .prefix("switchyard-gw-config-")
            .suffix(name)
            .tempfile()
            .unwrap();
        std::fs::write(file.path(), text).unwrap();
        file.into_temp_path()
    }

    #[test]
    fn yaml_and_toml_fleet_files() {
        let y = write(
            "fleet.yaml",
            "backends:\n  - address: 127.0.0.1:9001\n    role: prefill\n    models: [m]\n    labels: {zone: a}\n    kind: vllm\n  - address: http://127.0.0.1:9002\n    name: two\n    weight: 2\n",
        );
        let specs = load_fleet_file(&y).unwrap().backends;
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].name, "127.0.0.1:9001");
        assert_eq!(specs[0].role, Role::Prefill);
        assert_eq!(specs[0].labels["zone"], "a");
        assert_eq!(specs[1].name, "two");
        let t = write(
            "fleet.toml",
            "[[backends]]\naddress = \"127.0.0.1:9003\"\nmodels = [\"m\"]\nkind = \"sglang\"\n",
        );
        assert_eq!(
            load_fleet_file(&t).unwrap().backends[0].address,
            "http://127.0.0.1:9003"
        );
        // No backends only when the file says so: empty, comment-only and key-less files are
        // refused (an editor's truncate-then-write must not remove the fleet).
        for (name, text) in [
            ("no-backends.yaml", "\n"),
            ("no-backends-comments.yaml", "# nothing yet\n\n"),
            ("no-backends-aliases.yaml", "model_aliases: {a: m}\n"),
            ("no-backends.toml", "# none\n"),
            ("no-backends.json", "{}"),
        ] {
            let e = load_fleet_file(&write(name, text)).unwrap_err();
            assert!(matches!(e, ConfigError::NoBackends(_)), "{name}: {e}");
            assert!(e.to_string().contains("backends: []"), "{e}");
        }
        for (name, text) in [
            ("explicitly-none.yaml", "backends: []\n"),
            ("explicitly-none.toml", "backends = []\n"),
            ("explicitly-none.json", "{\"backends\": []}"),
        ] {
            assert_eq!(
                load_fleet_file(&write(name, text)).unwrap(),
                FleetConfig::default(),
                "{name}"
            );
        }
    }

    #[test]
    fn fleet_file_model_aliases() {
        let y = write(
            "aliases.yaml",
            "backends:\n  - address: 127.0.0.1:9001\n    models: [m]\nmodel_aliases:\n  gpt-4o: m\n  sql: sql-lora\n",
        );
        let fleet = load_fleet_file(&y).unwrap();
        assert_eq!(fleet.model_aliases["gpt-4o"], "m");
        assert_eq!(fleet.model_aliases["sql"], "sql-lora");
        let t = write(
            "aliases.toml",
            "backends = []\n[model_aliases]\n\"gpt-4o\" = \"m\"\n",
        );
        assert_eq!(load_fleet_file(&t).unwrap().model_aliases["gpt-4o"], "m");
        for (name, text) in [
            ("self.yaml", "backends: []\nmodel_aliases:\n  m: m\n"),
            (
                "empty.json",
                r#"{"backends": [], "model_aliases": {"gpt-4o": ""}}"#,
            ),
        ] {
            let e = load_fleet_file(&write(name, text)).unwrap_err();
            assert!(matches!(e, ConfigError::Alias(..)), "{e}");
            let text = e.to_string();
            assert!(
                text.contains("model_aliases") && text.contains('`'),
                "{text}"
            );
        }
        let e = load_fleet_file(&write("list.yaml", "model_aliases: [a]\n")).unwrap_err();
        assert!(matches!(e, ConfigError::Parse(..)), "{e}");
    }

    #[test]
    fn bad_fleet_files_are_refused() {
        let unknown = write("u.yaml", "backends:\n  - address: h:1\n    colour: red\n");
        assert!(matches!(
            load_fleet_file(&unknown),
            Err(ConfigError::Parse(..))
        ));
        let dup = write("d.yaml", "backends:\n  - address: h:1\n  - address: h:1\n");
        assert!(matches!(
            load_fleet_file(&dup),
            Err(ConfigError::Backend(..))
        ));
        let noport = write("p.yaml", "backends:\n  - address: h\n");
        assert!(matches!(
            load_fleet_file(&noport),
            Err(ConfigError::Backend(..))
        ));
    }

    #[test]
    fn router_settings_files() {
        let t = write(
            "r.toml",
            "policy = \"least-load\"\n[cost]\nmax_in_flight = 4\n",
        );
        let c = load_router_config(&t).unwrap();
        assert_eq!(c.policy, "least-load");
        assert_eq!(c.cost.max_in_flight, Some(4));
        let bad = write("r.json", "{\"policy\": \"nope\"}");
        assert!(matches!(
            load_router_config(&bad),
            Err(ConfigError::Router(..))
        ));
    }

    #[test]
    fn api_key_lists() {
        let keys = parse_api_keys("a\n# comment\n b , c\n\nd # trailing\n");
        assert_eq!(keys.len(), 4);
        assert!(keys.contains("b") && keys.contains("d"));
    }
}
