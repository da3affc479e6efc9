//! The emulator's vocabulary as a Hugging Face `tokenizer.json`, so a router can tokenize
//! prompts the way the emulator does (`switchyard engine --write-tokenizer FILE`).
//!
//! The emulator's tokenizer cuts text into 4-byte chunks whose ids are the chunks' bytes; no
//! vocabulary file can hold every chunk, so this one holds every chunk of text made of the 64
//! words generated output is made of (each 4 bytes) and of the chat template's markers
//! ([`crate::chat_template`], for the roles in [`CHAT_ROLES`]), at any alignment: a prompt
//! written in those words, sent whole or as chat messages, tokenizes to the same ids here and
//! in the emulator. Anything else maps to `[UNK]` (id 0, which the emulator never produces
//! for text without NUL bytes), so a router can tell it cannot reproduce the ids.
//!
//! [`tokenizer_config_json`] is the matching `tokenizer_config.json`: the emulator's chat
//! template in Jinja, as a Hugging Face model directory carries it.

use serde_json::{json, Map, Value};

/// Id of the unknown-chunk token: the emulator's id of four NUL bytes, never a real chunk.
pub const UNK_ID: u32 = 0;

/// The tokenizer.json text: a WordLevel model over the vocabulary, text split into 4-character
/// pieces (one per 4-byte chunk for ASCII text).
pub fn tokenizer_json() -> String {
    tokenizer_json_for(false)
}

/// [`tokenizer_json`], with the chat template's markers as added (special) tokens when the
/// emulator runs with `--special-tokens` ([`crate::chat_template::SPECIAL_TOKENS`]): a
/// tokenizer cuts the text at them before splitting it into 4-character pieces, as the
/// emulator does then.
pub fn tokenizer_json_for(special_tokens: bool) -> String {
    let added: Vec<Value> = if special_tokens {
        crate::chat_template::SPECIAL_TOKENS
            .iter()
            .enumerate()
            .map(|(k, content)| {
                json!({"id": crate::chat_template::special_token_id(k), "content": content,
                    "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": true})
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut vocab = Map::new();
    vocab.insert("[UNK]".into(), json!(UNK_ID));
    for piece in pieces() {
        let id = switchyard_engine::tokenizer::encode(&piece)[0];
        vocab.insert(piece, json!(id));
    }
    if special_tokens {
        // An added token takes its id from the model's vocabulary when it is there (else the
        // next free one, whatever the file says); the 4-character split never yields one.
        for (k, content) in crate::chat_template::SPECIAL_TOKENS.iter().enumerate() {
            let id = crate::chat_template::special_token_id(k);
            vocab.insert(content.to_string(), json!(id));
        }
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": "(?s).{1,4}"},
            "behavior": "Isolated",
            "invert": false
        },
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": Value::Object(vocab), "unk_token": "[UNK]"}
    });
    // A JSON value always serialises.
    serde_json::to_string_pretty(&tokenizer).unwrap_or_default()
}

/// Roles whose chat markers the vocabulary covers.
pub const CHAT_ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// Every chunk the emulator can cut from text made of vocabulary words and chat markers: each
/// item is at least 4 bytes, so a 4-byte chunk spans at most two neighbours, and the last,
/// shorter chunk lies in the last item.
fn pieces() -> std::collections::BTreeSet<String> {
    let mut items: Vec<String> = switchyard_engine::tokenizer::vocabulary()
        .map(|(w, _)| w.to_string())
        .collect();
    items.extend(CHAT_ROLES.iter().map(|r| format!("<|{r}|>\n")));
    items.push("<|end|>\n".to_string());
    let mut out = std::collections::BTreeSet::new();
    for x in &items {
        for n in 1..4 {
            out.insert(x[x.len() - n..].to_string());
        }
        for y in &items {
            let pair = format!("{x}{y}");
            for i in 0..=pair.len() - 4 {
                out.insert(pair[i..i + 4].to_string());
            }
        }
    }
    out
}

/// The `tokenizer_config.json` text: [`crate::chat_template`] as a Jinja chat template (with
/// the generation prompt the emulator always appends).
pub fn tokenizer_config_json() -> String {
    let template = "{% for message in messages %}<|{{ message['role'] }}|>\n\
                    {{ message['content'] }}<|end|>\n{% endfor %}\
                    {% if add_generation_prompt %}<|assistant|>\n{% endif %}";
    let config = json!({
        "chat_template": template,
        "bos_token": null,
        "eos_token": null,
        "tokenizer_class": "PreTrainedTokenizerFast"
    });
    // A JSON value always serialises.
    serde_json::to_string_pretty(&config).unwrap_or_default()
}
