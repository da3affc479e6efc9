//! Long pieces continued: a conversation sent as one text (a `/v1/completions` prompt that
//! grows by its answer and a new question every turn, or a chat template without special
//! tokens) is one piece that is never the same twice, so the piece cache cannot help it. Its
//! ids and token boundaries are kept instead, found again by the text's first bytes, and a
//! longer piece that starts with a kept one is tokenized from near the kept one's end: the
//! kept tokens up to a margin before it, then the rest, spliced where a re-tokenized stretch
//! agrees with the kept tokens token for token (else the piece is tokenized whole, as before).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Pieces shorter than this are not kept (tokenizing them costs little).
pub(super) const MIN_BYTES: usize = 1024;

/// Bytes of a text's start that find its kept pieces.
const KEY_BYTES: usize = 256;

/// Kept pieces per key: conversations that share their first bytes (a system prompt) each keep
/// their own, the most recent first.
const PER_KEY: usize = 8;

/// Bookkeeping charged per kept piece besides its text, ids and ends.
const ENTRY_OVERHEAD: usize = 96;

/// Bytes before a kept piece's end whose tokens are not trusted (more text can change them: a
/// word continued), and the length of the stretch re-tokenized before the splice.
const MARGIN: usize = 64;

/// A piece's ids and the byte where each of its tokens ends.
#[derive(Debug)]
pub(super) struct Continued {
    text: Box<str>,
    ids: Box<[u32]>,
    ends: Box<[u32]>,
}

impl Continued {
    /// Bytes of the kept text.
    pub(super) fn text_len(&self) -> usize {
        self.text.len()
    }
}

/// Kept pieces by the hash of their first [`KEY_BYTES`], bounded in bytes: two generations,
/// the old one dropped when the young one is full.
pub(super) struct Continuations {
    inner: Mutex<Sets>,
}

#[derive(Default)]
struct Sets {
    young: HashMap<u64, Vec<Arc<Continued>>, rustc_hash::FxBuildHasher>,
    old: HashMap<u64, Vec<Arc<Continued>>, rustc_hash::FxBuildHasher>,
    young_bytes: usize,
    budget: usize,
}

fn entry_bytes(c: &Continued) -> usize {
    c.text.len() + 4 * (c.ids.len() + c.ends.len()) + ENTRY_OVERHEAD
}

/// What a text of `bytes` takes kept, at most (a token per byte).
fn entry_bytes_of(bytes: usize) -> usize {
    bytes.saturating_mul(9).saturating_add(ENTRY_OVERHEAD)
}

fn key(text: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&text.as_bytes()[..KEY_BYTES.min(text.len())])
}

impl Continuations {
    /// Keeps up to `budget` bytes.
    pub(super) fn new(budget: usize) -> Self {
        Continuations {
            inner: Mutex::new(Sets {
                budget,
                ..Sets::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Sets> {
        // A poisoned lock only means another request panicked mid-update; the maps are whole.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a text of `bytes` would be kept (so its tokens' ends are worth finding).
    pub(super) fn would_keep(&self, bytes: usize) -> bool {
        bytes >= MIN_BYTES && entry_bytes_of(bytes) <= self.lock().budget / 2
    }

    /// Keeps `text`'s `ids` and their `ends` (one per id, increasing, the last at most the
    /// text's length), when the text is long enough to be worth it.
    pub(super) fn remember(&self, text: &str, ids: &[u32], ends: &[u32]) {
        if text.len() < MIN_BYTES
            || ids.len() != ends.len()
            || u32::try_from(text.len()).is_err()
            || ends.last().is_some_and(|&e| e as usize > text.len())
        {
            return;
        }
        let entry = Arc::new(Continued {
            text: text.into(),
            ids: ids.into(),
            ends: ends.into(),
        });
        let bytes = entry_bytes(&entry);
        let mut sets = self.lock();
        if bytes > sets.budget / 2 {
            return;
        }
        if sets.young_bytes + bytes > sets.budget / 2 {
            sets.old = std::mem::take(&mut sets.young);
            sets.young_bytes = 0;
        }
        sets.young_bytes += bytes;
        let set = sets.young.entry(key(text)).or_default();
        // A kept piece the new one continues (the same conversation's earlier turn) is no
        // longer needed; its bytes stay counted until the turnover (an overcount only).
        set.retain(|c| !text.starts_with(&*c.text));
        set.insert(0, entry);
        set.truncate(PER_KEY);
    }

    /// The longest kept piece that `piece` starts with and goes beyond.
    pub(super) fn prefix_of(&self, piece: &str) -> Option<Arc<Continued>> {
        if piece.len() < MIN_BYTES {
            return None;
        }
        let k = key(piece);
        let sets = self.lock();
        [sets.young.get(&k), sets.old.get(&k)]
            .into_iter()
            .flatten()
            .flatten()
            .filter(|c| c.text.len() < piece.len() && piece.starts_with(&*c.text))
            .max_by_key(|c| c.text.len())
            .cloned()
    }
}

/// `piece` tokenized from near the end of `from` (a kept piece it starts with): its ids, the
/// end of each, and the bytes tokenized. None when the tokenizer fails, or when the stretch
/// re-tokenized before the splice does not agree with the kept tokens (the tokens near the
/// splice could then depend on what precedes them: the caller tokenizes the piece whole).
pub(super) fn resume(
    tokenizer: &tokenizers::Tokenizer,
    piece: &str,
    from: &Continued,
) -> Option<(Vec<u32>, Vec<u32>, usize)> {
    let splice_limit = from.text.len().checked_sub(MARGIN)?;
    // The splice: the end of the last kept token at least a margin before the kept end.
    let kept = from
        .ends
        .iter()
        .take_while(|&&e| e as usize <= splice_limit)
        .count();
    let splice = *from.ends.get(kept.checked_sub(1)?)? as usize;
    // Re-tokenized from a kept token's end at least a margin before the splice.
    let lead = from
        .ends
        .iter()
        .take_while(|&&e| e as usize + MARGIN <= splice)
        .count();
    let restart = lead
        .checked_sub(1)
        .map_or(0, |last| from.ends[last] as usize);
    if !piece.is_char_boundary(restart) {
        return None;
    }
    let encoding = tokenizer.encode(&piece[restart..], false).ok()?;
    let new_ids = encoding.get_ids();
    let new_ends: Vec<u32> = encoding
        .get_offsets()
        .iter()
        .map(|&(_, end)| (restart + end) as u32)
        .collect();
    // The re-tokenized stretch must end a token at the splice, and agree with the kept
    // tokens in (restart + MARGIN / 2, splice]: ids and boundaries.
    let at = new_ends.iter().position(|&e| e as usize == splice)?;
    let check_from = restart + MARGIN / 2;
    let mut new_k = at;
    let mut old_k = kept - 1;
    loop {
        if new_ids[new_k] != from.ids[old_k] || new_ends[new_k] != from.ends[old_k] {
            return None;
        }
        let start = if new_k == 0 {
            restart
        } else {
            new_ends[new_k - 1] as usize
        };
        if start <= check_from || old_k == 0 {
            break;
        }
        if new_k == 0 {
            return None;
        }
        new_k -= 1;
        old_k -= 1;
    }
    let mut ids = from.ids[..kept].to_vec();
    ids.extend_from_slice(&new_ids[at + 1..]);
    let mut ends = from.ends[..kept].to_vec();
    ends.extend_from_slice(&new_ends[at + 1..]);
    Some((ids, ends, piece.len() - restart))
}
