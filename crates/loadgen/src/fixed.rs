//! One fixed chat request at a constant rate: the gateway overhead benchmark's generator
//! (`examples/overhead.rs`, driven by `bench/overhead.sh` and `bench/epp.sh`).
//!
//! Sends a chat request to `URL/v1/chat/completions` on a fixed schedule (request `i` is due
//! at `start + i / rate`, whatever happened to the earlier ones: open loop, so a slow server
//! cannot slow the offered load down) for `warmup_s` + `duration_s` seconds, and records with
//! HDR histograms the latency of each request of the warm-up-free window, to the *complete*
//! response body:
//!
//! - from the request's scheduled time (the open-loop figure: includes any wait for a free
//!   connection slot and any lateness of the generator, so queueing is never hidden), and
//! - from the moment the request was handed to the HTTP client (service time),
//!
//! plus how late the generator itself sent requests (its own health check). Run it against an
//! `--instant` engine directly and through a proxy: the difference is the proxy's added latency.
//!
//! The schedule is kept by a [`Pacer`] (a timerfd, or busy-polling with [`PaceMode::Spin`]).
//! Everything is bounded: at most `max_in_flight` requests are outstanding (a semaphore; a
//! request waiting for a slot is late from its schedule, not dropped), and requests not
//! finished `drain_s` seconds after the last one was due are counted as timed out. One
//! preflight request, before the schedule starts, must succeed.
//!
//! The request's user message is `words` four-byte words (a space and three letters: 2048
//! words are 8 KiB, 2,048 tokens for the emulator's 4-bytes-per-token tokenizer),
//! non-streaming unless `stream`. `unique` puts a per-request number first (spelled in the
//! same words, lowest digit first), so no two prompts share a prefix and every prompt stays
//! within the emulator's vocabulary (a tokenizer for it gives no unknown token).

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::{error_chain, http_client, BaseUrl, HttpClient};
use crate::error::{LoadgenError, Result};
use crate::pace::{PaceMode, Pacer, STALL};
use crate::stats::LatencyHist;
pub use crate::words::prompt;
use crate::words::spelled;

/// Lead time before the first send, so it is not late by the set-up.
const LEAD: Duration = Duration::from_millis(20);
/// Most requests a run may send (warm-up included).
const MAX_REQUESTS: f64 = 50_000_000.0;
/// Most bytes of an error body kept in a message.
const ERROR_BODY_BYTES: usize = 200;

/// What a fixed-rate run sends, how fast and for how long.
#[derive(Clone, Debug, PartialEq)]
pub struct FixedOptions {
    /// Base URL (`http://host:port[/prefix]`); requests go to `/v1/chat/completions` under it.
    pub url: String,
    /// Requests per second.
    pub rate: f64,
    /// Seconds measured, after the warm-up.
    pub duration_s: f64,
    /// Seconds sent at the rate before the measured window (not measured).
    pub warmup_s: f64,
    /// Name of the run in its output (default, when empty: the URL).
    pub label: String,
    /// The request's `model`.
    pub model: String,
    /// Four-byte words in the user message.
    pub words: usize,
    /// The request's `max_tokens`.
    pub max_tokens: u32,
    /// Ask for a streamed answer (`"stream": true`).
    pub stream: bool,
    /// Start each prompt with the request's number, so no two share a prefix.
    pub unique: bool,
    /// Two-turn conversations ([`crate::turns`]): every other request is the next turn of a
    /// conversation opened shortly before, and only those are measured.
    pub conversations: bool,
    /// Most requests outstanding at once (later ones wait for a slot).
    pub max_in_flight: usize,
    /// Seconds after the last request was due that unfinished ones are counted as timed out.
    pub drain_s: f64,
    /// How the schedule is kept.
    pub pace: PaceMode,
    /// Limit on connecting.
    pub connect_timeout: Duration,
    /// Limit on the preflight request.
    pub preflight_timeout: Duration,
}

