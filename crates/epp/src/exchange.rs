//! One request's conversation with Envoy, from its headers to the end of its response: the
//! body is buffered and parsed with the gateway's parser, routed by the same core and
//! admission queue as `serve`, and the response is watched (first token, usage, end) so that
//! the router learns exactly as it does behind the gateway.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use switchyard_core::{InstanceId, Observation};
use switchyard_gateway::body_budget::BodyHold;
use switchyard_gateway::error::ApiError;
use switchyard_gateway::proxy::{self, Endpoint, Routed};
use switchyard_gateway::stream::{RequestGuard, ResponseWatch};
use switchyard_gateway::{parse, Gateway};

use crate::messages;

/// How the picker treats response bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyWatch {
    /// Envoy sends the response body (`response_body_mode: FULL_DUPLEX_STREAMED`): first token
    /// and usage are read from it, and every chunk is passed back.
    Watch,
    /// Envoy does not send it (`response_body_mode: NONE`): the response headers count as the
    /// first byte and the end of the ext_proc stream as the end; no usage is learned.
    Skip,
}

/// Where the request is in its life.
enum Stage {
    /// Waiting for the request body.
    Request,
    /// Routed; the engine's answer is awaited or passing.
    Routed {
        /// The routing result (its decision makes the plan for the endpoint that served).
        routed: Box<Routed>,
        /// The unified (or decode) request, watched once its response headers show success.
        guard: Option<RequestGuard>,
        /// The prefill leg of a disaggregated request (settled at the first byte).
        prefill: Option<RequestGuard>,
        watch: Option<Box<ResponseWatch>>,
        /// Whether to remove the usage chunk we asked for on the client's behalf.
        strip_usage: bool,
        predicted_cached: u32,
    },
    /// Answered by the picker itself, or settled: nothing more to learn.
    Done,
}

/// One ext_proc stream.
pub struct Exchange {
    gw: Arc<Gateway>,
    bodies: BodyWatch,
    started: Instant,
    path: String,
    method: String,
    session: Option<String>,
    phase: Option<String>,
    subset: Option<Vec<String>>,
    body: BytesMut,
    /// The body's share of `--max-body-memory`, held while it is buffered.
    hold: BodyHold,
    stage: Stage,
}

impl Exchange {
    /// A new stream.
    pub fn new(gw: Arc<Gateway>, bodies: BodyWatch) -> Self {
        Exchange {
            gw,
            bodies,
            started: Instant::now(),
            path: String::new(),
            method: String::new(),
            session: None,
            phase: None,
            subset: None,
            body: BytesMut::new(),
            hold: BodyHold::default(),
            stage: Stage::Request,
        }
    }

    /// Handles one message from Envoy; returns the messages to send back, in order.
    pub async fn handle(&mut self, message: ProcessingRequest) -> Vec<ProcessingResponse> {
        if self.subset.is_none() {
            self.subset = messages::subset_hint(message.metadata_context.as_ref());
        }
        let Some(request) = message.request else {
            return Vec::new();
        };
        match request {
            Request::RequestHeaders(h) => {
                let headers = h.headers.as_ref();
                self.path = messages::header_value(headers, ":path").unwrap_or_default();
                self.method = messages::header_value(headers, ":method").unwrap_or_default();
                self.session = messages::header_value(headers, "x-session-id");
                self.phase = messages::header_value(headers, "x-switchyard-phase");
                if h.end_of_stream {
                    return self.without_body();
                }
                Vec::new()
            }
            Request::RequestBody(b) => {
                if !matches!(self.stage, Stage::Request) {
                    return Vec::new();
                }
                let limit = self.gw.settings.max_body_bytes;
                if limit > 0 && self.body.len() + b.body.len() > limit {
                    return self.answer(&ApiError::too_large(limit));
                }
                let budget = &self.gw.body_budget;
                if !budget.reserve(&mut self.hold, self.body.len() + b.body.len()) {
                    return self.answer(&ApiError::body_memory_exhausted(budget.limit()));
                }
                self.body.extend_from_slice(&b.body);
                if b.end_of_stream {
                    self.route(true).await
                } else {
                    Vec::new()
                }
            }
            Request::RequestTrailers(_) => {
                let mut out = if matches!(self.stage, Stage::Request) {
                    self.route(false).await
                } else {
                    Vec::new()
                };
                // After an immediate answer the stream is over: nothing more to say.
                if !matches!(self.stage, Stage::Done) {
                    out.push(messages::trailers(true));
                }
                out
            }
            Request::ResponseHeaders(h) => {
                let headers = h.headers.as_ref();
                let status: u16 = messages::header_value(headers, ":status")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                let sse = messages::header_value(headers, "content-type")
                    .is_some_and(|c| c.starts_with("text/event-stream"));
                let served = messages::header_value(headers, messages::SERVED);
                self.on_response_head(status, sse, served.as_deref(), h.end_of_stream);
                vec![messages::response_headers_unchanged()]
            }
            Request::ResponseBody(b) => {
                let out = match &mut self.stage {
                    Stage::Routed {
                        watch: Some(watch), ..
                    } => watch.on_data(Bytes::from(b.body), b.end_of_stream),
                    _ => Bytes::from(b.body),
                };
                if b.end_of_stream {
                    self.stage = Stage::Done;
                }
                vec![messages::response_body(&out, b.end_of_stream)]
            }
            Request::ResponseTrailers(_) => {
                self.settle_finished();
                vec![messages::trailers(false)]
            }
        }
    }

