//! The emulator's vocabulary as a Hugging Face `tokenizer.json`, so a router can tokenize
//! prompts the way the emulator does (`switchyard engine --write-tokenizer FILE`).
//!
//! The emulator's tokenizer cuts text into 4-byte chunks whose ids are the chunks' bytes; no
//! vocabulary file can hold every chunk, so this one holds the 64 words generated output is
//! made of (each 4 bytes): a prompt written in those words tokenizes to the same ids here and
//! in the emulator. Anything else maps to `[UNK]` (id 0, which the emulator never produces
//! for text without NUL bytes), so a router can tell it cannot reproduce the ids.

use serde_json::{json, Map, Value};

/// Id of the unknown-chunk token: the emulator's id of four NUL bytes, never a real chunk.
pub const UNK_ID: u32 = 0;

/// The tokenizer.json text: a WordLevel model over the vocabulary, text split into 4-character
/// pieces (one per 4-byte chunk for ASCII text).
pub fn tokenizer_json() -> String {
    let mut vocab = Map::new();
    vocab.insert("[UNK]".into(), json!(UNK_ID));
    for (word, id) in switchyard_engine::tokenizer::vocabulary() {
        vocab.insert(word.into(), json!(id));
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
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