impl Default for FixedOptions {
    fn default() -> Self {
        Self {
            url: String::new(),
            rate: 2000.0,
            duration_s: 10.0,
            warmup_s: 2.0,
            label: String::new(),
            model: "m".into(),
            words: 2048,
            max_tokens: 4,
            stream: false,
            unique: false,
            conversations: false,
            max_in_flight: 256,
            drain_s: 5.0,
            pace: PaceMode::Timer,
            connect_timeout: Duration::from_secs(5),
            preflight_timeout: Duration::from_secs(30),
        }
    }
}

impl FixedOptions {
    /// Checks the numbers: rate and duration > 0, warm-up and drain >= 0, at least one slot,
    /// at most 50 million requests.
    pub fn validate(&self) -> Result<()> {
        let finite = [self.rate, self.duration_s, self.warmup_s, self.drain_s]
            .iter()
            .all(|x| x.is_finite());
        if !(finite
            && self.rate > 0.0
            && self.duration_s > 0.0
            && self.warmup_s >= 0.0
            && self.drain_s >= 0.0)
        {
            return Err(LoadgenError::Invalid(
                "rate and duration must be > 0, warm-up and drain >= 0".into(),
            ));
        }
        if self.max_in_flight == 0 {
            return Err(LoadgenError::Invalid("max_in_flight must be >= 1".into()));
        }
        if self.rate * (self.duration_s + self.warmup_s) > MAX_REQUESTS {
            return Err(LoadgenError::Invalid(
                "more than 50 million requests: lower the rate or the duration".into(),
            ));
        }
        Ok(())
    }

    /// The label, or the URL without one.
    pub fn label(&self) -> &str {
        if self.label.is_empty() {
            &self.url
        } else {
            &self.label
        }
    }

    /// The request body; with `unique`, the prompt starts with that number.
    fn body(&self, text: &str, unique: Option<u64>) -> Result<Bytes> {
        let prefix = unique.map(spelled).unwrap_or_default();
        let stream = if self.stream { ",\"stream\":true" } else { "" };
        let model = serde_json::to_string(&self.model)?;
        Ok(Bytes::from(format!(
            r#"{{"model":{model},"messages":[{{"role":"user","content":"{prefix}{text}"}}],"max_tokens":{}{stream}}}"#,
            self.max_tokens
        )))
    }
}

/// What the preflight request showed.
#[derive(Clone, Debug, PartialEq)]
pub struct Preflight {
    /// Bytes of the request body.
    pub request_bytes: usize,
    /// Bytes of the answer body.
    pub answer_bytes: usize,
    /// The answer's `usage` object as JSON (`None` for a streamed answer).
    pub usage: Option<String>,
}

/// What a fixed-rate run measured (counts and latencies of the measured window only).
#[derive(Clone, Debug)]
pub struct FixedReport {
    /// The run's label.
    pub label: String,
    /// Requests per second offered.
    pub rate: f64,
    /// Seconds measured.
    pub duration_s: f64,
    /// Seconds of warm-up.
    pub warmup_s: f64,
    /// How the schedule was kept.
    pub pace: PaceMode,
    /// The preflight request.
    pub preflight: Preflight,
    /// Measured requests sent.
    pub sent: u64,
    /// Measured requests answered with a 2xx and a complete body.
    pub ok: u64,
    /// Measured requests that failed (non-2xx status, connection or body error).
    pub errors: u64,
    /// Measured requests unfinished when the drain ended.
    pub timeouts: u64,
    /// The first error's message.
    pub first_error: Option<String>,
    /// Whether every request finished within the drain.
    pub drained: bool,
    /// Seconds from the first measured request's schedule to the last answer (or the last
    /// schedule, if later); at least `duration_s`.
    pub window_s: f64,
    /// Successful requests per second of `window_s`.
    pub achieved: f64,
    /// Scheduled time to complete answer.
    pub from_schedule: LatencyHist,
    /// Handed to the client to complete answer.
    pub from_send: LatencyHist,
    /// Handed to the client minus scheduled time: the generator's own lateness.
    pub lag: LatencyHist,
    /// Core stalls while spinning (see [`Pacer::stalls`]).
    pub stalls: u64,
    /// Their total length.
    pub stalled: Duration,
    /// CPU seconds (user + system) the whole process had used at the end.
    pub cpu_s: f64,
    /// Conversation runs: measured next turns sent as new conversations, their first turn
    /// unanswered by then.
    pub without_answer: u64,
}