    /// The stream ended. `clean`: Envoy closed it normally (the response is complete); else
    /// it was cut, and what is unsettled counts as cancelled (the client left). Without
    /// response bodies Envoy cuts the stream at every response's end, so the end is taken as
    /// the answer's end: a client that leaves mid-answer is not told apart then.
    pub fn close(mut self, clean: bool) {
        if clean || self.bodies == BodyWatch::Skip {
            self.settle_finished();
        }
    }

    /// A response without a body seen (Envoy does not send bodies, or the body is empty):
    /// finished at the end of the stream.
    fn settle_finished(&mut self) {
        if let Stage::Routed {
            watch: Some(watch), ..
        } = &mut self.stage
        {
            watch.on_end();
            self.stage = Stage::Done;
        }
    }

    /// A request without a body: the picker answers the model list itself; anything else has
    /// no engine to go to.
    fn without_body(&mut self) -> Vec<ProcessingResponse> {
        let path = self.path.split('?').next().unwrap_or_default();
        if self.method == "GET" && path == "/v1/models" {
            let listing = self.gw.registry.lock().listing();
            let created = self.gw.started_unix();
            let data: Vec<_> = listing
                .into_iter()
                .map(|(name, (root, parent))| {
                    serde_json::json!({"id": name, "object": "model", "created": created,
                        "owned_by": "switchyard", "root": root, "parent": parent})
                })
                .collect();
            let body = serde_json::json!({"object": "list", "data": data}).to_string();
            self.stage = Stage::Done;
            return vec![messages::immediate(200, body.into_bytes(), &[], "models")];
        }
        self.answer(&ApiError::no_route(path))
    }

    /// Answers the client with `e` (counted as the gateway's own answer).
    fn answer(&mut self, e: &ApiError) -> Vec<ProcessingResponse> {
        self.gw.metrics.gateway_answer(e.code);
        self.stage = Stage::Done;
        vec![messages::error(e)]
    }

