//! Operating `switchyard serve`: fleet file reloads under traffic, graceful drain on SIGTERM,
//! client API keys, the admin API and its token, router settings files.

mod gateway_support;
mod support;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use gateway_support::*;
use serde_json::{json, Value};

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "switchyard-gw-{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Replaces the file atomically (as editors and config managers do).
fn write_fleet(path: &PathBuf, engines: &[&Proc]) {
    let mut text = String::from("backends:\n");
    for e in engines {
        text.push_str(&format!(
            "  - address: {}\n    models: [{MODEL}]\n    labels: {{zone: test}}\n",
            e.base
        ));
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn backend_names(c: &reqwest::Client, gw: &Proc) -> Vec<(String, String)> {
    fleet_health(c, gw, "adm").await
}

#[tokio::test]
async fn fleet_file_reloads_without_failing_requests() {
    let a = engine_on(0, &["--speed", "1"]);
    let b = engine(&[]);
    let dir = temp_dir("reload");
    let file = dir.join("fleet.yaml");
    write_fleet(&file, &[&a]);
    let gw = gateway(&[
        "--fleet-file",
        file.to_str().unwrap(),
        "--admin-token",
        "adm",
        "--drain-timeout",
        "20",
    ]);
    let c = client();

    // A stream on `a` that is still running when `a` leaves the file.
    let stream = c
        .post(gw.url("/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": "long stream", "max_tokens": 1000, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let mut body = stream.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    let mut streamed = String::from_utf8(first.to_vec()).unwrap();

    // Steady traffic from two clients throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(AtomicUsize::new(0));
    let mut loops = Vec::new();
    for w in 0..2 {
        let (c, url, stop, failures, sent) = (
            c.clone(),
            gw.url("/v1/chat/completions"),
            stop.clone(),
            failures.clone(),
            sent.clone(),
        );
        loops.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let r = post(&c, &url, &chat(&format!("traffic {w} {i}"), 2)).await;
                sent.fetch_add(1, Ordering::SeqCst);
                if r.status != 200 {
                    eprintln!("failed: {} {}", r.status, r.text);
                    failures.fetch_add(1, Ordering::SeqCst);
                }
                i += 1;
            }
        }));
    }

    // Add b.
    write_fleet(&file, &[&a, &b]);
    let both = poll(Duration::from_secs(10), || async {
        let f = backend_names(&c, &gw).await;
        (f.len() == 2 && f.iter().all(|(_, h)| h == "healthy")).then_some(())
    })
    .await;
    assert!(both.is_some(), "{:?}", backend_names(&c, &gw).await);

    // A broken file changes nothing.
    std::fs::write(&file, "backends: [ {address: ").unwrap();
    let counted = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "switchyard_fleet_reloads_total", &["result=\"error\""]) >= 1.0)
            .then_some(())
    })
    .await;
    assert!(counted.is_some());
    assert_eq!(backend_names(&c, &gw).await.len(), 2);
    // Nor does an empty one (what a truncate-then-write editor leaves for a moment).
    std::fs::write(&file, "").unwrap();
    let counted = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "switchyard_fleet_reloads_total", &["result=\"error\""]) >= 2.0)
            .then_some(())
    })
    .await;
    assert!(counted.is_some());
    assert_eq!(backend_names(&c, &gw).await.len(), 2);

    // Remove a: it drains (its stream keeps going) and then leaves.
    write_fleet(&file, &[&b]);
    let draining = poll(Duration::from_secs(10), || async {
        let f = backend_names(&c, &gw).await;
        f.iter()
            .any(|(n, h)| *n == a.authority() && h == "draining")
            .then_some(())
    })
    .await;
    assert!(draining.is_some(), "{:?}", backend_names(&c, &gw).await);
    while let Some(chunk) = body.next().await {
        streamed.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(sse_chunks(&streamed).len() >= 1000);
    let gone = poll(Duration::from_secs(10), || async {
        let f = backend_names(&c, &gw).await;
        (f.len() == 1 && f[0].0 == b.authority()).then_some(())
    })
    .await;
    assert!(gone.is_some(), "{:?}", backend_names(&c, &gw).await);

    // A few more requests on the new fleet, then stop.
    let before = sent.load(Ordering::SeqCst);
    let more = poll(Duration::from_secs(10), || async {
        (sent.load(Ordering::SeqCst) >= before + 6).then_some(())
    })
    .await;
    assert!(more.is_some());
    stop.store(true, Ordering::SeqCst);
    for l in loops {
        l.await.unwrap();
    }
    assert_eq!(
        failures.load(Ordering::SeqCst),
        0,
        "of {}",
        sent.load(Ordering::SeqCst)
    );
    let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    assert!(
        metric_sum(
            &m,
            "switchyard_requests_total",
            &[&format!("backend=\"{}\"", b.authority()), "outcome=\"ok\""]
        ) > 0.0
    );
    assert!(
        !m.contains(&format!("backend=\"{}\"", a.authority())),
        "a's series are gone"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn sigterm_lets_running_streams_finish() {
    let e = engine_on(0, &["--speed", "1"]);
    let mut gw = gateway(&["--backend", &backend(&e), "--drain-timeout", "30"]);
    let c = client();
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "a long answer"}],
                      "max_tokens": 400, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let mut text = String::from_utf8(body.next().await.unwrap().unwrap().to_vec()).unwrap();
    gw.terminate();
    // New connections are refused soon after.
    let refused = poll(Duration::from_secs(5), || async {
        let r = reqwest::Client::new().get(gw.url("/health")).send().await;
        r.is_err().then_some(())
    })
    .await;
    assert!(refused.is_some());
    while let Some(chunk) = body.next().await {
        text.push_str(std::str::from_utf8(&chunk.expect("stream cut")).unwrap());
    }
    let chunks = sse_chunks(&text);
    assert!(chunks.len() >= 400, "{} chunks", chunks.len());
    // The stream's connection, kept alive in the client's pool, answers the next request with
    // a clear 503 and closes, instead of being closed under it.
    let r = post(
        &c,
        &gw.url("/v1/chat/completions"),
        &chat("after the drain began", 1),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.json()["error"]["code"], "shutting_down");
    assert_eq!(r.header("connection").as_deref(), Some("close"));
    assert_eq!(gw.wait_exit(Duration::from_secs(10)), Some(0));
}

