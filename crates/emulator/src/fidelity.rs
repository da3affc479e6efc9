//! The fidelity check: does the emulator, measured through HTTP in real time
//! at `--speed 1`, reproduce what the engine model predicts?
//!
//! For prompts of 512, 2048 and 8192 tokens, first cold (a fresh prefix) and
//! then fully cached (the same prompt again), it measures over a streamed
//! `/v1/completions` request the time to first token and the decode rate
//! (tokens after the first, divided by the time between the first and the
//! last token; token counts come from `continuous_usage_stats`). The
//! prediction comes from running a fresh [`Engine`] with the same
//! configuration through the same sequence of requests in pure virtual time.
//! Each case is repeated (with a fresh prefix per repetition) and the row
//! reports medians, so one scheduling hiccup on a busy machine does not
//! decide the result. A row passes when both measured values are within 10%
//! of the prediction.

use std::time::Instant;

use futures_util::StreamExt;
use serde_json::{json, Value};
use switchyard_engine::{Engine, EngineConfig, EngineEvent, EngineRequest, RequestMode};
use thiserror::Error;

/// Relative error allowed for PASS.
pub const TOLERANCE: f64 = 0.10;

/// Errors running the check.
#[derive(Debug, Error)]
pub enum FidelityError {
    /// HTTP failure talking to the emulator.
    #[error("http: {0}")]
    Http(#[from] reqwest::Error),
    /// The emulator answered something unexpected.
    #[error("bad response: {0}")]
    Protocol(String),
    /// The engine model refused the configuration or a request.
    #[error("engine model: {0}")]
    Engine(String),
}

/// One case of the check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Case {
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Whether the prompt was sent before (fully cached).
    pub cached: bool,
}

/// Timings of one request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Timing {
    /// Time to first token, seconds.
    pub ttft: f64,
    /// Tokens per second after the first token.
    pub decode_rate: f64,
    /// Seconds until the streaming response's headers arrived: the HTTP round trip, which the
    /// server answers before the engine has done any work (0 for predictions).
    pub transport: f64,
}

/// One row of the result table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row {
    /// The case.
    pub case: Case,
    /// What the engine model predicts.
    pub predicted: Timing,
    /// What was measured over HTTP.
    pub measured: Timing,
}

impl Row {
    /// Measured TTFT without the HTTP round trip: what the profile models. A real engine
    /// behind HTTP pays the same transport, which on a loaded VM's loopback is 0.3–0.6 ms,
    /// a tenth of a fully cached TTFT.
    pub fn net_ttft(&self) -> f64 {
        (self.measured.ttft - self.measured.transport).max(0.0)
    }

    /// Relative TTFT error (measured net of transport vs predicted).
    pub fn ttft_err(&self) -> f64 {
        rel_err(self.net_ttft(), self.predicted.ttft)
    }

    /// Relative decode-rate error.
    pub fn decode_err(&self) -> f64 {
        rel_err(self.measured.decode_rate, self.predicted.decode_rate)
    }

    /// Both within [`TOLERANCE`].
    pub fn pass(&self) -> bool {
        self.ttft_err().abs() <= TOLERANCE && self.decode_err().abs() <= TOLERANCE
    }
}

fn rel_err(measured: f64, predicted: f64) -> f64 {
    if predicted > 0.0 {
        (measured - predicted) / predicted
    } else if measured == 0.0 {
        0.0
    } else {
        f64::INFINITY
    }
}

/// The standard cases: 512, 2k, 8k tokens, each cold then cached.
pub fn standard_cases() -> Vec<Case> {
    [512u32, 2048, 8192]
        .iter()
        .flat_map(|&n| {
            [false, true].map(move |cached| Case {
                prompt_tokens: n,
                cached,
            })
        })
        .collect()
}

/// A prompt of exactly `tokens` tokens (4 ASCII bytes each) starting with a
/// per-run nonce so a cold case cannot hit an earlier run's cache.
pub fn prompt_text(tokens: u32, nonce: u64) -> String {
    let mut s = format!("{nonce:016x}");
    let target = tokens as usize * 4;
    let alphabet = b"abcdefghijklmnopqrstuvwxyz ";
    let mut i = 0usize;
    while s.len() < target {
        s.push(alphabet[i % alphabet.len()] as char);
        i += 1;
    }
    s.truncate(target);
    s
}

/// One request of the check: a case with the prefix nonce of its repetition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    /// The case.
    pub case: Case,
    /// Prefix nonce (a cached probe repeats its cold probe's nonce).
    pub nonce: u64,
}

