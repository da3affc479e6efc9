//! Errors the gateway itself answers, in OpenAI's shape:
//! `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.
//!
//! Engine errors are never rewritten: a 4xx (or the last 5xx) from an engine is passed through
//! as the engine wrote it.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error answered by the gateway.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// Machine-readable code (`model_not_found`, `saturated`, ...).
    pub code: &'static str,
    /// The request parameter at fault, when one is.
    pub param: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429 and 503).
    pub retry_after: Option<u32>,
}

/// The inner object of the error body.
#[derive(Debug, Serialize)]
struct ErrorInfo<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

/// `{"error": {...}}`.
#[derive(Debug, Serialize)]
struct ErrorBody<'a> {
    error: ErrorInfo<'a>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        ApiError {
            status,
            message,
            kind,
            code,
            param: None,
            retry_after: None,
        }
    }

    /// 400: a path parameter that does not decode (e.g. invalid percent-encoding).
    pub fn bad_path(detail: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_path",
            format!("The request path is invalid: {detail}"),
        )
    }

    /// 400: the body is not valid JSON (or not an object).
    pub fn malformed(detail: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_json",
            format!("The request body is not valid JSON: {detail}"),
        )
    }

    /// 400: a field the gateway needs is missing or has the wrong type.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param),
            ..Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_value",
                message.into(),
            )
        }
    }

    /// 400: `model` is missing.
    pub fn missing_model() -> Self {
        ApiError {
            param: Some("model"),
            ..Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "missing_model",
                "The `model` field is required.".into(),
            )
        }
    }

    /// 404: no backend serves this model or adapter.
    pub fn unknown_model(model: &str) -> Self {
        ApiError {
            param: Some("model"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("The model `{model}` does not exist."),
            )
        }
    }

    /// 404: `alias` is an alias of `target`, which no backend serves.
    pub fn alias_target_missing(alias: &str, target: &str) -> Self {
        ApiError {
            param: Some("model"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("The model `{alias}` is an alias of `{target}`, which no backend serves."),
            )
        }
    }

    /// 404: no such endpoint.
    pub fn no_route(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            format!("No endpoint at `{path}`."),
        )
    }

    /// 405: the endpoint exists with another method.
    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            "Method not allowed for this endpoint.".into(),
        )
    }

    /// 413: the body is over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("The request body is larger than {limit} bytes."),
        )
    }

    /// 431: the request's headers are larger than engines accept; forwarding them would get
    /// the connection closed by the engine, which looks like the engine failing.
    pub fn headers_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "invalid_request_error",
            "headers_too_large",
            format!("The request headers are larger than {limit} bytes."),
        )
    }

    /// 431 from the HTTP layer (more or larger header fields than it parses).
    pub fn header_fields_too_large() -> Self {
        Self::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "invalid_request_error",
            "headers_too_large",
            "The request has more or larger header fields than the gateway accepts.".into(),
        )
    }

    /// 400 from the HTTP layer: the request is not valid HTTP/1.1.
    pub fn invalid_http() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_http",
            "The request is not valid HTTP/1.1.".into(),
        )
    }

    /// 414 from the HTTP layer: the request target is too long.
    pub fn uri_too_long() -> Self {
        Self::new(
            StatusCode::URI_TOO_LONG,
            "invalid_request_error",
            "uri_too_long",
            "The request URI is too long.".into(),
        )
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "Missing or invalid API key (send `Authorization: Bearer KEY`).".into(),
        )
    }

    /// 401: the dashboard without the admin token (answered with a Basic challenge, so a
    /// browser asks for it).
    pub fn admin_unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_admin_token",
            "Missing or wrong admin token (send `Authorization: Bearer TOKEN`, or the token as \
             the password of HTTP Basic credentials)."
                .into(),
        )
    }

    /// 503: too many dashboard event streams open at once.
    pub fn too_many_streams(max: usize) -> Self {
        ApiError {
            retry_after: Some(5),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "too_many_dashboard_streams",
                format!("{max} dashboard event streams are open already; retry later."),
            )
        }
    }

    /// 403: admin endpoint without the admin token, or admin disabled.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "forbidden",
            message.into(),
        )
    }

    /// 503: no healthy backend serves the model.
    pub fn no_backend(model: &str) -> Self {
        ApiError {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "no_healthy_backend",
                format!("No healthy backend is available for model `{model}`."),
            )
        }
    }

    /// 503: more client connections are open than `--max-connections` allows.
    pub fn too_many_connections() -> Self {
        ApiError {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "too_many_connections",
                "The gateway has too many open connections; retry later.".into(),
            )
        }
    }

    /// 408: the request body did not arrive in time.
    pub fn body_timeout(secs: f64) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "body_timeout",
            format!("The request body did not arrive within {secs} s."),
        )
    }

    /// 503: the gateway is shutting down.
    pub fn shutting_down() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "shutting_down",
            "The gateway is shutting down.".into(),
        )
    }

    /// 502: every attempt failed without an answer from an engine.
    pub fn bad_gateway(detail: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "server_error",
            "upstream_error",
            format!("No backend answered: {detail}"),
        )
    }

    /// 504: the engine did not answer in time.
    pub fn upstream_timeout(secs: f64) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "server_error",
            "upstream_timeout",
            format!("The backend did not answer within {secs} s."),
        )
    }

    /// 503: the request bodies already held use up `--max-body-memory`.
    pub fn body_memory_exhausted(limit: usize) -> Self {
        ApiError {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "body_memory_exhausted",
                format!(
                    "Request bodies being received use up the gateway's {limit} bytes for them; retry later."
                ),
            )
        }
    }

    /// 429: every backend is saturated and the admission queue did not clear in time.
    pub fn saturated(retry_after: u32) -> Self {
        ApiError {
            retry_after: Some(retry_after),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "saturated",
                "Every backend is at capacity; retry later.".into(),
            )
        }
    }

    /// 400 for an admin request that names an unknown policy or backend, etc.
    pub fn bad_admin(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_value",
            message.into(),
        )
    }

    /// 404 for an admin request naming an unknown backend.
    pub fn unknown_backend(name: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "backend_not_found",
            format!("No backend named `{name}`."),
        )
    }

    /// The JSON body bytes.
    pub fn body(&self) -> Vec<u8> {
        let body = ErrorBody {
            error: ErrorInfo {
                message: &self.message,
                kind: self.kind,
                param: self.param,
                code: self.code,
            },
        };
        // Serialising a struct of strings cannot fail; keep a fallback rather than unwrap.
        serde_json::to_vec(&body).unwrap_or_else(|_| b"{\"error\":{}}".to_vec())
    }
}

