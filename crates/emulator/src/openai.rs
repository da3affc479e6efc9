//! OpenAI-compatible request and response types, shaped like vLLM's.
//!
//! Requests are parsed leniently (unknown fields such as `temperature` are
//! accepted and ignored, as sampling does not change the emulated timing) but
//! the fields that matter are validated the way vLLM validates them.
//! Responses follow vLLM's `CompletionResponse`, `ChatCompletionResponse` and
//! their stream chunks (vllm/entrypoints/openai/protocol.py).

use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;

/// `stream_options` of a request.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StreamOptions {
    /// Send a final chunk with `usage` (and empty `choices`).
    #[serde(default)]
    pub include_usage: bool,
    /// Put the running `usage` into every chunk.
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// The fields both completion kinds share.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct CommonFields {
    /// Model or adapter name; required by the emulator.
    pub model: Option<String>,
    /// Whether to answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Options for streamed answers.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices; only 1 is supported.
    pub n: Option<u32>,
    /// NixlConnector hand-off parameters (vLLM disaggregated prefill).
    pub kv_transfer_params: Option<Value>,
    /// SGLang PD bootstrap host.
    pub bootstrap_host: Option<Value>,
    /// SGLang PD bootstrap port.
    pub bootstrap_port: Option<Value>,
    /// SGLang PD bootstrap room (pairs prefill and decode).
    pub bootstrap_room: Option<Value>,
    /// Client-chosen request id (vLLM honours `X-Request-Id`/`request_id`).
    pub request_id: Option<String>,
}

/// A prompt as `/v1/completions` accepts it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PromptInput {
    /// A single text prompt.
    Text(String),
    /// A list of text prompts (batch).
    Texts(Vec<String>),
    /// One prompt given as token ids.
    Tokens(Vec<u32>),
    /// Several prompts given as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct CompletionRequest {
    /// Shared fields.
    #[serde(flatten)]
    pub common: CommonFields,
    /// The prompt.
    pub prompt: Option<PromptInput>,
    /// Maximum tokens to generate (vLLM default 16).
    pub max_tokens: Option<u32>,
}

/// One part of a multi-part message content.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ContentPart {
    /// Part type; only `text` carries tokens here.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// A chat message's content: a string or a list of parts.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Parts; the text parts are concatenated.
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// The text the template sees.
    pub fn text(&self) -> String {
        match self {
            MessageContent::Text(t) => t.clone(),
            MessageContent::Parts(parts) => parts
                .iter()
                .filter(|p| p.kind == "text")
                .filter_map(|p| p.text.as_deref())
                .collect::<Vec<_>>()
                .join(""),
        }
    }
}

/// A chat message.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The content (may be null for assistant tool calls).
    pub content: Option<MessageContent>,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ChatRequest {
    /// Shared fields.
    #[serde(flatten)]
    pub common: CommonFields,
    /// The conversation.
    pub messages: Option<Vec<ChatMessage>>,
    /// Deprecated OpenAI name of the output limit.
    pub max_tokens: Option<u32>,
    /// Current OpenAI name of the output limit (wins over `max_tokens`).
    pub max_completion_tokens: Option<u32>,
}

/// Roles the chat template knows.
pub const CHAT_ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Parse a JSON body into `T`, turning every failure into a 400 like vLLM.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid JSON body: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "Request body must be a JSON object".to_string(),
        ));
    }
    serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(format!("Invalid request: {e}")))
}

/// Check the shared fields and return the requested model name.
pub fn validate_common(common: &CommonFields) -> Result<String, ApiError> {
    let model = match common.model.as_deref() {
        Some(m) if !m.is_empty() => m.to_string(),
        _ => {
            return Err(ApiError::bad_request("The `model` field is required.").with_param("model"))
        }
    };
    if common.stream_options.is_some() && !common.stream {
        // vLLM's request validator refuses this combination.
        return Err(ApiError::bad_request(
            "Stream options can only be defined when `stream=True`.",
        )
        .with_param("stream_options"));
    }
    if let Some(n) = common.n {
        if n != 1 {
            return Err(ApiError::bad_request("The emulator supports only n=1.").with_param("n"));
        }
    }
    Ok(model)
}

