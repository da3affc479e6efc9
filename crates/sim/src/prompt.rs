//! Turning a workload request into what the engine and the router see.
//!
//! The engine gets token ids (the project's tokenizer: one token per 4 bytes of the rendered
//! prompt); the router gets the prompt as borrowed pieces, without copying the shared text.

use std::sync::Arc;

use switchyard_core::{ChatMessage as CoreMessage, Prompt as CorePrompt};
use switchyard_engine::tokenizer::BYTES_PER_TOKEN;
use switchyard_workload::{Prompt, Request};

/// Token ids of the rendered prompt, exactly as `tokenizer::encode` of the concatenated
/// segments, but streamed across segment boundaries without building the string.
pub fn encode_request(request: &Request) -> Arc<[u32]> {
    let bytes: usize = request.prompt.segments().map(str::len).sum();
    let mut out = Vec::with_capacity(bytes.div_ceil(BYTES_PER_TOKEN));
    let mut carry = [0u8; BYTES_PER_TOKEN];
    let mut held = 0;
    for segment in request.prompt.segments() {
        let mut rest = segment.as_bytes();
        if held > 0 {
            let take = (BYTES_PER_TOKEN - held).min(rest.len());
            carry[held..held + take].copy_from_slice(&rest[..take]);
            held += take;
            rest = &rest[take..];
            if held < BYTES_PER_TOKEN {
                continue;
            }
            out.push(u32::from_le_bytes(carry));
        }
        let mut chunks = rest.chunks_exact(BYTES_PER_TOKEN);
        for c in &mut chunks {
            out.push(u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        }
        let tail = chunks.remainder();
        carry[..tail.len()].copy_from_slice(tail);
        held = tail.len();
    }
    if held > 0 {
        carry[held..].fill(0);
        out.push(u32::from_le_bytes(carry));
    }
    out.into()
}

/// Borrowed pieces of a request's prompt for [`router_prompt`].
pub enum Pieces<'a> {
    /// Text segments.
    Text(Vec<&'a str>),
    /// Chat messages.
    Chat(Vec<CoreMessage<'a>>),
}

impl<'a> Pieces<'a> {
    /// Borrows the prompt of `request`.
    pub fn of(request: &'a Request) -> Pieces<'a> {
        match &request.prompt {
            Prompt::Text(segments) => Pieces::Text(segments.iter().map(|s| &**s).collect()),
            Prompt::Chat(messages) => Pieces::Chat(
                messages
                    .iter()
                    .map(|m| CoreMessage {
                        role: m.role.as_str(),
                        content: &m.content,
                    })
                    .collect(),
            ),
        }
    }

    /// The prompt as the router takes it.
    pub fn router_prompt(&self) -> CorePrompt<'_> {
        match self {
            Pieces::Text(pieces) => CorePrompt::Pieces(pieces),
            Pieces::Chat(messages) => CorePrompt::Chat(messages),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_engine::tokenizer;
    use switchyard_workload::{ChatMessage, Role};

    fn request(prompt: Prompt) -> Request {
        Request {
            id: 0,
            arrival_s: 0.0,
            model: Arc::from("m"),
            adapter: None,
            prompt,
            max_tokens: 1,
            session_id: None,
            cache_salt: None,
        }
    }

    #[test]
    fn streaming_encode_matches_the_tokenizer_across_odd_boundaries() {
        let parts = ["ab", "cdefg", "", "h", "ijklmnop", "q"];
        let r = request(Prompt::Text(parts.iter().map(|&s| Arc::from(s)).collect()));
        assert_eq!(
            &*encode_request(&r),
            tokenizer::encode(&parts.concat()).as_slice()
        );
        let chat = request(Prompt::Chat(vec![
            ChatMessage {
                role: Role::System,
                content: Arc::from("be brief"),
            },
            ChatMessage {
                role: Role::User,
                content: Arc::from("hello!"),
            },
        ]));
        assert_eq!(
            &*encode_request(&chat),
            tokenizer::encode(&chat.prompt.render()).as_slice()
        );
    }

    #[test]
    fn router_pieces_render_the_same_text() {
        let r = request(Prompt::Text(vec![Arc::from("abc "), Arc::from("def ")]));
        let pieces = Pieces::of(&r);
        assert_eq!(pieces.router_prompt().rendered_len(), 8);
    }
}
