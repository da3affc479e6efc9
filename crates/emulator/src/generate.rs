//! `POST /v1/completions` and `POST /v1/chat/completions`.
//!
//! Both endpoints share one flow: parse and validate, resolve the model or
//! adapter, tokenize (chat through [`crate::chat_template`]), check the
//! context limit, pick the PD mode, then either answer at once (`--instant`)
//! or submit to the engine task and stream its per-step tokens as SSE (or
//! collect them for a plain JSON answer).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use switchyard_engine::{tokenizer, EngineEvent, KvTransfer, RequestMode};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::chat_template;
use crate::error::ApiError;
use crate::openai::{
    self, finish_reason_str, ChatRequest, CommonFields, CompletionRequest, Kind, PromptInput,
    ResponseMeta, Usage,
};
use crate::pd;
use crate::runner::{RunnerError, Submission};
use crate::sse;
use crate::state::SharedState;

/// vLLM's default `max_tokens` for `/v1/completions`.
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;

/// Turn a body-extraction failure (too large, unreadable) into a JSON error.
pub fn body_error(rej: BytesRejection) -> ApiError {
    ApiError {
        status: rej.status(),
        message: rej.body_text(),
        param: None,
    }
}

/// A validated generation request, ready for the engine.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// Endpoint kind and identity of the response.
    pub meta: ResponseMeta,
    /// Prompt token ids.
    pub prompt: Arc<[u32]>,
    /// Output limit.
    pub max_tokens: u32,
    /// LoRA adapter, if the model named one.
    pub adapter: Option<String>,
    /// Engine mode (normal / prefill-only / decode-after-transfer).
    pub mode: RequestMode,
    /// Answer as SSE.
    pub stream: bool,
    /// Send the final usage chunk.
    pub include_usage: bool,
    /// Put usage in every chunk.
    pub continuous_usage: bool,
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let prepared = body
        .map_err(body_error)
        .and_then(|b| prepare_completion(&state, &b));
    match prepared {
        Ok(p) => run(state, p).await,
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let prepared = body
        .map_err(body_error)
        .and_then(|b| prepare_chat(&state, &b));
    match prepared {
        Ok(p) => run(state, p).await,
        Err(e) => e.into_response(),
    }
}

/// Tokenize a completion prompt.
pub fn completion_prompt(
    prompt: Option<&PromptInput>,
    special_tokens: bool,
) -> Result<Vec<u32>, ApiError> {
    let one = |v: Vec<u32>| {
        if v.is_empty() {
            Err(ApiError::bad_request("The prompt must not be empty.").with_param("prompt"))
        } else {
            Ok(v)
        }
    };
    match prompt {
        None => Err(ApiError::bad_request("The `prompt` field is required.").with_param("prompt")),
        Some(PromptInput::Text(t)) => one(chat_template::encode(t, special_tokens)),
        Some(PromptInput::Tokens(t)) => one(t.clone()),
        Some(PromptInput::Texts(v)) if v.len() == 1 => {
            one(chat_template::encode(&v[0], special_tokens))
        }
        Some(PromptInput::TokenLists(v)) if v.len() == 1 => one(v[0].clone()),
        Some(_) => Err(ApiError::bad_request(
            "The emulator accepts one prompt per request (batched prompts are not supported).",
        )
        .with_param("prompt")),
    }
}

/// Validate a completions body.
pub fn prepare_completion(state: &SharedState, body: &[u8]) -> Result<Prepared, ApiError> {
    let req: CompletionRequest = openai::parse_body(body)?;
    let model = openai::validate_common(&req.common)?;
    let adapter = state.resolve_model(&model)?;
    let prompt = completion_prompt(req.prompt.as_ref(), state.special_tokens)?;
    let max_tokens = req.max_tokens.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS);
    finish_prepare(
        state,
        Kind::Completion,
        model,
        adapter,
        prompt,
        Some(max_tokens),
        &req.common,
    )
}

/// Validate a chat body.
pub fn prepare_chat(state: &SharedState, body: &[u8]) -> Result<Prepared, ApiError> {
    let req: ChatRequest = openai::parse_body(body)?;
    let model = openai::validate_common(&req.common)?;
    let messages = openai::validate_messages(req.messages.as_deref())?;
    let adapter = state.resolve_model(&model)?;
    let text = chat_template::render(messages);
    let prompt = chat_template::encode(&text, state.special_tokens);
    let max_tokens = req.max_completion_tokens.or(req.max_tokens);
    finish_prepare(
        state,
        Kind::Chat,
        model,
        adapter,
        prompt,
        max_tokens,
        &req.common,
    )
}