impl FixedReport {
    /// The preflight line: `LABEL: request N bytes, answer N bytes, usage {...}`.
    pub fn preflight_line(&self) -> String {
        let p = &self.preflight;
        format!(
            "{}: request {} bytes, answer {} bytes, usage {}",
            self.label,
            p.request_bytes,
            p.answer_bytes,
            p.usage.as_deref().unwrap_or("(streamed)")
        )
    }

    /// Why a run without any successful request has no latencies.
    pub fn no_success_line(&self) -> String {
        format!(
            "{}: no successful request ({} errors, first: {:?})",
            self.label, self.errors, self.first_error
        )
    }

    /// The human-readable summary, one line each (with `deciles`, the deciles from the
    /// schedule too); empty without a successful request.
    pub fn text(&self, deciles: bool) -> String {
        if self.ok == 0 {
            return String::new();
        }
        let mut out = String::new();
        let (h, f) = (&self.from_schedule, &self.from_send);
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{} @ {} req/s for {} s (+{} s warm-up): {} ok, {} errors, {} unfinished{}; achieved {:.0} req/s",
            self.label,
            self.rate,
            self.duration_s,
            self.warmup_s,
            self.ok,
            self.errors,
            self.timeouts,
            if self.drained { "" } else { " (drain timed out)" },
            self.achieved
        );
        if let Some(e) = &self.first_error {
            let _ = writeln!(out, "  first error: {e}");
        }
        if self.without_answer > 0 {
            let _ = writeln!(
                out,
                "  next turns sent as new conversations (no answer to their first turn yet): {}",
                self.without_answer
            );
        }
        let _ = writeln!(
            out,
            "  from schedule (µs): p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
            h.quantile_us(0.5),
            h.quantile_us(0.9),
            h.quantile_us(0.99),
            h.quantile_us(0.999),
            h.max_us(),
            h.mean_us()
        );
        let _ = writeln!(
            out,
            "  from send     (µs): p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
            f.quantile_us(0.5),
            f.quantile_us(0.9),
            f.quantile_us(0.99),
            f.quantile_us(0.999),
            f.max_us(),
            f.mean_us()
        );
        if deciles {
            let qs: Vec<String> = (1..10)
                .map(|d| format!("p{}0 {:.0}", d, h.quantile_us(f64::from(d) / 10.0)))
                .collect();
            let _ = writeln!(out, "  deciles from schedule (µs): {}", qs.join("  "));
        }
        let _ = writeln!(
            out,
            "  generator lateness (µs): p50 {:.1}  p99 {:.1}  max {:.1}",
            self.lag.quantile_us(0.5),
            self.lag.quantile_us(0.99),
            self.lag.max_us()
        );
        if self.pace == PaceMode::Spin {
            let _ = writeln!(
                out,
                "  generator core stalls over {} µs: {}, {:.1} ms in all",
                STALL.as_micros(),
                self.stalls,
                self.stalled.as_secs_f64() * 1e3
            );
        }
        out
    }

    /// The machine-readable line the bench scripts parse (fields and order are fixed):
    /// `RESULT label=... rate=... achieved=... ok=... errors=... timeouts=... p50_us=... ...`,
    /// shortened to the counts without a successful request.
    pub fn result_line(&self) -> String {
        if self.ok == 0 {
            return format!(
                "RESULT label={} rate={} achieved=0 ok=0 errors={} timeouts={}",
                self.label, self.rate, self.errors, self.timeouts
            );
        }
        let (h, f) = (&self.from_schedule, &self.from_send);
        format!(
            "RESULT label={} rate={} achieved={:.1} ok={} errors={} timeouts={} \
             p50_us={:.1} p90_us={:.1} p99_us={:.1} p999_us={:.1} max_us={:.1} mean_us={:.1} \
             send_p50_us={:.1} send_p99_us={:.1} send_p999_us={:.1} lag_p99_us={:.1} cpu_s={:.3} \
             stalls={} stalled_ms={:.1}",
            self.label,
            self.rate,
            self.achieved,
            self.ok,
            self.errors,
            self.timeouts,
            h.quantile_us(0.5),
            h.quantile_us(0.9),
            h.quantile_us(0.99),
            h.quantile_us(0.999),
            h.max_us(),
            h.mean_us(),
            f.quantile_us(0.5),
            f.quantile_us(0.99),
            f.quantile_us(0.999),
            self.lag.quantile_us(0.99),
            self.cpu_s,
            self.stalls,
            self.stalled.as_secs_f64() * 1e3,
        )
    }
}

