//! Extracts what routing needs from an OpenAI request body, borrowing from the bytes.
//!
//! The body is parsed once, leniently: unknown fields are skipped, routing hints of an odd type
//! are ignored rather than refused (the engine validates its own input), and the original bytes
//! are what gets forwarded. Only a body that is not a JSON object, or a missing `model`, is
//! refused here.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use switchyard_core::{ChatMessage, Phase, Prompt, RouteRequest};

use crate::error::ApiError;

/// `x-session-id`: the client's sticky-session key (the body's `user` otherwise).
pub static SESSION_ID: http::HeaderName = http::HeaderName::from_static("x-session-id");
use crate::json::Scanner;

/// A completion prompt as the router sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PromptText<'a> {
    /// No prompt (or one the router cannot read).
    #[default]
    None,
    /// One string.
    Text(Cow<'a, str>),
    /// Several strings (a batch; routed as their concatenation).
    Texts(Vec<Cow<'a, str>>),
    /// Token ids, rendered as decimal text so the prefix index can still hash them.
    Tokens(String),
}

/// One chat message: role and its text (text parts joined).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<'a> {
    /// Role.
    pub role: Cow<'a, str>,
    /// Text content.
    pub content: Cow<'a, str>,
}

/// The routing-relevant fields of a request body.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ParsedRequest<'a> {
    /// Requested model (a base model or an adapter name).
    pub model: Cow<'a, str>,
    /// Completion prompt (`/v1/completions`) or embedding input.
    pub prompt: PromptText<'a>,
    /// Chat messages (`/v1/chat/completions`).
    pub messages: Option<Vec<Message<'a>>>,
    /// The client asked for server-sent events.
    pub stream: bool,
    /// `stream_options` is present in the body at all.
    pub has_stream_options: bool,
    /// `stream_options.include_usage` is true.
    pub include_usage: bool,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u32>,
    /// vLLM `cache_salt`.
    pub cache_salt: Option<Cow<'a, str>>,
    /// Sticky-session key: the `x-session-id` header, else the body's `user`.
    pub session_id: Option<Cow<'a, str>>,
    /// `unified` when the `x-switchyard-phase: unified` header forbids splitting the request into
    /// a prefill and a decode (set by the caller from the headers; see [`phase_header`]).
    pub phase: Phase,
}

/// The phase a request asks for in its `x-switchyard-phase` header: `unified` runs it whole on
/// one instance even in a disaggregated pool; anything else (or none) lets the router decide.
pub fn phase_header(value: Option<&str>) -> Phase {
    match value.map(str::trim) {
        Some(v) if v.eq_ignore_ascii_case("unified") => Phase::Unified,
        _ => Phase::Any,
    }
}

/// Output budget assumed when a request gives none (vLLM's completion default is 16, chat's is
/// "the rest of the context"; this is a middle estimate for KV accounting).
pub const DEFAULT_MAX_TOKENS: u32 = 256;

/// The body as serde sees it.
#[derive(Deserialize)]
struct Raw<'a> {
    #[serde(default, borrow, deserialize_with = "lenient_str")]
    model: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    prompt: Option<PromptText<'a>>,
    #[serde(default, borrow)]
    input: Option<PromptText<'a>>,
    #[serde(default, borrow)]
    messages: Option<Messages<'a>>,
    #[serde(default, deserialize_with = "lenient_bool")]
    stream: Option<bool>,
    #[serde(default, deserialize_with = "present")]
    stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "lenient_u32")]
    max_tokens: Option<u32>,
    #[serde(default, deserialize_with = "lenient_u32")]
    max_completion_tokens: Option<u32>,
    #[serde(default, borrow, deserialize_with = "lenient_str")]
    cache_salt: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "lenient_str")]
    user: Option<Cow<'a, str>>,
}

/// `stream_options`; anything but an object with a boolean `include_usage` counts as present
/// without usage.
#[derive(Default)]
struct StreamOptions {
    include_usage: bool,
}