impl From<switchyard_core::models::ModelError> for ApiError {
    fn from(e: switchyard_core::models::ModelError) -> Self {
        match e {
            switchyard_core::models::ModelError::Unknown(m) => ApiError::unknown_model(&m),
            switchyard_core::models::ModelError::AliasTarget { alias, target } => {
                ApiError::alias_target_missing(&alias, &target)
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body()).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::PAYLOAD_TOO_LARGE
            || self.status == StatusCode::REQUEST_TIMEOUT
            || self.code == "body_memory_exhausted"
        {
            // The rest of the body was never read, so the connection cannot carry
            // another request: say so, or a client reuses it and loses its next one.
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_openai_shape() {
        let e = ApiError::unknown_model("x\"y");
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["param"], "model");
        assert!(v["error"]["message"].as_str().unwrap().contains("x\"y"));
    }

    #[test]
    fn a_missing_alias_target_names_both() {
        let e = ApiError::from(switchyard_core::models::ModelError::AliasTarget {
            alias: "gpt-4o".into(),
            target: "qwen".into(),
        });
        assert_eq!(
            (e.status, e.code),
            (StatusCode::NOT_FOUND, "model_not_found")
        );
        assert!(e.message.contains("`gpt-4o`") && e.message.contains("`qwen`"));
    }

    #[test]
    fn saturated_sets_retry_after() {
        let r = ApiError::saturated(3).into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "3");
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
    }

    #[test]
    fn too_large_closes_the_connection_and_others_keep_it() {
        let r = ApiError::too_large(10).into_response();
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(r.headers()[header::CONNECTION], "close");
        let r = ApiError::no_route("/x").into_response();
        assert!(r.headers().get(header::CONNECTION).is_none());
    }
}