/// Check a chat request's messages.
pub fn validate_messages(messages: Option<&[ChatMessage]>) -> Result<&[ChatMessage], ApiError> {
    let messages = match messages {
        Some(m) if !m.is_empty() => m,
        Some(_) => {
            return Err(
                ApiError::bad_request("`messages` must not be empty.").with_param("messages")
            )
        }
        None => {
            return Err(
                ApiError::bad_request("The `messages` field is required.").with_param("messages")
            )
        }
    };
    for m in messages {
        if !CHAT_ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::bad_request(format!(
                "Unknown message role `{}`; expected one of {}.",
                m.role,
                CHAT_ROLES.join(", ")
            ))
            .with_param("messages"));
        }
    }
    Ok(messages)
}

/// The context-length error vLLM gives when prompt + output exceed the model.
pub fn context_error(max_model_len: u32, prompt: u32, max_tokens: u32) -> ApiError {
    ApiError::bad_request(format!(
        "This model's maximum context length is {max_model_len} tokens. However, you requested \
         {} tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce the \
         length of the messages or completion.",
        u64::from(prompt) + u64::from(max_tokens)
    ))
    .with_param("max_tokens")
}

/// Token accounting of one answered request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache (or transferred, for decode).
    pub cached_tokens: u32,
}

impl Usage {
    /// The `usage` object with `prompt_tokens_details.cached_tokens`.
    pub fn to_json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": { "cached_tokens": self.cached_tokens },
        })
    }
}

/// Which endpoint an answer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

/// Identity of one response: id, creation time and model echoed back.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseMeta {
    /// Endpoint kind.
    pub kind: Kind,
    /// `cmpl-…` or `chatcmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model name as requested.
    pub model: String,
}

impl ResponseMeta {
    /// The full non-streaming body.
    pub fn full_response(
        &self,
        text: &str,
        finish_reason: &str,
        usage: &Usage,
        kv_transfer_params: Option<Value>,
    ) -> Value {
        match self.kind {
            Kind::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": finish_reason,
                    "stop_reason": null,
                    "prompt_logprobs": null,
                }],
                "usage": usage.to_json(),
                "system_fingerprint": null,
                "kv_transfer_params": kv_transfer_params,
            }),
            Kind::Chat => json!({
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": null,
                        "annotations": null,
                        "audio": null,
                        "function_call": null,
                        "tool_calls": [],
                        "reasoning_content": null,
                    },
                    "logprobs": null,
                    "finish_reason": finish_reason,
                    "stop_reason": null,
                }],
                "usage": usage.to_json(),
                "system_fingerprint": null,
                "prompt_logprobs": null,
                "kv_transfer_params": kv_transfer_params,
            }),
        }
    }

    /// A streamed chunk carrying `text` (and, on the last one, the finish reason).
    ///
    /// `first` adds the assistant role to a chat delta, as vLLM's first chunk has it.
    pub fn chunk(
        &self,
        text: &str,
        first: bool,
        finish_reason: Option<&str>,
        usage: Option<&Usage>,
    ) -> Value {
        let mut v = match self.kind {
            Kind::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": finish_reason,
                    "stop_reason": null,
                }],
            }),
            Kind::Chat => {
                let delta = if first {
                    json!({ "role": "assistant", "content": text })
                } else if text.is_empty() && finish_reason.is_some() {
                    json!({})
                } else {
                    json!({ "content": text })
                };
                json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [{
                        "index": 0,
                        "delta": delta,
                        "logprobs": null,
                        "finish_reason": finish_reason,
                        "stop_reason": null,
                    }],
                })
            }
        };
        if let (Some(u), Some(obj)) = (usage, v.as_object_mut()) {
            obj.insert("usage".to_string(), u.to_json());
        }
        v
    }

    /// The final `include_usage` chunk: empty `choices`, full `usage`.
    pub fn usage_chunk(&self, usage: &Usage) -> Value {
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage.to_json(),
        })
    }
}

