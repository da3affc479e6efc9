//! What the router needs to know about one request: only the fields routing uses.

use serde::{Deserialize, Serialize};

/// Caller-chosen identifier of one request, unique among requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// One chat message as the router sees it (role and text content).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatMessage<'a> {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: &'a str,
    /// The message text (multi-part contents are concatenated by the caller).
    pub content: &'a str,
}

/// The prompt, borrowed from wherever the caller keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// A completion prompt.
    Text(&'a str),
    /// A completion prompt given as consecutive pieces (the simulator shares pieces between requests).
    Pieces(&'a [&'a str]),
    /// Chat messages; rendered canonically so that a conversation's rendering is a
    /// prefix of the rendering of any continuation of it.
    Chat(&'a [ChatMessage<'a>]),
}

impl Prompt<'_> {
    /// Calls `f` with the canonical byte rendering of the prompt, piece by piece.
    pub fn for_each_piece(&self, mut f: impl FnMut(&[u8])) {
        match self {
            Prompt::Text(text) => f(text.as_bytes()),
            Prompt::Pieces(pieces) => pieces.iter().for_each(|p| f(p.as_bytes())),
            Prompt::Chat(messages) => {
                for message in messages.iter() {
                    f(b"<|");
                    f(message.role.as_bytes());
                    f(b"|>");
                    f(message.content.as_bytes());
                    f(b"<|end|>\n");
                }
            }
        }
    }

    /// Length in bytes of the canonical rendering.
    pub fn rendered_len(&self) -> usize {
        let mut len = 0;
        self.for_each_piece(|piece| len += piece.len());
        len
    }
}

/// Which part of the work a request asks for, for disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Let the router decide: one instance doing both, or a prefill/decode pair.
    #[default]
    Any,
    /// Prefill and decode on one instance (never split).
    Unified,
}

/// What a request asks of the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RequestKind {
    /// Completions and chat: a prefill, then decoding.
    #[default]
    Generate,
    /// Embeddings: one pass over the input and no decoding. Embedding engines keep no prompt
    /// cache to reuse, so such a request is placed by load alone (no prefix index, never
    /// split into prefill and decode), with every exclusion of health, role, model and
    /// saturation as for any other request.
    Embed,
}

/// A request as presented to [`crate::Router::route`].
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// Served model name asked for (the base model, or an adapter name resolved by the caller).
    pub model: &'a str,
    /// LoRA adapter the request needs, if any.
    pub adapter: Option<&'a str>,
    /// The prompt.
    pub prompt: Prompt<'a>,
    /// Generation budget, used to estimate KV growth and decode load.
    pub max_tokens: u32,
    /// Cache isolation salt (vLLM `cache_salt`): requests with different salts never share cache.
    pub cache_salt: Option<&'a str>,
    /// Sticky-session key, if the client gave one.
    pub session_id: Option<&'a str>,
    /// Disaggregation preference.
    pub phase: Phase,
    /// The prompt's token ids, when the caller has them: enables exact matching against
    /// instances that publish KV events.
    pub token_ids: Option<&'a [u32]>,
    /// Generation or embedding.
    pub kind: RequestKind,
}

impl<'a> RouteRequest<'a> {
    /// A request for `model` with a plain text prompt and defaults elsewhere.
    pub fn text(model: &'a str, prompt: &'a str) -> Self {
        RouteRequest {
            model,
            adapter: None,
            prompt: Prompt::Text(prompt),
            max_tokens: 128,
            cache_salt: None,
            session_id: None,
            phase: Phase::Any,
            token_ids: None,
            kind: RequestKind::Generate,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(prompt: Prompt<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        prompt.for_each_piece(|p| out.extend_from_slice(p));
        out
    }

    #[test]
    fn chat_rendering_of_a_conversation_prefixes_its_continuation() {
        let first = [
            ChatMessage {
                role: "system",
                content: "be brief",
            },
            ChatMessage {
                role: "user",
                content: "hi",
            },
        ];
        let longer = [
            first[0],
            first[1],
            ChatMessage {
                role: "assistant",
                content: "hello",
            },
            ChatMessage {
                role: "user",
                content: "more",
            },
        ];
        let a = rendered(Prompt::Chat(&first));
        let b = rendered(Prompt::Chat(&longer));
        assert!(b.starts_with(&a));
        assert_eq!(Prompt::Chat(&first).rendered_len(), a.len());
    }

    #[test]
    fn roles_are_part_of_the_rendering() {
        let a = [ChatMessage {
            role: "user",
            content: "x",
        }];
        let b = [ChatMessage {
            role: "system",
            content: "x",
        }];
        assert_ne!(rendered(Prompt::Chat(&a)), rendered(Prompt::Chat(&b)));
    }

    #[test]
    fn pieces_render_like_the_joined_text() {
        let pieces = ["abc", "", "defg"];
        assert_eq!(rendered(Prompt::Pieces(&pieces)), b"abcdefg");
        assert_eq!(rendered(Prompt::Text("abcdefg")), b"abcdefg");
    }
}
