//! Shared helpers for the `switchyard engine` integration tests: spawn the
//! real binary on an ephemeral port, read its address line, poll with
//! deadlines, and kill it on drop.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A running emulator process, killed when dropped.
pub struct Emulator {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The KV-events endpoint the process printed, if it bound one.
    pub kv_endpoint: Option<String>,
    /// The KV-events replay endpoint the process printed, if it serves one.
    pub kv_replay_endpoint: Option<String>,
}

impl Emulator {
    /// Start `switchyard engine --host 127.0.0.1 --port 0 <args>` and wait for
    /// its `listening on` line.
    pub fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .arg("engine")
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn switchyard engine");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut kv_endpoint = None;
        let mut kv_replay_endpoint = None;
        let mut emu = None;
        while Instant::now() < deadline {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(line) => {
                    if let Some(ep) = line.strip_prefix("kv-events on ") {
                        kv_endpoint = Some(ep.trim().to_string());
                    }
                    if let Some(ep) = line.strip_prefix("kv-events-replay on ") {
                        kv_replay_endpoint = Some(ep.trim().to_string());
                    }
                    if let Some(addr) = line.strip_prefix("listening on ") {
                        emu = Some(addr.trim().to_string());
                        break;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(status)) = child.try_wait() {
                        panic!("emulator exited early: {status}");
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let Some(base) = emu else {
            let _ = child.kill();
            panic!("emulator did not print its address in time");
        };
        Emulator {
            child,
            base,
            kv_endpoint,
            kv_replay_endpoint,
        }
    }

    /// An emulator of `model` at 100x speed publishing KV events on a loopback port it binds
    /// (`kv_endpoint`).
    pub fn start_publishing(model: &str) -> Self {
        let emu = Self::start(&[
            "--model",
            model,
            "--speed",
            "100",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-bind",
        ]);
        assert!(emu.kv_endpoint.is_some(), "no kv-events line");
        emu
    }

    /// Kills the process now and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Process id of the emulator.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Wait for the process to exit, up to `timeout`; returns its status.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Absolute URL for `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP client with a sane timeout.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

/// POST JSON and return (status, parsed body or Null).
pub async fn post_json(c: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = c.post(url).json(body).send().await.expect("send");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// POST raw bytes as JSON content and return (status, parsed body or Null).
pub async fn post_raw(c: &reqwest::Client, url: &str, body: &str) -> (u16, Value) {
    let r = c
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("send");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// GET and return (status, text).
pub async fn get_text(c: &reqwest::Client, url: &str) -> (u16, String) {
    let r = c.get(url).send().await.expect("send");
    let status = r.status().as_u16();
    (status, r.text().await.expect("body"))
}

/// Parse an SSE body into its JSON chunks; asserts it ends with `[DONE]`.
pub fn sse_chunks(body: &str) -> Vec<Value> {
    let events: Vec<&str> = body
        .split("\n\n")
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    assert_eq!(
        events.last().copied(),
        Some("data: [DONE]"),
        "stream: {body}"
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| {
            let data = e.strip_prefix("data: ").expect("data: prefix");
            serde_json::from_str(data).expect("chunk json")
        })
        .collect()
}

/// The value of the first sample of `name` (exact metric name incl. suffix).
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Poll `f` until it returns Some or the deadline passes.
pub async fn poll<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A prompt of roughly `tokens` tokens, unique per `tag`.
pub fn prompt(tag: &str, tokens: usize) -> String {
    let mut s = format!("[{tag}] ");
    while s.len() < tokens * 4 {
        s.push_str("the quick brown fox jumps over the lazy dog ");
    }
    s.truncate(tokens * 4);
    s
}
