//! Prompt tokenization for exact prefix matching (`--tokenizer MODEL=PATH/tokenizer.json`):
//! a text prompt is turned into the engine's token ids in the prepare step, outside the router
//! lock, so backends that publish KV events are matched exactly for text prompts too.
//!
//! Hugging Face `tokenizer.json` files, loaded from disk (nothing is downloaded). Chat messages
//! are tokenized too when a `tokenizer_config.json` with a `chat_template` sits beside the
//! `tokenizer.json` (as in every Hugging Face model directory): the messages are rendered with
//! that Jinja template as `transformers`' `apply_chat_template` and vLLM render them
//! (`add_generation_prompt`, `bos_token` / `eos_token`, `trim_blocks` and `lstrip_blocks`),
//! then tokenized without adding special tokens (the template writes them). A template the
//! renderer cannot run leaves the request to the approximate index.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use thiserror::Error;

mod continued;
mod pieces;

pub use pieces::Needed;

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
    /// From `tokenizer_config.json` beside it, when it has a chat template.
    chat: Option<ChatTemplate>,
    /// Piece-by-piece tokenizing with cached pieces, when the tokenizer's pieces are
    /// independent.
    pieces: Option<pieces::PieceTokenizer>,
}

/// A model's chat template, compiled, with the special tokens it may write.
struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// The template's name in its environment.
const CHAT: &str = "chat";

/// What `tokenizer_config.json` says about chat.
#[derive(serde::Deserialize)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<TemplateField>,
    #[serde(default)]
    bos_token: Option<TokenField>,
    #[serde(default)]
    eos_token: Option<TokenField>,
}

/// `chat_template`: one template, or named ones (the `default` is the chat template).
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(serde::Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// A special token: its text, or an added-token object with `content`.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum TokenField {
    Text(String),
    Added { content: String },
}

impl TokenField {
    fn text(self) -> String {
        match self {
            TokenField::Text(t) | TokenField::Added { content: t } => t,
        }
    }
}

impl ChatTemplate {
    /// The template of `config` (a `tokenizer_config.json` text), compiled; none without one.
    fn from_config(text: &str) -> Result<Option<ChatTemplate>, String> {
        let config: TokenizerConfig =
            serde_json::from_str(text).map_err(|e| format!("tokenizer_config.json: {e}"))?;
        let source = match config.chat_template {
            None => return Ok(None),
            Some(TemplateField::One(t)) => t,
            Some(TemplateField::Named(named)) => {
                match named.into_iter().find(|t| t.name == "default") {
                    Some(t) => t.template,
                    None => return Ok(None),
                }
            }
        };
        let mut env = minijinja::Environment::new();
        // As transformers compiles chat templates (jinja2 with these two and no trailing
        // newline kept).
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| format!("chat template: {e}"))?;
        env.set_syntax(syntax);
        // `.strip()`, `.startswith()`, `.items()` and the other Python methods templates use.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        env.add_template_owned(CHAT, source)
            .map_err(|e| format!("chat template: {e}"))?;
        Ok(Some(ChatTemplate {
            env,
            bos_token: config.bos_token.map(TokenField::text).unwrap_or_default(),
            eos_token: config.eos_token.map(TokenField::text).unwrap_or_default(),
        }))
    }

    /// The prompt text the engine makes of `messages` (role, content), with the generation
    /// prompt; none when the template fails on them.
    fn render(&self, messages: &[(&str, &str)]) -> Option<String> {
        self.render_with(messages, true)
    }

    /// As [`ChatTemplate::render`], with or without the generation prompt (a conversation
    /// whose last message is the answer, as its next turn renders it).
    fn render_with(&self, messages: &[(&str, &str)], generation_prompt: bool) -> Option<String> {
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .map(|(role, content)| minijinja::context! { role => *role, content => *content })
            .collect();
        let template = self.env.get_template(CHAT).ok()?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .ok()
    }
}

/// Bytes of tokenized prompt pieces a tokenizer keeps by default (`--tokenizer-cache-mib`).
pub use pieces::CACHE_BYTES as DEFAULT_CACHE_BYTES;

/// Tokenizers by served base model (cheap to clone: shared).
#[derive(Default, Clone)]
pub struct Tokenizers {
    by_model: std::sync::Arc<HashMap<String, Loaded>>,
}

