//! vLLM's non-generating endpoints: models, health, metrics, LoRA
//! management, tokenization and prompt rendering.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use switchyard_engine::tokenizer;

use crate::chat_template;
use crate::error::ApiError;
use crate::generate::{self, body_error, Prepared};
use crate::openai::{self, ChatMessage};
use crate::runner::RunnerError;
use crate::state::SharedState;

/// `GET /health` (also `/ping`): 200 with an empty body while the engine
/// task answers, 503 once it is gone (as vLLM does for a dead engine).
pub async fn health(State(state): State<SharedState>) -> Response {
    match state.engine.metrics().await {
        Ok(_) => StatusCode::OK.into_response(),
        Err(_) => ApiError::unavailable("The engine is not running.").into_response(),
    }
}

/// `GET /version`.
pub async fn version() -> Response {
    axum::Json(json!({ "version": env!("CARGO_PKG_VERSION") })).into_response()
}

fn model_card(
    id: &str,
    created: u64,
    root: &str,
    parent: Option<&str>,
    max_len: Option<u32>,
) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_len,
        "permission": [{
            "id": format!("modelperm-{id}"),
            "object": "model_permission",
            "created": created,
            "allow_create_engine": false,
            "allow_sampling": true,
            "allow_logprobs": true,
            "allow_search_indices": false,
            "allow_view": true,
            "allow_fine_tuning": false,
            "organization": "*",
            "group": null,
            "is_blocking": false,
        }],
    })
}

/// `GET /v1/models`: the base model, then each adapter with `root` = its path
/// and `parent` = the base model (vLLM's `OpenAIServingModels.show_available_models`).
pub async fn models(State(state): State<SharedState>) -> Response {
    let mut data = vec![model_card(
        &state.model,
        state.created,
        &state.model,
        None,
        Some(state.engine_cfg.max_model_len),
    )];
    if let Ok(adapters) = state.adapters.read() {
        for (name, path) in adapters.iter() {
            data.push(model_card(
                name,
                state.created,
                path,
                Some(&state.model),
                None,
            ));
        }
    }
    axum::Json(json!({ "object": "list", "data": data })).into_response()
}

