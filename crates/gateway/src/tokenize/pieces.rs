//! Tokenizing a prompt piece by piece, with the pieces' ids remembered.
//!
//! A Hugging Face tokenizer cuts the text at its added (special) tokens before anything else
//! and normalizes, pre-tokenizes and tokenizes each piece on its own; the ids of a prompt are
//! the concatenation of its pieces' ids, wrapped by the post-processor's special tokens. A
//! conversation sends its earlier messages again in every turn, between the same special
//! tokens (`<|eot_id|>`, `<|im_end|>`…), so a bounded cache of the pieces' ids makes a turn
//! cost the tokenizing of its new messages only, instead of the whole conversation.
//!
//! The cut is made exactly as the tokenizer makes it (leftmost-longest match of the added
//! tokens' text). Tokenizers whose added tokens change the cut with the text around them
//! (`lstrip`, `rstrip`, `single_word`, or matched after normalization), or that truncate or
//! pad, are tokenized whole, as before.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};

use super::continued::{self, Continuations};

/// Bytes of cached pieces (text and ids) per tokenizer: a 32k-token system prompt takes about
/// 256 KiB, so this holds well over a hundred long conversations' histories.
pub const CACHE_BYTES: usize = 64 << 20;

/// Bookkeeping charged per cached piece besides its text and ids.
const ENTRY_OVERHEAD: usize = 64;

/// How a tokenizer's prompts are cut and what its post-processor adds around one sequence.
pub(super) struct PieceTokenizer {
    /// The added tokens' text, matched as the tokenizer matches it; none without added tokens
    /// (a search for no pattern still walks the whole text).
    added: Option<AhoCorasick>,
    /// The id of each pattern of `added`.
    added_ids: Vec<u32>,
    /// Ids the post-processor puts before and after a single sequence; none when it does
    /// something else, and then prompts with special tokens are tokenized whole.
    wrap: Option<(Vec<u32>, Vec<u32>)>,
    cache: Mutex<Generations>,
    /// Long pieces' ids and token ends, so that a longer piece starting with one is tokenized
    /// from near its end (half the budget again).
    continued: Continuations,
}

/// A piece cache bounded in bytes: new pieces go to the young generation; when it is full the
/// old one is dropped and the young one becomes old. A piece found in the old generation moves
/// back to the young one, so pieces in use survive and memory stays under two generations.
struct Generations {
    young: Pieces,
    old: Pieces,
    young_bytes: usize,
    /// Bytes both generations may hold together.
    budget: usize,
}

/// Pieces by the xxh3 hash of their text (hashed once, outside the lock, at memory speed),
/// with the text kept to tell a collision from a hit.
type Pieces = HashMap<u64, Piece, rustc_hash::FxBuildHasher>;

/// A cached piece.
struct Piece {
    text: Box<str>,
    ids: Arc<[u32]>,
}

fn entry_bytes(text: &str, ids: &[u32]) -> usize {
    text.len() + std::mem::size_of_val(ids) + ENTRY_OVERHEAD
}

impl Generations {
    fn new(budget: usize) -> Generations {
        Generations {
            young: Pieces::default(),
            old: Pieces::default(),
            young_bytes: 0,
            budget,
        }
    }

    fn get(&mut self, hash: u64, text: &str) -> Option<Arc<[u32]>> {
        if let Some(piece) = self.young.get(&hash) {
            return (*piece.text == *text).then(|| piece.ids.clone());
        }
        if self.old.get(&hash).is_none_or(|piece| *piece.text != *text) {
            return None;
        }
        let piece = self.old.remove(&hash)?;
        let ids = piece.ids.clone();
        self.insert(hash, piece);
        Some(ids)
    }

    fn insert(&mut self, hash: u64, piece: Piece) {
        let bytes = entry_bytes(&piece.text, &piece.ids);
        if bytes > self.budget / 2 {
            return;
        }
        if self.young_bytes + bytes > self.budget / 2 {
            self.old = std::mem::take(&mut self.young);
            self.young_bytes = 0;
        }
        self.young_bytes += bytes;
        // A colliding piece already young keeps its bytes counted until the turnover: an
        // overcount, never an overrun.
        self.young.insert(hash, piece);
    }
}