#[tokio::test]
async fn client_api_keys() {
    let e = engine(&[]);
    let dir = temp_dir("keys");
    let keys = dir.join("keys.txt");
    std::fs::write(&keys, "# clients\nkey-one\nkey-two\n").unwrap();
    let gw = {
        let mut args = vec![
            "serve".to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--backend".into(),
            backend(&e),
            "--api-keys-file".into(),
            keys.to_str().unwrap().into(),
        ];
        args.extend(["--health-interval".into(), "0.1".into()]);
        // The environment adds keys too.
        Proc::start_with_env(&args, &[("SWITCHYARD_API_KEYS", "env-key")])
    };
    let c = client();
    let url = gw.url("/v1/chat/completions");
    let r = post(&c, &url, &chat("no key", 1)).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let r = post_with(
        &c,
        &url,
        &chat("bad key", 1),
        &[("authorization", "Bearer nope")],
    )
    .await;
    assert_eq!(r.status, 401);
    for key in ["key-one", "key-two", "env-key"] {
        let auth = format!("Bearer {key}");
        let r = post_with(&c, &url, &chat("good key", 1), &[("authorization", &auth)]).await;
        assert_eq!(r.status, 200, "{key}: {}", r.text);
    }
    assert_eq!(get_with(&c, &gw.url("/v1/models"), &[]).await.status, 401);
    assert_eq!(
        get_with(
            &c,
            &gw.url("/v1/models"),
            &[("authorization", "Bearer key-one")]
        )
        .await
        .status,
        200
    );
    // Health and metrics stay open.
    assert_eq!(get_with(&c, &gw.url("/health"), &[]).await.status, 200);
    assert_eq!(get_with(&c, &gw.url("/metrics"), &[]).await.status, 200);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn admin_api_needs_its_token() {
    let a = engine(&[]);
    let b = engine(&[]);
    let plain = gateway(&["--backend", &backend(&a)]);
    let c = client();
    let r = get_with(&c, &plain.url("/admin/fleet"), &[]).await;
    assert_eq!(r.status, 403);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--admin-token"));

    let dir = temp_dir("admin");
    let rc = dir.join("router.toml");
    std::fs::write(
        &rc,
        "policy = \"least-load\"\n[estimates]\nmetrics_stale_after_s = 2.0\n",
    )
    .unwrap();
    let gw = gateway(&[
        "--backend",
        &backend(&a),
        "--backend",
        &backend(&b),
        "--admin-token",
        "s3cret",
        "--router-config",
        rc.to_str().unwrap(),
        "--debug-header",
    ]);
    let auth = [("authorization", "Bearer s3cret")];
    assert_eq!(get_with(&c, &gw.url("/admin/fleet"), &[]).await.status, 403);
    assert_eq!(
        get_with(
            &c,
            &gw.url("/admin/fleet"),
            &[("authorization", "Bearer wrong")]
        )
        .await
        .status,
        403
    );
    // The API key check does not apply to admin routes, nor the admin token to the API.
    let fleet = get_with(&c, &gw.url("/admin/fleet"), &auth).await;
    assert_eq!(fleet.status, 200);
    assert_eq!(fleet.json()["policy"], "least-load");
    assert_eq!(fleet.json()["backends"].as_array().unwrap().len(), 2);
    assert_eq!(fleet.json()["backends"][0]["labels"], json!({}));

    // Drain a: everything goes to b.
    let drain = c
        .post(gw.url(&format!("/admin/drain/{}", a.authority())))
        .header("authorization", "Bearer s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(drain.status(), 200);
    for i in 0..6 {
        let r = post(
            &c,
            &gw.url("/v1/chat/completions"),
            &chat(&format!("drained {i}"), 1),
        )
        .await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-switchyard-backend").unwrap(), b.authority());
    }
    let undrain = c
        .post(gw.url(&format!("/admin/undrain/{}", a.authority())))
        .header("authorization", "Bearer s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(undrain.status(), 200);
    assert!(fleet_health(&c, &gw, "s3cret")
        .await
        .iter()
        .all(|(_, h)| h == "healthy"));
    let r = c
        .post(gw.url("/admin/drain/nobody"))
        .header("authorization", "Bearer s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = c.post(gw.url("/admin/drain/nobody")).send().await.unwrap();
    assert_eq!(r.status(), 403);
    // A path that does not decode: the token is checked first, and the error is OpenAI's shape.
    let r = c.post(gw.url("/admin/drain/%FF")).send().await.unwrap();
    assert_eq!(r.status(), 403);
    let r = c
        .post(gw.url("/admin/drain/%FF"))
        .header("authorization", "Bearer s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_path", "{body}");

    // Switch the policy.
    let r = post_with(
        &c,
        &gw.url("/admin/policy"),
        &json!({"policy": "round-robin"}),
        &auth,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        get_with(&c, &gw.url("/admin/fleet"), &auth).await.json()["policy"],
        "round-robin"
    );
    let r = post(
        &c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": "rr", "max_tokens": 1}),
    )
    .await;
    assert!(r
        .header("x-switchyard-decision")
        .unwrap()
        .starts_with("policy=round-robin"));
    let r = post_with(
        &c,
        &gw.url("/admin/policy"),
        &json!({"policy": "nope"}),
        &auth,
    )
    .await;
    assert_eq!(r.status, 400);
    let r = post_with(
        &c,
        &gw.url("/admin/policy"),
        &json!({"policy": "cost"}),
        &[],
    )
    .await;
    assert_eq!(r.status, 403);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn the_demo_runs_a_whole_fleet_in_one_command() {
    let mut demo = Proc::start(&[
        "demo".to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--speed".into(),
        "100".into(),
        "--pd".into(),
    ]);
    let c = client();
    // Engines are discovered from their /v1/models: wait for the adapters and the pair.
    let models = poll(Duration::from_secs(15), || async {
        let r = get_with(&c, &demo.url("/v1/models"), &[]).await;
        let ids: Vec<String> = r.json()["data"]
            .as_array()
            .map(|d| {
                d.iter()
                    .filter_map(|m| m["id"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        (ids.len() == 4).then_some(ids)
    })
    .await
    .expect("models discovered");
    assert!(models.contains(&"sql-lora".to_string()), "{models:?}");
    let chat = json!({"model": "demo-llama-8b", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8});
    let r = post(&c, &demo.url("/v1/chat/completions"), &chat).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.header("x-switchyard-decision").is_some());
    let r = post(
        &c,
        &demo.url("/v1/completions"),
        &json!({"model": "sql-lora", "prompt": "SELECT", "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.header("x-switchyard-backend").as_deref(),
        Some("engine-0")
    );
    let r = post(
        &c,
        &demo.url("/v1/completions"),
        &json!({"model": "demo-llama-8b-pd", "prompt": "short", "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    // Short: run whole on the decode instance (selective disaggregation).
    assert_eq!(r.header("x-switchyard-prefill"), None);
    assert_eq!(
        r.header("x-switchyard-backend").as_deref(),
        Some("decode-0")
    );
    let r = post(
        &c,
        &demo.url("/v1/completions"),
        &json!({"model": "demo-llama-8b-pd", "prompt": prompt("split", 9000), "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.header("x-switchyard-prefill").as_deref(),
        Some("prefill-0")
    );
    let r = get_with(
        &c,
        &demo.url("/admin/fleet"),
        &[("authorization", "Bearer demo")],
    )
    .await;
    assert_eq!(r.json()["backends"].as_array().unwrap().len(), 5);
    demo.terminate();
    assert_eq!(demo.wait_exit(Duration::from_secs(15)), Some(0));
}

/// A client that sends no `max_tokens`: the gateway budgets 256 tokens, the engine (as vLLM)
/// answers until its context is full, and `/admin/fleet` shows the router measuring answers
/// longer than the budget it assumed (docs/core.md, `kv_penalty`).
#[tokio::test]
async fn the_router_measures_how_much_of_max_tokens_answers_use() {
    let e = engine(&["--max-model-len", "600"]);
    let gw = gateway(&["--backend", &backend(&e), "--admin-token", "adm"]);
    let c = client();
    let url = gw.url("/v1/chat/completions");
    let ask = |i: usize| json!({"model": MODEL, "messages": [{"role": "user", "content": format!("hello {i}")}]});
    let first = poll(Duration::from_secs(10), || async {
        let r = post(&c, &url, &ask(0)).await;
        (r.status == 200).then_some(r)
    })
    .await
    .expect("the gateway serves");
    let answer = first.json()["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(
        answer > 300,
        "the engine fills its context: {answer} tokens"
    );
    for i in 1..4 {
        assert_eq!(post(&c, &url, &ask(i)).await.status, 200);
    }
    let auth = [("authorization", "Bearer adm")];
    let share = poll(Duration::from_secs(10), || async {
        let fleet = get_with(&c, &gw.url("/admin/fleet"), &auth).await.json();
        fleet["output_share"].as_f64().filter(|&s| s > 1.2)
    })
    .await;
    assert!(
        share.is_some(),
        "answers of ~{answer} tokens against 256 assumed"
    );
}
