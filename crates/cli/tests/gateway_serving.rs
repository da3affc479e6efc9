//! `switchyard serve` in front of real `switchyard engine` processes: routing across
//! instances, cache affinity, streaming passthrough, usage handling, models and adapters,
//! request ids, every error the gateway answers itself, and its metrics.

mod gateway_support;
mod support;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use gateway_support::*;
use serde_json::json;

#[tokio::test]
async fn routes_across_instances_and_keeps_cache_affinity() {
    let engines: Vec<Proc> = (0..3).map(|_| engine(&[])).collect();
    let mut args = vec!["--debug-header".to_string()];
    for e in &engines {
        args.push("--backend".into());
        args.push(backend(e));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gw = gateway(&args);
    let c = client();

    // Distinct prompts spread over the fleet (random tie-breaks, no herding).
    let mut used = HashSet::new();
    for i in 0..12 {
        let r = post(
            &c,
            &gw.url("/v1/chat/completions"),
            &chat(&prompt(&format!("spread-{i}"), 40), 2),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let backend = r.header("x-switchyard-backend").expect("backend header");
        let decision = r.header("x-switchyard-decision").unwrap();
        assert!(decision.starts_with("policy=cost"), "{decision}");
        // Candidates are named by backend, the chosen one first.
        assert!(
            decision.contains(&format!("[{backend} score=")),
            "{decision}"
        );
        used.insert(backend);
    }
    assert!(used.len() >= 2, "all requests went to {used:?}");

    // The same long prefix goes back where it went, and the engine reports a cache hit.
    let long = prompt("affinity", 600);
    let first = post(
        &c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": long, "max_tokens": 2}),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text);
    let continued = format!("{long} and a new question at the end");
    let second = post(
        &c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": continued, "max_tokens": 2}),
    )
    .await;
    assert_eq!(second.status, 200);
    assert_eq!(
        first.header("x-switchyard-backend"),
        second.header("x-switchyard-backend")
    );
    let cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "no cache hit: {}", second.text);

    // The gateway counted predicted and reported cached tokens.
    let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    assert!(
        metric_sum(&m, "switchyard_reported_cached_tokens_total", &[]) > 0.0,
        "{m}"
    );
    assert!(metric_sum(&m, "switchyard_predicted_cached_tokens_total", &[]) > 0.0);
    assert!(metric_sum(&m, "switchyard_requests_total", &["outcome=\"ok\""]) >= 14.0);
    assert!(metric_sum(&m, "switchyard_decision_seconds_count", &[]) >= 14.0);
    assert!(metric_sum(&m, "switchyard_ttft_seconds_count", &[]) >= 14.0);
    assert!(metric_sum(&m, "switchyard_e2e_seconds_count", &[]) >= 14.0);
    assert_eq!(metric_sum(&m, "switchyard_backend_healthy", &[]), 3.0);
    assert_eq!(
        metric_sum(&m, "switchyard_admission_queue_length", &[]),
        0.0
    );
    assert!(metric_sum(&m, "switchyard_scrapes_total", &["result=\"ok\""]) > 0.0);
    assert!(metric_sum(&m, "switchyard_health_checks_total", &["result=\"ok\""]) > 0.0);
    assert_eq!(
        metric_sum(&m, "switchyard_requests_total", &["outcome=\"cancelled\""]),
        0.0
    );
}

#[tokio::test]
async fn streams_pass_through_chunk_by_chunk() {
    // Real time: 40 output tokens take a visible while.
    let e = engine_on(0, &["--speed", "1"]);
    let gw = gateway(&["--backend", &backend(&e)]);
    let c = client();
    let body = json!({"model": MODEL, "prompt": "count slowly", "max_tokens": 40, "stream": true});
    let r = c
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let started = Instant::now();
    let mut arrivals = Vec::new();
    let mut text = String::new();
    let mut stream = r.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        arrivals.push(started.elapsed());
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let chunks = sse_chunks(&text);
    assert!(chunks.len() >= 40, "{text}");
    // Incremental: the first bytes came well before the last.
    let first = arrivals[0];
    let last = *arrivals.last().unwrap();
    assert!(arrivals.len() >= 10, "{} reads", arrivals.len());
    assert!(
        last > first + Duration::from_millis(100),
        "first {first:?} last {last:?}"
    );
    // The client did not ask for usage: the chunk the gateway asked for is not shown.
    assert!(
        chunks
            .iter()
            .all(|c| c.get("usage").is_none_or(|u| u.is_null())),
        "{text}"
    );

    // Asked for: passed through.
    let body = json!({"model": MODEL, "prompt": "usage please", "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = post(&c, &gw.url("/v1/completions"), &body).await;
    let chunks = sse_chunks(&r.text);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn usage_injection_can_be_turned_off() {
    let e = engine(&[]);
    let gw = gateway(&["--backend", &backend(&e), "--no-usage-injection"]);
    let c = client();
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true});
    let r = post(&c, &gw.url("/v1/chat/completions"), &body).await;
    assert_eq!(r.status, 200);
    let chunks = sse_chunks(&r.text);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert!(chunks[0]["choices"][0]["delta"]["role"] == "assistant");
}

#[tokio::test]
async fn models_adapters_and_request_ids() {
    let plain = engine(&[]);
    let lora = engine(&[
        "--lora-modules",
        "sql-lora=/adapters/sql",
        "--max-loras",
        "2",
    ]);
    // No models= on the flags: discovered from /v1/models.
    let gw = gateway(&[
        "--backend",
        &plain.base,
        "--backend",
        &lora.base,
        "--debug-header",
    ]);
    let c = client();
    let models = poll(Duration::from_secs(10), || async {
        let r = get_with(&c, &gw.url("/v1/models"), &[]).await;
        let data = r.json()["data"].as_array().cloned().unwrap_or_default();
        (data.len() == 2).then_some(data)
    })
    .await
    .expect("both models discovered");
    let lora_card = models
        .iter()
        .find(|m| m["id"] == "sql-lora")
        .expect("adapter listed");
    assert_eq!(lora_card["parent"], MODEL);
    assert!(models
        .iter()
        .any(|m| m["id"] == MODEL && m["parent"].is_null()));

    // The adapter only goes where it is served.
    for _ in 0..4 {
        let body = json!({"model": "sql-lora", "prompt": "SELECT", "max_tokens": 2});
        let r = post(&c, &gw.url("/v1/completions"), &body).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.header("x-switchyard-backend").unwrap(), lora.authority());
        assert_eq!(r.json()["model"], "sql-lora");
    }

    // Request ids: echoed when given, generated otherwise, also on errors.
    let r = post_with(
        &c,
        &gw.url("/v1/chat/completions"),
        &chat("id", 1),
        &[("x-request-id", "abc-123")],
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-request-id").as_deref(), Some("abc-123"));
    let r = post(&c, &gw.url("/v1/chat/completions"), &chat("id", 1)).await;
    let generated = r.header("x-request-id").expect("generated id");
    assert!(!generated.is_empty());
    let r2 = post(&c, &gw.url("/v1/chat/completions"), &chat("id", 1)).await;
    assert_ne!(r2.header("x-request-id").unwrap(), generated);
    let r = post_with(
        &c,
        &gw.url("/v1/chat/completions"),
        &json!({}),
        &[("x-request-id", "err-1")],
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.header("x-request-id").as_deref(), Some("err-1"));
    let r = get_with(&c, &gw.url("/nowhere"), &[("x-request-id", "nf-1")]).await;
    assert_eq!(r.header("x-request-id").as_deref(), Some("nf-1"));
}

fn assert_error(r: &Reply, status: u16, code: &str) {
    assert_eq!(r.status, status, "{}", r.text);
    let e = &r.json()["error"];
    assert_eq!(e["code"], code, "{}", r.text);
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(e["type"].is_string());
    assert!(e.get("param").is_some());
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
}

#[tokio::test]
async fn every_gateway_error_has_the_openai_shape() {
    let e = engine(&[]);
    // Strict: an unknown model is the gateway's 404, not the single-model fallback.
    let gw = gateway(&[
        "--backend",
        &backend(&e),
        "--max-body-bytes",
        "2000",
        "--strict-models",
    ]);
    let c = client();
    let chat_url = gw.url("/v1/chat/completions");

    let raw = |body: &'static str| {
        let c = c.clone();
        let url = chat_url.clone();
        async move {
            let r = c
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            Reply {
                status: r.status().as_u16(),
                headers: r.headers().clone(),
                text: r.text().await.unwrap(),
            }
        }
    };
    assert_error(&raw("{not json").await, 400, "invalid_json");
    assert_error(&raw("[1,2]").await, 400, "invalid_json");
    assert_error(&raw("").await, 400, "invalid_json");
    assert_error(&raw("{\"messages\":[]}").await, 400, "missing_model");
    assert_error(&raw("{\"model\":42}").await, 400, "missing_model");
    let r = post(&c, &chat_url, &json!({"model": "nope", "messages": []})).await;
    assert_error(&r, 404, "model_not_found");
    let big = json!({"model": MODEL, "prompt": "x".repeat(5000)});
    assert_error(
        &post(&c, &gw.url("/v1/completions"), &big).await,
        413,
        "body_too_large",
    );
    // Over the limit without a content-length (chunked upload).
    let chunks =
        futures_util::stream::iter((0..10).map(|_| Ok::<_, std::io::Error>(vec![b' '; 500])));
    let r = c
        .post(gw.url("/v1/completions"))
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_error(
        &get_with(&c, &gw.url("/v2/unknown"), &[]).await,
        404,
        "not_found",
    );
    let r = get_with(&c, &chat_url, &[]).await;
    assert_error(&r, 405, "method_not_allowed");

    // Engine 4xx is passed through as the engine wrote it, and never ejects the engine.
    for _ in 0..5 {
        let r = post(
            &c,
            &gw.url("/v1/completions"),
            &json!({"model": MODEL, "prompt": "x", "max_tokens": 0}),
        )
        .await;
        assert_eq!(r.status, 400, "{}", r.text);
        assert!(r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens"));
    }
    let r = post(&c, &chat_url, &chat("still fine", 2)).await;
    assert_eq!(r.status, 200);
    let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    assert_eq!(metric_sum(&m, "switchyard_backend_healthy", &[]), 1.0);
    assert_eq!(
        metric_sum(
            &m,
            "switchyard_requests_total",
            &["outcome=\"client_error\""]
        ),
        5.0
    );
    assert!(
        metric_sum(
            &m,
            "switchyard_requests_total",
            &["outcome=\"invalid_json\""]
        ) >= 3.0
    );

    // Nothing a client sent broke the process.
    let r = get_with(&c, &gw.url("/health"), &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["healthy_backends"], 1);
}

#[tokio::test]
async fn no_healthy_backend_is_503_and_a_slow_engine_is_504() {
    // Nothing listens on this backend's port.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{},models={MODEL}", closed.local_addr().unwrap());
    drop(closed);
    let gw = gateway(&["--backend", &dead, "--connect-timeout", "1"]);
    let c = client();
    let r = post(&c, &gw.url("/v1/chat/completions"), &chat("anyone?", 2)).await;
    assert_error(&r, 503, "no_healthy_backend");
    let r = post(&c, &gw.url("/v1/chat/completions"), &chat("anyone?", 2)).await;
    assert_error(&r, 503, "no_healthy_backend");
    assert_eq!(get_with(&c, &gw.url("/health"), &[]).await.status, 503);

    // A non-streaming answer that takes ~2 s against a 0.3 s upstream timeout.
    let slow = engine_on(0, &["--speed", "1"]);
    let gw = gateway(&["--backend", &backend(&slow), "--upstream-timeout", "0.3"]);
    let started = Instant::now();
    let r = post(
        &c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": "slow", "max_tokens": 100}),
    )
    .await;
    assert_error(&r, 504, "upstream_timeout");
    assert!(started.elapsed() < Duration::from_secs(2));
    let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    assert_eq!(
        metric_sum(&m, "switchyard_requests_total", &["outcome=\"timeout\""]),
        1.0
    );
}

#[tokio::test]
async fn a_client_that_leaves_cancels_the_engine_request() {
    let e = engine_on(0, &["--speed", "1"]);
    let gw = gateway(&["--backend", &backend(&e)]);
    let c = client();
    let body = json!({"model": MODEL, "prompt": "long", "max_tokens": 500, "stream": true});
    let r = c
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut stream = r.bytes_stream();
    assert!(stream.next().await.unwrap().is_ok());
    drop(stream);
    let settled = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        let cancelled = metric_sum(&m, "switchyard_requests_total", &["outcome=\"cancelled\""]);
        let in_flight = metric_sum(&m, "switchyard_backend_in_flight", &[]);
        (cancelled == 1.0 && in_flight == 0.0).then_some(())
    })
    .await;
    assert!(settled.is_some());
    // The engine stopped working on it.
    let idle = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &e.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "vllm:num_requests_running", &[]) == 0.0).then_some(())
    })
    .await;
    assert!(idle.is_some());
}