/// Why a prompt got no token ids (it is then matched on the approximate index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Miss {
    /// No `--tokenizer` for the request's model.
    NoTokenizer,
    /// Chat messages for a model without a chat template (`tokenizer_config.json`).
    NoTemplate,
    /// The chat template failed on the messages (it raised, or used what the renderer lacks).
    TemplateFailed,
    /// Text the tokenizer does not know (an unknown token), or none at all.
    Unknown,
}

impl Miss {
    /// The metric label (`switchyard_tokenized_prompts_total{result}`).
    pub fn label(self) -> &'static str {
        match self {
            Miss::NoTokenizer => "no_tokenizer",
            Miss::NoTemplate => "no_template",
            Miss::TemplateFailed => "template_failed",
            Miss::Unknown => "unknown",
        }
    }
}

/// A prompt as the tokenizer takes it: chat messages (role, content) or one text.
#[derive(Debug, Clone, PartialEq)]
pub enum Input<S> {
    /// Chat messages, rendered with the model's chat template.
    Chat(Vec<(S, S)>),
    /// One text prompt (`/v1/completions`).
    Text(S),
}

impl<S: AsRef<str>> Input<S> {
    /// Bytes of text to tokenize.
    pub fn bytes(&self) -> usize {
        match self {
            Input::Chat(messages) => messages
                .iter()
                .map(|(r, c)| r.as_ref().len() + c.as_ref().len())
                .sum(),
            Input::Text(t) => t.as_ref().len(),
        }
    }

    /// The same input owning its text (to tokenize on another thread).
    pub fn to_owned_input(&self) -> Input<String> {
        match self {
            Input::Chat(messages) => Input::Chat(
                messages
                    .iter()
                    .map(|(r, c)| (r.as_ref().to_string(), c.as_ref().to_string()))
                    .collect(),
            ),
            Input::Text(t) => Input::Text(t.as_ref().to_string()),
        }
    }
}

impl Tokenizers {
    /// Loads every `model -> tokenizer.json` of the settings.
    pub fn load(files: &BTreeMap<String, PathBuf>) -> Result<Self, TokenizerError> {
        Self::load_with_cache(files, DEFAULT_CACHE_BYTES)
    }

    /// As [`Tokenizers::load`], keeping up to `cache_bytes` of tokenized prompt pieces per
    /// tokenizer (0 keeps none: every prompt is tokenized in full, as the first time).
    pub fn load_with_cache(
        files: &BTreeMap<String, PathBuf>,
        cache_bytes: usize,
    ) -> Result<Self, TokenizerError> {
        let mut by_model = HashMap::new();
        for (model, path) in files {
            by_model.insert(model.clone(), load_one(model, path, cache_bytes)?);
        }
        Ok(Tokenizers {
            by_model: std::sync::Arc::new(by_model),
        })
    }

    /// Whether any tokenizer is configured.
    pub fn is_empty(&self) -> bool {
        self.by_model.is_empty()
    }

    /// The token ids of `text` for `model` as its engine would see them (special tokens
    /// included); none without a tokenizer for it, or when part of the text is unknown to it.
    pub fn token_ids(&self, model: &str, text: &str) -> Option<Vec<u32>> {
        self.ids(model, &Input::Text(text)).ok()
    }

    /// The token ids of chat `messages` (role, content) for `model`: rendered with its chat
    /// template, then tokenized; none without a tokenizer and template for it, or when the
    /// template fails or part of the text is unknown to the tokenizer.
    pub fn chat_token_ids(&self, model: &str, messages: &[(&str, &str)]) -> Option<Vec<u32>> {
        self.ids(model, &Input::Chat(messages.to_vec())).ok()
    }

    /// The token ids of `input` for `model` ([`Tokenizers::chat_token_ids`] for messages,
    /// [`Tokenizers::token_ids`] for a text), or why there are none.
    pub fn ids<S: AsRef<str>>(&self, model: &str, input: &Input<S>) -> Result<Vec<u32>, Miss> {
        self.ids_counted(model, input, &mut 0)
    }

    /// As [`Tokenizers::ids`], adding to `fresh_bytes` the bytes of text tokenized anew (not
    /// found in the piece cache).
    pub fn ids_counted<S: AsRef<str>>(
        &self,
        model: &str,
        input: &Input<S>,
        fresh_bytes: &mut usize,
    ) -> Result<Vec<u32>, Miss> {
        let loaded = self.by_model.get(model).ok_or(Miss::NoTokenizer)?;
        let (text, special) = loaded.text_of(input)?;
        loaded
            .encode(&text, special, fresh_bytes)
            .ok_or(Miss::Unknown)
    }

