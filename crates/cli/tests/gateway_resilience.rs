//! Failure handling of `switchyard serve`: retries on 5xx / 429 / closed connections, the
//! llama.cpp keep-alive quirk, ejection of a killed engine and readmission when it returns,
//! and admission control when every backend is saturated.

mod gateway_support;
mod support;

use std::time::{Duration, Instant};

use gateway_support::*;
use serde_json::json;

#[tokio::test]
async fn failed_attempts_are_retried_on_the_next_candidate() {
    let real = engine(&[]);
    let broken = FakeEngine::start(Fake::Status500).await;
    let busy = FakeEngine::start(Fake::Status429).await;
    let closer = FakeEngine::start(Fake::Drop).await;
    // Health checks would eject the 500 fake quickly; make them rare so requests meet it.
    let gw = gateway(&[
        "--backend",
        &backend(&real),
        "--backend",
        &broken.backend(),
        "--backend",
        &busy.backend(),
        "--backend",
        &closer.backend(),
        "--max-retries",
        "3",
        "--health-interval",
        "30",
        "--eject-after",
        "1000",
        "--policy",
        "round-robin",
    ]);
    let c = client();
    for i in 0..8 {
        let r = post(
            &c,
            &gw.url("/v1/chat/completions"),
            &chat(&format!("retry {i}"), 2),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    assert!(broken.hits() > 0 && busy.hits() > 0 && closer.hits() > 0);
    let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    assert!(
        metric_sum(&m, "switchyard_retries_total", &[]) >= 8.0,
        "{m}"
    );
    assert!(
        metric_sum(
            &m,
            "switchyard_upstream_failures_total",
            &["result=\"status_5xx\""]
        ) > 0.0
    );
    assert!(
        metric_sum(
            &m,
            "switchyard_upstream_failures_total",
            &["result=\"status_429\""]
        ) > 0.0
    );
    assert!(
        metric_sum(
            &m,
            "switchyard_upstream_failures_total",
            &["result=\"closed\""]
        ) > 0.0
    );
    // 429 never counts against health; the others only after --eject-after failures.
    assert_eq!(metric_sum(&m, "switchyard_backend_healthy", &[]), 4.0);

    // With retries off, the one candidate's answer is passed through.
    let gw = gateway(&[
        "--backend",
        &broken.backend(),
        "--max-retries",
        "0",
        "--health-interval",
        "30",
    ]);
    let r = post(&c, &gw.url("/v1/chat/completions"), &chat("no retry", 2)).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["message"], "boom");
}

#[tokio::test]
async fn engines_that_close_keep_alive_connections_are_retried_fresh() {
    // llama.cpp announces keep-alive and closes anyway: every pooled reuse fails.
    let liar = FakeEngine::start(Fake::KeepAliveLiar).await;
    let gw = gateway(&[
        "--backend",
        &liar.backend(),
        "--max-retries",
        "0",
        "--eject-after",
        "2",
    ]);
    let c = client();
    for i in 0..6 {
        let body = json!({"model": MODEL, "prompt": format!("again {i}"), "max_tokens": 1});
        let r = post(&c, &gw.url("/v1/completions"), &body).await;
        assert_eq!(r.status, 200, "request {i}: {}", r.text);
    }
    assert_eq!(liar.hits(), 6);
    // Never held against its health.
    let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    assert_eq!(
        metric_sum(&m, "switchyard_backend_healthy", &[]),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric_sum(&m, "switchyard_requests_total", &["outcome=\"ok\""]),
        6.0
    );
    let stale = metric_sum(
        &m,
        "switchyard_upstream_failures_total",
        &["result=\"stale\""],
    );
    assert!(stale >= 1.0, "{m}");
    let closed = metric_sum(
        &m,
        "switchyard_upstream_failures_total",
        &["result=\"closed\""],
    );
    assert_eq!(closed, 0.0);
}

#[tokio::test]
async fn a_killed_engine_is_ejected_and_readmitted_when_it_returns() {
    let a = engine(&[]);
    let mut b = engine(&[]);
    let b_port = b.port();
    let token = "t0ken";
    let gw = gateway(&[
        "--backend",
        &backend(&a),
        "--backend",
        &backend(&b),
        "--admin-token",
        token,
        "--eject-after",
        "2",
        "--readmit-after",
        "2",
    ]);
    let c = client();
    for i in 0..4 {
        let r = post(
            &c,
            &gw.url("/v1/chat/completions"),
            &chat(&format!("before {i}"), 2),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    b.kill();
    // Traffic continues while and after b is ejected.
    for i in 0..10 {
        let r = post(
            &c,
            &gw.url("/v1/chat/completions"),
            &chat(&format!("during {i}"), 2),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    let b_name = b.authority();
    let ejected = poll(Duration::from_secs(10), || async {
        let f = fleet_health(&c, &gw, token).await;
        f.iter()
            .any(|(n, h)| *n == b_name && h == "unhealthy")
            .then_some(())
    })
    .await;
    assert!(
        ejected.is_some(),
        "{:?}",
        fleet_health(&c, &gw, token).await
    );

    // The active checks see it down too.
    let checked = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "switchyard_health_checks_total", &["result=\"error\""]) > 0.0)
            .then_some(())
    })
    .await;
    assert!(checked.is_some());

    // Back on the same port: readmitted after passing checks, and takes traffic again.
    let _b2 = engine_on(b_port, &["--speed", "100"]);
    let readmitted = poll(Duration::from_secs(10), || async {
        let f = fleet_health(&c, &gw, token).await;
        f.iter().all(|(_, h)| h == "healthy").then_some(())
    })
    .await;
    assert!(
        readmitted.is_some(),
        "{:?}",
        fleet_health(&c, &gw, token).await
    );
    let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    assert_eq!(metric_sum(&m, "switchyard_backend_healthy", &[]), 2.0);
}

#[tokio::test]
async fn saturated_requests_queue_then_get_429_with_retry_after() {
    // One engine at real time, one request in flight at most.
    let e = engine_on(0, &["--speed", "1"]);
    let gw = gateway(&[
        "--backend",
        &backend(&e),
        "--max-in-flight",
        "1",
        "--queue-size",
        "1",
        "--queue-timeout",
        "0.5",
    ]);
    let c = client();
    let long = json!({"model": MODEL, "prompt": "a long one", "max_tokens": 2000});
    let url = gw.url("/v1/completions");
    let first = tokio::spawn({
        let (c, url, long) = (c.clone(), url.clone(), long.clone());
        async move { post(&c, &url, &long).await }
    });
    // Wait until the first is in flight.
    let inflight = poll(Duration::from_secs(5), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "switchyard_backend_in_flight", &[]) >= 1.0).then_some(())
    })
    .await;
    assert!(inflight.is_some());
    // The second waits in the queue...
    let second = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move {
            let started = Instant::now();
            (
                post(
                    &c,
                    &url,
                    &json!({"model": MODEL, "prompt": "queued", "max_tokens": 1}),
                )
                .await,
                started.elapsed(),
            )
        }
    });
    let queued = poll(Duration::from_secs(5), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "switchyard_admission_queue_length", &[]) >= 1.0).then_some(())
    })
    .await;
    assert!(queued.is_some());
    // ...so a third finds the queue full: 429 at once.
    let third = post(
        &c,
        &url,
        &json!({"model": MODEL, "prompt": "shed", "max_tokens": 1}),
    )
    .await;
    assert_eq!(third.status, 429, "{}", third.text);
    assert_eq!(third.json()["error"]["code"], "saturated");
    assert!(third.header("retry-after").is_some());
    // The queued one times out with 429 and Retry-After.
    let (second, waited) = second.await.unwrap();
    assert_eq!(second.status, 429, "{}", second.text);
    assert!(
        second
            .header("retry-after")
            .unwrap()
            .parse::<u32>()
            .unwrap()
            >= 1
    );
    assert!(waited >= Duration::from_millis(400), "{waited:?}");
    // The long one is still running: leaving cancels it on the engine.
    first.abort();

    // A queued request is admitted as soon as capacity frees up.
    let gw = gateway(&[
        "--backend",
        &backend(&e),
        "--max-in-flight",
        "1",
        "--queue-timeout",
        "30",
    ]);
    let url = gw.url("/v1/completions");
    let short = json!({"model": MODEL, "prompt": "short", "max_tokens": 20});
    let a = tokio::spawn({
        let (c, url, short) = (c.clone(), url.clone(), short.clone());
        async move { post(&c, &url, &short).await }
    });
    let b = tokio::spawn({
        let (c, url, short) = (c.clone(), url.clone(), short.clone());
        async move { post(&c, &url, &short).await }
    });
    assert_eq!(a.await.unwrap().status, 200);
    assert_eq!(b.await.unwrap().status, 200);
}

