//! The response body on its way back: passed through frame by frame (no buffering), watched
//! for the first byte (⇒ `FirstToken`) and the engine's final `usage` (⇒ `Finished`), and for
//! a client that goes away (⇒ `Failed`, and the upstream request is dropped, which cancels it).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use serde::de::IgnoredAny;
use serde::Deserialize;
use switchyard_core::{Observation, RequestId, Usage};

use crate::backends::{Backend, InFlightGuard};
use crate::json::Scanner;
use crate::state::{AnswerWarm, Gateway};
use crate::upstream::UpstreamBody;

/// One request routed to one backend: reports `Failed` to the router when dropped before it
/// was settled (client disconnect, error, timeout), so the router never leaks an in-flight entry.
pub struct RequestGuard {
    gw: Arc<Gateway>,
    /// The router's id of the request.
    pub rid: RequestId,
    /// Where it went.
    pub backend: Arc<Backend>,
    _in_flight: InFlightGuard,
    settled: bool,
    /// Waiting for the engine's response head: dropped now, the client went away (a
    /// non-streamed request spends its whole generation here).
    awaiting_head: bool,
}

impl RequestGuard {
    /// Starts tracking (the caller has already sent `Routed`).
    pub fn new(gw: Arc<Gateway>, rid: RequestId, backend: Arc<Backend>) -> Self {
        let in_flight = backend.enter();
        RequestGuard {
            gw,
            rid,
            backend,
            _in_flight: in_flight,
            settled: false,
            awaiting_head: false,
        }
    }

    /// Marks the wait for the engine's response head (see [`RequestGuard::drop`]).
    pub fn set_awaiting_head(&mut self, awaiting: bool) {
        self.awaiting_head = awaiting;
    }

    /// Reports the request failed now (the body may still be passed on, e.g. a 4xx).
    pub fn fail(&mut self) {
        if !self.settled {
            self.settled = true;
            self.gw.observe(Observation::Failed(self.rid));
            self.gw.admission.wake();
        }
    }

    /// Reports the first response byte.
    pub fn first_token(&self) {
        if !self.settled {
            self.gw.observe(Observation::FirstToken(self.rid));
        }
    }

    /// Reports the request finished, with the engine's usage.
    pub fn finish(&mut self, usage: Option<Usage>) {
        if !self.settled {
            self.settled = true;
            self.gw.observe(Observation::Finished(self.rid, usage));
            self.gw.admission.wake();
        }
    }
}

impl Drop for RequestGuard {
    /// Settles the request as failed; dropped while waiting for the engine's answer (the
    /// request's future was dropped: the client disconnected), it also counts as `cancelled`,
    /// as a stream the client leaves does ([`Track`]).
    fn drop(&mut self) {
        if self.awaiting_head && !self.settled {
            self.backend.metrics.cancelled.inc();
        }
        self.fail();
    }
}

/// The usage object engines put in a JSON response or the last SSE chunk.
#[derive(Debug, Default, Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Debug, Default, Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

