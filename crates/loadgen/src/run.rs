//! The open-loop dispatcher.
//!
//! Request `i` is sent at `start + offset_i` whatever happened to the earlier
//! ones: a slow server does not slow the offered load down. The only thing
//! that can hold a send back is the concurrency cap: when `max_concurrency`
//! requests are in flight, the next send waits for a slot (and every later one
//! with it), which the report counts (`cap_waits`) along with every send that
//! went out more than [`crate::stats::LATE_AFTER`] after its time.
//!
//! The schedule is kept by a [`Pacer`] (a timerfd: tokio's own timer has a
//! 1 ms granularity, which would send the requests due within a millisecond
//! in a burst).
//!
//! With several base URLs (no proxy in front of them), each request goes to
//! one of them drawn uniformly by a random stream seeded from the run's seed,
//! so the same seed sends the same requests to the same URLs.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use http_body_util::{BodyExt, Full};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use switchyard_workload::WorkloadSpec;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::{http_client, send, BaseUrl};
use crate::error::{LoadgenError, Result};
use crate::pace::{PaceMode, Pacer};
use crate::plan::{Plan, PlanOptions};
use crate::report::{Report, Summary};
use crate::stats::Stats;

/// Lead time before the first send, so it is not late by the set-up.
const LEAD: Duration = Duration::from_millis(20);

/// Domain tag of the random stream that picks a URL per request.
const URL_STREAM: u64 = 0x5552_4c5f_7069_636b;

/// How a run is carried out.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Base URL of the OpenAI-compatible server.
    pub url: String,
    /// Further base URLs: with any, each request goes to one of `url` and
    /// these, drawn uniformly with a random stream seeded from the run's seed.
    pub extra_urls: Vec<String>,
    /// Name of the run in reports (default: the URL).
    pub label: Option<String>,
    /// How the workload becomes requests.
    pub plan: PlanOptions,
    /// Per-request limit from send to the end of the stream.
    pub timeout: Duration,
    /// Limit on connecting.
    pub connect_timeout: Duration,
    /// Most requests in flight at once.
    pub max_concurrency: usize,
    /// Draw a progress bar on stderr (only if stderr is a terminal).
    pub progress: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            url: String::new(),
            extra_urls: Vec::new(),
            label: None,
            plan: PlanOptions::default(),
            timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(5),
            max_concurrency: 1024,
            progress: false,
        }
    }
}

/// The first model `url/v1/models` lists.
pub async fn discover_model(url: &str, timeout: Duration) -> Result<String> {
    let base = BaseUrl::parse(url)?;
    let uri = base.uri("/v1/models")?;
    let err = |message: String| LoadgenError::Discovery {
        url: uri.to_string(),
        message,
    };
    let client = http_client(1, timeout);
    let req = hyper::Request::get(uri.clone())
        .body(Full::default())
        .map_err(|e| err(e.to_string()))?;
    let fetch = async {
        let resp = client.request(req).await.map_err(|e| err(e.to_string()))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| err(e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            return Err(err(format!("status {status}")));
        }
        let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| err(e.to_string()))?;
        v["data"][0]["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| err("no model listed".into()))
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| err("timed out".into()))?
}

