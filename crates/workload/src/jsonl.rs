//! Workloads as JSONL files: one [`Request`] a line.
//!
//! Lines are self-contained (the full prompt text is written out), so any
//! tool can read them. On read, segments and other strings are interned: each
//! distinct string seen recently is one `Arc<str>`, so a file of a million
//! requests sharing a few system prompts reads back sharing them again.
//! The interner is bounded like the trace's block cache (see
//! [`crate::cache`]), so streaming a file never holds more than that many
//! strings beyond the requests the caller keeps.

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufRead, BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Deserializer};

use crate::cache::GenCache;
use crate::error::{Result, WorkloadError};
use crate::request::{ChatMessage, Prompt, Request, Role};
use crate::source::open_lines;

/// Default most distinct strings the reader's interner keeps.
pub const DEFAULT_INTERN_CAPACITY: usize = 65_536;

/// Writes `requests` as JSONL to `out`; returns how many were written.
pub fn write_jsonl<W: Write>(out: W, requests: impl IntoIterator<Item = Request>) -> Result<u64> {
    let mut out = BufWriter::new(out);
    let mut n = 0;
    for r in requests {
        serde_json::to_writer(&mut out, &r).map_err(|source| WorkloadError::Json {
            line: n + 1,
            source,
        })?;
        out.write_all(b"\n")?;
        n += 1;
    }
    out.flush()?;
    Ok(n)
}

/// Writes `requests` to the file at `path` (created or truncated).
pub fn write_jsonl_file(path: &Path, requests: impl IntoIterator<Item = Request>) -> Result<u64> {
    let file = File::create(path).map_err(|source| WorkloadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    write_jsonl(file, requests)
}

/// Opens a JSONL workload file (`.jsonl`, or `.jsonl.xz` read into memory).
pub fn open_jsonl(path: &Path) -> Result<JsonlReader<Box<dyn BufRead + Send>>> {
    Ok(JsonlReader::new(open_lines(path)?))
}

/// Reads a whole JSONL workload file into memory, interning strings.
pub fn read_jsonl_file(path: &Path) -> Result<Vec<Request>> {
    open_jsonl(path)?.collect()
}

/// Streaming reader of JSONL requests with string interning.
pub struct JsonlReader<R> {
    input: R,
    line: String,
    line_no: u64,
    strings: GenCache<Arc<str>, Arc<str>>,
}

impl<R: BufRead> JsonlReader<R> {
    /// Reads from `input` with the default interner size.
    pub fn new(input: R) -> Self {
        Self::with_intern_capacity(input, DEFAULT_INTERN_CAPACITY)
    }

    /// Reads from `input`, interning at most `capacity` distinct strings.
    pub fn with_intern_capacity(input: R, capacity: usize) -> Self {
        Self {
            input,
            line: String::new(),
            line_no: 0,
            strings: GenCache::new(capacity.max(2)),
        }
    }

    /// The shared `Arc` for `s`.
    fn intern(&mut self, s: &str) -> Arc<str> {
        self.strings.get_or_insert_with(s, || {
            let a: Arc<str> = Arc::from(s);
            (a.clone(), a)
        })
    }

    /// Converts a parsed line into a request with interned strings.
    fn convert(&mut self, rec: RecordIn<'_>) -> Request {
        let prompt = match rec.prompt {
            PromptIn::Text(segs) => Prompt::Text(segs.iter().map(|s| self.intern(&s.0)).collect()),
            PromptIn::Chat(msgs) => Prompt::Chat(
                msgs.iter()
                    .map(|m| ChatMessage {
                        role: m.role,
                        content: self.intern(&m.content.0),
                    })
                    .collect(),
            ),
        };
        Request {
            id: rec.id,
            arrival_s: rec.arrival_s,
            model: self.intern(&rec.model.0),
            adapter: rec.adapter.map(|s| self.intern(&s.0)),
            prompt,
            max_tokens: rec.max_tokens,
            session_id: rec.session_id.map(|s| self.intern(&s.0)),
            cache_salt: rec.cache_salt.map(|s| self.intern(&s.0)),
        }
    }
}

impl<R: BufRead> Iterator for JsonlReader<R> {
    type Item = Result<Request>;

    fn next(&mut self) -> Option<Result<Request>> {
        loop {
            self.line.clear();
            match self.input.read_line(&mut self.line) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(e) => return Some(Err(e.into())),
            }
            self.line_no += 1;
            if self.line.trim().is_empty() {
                continue;
            }
            // Parse borrowing from the line buffer; take it out so `self`
            // stays free for interning, then put it back for reuse.
            let line = std::mem::take(&mut self.line);
            let parsed = serde_json::from_str::<RecordIn<'_>>(&line)
                .map(|rec| self.convert(rec))
                .map_err(|source| WorkloadError::Json {
                    line: self.line_no,
                    source,
                });
            self.line = line;
            return Some(parsed);
        }
    }
}

/// A string borrowed from the input when it has no escapes, else owned.
///
/// `Cow<str>` alone always deserialises owned inside `Vec`/`Option`, which
/// would allocate every segment just to find its interned twin.
struct Str<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = Str<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> std::result::Result<Str<'a>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> std::result::Result<Str<'a>, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> std::result::Result<Str<'a>, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(std::marker::PhantomData))
    }
}

