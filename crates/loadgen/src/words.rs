//! Prompt text in four-byte words (a space and three letters): one token each for the
//! emulator's tokenizer, and inside the vocabulary of the tokenizer it writes, at any place in
//! a prompt (the emulator's own words, which begin with their space: text that starts right
//! after a chat marker cut as a special token is chunked from its first byte).

/// A space and three letters: four bytes, one emulator token each (the first of the
/// emulator's output words).
const WORDS: [&str; 16] = [
    " the", " and", " for", " you", " are", " was", " but", " not", " all", " can", " had", " her",
    " one", " our", " out", " day",
];

/// `n` in base 16, eight digits, lowest first, one word a digit: prompts numbered apart differ
/// from their first word.
pub fn spelled(n: u64) -> String {
    (0..8)
        .map(|digit| WORDS[(n >> (4 * digit)) as usize % WORDS.len()])
        .collect()
}

/// The user message: `words` four-byte words in a fixed order that does not repeat one block.
pub fn prompt(words: usize) -> String {
    let mut s = String::with_capacity(words * 4);
    for i in 0..words {
        s.push_str(WORDS[(i * 7 + i / 16) % WORDS.len()]);
    }
    s
}