impl PieceTokenizer {
    /// The piece tokenizer of `tokenizer`, caching up to `budget` bytes; none when its pieces
    /// are not independent.
    pub(super) fn new(tokenizer: &tokenizers::Tokenizer, budget: usize) -> Option<PieceTokenizer> {
        if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
            return None;
        }
        let vocabulary = tokenizer.get_added_vocabulary();
        if vocabulary.get_encode_special_tokens() {
            return None;
        }
        let mut tokens: Vec<(&str, u32)> = Vec::new();
        for (id, token) in vocabulary.get_added_tokens_decoder() {
            if token.lstrip || token.rstrip || token.single_word || token.normalized {
                return None;
            }
            tokens.push((token.content.as_str(), *id));
        }
        tokens.sort_unstable();
        if tokens.windows(2).any(|w| w[0].0 == w[1].0) || tokens.iter().any(|t| t.0.is_empty()) {
            return None;
        }
        let added = if tokens.is_empty() {
            None
        } else {
            let matcher = AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .build(tokens.iter().map(|t| t.0))
                .ok()?;
            Some(matcher)
        };
        if depends_on_position(tokenizer) {
            return None;
        }
        let probes: Vec<&str> = tokens.iter().take(4).map(|t| t.0).collect();
        let pieces = PieceTokenizer {
            added,
            added_ids: tokens.iter().map(|t| t.1).collect(),
            wrap: wrap(tokenizer),
            cache: Mutex::new(Generations::new(budget)),
            continued: Continuations::new(budget / 2),
        };
        if !pieces.agrees_on_probes(tokenizer, &probes) {
            return None;
        }
        // The probes' pieces are no prompt's (and too short to be continued).
        *pieces.lock() = Generations::new(budget);
        Some(pieces)
    }

    /// Whether texts around the added tokens `probes` come out as the tokenizer makes them:
    /// the check behind the flags, for whatever else in a pipeline could make a piece's ids
    /// depend on what precedes it.
    fn agrees_on_probes(&self, tokenizer: &tokenizers::Tokenizer, probes: &[&str]) -> bool {
        probes.iter().all(|token| {
            [
                format!("Hello world{token}Hello world"),
                format!("{token} a\n\nb {token}c{token}"),
                format!("x  {token}  y\n"),
            ]
            .iter()
            .all(|text| {
                [false, true].iter().all(|&special| {
                    self.encode_counted(tokenizer, text, special, &mut 0)
                        == whole(tokenizer, text, special)
                })
            })
        })
    }

    /// The ids `tokenizer` gives `text` (with the post-processor's special tokens when
    /// `special`); none when the tokenizer fails or this cannot reproduce it.
    #[cfg(test)]
    pub(super) fn encode(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
        special: bool,
    ) -> Option<Vec<u32>> {
        self.encode_counted(tokenizer, text, special, &mut 0)
    }

    /// As [`PieceTokenizer::encode`], adding to `fresh` the bytes of text not found in the
    /// cache (tokenized anew).
    pub(super) fn encode_counted(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
        special: bool,
        fresh: &mut usize,
    ) -> Option<Vec<u32>> {
        let (prefix, suffix) = match (special, &self.wrap) {
            (false, _) => (&[][..], &[][..]),
            (true, Some((prefix, suffix))) => (&prefix[..], &suffix[..]),
            (true, None) => {
                *fresh += text.len();
                return whole(tokenizer, text, true);
            }
        };
        let mut ids = prefix.to_vec();
        let mut start = 0;
        for found in self.added.iter().flat_map(|added| added.find_iter(text)) {
            *fresh += self.encode_piece(tokenizer, &text[start..found.start()], &mut ids, false)?;
            ids.push(self.added_ids[found.pattern().as_usize()]);
            start = found.end();
        }
        *fresh += self.encode_piece(tokenizer, &text[start..], &mut ids, true)?;
        ids.extend_from_slice(suffix);
        Some(ids)
    }

    /// Whether prompts are cut into pieces at all (the tokenizer has added tokens): without,
    /// a prompt is one piece, and only the very same prompt finds it cached.
    pub(super) fn cuts(&self) -> bool {
        self.added.is_some()
    }

    /// Tokenizes and caches the pieces of `text` (a text without the post-processor's special
    /// tokens, as a chat template renders it) that overlap any of the byte ranges `parts`, so
    /// that a later prompt with those pieces finds them cached; the other pieces are not
    /// looked at, nor is the last (no added token ends it, so a longer text would not have
    /// it). Returns the bytes tokenized anew.
    pub(super) fn warm(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
        parts: &[std::ops::Range<usize>],
    ) -> Option<usize> {
        let mut fresh = 0;
        let mut scratch = Vec::new();
        let mut start = 0;
        let cuts = self
            .added
            .iter()
            .flat_map(|added| added.find_iter(text))
            .map(|found| (found.start(), found.end()));
        for (end, next) in cuts {
            if start < end && parts.iter().any(|p| p.start < end && start < p.end) {
                fresh += self.encode_piece(tokenizer, &text[start..end], &mut scratch, false)?;
                scratch.clear();
            }
            start = next;
        }
        Some(fresh)
    }

    /// As [`PieceTokenizer::encode`], but only as far as exact matching needs: `horizon`
    /// says, for the ids so far, how many a lookup could still use, and tokenizing stops once
    /// the ids reach it (a new prompt then costs its first block or so instead of its whole
    /// text). Pieces seen before cost nothing and are always taken; a new piece is tokenized
    /// in growing cuts while the horizon lies inside it, the first reaching `held_bytes` of the
    /// text (where the router expects the held part to end). More than `budget` bytes of new
    /// text gives [`Needed::OverBudget`]. The bytes tokenized anew (cuts re-tokenized
    /// included) are added to `fresh_bytes`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn encode_as_needed(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
        special: bool,
        horizon: &mut dyn FnMut(&[u32]) -> usize,
        held_bytes: usize,
        budget: usize,
        fresh_bytes: &mut usize,
    ) -> Option<Needed> {
        let (prefix, suffix) = match (special, &self.wrap) {
            (false, _) => (&[][..], &[][..]),
            (true, Some((prefix, suffix))) => (&prefix[..], &suffix[..]),
            (true, None) if text.len() <= budget => {
                *fresh_bytes += text.len();
                return whole(tokenizer, text, true).map(Needed::Whole);
            }
            (true, None) => return Some(Needed::OverBudget),
        };
        let mut ids = prefix.to_vec();
        let mut need = horizon(&ids);
        if need == 0 {
            return Some(Needed::Prefix(Vec::new(), text.len()));
        }
        let budget = budget.saturating_add(*fresh_bytes);
        let mut start = 0;
        let cuts = self
            .added
            .iter()
            .flat_map(|added| added.find_iter(text))
            .map(|found| {
                (
                    found.start(),
                    Some((found.end(), found.pattern().as_usize())),
                )
            })
            .chain(std::iter::once((text.len(), None)));
        for (end, added) in cuts {
            let piece = &text[start..end];
            if !piece.is_empty() {
                let hash = xxhash_rust::xxh3::xxh3_64(piece.as_bytes());
                let cached = self.lock().get(hash, piece);
                if let Some(found) = cached {
                    ids.extend_from_slice(&found);
                } else {
                    if ids.len() >= need {
                        need = horizon(&ids);
                        if ids.len() >= need {
                            return Some(Needed::Prefix(ids, text.len() - start));
                        }
                    }
                    let mut fresh = Fresh {
                        ids: &mut ids,
                        need: &mut need,
                        fresh_bytes: &mut *fresh_bytes,
                        held_bytes: held_bytes.saturating_sub(start),
                        budget,
                        last: added.is_none(),
                    };
                    match fresh.encode(self, tokenizer, piece, hash, horizon)? {
                        Taken::Whole => {}
                        Taken::Cut(covered) => {
                            return Some(Needed::Prefix(ids, text.len() - (start + covered)))
                        }
                        Taken::OverBudget => return Some(Needed::OverBudget),
                    }
                }
            }
            if let Some((added_end, pattern)) = added {
                ids.push(self.added_ids[pattern]);
                start = added_end;
            }
        }
        ids.extend_from_slice(suffix);
        Some(Needed::Whole(ids))
    }

    /// Appends the ids of `piece`, a text without added tokens, to `ids`; returns the bytes
    /// tokenized anew (0 when the piece was cached). `last`: no added token follows it (the
    /// only piece a longer text can continue).
    fn encode_piece(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        piece: &str,
        ids: &mut Vec<u32>,
        last: bool,
    ) -> Option<usize> {
        if piece.is_empty() {
            return Some(0);
        }
        let hash = xxhash_rust::xxh3::xxh3_64(piece.as_bytes());
        let cached = self.lock().get(hash, piece);
        match cached {
            Some(found) => {
                ids.extend_from_slice(&found);
                Some(0)
            }
            None => self.encode_piece_fresh(tokenizer, piece, hash, ids, last),
        }
    }

    /// Tokenizes `piece` (not in the cache; `hash` its text's), caches its ids and appends
    /// them to `ids`; returns the bytes tokenized. A long `last` piece (no added token after
    /// it: a later turn may continue it) is tokenized from near the end of a kept piece it
    /// starts with, when there is one, and is kept in its turn.
    fn encode_piece_fresh(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        piece: &str,
        hash: u64,
        ids: &mut Vec<u32>,
        last: bool,
    ) -> Option<usize> {
        let keep = last && self.continued.would_keep(piece.len());
        let (fresh, tokenized): (Arc<[u32]>, usize) = if !keep {
            (whole(tokenizer, piece, false)?.into(), piece.len())
        } else {
            let resumed = self
                .continued
                .prefix_of(piece)
                .and_then(|from| continued::resume(tokenizer, piece, &from));
            let (found, ends, tokenized) = match resumed {
                Some(r) => r,
                None => {
                    let encoding = tokenizer.encode(piece, false).ok()?;
                    let ends = encoding.get_offsets().iter().map(|o| o.1 as u32).collect();
                    (encoding.get_ids().to_vec(), ends, piece.len())
                }
            };
            self.continued.remember(piece, &found, &ends);
            (found.into(), tokenized)
        };
        ids.extend_from_slice(&fresh);
        self.lock().insert(
            hash,
            Piece {
                text: piece.into(),
                ids: fresh,
            },
        );
        Some(tokenized)
    }

    /// Bytes left to tokenize of `piece` after the longest kept piece it starts with (none
    /// without one).
    fn continues(&self, piece: &str) -> Option<usize> {
        self.continued
            .prefix_of(piece)
            .map(|from| piece.len() - from.text_len())
    }

    /// The cache; a poisoned lock only means another request panicked mid-lookup, and the
    /// maps are still whole.
    fn lock(&self) -> std::sync::MutexGuard<'_, Generations> {
        self.cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Bytes the cache holds now (both generations), for tests and benches.
    #[cfg(test)]
    pub(super) fn cached_bytes(&self) -> usize {
        let cache = self.lock();
        cache.young_bytes
            + cache
                .old
                .values()
                .map(|p| entry_bytes(&p.text, &p.ids))
                .sum::<usize>()
    }
}