impl<'de> Deserialize<'de> for StreamOptions {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StreamOptions;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("stream options")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<StreamOptions, A::Error> {
                let mut out = StreamOptions::default();
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    if key == "include_usage" {
                        out.include_usage = map.next_value::<Lenient<bool>>()?.0.unwrap_or(false);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(out)
            }
            fn visit_unit<E>(self) -> Result<StreamOptions, E> {
                Ok(StreamOptions::default())
            }
            fn visit_bool<E>(self, _: bool) -> Result<StreamOptions, E> {
                Ok(StreamOptions::default())
            }
            fn visit_u64<E>(self, _: u64) -> Result<StreamOptions, E> {
                Ok(StreamOptions::default())
            }
            fn visit_str<E>(self, _: &str) -> Result<StreamOptions, E> {
                Ok(StreamOptions::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<StreamOptions, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(StreamOptions::default())
            }
        }
        d.deserialize_any(V)
    }
}

/// A value of the expected type, or `None` for anything else (the engine will judge it).
struct Lenient<T>(Option<T>);

macro_rules! ignore_rest {
    ($t:ty) => {
        fn visit_unit<E>(self) -> Result<Lenient<$t>, E> {
            Ok(Lenient(None))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Lenient<$t>, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(Lenient(None))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Lenient<$t>, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(Lenient(None))
        }
    };
}

impl<'de> Deserialize<'de> for Lenient<bool> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lenient<bool>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a boolean")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Lenient<bool>, E> {
                Ok(Lenient(Some(v)))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Lenient<bool>, E> {
                Ok(Lenient(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Lenient<bool>, E> {
                Ok(Lenient(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Lenient<bool>, E> {
                Ok(Lenient(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Lenient<bool>, E> {
                Ok(Lenient(None))
            }
            ignore_rest!(bool);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Lenient<u32> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lenient<u32>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Lenient<u32>, E> {
                Ok(Lenient(Some(u32::try_from(v).unwrap_or(u32::MAX))))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Lenient<u32>, E> {
                Ok(Lenient(None))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Lenient<u32>, E> {
                // Saturating cast: NaN becomes 0, out-of-range values clamp.
                Ok(Lenient((v >= 0.0).then_some(v as u32)))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Lenient<u32>, E> {
                Ok(Lenient(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Lenient<u32>, E> {
                Ok(Lenient(None))
            }
            ignore_rest!(u32);
        }
        d.deserialize_any(V)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Lenient<Cow<'a, str>> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lenient<Cow<'de, str>>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Lenient(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Lenient(Some(Cow::Owned(v.to_string()))))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Lenient(Some(Cow::Owned(v))))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Lenient(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Lenient(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Lenient(None))
            }
        }
        d.deserialize_any(V)
    }
}

fn lenient_str<'de: 'a, 'a, D: Deserializer<'de>>(d: D) -> Result<Option<Cow<'a, str>>, D::Error> {
    Ok(Lenient::<Cow<'a, str>>::deserialize(d)?.0)
}

/// `Some` whenever the key is present, even as `null` (so we never add a second key).
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<StreamOptions>, D::Error> {
    StreamOptions::deserialize(d).map(Some)
}

fn lenient_bool<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    Ok(Lenient::<bool>::deserialize(d)?.0)
}

fn lenient_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    Ok(Lenient::<u32>::deserialize(d)?.0)
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptText<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptText<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a prompt (string, strings or token ids)")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(PromptText::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(PromptText::Text(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(PromptText::Text(Cow::Owned(v)))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(PromptText::None)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(PromptText::None)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(PromptText::None)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(PromptText::None)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(PromptText::None)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(PromptText::None)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut texts = Vec::new();
                let mut tokens = String::new();
                while let Some(item) = seq.next_element::<PromptItem<'de>>()? {
                    match item {
                        PromptItem::Text(t) => texts.push(t),
                        PromptItem::Tokens(t) => tokens.push_str(&t),
                        PromptItem::Other => {}
                    }
                }
                Ok(if !texts.is_empty() {
                    PromptText::Texts(texts)
                } else if !tokens.is_empty() {
                    PromptText::Tokens(tokens)
                } else {
                    PromptText::None
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// One element of a prompt array: a string, a token id, or a list of token ids.
enum PromptItem<'a> {
    Text(Cow<'a, str>),
    Tokens(String),
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptItem<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a prompt element")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(PromptItem::Text(Cow::Owned(v.to_string())))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
                Ok(PromptItem::Tokens(format!("{v} ")))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(PromptItem::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(PromptItem::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(PromptItem::Other)
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(PromptItem::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(PromptItem::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                use std::fmt::Write;
                let mut out = String::new();
                while let Some(v) = seq.next_element::<IgnoredNumber>()? {
                    if let Some(n) = v.0 {
                        let _ = write!(out, "{n} ");
                    }
                }
                Ok(PromptItem::Tokens(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// A token id inside a nested token list (anything else is skipped).
struct IgnoredNumber(Option<u64>);

impl<'de> Deserialize<'de> for IgnoredNumber {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Lenient::<u32>::deserialize(d)?;
        Ok(IgnoredNumber(v.0.map(u64::from)))
    }
}

/// Chat messages; a non-array `messages` reads as none.
struct Messages<'a>(Vec<Message<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for Messages<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Messages<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of messages")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(4));
                while let Some(m) = seq.next_element::<LenientMessage<'de>>()? {
                    if let Some(m) = m.0 {
                        out.push(Message {
                            role: m.role.unwrap_or(Cow::Borrowed("")),
                            content: m.content.map(|c| c.0).unwrap_or(Cow::Borrowed("")),
                        });
                    }
                }
                Ok(Messages(out))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Messages(Vec::new()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Messages(Vec::new()))
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok(Messages(Vec::new()))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Messages(Vec::new()))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Messages(Vec::new()))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Messages(Vec::new()))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Messages(Vec::new()))
            }
        }
        d.deserialize_any(V)
    }
}

/// One `messages` element: an object is a message; anything else (a number, a string, null) is
/// valid JSON the engine may refuse or accept, so it is forwarded and adds nothing to the prompt.
struct LenientMessage<'a>(Option<RawMessage<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for LenientMessage<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = LenientMessage<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a message")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                RawMessage::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(|m| LenientMessage(Some(m)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(LenientMessage(None))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(LenientMessage(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok(LenientMessage(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(LenientMessage(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(LenientMessage(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(LenientMessage(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(LenientMessage(None))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
struct RawMessage<'a> {
    #[serde(default, borrow, deserialize_with = "lenient_str")]
    role: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    content: Option<Content<'a>>,
}

/// A message's text: a string, or the `text` parts of a part list joined.
struct Content<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("message content")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Content(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Content(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Content(Cow::Owned(v)))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Content(Cow::Borrowed("")))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut text: Cow<'de, str> = Cow::Borrowed("");
                while let Some(part) = seq.next_element::<Option<Part<'de>>>()? {
                    let Some(Part {
                        kind,
                        text: Some(t),
                    }) = part
                    else {
                        continue;
                    };
                    if kind.as_deref().is_some_and(|k| k != "text") {
                        continue;
                    }
                    if text.is_empty() {
                        text = t;
                    } else {
                        text.to_mut().push_str(&t);
                    }
                }
                Ok(Content(text))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Content(Cow::Borrowed("")))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Content(Cow::Borrowed("")))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Content(Cow::Borrowed("")))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Content(Cow::Borrowed("")))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Content(Cow::Borrowed("")))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(default, rename = "type", borrow, deserialize_with = "lenient_str")]
    kind: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "lenient_str")]
    text: Option<Cow<'a, str>>,
}

