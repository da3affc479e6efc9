//! Prompt tokenization for exact prefix matching (`--tokenizer MODEL=PATH/tokenizer.json`):
//! a text prompt is turned into the engine's token ids in the prepare step, outside the router
//! lock, so backends that publish KV events are matched exactly for text prompts too.
//!
//! Hugging Face `tokenizer.json` files, loaded from disk (nothing is downloaded). Only
//! `/v1/completions` text prompts are tokenized: a chat prompt goes through the engine's chat
//! template first, which the gateway does not reproduce.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Unknown-token names: a prompt that tokenizes to one of these would not give the engine's
/// ids, so it is left to the approximate index.
const UNKNOWN: [&str; 2] = ["[UNK]", "<unk>"];

/// A tokenizer that could not be loaded.
#[derive(Debug, Error)]
#[error("tokenizer for `{model}` ({}): {reason}", path.display())]
pub struct TokenizerError {
    /// The model it was given for.
    pub model: String,
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    pub reason: String,
}

/// One tokenizer and its unknown-token ids.
struct Loaded {
    tokenizer: tokenizers::Tokenizer,
    unknown: Vec<u32>,
}

/// Tokenizers by served base model.
#[derive(Default)]
pub struct Tokenizers {
    by_model: HashMap<String, Loaded>,
}

impl Tokenizers {
    /// Loads every `model -> tokenizer.json` of the settings.
    pub fn load(files: &BTreeMap<String, PathBuf>) -> Result<Self, TokenizerError> {
        let mut by_model = HashMap::new();
        for (model, path) in files {
            by_model.insert(model.clone(), load_one(model, path)?);
        }
        Ok(Tokenizers { by_model })
    }

    /// Whether any tokenizer is configured.
    pub fn is_empty(&self) -> bool {
        self.by_model.is_empty()
    }

    /// The token ids of `text` for `model` as its engine would see them (special tokens
    /// included); none without a tokenizer for it, or when part of the text is unknown to it.
    pub fn token_ids(&self, model: &str, text: &str) -> Option<Vec<u32>> {
        let loaded = self.by_model.get(model)?;
        let encoding = loaded.tokenizer.encode(text, true).ok()?;
        let ids = encoding.get_ids();
        if ids.is_empty() || ids.iter().any(|id| loaded.unknown.contains(id)) {
            return None;
        }
        Some(ids.to_vec())
    }
}

fn load_one(model: &str, path: &Path) -> Result<Loaded, TokenizerError> {
    let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError {
        model: model.to_string(),
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let unknown = UNKNOWN
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .collect();
    Ok(Loaded { tokenizer, unknown })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use switchyard_engine::tokenizer::{encode, vocabulary};

    fn emulators() -> Tokenizers {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, switchyard_emulator::tokenizer_json::tokenizer_json()).unwrap();
        Tokenizers::load(&BTreeMap::from([("m".to_string(), path)])).unwrap()
    }

    proptest! {
        #[test]
        fn the_emulators_tokenizer_json_gives_the_emulators_ids(words in proptest::collection::vec(0usize..64, 1..200)) {
            let vocab: Vec<&str> = vocabulary().map(|(w, _)| w).collect();
            let text: String = words.iter().map(|&i| vocab[i]).collect();
            let t = emulators();
            prop_assert_eq!(t.token_ids("m", &text), Some(encode(&text)));
        }
    }

    #[test]
    fn unknown_text_models_and_files_give_no_ids() {
        let t = emulators();
        assert_eq!(
            t.token_ids("m", " the zebra"),
            None,
            "not in the vocabulary"
        );
        assert_eq!(t.token_ids("other", " the"), None, "no tokenizer");
        assert_eq!(t.token_ids("m", ""), None);
        let e = Tokenizers::load(&BTreeMap::from([(
            "m".to_string(),
            PathBuf::from("/nonexistent/tokenizer.json"),
        )]))
        .err()
        .unwrap();
        assert!(e.to_string().contains("tokenizer for `m`"), "{e}");
    }
}
