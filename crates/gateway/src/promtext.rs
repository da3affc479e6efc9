//! A small parser for the Prometheus text exposition format (0.0.4), enough to read engine
//! gauges: sample lines `name{label="value",...} value [timestamp]`; comments and malformed
//! lines are skipped, never fatal (one odd line must not blind the router to a whole engine).

use std::borrow::Cow;

/// One sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// Metric name (with any `_total` / `_bucket` suffix as written).
    pub name: &'a str,
    /// Labels in the order written; values unescaped.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    /// The value (`+Inf`, `-Inf` and `NaN` included).
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `key`, if present.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_ref())
    }
}

/// Every well-formed sample in `text`, in order.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(parse_line)
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

/// Parses one line; `None` for comments, blanks and anything malformed.
pub fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next()?)?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Parses `k="v",...}` and returns what follows the closing brace.
fn parse_labels<'a>(mut s: &'a str, out: &mut Vec<(&'a str, Cow<'a, str>)>) -> Option<&'a str> {
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(after) = s.strip_prefix('}') {
            return Some(after);
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim();
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        // Find the closing quote, honouring backslash escapes.
        let bytes = s.as_bytes();
        let mut i = 0;
        let mut escaped = false;
        while i < bytes.len() {
            match bytes[i] {
                b'\\' => {
                    escaped = true;
                    i += 2;
                    continue;
                }
                b'"' => break,
                _ => i += 1,
            }
        }
        if i >= bytes.len() {
            return None;
        }
        let raw = &s[..i];
        let value = if escaped {
            Cow::Owned(unescape(raw))
        } else {
            Cow::Borrowed(raw)
        };
        out.push((key, value));
        s = &s[i + 1..];
    }
}

fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_labels_values() {
        let text = "# HELP x help\n# TYPE x gauge\nx 1\n\
                    vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 3.0\n\
                    y{a=\"q\\\"u\\\\o\\nte\", b=\"\"} +Inf 1700000000\n\
                    bad{a=\"unterminated} 1\n\
                    z{} NaN\n\
                    novalue\n";
        let all: Vec<_> = samples(text).collect();
        assert_eq!(all.len(), 4);
        assert_eq!(all[0].name, "x");
        assert_eq!(all[0].value, 1.0);
        assert_eq!(all[1].name, "vllm:num_requests_waiting");
        assert_eq!(all[1].label("model_name"), Some("m"));
        assert_eq!(all[1].value, 3.0);
        assert_eq!(all[2].label("a"), Some("q\"u\\o\nte"));
        assert_eq!(all[2].label("b"), Some(""));
        assert!(all[2].value.is_infinite());
        assert!(all[3].value.is_nan());
    }

    #[test]
    fn commas_in_label_values_survive() {
        let s = parse_line("vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 1.7e9").unwrap();
        assert_eq!(s.label("running_lora_adapters"), Some("a,b"));
        assert_eq!(s.value, 1.7e9);
    }
}