    /// As [`Tokenizers::ids`], but only as far as exact matching needs: `horizon` says, for
    /// the ids so far, how many a lookup could still use (the router's
    /// `exact_horizon`), and tokenizing stops there. A new prompt then costs its first block
    /// or so, and a conversation's next turn the part of it an instance may hold, instead of
    /// the whole text; at most `budget` bytes of text not seen before are tokenized here
    /// ([`Needed::OverBudget`] beyond). `held_bytes` is where the router expects the held part
    /// of the text to end (its approximate index): the first cut of new text reaches it, so a
    /// held history is tokenized in one pass. Tokenizers without the piece cache are
    /// tokenized whole, within the same budget. The bytes tokenized anew are added to
    /// `fresh_bytes`.
    pub fn ids_as_needed<S: AsRef<str>>(
        &self,
        model: &str,
        input: &Input<S>,
        horizon: &mut dyn FnMut(&[u32]) -> usize,
        held_bytes: usize,
        budget: usize,
        fresh_bytes: &mut usize,
    ) -> Result<Needed, Miss> {
        let loaded = self.by_model.get(model).ok_or(Miss::NoTokenizer)?;
        let (text, special) = loaded.text_of(input)?;
        loaded
            .encode_as_needed(&text, special, horizon, held_bytes, budget, fresh_bytes)
            .ok_or(Miss::Unknown)
    }

    /// Whether [`Tokenizers::warm`] would do anything for a prompt of `model` (chat messages
    /// or a text): it has a piece cache (and, for chat messages, a chat template), and either
    /// the question is warmed too or the answer has pieces of its own (chat messages, a
    /// tokenizer that cuts at special tokens).
    pub fn can_warm(&self, model: &str, chat: bool, with_question: bool) -> bool {
        self.by_model.get(model).is_some_and(|l| {
            l.pieces.as_ref().is_some_and(|pieces| {
                (!chat || l.chat.is_some()) && (with_question || (chat && pieces.cuts()))
            })
        })
    }

    /// Tokenizes into the caches what the next turn of a conversation will send again and no
    /// instance's prompt has had tokenized yet, so that the turn finds it cached instead of
    /// tokenizing it on its way. `continued` is the request's prompt with the engine's answer
    /// after it: chat messages with the answer as the last, or a text prompt with the answer
    /// appended. Where the tokenizer cuts prompts at special tokens, the pieces holding the
    /// answer (and, `with_question`, the last user message) are tokenized, each looked for in
    /// the rendering from the end; where it does not (one piece a prompt), or for a text
    /// prompt, the whole is, from near the end of the prompt's kept tokens
    /// (`tokenize::continued`), and only `with_question` (one-off prompts do not pay for a
    /// whole prompt no next turn may send). Returns the bytes tokenized anew; none when the
    /// model cannot be warmed, the template fails, or the answer is not in the rendering as
    /// written (a template that edits the content).
    pub fn warm<S: AsRef<str>>(
        &self,
        model: &str,
        continued: &Input<S>,
        with_question: bool,
    ) -> Option<usize> {
        let chat = matches!(continued, Input::Chat(_));
        if !self.can_warm(model, chat, with_question) {
            return None;
        }
        let loaded = self.by_model.get(model)?;
        let pieces = loaded.pieces.as_ref()?;
        let (text, special) = match continued {
            // As the next turn renders it: no generation prompt after the answer.
            Input::Chat(messages) => {
                let messages: Vec<(&str, &str)> = messages
                    .iter()
                    .map(|(r, c)| (r.as_ref(), c.as_ref()))
                    .collect();
                (
                    loaded.chat.as_ref()?.render_with(&messages, false)?.into(),
                    false,
                )
            }
            Input::Text(_) => loaded.text_of(continued).ok()?,
        };
        let Input::Chat(messages) = continued else {
            let mut fresh = 0;
            with_question
                .then(|| pieces.encode_counted(&loaded.tokenizer, &text, special, &mut fresh))??;
            return Some(fresh);
        };
        if !pieces.cuts() {
            let mut fresh = 0;
            with_question
                .then(|| pieces.encode_counted(&loaded.tokenizer, &text, special, &mut fresh))??;
            return Some(fresh);
        }
        let answer = messages.last()?.1.as_ref();
        let question = messages
            .iter()
            .rev()
            .skip(1)
            .find(|(role, _)| with_question && role.as_ref() == "user")
            .map_or("", |(_, content)| content.as_ref());
        let mut before = text.len();
        let mut ranges = Vec::with_capacity(2);
        for part in [answer, question].into_iter().filter(|p| !p.is_empty()) {
            let at = text[..before].rfind(part)?;
            ranges.push(at..at + part.len());
            before = at;
        }
        pieces.warm(&loaded.tokenizer, &text, &ranges)
    }

