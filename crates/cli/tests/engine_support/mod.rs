//! Shared helpers for the `switchyard engine` integration tests: the emulator as a child
//! process (the shared [`Proc`]) with the endpoints it prints, and JSON/metrics helpers.

#![allow(dead_code)]

use std::time::Duration;

use serde_json::Value;

// Each test binary uses its own subset.
#[allow(unused_imports)]
pub use crate::support::{client, poll, prompt, sse_chunks, Proc};

/// A running emulator process, killed when dropped.
pub struct Emulator {
    proc: Proc,
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
        let mut argv: Vec<String> = ["engine", "--host", "127.0.0.1", "--port", "0"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        argv.extend(args.iter().map(|s| s.to_string()));
        let proc = Proc::start(&argv);
        let endpoint = |prefix: &str| {
            proc.before
                .iter()
                .find_map(|l| l.strip_prefix(prefix))
                .map(|ep| ep.trim().to_string())
        };
        let kv_endpoint = endpoint("kv-events on ");
        let kv_replay_endpoint = endpoint("kv-events-replay on ");
        Emulator {
            base: proc.base.clone(),
            proc,
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
        self.proc.kill();
    }

    /// Process id of the emulator.
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// Waits up to `timeout` for the process to exit; its exit code if it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        self.proc.wait_exit(timeout)
    }

    /// Absolute URL for `path`.
    pub fn url(&self, path: &str) -> String {
        self.proc.url(path)
    }
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

/// The value of the first sample of `name` (exact metric name incl. suffix).
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