/// A prompt's token ids, as far as exact matching needed them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Needed {
    /// Every id of the prompt.
    Whole(Vec<u32>),
    /// The prompt's first ids, then this many bytes of its text left untokenized: no instance
    /// can hold what follows them.
    Prefix(Vec<u32>, usize),
    /// The lookup needs more new text tokenized than the budget allows here.
    OverBudget,
}

/// Bytes before a cut whose tokens are not trusted: the tokens of a text cut short can differ
/// from the whole text's near the cut (a word split in two, whitespace a pre-tokenizer joins
/// to the next word), never this far before it for the tokenizers in use (BPE and WordPiece
/// work within pre-tokenized words, which are short; Unigram's lattice reconnects within a
/// few pieces).
const CUT_MARGIN: usize = 64;

/// Smallest first cut of a new piece, in bytes.
const FIRST_CUT_BYTES: usize = 192;

/// Bytes a token is assumed to take when sizing a cut before any of the piece is tokenized.
const CUT_BYTES_PER_TOKEN: usize = 6;

/// What was taken of a new piece.
enum Taken {
    /// All of it (and it is cached).
    Whole,
    /// Its ids up to this byte, where the horizon was reached.
    Cut(usize),
    /// Its cuts would exceed the budget of new text.
    OverBudget,
}