/// llama.cpp's `timings`: `cache_n` prompt tokens came from its cache, `prompt_n` were
/// computed, `predicted_n` were generated.
#[derive(Debug, Default, Deserialize)]
struct Timings {
    #[serde(default)]
    cache_n: Option<u32>,
    #[serde(default)]
    prompt_n: Option<u32>,
    #[serde(default)]
    predicted_n: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
struct Envelope {
    #[serde(default)]
    usage: Option<UsageJson>,
    #[serde(default)]
    choices: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    timings: Option<Timings>,
}

/// Reads `usage` from a JSON object; also says whether it is a usage-only stream chunk
/// (`choices` empty), the one added when we asked for usage on the client's behalf.
pub fn read_usage(json: &[u8]) -> Option<(Usage, bool)> {
    let env = match fast_envelope(json) {
        Some(env) => env,
        None => serde_json::from_slice(json).ok()?,
    };
    usage_of(env)
}

/// The envelope read by the JSON scanner, or `None` for anything it does not take (a duplicate
/// field, an escaped key, a number that is no `u32`, invalid JSON...): serde_json then decides.
/// What it accepts, serde_json accepts with the same values; it skips the answer's text
/// without decoding it, which made serde_json's pass most of the cost of reading an answer.
fn fast_envelope(json: &[u8]) -> Option<Envelope> {
    let mut s = Scanner::new(json);
    let mut env = Envelope::default();
    let mut seen = 0u8;
    s.object(|s, key| {
        let bit = match key {
            b"usage" => 1,
            b"choices" => 2,
            b"timings" => 4,
            _ => return s.skip(),
        };
        once(&mut seen, bit)?;
        if s.null() {
            return Some(());
        }
        match bit {
            1 => env.usage = Some(fast_usage(s)?),
            2 => {
                let mut n = 0;
                s.array(|s| {
                    n += 1;
                    s.skip()
                })?;
                env.choices = Some(vec![IgnoredAny; n]);
            }
            _ => env.timings = Some(fast_timings(s)?),
        }
        Some(())
    })?;
    s.at_end().then_some(env)
}

/// `null` or an integer that fits a `u32`, as serde_json reads an `Option<u32>`.
fn opt_u32(s: &mut Scanner<'_>) -> Option<Option<u32>> {
    match s.opt_uint()? {
        Some(v) => u32::try_from(v).ok().map(Some),
        None => Some(None),
    }
}

/// Sets the field of `bit` unless it was seen already (a duplicate is serde_json's to refuse).
fn once(seen: &mut u8, bit: u8) -> Option<()> {
    (*seen & bit == 0).then(|| *seen |= bit)
}

fn fast_usage(s: &mut Scanner<'_>) -> Option<UsageJson> {
    let mut u = UsageJson::default();
    let mut seen = 0u8;
    s.object(|s, key| {
        match key {
            b"prompt_tokens" => {
                once(&mut seen, 1)?;
                u.prompt_tokens = opt_u32(s)?;
            }
            b"completion_tokens" => {
                once(&mut seen, 2)?;
                u.completion_tokens = opt_u32(s)?;
            }
            b"prompt_tokens_details" => {
                once(&mut seen, 4)?;
                if !s.null() {
                    let mut details = Details::default();
                    let mut seen_cached = false;
                    s.object(|s, key| {
                        if key != b"cached_tokens" {
                            return s.skip();
                        }
                        if std::mem::replace(&mut seen_cached, true) {
                            return None;
                        }
                        details.cached_tokens = opt_u32(s)?;
                        Some(())
                    })?;
                    u.prompt_tokens_details = Some(details);
                }
            }
            _ => s.skip()?,
        }
        Some(())
    })?;
    Some(u)
}

fn fast_timings(s: &mut Scanner<'_>) -> Option<Timings> {
    let mut t = Timings::default();
    let mut seen = 0u8;
    s.object(|s, key| {
        let (bit, field) = match key {
            b"cache_n" => (1, &mut t.cache_n),
            b"prompt_n" => (2, &mut t.prompt_n),
            b"predicted_n" => (4, &mut t.predicted_n),
            _ => return s.skip(),
        };
        once(&mut seen, bit)?;
        *field = opt_u32(s)?;
        Some(())
    })?;
    Some(t)
}

/// The usage in an envelope, and whether it is a usage-only chunk.
fn usage_of(env: Envelope) -> Option<(Usage, bool)> {
    let Some(u) = env.usage else {
        // llama.cpp's last streamed chat chunk carries `timings` but no `usage` when the
        // client did not ask for usage.
        let t = env.timings?;
        let (cached, computed) = (t.cache_n?, t.prompt_n?);
        let usage = Usage {
            prompt_tokens: cached + computed,
            cached_tokens: Some(cached),
            completion_tokens: t.predicted_n.unwrap_or(0),
        };
        return Some((usage, false));
    };
    let cached = u
        .prompt_tokens_details
        .and_then(|d| d.cached_tokens)
        .or(env.timings.and_then(|t| t.cache_n));
    let usage = Usage {
        prompt_tokens: u.prompt_tokens.unwrap_or(0),
        cached_tokens: cached,
        completion_tokens: u.completion_tokens.unwrap_or(0),
    };
    let usage_only = env.choices.is_some_and(|c| c.is_empty());
    Some((usage, usage_only))
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// End (exclusive) of the first complete SSE event at or after `from`: after `\n\n` or `\n\r\n`.
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i < buf.len() {
        if buf[i] == b'\n' {
            match (buf.get(i + 1), buf.get(i + 2)) {
                (Some(b'\n'), _) => return Some(i + 2),
                (Some(b'\r'), Some(b'\n')) => return Some(i + 3),
                _ => {}
            }
        }
        i += 1;
    }
    None
}

/// The JSON of an SSE event's `data:` lines (joined), unless it is `[DONE]`.
fn event_data(event: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            if !out.is_empty() {
                out.push(b'\n');
            }
            out.extend_from_slice(rest);
        }
    }
    (!out.is_empty() && out != b"[DONE]").then_some(out)
}

/// Whether an SSE event is the `data: [DONE]` terminator.
fn is_done_event(event: &[u8]) -> bool {
    contains(event, b"[DONE]")
        && event.split(|&b| b == b'\n').any(|line| {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            line.strip_prefix(b"data:")
                .map(|rest| rest.strip_prefix(b" ").unwrap_or(rest))
                == Some(b"[DONE]".as_slice())
        })
}

/// Largest answer collected to warm the piece cache with (longer ones are not warmed).
const ANSWER_LIMIT: usize = 1 << 20;

/// A chat answer's text, collected as it passes (the first choice's), to warm the piece cache
/// with ([`Gateway::warm_answer`]).
#[derive(Debug, Default)]
struct AnswerText {
    text: String,
    /// Not to be warmed: over [`ANSWER_LIMIT`], another choice than the first, or a chunk
    /// that did not parse.
    spoiled: bool,
}

/// The part of a chat completion (or chunk) that carries the answer's text.
#[derive(Deserialize)]
struct ChoicesJson<'a> {
    #[serde(borrow, default)]
    choices: Vec<ChoiceJson<'a>>,
}