    /// Parses and routes the buffered body; answers with the destination and the body.
    async fn route(&mut self, end_of_stream: bool) -> Vec<ProcessingResponse> {
        let path = self.path.split('?').next().unwrap_or_default();
        let endpoint = match (self.method.as_str(), path) {
            ("POST", "/v1/chat/completions") => Endpoint::Chat,
            ("POST", "/v1/completions") => Endpoint::Completions,
            ("POST", "/v1/embeddings") => Endpoint::Embeddings,
            _ => return self.answer(&ApiError::no_route(path)),
        };
        if self.gw.is_shutting_down() {
            return self.answer(&ApiError::shutting_down());
        }
        let body = std::mem::take(&mut self.body).freeze();
        let mut parsed = match parse::parse(&body, self.session.as_deref()) {
            Ok(p) => p,
            Err(e) => return self.answer(&e),
        };
        parsed.phase = parse::phase_header(self.phase.as_deref());
        let rid = self.gw.next_request();
        let routed = match proxy::route(&self.gw, &parsed, endpoint, rid).await {
            Ok(r) => r,
            Err(e) => return self.answer(&e),
        };
        let strip_usage = self.bodies == BodyWatch::Watch
            && self.gw.settings.inject_usage
            && endpoint != Endpoint::Embeddings
            && parsed.stream
            && !parsed.has_stream_options;
        drop(parsed);
        let Some(pick) = self.pick(&routed) else {
            self.gw.observe(Observation::Failed(routed.rid));
            self.gw.admission.wake();
            let model = routed
                .candidates
                .first()
                .and_then(|b| b.spec.models.first().cloned())
                .unwrap_or_default();
            return self.answer(&ApiError::no_backend(&model));
        };
        // The engine gets the name it serves when an alias or the fallback applied, and the
        // usage chunk when we want to learn from it: the body changes only then.
        let mut out_body = match routed.upstream_model.as_deref() {
            Some(model) => Bytes::from(parse::with_model(&body, model)),
            None => body.clone(),
        };
        if strip_usage {
            if let Some(b) = parse::with_include_usage(&out_body) {
                out_body = Bytes::from(b);
            }
        }
        let mut extra: Vec<(&str, String)> = Vec::new();
        if out_body.len() != body.len() {
            extra.push(("content-length", out_body.len().to_string()));
        }
        if let Some(prefill) = &pick.prefill {
            extra.push((messages::PREFILLER, prefill.clone()));
        }
        if let Some(peers) = &self.gw.peers {
            // Every leg the router recorded: the request whole, or its prefill and decode legs
            // (each its own request in the router).
            let session = self.session.as_deref();
            let legs = pick.prefill_guard.iter().chain([&pick.guard]);
            for guard in legs {
                peers.routed(
                    &self.gw.metrics,
                    guard.rid,
                    guard.backend.name(),
                    endpoint.into(),
                    session,
                    &body,
                );
            }
        }
        let mut replies = vec![messages::routed(&pick.destination, &extra)];
        replies.extend(messages::request_body(&out_body, end_of_stream));
        // The body goes back to Envoy with these replies: its memory is given back here.
        self.hold = BodyHold::default();
        self.stage = Stage::Routed {
            routed: Box::new(routed),
            guard: Some(pick.guard),
            prefill: pick.prefill_guard,
            watch: None,
            strip_usage,
            predicted_cached: pick.predicted_cached,
        };
        replies
    }

    /// The destination list (the proxy's subset hint applied) and the guards that settle the
    /// request with the router; `None` when the hint leaves no candidate.
    fn pick(&self, routed: &Routed) -> Option<Pick> {
        let allowed = |authority: &str| {
            self.subset
                .as_ref()
                .is_none_or(|s| s.iter().any(|a| a == authority))
        };
        let decision = routed.decision.as_ref();
        let disaggregated = decision.is_some_and(|d| d.is_disaggregated());
        if disaggregated {
            // The decode pod is the destination; its sidecar runs the prefill on the pod named
            // in `x-prefiller-host-port` (llm-d's protocol).
            let d = decision?;
            let registry = self.gw.registry.lock();
            let decode: Vec<_> = d.decode[..d.decode_eligible]
                .iter()
                .filter_map(|c| registry.backend(c.instance).cloned())
                .filter(|b| allowed(b.base.authority().as_ref()))
                .take(self.gw.settings.max_retries as usize + 1)
                .collect();
            drop(registry);
            let prefill = routed.candidates.first()?.clone();
            let first = decode.first()?.clone();
            let destination = join(decode.iter().map(|b| b.base.authority().to_string()));
            let decode_rid = self.gw.next_request();
            self.gw.observe(Observation::Routed {
                request: decode_rid,
                instance: first.id,
                plan: routed.plan_for(first.id),
            });
            return Some(Pick {
                destination,
                prefill: Some(prefill.base.authority().to_string()),
                guard: awaiting(RequestGuard::new(self.gw.clone(), decode_rid, first)),
                prefill_guard: Some(RequestGuard::new(self.gw.clone(), routed.rid, prefill)),
                predicted_cached: 0,
            });
        }
        let candidates: Vec<_> = routed
            .candidates
            .iter()
            .filter(|b| allowed(b.base.authority().as_ref()))
            .cloned()
            .collect();
        let first = candidates.first()?.clone();
        // The router recorded the first candidate; if the hint ruled it out, the one that
        // goes first is recorded instead.
        if routed.candidates.first().map(|b| b.id) != Some(first.id) {
            self.gw.observe(Observation::Failed(routed.rid));
            self.gw.observe(Observation::Routed {
                request: routed.rid,
                instance: first.id,
                plan: routed.plan_for(first.id),
            });
        }
        Some(Pick {
            destination: join(candidates.iter().map(|b| b.base.authority().to_string())),
            prefill: None,
            predicted_cached: predicted(routed, first.id),
            guard: awaiting(RequestGuard::new(self.gw.clone(), routed.rid, first)),
            prefill_guard: None,
        })
    }

