//! A strict JSON scanner for the routing fields of a client's request (`parse.rs`).
//!
//! It is a fast path in front of `serde_json`, not a replacement: it understands only the
//! common shapes of request bodies and answers `None` for anything else (an escape it does not
//! decode, a duplicate key, an unexpected type, invalid JSON, deep nesting...), and the caller
//! then parses the same bytes with `serde_json`, which decides (and words any error). So for
//! every body it accepts, serde_json accepts it too and extracts the same values; it never has
//! to reproduce serde_json's errors. It allocates only for strings with escapes.
//!
//! Long strings (the prompt) are scanned with SIMD (`memchr`): serde_json's string scan costs
//! about 2 instructions per byte, and parsing the 8 KiB body of a 2k-token chat request took
//! about 1 µs with serde_json against 0.4 µs here (the gap grows with the prompt).

use std::borrow::Cow;

/// Deepest nesting the scanner follows (serde_json's limit is 128; deeper goes to serde_json).
const MAX_DEPTH: u32 = 64;

/// One bit (0x80) per byte of `w` for the bytes that end the simple part of a string (`"`, `\\`,
/// control characters); bytes after the first flagged one may be flagged wrongly (borrows), so
/// only the lowest flag counts.
#[inline]
fn stops(w: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let quote = w ^ (ONES * u64::from(b'"'));
    let backslash = w ^ (ONES * u64::from(b'\\'));
    let control = w.wrapping_sub(ONES * 0x20) & !w;
    let quote = quote.wrapping_sub(ONES) & !quote;
    let backslash = backslash.wrapping_sub(ONES) & !backslash;
    (control | quote | backslash) & (ONES * 0x80)
}