#[tokio::test]
async fn queued_requests_are_admitted_in_arrival_order() {
    // One request at a time; four wait behind it, each sent once the one before is queued.
    let e = engine_on(0, &["--speed", "1"]);
    let gw = gateway(&[
        "--backend",
        &backend(&e),
        "--max-in-flight",
        "1",
        "--queue-size",
        "8",
        "--queue-timeout",
        "60",
    ]);
    let c = client();
    let url = gw.url("/v1/completions");
    let queued = |n: f64| {
        let (c, gw) = (c.clone(), &gw);
        async move {
            poll(Duration::from_secs(10), || async {
                let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
                (metric_sum(&m, "switchyard_admission_queue_length", &[]) >= n).then_some(())
            })
            .await
            .is_some()
        }
    };
    let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let send = |i: usize, max_tokens: u32| {
        let (c, url, done) = (c.clone(), url.clone(), done.clone());
        tokio::spawn(async move {
            let body =
                json!({"model": MODEL, "prompt": format!("request {i}"), "max_tokens": max_tokens});
            let r = post(&c, &url, &body).await;
            done.lock().unwrap().push(i);
            r.status
        })
    };
    let mut tasks = vec![send(0, 200)];
    let inflight = poll(Duration::from_secs(5), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "switchyard_backend_in_flight", &[]) >= 1.0).then_some(())
    })
    .await;
    assert!(inflight.is_some());
    for i in 1..=4 {
        tasks.push(send(i, 3));
        assert!(queued(i as f64).await, "request {i} did not queue");
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    // Served one at a time, so they finish in the order they were admitted.
    assert_eq!(*done.lock().unwrap(), vec![0, 1, 2, 3, 4]);
}

