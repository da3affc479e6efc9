//! The plan of a run: which request bodies are sent at which offsets.
//!
//! A [`Plan`] is a lazy iterator over [`PlannedRequest`]s built from a
//! workload stream: offsets are the workload's arrival times divided by the
//! time scale, bodies are the OpenAI JSON the run POSTs. Everything is a pure
//! function of the workload spec, the seed and the [`PlanOptions`], so the same
//! seed gives the same plan byte for byte ([`write_plan`] writes it as JSONL).
//!
//! Prompts keep the workload's text exactly, so requests that share a prefix
//! in the workload share it byte for byte on the wire: a text prompt is one
//! completions `prompt` (or one user message), a chat prompt becomes the same
//! messages (or, for completions, [`Prompt::render`]'s plain rendering).

use std::io::Write;
use std::path::Path;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use switchyard_workload::{Prompt, Request, RequestStream, WorkloadSpec};

use crate::error::{LoadgenError, Result};

/// Which OpenAI endpoint requests go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/chat/completions` with `messages`.
    Chat,
    /// `POST /v1/completions` with `prompt`.
    Completions,
}

impl Api {
    /// The request path under the base URL.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }

    /// The name used in reports (`chat` or `completions`).
    pub fn as_str(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
        }
    }
}

/// How a workload is turned into a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanOptions {
    /// Endpoint the bodies are for.
    pub api: Api,
    /// Model name every request asks for; `None` keeps each request's own
    /// (its adapter if it has one, else its base model).
    pub model: Option<String>,
    /// Offsets are arrival times divided by this (2 = twice as fast).
    pub time_scale: f64,
    /// Send at most this many requests.
    pub max_requests: Option<u64>,
    /// Send only requests whose offset is below this many seconds.
    pub duration_s: Option<f64>,
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self {
            api: Api::Chat,
            model: None,
            time_scale: 1.0,
            max_requests: None,
            duration_s: None,
        }
    }
}

impl PlanOptions {
    /// Checks the numbers.
    pub fn validate(&self) -> Result<()> {
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(LoadgenError::Invalid(format!(
                "time scale must be > 0, got {}",
                self.time_scale
            )));
        }
        if let Some(d) = self.duration_s {
            if !(d.is_finite() && d > 0.0) {
                return Err(LoadgenError::Invalid(format!(
                    "duration must be > 0, got {d}"
                )));
            }
        }
        Ok(())
    }
}

/// One request of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedRequest {
    /// Position in the workload.
    pub id: u64,
    /// Seconds after the run's start at which it is due.
    pub offset_s: f64,
    /// Prompt tokens under the 4-bytes-a-token convention.
    pub prompt_tokens: u64,
    /// Tokens asked for.
    pub max_tokens: u32,
    /// The JSON body.
    pub body: Bytes,
}

/// Lazy iterator over the planned requests; see the module docs.
pub struct Plan {
    stream: RequestStream,
    options: PlanOptions,
    emitted: u64,
    done: bool,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("options", &self.options)
            .field("emitted", &self.emitted)
            .finish()
    }
}

impl Plan {
    /// The plan of `spec` built with `seed`.
    pub fn new(spec: &WorkloadSpec, seed: u64, options: &PlanOptions) -> Result<Self> {
        options.validate()?;
        Ok(Self {
            stream: spec.build(seed)?,
            options: options.clone(),
            emitted: 0,
            done: false,
        })
    }

    /// Number of requests the plan of `spec` holds (builds it once, without bodies).
    pub fn count(spec: &WorkloadSpec, seed: u64, options: &PlanOptions) -> Result<u64> {
        options.validate()?;
        let mut n = 0;
        for r in spec.build(seed)? {
            if !admits(options, n, r.arrival_s) {
                break;
            }
            n += 1;
        }
        Ok(n)
    }
}

/// Whether the `n`th request (from 0), arriving at `arrival_s`, is in the plan.
fn admits(o: &PlanOptions, n: u64, arrival_s: f64) -> bool {
    o.max_requests.is_none_or(|m| n < m)
        && o.duration_s.is_none_or(|d| arrival_s / o.time_scale < d)
}