/// The request sequence: for each case, `reps` repetitions, each with its own nonce.
///
/// Cases come in the order given, so a cached case directly after its cold
/// case reuses the cold case's prompts.
pub fn probes(cases: &[Case], reps: u32, nonce: u64) -> Vec<Probe> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cases.len() {
        // A cold case followed by its cached twin runs as pairs per repetition.
        let pair = cases.get(i + 1).is_some_and(|n| {
            !cases[i].cached && n.cached && n.prompt_tokens == cases[i].prompt_tokens
        });
        for r in 0..u64::from(reps.max(1)) {
            let n = nonce
                .wrapping_add(r.wrapping_mul(0x9E37_79B9))
                .wrapping_add(i as u64);
            out.push(Probe {
                case: cases[i],
                nonce: n,
            });
            if pair {
                out.push(Probe {
                    case: cases[i + 1],
                    nonce: n,
                });
            }
        }
        i += if pair { 2 } else { 1 };
    }
    out
}

/// Predict the timings of `probes` (sent one after another) with the engine model.
pub fn predict(
    cfg: &EngineConfig,
    probes: &[Probe],
    max_tokens: u32,
) -> Result<Vec<Timing>, FidelityError> {
    let mut c = cfg.clone();
    c.emit_token_events = true;
    c.emit_kv_events = false;
    let mut engine = Engine::new(c).map_err(|e| FidelityError::Engine(e.to_string()))?;
    let mut now = 0.0f64;
    let mut out = Vec::new();
    let mut results = Vec::with_capacity(probes.len());
    for (i, probe) in probes.iter().enumerate() {
        let prompt = switchyard_engine::tokenizer::encode(&prompt_text(
            probe.case.prompt_tokens,
            probe.nonce,
        ));
        let id = i as u64 + 1;
        engine
            .submit(
                EngineRequest {
                    id,
                    prompt_tokens: prompt.into(),
                    max_tokens,
                    adapter: None,
                    mode: RequestMode::Normal,
                },
                now,
            )
            .map_err(|e| FidelityError::Engine(e.to_string()))?;
        let start = now;
        let mut first: Option<f64> = None;
        let mut first_tokens = 0u32;
        let mut last = start;
        let mut total = 0u32;
        let mut done = false;
        while !done {
            let Some(t) = engine.next_event_time() else {
                return Err(FidelityError::Engine(
                    "engine went idle before the request finished".into(),
                ));
            };
            now = t.max(now);
            out.clear();
            engine.advance(now, &mut out);
            for ev in &out {
                match ev {
                    EngineEvent::FirstToken { time, .. } if first.is_none() => {
                        first = Some(*time);
                    }
                    EngineEvent::Tokens { time, tokens, .. } => {
                        if total == 0 {
                            first_tokens = tokens.len() as u32;
                            first.get_or_insert(*time);
                        }
                        total += tokens.len() as u32;
                        last = *time;
                    }
                    EngineEvent::Finished { .. } => done = true,
                    _ => {}
                }
            }
        }
        let f = first.unwrap_or(start);
        results.push(Timing {
            ttft: f - start,
            decode_rate: decode_rate(total.saturating_sub(first_tokens), last - f),
            transport: 0.0,
        });
    }
    Ok(results)
}

fn decode_rate(tokens: u32, secs: f64) -> f64 {
    if secs > 0.0 {
        f64::from(tokens) / secs
    } else {
        0.0
    }
}

/// Measure one case through HTTP.
pub async fn measure_one(
    client: &reqwest::Client,
    base_url: &str,
    model: &str,
    prompt: &str,
    max_tokens: u32,
) -> Result<Timing, FidelityError> {
    let body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true},
    });
    let start = Instant::now();
    let resp = client
        .post(format!("{base_url}/v1/completions"))
        .json(&body)
        .send()
        .await?;
    let transport = start.elapsed().as_secs_f64();
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return Err(FidelityError::Protocol(format!("{status}: {text}")));
    }
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let mut first: Option<(f64, u64)> = None;
    let mut last: (f64, u64) = (0.0, 0);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        let t = start.elapsed().as_secs_f64();
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(pos) = buf.find("\n\n") {
            let event: String = buf.drain(..pos + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data)
                .map_err(|e| FidelityError::Protocol(format!("chunk {data}: {e}")))?;
            let has_text = v["choices"]
                .get(0)
                .and_then(|c| c["text"].as_str())
                .map(|s| !s.is_empty())
                .unwrap_or(false);
            let n = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            if has_text {
                if first.is_none() {
                    first = Some((t, n));
                }
                last = (t, n);
            }
        }
    }
    let Some((t0, n0)) = first else {
        return Err(FidelityError::Protocol("no tokens streamed".into()));
    };
    Ok(Timing {
        ttft: t0,
        decode_rate: decode_rate(
            u32::try_from(last.1.saturating_sub(n0)).unwrap_or(0),
            last.0 - t0,
        ),
        transport,
    })
}

