//! Server-sent-event framing as vLLM writes it: `data: {json}\n\n`, ending
//! with `data: [DONE]\n\n`.

use bytes::Bytes;
use serde_json::Value;

/// Frame one JSON chunk.
pub fn event(value: &Value) -> Bytes {
    let mut s = String::with_capacity(256);
    s.push_str("data: ");
    s.push_str(&value.to_string());
    s.push_str("\n\n");
    Bytes::from(s)
}

/// The terminating `[DONE]` event.
pub fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// Frame an error that happens mid-stream (vLLM sends the error object as a
/// data event, then `[DONE]`).
pub fn error_event(err: &crate::error::ApiError) -> Bytes {
    match serde_json::to_value(err.body()) {
        Ok(v) => event(&v),
        // Serializing a plain struct of strings cannot fail; keep a fallback anyway.
        Err(_) => Bytes::from_static(b"data: {\"error\":{\"message\":\"internal error\"}}\n\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_json_and_done() {
        let b = event(&serde_json::json!({"a": 1}));
        assert_eq!(&b[..], b"data: {\"a\":1}\n\n");
        assert_eq!(&done()[..], b"data: [DONE]\n\n");
    }

    #[test]
    fn error_event_is_json() {
        let b = error_event(&crate::error::ApiError::bad_request("x"));
        let s = std::str::from_utf8(&b).unwrap();
        assert!(s.starts_with("data: {\"error\""));
        assert!(s.ends_with("\n\n"));
    }
}