impl Iterator for Plan {
    type Item = PlannedRequest;

    fn next(&mut self) -> Option<PlannedRequest> {
        if self.done {
            return None;
        }
        let r = self.stream.next();
        let Some(r) = r.filter(|r| admits(&self.options, self.emitted, r.arrival_s)) else {
            self.done = true;
            return None;
        };
        self.emitted += 1;
        Some(PlannedRequest {
            id: r.id,
            offset_s: r.arrival_s / self.options.time_scale,
            prompt_tokens: r.prompt_tokens() as u64,
            max_tokens: r.max_tokens,
            body: body(&r, self.options.api, self.options.model.as_deref()),
        })
    }
}

/// One chat message on the wire.
#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'a str,
    content: &'a str,
}

/// `stream_options` on the wire.
#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// A request body on the wire; field order is fixed, so bytes are stable.
#[derive(Serialize)]
struct WireBody<'a> {
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    messages: Option<Vec<WireMessage<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a str>,
    max_tokens: u32,
    stream: bool,
    stream_options: StreamOptions,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_salt: Option<&'a str>,
}

/// The streaming JSON body of `r` for `api`; `model` overrides the request's.
pub fn body(r: &Request, api: Api, model: Option<&str>) -> Bytes {
    let model = model.unwrap_or_else(|| r.adapter.as_deref().unwrap_or(&r.model));
    let rendered;
    let (messages, prompt) = match (api, &r.prompt) {
        (Api::Chat, Prompt::Chat(msgs)) => (
            Some(
                msgs.iter()
                    .map(|m| WireMessage {
                        role: m.role.as_str(),
                        content: &m.content,
                    })
                    .collect(),
            ),
            None,
        ),
        (Api::Chat, Prompt::Text(_)) => {
            rendered = r.prompt.render();
            (
                Some(vec![WireMessage {
                    role: "user",
                    content: &rendered,
                }]),
                None,
            )
        }
        (Api::Completions, p) => {
            rendered = p.render();
            (None, Some(rendered.as_str()))
        }
    };
    let wire = WireBody {
        model,
        messages,
        prompt,
        max_tokens: r.max_tokens,
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
        cache_salt: r.cache_salt.as_deref(),
    };
    // Serialising borrowed strings and numbers into a Vec cannot fail.
    Bytes::from(serde_json::to_vec(&wire).unwrap_or_default())
}

/// Writes one plan line: `{"id":..,"offset_s":..,"path":..,"body":{..}}`.
pub fn write_line(out: &mut impl Write, api: Api, p: &PlannedRequest) -> std::io::Result<()> {
    write!(
        out,
        "{{\"id\":{},\"offset_s\":{},\"path\":\"{}\",\"body\":",
        p.id,
        serde_json::Value::from(p.offset_s),
        api.path()
    )?;
    out.write_all(&p.body)?;
    out.write_all(b"}\n")
}