/// Parses a request body; `session_header` is the `x-session-id` header, if sent.
pub fn parse<'a>(
    body: &'a [u8],
    session_header: Option<&'a str>,
) -> Result<ParsedRequest<'a>, ApiError> {
    // A quick check gives a clearer message than serde's for the common mistake.
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err(ApiError::malformed("expected a JSON object"));
    }
    if let Some(parsed) = parse_fast(body, session_header) {
        return Ok(parsed);
    }
    parse_serde(body, session_header)
}

/// Both parsing paths of [`parse`] side by side: the fast scanner's result (`None` when it
/// hands the body on) and serde's. They must agree wherever the fast one answers; the fuzz
/// target `request_parser` checks it.
#[doc(hidden)]
pub fn parse_both_paths<'a>(
    body: &'a [u8],
    session_header: Option<&'a str>,
) -> (
    Option<ParsedRequest<'a>>,
    Result<ParsedRequest<'a>, ApiError>,
) {
    (
        parse_fast(body, session_header),
        parse_serde(body, session_header),
    )
}

/// The general path: every body, every error.
fn parse_serde<'a>(
    body: &'a [u8],
    session_header: Option<&'a str>,
) -> Result<ParsedRequest<'a>, ApiError> {
    let raw: Raw<'a> = serde_json::from_slice(body).map_err(ApiError::malformed)?;
    let model = match raw.model {
        Some(m) if !m.is_empty() => m,
        _ => return Err(ApiError::missing_model()),
    };
    let (has_stream_options, include_usage) = match &raw.stream_options {
        Some(o) => (true, o.include_usage),
        None => (false, false),
    };
    Ok(ParsedRequest {
        model,
        prompt: raw.prompt.or(raw.input).unwrap_or_default(),
        messages: raw.messages.map(|m| m.0),
        stream: raw.stream.unwrap_or(false),
        has_stream_options,
        include_usage,
        max_tokens: raw.max_completion_tokens.or(raw.max_tokens),
        cache_salt: raw.cache_salt,
        session_id: session_header.map(Cow::Borrowed).or(raw.user),
        phase: Phase::Any,
    })
}