#[derive(Deserialize)]
struct ChoiceJson<'a> {
    #[serde(default)]
    index: u32,
    #[serde(borrow, default)]
    delta: Option<ContentJson<'a>>,
    #[serde(borrow, default)]
    message: Option<ContentJson<'a>>,
    /// A completion's text (`/v1/completions`).
    #[serde(borrow, default)]
    text: Option<std::borrow::Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ContentJson<'a> {
    #[serde(borrow, default)]
    content: Option<std::borrow::Cow<'a, str>>,
}

impl AnswerText {
    /// Adds the text of one chat completion or chunk (`json`).
    fn add(&mut self, json: &[u8]) {
        if self.spoiled || !(contains(json, b"\"content\"") || contains(json, b"\"text\"")) {
            return;
        }
        let Ok(parsed) = serde_json::from_slice::<ChoicesJson<'_>>(json) else {
            self.spoiled = true;
            return;
        };
        for choice in parsed.choices {
            let content = choice
                .delta
                .or(choice.message)
                .and_then(|c| c.content)
                .or(choice.text)
                .unwrap_or_default();
            if content.is_empty() {
                continue;
            }
            if choice.index != 0 || self.text.len() + content.len() > ANSWER_LIMIT {
                self.spoiled = true;
                return;
            }
            self.text.push_str(&content);
        }
    }

    /// The answer, when complete and whole.
    fn take(&mut self) -> Option<String> {
        (!self.spoiled && !self.text.is_empty()).then(|| std::mem::take(&mut self.text))
    }
}

/// Watches an SSE stream for usage; optionally removes the usage-only chunk we asked for.
#[derive(Debug, Default)]
pub struct SseScanner {
    pending: BytesMut,
    strip_usage: bool,
    /// The answer's text, when it is collected.
    answer: Option<AnswerText>,
    /// The latest usage seen.
    pub usage: Option<Usage>,
    /// The `data: [DONE]` terminator was seen: the answer is complete, whatever the connection
    /// does next (clients often close it at once).
    pub done: bool,
}

impl SseScanner {
    /// A scanner; `strip_usage` removes usage-only chunks from what is passed on.
    pub fn new(strip_usage: bool) -> Self {
        SseScanner {
            strip_usage,
            ..Self::default()
        }
    }

    /// Looks at one event; true when it is a usage-only chunk.
    fn inspect(&mut self, event: &[u8]) -> bool {
        if let Some(answer) = self.answer.as_mut() {
            if contains(event, b"\"content\"") || contains(event, b"\"text\"") {
                if let Some(data) = event_data(event) {
                    answer.add(&data);
                }
            }
        }
        // llama.cpp without usage reports only `timings`; a later usage chunk, if any,
        // replaces what they gave.
        if !contains(event, b"\"usage\"") && !contains(event, b"\"timings\"") {
            return false;
        }
        let Some(data) = event_data(event) else {
            return false;
        };
        match read_usage(&data) {
            Some((usage, only)) => {
                self.usage = Some(usage);
                only
            }
            None => false,
        }
    }

    /// Feeds one chunk; returns what to pass on (the chunk itself unless stripping, in which
    /// case complete events only, the rest held until it completes).
    pub fn feed(&mut self, chunk: Bytes) -> Bytes {
        self.pending.extend_from_slice(&chunk);
        let mut end = 0;
        while let Some(e) = event_end(&self.pending, end) {
            end = e;
        }
        if end == 0 {
            return if self.strip_usage {
                Bytes::new()
            } else {
                chunk
            };
        }
        let complete = self.pending.split_to(end).freeze();
        let mut kept: Option<BytesMut> = None;
        let mut start = 0;
        while let Some(e) = event_end(&complete, start) {
            let event = &complete[start..e];
            if !self.done && is_done_event(event) {
                self.done = true;
            }
            let usage_only = self.inspect(event);
            if self.strip_usage && usage_only {
                if kept.is_none() {
                    kept = Some(BytesMut::from(&complete[..start]));
                }
            } else if let Some(k) = kept.as_mut() {
                k.extend_from_slice(event);
            }
            start = e;
        }
        if !self.strip_usage {
            return chunk;
        }
        match kept {
            Some(k) => k.freeze(),
            None => complete,
        }
    }

    /// What is left at the end of the stream (an unterminated last event).
    pub fn finish(&mut self) -> Bytes {
        let rest = self.pending.split().freeze();
        if !rest.is_empty() {
            self.inspect(&rest);
        }
        if self.strip_usage {
            rest
        } else {
            Bytes::new()
        }
    }
}

/// Largest JSON response body whose usage is read.
const JSON_COPY_LIMIT: usize = 8 << 20;

enum Scan {
    Sse(SseScanner),
    /// A JSON body: copied when it comes in several frames, else read in place.
    Json {
        buf: Vec<u8>,
        usage: Option<Usage>,
        /// The answer's text, when it is collected.
        answer: Option<AnswerText>,
    },
}

