//! Chaos: a steady load through `switchyard serve` while its engines misbehave in every way
//! the gateway knows of (one killed and restarted on the same port, one hanging, one answering
//! 500, one stalling mid-stream) and some clients leave mid-answer. Every request must end
//! within the configured timeouts with a complete answer or an error in OpenAI's shape, the
//! in-flight accounting must return to zero, the restarted engine must be readmitted, and the
//! gateway's memory must stay bounded. Stops by itself in about ten seconds.

mod gateway_support;
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use gateway_support::*;
use serde_json::{json, Value};

/// What one request ended as.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// 200 with a complete answer (a JSON completion, or a stream that reached `[DONE]`).
    Complete,
    /// A stream the gateway ended with its SSE error event (the engine stalled).
    StreamError,
    /// An error status with OpenAI's error JSON (`code`).
    Error(u16, String),
    /// The client left on purpose.
    Left,
}

async fn one(c: &reqwest::Client, url: &str, i: usize) -> Result<Outcome, String> {
    let stream = i.is_multiple_of(2);
    let leave = i % 7 == 3;
    let body = json!({"model": MODEL, "prompt": format!("chaos {} {}", i % 5, "word ".repeat(50)),
                      "max_tokens": 16, "stream": stream});
    let r = c
        .post(url)
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = r.status().as_u16();
    if status != 200 {
        let text = r.text().await.map_err(|e| format!("body: {e}"))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|_| format!("{status} not JSON: {text}"))?;
        let code = v["error"]["code"]
            .as_str()
            .ok_or(format!("{status} without a code: {text}"))?;
        return Ok(Outcome::Error(status, code.to_string()));
    }
    if !stream {
        let text = r.text().await.map_err(|e| format!("body: {e}"))?;
        return match serde_json::from_str::<Value>(&text) {
            Ok(v) if v["choices"].is_array() => Ok(Outcome::Complete),
            // An engine that streams whatever was asked, then stalls: the gateway's error event.
            _ if text.contains("stream_stalled") => Ok(Outcome::StreamError),
            _ => Err(format!("200 without an answer: {text}")),
        };
    }
    let mut body = r.bytes_stream();
    let mut text = String::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| format!("stream cut: {e}"))?;
        text.push_str(&String::from_utf8_lossy(&chunk));
        if leave {
            return Ok(Outcome::Left);
        }
    }
    if text.contains("data: [DONE]") {
        Ok(Outcome::Complete)
    } else if text.contains("stream_stalled") {
        Ok(Outcome::StreamError)
    } else {
        Err(format!("a stream that just ended: {text}"))
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn a_fleet_in_trouble_still_answers_every_request() {
    let steady = engine(&[]);
    let mut flaky = engine(&[]);
    let flaky_port = flaky.port();
    let hang = FakeEngine::start(Fake::Hang).await;
    let broken = FakeEngine::start(Fake::Status500).await;
    let stall = FakeEngine::start(Fake::StallMidStream).await;
    let gw = gateway(&[
        "--backend",
        &backend(&steady),
        "--backend",
        &backend(&flaky),
        "--backend",
        &hang.backend(),
        "--backend",
        &broken.backend(),
        "--backend",
        &stall.backend(),
        "--upstream-timeout",
        "1",
        "--stream-idle-timeout",
        "1",
        "--policy",
        "round-robin",
        "--admin-token",
        "t",
    ]);
    let url = gw.url("/v1/completions");
    let stop = Arc::new(AtomicBool::new(false));
    // Eight clients, one request after another each, until told to stop.
    let clients: Vec<_> = (0..8)
        .map(|k| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                let c = client();
                let mut results = Vec::new();
                let mut i = k;
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let r = one(&c, &url, i).await;
                    results.push((r, started.elapsed()));
                    i += 8;
                }
                results
            })
        })
        .collect();
    // The flaky engine dies, and comes back on the same port.
    tokio::time::sleep(Duration::from_secs(1)).await;
    flaky.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let flaky = engine_on(flaky_port, &["--speed", "100"]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let mut outcomes = Vec::new();
    for c in clients {
        outcomes.extend(c.await.unwrap());
    }
    let total = outcomes.len();
    let mut complete = 0;
    for (r, took) in &outcomes {
        // Upstream and stream-idle timeouts are 1 s; retries and the connect timeout add at
        // most a few more.
        assert!(
            *took < Duration::from_secs(8),
            "a request took {took:?}: {r:?}"
        );
        match r {
            Ok(Outcome::Complete) => complete += 1,
            Ok(Outcome::Error(status, code)) => {
                assert!(
                    [429, 500, 502, 503, 504].contains(status),
                    "unexpected error {status} {code}"
                );
            }
            Ok(_) => {}
            Err(e) => panic!("not a clear answer: {e}"),
        }
    }
    assert!(total >= 40, "only {total} requests in the run");
    // The healthy engines keep serving. (A hung engine whose health checks pass keeps its
    // share of round robin: each of its requests ends at the upstream timeout.)
    assert!(
        complete * 5 >= total,
        "{complete} of {total} complete: {outcomes:?}"
    );
    // The books balance, and the engine that came back takes traffic again.
    let c = client();
    let settled = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "switchyard_backend_in_flight", &[]) == 0.0).then_some(())
    })
    .await;
    assert!(settled.is_some(), "in-flight accounting back to 0");
    let readmitted = poll(Duration::from_secs(10), || async {
        let r = get_with(
            &c,
            &gw.url("/admin/fleet"),
            &[("authorization", "Bearer t")],
        )
        .await;
        let v = r.json();
        let b = v["backends"]
            .as_array()?
            .iter()
            .find(|b| {
                b["address"]
                    .as_str()
                    .is_some_and(|a| a.ends_with(&format!(":{flaky_port}")))
            })?
            .clone();
        (b["health"] == "healthy").then_some(())
    })
    .await;
    assert!(readmitted.is_some(), "the restarted engine is readmitted");
    let kib = rss_kib(gw.pid());
    assert!(kib < 300 * 1024, "gateway RSS {kib} KiB");
    drop(flaky);
}