/// The common request shapes without serde: string fields, messages with string contents,
/// booleans and integers where expected. `None` for anything else (including every body
/// `parse` refuses), which then goes through serde_json: the result is the same either way.
fn parse_fast<'a>(body: &'a [u8], session_header: Option<&'a str>) -> Option<ParsedRequest<'a>> {
    const MODEL: u16 = 1;
    const PROMPT: u16 = 1 << 1;
    const INPUT: u16 = 1 << 2;
    const MESSAGES: u16 = 1 << 3;
    const STREAM: u16 = 1 << 4;
    const STREAM_OPTIONS: u16 = 1 << 5;
    const MAX_TOKENS: u16 = 1 << 6;
    const MAX_COMPLETION_TOKENS: u16 = 1 << 7;
    const CACHE_SALT: u16 = 1 << 8;
    const USER: u16 = 1 << 9;
    let mut s = Scanner::new(body);
    let mut seen = 0u16;
    let mut model = None;
    let mut prompt = None;
    let mut input = None;
    let mut messages = None;
    let mut stream = None;
    let mut stream_options: Option<bool> = None;
    let mut max_tokens = None;
    let mut max_completion_tokens = None;
    let mut cache_salt = None;
    let mut user = None;
    let hint = |v: Option<u64>| v.map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    s.object(|s, key| {
        let field = match key {
            b"model" => MODEL,
            b"prompt" => PROMPT,
            b"input" => INPUT,
            b"messages" => MESSAGES,
            b"stream" => STREAM,
            b"stream_options" => STREAM_OPTIONS,
            b"max_tokens" => MAX_TOKENS,
            b"max_completion_tokens" => MAX_COMPLETION_TOKENS,
            b"cache_salt" => CACHE_SALT,
            b"user" => USER,
            _ => return s.skip(),
        };
        // serde refuses a duplicate field: let it say so.
        if seen & field != 0 {
            return None;
        }
        seen |= field;
        match field {
            MODEL => model = s.opt_string()?,
            PROMPT => prompt = s.opt_string()?.map(PromptText::Text),
            INPUT => input = s.opt_string()?.map(PromptText::Text),
            MESSAGES => messages = fast_messages(s)?,
            STREAM => {
                stream = if s.null() { None } else { Some(s.boolean()?) };
            }
            STREAM_OPTIONS => stream_options = Some(fast_stream_options(s)?),
            MAX_TOKENS => max_tokens = hint(s.opt_uint()?),
            MAX_COMPLETION_TOKENS => max_completion_tokens = hint(s.opt_uint()?),
            CACHE_SALT => cache_salt = s.opt_string()?,
            _ => user = s.opt_string()?,
        }
        Some(())
    })?;
    if !s.at_end() {
        return None;
    }
    let model = model.filter(|m| !m.is_empty())?;
    Some(ParsedRequest {
        model,
        prompt: prompt.or(input).unwrap_or_default(),
        messages,
        stream: stream.unwrap_or(false),
        has_stream_options: stream_options.is_some(),
        include_usage: stream_options.unwrap_or(false),
        max_tokens: max_completion_tokens.or(max_tokens),
        cache_salt,
        session_id: session_header.map(Cow::Borrowed).or(user),
        phase: Phase::Any,
    })
}