/// What the tracker needs to settle the request.
struct Track {
    guard: RequestGuard,
    started: Instant,
    first_seen: bool,
    predicted_cached: u32,
    scan: Scan,
    /// Settled as finished (at `[DONE]` or the body's end): later ends are no-ops.
    ended: bool,
    /// Warm the piece cache with the answer once it ends.
    warm: Option<Arc<AnswerWarm>>,
}

impl Track {
    fn new(
        guard: RequestGuard,
        started: Instant,
        sse: bool,
        strip_usage: bool,
        predicted_cached: u32,
    ) -> Self {
        let scan = if sse {
            Scan::Sse(SseScanner::new(strip_usage))
        } else {
            Scan::Json {
                buf: Vec::new(),
                usage: None,
                answer: None,
            }
        };
        Track {
            guard,
            started,
            first_seen: false,
            predicted_cached,
            scan,
            ended: false,
            warm: None,
        }
    }

    /// Collects the answer's text, to warm the piece cache with it at the end.
    fn set_warm(&mut self, warm: Arc<AnswerWarm>) {
        match &mut self.scan {
            Scan::Sse(s) => s.answer = Some(AnswerText::default()),
            Scan::Json { answer, .. } => *answer = Some(AnswerText::default()),
        }
        self.warm = Some(warm);
    }

    /// One data frame; `last`: the body ends with it.
    fn on_data(&mut self, data: Bytes, last: bool) -> Bytes {
        if !self.first_seen {
            self.first_seen = true;
            // A JSON answer's first byte comes after the whole generation: it is no first
            // token, and taking it for one would teach the router prefill speeds from whole
            // generations. The histogram is time to first byte either way.
            if matches!(self.scan, Scan::Sse(_)) {
                self.guard.first_token();
            }
            let ttft = self.started.elapsed().as_secs_f64();
            let backend = &self.guard.backend;
            backend.metrics.ttft.observe(ttft);
            backend.ttft.record(self.guard.gw.now(), ttft);
        }
        match &mut self.scan {
            Scan::Sse(s) => s.feed(data),
            Scan::Json { buf, usage, answer } => {
                if last && buf.is_empty() && data.len() <= JSON_COPY_LIMIT {
                    // The whole body in one frame (the usual non-streamed answer): no copy.
                    *usage = read_usage(&data).map(|(u, _)| u);
                    if let Some(answer) = answer.as_mut() {
                        answer.add(&data);
                    }
                } else if buf.len() + data.len() <= JSON_COPY_LIMIT {
                    buf.extend_from_slice(&data);
                }
                data
            }
        }
    }

    /// Whether the stream's `[DONE]` has been seen.
    fn saw_done(&self) -> bool {
        matches!(&self.scan, Scan::Sse(s) if s.done)
    }

    fn on_end(&mut self) -> Bytes {
        if self.ended {
            return Bytes::new();
        }
        self.ended = true;
        let (rest, usage, answer) = match &mut self.scan {
            Scan::Sse(s) => {
                let rest = s.finish();
                let answer = s.answer.as_mut().and_then(AnswerText::take);
                (rest, s.usage, answer)
            }
            Scan::Json { buf, usage, answer } => {
                if !buf.is_empty() {
                    *usage = read_usage(buf).map(|(u, _)| u);
                    if let Some(answer) = answer.as_mut() {
                        if buf.len() < JSON_COPY_LIMIT {
                            answer.add(buf);
                        }
                    }
                }
                let answer = answer.as_mut().and_then(AnswerText::take);
                (Bytes::new(), *usage, answer)
            }
        };
        let m = &self.guard.backend.metrics;
        m.e2e.observe(self.started.elapsed().as_secs_f64());
        m.ok.inc();
        if let Some(u) = usage {
            m.prompt_tokens.inc_by(u64::from(u.prompt_tokens));
            if let Some(c) = u.cached_tokens {
                m.reported_cached.inc_by(u64::from(c));
                m.predicted_cached.inc_by(u64::from(self.predicted_cached));
            }
        }
        self.guard.backend.record_request_success();
        self.guard.finish(usage);
        if let (Some(warm), Some(answer)) = (self.warm.take(), answer) {
            self.guard.gw.warm_answer(warm, answer);
        }
        rest
    }
}

impl Drop for Track {
    fn drop(&mut self) {
        if !self.guard.settled {
            self.guard.backend.metrics.cancelled.inc();
        }
    }
}

/// Watches a 2xx response body that another proxy carries (the Envoy endpoint picker sees
/// it chunk by chunk): first token, usage and the end settle the request exactly as
/// [`ObservedBody`] does for the gateway's own bodies. Dropped before the end: cancelled.
pub struct ResponseWatch(Track);

impl ResponseWatch {
    /// Like [`ObservedBody::tracked`], without a body to poll.
    pub fn new(
        guard: RequestGuard,
        started: Instant,
        sse: bool,
        strip_usage: bool,
        predicted_cached: u32,
    ) -> Self {
        ResponseWatch(Track::new(
            guard,
            started,
            sse,
            strip_usage,
            predicted_cached,
        ))
    }