/// Index of the first `"`, `\` or control character at or after `from` (the length if none).
///
/// The first 16 bytes eight at a time (keys and short values end there, and a byte loop's
/// exit branch is what costs), then `memchr2` (SIMD) for the quote or backslash and a
/// branch-free minimum (vectorised) for a control character before it.
#[inline]
fn scan(b: &[u8], from: usize) -> usize {
    const SHORT: usize = 16;
    let rest = &b[from.min(b.len())..];
    let mut i = 0;
    while i < SHORT {
        let Some(word) = rest.get(i..i + 8) else {
            // The end of the text is near: byte by byte.
            let tail = &rest[i..];
            let k = tail
                .iter()
                .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
                .unwrap_or(tail.len());
            return from + i + k;
        };
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        let m = stops(u64::from_le_bytes(w));
        if m != 0 {
            return from + i + (m.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    let long = &rest[SHORT..];
    let end = memchr::memchr2(b'"', b'\\', long).unwrap_or(long.len());
    let body = &long[..end];
    if body.iter().fold(0xff, |m: u8, &c| m.min(c)) < 0x20 {
        return from + SHORT + body.iter().position(|&c| c < 0x20).unwrap_or(end);
    }
    from + SHORT + end
}

/// A cursor over a JSON text. Every method answers `None` when the text is not what it
/// expects; the cursor is then in no useful state (the caller gives up on the fast path).
pub(crate) struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Scanner { b, i: 0 }
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(&c) = self.b.get(self.i) {
            if c == b' ' || c == b'\n' || c == b'\r' || c == b'\t' {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    /// The next byte after whitespace, not consumed.
    #[inline]
    pub(crate) fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.i).copied()
    }

    #[inline]
    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    /// The offset of the cursor in the text.
    pub(crate) fn pos(&self) -> usize {
        self.i
    }

    /// Only whitespace is left.
    pub(crate) fn at_end(&mut self) -> bool {
        self.ws();
        self.i == self.b.len()
    }

    /// Consumes `null` if it is next.
    pub(crate) fn null(&mut self) -> bool {
        self.ws();
        if self.b[self.i.min(self.b.len())..].starts_with(b"null") {
            self.i += 4;
            true
        } else {
            false
        }
    }

    /// A boolean, or `None` for anything else.
    pub(crate) fn boolean(&mut self) -> Option<bool> {
        self.ws();
        let rest = self.b.get(self.i..)?;
        if rest.starts_with(b"true") {
            self.i += 4;
            Some(true)
        } else if rest.starts_with(b"false") {
            self.i += 5;
            Some(false)
        } else {
            None
        }
    }

    /// A non-negative integer written without fraction or exponent that fits a u64.
    pub(crate) fn uint(&mut self) -> Option<u64> {
        self.ws();
        let b = self.b;
        let mut i = self.i;
        let mut v: u64 = 0;
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                while let Some(&c @ b'0'..=b'9') = b.get(i) {
                    v = v.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
                    i += 1;
                }
            }
            _ => return None,
        }
        if matches!(b.get(i), Some(b'.' | b'e' | b'E' | b'0'..=b'9')) {
            return None;
        }
        self.i = i;
        Some(v)
    }

    /// A string: borrowed from the text when it has no escapes, decoded otherwise (`\u`
    /// escapes are left to serde_json). Checked to be UTF-8, as serde_json does.
    pub(crate) fn string(&mut self) -> Option<Cow<'a, str>> {
        if !self.eat(b'"') {
            return None;
        }
        let b = self.b;
        let start = self.i;
        let end = scan(b, start);
        match b.get(end) {
            Some(b'"') => {
                self.i = end + 1;
                // SIMD validation: std's took as long as the scan itself on a long prompt.
                return simdutf8::basic::from_utf8(&b[start..end])
                    .ok()
                    .map(Cow::Borrowed);
            }
            Some(b'\\') => {}
            _ => return None,
        }
        let mut out: Vec<u8> = Vec::with_capacity(end - start + 16);
        let mut seg = start;
        let mut esc = end;
        loop {
            out.extend_from_slice(&b[seg..esc]);
            out.push(match b.get(esc + 1)? {
                b'"' => b'"',
                b'\\' => b'\\',
                b'/' => b'/',
                b'b' => 0x08,
                b'f' => 0x0c,
                b'n' => b'\n',
                b'r' => b'\r',
                b't' => b'\t',
                _ => return None,
            });
            seg = esc + 2;
            let e = scan(b, seg);
            match b.get(e) {
                Some(b'"') => {
                    out.extend_from_slice(&b[seg..e]);
                    self.i = e + 1;
                    return String::from_utf8(out).ok().map(Cow::Owned);
                }
                Some(b'\\') => esc = e,
                _ => return None,
            }
        }
    }

    /// `null` (as `Some(None)`) or a string.
    pub(crate) fn opt_string(&mut self) -> Option<Option<Cow<'a, str>>> {
        if self.null() {
            Some(None)
        } else {
            self.string().map(Some)
        }
    }

    /// `null` (as `Some(None)`) or an integer as [`Self::uint`] reads it.
    pub(crate) fn opt_uint(&mut self) -> Option<Option<u64>> {
        if self.null() {
            Some(None)
        } else {
            self.uint().map(Some)
        }
    }

    /// Iterates an object's members: `member` gets the key (without escapes, checked to be
    /// UTF-8) with the cursor at the value, which it must consume.
    pub(crate) fn object(
        &mut self,
        mut member: impl FnMut(&mut Self, &'a [u8]) -> Option<()>,
    ) -> Option<()> {
        if !self.eat(b'{') {
            return None;
        }
        if self.eat(b'}') {
            return Some(());
        }
        loop {
            if !self.eat(b'"') {
                return None;
            }
            let start = self.i;
            let end = scan(self.b, start);
            if self.b.get(end) != Some(&b'"') {
                return None;
            }
            let key = &self.b[start..end];
            if !key.is_ascii() && std::str::from_utf8(key).is_err() {
                return None;
            }
            self.i = end + 1;
            if !self.eat(b':') {
                return None;
            }
            self.ws();
            member(self, key)?;
            if self.eat(b',') {
                continue;
            }
            return self.eat(b'}').then_some(());
        }
    }

    /// Iterates an array's elements: `element` is called with the cursor at each, which it
    /// must consume.
    pub(crate) fn array(&mut self, mut element: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        if !self.eat(b'[') {
            return None;
        }
        if self.eat(b']') {
            return Some(());
        }
        loop {
            self.ws();
            element(self)?;
            if self.eat(b',') {
                continue;
            }
            return self.eat(b']').then_some(());
        }
    }

    /// Skips one value of any type, checked at least as strictly as serde_json checks a value
    /// it ignores.
    pub(crate) fn skip(&mut self) -> Option<()> {
        self.skip_at(0)
    }

    fn skip_at(&mut self, depth: u32) -> Option<()> {
        match self.peek()? {
            b'"' => {
                self.i += 1;
                self.skip_string_body()
            }
            b'{' => {
                if depth >= MAX_DEPTH {
                    return None;
                }
                self.i += 1;
                if self.eat(b'}') {
                    return Some(());
                }
                loop {
                    if !self.eat(b'"') {
                        return None;
                    }
                    self.skip_string_body()?;
                    if !self.eat(b':') {
                        return None;
                    }
                    self.skip_at(depth + 1)?;
                    if self.eat(b',') {
                        continue;
                    }
                    return self.eat(b'}').then_some(());
                }
            }
            b'[' => {
                if depth >= MAX_DEPTH {
                    return None;
                }
                self.array(|s| s.skip_at(depth + 1))
            }
            b't' | b'f' => self.boolean().map(|_| ()),
            b'n' => self.null().then_some(()),
            b'-' | b'0'..=b'9' => self.skip_number(),
            _ => None,
        }
    }

    /// The rest of a string after its opening quote (escapes checked, not decoded).
    fn skip_string_body(&mut self) -> Option<()> {
        let b = self.b;
        loop {
            let e = scan(b, self.i);
            match b.get(e) {
                Some(b'"') => {
                    self.i = e + 1;
                    return Some(());
                }
                Some(b'\\') => match b.get(e + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.i = e + 2,
                    b'u' => {
                        let hex = b.get(e + 2..e + 6)?;
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return None;
                        }
                        self.i = e + 6;
                    }
                    _ => return None,
                },
                _ => return None,
            }
        }
    }

    /// A number by JSON's grammar.
    fn skip_number(&mut self) -> Option<()> {
        let b = self.b;
        let mut i = self.i;
        let digits = |i: &mut usize| {
            let s = *i;
            while matches!(b.get(*i), Some(b'0'..=b'9')) {
                *i += 1;
            }
            *i > s
        };
        if b.get(i) == Some(&b'-') {
            i += 1;
        }
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                digits(&mut i);
            }
            _ => return None,
        }
        if b.get(i) == Some(&b'.') {
            i += 1;
            if !digits(&mut i) {
                return None;
            }
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(b.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            if !digits(&mut i) {
                return None;
            }
        }
        self.i = i;
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Skips a whole document with the scanner; `Some` only for a single valid value.
    fn skims(text: &[u8]) -> bool {
        let mut s = Scanner::new(text);
        s.skip().is_some() && s.at_end()
    }

    #[test]
    fn scan_agrees_with_a_byte_loop() {
        let mut r = gen::Rng(0x5ca7_0001);
        for _ in 0..20_000 {
            let n = r.below(40);
            let v: Vec<u8> = (0..n)
                .map(|_| match r.below(20) {
                    0 => b'"',
                    1 => b'\\',
                    2 => r.below(0x20) as u8,
                    3 => 0x80 + r.below(0x80) as u8,
                    _ => 0x20 + r.below(0x60) as u8,
                })
                .collect();
            let from = r.below(n + 1);
            let want = v[from..]
                .iter()
                .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
                .map_or(n, |k| from + k);
            assert_eq!(scan(&v, from), want, "{v:?} from {from}");
        }
    }

    #[test]
    fn scan_finds_quotes_escapes_and_control_characters() {
        for n in [0usize, 1, 15, 16, 31, 32, 33, 64, 100, 1000] {
            for stop in [b'"', b'\\', b'\n', 0x1f, 0] {
                let mut v = vec![b'a'; n];
                v.push(stop);
                v.extend_from_slice(b"tail\x01\"");
                assert_eq!(scan(&v, 0), n, "n={n} stop={stop}");
                assert_eq!(scan(&v, n), n);
            }
            // A control character before the quote ends the simple part first.
            let mut v = vec![b'a'; n];
            v.extend_from_slice("é\t\"".as_bytes());
            assert_eq!(scan(&v, 0), n + 2);
            assert_eq!(scan(&vec![b'a'; n], 0), n);
        }
    }

    #[test]
    fn strings_borrow_or_decode() {
        let mut s = Scanner::new(br#""plain" "a\nb\"c\\d\/e\tf" "\u0041" "caf\u00e9""#);
        assert!(matches!(s.string(), Some(Cow::Borrowed("plain"))));
        assert_eq!(s.string().as_deref(), Some("a\nb\"c\\d/e\tf"));
        assert_eq!(s.string(), None, "\\u escapes go to serde_json");
        let mut s = Scanner::new("\"é\"".as_bytes());
        assert_eq!(s.string().as_deref(), Some("é"));
        assert_eq!(Scanner::new(b"\"a\x01\"").string(), None);
        assert_eq!(Scanner::new(b"\"\xff\"").string(), None);
        assert_eq!(Scanner::new(b"\"open").string(), None);
        assert_eq!(Scanner::new(br#""bad \x""#).string(), None);
    }

    #[test]
    fn numbers() {
        for (t, v) in [
            ("0", Some(0)),
            ("7", Some(7)),
            ("18446744073709551615", Some(u64::MAX)),
        ] {
            assert_eq!(Scanner::new(t.as_bytes()).uint(), v, "{t}");
        }
        for t in ["-1", "1.0", "1e3", "01", "18446744073709551616", "x", ""] {
            assert_eq!(Scanner::new(t.as_bytes()).uint(), None, "{t}");
        }
    }

    #[test]
    fn skip_accepts_only_what_serde_json_accepts() {
        let good: &[&[u8]] = &[
            b"0",
            b"-0.5e+10",
            b"1E5",
            b" [1, 2.5, \"x\", null, true, false, {}, []] ",
            br#"{"a":{"b":[{"c":"\u00e9\n"}]},"":0}"#,
            "\"\u{fffd}\"".as_bytes(),
        ];
        for t in good {
            assert!(skims(t), "{}", String::from_utf8_lossy(t));
            serde_json::from_slice::<serde::de::IgnoredAny>(t).unwrap();
        }
        let bad: &[&[u8]] = &[
            b"",
            b"01",
            b"1.",
            b"-",
            b".5",
            b"1e",
            b"+1",
            b"[1,]",
            b"{\"a\":1,}",
            b"{\"a\" 1}",
            b"{a:1}",
            b"[1 2]",
            b"\"\\x\"",
            b"\"\\u12g4\"",
            b"\"a\tb\"",
            b"nul",
            b"tru",
            b"NaN",
            b"[1] 2",
            b"\x0c1",
        ];
        for t in bad {
            assert!(!skims(t), "{}", String::from_utf8_lossy(t));
        }
        let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
        assert!(!skims(deep.as_bytes()), "deep nesting goes to serde_json");
        let ok = format!("{}{}", "[".repeat(60), "]".repeat(60));
        assert!(skims(ok.as_bytes()));
    }

    #[test]
    fn objects_and_arrays() {
        let mut keys = Vec::new();
        let mut s = Scanner::new(br#" { "a" : 1 , "b":[true,null] } "#);
        s.object(|s, k| {
            keys.push(k);
            s.skip()
        })
        .unwrap();
        assert!(s.at_end());
        assert_eq!(keys, [b"a", b"b"]);
        let mut n = 0;
        Scanner::new(b"[[],{},3]")
            .array(|s| {
                n += 1;
                s.skip()
            })
            .unwrap();
        assert_eq!(n, 3);
        assert!(Scanner::new(br#"{"k\u0041":1}"#)
            .object(|s, _| s.skip())
            .is_none());
    }
}

/// Random JSON texts for the tests that hold the fast paths to serde_json's results.
#[cfg(test)]
pub(crate) mod gen {
    /// xorshift64*: deterministic, no dependency.
    pub(crate) struct Rng(pub(crate) u64);

    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        pub(crate) fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        /// True `percent` % of the time.
        pub(crate) fn chance(&mut self, percent: usize) -> bool {
            self.below(100) < percent
        }

        pub(crate) fn pick<'a>(&mut self, of: &[&'a str]) -> &'a str {
            of[self.below(of.len())]
        }
    }

    fn ws(r: &mut Rng) -> &'static str {
        if r.chance(80) {
            ""
        } else if r.chance(98) {
            r.pick(&[" ", "\n", "\t", "\r\n  "])
        } else {
            "\u{c}"
        }
    }

    /// A string literal, mostly valid, sometimes long enough for the chunked scan.
    pub(crate) fn string(r: &mut Rng) -> String {
        let mut s = String::from("\"");
        let pieces = if r.chance(10) { 40 } else { r.below(5) };
        for _ in 0..pieces {
            s.push_str(if r.chance(95) {
                r.pick(&[
                    "abc",
                    " ",
                    "user",
                    "hello world ",
                    "0123456789abcdef0123456789abcdef",
                ])
            } else {
                r.pick(&[
                    "\\n",
                    "\\\"",
                    "\\\\",
                    "\\/",
                    "\\t",
                    "\\b",
                    "\\f",
                    "\\r",
                    "\\u0041",
                    "\\ud83d\\ude00",
                    "\\udc00",
                    "\\ud800",
                    "é",
                    "\u{1F600}",
                    "\\x",
                    "\u{1}",
                    "\\u12g4",
                    "\\",
                    "\u{7f}",
                ])
            });
        }
        if r.chance(98) {
            s.push('"');
        }
        s
    }

    pub(crate) fn number(r: &mut Rng) -> &'static str {
        r.pick(&[
            "0",
            "7",
            "4",
            "256",
            "-1",
            "-0",
            "1.5",
            "1e3",
            "2E-2",
            "4294967295",
            "4294967296",
            "18446744073709551615",
            "18446744073709551616",
            "01",
            "1.",
            "-",
            "1e",
            "3.0",
        ])
    }

    pub(crate) fn value(r: &mut Rng, depth: u32) -> String {
        match r.below(if depth > 3 { 5 } else { 7 }) {
            0 | 1 => string(r),
            2 => number(r).to_string(),
            3 => r
                .pick(&["true", "false", "null", "nul", "True"])
                .to_string(),
            4 => r
                .pick(&["[]", "{}", "[1,]", "{\"a\":1,}", "[[[]]]"])
                .to_string(),
            5 => {
                let n = r.below(4);
                let items: Vec<String> = (0..n).map(|_| value(r, depth + 1)).collect();
                format!("[{}{}]", items.join(","), ws(r))
            }
            _ => {
                let n = r.below(4);
                let items: Vec<String> = (0..n)
                    .map(|_| format!("{}:{}{}", key(r, &[]), ws(r), value(r, depth + 1)))
                    .collect();
                format!("{{{}}}", items.join(","))
            }
        }
    }

    /// A chat role, sometimes odd.
    pub(crate) fn pick_role(r: &mut Rng) -> String {
        r.pick(&[
            "\"user\"",
            "\"system\"",
            "\"assistant\"",
            "null",
            "\"r\\u00e9le\"",
        ])
        .to_string()
    }

    /// A key: one of `known` most of the time, else another (sometimes escaped) one.
    pub(crate) fn key(r: &mut Rng, known: &[&str]) -> String {
        if !known.is_empty() && r.chance(75) {
            if r.chance(3) {
                return "\"mod\\u0065l\"".to_string();
            }
            return format!("\"{}\"", r.pick(known));
        }
        format!(
            "\"{}\"",
            r.pick(&["temperature", "n", "x", "", "é", "a\\nb", "tools"])
        )
    }

    /// An object of `fields` members whose values come from `field_value(rng, key)`.
    pub(crate) fn object(
        r: &mut Rng,
        known: &[&str],
        fields: usize,
        mut field_value: impl FnMut(&mut Rng, &str) -> String,
    ) -> String {
        let items: Vec<String> = (0..fields)
            .map(|_| {
                let k = key(r, known);
                let v = field_value(r, k.trim_matches('"'));
                format!("{}{k}{}:{}{v}{}", ws(r), ws(r), ws(r), ws(r))
            })
            .collect();
        format!("{}{{{}}}{}", ws(r), items.join(","), ws(r))
    }

    /// Random edits of a text: the fast path must still never disagree with serde_json.
    pub(crate) fn mutate(r: &mut Rng, text: &[u8]) -> Vec<u8> {
        let mut out = text.to_vec();
        for _ in 0..1 + r.below(3) {
            if out.is_empty() {
                break;
            }
            let at = r.below(out.len());
            const BYTES: &[u8] = b"{}[]\",:\\ 0a-.en\x01\xff";
            let byte = BYTES[r.below(BYTES.len())];
            match r.below(3) {
                0 => out[at] = byte,
                1 => out.insert(at, byte),
                _ => {
                    out.remove(at);
                }
            }
        }
        out
    }
}
