//! The live dashboard (`/dashboard`, `/dashboard/snapshot`, `/dashboard/events`) on
//! `switchyard serve` and on `switchyard epp`'s metrics port: the admin token guards it, the
//! snapshot reports the fleet and the last decisions (bounded), the event stream streams and
//! never holds a graceful shutdown up. The page itself in a real browser: tests/browser/.

mod gateway_support;
mod support;

use std::time::Duration;

use futures_util::StreamExt;
use gateway_support::*;
use serde_json::Value;

const TOKEN: &str = "dash-token";

fn bearer() -> String {
    format!("Bearer {TOKEN}")
}

async fn snapshot(c: &reqwest::Client, p: &Proc) -> Value {
    let r = get_with(
        c,
        &p.url("/dashboard/snapshot"),
        &[("authorization", &bearer())],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json()
}

/// Basic credentials with `password` (`user:password`, base64), as a browser sends them.
fn basic(password: &str) -> String {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let raw = format!("admin:{password}").into_bytes();
    let mut out = String::from("Basic ");
    for chunk in raw.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(B64[((n >> (18 - 6 * k)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[tokio::test]
async fn the_dashboard_needs_the_admin_token() {
    let e = engine(&[]);
    let gw = gateway(&["--backend", &backend(&e), "--admin-token", TOKEN]);
    let c = client();
    for path in ["/dashboard", "/dashboard/snapshot", "/dashboard/events"] {
        for auth in [
            None,
            Some("Bearer wrong".to_string()),
            Some(basic("wrong")),
            Some(format!("Token {TOKEN}")),
        ] {
            let headers: Vec<(&str, &str)> =
                auth.iter().map(|a| ("authorization", a.as_str())).collect();
            let r = get_with(&c, &gw.url(path), &headers).await;
            assert_eq!(r.status, 401, "{path} with {auth:?}: {}", r.text);
            assert_eq!(r.json()["error"]["code"], "invalid_admin_token");
            // The challenge is what makes a browser ask for the token.
            assert!(r
                .header("www-authenticate")
                .is_some_and(|h| h.starts_with("Basic realm=")));
            assert!(!r.text.contains("gw-test-model"), "{path} leaked figures");
        }
    }
    // The page, with the token as a Bearer token or as Basic credentials' password.
    for auth in [bearer(), basic(TOKEN)] {
        let r = get_with(&c, &gw.url("/dashboard"), &[("authorization", &auth)]).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert!(r
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/html")));
        assert!(r.text.contains("new EventSource(\"/dashboard/events\")"));
        // Everything is in the page: nothing is loaded from elsewhere.
        for external in ["http://", "https://", "src=\""] {
            let outside = r
                .text
                .match_indices(external)
                .filter(|(i, _)| !r.text[..*i].ends_with("xmlns=\""))
                .filter(|(i, _)| !r.text[*i..].starts_with("http://www.w3.org/2000/svg"));
            assert_eq!(outside.count(), 0, "{external} in the page");
        }
    }
    // No admin token configured: the dashboard is off, as the admin API.
    let open = gateway(&["--backend", &backend(&e)]);
    let r = get_with(&c, &open.url("/dashboard/snapshot"), &[]).await;
    assert_eq!(r.status, 403, "{}", r.text);
}

#[tokio::test]
async fn the_snapshot_shows_each_instance_and_the_last_decisions() {
    let (a, b) = (engine(&[]), engine(&[]));
    let gw = gateway(&[
        "--backend",
        &format!("{},name=alpha", backend(&a)),
        "--backend",
        &format!("{},name=beta", backend(&b)),
        "--admin-token",
        TOKEN,
    ]);
    let c = client();
    let url = gw.url("/v1/chat/completions");
    // More requests than the decision ring holds.
    let requests = 70;
    for i in 0..requests {
        let mut body = chat(&prompt(&format!("dash {}", i % 4), 64), 4);
        body["stream"] = true.into();
        assert_eq!(post(&c, &url, &body).await.status, 200);
    }
    let snap = poll(Duration::from_secs(10), || async {
        let s = snapshot(&c, &gw).await;
        let scraped = s["instances"]
            .as_array()?
            .iter()
            .all(|i| i["engine"].is_object());
        scraped.then_some(s)
    })
    .await
    .expect("both engines scraped");

    let instances = snap["instances"].as_array().unwrap();
    let names: Vec<&str> = instances
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["alpha", "beta"]);
    let mut routed = 0;
    let mut samples = 0;
    for i in instances {
        assert_eq!(i["state"], "healthy");
        assert_eq!(i["role"], "both");
        assert_eq!(i["models"][0], "gw-test-model");
        assert!(i["engine"]["age_s"].as_f64().unwrap() >= 0.0);
        assert!(i["router"]["pending"].is_u64() && i["router"]["running"].is_u64());
        routed += i["routed_recent"].as_u64().unwrap();
        let n = i["ttft_samples"].as_u64().unwrap();
        samples += n;
        if n > 0 {
            let (p50, p99) = (
                i["ttft_p50_s"].as_f64().unwrap(),
                i["ttft_p99_s"].as_f64().unwrap(),
            );
            assert!(0.0 < p50 && p50 <= p99, "{i}");
        }
        let share = i["traffic_share"].as_f64().unwrap_or(0.0);
        assert!((0.0..=1.0).contains(&share));
    }
    assert_eq!(routed, requests);
    assert_eq!(samples, requests);
    assert_eq!(snap["per_minute"]["routed"], requests);
    assert!(snap["fleet"]["ttft_p99_s"].as_f64().unwrap() > 0.0);
    let series_total: u64 = snap["series"]["routed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(series_total, requests);

    // The ring keeps the last 50, newest first, each explained as the debug header is.
    let decisions = snap["decisions"].as_array().unwrap();
    assert_eq!(decisions.len(), 50);
    let ids: Vec<u64> = decisions
        .iter()
        .map(|d| d["request"].as_u64().unwrap())
        .collect();
    assert!(ids.windows(2).all(|w| w[0] > w[1]), "{ids:?}");
    for d in decisions {
        assert_eq!(d["model"], "gw-test-model");
        assert!(["alpha", "beta"].contains(&d["backend"].as_str().unwrap()));
        let explain = d["explain"].as_str().unwrap();
        assert!(explain.starts_with("policy=cost eligible=2 "), "{explain}");
        assert!(explain.contains("alpha score=") && explain.contains("beta score="));
    }

    // A drained backend shows as drained.
    let r = c
        .post(gw.url("/admin/drain/beta"))
        .header("authorization", bearer())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let snap = snapshot(&c, &gw).await;
    let states: Vec<&str> = snap["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["healthy", "drained"]);
}

/// The next `data:` event of a server-sent event stream, as JSON (None when it ended).
async fn next_event(
    stream: &mut (impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
    buf: &mut String,
) -> Option<Value> {
    loop {
        if let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let data = event.lines().find_map(|l| l.strip_prefix("data: "))?;
            return Some(serde_json::from_str(data).expect("event json"));
        }
        let chunk = stream.next().await?.ok()?;
        buf.push_str(std::str::from_utf8(&chunk).expect("utf-8"));
    }
}

/// Opens `/dashboard/events` on `p`; checks it streams snapshots.
async fn open_events(
    c: &reqwest::Client,
    p: &Proc,
) -> impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin {
    let r = c
        .get(p.url("/dashboard/events"))
        .header("authorization", bearer())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let mut stream = r.bytes_stream();
    let mut buf = String::new();
    for _ in 0..2 {
        let snap = tokio::time::timeout(Duration::from_secs(5), next_event(&mut stream, &mut buf))
            .await
            .expect("an event within the interval")
            .expect("an event");
        assert_eq!(snap["instances"].as_array().map(Vec::len), Some(1));
    }
    stream
}

#[tokio::test]
async fn event_streams_are_capped_and_end_at_shutdown() {
    let e = engine(&[]);
    let mut gw = gateway(&[
        "--backend",
        &backend(&e),
        "--admin-token",
        TOKEN,
        "--drain-timeout",
        "30",
    ]);
    let c = client();
    let mut stream = open_events(&c, &gw).await;
    // At most 16 at once: the 17th is refused, and a closed one frees its place.
    let mut others = Vec::new();
    for _ in 1..16 {
        let r = c
            .get(gw.url("/dashboard/events"))
            .header("authorization", bearer())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        others.push(r);
    }
    let over = get_with(
        &c,
        &gw.url("/dashboard/events"),
        &[("authorization", &bearer())],
    )
    .await;
    assert_eq!(over.status, 503, "{}", over.text);
    assert_eq!(over.json()["error"]["code"], "too_many_dashboard_streams");
    others.clear();
    // The server notices a client gone at its next write (within the interval).
    let reopened = poll(Duration::from_secs(10), || async {
        let r = c
            .get(gw.url("/dashboard/events"))
            .header("authorization", bearer())
            .send()
            .await
            .ok()?;
        (r.status() == 200).then_some(r)
    })
    .await;
    assert!(reopened.is_some(), "a place was not freed");
    drop(reopened);

    // Shutdown ends the stream at once instead of waiting out the drain timeout for it.
    let t0 = std::time::Instant::now();
    gw.terminate();
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = String::new();
        while next_event(&mut stream, &mut buf).await.is_some() {}
    })
    .await;
    assert!(ended.is_ok(), "the event stream outlived the shutdown");
    assert_eq!(gw.wait_exit(Duration::from_secs(10)), Some(0));
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn the_endpoint_picker_serves_the_dashboard_on_its_metrics_port() {
    let e = engine(&[]);
    let mut picker = epp(&["--backend", &backend(&e), "--admin-token", TOKEN]);
    let c = client();
    let r = get_with(&c, &picker.url("/dashboard/snapshot"), &[]).await;
    assert_eq!(r.status, 401);
    let snap = snapshot(&c, &picker).await;
    assert_eq!(snap["instances"].as_array().map(Vec::len), Some(1));
    let r = get_with(
        &c,
        &picker.url("/dashboard"),
        &[("authorization", &basic(TOKEN))],
    )
    .await;
    assert_eq!(r.status, 200);
    let mut stream = open_events(&c, &picker).await;
    let t0 = std::time::Instant::now();
    picker.terminate();
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = String::new();
        while next_event(&mut stream, &mut buf).await.is_some() {}
    })
    .await;
    assert!(ended.is_ok(), "the event stream outlived the shutdown");
    assert_eq!(picker.wait_exit(Duration::from_secs(10)), Some(0));
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}