    /// Whether `model` has a chat template (for the startup log).
    pub fn has_chat_template(&self, model: &str) -> bool {
        self.by_model.get(model).is_some_and(|l| l.chat.is_some())
    }
}

impl Loaded {
    /// The text the tokenizer takes of `input`, and whether the post-processor's special
    /// tokens go around it: chat messages rendered with the template (which writes the
    /// special tokens itself), a text prompt as it is.
    fn text_of<'i, S: AsRef<str>>(
        &self,
        input: &'i Input<S>,
    ) -> Result<(std::borrow::Cow<'i, str>, bool), Miss> {
        match input {
            Input::Chat(messages) => {
                let messages: Vec<(&str, &str)> = messages
                    .iter()
                    .map(|(r, c)| (r.as_ref(), c.as_ref()))
                    .collect();
                let chat = self.chat.as_ref().ok_or(Miss::NoTemplate)?;
                let text = chat.render(&messages).ok_or(Miss::TemplateFailed)?;
                Ok((text.into(), false))
            }
            Input::Text(t) => Ok((t.as_ref().into(), true)),
        }
    }

    fn encode(&self, text: &str, special: bool, fresh_bytes: &mut usize) -> Option<Vec<u32>> {
        let ids = match &self.pieces {
            Some(pieces) => pieces.encode_counted(&self.tokenizer, text, special, fresh_bytes)?,
            None => {
                *fresh_bytes += text.len();
                pieces::whole(&self.tokenizer, text, special)?
            }
        };
        if ids.is_empty() || ids.iter().any(|id| self.unknown.contains(id)) {
            return None;
        }
        Some(ids)
    }

    #[allow(clippy::too_many_arguments)]
    fn encode_as_needed(
        &self,
        text: &str,
        special: bool,
        horizon: &mut dyn FnMut(&[u32]) -> usize,
        held_bytes: usize,
        budget: usize,
        fresh_bytes: &mut usize,
    ) -> Option<Needed> {
        let needed = match &self.pieces {
            Some(pieces) => pieces.encode_as_needed(
                &self.tokenizer,
                text,
                special,
                horizon,
                held_bytes,
                budget,
                fresh_bytes,
            )?,
            None if text.len() > budget => Needed::OverBudget,
            None => {
                *fresh_bytes += text.len();
                Needed::Whole(pieces::whole(&self.tokenizer, text, special)?)
            }
        };
        let ids = match &needed {
            Needed::Whole(ids) if ids.is_empty() => return None,
            Needed::Whole(ids) | Needed::Prefix(ids, _) => ids,
            Needed::OverBudget => return Some(needed),
        };
        if ids.iter().any(|id| self.unknown.contains(id)) {
            return None;
        }
        Some(needed)
    }
}