/// The state of a prompt tokenized as far as needed, while a new piece is cut.
struct Fresh<'a> {
    ids: &'a mut Vec<u32>,
    need: &'a mut usize,
    fresh_bytes: &'a mut usize,
    /// Bytes of this piece the router expects an instance to hold.
    held_bytes: usize,
    budget: usize,
    /// No added token follows the piece: a later turn may continue it.
    last: bool,
}

impl Fresh<'_> {
    /// Tokenizes `piece` in cuts growing fourfold (so re-tokenizing the start of each costs at
    /// most a third more than one pass) until the horizon is reached or the piece ends; the
    /// first cut takes the part expected held and two blocks' worth past it.
    fn encode(
        &mut self,
        pieces: &PieceTokenizer,
        tokenizer: &tokenizers::Tokenizer,
        piece: &str,
        hash: u64,
        horizon: &mut dyn FnMut(&[u32]) -> usize,
    ) -> Option<Taken> {
        let base = self.ids.len();
        // A piece continuing a kept one costs its new part: taken whole.
        if let Some(rest) = self.last.then(|| pieces.continues(piece)).flatten() {
            if self.fresh_bytes.saturating_add(rest) <= self.budget {
                *self.fresh_bytes +=
                    pieces.encode_piece_fresh(tokenizer, piece, hash, self.ids, true)?;
                return Some(Taken::Whole);
            }
        }
        let mut cut: usize = 0;
        let mut bytes_per_token = CUT_BYTES_PER_TOKEN;
        loop {
            let wanted = self.need.saturating_sub(self.ids.len()).max(1);
            let first = if cut == 0 { self.held_bytes } else { 0 };
            cut = cut.saturating_mul(4).max(FIRST_CUT_BYTES).max(
                wanted
                    .saturating_mul(2 * bytes_per_token)
                    .saturating_add(first)
                    .saturating_add(CUT_MARGIN),
            );
            if cut.saturating_add(CUT_MARGIN) >= piece.len() {
                *self.fresh_bytes += piece.len();
                if *self.fresh_bytes > self.budget {
                    return Some(Taken::OverBudget);
                }
                self.ids.truncate(base);
                pieces.encode_piece_fresh(tokenizer, piece, hash, self.ids, self.last)?;
                return Some(Taken::Whole);
            }
            let at = floor_char_boundary(piece, cut);
            *self.fresh_bytes += at;
            if *self.fresh_bytes > self.budget {
                return Some(Taken::OverBudget);
            }
            let encoding = tokenizer.encode(&piece[..at], false).ok()?;
            let trusted_end = at - CUT_MARGIN;
            let kept = encoding
                .get_offsets()
                .iter()
                .take_while(|(_, end)| *end <= trusted_end)
                .count();
            let covered = kept
                .checked_sub(1)
                .map_or(0, |last| encoding.get_offsets()[last].1);
            self.ids.truncate(base);
            self.ids.extend_from_slice(&encoding.get_ids()[..kept]);
            // Kept, so that the conversation's next turn (or this answer's warm-up) starts
            // from here.
            if self.last {
                let ends: Vec<u32> = encoding.get_offsets()[..kept]
                    .iter()
                    .map(|o| o.1 as u32)
                    .collect();
                pieces
                    .continued
                    .remember(&piece[..covered], &encoding.get_ids()[..kept], &ends);
            }
            if kept > 0 {
                bytes_per_token = covered.div_ceil(kept).max(1);
            }
            if self.ids.len() >= *self.need {
                *self.need = horizon(self.ids);
                if self.ids.len() >= *self.need {
                    return Some(Taken::Cut(covered));
                }
            }
        }
    }
}

