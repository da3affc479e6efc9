//! A deterministic stand-in tokenizer.
//!
//! Real tokenizers are large and model-specific; routing only needs token
//! *counts* and *identity* (for prefix caching) to be stable. So a token here
//! is a 4-byte chunk of the UTF-8 text, its id the little-endian `u32` of the
//! zero-padded chunk. Generated tokens come from a fixed vocabulary of
//! 4-byte words, so their ids are themselves valid chunk ids:
//! `encode(&decode_output(ids)) == ids` for generated ids, which keeps
//! multi-turn prompts that quote earlier answers cache-friendly.

/// Bytes per token.
pub const BYTES_PER_TOKEN: usize = 4;

/// The words generated output is drawn from; each is exactly 4 bytes.
const VOCAB: [&str; 64] = [
    " the", " and", " for", " you", " are", " was", " but", " not", " all", " can", " had", " her",
    " one", " our", " out", " day", " get", " has", " him", " his", " how", " man", " new", " now",
    " old", " see", " two", " way", " who", " boy", " did", " its", " let", " put", " say", " she",
    " too", " use", " sky", " sun", " sea", " red", " big", " map", " run", " cat", " dog", " art",
    " key", " law", " oil", " joy", " ice", " air", " arm", " box", " car", " cup", " end", " eye",
    " far", " fun", " hot", " job",
];

/// The token id of each `VOCAB` word, computed at compile time (generating a
/// token is on the engine's hot path: every output block is hashed).
const VOCAB_IDS: [u32; 64] = {
    let mut ids = [0u32; 64];
    let mut i = 0;
    while i < VOCAB.len() {
        let w = VOCAB[i].as_bytes();
        ids[i] = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        i += 1;
    }
    ids
};

/// The vocabulary generated output is drawn from: each word (4 bytes) with its token id.
/// Text made of these words tokenizes to their ids (what a tokenizer.json of this vocabulary
/// reproduces, see the emulator's `tokenizer_json`).
pub fn vocabulary() -> impl Iterator<Item = (&'static str, u32)> {
    VOCAB.iter().copied().zip(VOCAB_IDS)
}

/// Tokenize `text`: one token per 4-byte chunk, the last partial chunk zero-padded.
pub fn encode(text: &str) -> Vec<u32> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(count(text));
    let mut chunks = bytes.chunks_exact(BYTES_PER_TOKEN);
    for c in &mut chunks {
        out.push(u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut pad = [0u8; BYTES_PER_TOKEN];
        pad[..rest.len()].copy_from_slice(rest);
        out.push(u32::from_le_bytes(pad));
    }
    out
}

/// Number of tokens `encode(text)` would produce, without allocating.
pub fn count(text: &str) -> usize {
    text.len().div_ceil(BYTES_PER_TOKEN)
}

/// The id of the `position`-th generated token of request `request_id`.
///
/// A pure function of its arguments, so a preempted request regenerates the
/// same text and a replay reproduces it exactly.
pub fn output_token(request_id: u64, position: u32) -> u32 {
    let h = splitmix64(request_id ^ (u64::from(position)).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    VOCAB_IDS[(h % VOCAB_IDS.len() as u64) as usize]
}

/// Text for token ids: each id's little-endian bytes, with the zero padding
/// of a partial chunk dropped, decoded as (lossy) UTF-8.
///
/// Works for generated ids and for any ids produced by [`encode`].
pub fn decode_output(ids: &[u32]) -> String {
    let mut bytes = Vec::with_capacity(ids.len() * BYTES_PER_TOKEN);
    for id in ids {
        let b = id.to_le_bytes();
        // Zero bytes only occur as padding of the final partial chunk (or as
        // NULs in the input, which we accept losing).
        let len = b.iter().rposition(|&x| x != 0).map_or(0, |p| p + 1);
        bytes.extend_from_slice(&b[..len]);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// SplitMix64 finaliser: a cheap, well-mixed, deterministic hash of a u64.
fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn vocab_words_are_four_bytes() {
        for w in VOCAB {
            assert_eq!(w.len(), BYTES_PER_TOKEN, "{w:?}");
        }
    }

    #[test]
    fn vocab_ids_are_the_words_encoded() {
        for (w, &id) in VOCAB.iter().zip(&VOCAB_IDS) {
            assert_eq!(encode(w), vec![id], "{w:?}");
        }
    }

    #[test]
    fn encode_chunks_and_pads() {
        assert_eq!(encode(""), Vec::<u32>::new());
        assert_eq!(encode("abcd"), vec![u32::from_le_bytes(*b"abcd")]);
        assert_eq!(
            encode("abcdef"),
            vec![
                u32::from_le_bytes(*b"abcd"),
                u32::from_le_bytes([b'e', b'f', 0, 0])
            ]
        );
    }

    #[test]
    fn output_tokens_are_deterministic_and_varied() {
        let a: Vec<u32> = (0..50).map(|p| output_token(7, p)).collect();
        let b: Vec<u32> = (0..50).map(|p| output_token(7, p)).collect();
        assert_eq!(a, b);
        let c: Vec<u32> = (0..50).map(|p| output_token(8, p)).collect();
        assert_ne!(a, c);
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 10);
    }

    #[test]
    fn generated_text_round_trips() {
        let ids: Vec<u32> = (0..20).map(|p| output_token(3, p)).collect();
        let text = decode_output(&ids);
        assert_eq!(text.len(), 80);
        assert_eq!(encode(&text), ids);
    }

    proptest! {
        #[test]
        fn count_matches_encode(s in ".{0,64}") {
            prop_assert_eq!(count(&s), encode(&s).len());
        }

        #[test]
        fn decode_inverts_encode_without_nul(s in "[^\u{0}]{0,64}") {
            prop_assert_eq!(decode_output(&encode(&s)), s);
        }
    }
}