/// What the measured requests recorded.
struct Measured {
    from_schedule: LatencyHist,
    from_send: LatencyHist,
    lag: LatencyHist,
    ok: u64,
    errors: u64,
    first_error: Option<String>,
    last_done: Option<Instant>,
}

impl Default for Measured {
    fn default() -> Self {
        Self {
            from_schedule: LatencyHist::fine(),
            from_send: LatencyHist::fine(),
            lag: LatencyHist::fine(),
            ok: 0,
            errors: 0,
            first_error: None,
            last_done: None,
        }
    }
}

/// One request, to the end of its body: the body of a 2xx answer.
async fn exchange(
    client: &HttpClient,
    uri: &hyper::Uri,
    body: Bytes,
    session: Option<&str>,
) -> std::result::Result<Bytes, String> {
    let mut req =
        hyper::Request::post(uri.clone()).header(http::header::CONTENT_TYPE, "application/json");
    if let Some(session) = session {
        req = req.header("x-session-id", session);
    }
    let req = req
        .body(Full::new(body))
        .map_err(|e| format!("building the request: {e}"))?;
    let response = client.request(req).await.map_err(|e| error_chain(&e))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {}", error_chain(&e)))?
        .to_bytes();
    if status.is_success() {
        Ok(bytes)
    } else {
        Err(format!(
            "status {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(ERROR_BODY_BYTES)])
        ))
    }
}

