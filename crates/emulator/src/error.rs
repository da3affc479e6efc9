//! OpenAI/vLLM-style error responses.
//!
//! vLLM (0.10 and later) answers errors with
//! `{"error": {"message", "type", "param", "code"}}` where `code` repeats the
//! HTTP status as an integer and `type` is the exception-like name
//! (`BadRequestError`, `NotFoundError`, ...). Clients such as the official
//! `openai` package read `error.message`, so the nesting matters.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use thiserror::Error;

/// An error that becomes an HTTP response in vLLM's shape.
#[derive(Debug, Clone, Error, PartialEq)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status to answer with.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// The request parameter at fault, when one is.
    pub param: Option<String>,
}

/// The inner object of the error body.
#[derive(Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct ErrorInfo {
    /// Human-readable message.
    pub message: String,
    /// Error class name, e.g. `BadRequestError`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The offending parameter, if any.
    pub param: Option<String>,
    /// The HTTP status code as an integer.
    pub code: u16,
}

/// The error body: `{"error": {...}}`.
#[derive(Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct ErrorBody {
    /// The error details.
    pub error: ErrorInfo,
}

impl ApiError {
    /// A 400 Bad Request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }

    /// A 404 Not Found.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            param: None,
        }
    }

    /// A 503 Service Unavailable (engine task gone, shutting down).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            param: None,
        }
    }

    /// A 500 Internal Server Error.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
        }
    }

    /// Attach the name of the parameter at fault.
    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// The unknown-model error vLLM gives (404, `param: "model"`).
    pub fn unknown_model(model: &str) -> Self {
        Self::not_found(format!("The model `{model}` does not exist.")).with_param("model")
    }

    /// The error class name vLLM/OpenAI use for this status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 => "BadRequestError",
            401 => "AuthenticationError",
            404 => "NotFoundError",
            413 => "BadRequestError",
            422 => "UnprocessableEntityError",
            429 => "RateLimitError",
            501 => "NotImplementedError",
            503 => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    /// The JSON body for this error.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorInfo {
                message: self.message.clone(),
                kind: self.kind().to_string(),
                param: self.param.clone(),
                code: self.status.as_u16(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_vllm_shape() {
        let e = ApiError::unknown_model("nope");
        let v = serde_json::to_value(e.body()).unwrap();
        assert_eq!(v["error"]["type"], "NotFoundError");
        assert_eq!(v["error"]["code"], 404);
        assert_eq!(v["error"]["param"], "model");
        assert!(v["error"]["message"].as_str().unwrap().contains("nope"));
    }

    #[test]
    fn bad_request_has_null_param() {
        let v = serde_json::to_value(ApiError::bad_request("x").body()).unwrap();
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["code"], 400);
        assert!(v["error"]["param"].is_null());
    }
}