/// Line shape on input, mirroring [`Request`]'s serde form.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordIn<'a> {
    id: u64,
    arrival_s: f64,
    #[serde(borrow)]
    model: Str<'a>,
    #[serde(borrow, default)]
    adapter: Option<Str<'a>>,
    #[serde(borrow)]
    prompt: PromptIn<'a>,
    max_tokens: u32,
    #[serde(borrow, default)]
    session_id: Option<Str<'a>>,
    #[serde(borrow, default)]
    cache_salt: Option<Str<'a>>,
}

/// Prompt shape on input.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum PromptIn<'a> {
    Text(#[serde(borrow)] Vec<Str<'a>>),
    Chat(#[serde(borrow)] Vec<MessageIn<'a>>),
}

/// Chat message shape on input.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MessageIn<'a> {
    role: Role,
    #[serde(borrow)]
    content: Str<'a>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ChatSpec;
    use crate::sampling::Count;
    use crate::shared_prefix::SharedPrefixSpec;
    use proptest::prelude::*;

    fn roundtrip(reqs: Vec<Request>) -> (Vec<u8>, Vec<Request>) {
        let mut buf = Vec::new();
        let n = write_jsonl(&mut buf, reqs.iter().cloned()).unwrap();
        assert_eq!(n, reqs.len() as u64);
        let back: Vec<Request> = JsonlReader::new(buf.as_slice())
            .collect::<Result<_>>()
            .unwrap();
        (buf, back)
    }

    #[test]
    fn reading_reshares_segments() {
        let reqs: Vec<Request> = SharedPrefixSpec {
            num_groups: 2,
            prompts_per_group: 5,
            system_prompt_len: 100,
            question_len: 10,
            ..Default::default()
        }
        .build(0)
        .unwrap()
        .collect();
        let (_, back) = roundtrip(reqs.clone());
        assert_eq!(back, reqs);
        let firsts: Vec<Arc<str>> = back
            .iter()
            .map(|r| match &r.prompt {
                Prompt::Text(s) => s[0].clone(),
                Prompt::Chat(_) => unreachable!(),
            })
            .collect();
        let mut distinct: Vec<*const u8> = firsts.iter().map(|a| a.as_ptr()).collect();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 2, "one allocation per system prompt");
        assert!(Arc::ptr_eq(&back[0].model, &back[9].model));
    }

    #[test]
    fn escapes_and_optional_fields() {
        let r = Request {
            id: 1,
            arrival_s: 0.1 + 0.2,
            model: Arc::from("m\"odel"),
            adapter: Some(Arc::from("lora-1")),
            prompt: Prompt::Chat(vec![ChatMessage {
                role: Role::Assistant,
                content: Arc::from("line\nbreak ünïcode"),
            }]),
            max_tokens: 9,
            session_id: Some(Arc::from("s")),
            cache_salt: Some(Arc::from("tenant-a")),
        };
        let (_, back) = roundtrip(vec![r.clone()]);
        assert_eq!(back, [r]);
    }

    #[test]
    fn errors_carry_line_numbers() {
        let input = b"{\"id\":0,\"arrival_s\":0,\"model\":\"m\",\"prompt\":{\"text\":[]},\"max_tokens\":1}\n\n{oops\n";
        let out: Vec<Result<Request>> = JsonlReader::new(&input[..]).collect();
        assert!(out[0].is_ok());
        match &out[1] {
            Err(WorkloadError::Json { line: 3, .. }) => {}
            other => panic!("{other:?}"),
        }
        let unknown = b"{\"id\":0,\"arrival_s\":0,\"model\":\"m\",\"prompt\":{\"text\":[]},\"max_tokens\":1,\"bogus\":2}\n";
        assert!(JsonlReader::new(&unknown[..]).next().unwrap().is_err());
    }

    #[test]
    fn file_roundtrip() {
        let dir = std::env::temp_dir().join(format!("sy-wl-jsonl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("w.jsonl");
        let reqs: Vec<Request> = ChatSpec {
            sessions: 3,
            turns: Count::Fixed(3),
            ..Default::default()
        }
        .build(1)
        .unwrap()
        .collect();
        write_jsonl_file(&p, reqs.clone()).unwrap();
        assert_eq!(read_jsonl_file(&p).unwrap(), reqs);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    proptest! {
        #[test]
        fn roundtrip_is_exact(seed in any::<u64>(), sessions in 1u64..5) {
            let reqs: Vec<Request> = ChatSpec {
                sessions,
                turns: Count::Uniform { min: 1, max: 4 },
                system_prompt_len: 8,
                user_len: Count::Uniform { min: 0, max: 9 },
                assistant_len: Count::Fixed(5),
                arrivals: crate::ArrivalProcess::Poisson { rate: 1.7 },
                ..Default::default()
            }
            .build(seed)
            .unwrap()
            .collect();
            let (bytes, back) = roundtrip(reqs.clone());
            prop_assert_eq!(&back, &reqs);
            // Writing what was read gives the same bytes.
            let mut again = Vec::new();
            write_jsonl(&mut again, back).unwrap();
            prop_assert_eq!(bytes, again);
        }
    }
}
