//! The fixed chat template of the emulated model.
//!
//! Real servers render messages with the model's Jinja template; the emulator
//! uses one documented template so that routers hashing the rendered text and
//! the engine's prefix cache see the same stable prefixes:
//!
//! ```text
//! <|role|>\n{content}<|end|>\n      for every message, in order
//! <|assistant|>\n                    generation prompt, always appended
//! ```
//!
//! For example `[{"role":"user","content":"Hi"}]` renders as
//! `"<|user|>\nHi<|end|>\n<|assistant|>\n"`.

use crate::openai::ChatMessage;
use switchyard_engine::tokenizer;

/// The template's markers, tokenized as special tokens with `--special-tokens`: one token
/// each, the text between them tokenized on its own (as a chat model's tokenizer cuts a
/// prompt at its special tokens before anything else).
pub const SPECIAL_TOKENS: [&str; 6] = [
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|developer|>",
    "<|end|>",
];

/// The id of [`SPECIAL_TOKENS`]`[k]`: a first byte of zero, which no chunk of text without NUL
/// bytes has, so it is never a text token's id.
pub fn special_token_id(k: usize) -> u32 {
    (k as u32 + 1) << 8
}

/// The prompt's token ids: the emulator's 4-byte chunks, and with `special_tokens` the
/// template's markers as one token each, the text between them chunked from its own start.
pub fn encode(text: &str, special_tokens: bool) -> Vec<u32> {
    if !special_tokens {
        return tokenizer::encode(text);
    }
    let mut ids = Vec::with_capacity(tokenizer::count(text));
    let mut piece_start = 0;
    let mut from = 0;
    while let Some(found) = text[from..].find("<|") {
        let at = from + found;
        match SPECIAL_TOKENS
            .iter()
            .position(|t| text[at..].starts_with(t))
        {
            Some(k) => {
                ids.extend(tokenizer::encode(&text[piece_start..at]));
                ids.push(special_token_id(k));
                piece_start = at + SPECIAL_TOKENS[k].len();
                from = piece_start;
            }
            None => from = at + 2,
        }
    }
    ids.extend(tokenizer::encode(&text[piece_start..]));
    ids
}

/// Render a conversation to the prompt text the tokenizer sees.
pub fn render(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str("<|");
        out.push_str(&m.role);
        out.push_str("|>\n");
        if let Some(c) = &m.content {
            out.push_str(&c.text());
        }
        out.push_str("<|end|>\n");
    }
    out.push_str("<|assistant|>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::MessageContent;

    #[test]
    fn special_tokens_cut_the_prompt_into_pieces_chunked_on_their_own() {
        let text = "<|user|>\nHi there<|end|>\n<|x|><|assistant|>\n";
        assert_eq!(encode(text, false), tokenizer::encode(text));
        let mut expected = vec![special_token_id(1)];
        expected.extend(tokenizer::encode("\nHi there"));
        expected.push(special_token_id(5));
        expected.extend(tokenizer::encode("\n<|x|>"));
        expected.push(special_token_id(2));
        expected.extend(tokenizer::encode("\n"));
        assert_eq!(encode(text, true), expected);
        // No chunk of text has a marker's id.
        for k in 0..SPECIAL_TOKENS.len() {
            assert_eq!(special_token_id(k).to_le_bytes()[0], 0);
        }
    }

    #[test]
    fn renders_roles_in_order() {
        let msgs = vec![
            ChatMessage {
                role: "system".into(),
                content: Some(MessageContent::Text("S".into())),
            },
            ChatMessage {
                role: "user".into(),
                content: Some(MessageContent::Text("Hi".into())),
            },
        ];
        assert_eq!(
            render(&msgs),
            "<|system|>\nS<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
        );
    }

    #[test]
    fn shared_prefix_is_stable() {
        let a = vec![ChatMessage {
            role: "user".into(),
            content: Some(MessageContent::Text("same".into())),
        }];
        let mut b = a.clone();
        b.push(ChatMessage {
            role: "assistant".into(),
            content: None,
        });
        assert!(render(&b).starts_with(&render(&a)[..render(&a).len() - "<|assistant|>\n".len()]));
    }
}