/// A non-streamed request waits for the whole generation before any response byte: a client
/// that leaves meanwhile is counted `cancelled` too, and the engine stops working on it.
#[tokio::test]
async fn a_client_that_leaves_a_non_streamed_request_is_counted() {
    let e = engine_on(0, &["--speed", "1"]);
    let gw = gateway(&["--backend", &backend(&e)]);
    let c = client();
    let body = json!({"model": MODEL, "prompt": "long", "max_tokens": 500});
    let url = gw.url("/v1/completions");
    let request = tokio::spawn({
        let c = c.clone();
        async move { c.post(url).json(&body).send().await }
    });
    // Leave once the engine is generating.
    let running = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &e.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "vllm:num_requests_running", &[]) == 1.0).then_some(())
    })
    .await;
    assert!(running.is_some());
    request.abort();
    let settled = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        let cancelled = metric_sum(&m, "switchyard_requests_total", &["outcome=\"cancelled\""]);
        let in_flight = metric_sum(&m, "switchyard_backend_in_flight", &[]);
        (cancelled == 1.0 && in_flight == 0.0).then_some(())
    })
    .await;
    assert!(settled.is_some(), "the disconnect is counted");
    let idle = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &e.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "vllm:num_requests_running", &[]) == 0.0).then_some(())
    })
    .await;
    assert!(idle.is_some());
}

