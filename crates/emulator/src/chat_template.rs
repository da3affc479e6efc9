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