/// `messages` as [`Messages`] reads it, for `null` or an array of objects (or `null`s) whose
/// `role` is a string and `content` a string or `null`.
fn fast_messages<'a>(s: &mut Scanner<'a>) -> Option<Option<Vec<Message<'a>>>> {
    if s.null() {
        return Some(None);
    }
    let mut out = Vec::with_capacity(4);
    s.array(|s| {
        if s.null() {
            return Some(());
        }
        let (mut role, mut content) = (None, None);
        let (mut has_role, mut has_content) = (false, false);
        s.object(|s, key| match key {
            b"role" if !has_role => {
                has_role = true;
                role = s.opt_string()?;
                Some(())
            }
            b"content" if !has_content => {
                has_content = true;
                content = s.opt_string()?;
                Some(())
            }
            b"role" | b"content" => None,
            _ => s.skip(),
        })?;
        out.push(Message {
            role: role.unwrap_or(Cow::Borrowed("")),
            content: content.unwrap_or(Cow::Borrowed("")),
        });
        Some(())
    })?;
    Some(Some(out))
}

/// `stream_options` as [`StreamOptions`] reads it (`include_usage`), for `null` or an object
/// whose `include_usage`, if any, is a boolean or `null`.
fn fast_stream_options(s: &mut Scanner<'_>) -> Option<bool> {
    if s.null() {
        return Some(false);
    }
    let mut include_usage = false;
    s.object(|s, key| {
        if key == b"include_usage" {
            include_usage = if s.null() { false } else { s.boolean()? };
            Some(())
        } else {
            s.skip()
        }
    })?;
    Some(include_usage)
}

impl ParsedRequest<'_> {
    /// Calls `f` with the core's view of this request for `model` / `adapter` (resolved by the
    /// caller from the requested name).
    pub fn with_route_request<R>(
        &self,
        model: &str,
        adapter: Option<&str>,
        f: impl FnOnce(&RouteRequest<'_>) -> R,
    ) -> R {
        self.route_request(model, adapter, true, f)
    }

    /// As [`ParsedRequest::with_route_request`], without the client's token ids: for a route
    /// whose prepared prompt carries them already (parsed once, outside the router's lock).
    pub fn with_route_request_without_ids<R>(
        &self,
        model: &str,
        adapter: Option<&str>,
        f: impl FnOnce(&RouteRequest<'_>) -> R,
    ) -> R {
        self.route_request(model, adapter, false, f)
    }

    fn route_request<R>(
        &self,
        model: &str,
        adapter: Option<&str>,
        with_ids: bool,
        f: impl FnOnce(&RouteRequest<'_>) -> R,
    ) -> R {
        let messages: Vec<ChatMessage<'_>>;
        let pieces: Vec<&str>;
        // Token ids sent by the client (`/v1/completions` with `prompt` as ids) are what the
        // engine runs: the router matches them exactly against instances publishing KV events.
        let token_ids: Option<Vec<u32>> = match (&self.messages, &self.prompt) {
            (None, PromptText::Tokens(t)) if with_ids => token_ids(t),
            _ => None,
        };
        let prompt = match (&self.messages, &self.prompt) {
            (Some(m), _) => {
                messages = m
                    .iter()
                    .map(|m| ChatMessage {
                        role: &m.role,
                        content: &m.content,
                    })
                    .collect();
                Prompt::Chat(&messages)
            }
            (None, PromptText::Text(t)) => Prompt::Text(t),
            (None, PromptText::Texts(t)) => {
                pieces = t.iter().map(|p| p.as_ref()).collect();
                Prompt::Pieces(&pieces)
            }
            (None, PromptText::Tokens(t)) => Prompt::Text(t),
            (None, PromptText::None) => Prompt::Text(""),
        };
        let request = RouteRequest {
            model,
            adapter,
            prompt,
            max_tokens: self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
            cache_salt: self.cache_salt.as_deref(),
            session_id: self.session_id.as_deref(),
            phase: self.phase,
            token_ids: token_ids.as_deref(),
            kind: Default::default(),
        };
        f(&request)
    }
}

/// The ids of a [`PromptText::Tokens`] text; none when one does not fit a `u32` (the engine
/// will refuse it anyway).
fn token_ids(text: &str) -> Option<Vec<u32>> {
    text.split_ascii_whitespace()
        .map(|t| t.parse().ok())
        .collect::<Option<Vec<u32>>>()
        .filter(|ids| !ids.is_empty())
}

/// Adds `"stream_options":{"include_usage":true}` to a body that has no `stream_options`, so the
/// engine reports usage at the end of a stream. Returns `None` when the body does not start
/// with `{`.
pub fn with_include_usage(body: &[u8]) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    const FIELD: &[u8] = b"\"stream_options\":{\"include_usage\":true}";
    let mut out = Vec::with_capacity(body.len() + FIELD.len() + 1);
    out.push(b'{');
    out.extend_from_slice(FIELD);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(out)
}

/// The body with its top-level `model` replaced by `model`, everything else byte for byte (the
/// value's span is found by the fast scanner; a body it does not read goes through serde_json,
/// which keeps the members but not their order or spacing). For bodies `parse` accepted.
pub fn with_model(body: &[u8], model: &str) -> Vec<u8> {
    // A JSON string of any `&str` always serialises.
    let value = serde_json::to_string(model).unwrap_or_else(|_| format!("\"{model}\""));
    if let Some((start, end)) = model_span(body) {
        let mut out = Vec::with_capacity(body.len() - (end - start) + value.len());
        out.extend_from_slice(&body[..start]);
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(&body[end..]);
        return out;
    }
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body) {
        Ok(mut map) => {
            map.insert("model".into(), serde_json::Value::String(model.into()));
            serde_json::to_vec(&map).unwrap_or_else(|_| body.to_vec())
        }
        // Not an object: `parse` refused it already; nothing to rewrite.
        Err(_) => body.to_vec(),
    }
}