/// Writes a whole plan as JSONL to `path`; returns the number of requests.
pub fn write_plan(
    path: &Path,
    api: Api,
    plan: impl Iterator<Item = PlannedRequest>,
) -> Result<u64> {
    let file = std::fs::File::create(path).map_err(|e| LoadgenError::io(path, e))?;
    let mut out = std::io::BufWriter::new(file);
    let mut n = 0;
    for p in plan {
        write_line(&mut out, api, &p).map_err(|e| LoadgenError::io(path, e))?;
        n += 1;
    }
    out.flush().map_err(|e| LoadgenError::io(path, e))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_workload::{ArrivalProcess, ChatSpec, GroupSelection, SharedPrefixSpec};

    fn shared(rate: f64) -> WorkloadSpec {
        WorkloadSpec::SharedPrefix(SharedPrefixSpec {
            num_groups: 4,
            prompts_per_group: 4,
            system_prompt_len: 64,
            question_len: 8,
            output_len: 5,
            group_selection: GroupSelection::Zipf { exponent: 1.1 },
            arrivals: ArrivalProcess::Poisson { rate },
            ..Default::default()
        })
    }

    fn lines(spec: &WorkloadSpec, seed: u64, o: &PlanOptions) -> Vec<u8> {
        let mut out = Vec::new();
        for p in Plan::new(spec, seed, o).unwrap() {
            write_line(&mut out, o.api, &p).unwrap();
        }
        out
    }

    #[test]
    fn same_seed_same_bytes() {
        let o = PlanOptions::default();
        let a = lines(&shared(10.0), 7, &o);
        assert_eq!(a, lines(&shared(10.0), 7, &o));
        assert_ne!(a, lines(&shared(10.0), 8, &o));
        assert_eq!(a.iter().filter(|&&b| b == b'\n').count(), 16);
    }

    #[test]
    fn chat_body_shape_and_shared_prefix() {
        let plan: Vec<PlannedRequest> = Plan::new(&shared(10.0), 1, &PlanOptions::default())
            .unwrap()
            .collect();
        let v: serde_json::Value = serde_json::from_slice(&plan[0].body).unwrap();
        assert_eq!(v["model"], "base");
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["max_tokens"], 5);
        assert_eq!(v["messages"][0]["role"], "user");
        let content = v["messages"][0]["content"].as_str().unwrap();
        assert_eq!(content.len(), 4 * (64 + 8));
        assert_eq!(plan[0].prompt_tokens, 72);
        // Some two requests share their 64-token system prompt byte for byte.
        let heads: Vec<String> = plan
            .iter()
            .map(|p| {
                let v: serde_json::Value = serde_json::from_slice(&p.body).unwrap();
                v["messages"][0]["content"].as_str().unwrap()[..256].to_string()
            })
            .collect();
        let distinct: std::collections::HashSet<&String> = heads.iter().collect();
        assert!(distinct.len() < heads.len());
    }

    #[test]
    fn completions_and_model_override() {
        let o = PlanOptions {
            api: Api::Completions,
            model: Some("m".into()),
            ..Default::default()
        };
        let p = Plan::new(&shared(10.0), 1, &o).unwrap().next().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&p.body).unwrap();
        assert_eq!(v["model"], "m");
        assert!(v.get("messages").is_none());
        assert_eq!(v["prompt"].as_str().unwrap().len(), 4 * 72);
    }

    #[test]
    fn chat_prompts_keep_their_messages() {
        let spec = WorkloadSpec::Chat(ChatSpec {
            sessions: 2,
            system_prompt_len: 8,
            ..Default::default()
        });
        let p = Plan::new(&spec, 1, &PlanOptions::default())
            .unwrap()
            .next()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&p.body).unwrap();
        assert_eq!(v["messages"][0]["role"], "system");
        assert_eq!(v["messages"][1]["role"], "user");
        let o = PlanOptions {
            api: Api::Completions,
            ..Default::default()
        };
        let p = Plan::new(&spec, 1, &o).unwrap().next().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&p.body).unwrap();
        assert!(v["prompt"].as_str().unwrap().starts_with("<|system|>\n"));
    }

    #[test]
    fn limits_and_time_scale() {
        let spec = shared(4.0);
        let o = PlanOptions {
            time_scale: 2.0,
            duration_s: Some(1.0),
            ..Default::default()
        };
        let all: Vec<f64> = spec.build(3).unwrap().map(|r| r.arrival_s).collect();
        let plan: Vec<PlannedRequest> = Plan::new(&spec, 3, &o).unwrap().collect();
        let want = all.iter().filter(|&&t| t / 2.0 < 1.0).count();
        assert_eq!(plan.len(), want);
        assert_eq!(Plan::count(&spec, 3, &o).unwrap(), want as u64);
        for (p, t) in plan.iter().zip(&all) {
            assert_eq!(p.offset_s, t / 2.0);
        }
        let o = PlanOptions {
            max_requests: Some(3),
            ..Default::default()
        };
        assert_eq!(Plan::new(&spec, 3, &o).unwrap().count(), 3);
        assert!(PlanOptions {
            time_scale: 0.0,
            ..Default::default()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn plan_line_is_json() {
        let o = PlanOptions::default();
        let text = String::from_utf8(lines(&shared(1.0), 1, &o)).unwrap();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["path"], "/v1/chat/completions");
            assert!(v["body"]["messages"].is_array());
            assert!(v["offset_s"].is_number());
        }
    }
}