#[tokio::test]
async fn engine_queue_length_saturates_too() {
    // One sequence at a time on the engine: a second request waits in its queue, which the
    // scrape reports; --max-waiting 1 then sheds a third.
    let e = engine_on(0, &["--speed", "1", "--max-num-seqs", "1"]);
    let gw = gateway(&[
        "--backend",
        &backend(&e),
        "--max-waiting",
        "1",
        "--queue-size",
        "0",
        "--admin-token",
        "t",
    ]);
    let c = client();
    let url = gw.url("/v1/completions");
    let long = json!({"model": MODEL, "prompt": "hold the slot", "max_tokens": 1000});
    let mut running = Vec::new();
    for _ in 0..2 {
        let (c, url, long) = (c.clone(), url.clone(), long.clone());
        running.push(tokio::spawn(async move { post(&c, &url, &long).await }));
    }
    // Wait until the gateway's scrape shows the engine's queue.
    let seen = poll(Duration::from_secs(10), || async {
        let r = get_with(
            &c,
            &gw.url("/admin/fleet"),
            &[("authorization", "Bearer t")],
        )
        .await;
        let waiting = r.json()["backends"][0]["engine"]["metrics"]["waiting"].as_u64();
        (waiting >= Some(1)).then_some(())
    })
    .await;
    assert!(seen.is_some());
    let shed = post(
        &c,
        &url,
        &json!({"model": MODEL, "prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert_eq!(shed.status, 429, "{}", shed.text);
    assert!(shed.header("retry-after").is_some());
    for r in running {
        r.abort();
    }
}

#[tokio::test]
async fn embeddings_are_routed_by_load() {
    let a = FakeEngine::start(Fake::Ok).await;
    let b = FakeEngine::start(Fake::Ok).await;
    let gw = gateway(&[
        "--backend",
        &a.backend(),
        "--backend",
        &b.backend(),
        "--strict-models",
        "--admin-token",
        "t",
    ]);
    let c = client();
    let embed = |i: usize| {
        let (c, url) = (c.clone(), gw.url("/v1/embeddings"));
        async move {
            let r = post(
                &c,
                &url,
                &json!({"model": MODEL, "input": format!("embed {i}")}),
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.text);
            assert_eq!(r.json()["path"], "/v1/embeddings");
        }
    };
    for i in 0..16 {
        embed(i).await;
    }
    // Equal loads are ties, broken at random: both got some.
    assert!(a.hits() > 0 && b.hits() > 0, "{} {}", a.hits(), b.hits());
    // The core's exclusions hold for embeddings too: a drained backend gets none.
    let name = a.base.trim_start_matches("http://").to_string();
    let drain = c
        .post(gw.url(&format!("/admin/drain/{name}")))
        .header("authorization", "Bearer t")
        .send()
        .await
        .unwrap();
    assert_eq!(drain.status(), 200);
    let before = a.hits();
    for i in 0..8 {
        embed(100 + i).await;
    }
    assert_eq!(a.hits(), before, "a drained backend took embeddings");
    let r = post(
        &c,
        &gw.url("/v1/embeddings"),
        &json!({"model": "other", "input": "x"}),
    )
    .await;
    assert_eq!(r.status, 404);
}

#[tokio::test]
async fn a_request_that_fails_on_every_engine_ejects_none() {
    // Both engines drop this request's connection (as engines do with requests they cannot
    // read): that is the request, not the engines, so however often a client sends it, neither
    // is ejected.
    let one = FakeEngine::start(Fake::Drop).await;
    let two = FakeEngine::start(Fake::Drop).await;
    let gw = gateway(&[
        "--backend",
        &one.backend(),
        "--backend",
        &two.backend(),
        "--max-retries",
        "1",
        "--eject-after",
        "2",
    ]);
    let c = client();
    for i in 0..5 {
        let r = post(
            &c,
            &gw.url("/v1/completions"),
            &json!({"model": MODEL, "prompt": format!("poison {i}"), "max_tokens": 1}),
        )
        .await;
        assert_eq!(r.status, 502, "{}", r.text);
    }
    // Each request tried both (each on a fresh connection too: a closed pooled one is retried).
    let tried = one.hits() + two.hits();
    assert_eq!(tried, 20, "every request tried both");
    let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    assert_eq!(metric_sum(&m, "switchyard_backend_healthy", &[]), 2.0);
    assert_eq!(metric_sum(&m, "switchyard_request_blamed_total", &[]), 5.0);

    // Headers larger than engines accept never leave the gateway.
    let big = "x".repeat(20_000);
    let r = post_with(
        &c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": "hi", "max_tokens": 1}),
        &[("x-padding", big.as_str())],
    )
    .await;
    assert_eq!(r.status, 431, "{}", r.text);
    assert_eq!(r.json()["error"]["code"], "headers_too_large");
    assert_eq!(one.hits() + two.hits(), tried);
}

/// Reads what the server sends until it closes the connection (or `limit` passes).
async fn read_until_closed(stream: &mut tokio::net::TcpStream, limit: Duration) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(limit, read).await.ok()?;
    Some(String::from_utf8_lossy(&out).into_owned())
}

#[tokio::test]
async fn slow_idle_and_surplus_clients_are_cut_off() {
    use tokio::io::AsyncWriteExt;
    let e = engine(&[]);
    let gw = gateway(&[
        "--backend",
        &backend(&e),
        "--header-read-timeout",
        "0.5",
        "--body-read-timeout",
        "0.5",
    ]);
    let addr = gw.base.trim_start_matches("http://").to_string();
    let connect = || tokio::net::TcpStream::connect(addr.clone());
    // A client that connects and sends nothing is disconnected.
    let mut idle = connect().await.unwrap();
    assert!(
        read_until_closed(&mut idle, Duration::from_secs(10))
            .await
            .is_some(),
        "an idle connection is held"
    );
    // So is one that sends half its headers.
    let mut half = connect().await.unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    assert!(
        read_until_closed(&mut half, Duration::from_secs(10))
            .await
            .is_some(),
        "half-sent headers are held"
    );
    // One that sends its headers but only part of the body gets 408 in OpenAI's shape.
    let mut slow = connect().await.unwrap();
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"",
    )
    .await
    .unwrap();
    let answer = read_until_closed(&mut slow, Duration::from_secs(10))
        .await
        .expect("a half-sent body is held");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"body_timeout\""), "{answer}");

    // At the cap, a further connection is told so and closed (a gateway whose idle clients
    // are not cut off first).
    let gw = gateway(&["--backend", &backend(&e), "--max-connections", "3"]);
    let addr = gw.base.trim_start_matches("http://").to_string();
    let connect = || tokio::net::TcpStream::connect(addr.clone());
    let _held: Vec<_> = futures_util::future::join_all((0..3).map(|_| connect()))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    // The three are counted once the gateway accepted them: poll until the fourth is refused.
    let refused = poll(Duration::from_secs(10), || async {
        let mut extra = connect().await.ok()?;
        let answer = read_until_closed(&mut extra, Duration::from_secs(2)).await?;
        answer.starts_with("HTTP/1.1 503").then_some(answer)
    })
    .await
    .expect("a connection over the cap is refused");
    assert!(refused.contains("\"too_many_connections\""), "{refused}");
    assert!(
        refused.to_ascii_lowercase().contains("connection: close"),
        "{refused}"
    );
}