/// `GET /metrics` in Prometheus text format (times in virtual seconds).
pub async fn metrics(State(state): State<SharedState>) -> Response {
    match state.engine.metrics().await {
        Ok(snap) => {
            let text = state.metrics.render(&snap, crate::kv_events::unix_now());
            (
                StatusCode::OK,
                [(
                    header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                text,
            )
                .into_response()
        }
        Err(_) => ApiError::unavailable("The engine is shutting down.").into_response(),
    }
}

/// `POST /v1/load_lora_adapter` body.
#[derive(Debug, Deserialize)]
struct LoadLora {
    lora_name: Option<String>,
    lora_path: Option<String>,
}

/// `POST /v1/unload_lora_adapter` body.
#[derive(Debug, Deserialize)]
struct UnloadLora {
    lora_name: Option<String>,
}

/// `POST /v1/load_lora_adapter {lora_name, lora_path}`.
///
/// Registers the adapter and starts loading it into a free slot (paying
/// `--lora-load-time` in virtual time); with all slots busy it is loaded on
/// first use. Messages and statuses follow vLLM's serving_models.py.
pub async fn load_lora(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        let body = body.map_err(body_error)?;
        let req: LoadLora = openai::parse_body(&body)?;
        let (Some(name), Some(path)) = (req.lora_name, req.lora_path) else {
            return Err(ApiError::bad_request(
                "Both 'lora_name' and 'lora_path' must be provided.",
            ));
        };
        if name.is_empty() || path.is_empty() {
            return Err(ApiError::bad_request(
                "Both 'lora_name' and 'lora_path' must be provided.",
            ));
        }
        if name == state.model {
            return Err(ApiError::bad_request(format!(
                "The lora adapter '{name}' has already been loaded."
            )));
        }
        let exists = state
            .adapters
            .read()
            .map(|a| a.contains_key(&name))
            .unwrap_or(false);
        if exists {
            return Err(ApiError::bad_request(format!(
                "The lora adapter '{name}' has already been loaded."
            )));
        }
        state
            .engine
            .register_adapter(&name, true)
            .await
            .map_err(|e| match e {
                RunnerError::Gone => ApiError::unavailable("The engine is shutting down."),
                RunnerError::Refused(m) => ApiError::bad_request(m),
            })?;
        if let Ok(mut a) = state.adapters.write() {
            a.insert(name.clone(), path);
        }
        Ok(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    }
    .await;
    match r {
        Ok(msg) => (StatusCode::OK, msg).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/unload_lora_adapter {lora_name}`.
pub async fn unload_lora(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = async {
        let body = body.map_err(body_error)?;
        let req: UnloadLora = openai::parse_body(&body)?;
        let Some(name) = req.lora_name.filter(|n| !n.is_empty()) else {
            return Err(ApiError::bad_request(
                "'lora_name' needs to be provided to unload a LoRA adapter.",
            ));
        };
        let exists = state
            .adapters
            .read()
            .map(|a| a.contains_key(&name))
            .unwrap_or(false);
        if !exists {
            return Err(ApiError::not_found(format!(
                "The lora adapter '{name}' cannot be found."
            )));
        }
        state
            .engine
            .unload_adapter(&name)
            .await
            .map_err(|e| match e {
                RunnerError::Gone => ApiError::unavailable("The engine is shutting down."),
                RunnerError::Refused(m) => ApiError::bad_request(m),
            })?;
        if let Ok(mut a) = state.adapters.write() {
            a.remove(&name);
        }
        Ok(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    }
    .await;
    match r {
        Ok(msg) => (StatusCode::OK, msg).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /tokenize` body: a completion prompt or chat messages.
#[derive(Debug, Deserialize)]
struct TokenizeReq {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
}

/// `POST /tokenize`: `{count, max_model_len, tokens, token_strs}` as vLLM answers.
pub async fn tokenize(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = (|| {
        let body = body.map_err(body_error)?;
        let req: TokenizeReq = openai::parse_body(&body)?;
        if let Some(m) = req.model.as_deref() {
            state.resolve_model(m)?;
        }
        let text = match (req.prompt, req.messages) {
            (Some(p), None) => p,
            (None, Some(msgs)) => {
                let msgs = openai::validate_messages(Some(&msgs))?;
                chat_template::render(msgs)
            }
            _ => {
                return Err(ApiError::bad_request(
                    "Exactly one of `prompt` or `messages` must be given.",
                ))
            }
        };
        let tokens = crate::chat_template::encode(&text, state.special_tokens);
        Ok(json!({
            "count": tokens.len(),
            "max_model_len": state.engine_cfg.max_model_len,
            "tokens": tokens,
            "token_strs": null,
        }))
    })();
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize` body.
#[derive(Debug, Deserialize)]
struct DetokenizeReq {
    model: Option<String>,
    tokens: Option<Vec<u32>>,
}

/// `POST /detokenize`: `{prompt}`.
pub async fn detokenize(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = (|| {
        let body = body.map_err(body_error)?;
        let req: DetokenizeReq = openai::parse_body(&body)?;
        if let Some(m) = req.model.as_deref() {
            state.resolve_model(m)?;
        }
        let Some(tokens) = req.tokens else {
            return Err(
                ApiError::bad_request("The `tokens` field is required.").with_param("tokens")
            );
        };
        Ok(json!({ "prompt": tokenizer::decode_output(&tokens) }))
    })();
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The token-in request a render endpoint returns (vLLM's `GenerateRequest`).
///
/// Shape followed: vLLM's `/v1/completions/render` returns a *list* of these
/// (one per prompt) and `/v1/chat/completions/render` a single object, each
/// with `request_id`, `token_ids`, `sampling_params`, `model`, `stream`
/// (vllm-project/vllm tests/entrypoints/serve/render tests:
/// `test_completion_render_basic`, `test_chat_completion_render_with_stream_true`).
/// vllm-router reads only `token_ids`.
fn rendered(p: &Prepared) -> Value {
    json!({
        "request_id": p.meta.id,
        "token_ids": &p.prompt[..],
        "features": null,
        "sampling_params": { "max_tokens": p.max_tokens },
        "model": p.meta.model,
        "stream": p.stream,
        "stream_options": null,
        "cache_salt": null,
        "priority": 0,
        "kv_transfer_params": null,
    })
}

/// `POST /v1/completions/render`.
pub async fn render_completion(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body
        .map_err(body_error)
        .and_then(|b| generate::prepare_completion(&state, &b))
    {
        Ok(p) => axum::Json(json!([rendered(&p)])).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/chat/completions/render`.
pub async fn render_chat(
    State(state): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body
        .map_err(body_error)
        .and_then(|b| generate::prepare_chat(&state, &b))
    {
        Ok(p) => axum::Json(rendered(&p)).into_response(),
        Err(e) => e.into_response(),
    }
}