/// The largest char boundary of `text` at or before `at`.
fn floor_char_boundary(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// Whether the pre-tokenizer treats the text's first piece apart from the others: Metaspace's
/// `prepend_scheme: first` (Mistral's and newer Llama 2 files) prefixes `▁` only at the start of
/// the whole text, so a piece tokenized alone would get one it does not have in context.
fn depends_on_position(tokenizer: &tokenizers::Tokenizer) -> bool {
    serde_json::to_string(&tokenizer.get_pre_tokenizer())
        .map_or(true, |json| json.contains("\"first\""))
}

/// The tokenizer's own ids for `text`, without offsets (which the router does not use).
pub(super) fn whole(
    tokenizer: &tokenizers::Tokenizer,
    text: &str,
    special: bool,
) -> Option<Vec<u32>> {
    tokenizer
        .encode_fast(text, special)
        .ok()
        .map(|e| e.get_ids().to_vec())
}

/// The ids the post-processor puts around a single sequence, when it only wraps it: found by
/// encoding probe texts with and without special tokens, and checked on all of them.
fn wrap(tokenizer: &tokenizers::Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    const PROBES: [&str; 3] = ["a", "Hello world", "0 1 2 3\n"];
    let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
    for probe in PROBES {
        let plain = whole(tokenizer, probe, false)?;
        let with = whole(tokenizer, probe, true)?;
        let at = (0..=with.len().checked_sub(plain.len())?)
            .find(|&at| with[at..at + plain.len()] == plain[..])?;
        let this = (with[..at].to_vec(), with[at + plain.len()..].to_vec());
        match &found {
            Some(first) if *first != this => return None,
            _ => found = Some(this),
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use switchyard_engine::tokenizer::vocabulary;

    /// Added tokens of the test tokenizer, as a chat model's tokenizer has them.
    const ADDED: [(&str, u32); 4] = [
        ("<s>", 1),
        ("<|im_start|>", 2),
        ("<|im_end|>", 3),
        ("<|im_end|>x", 4),
    ];

    /// The emulator's tokenizer with added tokens and a post-processor that puts `<s>` first,
    /// as Llama's does; `token_flags` adds flags to every added token.
    fn tokenizer(token_flags: serde_json::Value) -> tokenizers::Tokenizer {
        let mut json: serde_json::Value =
            serde_json::from_str(&switchyard_emulator::tokenizer_json::tokenizer_json()).unwrap();
        json["added_tokens"] = ADDED
            .iter()
            .map(|(content, id)| {
                let mut token = serde_json::json!({"id": id, "content": content,
                    "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": true});
                for (k, v) in token_flags.as_object().unwrap() {
                    token[k] = v.clone();
                }
                token
            })
            .collect();
        json["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        });
        json.to_string().parse().unwrap()
    }

    /// Text made of vocabulary words, added tokens and stray characters (the tokenizer's
    /// unknown pieces, which must come out the same too).
    fn text(items: &[usize]) -> String {
        let vocab: Vec<&str> = vocabulary().map(|(w, _)| w).collect();
        let extra = ["<", "|", ">", "x", " ", "\n", "é", "<|im_", "end|>"];
        items
            .iter()
            .map(|&i| match i % 3 {
                0 => vocab[i / 3 % vocab.len()],
                1 => ADDED[i / 3 % ADDED.len()].0,
                _ => extra[i / 3 % extra.len()],
            })
            .collect()
    }

    proptest! {
        #[test]
        fn pieces_give_the_tokenizers_own_ids(
            turns in proptest::collection::vec(proptest::collection::vec(0usize..600, 0..30), 1..6),
            special in any::<bool>(),
        ) {
            let t = tokenizer(serde_json::json!({}));
            // A budget small enough that generations turn over within the case.
            let pieces = PieceTokenizer::new(&t, 4096).unwrap();
            // Each turn repeats the earlier ones, so later encodes hit the cache.
            let mut conversation = String::new();
            for turn in &turns {
                conversation.push_str(&text(turn));
                conversation.push_str("<|im_end|>");
                for _ in 0..2 {
                    prop_assert_eq!(
                        pieces.encode(&t, &conversation, special),
                        whole(&t, &conversation, special)
                    );
                }
                prop_assert!(pieces.cached_bytes() <= 4096);
            }
        }
    }

    /// A byte-level BPE tokenizer (GPT-2's pre-tokenizer regex) with a few merges, and the
    /// test tokenizer's added tokens: cuts inside words and whitespace runs matter to it.
    fn byte_level_bpe() -> tokenizers::Tokenizer {
        let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
            .into_iter()
            .collect();
        alphabet.sort_unstable();
        let merges = [
            ("Ġ", "t"),
            ("h", "e"),
            ("Ġt", "he"),
            ("Ġ", "a"),
            ("o", "r"),
            ("Ġa", "n"),
            ("Ġ", "Ġ"),
            ("ĠĠ", "ĠĠ"),
            ("e", "r"),
            ("Ġ", "w"),
            ("Ġw", "or"),
            ("Ċ", "Ċ"),
        ];
        let mut vocab = serde_json::Map::new();
        for c in &alphabet {
            let id = vocab.len();
            vocab.insert(c.to_string(), serde_json::json!(id + 10));
        }
        for (a, b) in merges {
            let id = vocab.len();
            vocab.insert(format!("{a}{b}"), serde_json::json!(id + 10));
        }
        let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": ADDED.iter().map(|(content, id)| serde_json::json!({"id": id,
                "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": true})).collect::<Vec<_>>(),
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                "trim_offsets": true, "use_regex": true},
            "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": merges}
        })
        .to_string()
        .parse()
        .unwrap()
    }

    proptest! {
        #[test]
        fn a_piece_continued_from_a_kept_one_gives_the_tokenizers_own_ids(
            items in proptest::collection::vec(0usize..600, 50..300),
            kept_share in 0.1f64..1.0,
            bpe in any::<bool>(),
        ) {
            let t = if bpe { byte_level_bpe() } else { tokenizer(serde_json::json!({})) };
            // A piece: words, spaces and stray characters, no added token.
            let items: Vec<usize> = items.into_iter().filter(|i| i % 3 != 1).collect();
            let piece = text(&items).repeat(8);
            let at = floor_char_boundary(&piece, (piece.len() as f64 * kept_share) as usize);
            let kept_text = &piece[..at];
            prop_assume!(kept_text.len() >= continued::MIN_BYTES);
            let encoding = t.encode(kept_text, false).unwrap();
            let ends: Vec<u32> = encoding.get_offsets().iter().map(|o| o.1 as u32).collect();
            let kept = Continuations::new(CACHE_BYTES);
            kept.remember(kept_text, encoding.get_ids(), &ends);
            match kept.prefix_of(&piece) {
                None => prop_assert_eq!(at, piece.len()),
                Some(from) => {
                    let whole_ids = whole(&t, &piece, false).unwrap();
                    if let Some((ids, ends, fresh)) = continued::resume(&t, &piece, &from) {
                        prop_assert_eq!(&ids, &whole_ids);
                        prop_assert_eq!(ends.len(), ids.len());
                        prop_assert!(fresh < piece.len() - at + 300, "{} of {}", fresh, piece.len() - at);
                    }
                    // Through the piece cache: the same ids, whether resumed or not.
                    let pieces = PieceTokenizer::new(&t, CACHE_BYTES).unwrap();
                    pieces.continued.remember(kept_text, encoding.get_ids(), &ends);
                    prop_assert_eq!(pieces.encode(&t, &piece, false), Some(whole_ids));
                }
            }
        }
    }

    #[test]
    fn a_conversation_sent_as_one_text_is_tokenized_from_where_it_was_kept() {
        let vocab: Vec<&str> = vocabulary().map(|(w, _)| w).collect();
        let turn = |seed: usize| -> String {
            (0..300)
                .map(|i| vocab[(seed * 13 + i * 7) % vocab.len()])
                .collect::<String>()
                + "\n\n"
        };
        for t in [tokenizer(serde_json::json!({})), byte_level_bpe()] {
            let pieces = PieceTokenizer::new(&t, CACHE_BYTES).unwrap();
            let mut conversation = String::new();
            for round in 0..4 {
                conversation.push_str(&turn(round));
                let mut fresh = 0;
                let ids = pieces.encode_counted(&t, &conversation, false, &mut fresh);
                assert_eq!(ids, whole(&t, &conversation, false), "round {round}");
                if round == 0 {
                    assert_eq!(fresh, conversation.len());
                } else {
                    // The new turn and the margins around the splice, not the whole.
                    assert!(fresh <= turn(round).len() + 256, "round {round}: {fresh}");
                }
            }
        }
    }

    /// A horizon as the router gives it: the whole prompt's first `held` ids are held in
    /// blocks of `block`, and a lookup can use one block past the run the ids match.
    fn horizon_of(whole: &[u32], held: usize, block: usize) -> impl FnMut(&[u32]) -> usize + '_ {
        move |ids: &[u32]| {
            let run = ids
                .chunks_exact(block)
                .zip(whole.chunks_exact(block))
                .take(held / block)
                .take_while(|(a, b)| a == b)
                .count();
            (run + 1) * block
        }
    }

    proptest! {
        #[test]
        fn tokenizing_as_needed_gives_the_whole_prompts_first_ids(
            items in proptest::collection::vec(0usize..600, 0..400),
            held_share in 0.0f64..1.2,
            block in 1usize..20,
            bpe in any::<bool>(),
            cached in any::<bool>(),
            hint in 0usize..8000,
        ) {
            let t = if bpe { byte_level_bpe() } else { tokenizer(serde_json::json!({})) };
            let pieces = PieceTokenizer::new(&t, CACHE_BYTES).unwrap();
            // Long runs of words and spaces, so that cuts fall inside pieces.
            let text: String = text(&items).repeat(3);
            let special = false;
            let whole_ids = whole(&t, &text, special).unwrap();
            if cached {
                // Every piece seen before: nothing is cut.
                pieces.encode(&t, &text, special);
            }
            let held = (whole_ids.len() as f64 * held_share) as usize;
            let mut horizon = horizon_of(&whole_ids, held, block);
            let needed = pieces
                .encode_as_needed(&t, &text, special, &mut horizon, hint, usize::MAX, &mut 0)
                .unwrap();
            drop(horizon);
            let reach = ((held.min(whole_ids.len()) / block + 1) * block).min(whole_ids.len());
            match needed {
                Needed::Whole(ids) => prop_assert_eq!(ids, whole_ids),
                Needed::Prefix(ids, rest) => {
                    prop_assert!(ids.len() >= reach, "{} < {}", ids.len(), reach);
                    prop_assert_eq!(&ids[..], &whole_ids[..ids.len()]);
                    prop_assert!(rest <= text.len());
                }
                Needed::OverBudget => prop_assert!(false, "no budget was set"),
            }
        }
    }

    #[test]
    fn a_new_prompt_nobody_holds_is_tokenized_for_its_first_block_only() {
        let t = tokenizer(serde_json::json!({}));
        let pieces = PieceTokenizer::new(&t, CACHE_BYTES).unwrap();
        let text: String = vocabulary().map(|(w, _)| w).collect::<String>().repeat(40);
        let whole_ids = whole(&t, &text, false).unwrap();
        let mut calls = 0;
        let mut nothing_held = |_: &[u32]| {
            calls += 1;
            16
        };
        let needed = pieces
            .encode_as_needed(&t, &text, false, &mut nothing_held, 0, usize::MAX, &mut 0)
            .unwrap();
        let Needed::Prefix(ids, rest) = needed else {
            panic!("{needed:?}")
        };
        assert!((16..64).contains(&ids.len()), "{}", ids.len());
        assert_eq!(ids[..], whole_ids[..ids.len()]);
        assert_eq!(rest, text.len() - 4 * ids.len(), "4 bytes a token here");
        assert_eq!(calls, 2, "once before, once after the first cut");
        assert_eq!(pieces.cached_bytes(), 0, "a cut piece is not cached");
        // Nothing matched exactly: nothing tokenized.
        let needed = pieces
            .encode_as_needed(&t, &text, false, &mut |_| 0, 0, usize::MAX, &mut 0)
            .unwrap();
        assert_eq!(needed, Needed::Prefix(Vec::new(), text.len()));
        // A budget smaller than the new text the horizon asks for.
        let needed = pieces
            .encode_as_needed(&t, &text, false, &mut |_| usize::MAX, 0, 4096, &mut 0)
            .unwrap();
        assert_eq!(needed, Needed::OverBudget);
    }

    #[test]
    fn tokens_that_change_the_cut_with_their_context_turn_pieces_off() {
        assert!(PieceTokenizer::new(&tokenizer(serde_json::json!({})), CACHE_BYTES).is_some());
        for flag in ["lstrip", "rstrip", "single_word", "normalized"] {
            let t = tokenizer(serde_json::json!({ flag: true }));
            assert!(PieceTokenizer::new(&t, CACHE_BYTES).is_none(), "{flag}");
        }
    }

    /// A tokenizer whose pre-tokenizer prefixes `▁` to the text's first piece only, over a
    /// vocabulary that tells `▁a` from `a`.
    fn metaspace_first() -> tokenizers::Tokenizer {
        let vocab: serde_json::Map<String, serde_json::Value> =
            ["[UNK]", "a", "▁a", "b", "▁b", "c", "▁c"]
                .iter()
                .enumerate()
                .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
                .collect();
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 7, "content": "<|im_end|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁",
                "prepend_scheme": "first", "split": true},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        })
        .to_string()
        .parse()
        .unwrap()
    }

    #[test]
    fn a_pre_tokenizer_that_marks_the_first_piece_turns_pieces_off() {
        let t = metaspace_first();
        // In context the second `a` has no `▁`; alone it would.
        assert_eq!(whole(&t, "a<|im_end|>a", false), Some(vec![2, 7, 1]));
        assert!(depends_on_position(&t));
        assert!(PieceTokenizer::new(&t, CACHE_BYTES).is_none());
        // The probes catch it too, without the flag check.
        let pieces = PieceTokenizer {
            added: AhoCorasick::new(["<|im_end|>"]).ok(),
            added_ids: vec![7],
            wrap: None,
            cache: Mutex::new(Generations::new(CACHE_BYTES)),
            continued: Continuations::new(CACHE_BYTES),
        };
        assert_eq!(
            pieces.encode(&t, "a<|im_end|>a", false),
            Some(vec![2, 7, 2])
        );
        assert!(!pieces.agrees_on_probes(&t, &["<|im_end|>"]));
        // The test tokenizer passes both.
        let chat = tokenizer(serde_json::json!({}));
        assert!(!depends_on_position(&chat));
    }

    #[test]
    fn the_post_processors_wrap_is_found() {
        let t = tokenizer(serde_json::json!({}));
        let pieces = PieceTokenizer::new(&t, CACHE_BYTES).unwrap();
        assert_eq!(pieces.wrap, Some((vec![1], vec![])));
        let words: String = vocabulary().take(8).map(|(w, _)| w).collect();
        let ids = pieces.encode(&t, &words, true).unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(ids, whole(&t, &words, true).unwrap());
    }

    #[test]
    fn a_hash_collision_is_a_miss_not_someone_elses_ids() {
        let mut cache = Generations::new(1 << 20);
        let piece = |text: &str, id: u32| Piece {
            text: text.into(),
            ids: vec![id].into(),
        };
        cache.insert(7, piece("the first piece", 1));
        assert_eq!(cache.get(7, "the first piece").as_deref(), Some(&[1][..]));
        assert_eq!(cache.get(7, "another piece"), None);
        // In the old generation too.
        cache.old = std::mem::take(&mut cache.young);
        assert_eq!(cache.get(7, "another piece"), None);
        assert_eq!(cache.get(7, "the first piece").as_deref(), Some(&[1][..]));
        assert!(
            cache.young.contains_key(&7),
            "a hit in the old generation moves it back"
        );
    }

    #[test]
    fn a_piece_bigger_than_half_the_budget_is_not_kept() {
        let t = tokenizer(serde_json::json!({}));
        let pieces = PieceTokenizer::new(&t, 256).unwrap();
        let words: String = vocabulary().map(|(w, _)| w).collect();
        assert_eq!(pieces.encode(&t, &words, false), whole(&t, &words, false));
        assert_eq!(pieces.cached_bytes(), 0);
    }
}
