//! Incremental parsing of an OpenAI streaming response (server-sent events).
//!
//! Bytes arrive in arbitrary pieces; [`SseParser::push`] returns the events
//! completed so far. An event's `data:` lines are joined with newlines (the
//! SSE rule) and read as one JSON chunk, or as the `[DONE]` terminator.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Token counts from a chunk's `usage` object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens` (0 when absent).
    pub cached_tokens: u64,
}

/// What one event of the stream carried.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chunk {
    /// The event was `data: [DONE]`.
    pub done: bool,
    /// Some choice carried non-empty generated text (`delta.content`,
    /// `delta.reasoning_content` or `text`).
    pub content: bool,
    /// The chunk's `usage`, when present and not null.
    pub usage: Option<Usage>,
    /// An `error` object sent in the stream (its message), or unparsable data.
    pub error: Option<String>,
}

/// Incremental SSE parser.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; appends every event they complete to `out`.
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<Chunk>) {
        let mut rest = bytes;
        while let Some(i) = rest.iter().position(|&b| b == b'\n') {
            self.line.extend_from_slice(&rest[..i]);
            rest = &rest[i + 1..];
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            self.on_line(&line, out);
        }
        self.line.extend_from_slice(rest);
    }

    /// Ends the stream: an event left without its blank line is still read.
    pub fn finish(&mut self, out: &mut Vec<Chunk>) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.on_line(&line, out);
        }
        self.dispatch(out);
    }

    fn on_line(&mut self, line: &[u8], out: &mut Vec<Chunk>) {
        if line.is_empty() {
            self.dispatch(out);
        } else if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        // Comments (`:`), `event:`, `id:` and `retry:` lines carry nothing we use.
    }

    fn dispatch(&mut self, out: &mut Vec<Chunk>) {
        if !self.has_data {
            return;
        }
        self.has_data = false;
        let data = std::mem::take(&mut self.data);
        out.push(parse_data(&data));
    }
}

/// Reads one event's data.
pub fn parse_data(data: &[u8]) -> Chunk {
    let trimmed = data.trim_ascii();
    if trimmed == b"[DONE]" {
        return Chunk {
            done: true,
            ..Chunk::default()
        };
    }
    let v: Value = match serde_json::from_slice(trimmed) {
        Ok(v) => v,
        Err(e) => {
            return Chunk {
                error: Some(format!("unparsable chunk: {e}")),
                ..Chunk::default()
            }
        }
    };
    let error = v.get("error").filter(|e| !e.is_null()).map(|e| {
        e.get("message")
            .and_then(Value::as_str)
            .map_or_else(|| e.to_string(), str::to_string)
    });
    let non_empty = |x: Option<&Value>| x.and_then(Value::as_str).is_some_and(|s| !s.is_empty());
    let content = v
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(|choices| {
            choices.iter().any(|c| {
                let delta = c.get("delta");
                non_empty(c.get("text"))
                    || non_empty(delta.and_then(|d| d.get("content")))
                    || non_empty(delta.and_then(|d| d.get("reasoning_content")))
            })
        });
    let usage = v.get("usage").filter(|u| u.is_object()).map(|u| {
        let n = |x: Option<&Value>| x.and_then(Value::as_u64).unwrap_or(0);
        Usage {
            prompt_tokens: n(u.get("prompt_tokens")),
            completion_tokens: n(u.get("completion_tokens")),
            cached_tokens: n(u
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens"))),
        }
    });
    Chunk {
        done: false,
        content,
        usage,
        error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(pieces: &[&[u8]]) -> Vec<Chunk> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for piece in pieces {
            p.push(piece, &mut out);
        }
        p.finish(&mut out);
        out
    }

    const STREAM: &[u8] = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n\
data: {\"choices\":[{\"index\":0,\"text\":\" there\"}]}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n\
data: [DONE]\n\n";

    #[test]
    fn reads_content_usage_and_done() {
        let c = all(&[STREAM]);
        assert_eq!(c.len(), 5);
        assert!(!c[0].content, "role-only chunk is not a token");
        assert!(c[1].content && c[2].content);
        assert_eq!(
            c[3].usage,
            Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 2,
                cached_tokens: 8
            })
        );
        assert!(c[4].done);
    }

    #[test]
    fn any_split_gives_the_same_events() {
        let whole = all(&[STREAM]);
        for cut in 1..STREAM.len() {
            assert_eq!(all(&[&STREAM[..cut], &STREAM[cut..]]), whole, "cut {cut}");
        }
        let bytes: Vec<&[u8]> = STREAM.chunks(1).collect();
        assert_eq!(all(&bytes), whole);
    }

    #[test]
    fn crlf_comments_and_multiline_data() {
        let c = all(&[
            b": ping\r\n\r\ndata: {\"choices\":\r\ndata: [{\"text\":\"x\"}]}\r\n\r\ndata: [DONE]",
        ]);
        assert_eq!(c.len(), 2);
        assert!(c[0].content);
        assert!(c[1].done, "an unterminated last event is still read");
    }

    #[test]
    fn errors_in_stream() {
        let c = all(&[b"data: {\"error\":{\"message\":\"boom\",\"code\":500}}\n\ndata: nope\n\n"]);
        assert_eq!(c[0].error.as_deref(), Some("boom"));
        assert!(c[1].error.as_deref().unwrap().starts_with("unparsable"));
        let c = all(&[b"data: {\"usage\":null,\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"]);
        assert_eq!(c[0].usage, None);
        assert!(c[0].content);
    }
}