    /// Collects the answer's text and warms the tokenizer's caches with it when the body
    /// ends, as [`ObservedBody::with_answer_warm`] does.
    pub fn with_answer_warm(mut self, warm: Option<Arc<AnswerWarm>>) -> Self {
        if let Some(warm) = warm {
            self.0.set_warm(warm);
        }
        self
    }

    /// One chunk of the body; returns what to pass on (the usage chunk we asked for removed).
    pub fn on_data(&mut self, data: Bytes, last: bool) -> Bytes {
        let mut out = self.0.on_data(data, last);
        if last || self.0.saw_done() {
            let rest = self.0.on_end();
            if !rest.is_empty() {
                let mut joined = BytesMut::from(&out[..]);
                joined.extend_from_slice(&rest);
                out = joined.freeze();
            }
        }
        out
    }

    /// The body ended (without a last chunk seen): settles the request as finished.
    pub fn on_end(&mut self) -> Bytes {
        self.0.on_end()
    }
}

/// The body passed to the client.
pub struct ObservedBody {
    inner: UpstreamBody,
    /// Ends a stream the engine stopped feeding (see [`ObservedBody::with_idle_timeout`]).
    idle: Option<IdleTimer>,
    track: Option<Track>,
    /// Keeps the backend's in-flight count for bodies that are not tracked (errors).
    _guard: Option<RequestGuard>,
    done: bool,
}

impl ObservedBody {
    /// A tracked 2xx body: `sse` picks the scanner; `strip_usage` removes the usage chunk we
    /// asked for; `predicted_cached` is the router's prediction for the metrics.
    pub fn tracked(
        inner: UpstreamBody,
        guard: RequestGuard,
        started: Instant,
        sse: bool,
        strip_usage: bool,
        predicted_cached: u32,
    ) -> Self {
        ObservedBody {
            inner,
            idle: None,
            track: Some(Track::new(
                guard,
                started,
                sse,
                strip_usage,
                predicted_cached,
            )),
            _guard: None,
            done: false,
        }
    }

    /// Collects the answer's text and warms the piece cache with it when the body ends
    /// ([`Gateway::answer_warm`]); nothing for `None` or an untracked body.
    pub fn with_answer_warm(mut self, warm: Option<Arc<AnswerWarm>>) -> Self {
        if let (Some(track), Some(warm)) = (self.track.as_mut(), warm) {
            track.set_warm(warm);
        }
        self
    }

    /// An untracked body (an engine error passed through); the guard was settled already.
    pub fn passthrough(inner: UpstreamBody, guard: RequestGuard) -> Self {
        ObservedBody {
            inner,
            idle: None,
            track: None,
            _guard: Some(guard),
            done: false,
        }
    }

    /// Ends the body when the engine sends nothing for `after` (zero: never). A stream gets an
    /// SSE error event first (`stream_stalled`), so the client knows the answer is cut short;
    /// a JSON body just ends. Counted as `stream_stalled` and reported to the router as failed.
    pub fn with_idle_timeout(mut self, after: std::time::Duration) -> Self {
        if !after.is_zero() {
            self.idle = Some(IdleTimer {
                after,
                last: tokio::time::Instant::now(),
                sleep: None,
            });
        }
        self
    }

    /// The engine went silent: settle the request as failed and give the client the end.
    fn stalled(&mut self, after: std::time::Duration) -> Option<Bytes> {
        self.done = true;
        let track = self.track.as_mut()?;
        track.guard.backend.metrics.stream_stalled.inc();
        // An engine that stops mid-answer is failing (its health checks may well pass): held
        // against its health like a 5xx, so one that keeps doing it is ejected.
        crate::health::record_failure(&track.guard.gw, &track.guard.backend, false);
        track.guard.fail();
        tracing::warn!(
            backend = track.guard.backend.name(),
            "stream ended: the backend sent nothing for {} s",
            after.as_secs_f64()
        );
        match track.scan {
            Scan::Sse(_) => Some(stalled_event(after)),
            Scan::Json { .. } => None,
        }
    }
}

/// When the engine last sent something, and the timer that fires `after` it.
struct IdleTimer {
    after: std::time::Duration,
    last: tokio::time::Instant,
    /// Armed the first time the engine keeps the body waiting (a body that arrives whole
    /// never registers a timer).
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl IdleTimer {
    /// Whether the engine has been silent for `after`; re-arms the timer otherwise. The timer
    /// is only reset when it fires, not on every chunk: a chunk costs one clock read.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let due = self.last + self.after;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        loop {
            if sleep.as_mut().poll(cx).is_pending() {
                return false;
            }
            let due = self.last + self.after;
            if tokio::time::Instant::now() >= due {
                return true;
            }
            sleep.as_mut().reset(due);
        }
    }
}