/// The progress bar: drawn on stderr when asked and stderr is a terminal.
fn progress_bar(planned: u64, show: bool) -> ProgressBar {
    let target = if show && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(planned), target);
    if let Ok(style) = ProgressStyle::with_template(
        "{elapsed_precise} [{bar:30.cyan/blue}] {pos}/{len} done ({eta} left) {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Replays `spec` built with `seed` against `options.url`; see the module docs.
pub async fn run(spec: &WorkloadSpec, seed: u64, options: &RunOptions) -> Result<Report> {
    if options.max_concurrency == 0 {
        return Err(LoadgenError::Invalid("concurrency cap must be >= 1".into()));
    }
    if options.timeout.is_zero() {
        return Err(LoadgenError::Invalid("timeout must be > 0".into()));
    }
    let uris = std::iter::once(&options.url)
        .chain(&options.extra_urls)
        .map(|u| BaseUrl::parse(u)?.uri(options.plan.api.path()))
        .collect::<Result<Vec<_>>>()?;
    let mut pick = ChaCha8Rng::seed_from_u64(seed ^ URL_STREAM);
    let mut sent_per_url = vec![0u64; uris.len()];
    let planned = Plan::count(spec, seed, &options.plan)?;
    let plan = Plan::new(spec, seed, &options.plan)?;
    let client = http_client(options.max_concurrency, options.connect_timeout);
    let bar = progress_bar(planned, options.progress);
    let stats = Arc::new(Mutex::new(Stats::default()));
    let in_flight = Arc::new(AtomicU64::new(0));
    let slots = Arc::new(Semaphore::new(options.max_concurrency));
    let mut pacer = Pacer::new(PaceMode::Timer).map_err(LoadgenError::Pacer)?;
    let started_unix_s = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let start = Instant::now() + LEAD;
    let mut tasks = JoinSet::new();
    let mut last_offset = 0.0f64;
    for p in plan {
        last_offset = last_offset.max(p.offset_s);
        let due = start + Duration::from_secs_f64(p.offset_s.max(0.0));
        pacer.sleep_until(due).await.map_err(LoadgenError::Pacer)?;
        let (permit, waited) = match slots.clone().try_acquire_owned() {
            Ok(permit) => (permit, false),
            Err(_) => match slots.clone().acquire_owned().await {
                Ok(permit) => (permit, true),
                // The semaphore is never closed.
                Err(_) => break,
            },
        };
        let sent = Instant::now();
        let now_in_flight = in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        lock(&stats).record_send(sent.saturating_duration_since(due), waited, now_in_flight);
        let target = if uris.len() > 1 {
            pick.random_range(0..uris.len())
        } else {
            0
        };
        sent_per_url[target] += 1;
        let (client, uri, stats, in_flight, bar) = (
            client.clone(),
            uris[target].clone(),
            stats.clone(),
            in_flight.clone(),
            bar.clone(),
        );
        let timeout = options.timeout;
        tasks.spawn(async move {
            let outcome = send(&client, uri, p.body, timeout, sent).await;
            // Counted out before the slot is freed, so the peak never exceeds the cap.
            let left = in_flight.fetch_sub(1, Ordering::Relaxed) - 1;
            drop(permit);
            let failed = {
                let mut s = lock(&stats);
                s.record(&outcome);
                s.failed()
            };
            bar.set_message(format!("{left} in flight, {failed} failed"));
            bar.inc(1);
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let wall_s = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let stats = lock(&stats).clone();
    let label = options.label.clone().unwrap_or_else(|| options.url.clone());
    Ok(Report {
        label,
        url: options.url.clone(),
        urls: if uris.len() > 1 {
            std::iter::once(&options.url)
                .chain(&options.extra_urls)
                .cloned()
                .collect()
        } else {
            Vec::new()
        },
        sent_per_url: if uris.len() > 1 {
            sent_per_url
        } else {
            Vec::new()
        },
        api: options.plan.api,
        model: options.plan.model.clone(),
        seed,
        workload: spec.clone(),
        plan: options.plan.clone(),
        timeout_s: options.timeout.as_secs_f64(),
        max_concurrency: options.max_concurrency as u64,
        started_unix_s,
        summary: Summary::new(&stats, planned, last_offset, wall_s),
    })
}

/// Locks the stats; a panic in another task leaves them usable.
fn lock(stats: &Mutex<Stats>) -> std::sync::MutexGuard<'_, Stats> {
    stats.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    use bytes::Bytes;
    use http_body_util::combinators::BoxBody;
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    use hyper::server::conn::http1;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    use switchyard_workload::{ArrivalProcess, GroupSelection, SharedPrefixSpec};
    use tokio::net::TcpListener;

    type Body = BoxBody<Bytes, Infallible>;

    /// A tiny OpenAI-ish streaming server: 3 tokens 5 ms apart, then usage and
    /// [DONE]; prompts containing "fail" get a 503.
    async fn server() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                // Without it Nagle's algorithm coalesces the small chunks.
                let _ = stream.set_nodelay(true);
                tokio::spawn(async move {
                    let svc = service_fn(|req: hyper::Request<hyper::body::Incoming>| async move {
                        if req.uri().path() == "/v1/models" {
                            let b = Bytes::from_static(br#"{"data":[{"id":"served"}]}"#);
                            return Ok::<_, Infallible>(hyper::Response::new(Full::new(b).boxed()));
                        }
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        if body.windows(4).any(|w| w == b"fail") {
                            let mut r = hyper::Response::new(
                                Full::new(Bytes::from_static(b"busy")).boxed(),
                            );
                            *r.status_mut() = hyper::StatusCode::SERVICE_UNAVAILABLE;
                            return Ok(r);
                        }
                        let (tx, rx) =
                            tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(8);
                        tokio::spawn(async move {
                            for i in 0..3 {
                                let chunk = format!(
                                    "data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
                                );
                                let _ = tx.send(Ok(Frame::data(Bytes::from(chunk)))).await;
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                            let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\ndata: [DONE]\n\n";
                            let _ = tx.send(Ok(Frame::data(Bytes::from(usage)))).await;
                        });
                        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
                        let body: Body = StreamBody::new(stream).boxed();
                        Ok(hyper::Response::new(body))
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        format!("http://{addr}")
    }

    fn spec(n: u64) -> WorkloadSpec {
        WorkloadSpec::SharedPrefix(SharedPrefixSpec {
            num_groups: 2,
            prompts_per_group: 2,
            system_prompt_len: 16,
            question_len: 4,
            output_len: 3,
            num_requests: Some(n),
            group_selection: GroupSelection::RoundRobin,
            arrivals: ArrivalProcess::Constant { rate: 200.0 },
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn measures_a_streaming_server() {
        let url = server().await;
        assert_eq!(
            discover_model(&url, Duration::from_secs(5)).await.unwrap(),
            "served"
        );
        let options = RunOptions {
            url: url.clone(),
            plan: PlanOptions {
                model: Some("served".into()),
                ..Default::default()
            },
            timeout: Duration::from_secs(10),
            ..Default::default()
        };
        let r = run(&spec(10), 1, &options).await.unwrap();
        let s = &r.summary;
        assert_eq!(
            (s.planned, s.sent, s.ok, s.failed),
            (10, 10, 10, 0),
            "{s:?}"
        );
        assert_eq!(
            (s.prompt_tokens, s.cached_tokens, s.completion_tokens),
            (200, 160, 30)
        );
        let ttft = s.ttft.as_ref().unwrap();
        assert_eq!(ttft.count, 10);
        let itl = s.itl.as_ref().unwrap();
        assert_eq!(itl.count, 20);
        assert!(itl.p50_ms >= 4.0, "{itl:?}");
        assert!(s.e2e.as_ref().unwrap().p50_ms >= 10.0);
        assert!(
            s.schedule_s > 0.04 && s.schedule_s < 0.05,
            "{}",
            s.schedule_s
        );
    }

    #[tokio::test]
    async fn several_urls_share_the_requests_by_seed() {
        let (a, b) = (server().await, server().await);
        let options = RunOptions {
            url: a.clone(),
            extra_urls: vec![b.clone()],
            plan: PlanOptions {
                model: Some("served".into()),
                ..Default::default()
            },
            timeout: Duration::from_secs(10),
            ..Default::default()
        };
        let r = run(&spec(40), 7, &options).await.unwrap();
        assert_eq!((r.summary.ok, r.summary.failed), (40, 0), "{:?}", r.summary);
        assert_eq!(r.urls, vec![a.clone(), b.clone()]);
        assert_eq!(r.sent_per_url.iter().sum::<u64>(), 40);
        // Uniform over two: 40 draws put at least 8 on each (p < 1e-4 otherwise).
        assert!(
            r.sent_per_url.iter().all(|&n| n >= 8),
            "{:?}",
            r.sent_per_url
        );
        // The same seed picks the same URLs.
        let again = run(&spec(40), 7, &options).await.unwrap();
        assert_eq!(again.sent_per_url, r.sent_per_url);
        // One URL: no per-URL figures.
        let single = RunOptions {
            extra_urls: Vec::new(),
            ..options
        };
        let one = run(&spec(4), 7, &single).await.unwrap();
        assert!(one.urls.is_empty() && one.sent_per_url.is_empty());
        let j = one.to_json().unwrap();
        assert!(!j.contains("sent_per_url"), "{j}");
    }

    #[tokio::test]
    async fn counts_errors_by_kind() {
        let url = server().await;
        let options = RunOptions {
            url,
            plan: PlanOptions {
                model: Some("fail".into()),
                ..Default::default()
            },
            timeout: Duration::from_secs(10),
            ..Default::default()
        };
        let r = run(&spec(4), 1, &options).await.unwrap();
        assert_eq!(r.summary.errors["http_503"], 4);
        assert!(r.summary.error_examples[0].contains("busy"));
        // Nothing listens on port 1 of loopback.
        let options = RunOptions {
            url: "http://127.0.0.1:1".into(),
            ..options
        };
        let r = run(&spec(3), 1, &options).await.unwrap();
        assert_eq!(r.summary.errors["connect"], 3, "{:?}", r.summary);
    }

    #[tokio::test]
    async fn cap_waits_are_counted() {
        let url = server().await;
        let options = RunOptions {
            url,
            plan: PlanOptions {
                model: Some("served".into()),
                ..Default::default()
            },
            max_concurrency: 1,
            timeout: Duration::from_secs(10),
            ..Default::default()
        };
        // 200 req/s with responses taking ≥ 10 ms and one slot: most sends wait.
        let r = run(&spec(6), 1, &options).await.unwrap();
        assert_eq!(r.summary.ok, 6);
        assert!(r.summary.cap_waits >= 3, "{:?}", r.summary);
        assert_eq!(r.summary.peak_in_flight, 1);
    }

    #[tokio::test]
    async fn timeouts_are_counted() {
        // A server that accepts and never answers.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let options = RunOptions {
            url: format!("http://{addr}"),
            plan: PlanOptions {
                model: Some("m".into()),
                ..Default::default()
            },
            timeout: Duration::from_millis(200),
            ..Default::default()
        };
        let r = run(&spec(2), 1, &options).await.unwrap();
        assert_eq!(r.summary.errors["timeout"], 2);
        hold.abort();
    }
}
