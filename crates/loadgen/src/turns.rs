//! Two-turn conversations for the fixed-rate generator (`FixedOptions::conversations`): what a
//! router that tokenizes prompts pays for a conversation's next turn, whose history it has
//! seen only as the first turn's prompt and the engine's answer.
//!
//! Even requests open a conversation: the fixed user message led by the request's number (as
//! with `unique`), its answer kept. Odd request `i` is the next turn of the conversation
//! opened [`GAP_S`] earlier (request `i - 1 - lag`): that first question, the engine's answer
//! as it came, and a short new question. Both turns name the conversation in `x-session-id`,
//! as a session-aware client does. Only next turns are measured; a next turn whose first
//! turn has no answer yet (or failed) is sent as a new conversation and counted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use bytes::Bytes;

use crate::error::Result;
use crate::words::{prompt, spelled};

/// Seconds between a conversation's first turn and its next: far longer than a zero-delay
/// engine takes to answer, so the answer is there when the next turn is due.
pub const GAP_S: f64 = 0.05;

/// Four-byte words in a next turn's new question.
const NEXT_WORDS: usize = 16;

/// The answers of open conversations, by the number of their first request.
#[derive(Debug)]
pub struct Turns {
    /// Requests between a first turn and its next one (even).
    lag: u64,
    answers: Mutex<HashMap<u64, String>>,
    /// Measured next turns sent as new conversations: their first turn had no answer.
    pub without_answer: AtomicU64,
}

/// One request of a conversation run.
#[derive(Debug)]
pub struct Turn {
    /// The request body.
    pub body: Bytes,
    /// The `x-session-id` it names.
    pub session: String,
    /// A next turn (measured); else a first turn, whose answer is to be kept.
    pub next: bool,
}

impl Turns {
    /// The conversations of a run at `rate` requests/s.
    pub fn new(rate: f64) -> Self {
        Turns {
            lag: ((rate * GAP_S / 2.0).round() as u64).max(1) * 2,
            answers: Mutex::new(HashMap::new()),
            without_answer: AtomicU64::new(0),
        }
    }

    /// Request `i`: a first turn when even, else the next turn of the conversation opened
    /// `lag + 1` requests before (a first turn if that one has no answer).
    pub fn request(
        &self,
        model: &str,
        max_tokens: u32,
        stream: bool,
        question: &str,
        i: u64,
    ) -> Result<Turn> {
        let opened = (i % 2 == 1).then(|| i.checked_sub(self.lag + 1)).flatten();
        let answer = opened.and_then(|first| Some((first, self.lock().remove(&first)?)));
        let first_question = |n: u64| format!("{}{question}", spelled(n));
        let (messages, session, next) = match answer {
            Some((first, answer)) => {
                let new_question = format!("{}{}", spelled(i), prompt(NEXT_WORDS));
                let messages = serde_json::json!([
                    {"role": "user", "content": first_question(first)},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": new_question},
                ]);
                (messages, first, true)
            }
            None => {
                if i % 2 == 1 {
                    self.without_answer.fetch_add(1, Ordering::Relaxed);
                }
                let messages = serde_json::json!([{"role": "user", "content": first_question(i)}]);
                (messages, i, false)
            }
        };
        let mut body = serde_json::json!({
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
        });
        if stream {
            body["stream"] = true.into();
        }
        Ok(Turn {
            body: Bytes::from(serde_json::to_vec(&body)?),
            session: format!("conversation-{session}"),
            next,
        })
    }

    /// Keeps the answer of first turn `i` (its whole response body) for its next turn.
    pub fn answered(&self, i: u64, body: &[u8], stream: bool) {
        if let Some(answer) = answer_text(body, stream) {
            self.lock().insert(i, answer);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, String>> {
        self.answers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The first choice's text of a chat completion, streamed (SSE chunks) or not.
fn answer_text(body: &[u8], stream: bool) -> Option<String> {
    let content = |v: &serde_json::Value, field: &str| {
        v["choices"][0][field]["content"]
            .as_str()
            .map(str::to_string)
    };
    if !stream {
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        return content(&v, "message");
    }
    let text = std::str::from_utf8(body).ok()?;
    let answer: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| content(&v, "delta"))
        .collect();
    (!answer.is_empty()).then_some(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_next_turn_carries_its_first_turns_question_and_answer() {
        let turns = Turns::new(200.0);
        let request = |i| turns.request("m", 4, false, "the ", i).unwrap();
        assert_eq!(turns.lag, 10);
        let first = request(4);
        assert!(!first.next);
        assert_eq!(first.session, "conversation-4");
        turns.answered(
            4,
            br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"and \"so\""}}]}"#,
            false,
        );
        let next = request(15);
        assert!(next.next);
        assert_eq!(next.session, "conversation-4");
        let body: serde_json::Value = serde_json::from_slice(&next.body).unwrap();
        let first_body: serde_json::Value = serde_json::from_slice(&first.body).unwrap();
        assert_eq!(body["messages"][0], first_body["messages"][0]);
        assert_eq!(body["messages"][1]["content"], "and \"so\"");
        assert_eq!(body["messages"][2]["role"], "user");
        // Used once; a next turn without its answer opens a conversation of its own.
        let again = request(15);
        assert!(!again.next);
        assert_eq!(turns.without_answer.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_streamed_answer_is_read_from_its_chunks() {
        let body = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n\
                    data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"the \"}}]}\n\n\
                    data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"end\"}}]}\n\n\
                    data: [DONE]\n\n";
        assert_eq!(
            answer_text(body.as_bytes(), true).as_deref(),
            Some("the end")
        );
        assert_eq!(answer_text(b"not json", false), None);
    }
}