#[tokio::test]
async fn a_prefill_decode_pair_serves_disaggregated_requests() {
    let prefill = engine(&["--role", "prefill"]);
    let decode = engine(&["--role", "decode"]);
    let gw = gateway(&[
        "--backend",
        &format!("{},role=prefill", backend(&prefill)),
        "--backend",
        &format!("{},role=decode", backend(&decode)),
        "--debug-header",
    ]);
    let c = client();
    // Over `cost.local_prefill_max_tokens`, so it is split (shorter prompts may run whole on
    // the decode instance: selective disaggregation).
    let p = prompt("pd", 9000);
    let r = post(
        &c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": p, "max_tokens": 6}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.header("x-switchyard-prefill").unwrap(),
        prefill.authority()
    );
    assert_eq!(
        r.header("x-switchyard-backend").unwrap(),
        decode.authority()
    );
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 6);
    assert_eq!(v["usage"]["prompt_tokens"], 9000);
    // A short prompt runs whole on the decode instance: no hand-off.
    let r = post(
        &c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": prompt("short", 100), "max_tokens": 3}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.header("x-switchyard-prefill").is_none());
    assert_eq!(
        r.header("x-switchyard-backend").unwrap(),
        decode.authority()
    );
    // A long prompt the client wants run whole (`x-switchyard-phase: unified`) is not split.
    let r = post_with(
        &c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": prompt("whole", 9000), "max_tokens": 3}),
        &[("x-switchyard-phase", "unified")],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.header("x-switchyard-prefill").is_none());
    assert_eq!(
        r.header("x-switchyard-backend").unwrap(),
        decode.authority()
    );

    // Streamed chat, usage not asked for: none shown.
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": p}], "max_tokens": 4, "stream": true});
    let r = post(&c, &gw.url("/v1/chat/completions"), &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = sse_chunks(&r.text);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.is_empty());

    // Each engine did its half.
    let pm = get_with(&c, &prefill.url("/metrics"), &[]).await.text;
    let dm = get_with(&c, &decode.url("/metrics"), &[]).await.text;
    assert!(
        metric_sum(&pm, "vllm:prompt_tokens_total", &[]) >= 400.0,
        "{pm}"
    );
    assert!(
        metric_sum(&dm, "vllm:generation_tokens_total", &[]) >= 10.0,
        "{dm}"
    );
    let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    let ok = |b: &Proc| {
        metric_sum(
            &m,
            "switchyard_requests_total",
            &[&format!("backend=\"{}\"", b.authority()), "outcome=\"ok\""],
        )
    };
    assert_eq!(ok(&prefill), 2.0);
    // Two decode legs, the short request and the unified one run whole.
    assert_eq!(ok(&decode), 4.0);
}