fn finish_prepare(
    state: &SharedState,
    kind: Kind,
    model: String,
    adapter: Option<String>,
    prompt: Vec<u32>,
    max_tokens: Option<u32>,
    common: &CommonFields,
) -> Result<Prepared, ApiError> {
    let max_len = state.engine_cfg.max_model_len;
    let plen = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
    if plen >= max_len {
        return Err(openai::context_error(
            max_len,
            plen,
            max_tokens.unwrap_or(0),
        ));
    }
    // vLLM's chat default is "whatever context remains".
    let max_tokens = max_tokens.unwrap_or(max_len - plen);
    if max_tokens == 0 {
        return Err(
            ApiError::bad_request("max_tokens must be at least 1, got 0.").with_param("max_tokens"),
        );
    }
    if u64::from(plen) + u64::from(max_tokens) > u64::from(max_len) {
        return Err(openai::context_error(max_len, plen, max_tokens));
    }
    let intent = pd::parse_intent(
        common.kv_transfer_params.as_ref(),
        common.bootstrap_host.as_ref(),
        common.bootstrap_port.as_ref(),
        common.bootstrap_room.as_ref(),
    )?;
    let mode = pd::request_mode(
        &intent,
        state.engine_cfg.role,
        plen,
        state.engine_cfg.block_size,
    );
    let opts = common.stream_options.clone().unwrap_or_default();
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let id = match &common.request_id {
        Some(r) if !r.is_empty() => format!("{prefix}-{r}"),
        _ => state.response_id(prefix),
    };
    Ok(Prepared {
        meta: ResponseMeta {
            kind,
            id,
            created: crate::kv_events::unix_now() as u64,
            model,
        },
        prompt: Arc::from(prompt),
        max_tokens,
        adapter,
        mode,
        stream: common.stream,
        include_usage: common.stream && opts.include_usage,
        continuous_usage: common.stream && opts.include_usage && opts.continuous_usage_stats,
    })
}

fn runner_error(e: RunnerError) -> ApiError {
    match e {
        RunnerError::Gone => ApiError::unavailable("The engine is shutting down."),
        RunnerError::Refused(msg) => ApiError::bad_request(msg),
    }
}

/// Answer a prepared request (instant, streamed or collected).
pub async fn run(state: SharedState, p: Prepared) -> Response {
    if state.instant {
        return instant(&state, p);
    }
    let sub = match state
        .engine
        .submit(
            p.prompt.clone(),
            p.max_tokens,
            p.adapter.clone(),
            p.mode.clone(),
        )
        .await
    {
        Ok(s) => s,
        Err(e) => return runner_error(e).into_response(),
    };
    if p.stream {
        stream_response(state, p, sub)
    } else {
        collect_response(state, p, sub).await
    }
}

/// What a finished request reports.
#[derive(Debug, Clone)]
struct Outcome {
    usage: Usage,
    reason: &'static str,
    kv_transfer: Option<KvTransfer>,
}

fn kv_params(state: &SharedState, kv: &Option<KvTransfer>) -> Option<Value> {
    kv.as_ref()
        .map(|k| pd::prefill_response_params(k, &state.advertised))
}

async fn collect_response(state: SharedState, p: Prepared, mut sub: Submission) -> Response {
    let mut ids: Vec<u32> = Vec::new();
    while let Some(ev) = sub.events.recv().await {
        match ev {
            EngineEvent::Tokens { tokens, .. } => ids.extend_from_slice(&tokens),
            EngineEvent::Finished {
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                reason,
                kv_transfer,
                ..
            } => {
                sub.disarm();
                let out = Outcome {
                    usage: Usage {
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                    },
                    reason: finish_reason_str(&reason),
                    kv_transfer,
                };
                let text = tokenizer::decode_output(&ids);
                let body = p.meta.full_response(
                    &text,
                    out.reason,
                    &out.usage,
                    kv_params(&state, &out.kv_transfer),
                );
                return axum::Json(body).into_response();
            }
            EngineEvent::FirstToken { .. } | EngineEvent::Preempted { .. } => {}
        }
    }
    ApiError::unavailable("The engine stopped before the request finished.").into_response()
}