/// Map the engine's finish reason onto the OpenAI string.
pub fn finish_reason_str(reason: &switchyard_engine::FinishReason) -> &'static str {
    match reason {
        switchyard_engine::FinishReason::Length => "length",
        switchyard_engine::FinishReason::Stop => "stop",
        switchyard_engine::FinishReason::Abort => "abort",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_completion_with_unknown_fields() {
        let r: CompletionRequest = parse_body(
            br#"{"model":"m","prompt":"hi","max_tokens":5,"temperature":0.2,"stream":true,
                "stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert_eq!(r.common.model.as_deref(), Some("m"));
        assert_eq!(r.prompt, Some(PromptInput::Text("hi".into())));
        assert_eq!(r.max_tokens, Some(5));
        assert!(r.common.stream);
        assert!(r.common.stream_options.unwrap().include_usage);
    }

    #[test]
    fn parses_token_prompts() {
        let r: CompletionRequest = parse_body(br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompt, Some(PromptInput::Tokens(vec![1, 2, 3])));
        let r: CompletionRequest = parse_body(br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert_eq!(
            r.prompt,
            Some(PromptInput::Texts(vec!["a".into(), "b".into()]))
        );
    }

    #[test]
    fn malformed_json_is_400() {
        let e = parse_body::<CompletionRequest>(b"{not json").unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        let e = parse_body::<CompletionRequest>(b"[1,2]").unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        let e = parse_body::<CompletionRequest>(br#"{"model":"m","max_tokens":"x"}"#).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
    }

    #[test]
    fn missing_model_is_400() {
        let r: CompletionRequest = parse_body(br#"{"prompt":"x"}"#).unwrap();
        let e = validate_common(&r.common).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert_eq!(e.param.as_deref(), Some("model"));
    }

    #[test]
    fn stream_options_need_stream() {
        let r: CompletionRequest =
            parse_body(br#"{"model":"m","prompt":"x","stream_options":{"include_usage":true}}"#)
                .unwrap();
        assert_eq!(validate_common(&r.common).unwrap_err().status.as_u16(), 400);
    }

    #[test]
    fn wrong_role_is_400() {
        let r: ChatRequest =
            parse_body(br#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#).unwrap();
        let e = validate_messages(r.messages.as_deref()).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        let r: ChatRequest = parse_body(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        let m = validate_messages(r.messages.as_deref()).unwrap();
        assert_eq!(m[0].content.as_ref().unwrap().text(), "ab");
    }

    #[test]
    fn usage_has_cached_tokens() {
        let u = Usage {
            prompt_tokens: 10,
            completion_tokens: 3,
            cached_tokens: 8,
        };
        let v = u.to_json();
        assert_eq!(v["total_tokens"], 13);
        assert_eq!(v["prompt_tokens_details"]["cached_tokens"], 8);
    }

    #[test]
    fn chat_chunks_look_like_vllm() {
        let meta = ResponseMeta {
            kind: Kind::Chat,
            id: "chatcmpl-1".into(),
            created: 1,
            model: "m".into(),
        };
        let first = meta.chunk("he", true, None, None);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["choices"][0]["delta"]["content"], "he");
        assert!(first.get("usage").is_none());
        let last = meta.chunk("", false, Some("length"), None);
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        let u = meta.usage_chunk(&Usage::default());
        assert_eq!(u["choices"].as_array().unwrap().len(), 0);
        assert_eq!(u["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    }

    #[test]
    fn completion_full_response() {
        let meta = ResponseMeta {
            kind: Kind::Completion,
            id: "cmpl-1".into(),
            created: 1,
            model: "m".into(),
        };
        let v = meta.full_response("abc", "length", &Usage::default(), None);
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], "abc");
        assert!(v["kv_transfer_params"].is_null());
    }
}
