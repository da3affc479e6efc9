//! The request type every workload produces.
//!
//! Prompts are sequences of shared `Arc<str>` segments: a million requests
//! that share a 2k-token system prompt hold one copy of it, and each request
//! only owns what is private to it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::text::text_tokens;

/// Who wrote a chat message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Instructions fixed by the application.
    System,
    /// The end user.
    User,
    /// The model's earlier answers.
    Assistant,
}

impl Role {
    /// The OpenAI role name (`"system"`, `"user"`, `"assistant"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    /// The marker [`Prompt::segments`] puts before a message of this role.
    ///
    /// This is a plain, model-independent rendering for consumers that need
    /// one string (e.g. a completions endpoint). The router's canonical chat
    /// rendering for prefix hashing is its own business and should work from
    /// [`Prompt::messages`].
    pub fn marker(self) -> &'static str {
        match self {
            Role::System => "<|system|>\n",
            Role::User => "<|user|>\n",
            Role::Assistant => "<|assistant|>\n",
        }
    }
}

/// One chat message; its content is shared with every request that repeats it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: Role,
    /// What it says.
    pub content: Arc<str>,
}

/// A prompt: plain text, or a chat conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prompt {
    /// Completion-style text: the concatenation of the segments, in order.
    Text(Vec<Arc<str>>),
    /// Chat-style messages, oldest first.
    Chat(Vec<ChatMessage>),
}

impl Prompt {
    /// Prompt length in tokens under the 4-bytes-a-token convention.
    ///
    /// Text: tokens of the concatenated text. Chat: the sum of each message's
    /// content tokens; role markers and any chat-template overhead the engine
    /// adds are *not* counted, because they depend on the model's template.
    pub fn tokens(&self) -> usize {
        match self {
            Prompt::Text(segs) => text_tokens(segs.iter().map(|s| s.len()).sum()),
            Prompt::Chat(msgs) => msgs.iter().map(|m| text_tokens(m.content.len())).sum(),
        }
    }

    /// The pieces of the prompt in order, without copying.
    ///
    /// Text: the segments. Chat: for each message its [`Role::marker`], then
    /// its content.
    pub fn segments(&self) -> Segments<'_> {
        match self {
            Prompt::Text(segs) => Segments::Text(segs.iter()),
            Prompt::Chat(msgs) => Segments::Chat {
                msgs: msgs.iter(),
                pending: None,
            },
        }
    }

    /// The chat messages, if this is a chat prompt.
    pub fn messages(&self) -> Option<&[ChatMessage]> {
        match self {
            Prompt::Text(_) => None,
            Prompt::Chat(m) => Some(m),
        }
    }

    /// Concatenation of [`Prompt::segments`] into one new string (allocates).
    pub fn render(&self) -> String {
        let mut s = String::with_capacity(self.segments().map(str::len).sum());
        self.segments().for_each(|p| s.push_str(p));
        s
    }
}

/// Iterator over a prompt's pieces; see [`Prompt::segments`].
#[derive(Clone, Debug)]
pub enum Segments<'a> {
    /// Over text segments.
    Text(std::slice::Iter<'a, Arc<str>>),
    /// Over chat messages, yielding marker then content.
    Chat {
        /// Messages not yet started.
        msgs: std::slice::Iter<'a, ChatMessage>,
        /// Content still owed after a marker was yielded.
        pending: Option<&'a str>,
    },
}

impl<'a> Iterator for Segments<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        match self {
            Segments::Text(it) => it.next().map(|s| &**s),
            Segments::Chat { msgs, pending } => {
                if let Some(c) = pending.take() {
                    return Some(c);
                }
                let m = msgs.next()?;
                *pending = Some(&m.content);
                Some(m.role.marker())
            }
        }
    }
}

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Position in the workload, from 0.
    pub id: u64,
    /// Arrival time in seconds from the start of the run.
    pub arrival_s: f64,
    /// Base model name.
    pub model: Arc<str>,
    /// LoRA adapter to serve it with; `None` means the base model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<Arc<str>>,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Conversation this request belongs to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<Arc<str>>,
    /// Per-tenant salt for prefix-cache isolation (vLLM's `cache_salt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<Arc<str>>,
}

impl Request {
    /// Prompt length in tokens (see [`Prompt::tokens`]); no allocation.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt.tokens()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat() -> Prompt {
        Prompt::Chat(vec![
            ChatMessage {
                role: Role::System,
                content: Arc::from("abc abc "),
            },
            ChatMessage {
                role: Role::User,
                content: Arc::from("xyz"),
            },
        ])
    }

    #[test]
    fn text_tokens_and_segments() {
        let p = Prompt::Text(vec![Arc::from("abc "), Arc::from("def ghi ")]);
        assert_eq!(p.tokens(), 3);
        assert_eq!(p.segments().collect::<Vec<_>>(), ["abc ", "def ghi "]);
        assert_eq!(p.render(), "abc def ghi ");
        assert!(p.messages().is_none());
    }

    #[test]
    fn chat_counts_contents_only() {
        let p = chat();
        // 2 + ceil(3/4) = 3: markers are not counted.
        assert_eq!(p.tokens(), 3);
        assert_eq!(
            p.segments().collect::<Vec<_>>(),
            ["<|system|>\n", "abc abc ", "<|user|>\n", "xyz"]
        );
        assert_eq!(p.messages().map(<[_]>::len), Some(2));
    }

    #[test]
    fn serde_shape() {
        let r = Request {
            id: 3,
            arrival_s: 1.5,
            model: Arc::from("m"),
            adapter: None,
            prompt: chat(),
            max_tokens: 7,
            session_id: Some(Arc::from("s")),
            cache_salt: None,
        };
        let j = serde_json::to_string(&r).unwrap();
        assert_eq!(
            j,
            r#"{"id":3,"arrival_s":1.5,"model":"m","prompt":{"chat":[{"role":"system","content":"abc abc "},{"role":"user","content":"xyz"}]},"max_tokens":7,"session_id":"s"}"#
        );
        let back: Request = serde_json::from_str(&j).unwrap();
        assert_eq!(back, r);
    }
}