fn load_one(model: &str, path: &Path, cache_bytes: usize) -> Result<Loaded, TokenizerError> {
    let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError {
        model: model.to_string(),
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let unknown = UNKNOWN
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .collect();
    let error = |reason: String| TokenizerError {
        model: model.to_string(),
        path: path.to_path_buf(),
        reason,
    };
    // `tokenizer_config.json` beside `tokenizer.json`: absent means no chat tokenizing; present
    // but unreadable or with a template that does not compile is an error, not a surprise later.
    let config = path.with_file_name("tokenizer_config.json");
    let chat = match std::fs::read_to_string(&config) {
        Ok(text) => ChatTemplate::from_config(&text).map_err(error)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(error(format!("{}: {e}", config.display()))),
    };
    Ok(Loaded {
        pieces: pieces::PieceTokenizer::new(&tokenizer, cache_bytes),
        tokenizer,
        unknown,
        chat,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use switchyard_engine::tokenizer::vocabulary;

    fn emulators() -> Tokenizers {
        emulators_with(false)
    }

    /// The tokenizer `switchyard engine --write-tokenizer` writes, with `--special-tokens`
    /// when `special`.
    fn emulators_with(special: bool) -> Tokenizers {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let json = switchyard_emulator::tokenizer_json::tokenizer_json_for(special);
        std::fs::write(&path, json).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            switchyard_emulator::tokenizer_json::tokenizer_config_json(),
        )
        .unwrap();
        Tokenizers::load(&BTreeMap::from([("m".to_string(), path)])).unwrap()
    }

    /// Messages as the emulator's `/v1/chat/completions` takes them.
    fn emulator_messages(
        messages: &[(&str, String)],
    ) -> Vec<switchyard_emulator::openai::ChatMessage> {
        messages
            .iter()
            .map(|(role, content)| {
                serde_json::from_value(serde_json::json!({"role": role, "content": content}))
                    .unwrap()
            })
            .collect()
    }

    proptest! {
        #[test]
        fn chat_messages_rendered_with_the_template_give_the_emulators_ids(
            turns in proptest::collection::vec(
                (0usize..5, proptest::collection::vec(0usize..64, 0..40)),
                1..6,
            ),
            special in any::<bool>(),
        ) {
            let vocab: Vec<&str> = vocabulary().map(|(w, _)| w).collect();
            let roles = switchyard_emulator::tokenizer_json::CHAT_ROLES;
            let messages: Vec<(&str, String)> = turns
                .iter()
                .map(|(r, words)| (roles[*r], words.iter().map(|&i| vocab[i]).collect()))
                .collect();
            let pairs: Vec<(&str, &str)> =
                messages.iter().map(|(r, c)| (*r, c.as_str())).collect();
            let rendered =
                switchyard_emulator::chat_template::render(&emulator_messages(&messages));
            let t = emulators_with(special);
            let ids = switchyard_emulator::chat_template::encode(&rendered, special);
            prop_assert_eq!(t.chat_token_ids("m", &pairs), Some(ids));
        }

        #[test]
        fn the_emulators_tokenizer_json_gives_the_emulators_ids(
            words in proptest::collection::vec(0usize..70, 1..200),
            special in any::<bool>(),
        ) {
            let vocab: Vec<&str> = vocabulary().map(|(w, _)| w).collect();
            let markers = switchyard_emulator::chat_template::SPECIAL_TOKENS;
            // Words, and with special tokens markers among them (a text prompt cut at them).
            let text: String = words
                .iter()
                .map(|&i| if i < 64 { vocab[i] } else { markers[i - 64] })
                .filter(|w| special || !w.starts_with("<|"))
                .collect();
            prop_assume!(!text.is_empty());
            let t = emulators_with(special);
            let ids = switchyard_emulator::chat_template::encode(&text, special);
            prop_assert_eq!(t.token_ids("m", &text), Some(ids));
        }
    }

    #[test]
    fn a_warmed_answer_leaves_the_next_turn_only_its_new_text_to_tokenize() {
        let vocab: Vec<&str> = vocabulary().map(|(w, _)| w).collect();
        let words = |seed: usize, n: usize| -> String {
            (0..n)
                .map(|i| vocab[(seed * 31 + i * 7) % vocab.len()])
                .collect()
        };
        let (system, question, answer, next) =
            (words(1, 40), words(2, 300), words(3, 200), words(4, 20));
        let turn = vec![("system", system.as_str()), ("user", question.as_str())];
        let mut answered = turn.clone();
        answered.push(("assistant", answer.as_str()));
        let mut next_turn = answered.clone();
        next_turn.push(("user", next.as_str()));
        let prompt = format!("{system}{question}");
        let prompt_answered = format!("{prompt}{answer}");
        let prompt_next = format!("{prompt_answered}{next}");
        // Chat cut into pieces at special tokens; chat as one piece (a template without
        // special tokens); a text prompt that grows by its answer and a new question.
        let cases = [
            (
                true,
                Input::Chat(turn.clone()),
                Input::Chat(answered.clone()),
                Input::Chat(next_turn.clone()),
            ),
            (
                false,
                Input::Chat(turn),
                Input::Chat(answered),
                Input::Chat(next_turn),
            ),
            (
                false,
                Input::Text(prompt.as_str()),
                Input::Text(prompt_answered.as_str()),
                Input::Text(prompt_next.as_str()),
            ),
        ];
        for (case, (special, first, continued, next_input)) in cases.iter().enumerate() {
            for warmed in [false, true] {
                let t = emulators_with(*special);
                let chat = matches!(first, Input::Chat(_));
                assert!(t.can_warm("m", chat, true));
                assert_eq!(t.can_warm("m", chat, false), *special);
                // The first turn, new to every instance: tokenized for its first block only.
                let needed = t
                    .ids_as_needed("m", first, &mut |_| 16, 0, usize::MAX, &mut 0)
                    .unwrap();
                assert!(matches!(needed, Needed::Prefix(..)), "{case}: {needed:?}");
                if warmed {
                    let fresh = t.warm("m", continued, true).unwrap();
                    assert!(
                        fresh >= answer.len() + question.len() - 64,
                        "{case}: {fresh}"
                    );
                    assert!(t.warm("m", continued, true).unwrap() < 200, "{case}: again");
                }
                // The next turn, every id of it held but the new question's.
                let mut fresh = 0;
                let needed = t
                    .ids_as_needed(
                        "m",
                        next_input,
                        &mut |_| usize::MAX,
                        0,
                        usize::MAX,
                        &mut fresh,
                    )
                    .unwrap();
                let whole = emulators_with(*special).ids("m", next_input).unwrap();
                assert_eq!(needed, Needed::Whole(whole), "{case}");
                if warmed {
                    assert!(fresh <= system.len() + next.len() + 256, "{case}: {fresh}");
                } else {
                    assert!(fresh >= question.len() + answer.len(), "{case}: {fresh}");
                }
            }
        }
        // Without the question, only the answer's own pieces are worth it: where the prompt
        // is one piece, nothing is.
        let t = emulators_with(true);
        let fresh = t.warm("m", &cases[0].2, false).unwrap();
        assert!(fresh > answer.len() && fresh < answer.len() + 8, "{fresh}");
        assert_eq!(emulators().warm("m", &cases[1].2, false), None);
        assert_eq!(emulators().warm("other", &cases[1].2, true), None);
    }

    #[test]
    fn chat_templates_load_from_the_config_beside_the_tokenizer() {
        let t = emulators();
        assert!(t.has_chat_template("m"));
        assert_eq!(
            t.chat_token_ids("m", &[("user", " the zebra")]),
            None,
            "not in the vocabulary"
        );
        // Named templates: the `default` one; special tokens as added-token objects.
        let config = r#"{"chat_template": [{"name": "tool_use", "template": "x"},
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content.strip() }}{% endfor %}{{ eos_token }}"}],
            "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>"}"#;
        let chat = ChatTemplate::from_config(config).unwrap().unwrap();
        assert_eq!(chat.render(&[("user", "  hi ")]).unwrap(), "<s>hi</s>");
        // A template that raises renders nothing (the request falls back to the index).
        let raising = r#"{"chat_template": "{{ raise_exception('no system role') }}"}"#;
        let chat = ChatTemplate::from_config(raising).unwrap().unwrap();
        assert_eq!(chat.render(&[("system", "x")]), None);
        // No template: no chat tokenizing; a broken one: an error at load.
        assert!(ChatTemplate::from_config("{}").unwrap().is_none());
        assert!(ChatTemplate::from_config(r#"{"chat_template": "{% for %}"}"#).is_err());
        assert!(ChatTemplate::from_config("not json").is_err());
    }

    #[test]
    fn a_prompt_without_ids_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, switchyard_emulator::tokenizer_json::tokenizer_json()).unwrap();
        let files = BTreeMap::from([("m".to_string(), path.clone())]);
        let chat = Input::Chat(vec![("user", " the")]);
        // No tokenizer_config.json beside it: no chat template.
        let t = Tokenizers::load(&files).unwrap();
        assert_eq!(t.ids("m", &chat), Err(Miss::NoTemplate));
        assert_eq!(t.ids("other", &chat), Err(Miss::NoTokenizer));
        assert_eq!(t.ids("m", &Input::Text(" the zebra")), Err(Miss::Unknown));
        assert!(t.ids("m", &Input::Text(" the")).is_ok());
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": "{{ raise_exception('no user role') }}"}"#,
        )
        .unwrap();
        let t = Tokenizers::load(&files).unwrap();
        assert_eq!(t.ids("m", &chat), Err(Miss::TemplateFailed));
        assert_eq!(Miss::TemplateFailed.label(), "template_failed");
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