fn sse_response(rx: mpsc::Receiver<Result<Bytes, Infallible>>) -> Response {
    let body = Body::from_stream(ReceiverStream::new(rx));
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

fn stream_response(state: SharedState, p: Prepared, mut sub: Submission) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    tokio::spawn(async move {
        let mut first = true;
        let mut usage = Usage {
            prompt_tokens: u32::try_from(p.prompt.len()).unwrap_or(u32::MAX),
            ..Usage::default()
        };
        loop {
            let ev = tokio::select! {
                ev = sub.events.recv() => ev,
                // The client went away: dropping `sub` aborts in the engine.
                _ = tx.closed() => return,
            };
            let Some(ev) = ev else {
                let err = ApiError::unavailable("The engine stopped before the request finished.");
                let _ = tx.send(Ok(sse::error_event(&err))).await;
                let _ = tx.send(Ok(sse::done())).await;
                return;
            };
            match ev {
                EngineEvent::FirstToken {
                    prompt_tokens,
                    cached_tokens,
                    ..
                } => {
                    usage.prompt_tokens = prompt_tokens;
                    usage.cached_tokens = cached_tokens;
                }
                EngineEvent::Tokens { tokens, .. } => {
                    usage.completion_tokens += u32::try_from(tokens.len()).unwrap_or(0);
                    let text = tokenizer::decode_output(&tokens);
                    let u = p.continuous_usage.then_some(&usage);
                    let chunk = p.meta.chunk(&text, first, None, u);
                    first = false;
                    if tx.send(Ok(sse::event(&chunk))).await.is_err() {
                        return;
                    }
                }
                EngineEvent::Finished {
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                    reason,
                    kv_transfer,
                    ..
                } => {
                    sub.disarm();
                    usage = Usage {
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                    };
                    let mut chunk = p.meta.chunk(
                        "",
                        first,
                        Some(finish_reason_str(&reason)),
                        p.continuous_usage.then_some(&usage),
                    );
                    if let (Some(params), Some(obj)) =
                        (kv_params(&state, &kv_transfer), chunk.as_object_mut())
                    {
                        obj.insert("kv_transfer_params".to_string(), params);
                    }
                    let _ = tx.send(Ok(sse::event(&chunk))).await;
                    if p.include_usage {
                        let _ = tx.send(Ok(sse::event(&p.meta.usage_chunk(&usage)))).await;
                    }
                    let _ = tx.send(Ok(sse::done())).await;
                    return;
                }
                EngineEvent::Preempted { .. } => {}
            }
        }
    });
    sse_response(rx)
}

/// Deterministic output token ids for instant mode.
fn instant_tokens(seed: u64, n: u32) -> Vec<u32> {
    // Small ids in a fixed cycle: cheap, reproducible, and decodable.
    (0..n)
        .map(|i| ((seed as u32).wrapping_add(i.wrapping_mul(7919))) % 1000)
        .collect()
}

/// `--instant`: answer immediately with correct shapes and usage.
fn instant(state: &SharedState, p: Prepared) -> Response {
    let plen = u32::try_from(p.prompt.len()).unwrap_or(u32::MAX);
    let (n_out, kv) = match &p.mode {
        RequestMode::PrefillOnly => {
            let bs = state.engine_cfg.block_size.max(1);
            let kv = KvTransfer {
                remote_engine_id: state.engine_cfg.engine_id.clone(),
                remote_block_ids: (0..plen.div_ceil(bs)).collect(),
                remote_request_id: p.meta.id.clone(),
                num_tokens: plen,
            };
            (1, Some(kv))
        }
        _ => (p.max_tokens, None),
    };
    let cached = match &p.mode {
        RequestMode::DecodeAfterTransfer(_) => plen,
        _ => 0,
    };
    let usage = Usage {
        prompt_tokens: plen,
        completion_tokens: n_out,
        cached_tokens: cached,
    };
    let ids = instant_tokens(state.seed, n_out);
    let params = kv_params(state, &kv);
    if !p.stream {
        let text = tokenizer::decode_output(&ids);
        return axum::Json(p.meta.full_response(&text, "length", &usage, params)).into_response();
    }
    let mut out = Vec::with_capacity(ids.len() + 3);
    let mut running = Usage {
        completion_tokens: 0,
        ..usage
    };
    for (i, id) in ids.iter().enumerate() {
        running.completion_tokens += 1;
        let text = tokenizer::decode_output(std::slice::from_ref(id));
        out.push(sse::event(&p.meta.chunk(
            &text,
            i == 0,
            None,
            p.continuous_usage.then_some(&running),
        )));
    }
    let mut last = p.meta.chunk(
        "",
        ids.is_empty(),
        Some("length"),
        p.continuous_usage.then_some(&usage),
    );
    if let (Some(params), Some(obj)) = (params, last.as_object_mut()) {
        obj.insert("kv_transfer_params".to_string(), params);
    }
    out.push(sse::event(&last));
    if p.include_usage {
        out.push(sse::event(&p.meta.usage_chunk(&usage)));
    }
    out.push(sse::done());
    let body = Body::from_stream(tokio_stream::iter(out.into_iter().map(Ok::<_, Infallible>)));
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_forms() {
        assert!(completion_prompt(None, false).is_err());
        assert!(completion_prompt(Some(&PromptInput::Text(String::new())), false).is_err());
        assert_eq!(
            completion_prompt(Some(&PromptInput::Tokens(vec![1, 2])), false).unwrap(),
            vec![1, 2]
        );
        assert!(completion_prompt(
            Some(&PromptInput::Texts(vec!["a".into(), "b".into()])),
            false
        )
        .is_err());
        assert_eq!(
            completion_prompt(Some(&PromptInput::Text("abcdefgh".into())), false)
                .unwrap()
                .len(),
            tokenizer::count("abcdefgh")
        );
    }

    #[test]
    fn instant_tokens_are_deterministic() {
        assert_eq!(instant_tokens(1, 4), instant_tokens(1, 4));
        assert_eq!(instant_tokens(1, 4).len(), 4);
    }
}