#[tokio::test]
async fn a_non_streamed_answer_teaches_no_prefill_speed() {
    // The first byte of a JSON answer arrives after the whole generation; were it taken for the
    // first token, the router would learn a prefill speed from it.
    let e = engine(&[]);
    let gw = gateway(&["--backend", &backend(&e), "--admin-token", "t"]);
    let c = client();
    let body = json!({"model": MODEL, "prompt": prompt("slow", 2000), "max_tokens": 300});
    let r = post(&c, &gw.url("/v1/completions"), &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let fleet = get_with(
        &c,
        &gw.url("/admin/fleet"),
        &[("authorization", "Bearer t")],
    )
    .await
    .json();
    let speed = fleet["backends"][0]["learned"]["prefill_tokens_per_s"]
        .as_f64()
        .expect("learned speed");
    assert_eq!(speed, 20_000.0, "learned from a whole generation: {fleet}");
}

#[tokio::test]
async fn the_router_reports_its_predictions_against_outcomes() {
    let e = engine(&[]);
    let gw = gateway(&["--backend", &backend(&e)]);
    let c = client();
    let text = prompt("predict", 1500);
    for _ in 0..3 {
        let body = json!({"model": MODEL, "prompt": text, "max_tokens": 2, "stream": true});
        let r = post(&c, &gw.url("/v1/completions"), &body).await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    let counts = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        let ttft = metric_sum(&m, "switchyard_ttft_prediction_ratio_count", &[]);
        let cached = metric_sum(&m, "switchyard_cached_prediction_error_count", &[]);
        (ttft >= 3.0 && cached >= 3.0).then_some((ttft, cached))
    })
    .await;
    assert_eq!(counts, Some((3.0, 3.0)));
}