/// Where the value of the top-level `model` member is, if the fast scanner reads the body and
/// finds exactly one.
fn model_span(body: &[u8]) -> Option<(usize, usize)> {
    let mut s = Scanner::new(body);
    let mut span = None;
    let mut seen = false;
    s.object(|s, key| {
        if key != b"model" {
            return s.skip();
        }
        if std::mem::replace(&mut seen, true) {
            return None;
        }
        let start = s.pos();
        s.skip()?;
        span = Some((start, s.pos()));
        Some(())
    })?;
    if !s.at_end() {
        return None;
    }
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_is_replaced_in_place() {
        let body = br#" {"messages":[{"role":"user","content":"model"}], "model" : "gpt-4o" ,"max_tokens":3}"#;
        let out = with_model(body, "llama");
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#" {"messages":[{"role":"user","content":"model"}], "model" : "llama" ,"max_tokens":3}"#
        );
        // Quotes and backslashes are escaped.
        let out = with_model(br#"{"model":"x"}"#, r#"a"b\c"#);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["model"], r#"a"b\c"#);
        // A body the scanner does not read (an escaped key) still gets the new model, and keeps
        // every other member.
        let odd = br#"{"mod\u0065l":"gpt-4o","prompt":"hi","n":1.5e3}"#;
        let v: serde_json::Value = serde_json::from_slice(&with_model(odd, "llama")).unwrap();
        assert_eq!(v["model"], "llama");
        assert_eq!(v["prompt"], "hi");
        assert_eq!(v["n"], 1500.0);
        assert_eq!(v.as_object().unwrap().len(), 3);
        // The result parses as the original did, but for the model.
        let p = parse(&out, None).unwrap();
        assert_eq!(p.model, r#"a"b\c"#);
    }

    fn p(body: &str) -> ParsedRequest<'_> {
        parse(body.as_bytes(), None).unwrap()
    }

    #[test]
    fn completion_fields_borrow_from_the_body() {
        let r = p(
            r#"{"model":"m","prompt":"hello","stream":true,"max_tokens":7,"cache_salt":"s","user":"u","temperature":0.5}"#,
        );
        assert!(matches!(r.model, Cow::Borrowed("m")));
        assert!(matches!(r.prompt, PromptText::Text(Cow::Borrowed("hello"))));
        assert!(r.stream);
        assert!(!r.has_stream_options);
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        assert_eq!(r.session_id.as_deref(), Some("u"));
    }

    #[test]
    fn chat_contents_strings_and_text_parts() {
        let r = p(r#"{"model":"m","messages":[
            {"role":"system","content":"be\nbrief"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null,"tool_calls":[]}
        ],"max_completion_tokens":3,"max_tokens":9,"stream_options":{"include_usage":true}}"#);
        let m = r.messages.as_ref().unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].content, "be\nbrief");
        assert_eq!(m[1].content, "ab");
        assert_eq!(m[2].content, "");
        assert_eq!(r.max_tokens, Some(3));
        assert!(r.has_stream_options && r.include_usage);
    }

    #[test]
    fn prompt_arrays_and_token_ids() {
        assert_eq!(
            p(r#"{"model":"m","prompt":["a","b"]}"#).prompt,
            PromptText::Texts(vec![Cow::Borrowed("a"), Cow::Borrowed("b")])
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[1,2,3]}"#).prompt,
            PromptText::Tokens("1 2 3 ".into())
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[[1,2],[3]]}"#).prompt,
            PromptText::Tokens("1 2 3 ".into())
        );
        let ids = |body: &str| {
            p(body).with_route_request("m", None, |r| r.token_ids.map(<[u32]>::to_vec))
        };
        assert_eq!(
            ids(r#"{"model":"m","prompt":[1,2,3]}"#),
            Some(vec![1, 2, 3])
        );
        assert_eq!(ids(r#"{"model":"m","prompt":"1 2 3"}"#), None, "text");
        assert_eq!(
            p(r#"{"model":"m","prompt":[1,2,3]}"#)
                .with_route_request_without_ids("m", None, |r| r.token_ids.map(<[u32]>::to_vec)),
            None,
            "the route under the lock takes them from the prepared prompt"
        );
        assert_eq!(ids(r#"{"model":"m","prompt":[5000000000]}"#), None);
        assert_eq!(
            p(r#"{"model":"m","input":"embed me"}"#).prompt,
            PromptText::Text(Cow::Borrowed("embed me"))
        );
    }

    #[test]
    fn odd_hint_types_are_ignored_not_refused() {
        let r = p(
            r#"{"model":"m","stream":"yes","max_tokens":-1,"user":{"a":1},"messages":"x","stream_options":null}"#,
        );
        assert!(!r.stream);
        assert_eq!(r.max_tokens, None);
        assert_eq!(r.session_id, None);
        assert_eq!(r.messages, Some(vec![]));
        assert!(r.has_stream_options && !r.include_usage);
    }

    #[test]
    fn odd_message_elements_are_forwarded_not_refused() {
        let r = p(
            r#"{"model":"m","messages":[1, "two", null, [3], true, {"role":"user","content":"hi"}]}"#,
        );
        let m = r.messages.as_ref().unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].content, "hi");
        assert_eq!(
            p(r#"{"model":"m","messages":[1,2]}"#).messages,
            Some(vec![])
        );
    }

    #[test]
    fn refusals() {
        for bad in [
            "",
            "[]",
            "nul",
            "{\"model\":",
            "{\"model\":\"m\"} x",
            "\"s\"",
        ] {
            let e = parse(bad.as_bytes(), None).unwrap_err();
            assert_eq!(e.code, "invalid_json", "{bad}");
        }
        for missing in [
            "{}",
            r#"{"model":""}"#,
            r#"{"model":5}"#,
            r#"{"model":null}"#,
        ] {
            let e = parse(missing.as_bytes(), None).unwrap_err();
            assert_eq!(e.code, "missing_model", "{missing}");
        }
    }

    #[test]
    fn header_session_wins_over_user() {
        let r = parse(br#"{"model":"m","user":"u"}"#, Some("h")).unwrap();
        assert_eq!(r.session_id.as_deref(), Some("h"));
    }

    #[test]
    fn route_request_renders_chat_and_pieces() {
        let r = p(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
        let len = r.with_route_request("base", Some("m"), |rr| {
            assert_eq!(rr.model, "base");
            assert_eq!(rr.adapter, Some("m"));
            assert_eq!(rr.max_tokens, DEFAULT_MAX_TOKENS);
            rr.prompt.rendered_len()
        });
        assert_eq!(len, "<|user|>hi<|end|>\n".len());
        let r = p(r#"{"model":"m","prompt":["ab","cd"]}"#);
        assert_eq!(
            r.with_route_request("m", None, |rr| rr.prompt.rendered_len()),
            4
        );
    }

    #[test]
    fn include_usage_is_spliced_in() {
        let out = with_include_usage(br#" {"model":"m","stream":true}"#).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["model"], "m");
        let out = with_include_usage(b"{ }").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert!(with_include_usage(b"[1]").is_none());
    }
}

#[cfg(test)]
mod fast_path_tests {
    use super::*;
    use crate::json::gen::{self, Rng};

    const KEYS: &[&str] = &[
        "model",
        "prompt",
        "input",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "cache_salt",
        "user",
    ];

    fn message(r: &mut Rng) -> String {
        match r.below(10) {
            0 => "null".to_string(),
            1 => gen::value(r, 2),
            _ => {
                let fields = r.below(4);
                gen::object(r, &["role", "content"], fields, |r, k| match k {
                    "role" if r.chance(85) => gen::pick_role(r),
                    "content" if r.chance(80) => gen::string(r),
                    "content" if r.chance(50) => {
                        r#"[{"type":"text","text":"a"},{"type":"text","text":"b"}]"#.to_string()
                    }
                    _ => gen::value(r, 2),
                })
            }
        }
    }

    fn body(r: &mut Rng) -> String {
        let fields = r.below(5);
        let rest = gen::object(r, KEYS, fields, |r, k| match k {
            "model" if r.chance(90) => r.pick(&["\"m\"", "\"\"", "\"lora-1\""]).to_string(),
            "messages" if r.chance(85) => {
                let n = r.below(4);
                let items: Vec<String> = (0..n).map(|_| message(r)).collect();
                format!("[{}]", items.join(","))
            }
            "stream" if r.chance(80) => r.pick(&["true", "false", "null"]).to_string(),
            "stream_options" if r.chance(80) => r
                .pick(&[
                    "{\"include_usage\":true}",
                    "{\"include_usage\":false,\"x\":[1]}",
                    "{}",
                    "null",
                    "{\"include_usage\":null}",
                    "{\"include_usage\":1}",
                    "{\"include_usage\":true,\"include_usage\":false}",
                ])
                .to_string(),
            "max_tokens" | "max_completion_tokens" if r.chance(80) => gen::number(r).to_string(),
            _ if r.chance(60) => gen::string(r),
            _ => gen::value(r, 1),
        });
        // Most bodies name a model first (without one, the fast path never applies).
        match (r.chance(85), rest.trim().strip_prefix('{')) {
            (true, Some(inner)) if inner.trim_start().starts_with('}') => {
                format!("{{\"model\":\"m\"{inner}")
            }
            (true, Some(inner)) => format!("{{\"model\":\"m\",{inner}"),
            _ => rest,
        }
    }

    /// Whatever the fast path accepts, serde_json accepts too, with the same result.
    #[test]
    fn fast_path_agrees_with_serde() {
        let mut r = Rng(0x5eed_1234_abcd_0001);
        let (mut fast, mut total) = (0, 0);
        for i in 0..40_000 {
            let mut text = body(&mut r).into_bytes();
            if i % 3 == 0 {
                text = gen::mutate(&mut r, &text);
            }
            let session = (i % 7 == 0).then_some("hdr");
            total += 1;
            if let Some(f) = parse_fast(&text, session) {
                fast += 1;
                let s = parse_serde(&text, session).unwrap_or_else(|e| {
                    panic!("serde refuses {}: {e:?}", String::from_utf8_lossy(&text))
                });
                assert_eq!(f, s, "{}", String::from_utf8_lossy(&text));
            }
        }
        assert!(
            fast * 10 > total,
            "the fast path took only {fast} of {total}"
        );
    }

    #[test]
    fn fast_path_takes_the_common_shapes() {
        for body in [
            r#"{"model":"m","messages":[{"role":"system","content":"be\nbrief"},{"role":"user","content":"hi \"there\""}],"max_tokens":4}"#,
            r#"{"model":"m","prompt":"hello","stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":9,"user":"u","cache_salt":"s","temperature":0.5,"tools":[{"a":null}]}"#,
            r#" {"model":"m","input":"embed me"} "#,
        ] {
            let f = parse_fast(body.as_bytes(), None).expect(body);
            assert_eq!(f, parse_serde(body.as_bytes(), None).unwrap());
        }
        let words = vec!["abc"; 2048].join(" ");
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{words}"}}],"max_tokens":4}}"#
        );
        let f = parse_fast(body.as_bytes(), None).unwrap();
        assert!(
            matches!(&f.messages.as_ref().unwrap()[0].content, Cow::Borrowed(c) if c.len() == words.len())
        );
    }
}
