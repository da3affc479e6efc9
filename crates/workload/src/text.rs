//! Deterministic synthetic text under the project's token convention.
//!
//! The engine model's tokenizer counts one token per 4 bytes of UTF-8 text
//! (a trailing partial chunk is one more token). Generated text is therefore
//! made of 4-byte ASCII words — three lowercase letters and a space, e.g.
//! `"kab "` — so a text of `N` tokens is exactly `4N` bytes, and segments can be
//! concatenated without changing the count of the whole.
//!
//! Words come from a SplitMix64 stream seeded by a 64-bit key rather than from
//! `rand`, so the bytes stay identical across `rand` versions and platforms.
//! The stream for a key is consumed word by word, so `words(key, n)` is always a
//! prefix of `words(key, m)` for `n <= m`: cutting a block short yields exactly
//! the head of the full block.

/// Bytes per token in the shared tokenizer convention.
pub const TOKEN_BYTES: usize = 4;

/// Number of distinct words (26³ three-letter words).
const VOCAB: u64 = 26 * 26 * 26;

/// Letters words are made of.
const LETTERS: &[u8; 26] = b"abcdefghijklmnopqrstuvwxyz";

/// Tokens in a text of `bytes` bytes: `ceil(bytes / 4)`.
pub fn text_tokens(bytes: usize) -> usize {
    bytes.div_ceil(TOKEN_BYTES)
}

/// One step of SplitMix64: advances `state` and returns a well-mixed output.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes two words into one key (SplitMix64 finaliser over a combination).
///
/// Used to derive independent keys from a seed, a domain tag and indices, so
/// that e.g. trace block 7 and chat message 7 never get the same text.
pub fn mix(a: u64, b: u64) -> u64 {
    let mut s = a ^ b.wrapping_mul(0xD6E8_FEB8_6659_FD93).rotate_left(32);
    splitmix64(&mut s)
}

/// Derives a key from a seed, a domain tag and an index.
pub fn key(seed: u64, domain: u64, index: u64) -> u64 {
    mix(mix(seed, domain), index)
}

/// FNV-1a hash of a string: a stable key for names such as session ids
/// (std's `DefaultHasher` is not guaranteed stable across Rust releases).
pub fn hash_str(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// Appends `tokens` deterministic words derived from `key` to `out`.
pub fn push_words(out: &mut String, key: u64, tokens: usize) {
    out.reserve(tokens * TOKEN_BYTES);
    let mut state = key;
    let mut left = tokens;
    while left > 0 {
        let r = splitmix64(&mut state);
        // Four 16-bit lanes per draw; scaling by VOCAB >> 16 keeps the bias
        // below 1/3 of a percent, irrelevant for filler text.
        for lane in 0..4 {
            if left == 0 {
                break;
            }
            let w = (((r >> (16 * lane)) & 0xFFFF) * VOCAB) >> 16;
            out.push(LETTERS[(w / 676) as usize] as char);
            out.push(LETTERS[((w / 26) % 26) as usize] as char);
            out.push(LETTERS[(w % 26) as usize] as char);
            out.push(' ');
            left -= 1;
        }
    }
}

/// A fresh string of `tokens` deterministic words derived from `key`.
pub fn words(key: u64, tokens: usize) -> String {
    let mut s = String::with_capacity(tokens * TOKEN_BYTES);
    push_words(&mut s, key, tokens);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn text_tokens_rounds_up() {
        assert_eq!(text_tokens(0), 0);
        assert_eq!(text_tokens(1), 1);
        assert_eq!(text_tokens(4), 1);
        assert_eq!(text_tokens(5), 2);
        assert_eq!(text_tokens(2048), 512);
    }

    #[test]
    fn words_look_like_words() {
        let t = words(42, 100);
        for w in t.as_bytes().chunks(4) {
            assert!(w[..3].iter().all(u8::is_ascii_lowercase), "{w:?}");
            assert_eq!(w[3], b' ');
        }
        // Not a constant stream: a 100-word text uses many distinct words.
        let distinct: std::collections::HashSet<_> = t.as_bytes().chunks(4).collect();
        assert!(distinct.len() > 90, "{}", distinct.len());
    }

    #[test]
    fn mix_is_order_sensitive() {
        assert_ne!(mix(1, 2), mix(2, 1));
        assert_ne!(key(0, 1, 2), key(0, 2, 1));
    }

    proptest! {
        #[test]
        fn n_tokens_is_4n_bytes(key in any::<u64>(), n in 0usize..3000) {
            let t = words(key, n);
            prop_assert_eq!(t.len(), 4 * n);
            prop_assert!(t.is_ascii());
            prop_assert_eq!(text_tokens(t.len()), n);
        }

        #[test]
        fn shorter_is_prefix_of_longer(key in any::<u64>(), a in 0usize..600, b in 0usize..600) {
            let (n, m) = (a.min(b), a.max(b));
            let long = words(key, m);
            prop_assert!(long.starts_with(&words(key, n)));
        }

        #[test]
        fn different_keys_differ(k1 in any::<u64>(), k2 in any::<u64>()) {
            prop_assume!(k1 != k2);
            prop_assert_ne!(words(k1, 64), words(k2, 64));
        }
    }
}