    /// The engine's response head: a success is watched from here; an error settles the
    /// request as failed (and is passed to the client as it is).
    fn on_response_head(
        &mut self,
        status: u16,
        sse: bool,
        served: Option<&str>,
        end_of_stream: bool,
    ) {
        let Stage::Routed {
            routed,
            guard,
            prefill,
            watch,
            strip_usage,
            predicted_cached,
        } = &mut self.stage
        else {
            return;
        };
        // Whatever the answer, the prefill leg is over once the decode side answers.
        if let Some(mut p) = prefill.take() {
            if (200..300).contains(&status) {
                p.first_token();
                p.finish(None);
            } else {
                p.fail();
            }
        }
        let Some(mut g) = guard.take() else {
            return;
        };
        g.set_awaiting_head(false);
        // The proxy fell back to another endpoint of the list: the request is recorded where it
        // ran, so the router learns about the right instance.
        if let Some(served) = served.filter(|s| *s != g.backend.base.authority().as_str()) {
            let backend = {
                let registry = self.gw.registry.lock();
                registry
                    .by_name
                    .values()
                    .find(|b| b.base.authority().as_str() == served)
                    .cloned()
            };
            if let Some(backend) = backend {
                let rid = g.rid;
                g.fail();
                drop(g);
                self.gw.observe(Observation::Routed {
                    request: rid,
                    instance: backend.id,
                    plan: routed.plan_for(backend.id),
                });
                *predicted_cached = predicted(routed, backend.id);
                g = RequestGuard::new(self.gw.clone(), rid, backend);
            }
        }
        if !(200..300).contains(&status) {
            if status >= 500 || status == 429 {
                let label = if status == 429 {
                    "status_429"
                } else {
                    "status_5xx"
                };
                self.gw.metrics.upstream_failure(g.backend.name(), label);
            }
            g.fail();
            self.stage = Stage::Done;
            return;
        }
        let mut w = ResponseWatch::new(g, self.started, sse, *strip_usage, *predicted_cached);
        if self.bodies == BodyWatch::Skip {
            // No body will be seen: the head is the first byte.
            w.on_data(Bytes::new(), false);
        } else {
            w = w.with_answer_warm(routed.warm.clone());
        }
        *watch = Some(Box::new(w));
        if end_of_stream {
            self.settle_finished();
        }
    }
}

/// A routed request's destination and the guards that settle it.
struct Pick {
    destination: String,
    prefill: Option<String>,
    guard: RequestGuard,
    prefill_guard: Option<RequestGuard>,
    predicted_cached: u32,
}

/// A guard waiting for the engine's answer: dropped now (the stream was cut), the client left.
fn awaiting(mut guard: RequestGuard) -> RequestGuard {
    guard.set_awaiting_head(true);
    guard
}

fn join(parts: impl Iterator<Item = String>) -> String {
    parts.collect::<Vec<_>>().join(",")
}

fn predicted(routed: &Routed, id: InstanceId) -> u32 {
    routed
        .decision
        .as_ref()
        .and_then(|d| d.candidate(id))
        .map_or(0, |c| c.terms.cached_tokens)
}