/// Median of a non-empty list (0 for an empty one).
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Run all cases (`reps` times each) against `base_url` and pair the median
/// measurements with the median predictions.
pub async fn run(
    base_url: &str,
    cfg: &EngineConfig,
    cases: &[Case],
    reps: u32,
    max_tokens: u32,
) -> Result<Vec<Row>, FidelityError> {
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let probes = probes(cases, reps, nonce);
    let predicted = predict(cfg, &probes, max_tokens)?;
    let client = reqwest::Client::new();
    // One throwaway request warms connections and code paths.
    let _ = measure_one(
        &client,
        base_url,
        &cfg.model_name,
        &prompt_text(8, !nonce),
        2,
    )
    .await?;
    let mut measured = Vec::with_capacity(probes.len());
    for probe in &probes {
        let prompt = prompt_text(probe.case.prompt_tokens, probe.nonce);
        measured.push(measure_one(&client, base_url, &cfg.model_name, &prompt, max_tokens).await?);
    }
    let rows = cases
        .iter()
        .map(|case| {
            let pick = |timings: &[Timing], f: fn(&Timing) -> f64| {
                median(
                    probes
                        .iter()
                        .zip(timings)
                        .filter(|(p, _)| p.case == *case)
                        .map(|(_, t)| f(t))
                        .collect(),
                )
            };
            Row {
                case: *case,
                predicted: Timing {
                    ttft: pick(&predicted, |t| t.ttft),
                    decode_rate: pick(&predicted, |t| t.decode_rate),
                    transport: 0.0,
                },
                measured: Timing {
                    ttft: pick(&measured, |t| t.ttft),
                    decode_rate: pick(&measured, |t| t.decode_rate),
                    transport: pick(&measured, |t| t.transport),
                },
            }
        })
        .collect();
    Ok(rows)
}

/// Render the result table.
pub fn format_table(rows: &[Row]) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{:>7} {:>6} | {:>11} {:>11} {:>8} {:>11} {:>7} | {:>12} {:>12} {:>7} | {}\n",
        "prompt",
        "cache",
        "TTFT model",
        "TTFT meas.",
        "http",
        "net",
        "err",
        "decode model",
        "decode meas.",
        "err",
        "result"
    ));
    for r in rows {
        s.push_str(&format!(
            "{:>7} {:>6} | {:>8.1} ms {:>8.1} ms {:>5.2} ms {:>8.1} ms {:>+6.1}% | {:>7.1} tok/s {:>7.1} tok/s {:>+6.1}% | {}\n",
            r.case.prompt_tokens,
            if r.case.cached { "cached" } else { "cold" },
            r.predicted.ttft * 1e3,
            r.measured.ttft * 1e3,
            r.measured.transport * 1e3,
            r.net_ttft() * 1e3,
            r.ttft_err() * 100.0,
            r.predicted.decode_rate,
            r.measured.decode_rate,
            r.decode_err() * 100.0,
            if r.pass() { "PASS" } else { "FAIL" },
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_has_exact_token_count() {
        for n in [8u32, 512, 2048] {
            let p = prompt_text(n, 7);
            assert_eq!(switchyard_engine::tokenizer::count(&p), n as usize);
        }
        assert_ne!(prompt_text(64, 1), prompt_text(64, 2));
    }

    #[test]
    fn pass_rule() {
        let row = Row {
            case: Case {
                prompt_tokens: 512,
                cached: false,
            },
            predicted: Timing {
                ttft: 0.1,
                decode_rate: 100.0,
                transport: 0.0,
            },
            measured: Timing {
                ttft: 0.111,
                decode_rate: 91.0,
                transport: 0.002,
            },
        };
        assert!(row.pass());
        let bad = Row {
            measured: Timing {
                ttft: 0.2,
                decode_rate: 100.0,
                transport: 0.002,
            },
            ..row
        };
        assert!(!bad.pass());
        // Transport is only what arrived before the engine worked, never the engine's own time.
        let slow_transport_only = Row {
            measured: Timing {
                ttft: 0.2,
                decode_rate: 100.0,
                transport: 0.0,
            },
            ..row
        };
        assert!(!slow_transport_only.pass());
        assert!(format_table(&[row, bad]).contains("FAIL"));
    }

    #[test]
    fn six_standard_cases() {
        assert_eq!(standard_cases().len(), 6);
    }

    #[test]
    fn probes_pair_cold_and_cached() {
        let p = probes(&standard_cases(), 3, 7);
        assert_eq!(p.len(), 18);
        for pair in p.chunks(2) {
            assert!(!pair[0].case.cached && pair[1].case.cached);
            assert_eq!(pair[0].nonce, pair[1].nonce);
            assert_eq!(pair[0].case.prompt_tokens, pair[1].case.prompt_tokens);
        }
        assert_ne!(p[0].nonce, p[2].nonce);
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(vec![]), 0.0);
    }

    #[test]
    fn model_predicts_cold_slower_than_cached() {
        let cfg = EngineConfig::default();
        let p = probes(&standard_cases(), 1, 1);
        let t = predict(&cfg, &p, 8).unwrap();
        assert_eq!(t.len(), 6);
        for pair in t.chunks(2) {
            assert!(pair[0].ttft > pair[1].ttft, "{pair:?}");
            assert!(pair[0].decode_rate > 0.0);
        }
    }
}