#[tokio::test]
async fn bodies_being_received_cannot_take_more_memory_than_the_budget() {
    use tokio::io::AsyncWriteExt;
    let e = engine(&[]);
    let gw = gateway(&[
        "--backend",
        &backend(&e),
        "--max-body-memory",
        "100000",
        "--body-read-timeout",
        "30",
    ]);
    let addr = gw.base.trim_start_matches("http://").to_string();
    let connect = || tokio::net::TcpStream::connect(addr.clone());
    let head = |len: usize| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n"
        )
    };
    // A slow upload declares 60 kB and sends a few bytes: its 60 kB are reserved.
    let mut slow = connect().await.unwrap();
    slow.write_all(format!("{}{{\"model\"", head(60_000)).as_bytes())
        .await
        .unwrap();
    let c = reqwest::Client::new();
    poll(Duration::from_secs(10), || async {
        metric(&c, &gw, "switchyard_body_memory_bytes")
            .await
            .filter(|&b| b >= 60_000.0)
    })
    .await
    .expect("the slow upload's 60 kB are reserved");
    // A second one that would take the sum past 100 kB is refused at once, in OpenAI's shape.
    let refused = poll(Duration::from_secs(10), || async {
        let mut second = connect().await.ok()?;
        second
            .write_all(format!("{}{{", head(60_000)).as_bytes())
            .await
            .ok()?;
        let answer = read_until_closed(&mut second, Duration::from_secs(2)).await?;
        answer.starts_with("HTTP/1.1 503").then_some(answer)
    })
    .await
    .expect("the second upload is refused");
    assert!(refused.contains("\"body_memory_exhausted\""), "{refused}");
    assert!(
        refused.contains("retry-after") || refused.contains("Retry-After"),
        "{refused}"
    );
    // A request that fits still goes through beside the slow one.
    let ok = c
        .post(format!("{}/v1/completions", gw.base))
        .json(&serde_json::json!({"model": MODEL, "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    // Once the slow client leaves, its reservation is given back.
    drop(slow);
    let after = poll(Duration::from_secs(30), || async {
        let body = format!(
            "{{\"model\":\"{MODEL}\",\"prompt\":\"{}\",\"max_tokens\":2}}",
            "a".repeat(59_000)
        );
        let r = c
            .post(format!("{}/v1/completions", gw.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    assert!(after.is_some(), "the budget came back");
}

#[tokio::test]
async fn a_stalled_stream_is_ended_with_an_error_event() {
    // Headers and one token at once, then silence: the client must not wait forever.
    let fake = FakeEngine::start(Fake::StallMidStream).await;
    let gw = gateway(&[
        "--backend",
        &fake.backend(),
        "--max-retries",
        "0",
        "--stream-idle-timeout",
        "0.5",
    ]);
    let c = client();
    let body = json!({"model": MODEL, "prompt": "stall", "max_tokens": 5, "stream": true});
    let started = Instant::now();
    let r = c
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let text = tokio::time::timeout(Duration::from_secs(20), r.text())
        .await
        .expect("the stream ends")
        .expect("body");
    assert!(started.elapsed() >= Duration::from_millis(400));
    // The token, then the error event; no `[DONE]`: the answer is not complete.
    let events: Vec<&str> = text
        .split("\n\n")
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    assert_eq!(events.len(), 2, "{text}");
    let last: serde_json::Value =
        serde_json::from_str(events[1].trim_start_matches("data: ")).expect("JSON event");
    assert_eq!(last["error"]["code"], "stream_stalled");
    assert_eq!(last["error"]["type"], "server_error");
    let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    assert_eq!(
        metric_sum(
            &m,
            "switchyard_requests_total",
            &["outcome=\"stream_stalled\""]
        ),
        1.0
    );
    // The router saw it end: nothing stays in flight.
    let idle = poll(Duration::from_secs(5), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "switchyard_backend_in_flight", &[]) == 0.0).then_some(())
    })
    .await;
    assert!(idle.is_some());
}

#[tokio::test]
async fn a_stream_is_settled_at_done_even_if_the_client_leaves_at_once() {
    // Clients stop reading at `data: [DONE]` and close; the engine's body may end later (or,
    // here, never). The request is complete at `[DONE]`: counted ok, not cancelled.
    let fake = FakeEngine::start(Fake::DoneThenHold).await;
    let gw = gateway(&["--backend", &fake.backend(), "--max-retries", "0"]);
    let c = client();
    let body = json!({"model": MODEL, "prompt": "done", "max_tokens": 1, "stream": true});
    let mut r = c
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let mut seen = String::new();
    while !seen.contains("[DONE]") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), r.chunk())
            .await
            .expect("a chunk in time")
            .expect("read")
            .expect("the stream goes on until [DONE]");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(r);
    let counted = |outcome: &'static str| {
        let c = c.clone();
        let url = gw.url("/metrics");
        async move {
            let m = get_with(&c, &url, &[]).await.text;
            metric_sum(
                &m,
                "switchyard_requests_total",
                &[&format!("outcome=\"{outcome}\"")],
            )
        }
    };
    let ok = poll(Duration::from_secs(10), || async {
        let n = counted("ok").await;
        (n >= 1.0).then_some(n)
    })
    .await;
    assert_eq!(ok, Some(1.0), "the request was not counted ok");
    assert_eq!(counted("cancelled").await, 0.0);
}

