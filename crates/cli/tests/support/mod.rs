//! Helpers every integration test shares: the real `switchyard` binary run on 127.0.0.1
//! ephemeral ports (killed on drop, its address line read with a deadline), polling with
//! deadlines (never fixed sleeps), prompts, SSE bodies and an HTTP client.
//! Every test binary that uses `gateway_support` or `engine_support` declares `mod support;`
//! as well (they re-export from it).

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A child process that printed `listening on http://ADDR`; killed when dropped.
pub struct Proc {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The whole address line (what follows the address: other ports, for `epp`).
    pub line: String,
    /// The lines printed before it (other endpoints the process bound).
    pub before: Vec<String>,
    lines: mpsc::Receiver<String>,
    /// Its stderr lines so far, when started with [`Proc::start_logging`] (else empty).
    log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    /// Runs `switchyard <args>` and waits for its address line.
    pub fn start(args: &[String]) -> Proc {
        Self::start_with_env(args, &[])
    }

    /// Same, with extra environment variables for the child only.
    pub fn start_with_env(args: &[String], env: &[(&str, &str)]) -> Proc {
        Self::spawn(args, env, false)
    }

    /// Same, keeping its stderr (its log) for [`Proc::log`]; the lines are passed on to the
    /// test's stderr too, so a failing test still shows them.
    pub fn start_logging(args: &[String], env: &[(&str, &str)]) -> Proc {
        Self::spawn(args, env, true)
    }

    fn spawn(args: &[String], env: &[(&str, &str)], capture: bool) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(if capture {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .expect("spawn switchyard");
        let log = Arc::new(Mutex::new(Vec::new()));
        if let Some(stderr) = child.stderr.take() {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    eprintln!("{line}");
                    log.lock().expect("log").push(line);
                }
            });
        }
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
        let mut before = Vec::new();
        while Instant::now() < deadline {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("listening on ") {
                        return Proc {
                            child,
                            base: rest
                                .split_whitespace()
                                .next()
                                .unwrap_or_default()
                                .to_string(),
                            line: line.clone(),
                            before,
                            lines: rx,
                            log,
                        };
                    }
                    before.push(line);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(status)) = child.try_wait() {
                        panic!("switchyard {args:?} exited early: {status}");
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("switchyard {args:?} did not print its address in time");
    }

    /// Absolute URL of `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `host:port`.
    pub fn authority(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.authority()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("port")
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The stderr lines so far (none unless started with [`Proc::start_logging`]).
    pub fn log(&self) -> Vec<String> {
        self.log.lock().expect("log").clone()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Kills the process now and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits up to `timeout` for the process to exit; its exit code if it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status.code().unwrap_or(-1));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A file named `*name` holding `text`, removed when the returned path is dropped.
pub fn temp_file(name: &str, text: &str) -> tempfile::TempPath {
    let file = tempfile::Builder::new()
        .prefix("switchyard-test-")
        .suffix(name)
        .tempfile()
        .expect("temp file");
    std::fs::write(file.path(), text).expect("write");
    file.into_temp_path()
}

/// An HTTP client with a sane timeout.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

/// Polls `f` every 20 ms until it returns Some or `timeout` passes.
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

/// Parses an SSE body into its JSON chunks; asserts it ends with `[DONE]`.
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
