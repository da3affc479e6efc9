//! Open-loop latency probe: sends `count` requests at `rate` per second to `url` and prints
//! latency percentiles. Run it against an `--instant` engine directly and through the gateway;
//! the difference is the gateway's added latency.
//!
//! `cargo run --release -p switchyard-gateway --example overhead -- URL [RATE] [COUNT] [MODEL]`

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(url) = args.get(1).cloned() else {
        eprintln!("usage: overhead URL [RATE] [COUNT] [MODEL]");
        std::process::exit(2);
    };
    let rate: f64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2000.0);
    let count: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let model = args.get(4).cloned().unwrap_or_else(|| "m".into());
    let body = Bytes::from(format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"hello there, a short prompt"}}],"max_tokens":4}}"#
    ));
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build_http();
    let uri: hyper::Uri = format!("{url}/v1/chat/completions").parse().expect("url");
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        let at = started + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at.into()).await;
        let (client, uri, body) = (client.clone(), uri.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let request = hyper::Request::post(uri)
                .header("content-type", "application/json")
                .body(Full::new(body))
                .expect("request");
            let response = client.request(request).await.ok()?;
            let ok = response.status().is_success();
            response.into_body().collect().await.ok()?;
            ok.then(|| t0.elapsed())
        }));
    }
    let mut latencies = Vec::with_capacity(count);
    let mut failed = 0;
    for t in tasks {
        match t.await.ok().flatten() {
            Some(d) => latencies.push(d),
            None => failed += 1,
        }
    }
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
    println!(
        "{} ok, {failed} failed, achieved {:.0} req/s; p50 {:?} p90 {:?} p99 {:?}",
        latencies.len(),
        count as f64 / started.elapsed().as_secs_f64(),
        pct(0.5),
        pct(0.9),
        pct(0.99)
    );
}