/// Requests hyper cannot parse are answered by hyper itself, before any handler: they still get
/// OpenAI's error shape (and the connection is closed).
#[tokio::test]
async fn unparseable_requests_get_openai_errors() {
    use tokio::io::AsyncWriteExt;
    let e = engine(&[]);
    let gw = gateway(&["--backend", &backend(&e)]);
    let addr = gw.base.trim_start_matches("http://").to_string();
    let long_uri = format!("GET /{} HTTP/1.1\r\nhost: x\r\n\r\n", "a".repeat(70_000));
    let many_headers = format!(
        "GET /health HTTP/1.1\r\nhost: x\r\n{}\r\n",
        (0..120).map(|i| format!("h{i}: v\r\n")).collect::<String>()
    );
    for (request, status, code) in [
        ("GARBAGE\r\n\r\n".to_string(), "400", "invalid_http"),
        (
            "GET /health HTTP/1.1\r\nhost: x\r\nbad header: y\r\n\r\n".to_string(),
            "400",
            "invalid_http",
        ),
        (long_uri, "414", "uri_too_long"),
        (many_headers, "431", "headers_too_large"),
    ] {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let answer = read_until_closed(&mut s, Duration::from_secs(10))
            .await
            .expect("answered and closed");
        let (head, body) = answer.split_once("\r\n\r\n").expect("a head");
        assert!(head.starts_with(&format!("HTTP/1.1 {status}")), "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).expect("a JSON body");
        assert_eq!(v["error"]["code"], code, "{body}");
    }
}

/// An engine that accepts requests and never answers, while its health checks pass, is ejected
/// after `--eject-after` timed-out requests, as one answering 5xx is.
#[tokio::test]
async fn an_engine_that_never_answers_is_ejected() {
    let steady = engine(&[]);
    let hang = FakeEngine::start(Fake::Hang).await;
    let gw = gateway(&[
        "--backend",
        &backend(&steady),
        "--backend",
        &hang.backend(),
        "--policy",
        "round-robin",
        "--upstream-timeout",
        "0.3",
        "--eject-after",
        "2",
        // No health check readmits it during the test.
        "--health-interval",
        "60",
    ]);
    let c = client();
    let url = gw.url("/v1/chat/completions");
    let mut statuses = Vec::new();
    for i in 0..8 {
        statuses.push(post(&c, &url, &chat(&format!("hung {i}"), 2)).await.status);
    }
    assert_eq!(hang.hits(), 2, "{statuses:?}");
    assert!(statuses[4..].iter().all(|&s| s == 200), "{statuses:?}");
    assert_eq!(
        statuses.iter().filter(|&&s| s == 504).count(),
        2,
        "{statuses:?}"
    );
}
