//! The client's body as its top-level members, each kept as the raw JSON text it arrived as:
//! a leg's body is the original with a few members set or removed, so the prompt (most of the
//! bytes) is copied once into the leg's body and never parsed into a tree.

use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// A JSON object's members in order, values borrowed from the body.
#[derive(Debug)]
pub struct RawObject<'a> {
    members: Vec<(String, &'a RawValue)>,
}

struct MembersVisitor;

impl<'de> Visitor<'de> for MembersVisitor {
    type Value = Vec<(String, &'de RawValue)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut members = Vec::with_capacity(map.size_hint().unwrap_or(8));
        while let Some((key, value)) = map.next_entry::<String, &'de RawValue>()? {
            // The last of duplicate keys wins, as serde_json's maps have it.
            members.retain(|(k, _): &(String, &RawValue)| *k != key);
            members.push((key, value));
        }
        Ok(members)
    }
}

impl<'a> RawObject<'a> {
    /// The body's members, or `None` when it is not a JSON object.
    pub fn parse(body: &'a [u8]) -> Option<Self> {
        let mut de = serde_json::Deserializer::from_slice(body);
        let members = (&mut de).deserialize_map(MembersVisitor).ok()?;
        de.end().ok()?;
        Some(RawObject { members })
    }

    fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.members.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// Whether the object has `key`.
    pub fn contains(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// A boolean member.
    pub fn bool(&self, key: &str) -> Option<bool> {
        serde_json::from_str(self.get(key)?.get()).ok()
    }

    /// A string member.
    pub fn string(&self, key: &str) -> Option<String> {
        serde_json::from_str(self.get(key)?.get()).ok()
    }

    /// The object with `set` members (raw JSON values) put last in place of any of the same
    /// name, and `remove` members left out.
    pub fn with(&self, set: &[(&str, &str)], remove: &[&str]) -> Vec<u8> {
        let size: usize = self
            .members
            .iter()
            .map(|(k, v)| k.len() + v.get().len() + 4)
            .sum::<usize>()
            + set
                .iter()
                .map(|(k, v)| k.len() + v.len() + 4)
                .sum::<usize>();
        let mut out = Vec::with_capacity(size + 2);
        out.push(b'{');
        let kept = self
            .members
            .iter()
            .filter(|(k, _)| !remove.contains(&k.as_str()) && !set.iter().any(|(s, _)| s == k))
            .map(|(k, v)| (k.as_str(), v.get()));
        for (i, (key, value)) in kept.chain(set.iter().copied()).enumerate() {
            if i > 0 {
                out.push(b',');
            }
            // Writing a string into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut out, key);
            out.push(b':');
            out.extend_from_slice(value.as_bytes());
        }
        out.push(b'}');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn members_are_set_removed_and_kept_as_they_came() {
        let body = br#"{"model":"m","prompt":"a \"quoted\"\nprompt","stream":true,"stream_options":{"include_usage":false},"x":[1, 2]}"#;
        let o = RawObject::parse(body).unwrap();
        assert_eq!(o.bool("stream"), Some(true));
        assert_eq!(o.string("model").as_deref(), Some("m"));
        assert!(o.contains("x") && !o.contains("y"));
        let out = o.with(
            &[("stream", "false"), ("max_tokens", "1")],
            &["stream_options"],
        );
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v,
            json!({"model": "m", "prompt": "a \"quoted\"\nprompt", "x": [1, 2],
                   "stream": false, "max_tokens": 1})
        );
        // Untouched members keep their bytes.
        assert!(String::from_utf8(out).unwrap().contains(r#""x":[1, 2]"#));
    }

    #[test]
    fn only_objects_parse() {
        for bad in [&b"[1]"[..], b"\"s\"", b"{\"a\":1", b"{} trailing", b""] {
            assert!(
                RawObject::parse(bad).is_none(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let dup = RawObject::parse(br#"{"a":1,"a":2}"#).unwrap();
        assert_eq!(dup.with(&[], &[]), br#"{"a":2}"#);
        let escaped = RawObject::parse(br#"{"k\u00e9y":1}"#).unwrap();
        let v: Value = serde_json::from_slice(&escaped.with(&[], &[])).unwrap();
        assert_eq!(v, json!({"kéy": 1}));
    }
}
