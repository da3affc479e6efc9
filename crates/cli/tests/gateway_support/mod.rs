//! Shared helpers for the gateway integration tests: spawn the real `switchyard serve` and
//! `switchyard engine` processes on 127.0.0.1 ephemeral ports (killed on drop), fake engines
//! that misbehave on purpose, and polling with deadlines (never fixed sleeps).

#![allow(dead_code)]

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

// Each test binary uses its own subset.
#[allow(unused_imports)]
pub use crate::support::{client, poll, prompt, sse_chunks, Proc};

/// The served model of test engines.
pub const MODEL: &str = "gw-test-model";

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// `switchyard engine` on an ephemeral port (`port` 0) or a given one.
pub fn engine_on(port: u16, extra: &[&str]) -> Proc {
    engine_at("127.0.0.1", port, extra)
}

/// `switchyard engine` on a given loopback address (127.0.0.2 and up let several engines share
/// one port, as pods of a pool do).
pub fn engine_at(host: &str, port: u16, extra: &[&str]) -> Proc {
    let mut args = strings(&[
        "engine",
        "--host",
        host,
        "--port",
        &port.to_string(),
        "--model",
        MODEL,
    ]);
    args.extend(strings(extra));
    Proc::start(&args)
}

/// `switchyard engine` at 100x speed on an ephemeral port.
pub fn engine(extra: &[&str]) -> Proc {
    let mut all = vec!["--speed", "100"];
    all.extend_from_slice(extra);
    engine_on(0, &all)
}

/// `switchyard serve --listen 127.0.0.1:0` with fast health checks and scrapes.
/// Flags in `extra` replace these defaults.
pub fn gateway(extra: &[&str]) -> Proc {
    Proc::start(&gateway_args(extra))
}

/// The same, its log (stderr) kept ([`Proc::log`]), with extra environment (`RUST_LOG`).
pub fn gateway_logging(extra: &[&str], env: &[(&str, &str)]) -> Proc {
    Proc::start_logging(&gateway_args(extra), env)
}

/// The arguments [`gateway`] runs `switchyard` with.
fn gateway_args(extra: &[&str]) -> Vec<String> {
    let mut args = strings(&["serve"]);
    for (flag, value) in [
        ("--listen", "127.0.0.1:0"),
        ("--health-interval", "0.1"),
        ("--scrape-interval", "0.1"),
        ("--probe-timeout", "1"),
    ] {
        if !extra.contains(&flag) {
            args.extend(strings(&[flag, value]));
        }
    }
    args.extend(strings(extra));
    args
}

/// `switchyard epp` on 127.0.0.1 with ephemeral ports and fast health checks. Flags in
/// `extra` replace these defaults.
pub fn epp(extra: &[&str]) -> Proc {
    let mut args = strings(&["epp"]);
    for (flag, value) in [
        ("--host", "127.0.0.1"),
        ("--grpc-port", "0"),
        ("--grpc-health-port", "0"),
        ("--metrics-port", "0"),
        ("--health-interval", "0.2"),
    ] {
        if !extra.contains(&flag) {
            args.extend(strings(&[flag, value]));
        }
    }
    args.extend(strings(extra));
    Proc::start(&args)
}

/// Replica-sync messages `p` has applied (`--peer`).
pub async fn peer_messages_applied(c: &reqwest::Client, p: &Proc) -> f64 {
    let m = get_with(c, &p.url("/metrics"), &[]).await.text;
    metric_sum(
        &m,
        "switchyard_peer_messages_total",
        &["result=\"applied\""],
    )
}

/// Starts a conversation (a 600-token prompt) at `start_url` (`/v1/completions`), waits until
/// `peer` has applied its decision and end, continues it through `peer` (a `serve` with
/// `--debug-header`) and checks that the continuation ran where the first turn did (the backend
/// `served` names from the first answer) with the first turn reported cached.
pub async fn continue_on_peer(
    c: &reqwest::Client,
    start_url: &str,
    served: impl Fn(&Reply) -> Option<String>,
    peer: &Proc,
    tag: &str,
) {
    let first_turn = prompt(tag, 600);
    let before = peer_messages_applied(c, peer).await;
    let body = serde_json::json!({"model": MODEL, "prompt": first_turn, "max_tokens": 2});
    let first = post(c, start_url, &body).await;
    assert_eq!(first.status, 200, "{}", first.text);
    // Routed and end reach the peer (a JSON answer has no first token of its own).
    let heard = poll(std::time::Duration::from_secs(10), || async {
        (peer_messages_applied(c, peer).await >= before + 2.0).then_some(())
    })
    .await;
    assert!(
        heard.is_some(),
        "{tag}: the peer did not hear the first turn"
    );
    let next = format!("{first_turn} and then the next question");
    let body = serde_json::json!({"model": MODEL, "prompt": next, "max_tokens": 2});
    let second = post(c, &peer.url("/v1/completions"), &body).await;
    assert_eq!(second.status, 200, "{}", second.text);
    assert_eq!(
        second.header("x-switchyard-backend"),
        served(&first),
        "{tag}: {}",
        second.header("x-switchyard-decision").unwrap_or_default()
    );
    let cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(cached >= 500, "{tag}: {}", second.text);
}