/// The SSE event that ends a stalled stream, in OpenAI's error shape.
fn stalled_event(after: std::time::Duration) -> Bytes {
    let body = serde_json::json!({
        "error": {
            "message": format!(
                "The backend sent nothing for {} s; the stream was ended.",
                after.as_secs_f64()
            ),
            "type": "server_error",
            "param": null,
            "code": "stream_stalled",
        }
    });
    Bytes::from(format!("data: {body}\n\n"))
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => {
                    let Some(idle) = this.idle.as_mut() else {
                        return Poll::Pending;
                    };
                    if !idle.expired(cx) {
                        return Poll::Pending;
                    }
                    let after = idle.after;
                    return Poll::Ready(this.stalled(after).map(|b| Ok(Frame::data(b))));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(idle) = this.idle.as_mut() {
                        idle.last = tokio::time::Instant::now();
                    }
                    let Some(track) = this.track.as_mut() else {
                        return Poll::Ready(Some(Ok(frame)));
                    };
                    let frame = match frame.into_data() {
                        Ok(data) => {
                            let last = this.inner.is_end_stream();
                            let mut out = track.on_data(data, last);
                            // A body with a known length ends with its last byte: the server
                            // may never poll again, so settle now.
                            if last {
                                this.done = true;
                                let rest = track.on_end();
                                if !rest.is_empty() {
                                    let mut joined = BytesMut::from(&out[..]);
                                    joined.extend_from_slice(&rest);
                                    out = joined.freeze();
                                }
                                if out.is_empty() {
                                    return Poll::Ready(None);
                                }
                            } else if track.saw_done() {
                                // The answer is complete at `[DONE]`: settle now, so a client
                                // that closes the connection at once is not counted as
                                // cancelled and the router learns from the usage. Frames that
                                // follow are still passed on (the connection stays reusable).
                                let rest = track.on_end();
                                if !rest.is_empty() {
                                    let mut joined = BytesMut::from(&out[..]);
                                    joined.extend_from_slice(&rest);
                                    out = joined.freeze();
                                }
                                if out.is_empty() {
                                    continue;
                                }
                            } else if out.is_empty() {
                                // Everything was held back or stripped: read on.
                                continue;
                            }
                            Frame::data(out)
                        }
                        Err(frame) => frame,
                    };
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(Some(Err(e))) => {
                    if let Some(track) = this.track.as_mut() {
                        track.guard.backend.metrics.stream_error.inc();
                        track.guard.fail();
                    }
                    this.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    if let Some(track) = this.track.as_mut() {
                        let rest = track.on_end();
                        if !rest.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(rest))));
                        }
                    }
                    return Poll::Ready(None);
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        match &self.track {
            // Stripping may change the length.
            Some(Track {
                scan: Scan::Sse(s), ..
            }) if s.strip_usage => SizeHint::default(),
            _ => self.inner.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const USAGE: &str = "data: {\"id\":\"x\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n";
    const CHUNK: &str = "data: {\"id\":\"x\",\"choices\":[{\"index\":0,\"text\":\"hi\"}]}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    proptest::proptest! {
        /// However the engine's stream is cut into chunks, the scanner passes on the same bytes
        /// (all of them, or all but the usage-only chunk it strips), finds the usage, and sees
        /// `[DONE]` exactly when it was sent.
        #[test]
        fn any_split_of_a_stream_scans_the_same(
            texts in proptest::collection::vec("[a-z \\[\\]\\n]{0,12}", 0..6),
            with_usage in proptest::bool::ANY,
            with_done in proptest::bool::ANY,
            crlf in proptest::bool::ANY,
            cuts in proptest::collection::vec(0usize..400, 0..12),
            strip in proptest::bool::ANY,
        ) {
            let sep = if crlf { "\r\n\r\n" } else { "\n\n" };
            let mut kept = String::new();
            for t in &texts {
                let json = serde_json::json!({"choices": [{"index": 0, "text": t}]});
                kept.push_str(&format!("data: {json}{sep}"));
            }
            let usage = format!(
                "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":10,\"completion_tokens\":3,\"prompt_tokens_details\":{{\"cached_tokens\":8}}}}}}{sep}"
            );
            let done = format!("data: [DONE]{sep}");
            let mut stream = kept.clone();
            if with_usage {
                stream.push_str(&usage);
            }
            if with_done {
                stream.push_str(&done);
                kept.push_str(&done);
            }
            // Only the usage chunk we asked for is ever removed.
            if !(with_usage && strip) {
                kept = stream.clone();
            }
            let bytes = stream.as_bytes();
            let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
            points.sort_unstable();
            points.dedup();
            let mut scanner = SseScanner::new(strip);
            let mut out = Vec::new();
            let mut from = 0;
            for p in points.into_iter().chain([bytes.len()]) {
                out.extend_from_slice(&scanner.feed(Bytes::copy_from_slice(&bytes[from..p])));
                from = p;
            }
            out.extend_from_slice(&scanner.finish());
            proptest::prop_assert_eq!(String::from_utf8(out).unwrap(), kept);
            proptest::prop_assert_eq!(scanner.usage.is_some(), with_usage);
            if with_usage {
                proptest::prop_assert_eq!(scanner.usage.unwrap().cached_tokens, Some(8));
            }
            proptest::prop_assert_eq!(scanner.done, with_done);
        }
    }

    proptest::proptest! {
        /// However a chat stream is cut into chunks, the first choice's text comes out whole,
        /// and anything that makes it untrustworthy (another choice's text) gives none.
        #[test]
        fn any_split_of_a_chat_stream_collects_the_answer(
            texts in proptest::collection::vec("[a-z \"\\\\\n{}é]{0,12}", 1..6),
            second_choice in proptest::bool::ANY,
            cuts in proptest::collection::vec(0usize..400, 0..12),
        ) {
            let mut stream = String::from(
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n",
            );
            for t in &texts {
                let json = serde_json::json!({"choices": [{"index": 0, "delta": {"content": t}}]});
                stream.push_str(&format!("data: {json}\n\n"));
            }
            if second_choice {
                let json = serde_json::json!({"choices": [{"index": 1, "delta": {"content": "x"}}]});
                stream.push_str(&format!("data: {json}\n\n"));
            }
            stream.push_str(USAGE);
            stream.push_str(DONE);
            let bytes = stream.as_bytes();
            let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
            points.sort_unstable();
            let mut scanner = SseScanner::new(false);
            scanner.answer = Some(AnswerText::default());
            let mut from = 0;
            for p in points.into_iter().chain([bytes.len()]) {
                scanner.feed(Bytes::copy_from_slice(&bytes[from..p]));
                from = p;
            }
            scanner.finish();
            let answer = scanner.answer.as_mut().and_then(AnswerText::take);
            let whole: String = texts.concat();
            if second_choice || whole.is_empty() {
                proptest::prop_assert_eq!(answer, None);
            } else {
                proptest::prop_assert_eq!(answer, Some(whole));
            }
        }
    }

    #[test]
    fn a_json_answer_is_collected_from_its_message() {
        let mut answer = AnswerText::default();
        answer.add(br#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"a \"quoted\" answer"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3}}"#);
        assert_eq!(answer.take().as_deref(), Some("a \"quoted\" answer"));
        // No text (a tool call): nothing to warm.
        let mut answer = AnswerText::default();
        answer.add(br#"{"choices":[{"index":0,"message":{"content":null,"tool_calls":[]}}]}"#);
        assert_eq!(answer.take(), None);
        // A body that does not parse is not trusted.
        let mut answer = AnswerText::default();
        answer.add(br#"{"choices":[{"index":0,"message":{"content":"cut"#);
        assert_eq!(answer.take(), None);
    }

    #[test]
    fn the_done_terminator_is_seen_even_when_split() {
        let mut s = SseScanner::new(false);
        s.feed(Bytes::from(CHUNK));
        assert!(!s.done);
        s.feed(Bytes::from("data: [DO"));
        assert!(!s.done, "an incomplete event is not the end");
        s.feed(Bytes::from("NE]\n\n"));
        assert!(s.done);
        // Text that merely mentions it is not the terminator.
        let mut t = SseScanner::new(false);
        t.feed(Bytes::from(
            "data: {\"choices\":[{\"text\":\"[DONE]\"}]}\n\n",
        ));
        assert!(!t.done);
    }

    #[test]
    fn usage_from_json_and_llamacpp_timings() {
        let (u, only) = read_usage(br#"{"choices":[{}],"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}"#).unwrap();
        assert_eq!(
            u,
            Usage {
                prompt_tokens: 5,
                cached_tokens: Some(4),
                completion_tokens: 2
            }
        );
        assert!(!only);
        let (u, _) = read_usage(
            br#"{"usage":{"prompt_tokens":5,"completion_tokens":2},"timings":{"cache_n":3}}"#,
        )
        .unwrap();
        assert_eq!(u.cached_tokens, Some(3));
        assert!(read_usage(br#"{"usage":null}"#).is_none());
        assert!(read_usage(b"garbage").is_none());
    }

    /// The scanner's reading of an answer never differs from serde_json's: what it takes,
    /// serde_json takes with the same usage; what it gives up on goes to serde_json.
    #[test]
    fn the_fast_envelope_agrees_with_serde_json() {
        use crate::json::gen::{self, Rng};
        let by_serde = |json: &[u8]| {
            serde_json::from_slice::<Envelope>(json)
                .ok()
                .and_then(usage_of)
        };
        let fixed: &[&[u8]] = &[
            br#"{"choices":[{"message":{"content":"\u0001\u00e9"}}],"usage":{"completion_tokens":4,"prompt_tokens":2056,"prompt_tokens_details":{"cached_tokens":0},"total_tokens":2060}}"#,
            br#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":null}}"#,
            br#"{"usage":{"prompt_tokens":1,"prompt_tokens":2}}"#,
            br#"{"usage":{"prompt_tokens":4294967296}}"#,
            br#"{"usage":{"prompt_tokens":-1}}"#,
            br#"{"usage":{"prompt_tokens":1.0}}"#,
            br#"{"usage":[1,2,null]}"#,
            br#"{"usage":{"prompt_tokens":1},"usage":null}"#,
            br#"{"timings":{"cache_n":3,"prompt_n":1,"cache_n":2}}"#,
            br#"{"timings":{"cache_n":3,"prompt_n":1},"choices":null} x"#,
            br#"{"us\u0061ge":{"prompt_tokens":1}}"#,
            br#"[]"#,
        ];
        for json in fixed {
            let fast = fast_envelope(json).map(usage_of);
            assert!(
                fast.is_none() || fast == Some(by_serde(json)),
                "{}",
                String::from_utf8_lossy(json)
            );
        }
        let top = ["usage", "choices", "timings", "id", "model"];
        let usage = [
            "prompt_tokens",
            "completion_tokens",
            "prompt_tokens_details",
        ];
        let timings = ["cache_n", "prompt_n", "predicted_n"];
        let mut r = Rng(0x5eed_cafe);
        let mut accepted = 0;
        for _ in 0..20_000 {
            let n = r.below(5);
            let text = gen::object(&mut r, &top, n, |r, key| match key {
                "usage" if r.chance(90) => {
                    let n = r.below(4);
                    gen::object(r, &usage, n, |r, key| match key {
                        "prompt_tokens_details" if r.chance(80) => {
                            let n = r.below(3);
                            gen::object(r, &["cached_tokens"], n, |r, _| gen::number(r).to_string())
                        }
                        _ if r.chance(70) => gen::number(r).to_string(),
                        _ => gen::value(r, 2),
                    })
                }
                "timings" if r.chance(90) => {
                    let n = r.below(4);
                    gen::object(r, &timings, n, |r, _| gen::number(r).to_string())
                }
                _ => gen::value(r, 1),
            });
            let text = if r.chance(20) {
                gen::mutate(&mut r, text.as_bytes())
            } else {
                text.into_bytes()
            };
            if let Some(env) = fast_envelope(&text) {
                accepted += 1;
                assert_eq!(
                    usage_of(env),
                    by_serde(&text),
                    "{}",
                    String::from_utf8_lossy(&text)
                );
                assert!(serde_json::from_slice::<Envelope>(&text).is_ok());
            }
        }
        assert!(accepted > 5_000, "the fast path took only {accepted}");
    }

    #[test]
    fn llama_cpp_timings_stand_in_for_missing_usage() {
        let chunk = br#"{"choices":[{"finish_reason":"length","delta":{}}],"timings":{"cache_n":769,"prompt_n":1,"predicted_n":8}}"#;
        let (u, only) = read_usage(chunk).unwrap();
        assert_eq!(
            u,
            Usage {
                prompt_tokens: 770,
                cached_tokens: Some(769),
                completion_tokens: 8
            }
        );
        assert!(!only, "a chunk with choices is passed on");
        // Timings without the cache counters say nothing.
        assert!(read_usage(br#"{"timings":{"predicted_n":8}}"#).is_none());
        let mut scanner = SseScanner::new(false);
        let mut event = b"data: ".to_vec();
        event.extend_from_slice(chunk);
        event.extend_from_slice(b"\n\n");
        scanner.feed(Bytes::from(event));
        assert_eq!(scanner.usage.map(|u| u.cached_tokens), Some(Some(769)));
    }

    #[test]
    fn passes_chunks_unchanged_and_observes_usage() {
        let mut s = SseScanner::new(false);
        assert_eq!(s.feed(Bytes::from(CHUNK)), CHUNK);
        // An event split across chunks.
        let (a, b) = USAGE.split_at(30);
        assert_eq!(s.feed(Bytes::from(a)), a);
        assert!(s.usage.is_none());
        assert_eq!(s.feed(Bytes::from(b)), b);
        assert_eq!(s.usage.unwrap().cached_tokens, Some(8));
        assert_eq!(s.feed(Bytes::from(DONE)), DONE);
        assert!(s.finish().is_empty());
    }

    #[test]
    fn strips_only_the_usage_only_chunk() {
        let mut s = SseScanner::new(true);
        let all = format!("{CHUNK}{USAGE}{DONE}");
        let out = s.feed(Bytes::from(all));
        assert_eq!(out, format!("{CHUNK}{DONE}"));
        assert_eq!(s.usage.unwrap().prompt_tokens, 10);
        // Split events are held until complete.
        let mut s = SseScanner::new(true);
        let (a, b) = CHUNK.split_at(10);
        assert!(s.feed(Bytes::from(a)).is_empty());
        assert_eq!(s.feed(Bytes::from(b)), CHUNK);
        assert!(s.feed(Bytes::from(USAGE)).is_empty());
        assert_eq!(s.feed(Bytes::from(DONE)), DONE);
        // A chunk with usage and choices (continuous usage) is kept.
        let mut s = SseScanner::new(true);
        let both = "data: {\"choices\":[{\"text\":\"a\"}],\"usage\":{\"prompt_tokens\":1}}\n\n";
        assert_eq!(s.feed(Bytes::from(both)), both);
        assert_eq!(s.usage.unwrap().prompt_tokens, 1);
    }

    #[test]
    fn crlf_events_and_unterminated_tail() {
        let mut s = SseScanner::new(true);
        let crlf = USAGE.replace("\n\n", "\r\n\r\n");
        assert!(s.feed(Bytes::from(crlf)).is_empty());
        assert!(s.usage.is_some());
        let mut s = SseScanner::new(true);
        assert!(s.feed(Bytes::from("data: {\"a\":1}")).is_empty());
        assert_eq!(s.finish(), "data: {\"a\":1}");
    }
}
