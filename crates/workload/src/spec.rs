//! [`WorkloadSpec`]: any workload of this crate as one serialisable value.
//!
//! ```json
//! {"kind": "adapters",
//!  "mix": {"adapters": 16, "zipf_exponent": 1.0, "shift": {"at_fraction": 0.5}},
//!  "workload": {"kind": "shared_prefix", "num_requests": 100000,
//!               "arrivals": {"kind": "poisson", "rate": 50}}}
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::adapters::{AdapterAssigner, AdapterMix};
use crate::arrivals::{ArrivalProcess, Retimed};
use crate::chat::ChatSpec;
use crate::error::{Result, WorkloadError};
use crate::jsonl::read_jsonl_file;
use crate::request::Request;
use crate::shared_prefix::SharedPrefixSpec;
use crate::text::{key, mix};
use crate::trace::TraceSpec;

/// Domain tags deriving each layer's seed from the build seed.
const ADAPTERS: u64 = 0x5350_4144; // "SPAD"
const RETIME: u64 = 0x5350_5254; // "SPRT"

/// A boxed request stream whose `size_hint` is exact.
pub type RequestStream = Box<dyn Iterator<Item = Request> + Send>;

/// A workload from a JSONL file written by [`crate::write_jsonl`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonlSpec {
    /// The file (`.jsonl` or `.jsonl.xz`).
    pub path: PathBuf,
    /// Replace the file's arrival times with this process.
    #[serde(default)]
    pub arrivals: Option<ArrivalProcess>,
}

/// Any workload this crate can produce.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkloadSpec {
    /// Replay of a Mooncake-format trace.
    Trace(TraceSpec),
    /// SGLang-style generated shared-prefix groups.
    SharedPrefix(SharedPrefixSpec),
    /// Multi-turn chat sessions.
    Chat(ChatSpec),
    /// Requests read from a JSONL file.
    Jsonl(JsonlSpec),
    /// Another workload with LoRA adapters assigned.
    Adapters {
        /// The workload whose requests get adapters.
        workload: Box<WorkloadSpec>,
        /// How adapters are spread.
        #[serde(default)]
        mix: AdapterMix,
    },
}

impl WorkloadSpec {
    /// Parses a spec from JSON text.
    pub fn from_json_str(s: &str) -> Result<Self> {
        serde_json::from_str(s).map_err(|source| WorkloadError::Json { line: 1, source })
    }