/// CPU seconds (user + system) this process has used.
#[cfg(unix)]
fn cpu_seconds() -> f64 {
    // SAFETY: an all-zero rusage is valid, and getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU seconds this process has used (not measured off Unix).
#[cfg(not(unix))]
fn cpu_seconds() -> f64 {
    0.0
}

/// Locks the measurements; a panic in another task leaves them usable.
fn lock(m: &Mutex<Measured>) -> std::sync::MutexGuard<'_, Measured> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs the preflight request, then the schedule; see the module docs.
///
/// Works on any tokio runtime with I/O and time enabled; the benchmark runs it on a
/// current-thread runtime (with [`PaceMode::Spin`], pinned to a core of its own).
pub async fn run(options: &FixedOptions) -> Result<FixedReport> {
    options.validate()?;
    let uri = BaseUrl::parse(&options.url)?.uri("/v1/chat/completions")?;
    let client = http_client(options.max_in_flight, options.connect_timeout);
    let text = prompt(options.words);
    let fixed = options.body(&text, None)?;

    let answer = tokio::time::timeout(
        options.preflight_timeout,
        exchange(&client, &uri, fixed.clone(), None),
    )
    .await
    .map_err(|_| {
        LoadgenError::Preflight(format!(
            "no answer within {:.1} s",
            options.preflight_timeout.as_secs_f64()
        ))
    })?
    .map_err(LoadgenError::Preflight)?;
    let preflight = Preflight {
        request_bytes: fixed.len(),
        answer_bytes: answer.len(),
        usage: serde_json::from_slice::<serde_json::Value>(&answer)
            .ok()
            .and_then(|v| v.get("usage").map(ToString::to_string)),
    };

    let mut pacer = Pacer::new(options.pace).map_err(LoadgenError::Pacer)?;
    let measured = Arc::new(Mutex::new(Measured::default()));
    let slots = Arc::new(Semaphore::new(options.max_in_flight));
    let period_ns = 1e9 / options.rate;
    let total = ((options.warmup_s + options.duration_s) * options.rate).round() as u64;
    let warm = (options.warmup_s * options.rate).round() as u64;
    let start = Instant::now() + LEAD;
    let due_at = |i: u64| start + Duration::from_nanos((i as f64 * period_ns) as u64);
    let measure_from = due_at(warm);
    let turns = options
        .conversations
        .then(|| Arc::new(crate::turns::Turns::new(options.rate)));
    let mut tasks = JoinSet::new();
    let mut sent = 0u64;
    for i in 0..total {
        let due = due_at(i);
        pacer.sleep_until(due).await.map_err(LoadgenError::Pacer)?;
        let (body, session, first_turn) = match &turns {
            Some(turns) => {
                let turn =
                    turns.request(&options.model, options.max_tokens, options.stream, &text, i)?;
                (
                    turn.body,
                    Some(turn.session),
                    (!turn.next).then(|| turns.clone()),
                )
            }
            None if options.unique => (options.body(&text, Some(i))?, None, None),
            None => (fixed.clone(), None, None),
        };
        // In a conversation run only next turns are measured.
        let is_measured = i >= warm && (turns.is_none() || i % 2 == 1);
        sent += u64::from(is_measured);
        let stream = options.stream;
        let (client, uri, measured, slots) =
            (client.clone(), uri.clone(), measured.clone(), slots.clone());
        tasks.spawn(async move {
            // The semaphore is never closed.
            let Ok(permit) = slots.acquire().await else {
                return;
            };
            let sent_at = Instant::now();
            let result = exchange(&client, &uri, body, session.as_deref()).await;
            let done = Instant::now();
            drop(permit);
            if let (Some(turns), Ok(answer)) = (&first_turn, &result) {
                turns.answered(i, answer, stream);
            }
            if !is_measured {
                return;
            }
            let mut m = lock(&measured);
            match result {
                Ok(_) => {
                    m.ok += 1;
                    m.from_schedule.record(done.saturating_duration_since(due));
                    m.from_send.record(done.saturating_duration_since(sent_at));
                    m.lag.record(sent_at.saturating_duration_since(due));
                    m.last_done = Some(m.last_done.map_or(done, |t| t.max(done)));
                }
                Err(e) => {
                    m.errors += 1;
                    m.first_error.get_or_insert(e);
                }
            }
        });
        // Reap the finished ones, so the set holds only those in flight.
        while tasks.try_join_next().is_some() {}
    }
    let last_due = due_at(total.saturating_sub(1));
    let drain = Duration::from_secs_f64(options.drain_s);
    let drained = tokio::time::timeout(drain, async { while tasks.join_next().await.is_some() {} })
        .await
        .is_ok();
    // Requests still in flight are given up (and counted as timed out below).
    tasks.abort_all();
    let m = std::mem::take(&mut *lock(&measured));
    let timeouts = sent.saturating_sub(m.ok + m.errors);
    let end = m.last_done.map_or(last_due, |t| t.max(last_due));
    let window_s = end
        .saturating_duration_since(measure_from)
        .as_secs_f64()
        .max(options.duration_s);
    let (stalls, stalled) = pacer.stalls();
    Ok(FixedReport {
        label: options.label().to_string(),
        rate: options.rate,
        duration_s: options.duration_s,
        warmup_s: options.warmup_s,
        pace: options.pace,
        preflight,
        sent,
        ok: m.ok,
        errors: m.errors,
        timeouts,
        first_error: m.first_error,
        drained,
        window_s,
        achieved: m.ok as f64 / window_s,
        from_schedule: m.from_schedule,
        from_send: m.from_send,
        lag: m.lag,
        stalls,
        stalled,
        cpu_s: cpu_seconds(),
        without_answer: turns.map_or(0, |t| {
            t.without_answer.load(std::sync::atomic::Ordering::Relaxed)
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicU64, Ordering};

    use hyper::server::conn::http1;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpListener;

    /// What the test server does after answering its first request.
    #[derive(Clone, Copy)]
    enum Then {
        Answer,
        Fail,
        Hang,
    }

    /// A tiny chat server on 127.0.0.1:0: the first request gets a JSON answer with usage,
    /// later ones as `then` says. Returns its URL and its request count.
    async fn server(then: Then) -> (String, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let count = Arc::new(AtomicU64::new(0));
        let seen = count.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let n = seen.fetch_add(1, Ordering::SeqCst);
                        async move {
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            assert!(body.starts_with(br#"{"model":"m","messages":"#));
                            let mut r = hyper::Response::new(Full::new(Bytes::from_static(
                                br#"{"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":1}}"#,
                            )));
                            match (n, then) {
                                (0, _) | (_, Then::Answer) => {}
                                (_, Then::Fail) => {
                                    *r.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR;
                                    *r.body_mut() = Full::new(Bytes::from_static(b"broken"));
                                }
                                (_, Then::Hang) => std::future::pending::<()>().await,
                            }
                            Ok::<_, Infallible>(r)
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        (format!("http://{addr}"), count)
    }

    /// 200 req/s for 0.2 s after 0.05 s of warm-up: 50 requests, the last 40 measured.
    fn options(url: String, pace: PaceMode) -> FixedOptions {
        FixedOptions {
            url,
            rate: 200.0,
            duration_s: 0.2,
            warmup_s: 0.05,
            words: 16,
            drain_s: 0.5,
            pace,
            ..Default::default()
        }
    }

    #[test]
    fn bodies() {
        assert_eq!(prompt(3), " the not out");
        assert_eq!(prompt(2048).len(), 8192);
        let o = FixedOptions {
            words: 2,
            ..Default::default()
        };
        let text = prompt(o.words);
        assert_eq!(
            o.body(&text, Some(7)).unwrap(),
            r#"{"model":"m","messages":[{"role":"user","content":" not the the the the the the the the not"}],"max_tokens":4}"#
        );
        assert_eq!(spelled(0x12), " for and the the the the the the");
        assert_ne!(
            spelled(1)[..4],
            spelled(2)[..4],
            "apart from the first word"
        );
        let o = FixedOptions { stream: true, ..o };
        assert!(o
            .body(&text, None)
            .unwrap()
            .ends_with(b"\"max_tokens\":4,\"stream\":true}"));
    }

    #[test]
    fn validates() {
        let ok = FixedOptions {
            url: "http://127.0.0.1:1".into(),
            ..Default::default()
        };
        assert!(ok.validate().is_ok());
        assert_eq!(ok.label(), "http://127.0.0.1:1");
        for bad in [
            FixedOptions {
                rate: 0.0,
                ..ok.clone()
            },
            FixedOptions {
                duration_s: 0.0,
                ..ok.clone()
            },
            FixedOptions {
                warmup_s: -1.0,
                ..ok.clone()
            },
            FixedOptions {
                drain_s: f64::NAN,
                ..ok.clone()
            },
            FixedOptions {
                max_in_flight: 0,
                ..ok.clone()
            },
            FixedOptions {
                rate: 1e7,
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(LoadgenError::Invalid(_))),
                "{bad:?}"
            );
        }
    }

    #[tokio::test]
    async fn every_measured_request_is_counted_ok() {
        for pace in [PaceMode::Timer, PaceMode::Spin] {
            let (url, count) = server(Then::Answer).await;
            let r = run(&options(url, pace)).await.unwrap();
            assert_eq!(
                (r.sent, r.ok, r.errors, r.timeouts),
                (40, 40, 0, 0),
                "{pace:?}"
            );
            assert!(r.drained);
            // The preflight and the 50 scheduled requests.
            assert_eq!(count.load(Ordering::SeqCst), 51);
            assert_eq!(r.from_schedule.count(), 40);
            assert_eq!((r.from_send.count(), r.lag.count()), (40, 40));
            assert!(r.from_schedule.quantile_us(0.5) >= r.from_send.quantile_us(0.5));
            assert!(r.window_s >= 0.2 && r.achieved > 0.0, "{r:?}");
            let usage = r.preflight.usage.as_deref().unwrap();
            assert!(usage.contains(r#""prompt_tokens":8"#), "{usage}");
            assert!(
                r.preflight_line().contains(" usage {"),
                "{}",
                r.preflight_line()
            );
            let line = r.result_line();
            let keys: Vec<&str> = line
                .split(' ')
                .skip(1)
                .map(|kv| kv.split('=').next().unwrap())
                .collect();
            assert_eq!(
                keys.join(" "),
                "label rate achieved ok errors timeouts p50_us p90_us p99_us p999_us max_us \
                 mean_us send_p50_us send_p99_us send_p999_us lag_p99_us cpu_s stalls stalled_ms"
            );
            assert!(
                line.starts_with(&format!("RESULT label={} rate=200 ", r.label)),
                "{line}"
            );
            let text = r.text(true);
            assert!(text.contains("40 ok, 0 errors, 0 unfinished;"), "{text}");
            assert!(text.contains("deciles from schedule"), "{text}");
            assert_eq!(
                text.contains("generator core stalls"),
                pace == PaceMode::Spin
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_on_a_multi_thread_runtime() {
        let (url, _) = server(Then::Answer).await;
        let o = FixedOptions {
            unique: true,
            ..options(url, PaceMode::Timer)
        };
        let r = run(&o).await.unwrap();
        assert_eq!((r.sent, r.ok, r.errors, r.timeouts), (40, 40, 0, 0));
    }

    #[tokio::test]
    async fn server_errors_are_counted() {
        let (url, _) = server(Then::Fail).await;
        let r = run(&options(url, PaceMode::Timer)).await.unwrap();
        assert_eq!((r.sent, r.ok, r.errors, r.timeouts), (40, 0, 40, 0));
        let first = r.first_error.as_deref().unwrap();
        assert!(
            first.starts_with("status 500 Internal Server Error: broken"),
            "{first}"
        );
        assert_eq!(
            r.result_line(),
            format!(
                "RESULT label={} rate=200 achieved=0 ok=0 errors=40 timeouts=0",
                r.label
            )
        );
        assert!(r.text(false).is_empty());
        assert!(r
            .no_success_line()
            .contains("no successful request (40 errors"));
    }

    #[tokio::test]
    async fn unanswered_requests_time_out_after_the_drain() {
        let (url, _) = server(Then::Hang).await;
        let o = FixedOptions {
            drain_s: 0.2,
            ..options(url, PaceMode::Timer)
        };
        let t = Instant::now();
        let r = run(&o).await.unwrap();
        assert_eq!((r.sent, r.ok, r.errors, r.timeouts), (40, 0, 0, 40));
        assert!(!r.drained);
        // The schedule (0.27 s with the lead) and the drain, not much more.
        assert!(
            t.elapsed() >= Duration::from_millis(450),
            "{:?}",
            t.elapsed()
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[tokio::test]
    async fn a_failed_preflight_is_an_error() {
        // Nothing listens on port 1 of loopback.
        let o = options("http://127.0.0.1:1".into(), PaceMode::Timer);
        assert!(matches!(run(&o).await, Err(LoadgenError::Preflight(_))));
        assert!(matches!(
            run(&FixedOptions {
                url: "ftp://x".into(),
                ..o
            })
            .await,
            Err(LoadgenError::Url { .. })
        ));
    }
}