/// Runs `switchyard <args>`, expects it to fail, and returns its stderr.
pub fn fails(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .output()
        .expect("runs");
    assert!(!out.status.success(), "switchyard {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `--backend` value for a process with explicit models.
pub fn backend(p: &Proc) -> String {
    format!("{},models={MODEL}", p.base)
}

/// A response reduced to what tests look at.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status.
    pub status: u16,
    /// Headers.
    pub headers: reqwest::header::HeaderMap,
    /// Body text.
    pub text: String,
}

impl Reply {
    /// Body as JSON (Null when not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or(Value::Null)
    }

    /// A header as text.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    }
}

/// POST JSON.
pub async fn post(c: &reqwest::Client, url: &str, body: &Value) -> Reply {
    let r = c.post(url).json(body).send().await.expect("send");
    reply(r).await
}

/// POST JSON with extra headers.
pub async fn post_with(
    c: &reqwest::Client,
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Reply {
    let mut b = c.post(url).json(body);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    reply(b.send().await.expect("send")).await
}

/// GET with extra headers.
pub async fn get_with(c: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> Reply {
    let mut b = c.get(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    reply(b.send().await.expect("send")).await
}

async fn reply(r: reqwest::Response) -> Reply {
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let text = r.text().await.expect("body");
    Reply {
        status,
        headers,
        text,
    }
}

/// A chat request body.
pub fn chat(content: &str, max_tokens: u32) -> Value {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    })
}

/// The sum of every sample of metric `name` whose labels contain all of `labels`.
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// An unlabelled metric's value from a process's /metrics (None until it answers).
pub async fn metric(c: &reqwest::Client, p: &Proc, name: &str) -> Option<f64> {
    let text = c
        .get(p.url("/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The gateway's `/admin/fleet` backends by name -> health.
pub async fn fleet_health(c: &reqwest::Client, gw: &Proc, token: &str) -> Vec<(String, String)> {
    let auth = format!("Bearer {token}");
    let r = get_with(c, &gw.url("/admin/fleet"), &[("authorization", &auth)]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json()["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .map(|b| {
            (
                b["name"].as_str().unwrap_or_default().to_string(),
                b["health"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// How a fake engine misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fake {
    /// Every request gets 500 (health checks too).
    Status500,
    /// Every request gets 429 (health checks pass).
    Status429,
    /// Generation requests get their connection closed without an answer (health passes).
    Drop,
    /// Answers 200 JSON with usage announcing keep-alive, then closes the connection when the
    /// next request arrives on it instead of answering (llama.cpp's habit, without the race).
    KeepAliveLiar,
    /// Answers 200 JSON (`{"object":"ok","path":...}`) and keeps the connection.
    Ok,
    /// Generation requests are read and never answered (health passes).
    Hang,
    /// Generation requests get a streamed answer that ends in `data: [DONE]` with usage, and the
    /// body is then never terminated (the connection is held open).
    DoneThenHold,
    /// Generation requests get stream headers and one token, then nothing ever again.
    StallMidStream,
}

/// A fake engine on an ephemeral port; counts the generation requests it saw.
pub struct FakeEngine {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// Generation (non-probe) requests received.
    pub hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn response(status: &str, body: &str, keep_alive: bool) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: {}\r\n\r\n{body}",
        body.len(),
        if keep_alive { "keep-alive" } else { "close" }
    )
    .into_bytes()
}

/// Answers with SSE headers and `events` as one chunk, then holds the connection without the
/// terminating chunk: the body never ends.
async fn stream_then_hold(s: &mut tokio::net::TcpStream, events: &str) {
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    let chunk = format!("{head}{:x}\r\n{events}\r\n", events.len());
    if s.write_all(chunk.as_bytes()).await.is_ok() {
        std::future::pending::<()>().await;
    }
}

/// Reads one request (head and content-length body); its request line, or None at EOF.
async fn read_request(s: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            let total = end + 4 + len;
            while buf.len() < total {
                let mut chunk = [0u8; 8192];
                let n = s.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            buf.drain(..total);
            return head.lines().next().map(String::from);
        }
        let mut chunk = [0u8; 8192];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

impl FakeEngine {
    /// Starts a fake engine (inside a tokio runtime).
    pub async fn start(mode: Fake) -> FakeEngine {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let hits = Arc::new(AtomicUsize::new(0));
        let counter = hits.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let counter = counter.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut served = 0;
                    while let Some(line) = read_request(&mut s, &mut buf).await {
                        let probe = line.contains(" /health") || line.contains(" /metrics");
                        if mode == Fake::KeepAliveLiar && served > 0 {
                            // The connection is already closing: the request is never read.
                            return;
                        }
                        served += 1;
                        if !probe {
                            counter.fetch_add(1, Ordering::SeqCst);
                        }
                        let out = match (mode, probe) {
                            (Fake::Status500, _) => response(
                                "500 Internal Server Error",
                                r#"{"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}"#,
                                true,
                            ),
                            (_, true) => response("200 OK", "", true),
                            (Fake::Status429, false) => response(
                                "429 Too Many Requests",
                                r#"{"error":{"message":"busy","type":"RateLimitError","param":null,"code":429}}"#,
                                true,
                            ),
                            (Fake::Drop, false) => return,
                            (Fake::Hang, false) => {
                                // Hold the connection open without answering.
                                std::future::pending::<()>().await;
                                return;
                            }
                            (Fake::KeepAliveLiar, false) => {
                                let body = r#"{"object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":0}}}"#;
                                // Says keep-alive, but will close instead of answering the next
                                // request on this connection.
                                response("200 OK", body, true)
                            }
                            (Fake::DoneThenHold, false) => {
                                let events = concat!(
                                    "data: {\"choices\":[{\"index\":0,\"text\":\"x\"}]}\n\n",
                                    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,",
                                    "\"completion_tokens\":1,\"prompt_tokens_details\":",
                                    "{\"cached_tokens\":0}}}\n\n",
                                    "data: [DONE]\n\n"
                                );
                                stream_then_hold(&mut s, events).await;
                                return;
                            }
                            (Fake::StallMidStream, false) => {
                                let event =
                                    "data: {\"choices\":[{\"index\":0,\"text\":\"x\"}]}\n\n";
                                stream_then_hold(&mut s, event).await;
                                return;
                            }
                            (Fake::Ok, false) => {
                                let path = line.split(' ').nth(1).unwrap_or("").to_string();
                                let body =
                                    serde_json::json!({"object": "ok", "path": path}).to_string();
                                response("200 OK", &body, true)
                            }
                        };
                        if s.write_all(&out).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        FakeEngine { base, hits, task }
    }

    /// `--backend` value.
    pub fn backend(&self) -> String {
        format!("{},models={MODEL}", self.base)
    }

    /// Requests received.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// Reads one request (head and content-length body); its request line and body, or None at EOF.
async fn read_request_body(
    s: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
) -> Option<(String, Vec<u8>)> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            let total = end + 4 + len;
            while buf.len() < total {
                let mut chunk = [0u8; 8192];
                let n = s.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = buf[end + 4..total].to_vec();
            buf.drain(..total);
            return Some((head.lines().next().unwrap_or_default().to_string(), body));
        }
        let mut chunk = [0u8; 8192];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A fake engine that records the JSON body of every generation request and answers it with a
/// plain (non-streamed) completion naming itself, with usage and a NixlConnector-style
/// `kv_transfer_params` hand-off (`remote_engine_id` = its name).
pub struct Recorder {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    bodies: Arc<std::sync::Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Recorder {
    /// Starts a recorder answering as `name` (inside a tokio runtime).
    pub async fn start(name: &str) -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = bodies.clone();
        let name = name.to_string();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let seen = seen.clone();
                let name = name.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    while let Some((line, body)) = read_request_body(&mut s, &mut buf).await {
                        let probe = line.contains(" /health") || line.contains(" /metrics");
                        let out = if probe {
                            response("200 OK", "", true)
                        } else {
                            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                            seen.lock().expect("lock").push(v);
                            let answer = serde_json::json!({
                                "id": format!("cmpl-{name}"),
                                "object": "text_completion",
                                "model": MODEL,
                                "choices": [{"index": 0, "text": name, "finish_reason": "length"}],
                                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                                          "prompt_tokens_details": {"cached_tokens": 0}},
                                "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
                                    "remote_engine_id": name, "remote_block_ids": [0],
                                    "remote_request_id": "r", "remote_host": "127.0.0.1",
                                    "remote_port": 1, "tp_size": 1},
                            });
                            response("200 OK", &answer.to_string(), true)
                        };
                        if s.write_all(&out).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Recorder { base, bodies, task }
    }

    /// The generation request bodies received so far.
    pub fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().expect("lock").clone()
    }

    /// `--backend` value with `extra` options appended (e.g. `,role=prefill`).
    pub fn backend(&self, extra: &str) -> String {
        format!("{},models={MODEL}{extra}", self.base)
    }
}

/// A loopback port with nothing listening on it (connections are refused).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}