    /// Reads a spec from a JSON file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text)
    }

    /// The request stream for `seed`: same spec and seed, same requests.
    ///
    /// Generators are lazy. Files are read here, so I/O and format errors
    /// surface now: a trace's rows (ids only) are parsed up front, and a JSONL
    /// file is read whole (strings interned) rather than failing mid-stream.
    pub fn build(&self, seed: u64) -> Result<RequestStream> {
        Ok(match self {
            WorkloadSpec::Trace(s) => s.build(seed)?,
            WorkloadSpec::SharedPrefix(s) => Box::new(s.build(seed)?),
            WorkloadSpec::Chat(s) => Box::new(s.build(seed)?),
            WorkloadSpec::Jsonl(s) => {
                let reqs = read_jsonl_file(&s.path)?.into_iter();
                match &s.arrivals {
                    None => Box::new(reqs),
                    Some(p) => Box::new(Retimed::new(reqs, p, key(seed, RETIME, 0))?),
                }
            }
            WorkloadSpec::Adapters { workload, mix: m } => {
                let inner = workload.build(seed)?;
                Box::new(AdapterAssigner::new(inner, m, mix(seed, ADAPTERS))?)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Count;

    #[test]
    fn parses_the_doc_example() {
        let s = WorkloadSpec::from_json_str(
            r#"{"kind": "adapters",
                "mix": {"adapters": 16, "zipf_exponent": 1.0, "shift": {"at_fraction": 0.5}},
                "workload": {"kind": "shared_prefix", "num_requests": 1000,
                             "arrivals": {"kind": "poisson", "rate": 50}}}"#,
        )
        .unwrap();
        let reqs: Vec<Request> = s.build(1).unwrap().collect();
        assert_eq!(reqs.len(), 1000);
        assert!(reqs.iter().all(|r| r.adapter.is_some()));
        assert!(reqs.iter().all(|r| r.prompt_tokens() == 2048 + 128));
        let rate = 999.0 / reqs[999].arrival_s;
        assert!((40.0..60.0).contains(&rate), "{rate}");
    }

    #[test]
    fn json_roundtrip_of_every_kind() {
        let specs = [
            WorkloadSpec::Trace(TraceSpec::default()),
            WorkloadSpec::SharedPrefix(SharedPrefixSpec::default()),
            WorkloadSpec::Chat(ChatSpec {
                turns: Count::Uniform { min: 1, max: 3 },
                ..Default::default()
            }),
            WorkloadSpec::Jsonl(JsonlSpec {
                path: "w.jsonl".into(),
                arrivals: Some(ArrivalProcess::Constant { rate: 2.0 }),
            }),
            WorkloadSpec::Adapters {
                workload: Box::new(WorkloadSpec::Chat(ChatSpec::default())),
                mix: AdapterMix::default(),
            },
        ];
        for s in specs {
            let j = serde_json::to_string(&s).unwrap();
            assert_eq!(WorkloadSpec::from_json_str(&j).unwrap(), s, "{j}");
        }
    }

    #[test]
    fn typos_are_rejected() {
        let e = WorkloadSpec::from_json_str(r#"{"kind":"shared_prefix","num_group":3}"#);
        assert!(e.is_err());
        let e = WorkloadSpec::from_json_str(r#"{"kind":"nope"}"#);
        assert!(e.is_err());
    }

    #[test]
    fn same_seed_same_stream() {
        let s = WorkloadSpec::Adapters {
            workload: Box::new(WorkloadSpec::Chat(ChatSpec {
                sessions: 20,
                arrivals: ArrivalProcess::Gamma { rate: 1.0, cv: 2.0 },
                ..Default::default()
            })),
            mix: AdapterMix::default(),
        };
        let a: Vec<Request> = s.build(5).unwrap().collect();
        let b: Vec<Request> = s.build(5).unwrap().collect();
        assert_eq!(a, b);
        let c: Vec<Request> = s.build(6).unwrap().collect();
        assert_ne!(a, c);
    }

    /// The JSONL bytes of the first `n` requests of `spec` built with `seed`.
    fn bytes(spec: &WorkloadSpec, seed: u64, n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        crate::write_jsonl(&mut out, spec.build(seed).unwrap().take(n)).unwrap();
        out
    }

    #[test]
    fn byte_identical_by_seed() {
        let trace = WorkloadSpec::Trace(TraceSpec {
            max_requests: Some(20),
            arrivals: Some(ArrivalProcess::Poisson { rate: 5.0 }),
            ..Default::default()
        });
        let chat = WorkloadSpec::Chat(ChatSpec {
            sessions: 10,
            system_prompt_len: 64,
            ..Default::default()
        });
        for s in [&trace, &chat] {
            assert_eq!(bytes(s, 3, 30), bytes(s, 3, 30));
            assert_ne!(bytes(s, 3, 30), bytes(s, 4, 30));
        }
    }

    #[test]
    fn jsonl_spec_reads_and_retimes() {
        let dir = std::env::temp_dir().join(format!("sy-wl-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("w.jsonl");
        let reqs: Vec<Request> = SharedPrefixSpec {
            num_requests: Some(50),
            system_prompt_len: 16,
            question_len: 4,
            ..Default::default()
        }
        .build(0)
        .unwrap()
        .collect();
        crate::write_jsonl_file(&p, reqs.clone()).unwrap();
        let plain = WorkloadSpec::Jsonl(JsonlSpec {
            path: p.clone(),
            arrivals: None,
        });
        assert_eq!(plain.build(0).unwrap().collect::<Vec<_>>(), reqs);
        let timed = WorkloadSpec::Jsonl(JsonlSpec {
            path: p.clone(),
            arrivals: Some(ArrivalProcess::Constant { rate: 10.0 }),
        });
        let t: Vec<f64> = timed.build(0).unwrap().map(|r| r.arrival_s).collect();
        assert_eq!(t[10], 1.0);
        let missing = WorkloadSpec::Jsonl(JsonlSpec {
            path: dir.join("missing.jsonl"),
            arrivals: None,
        });
        assert!(missing.build(0).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
