//! The gateway's metrics follow Prometheus' naming conventions and stay bounded: what a client
//! chooses (model names, session ids, request ids, paths, prompts) never becomes a label value,
//! so a client cannot grow the series count.

mod gateway_support;
mod support;

use gateway_support::*;
use serde_json::json;

/// Series lines (not comments) of a metrics page.
fn series(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .collect()
}

#[tokio::test]
async fn client_chosen_values_never_become_series() {
    let e = engine(&[]);
    let gw = gateway(&["--backend", &backend(&e), "--strict-models"]);
    let c = client();
    let url = gw.url("/v1/chat/completions");
    // Every kind of answer once, so the series that exist have all been created.
    assert_eq!(post(&c, &url, &chat("warm", 1)).await.status, 200);
    let unknown = json!({"model": "warm-unknown", "messages": [{"role": "user", "content": "x"}]});
    assert_eq!(post(&c, &url, &unknown).await.status, 404);
    assert_eq!(get_with(&c, &gw.url("/nowhere"), &[]).await.status, 404);
    let before = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    for i in 0..60 {
        let model = format!("model-{i}");
        let body =
            json!({"model": model, "messages": [{"role": "user", "content": format!("q {i}")}]});
        assert_eq!(post(&c, &url, &body).await.status, 404);
        let session = format!("session-{i}");
        let rid = format!("rid-{i}");
        let headers = [
            ("x-session-id", session.as_str()),
            ("x-request-id", rid.as_str()),
        ];
        let r = post_with(&c, &url, &chat(&format!("prompt {i}"), 1), &headers).await;
        assert_eq!(r.status, 200);
        assert_eq!(
            get_with(&c, &gw.url(&format!("/path-{i}")), &[])
                .await
                .status,
            404
        );
    }
    let after = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    let (b, a) = (series(&before), series(&after));
    assert_eq!(a.len(), b.len(), "series grew with client-chosen values");
    for line in &a {
        for leaked in ["model-", "session-", "rid-", "path-", "prompt "] {
            assert!(!line.contains(leaked), "a client value in a label: {line}");
        }
    }
    // Naming: one prefix, counters exposed with `_total`, units spelled out.
    for line in after.lines().filter(|l| l.starts_with("# TYPE ")) {
        let mut parts = line.split_whitespace().skip(2);
        let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
        assert!(name.starts_with("switchyard_"), "{line}");
        assert!(
            !name.ends_with("_total"),
            "the family name carries no _total: {line}"
        );
        if kind == "counter" {
            assert!(
                after.contains(&format!("\n{name}_total")),
                "{name} samples end in _total"
            );
        }
        assert!(
            !name.contains("_ms") && !name.contains("millis"),
            "base units: {line}"
        );
    }
}

/// The series count is bounded by what the operator configures, not by traffic (#16): an
/// engine serving many adapters, requests for every one of them and for names nobody serves,
/// and the dashboard read meanwhile, add no series; no adapter name becomes a label (adapter
/// series exist only for dynamic placement, one per adapter with a `--lora-path`).
#[tokio::test]
async fn many_adapters_and_models_keep_the_series_count_bounded() {
    const ADAPTERS: usize = 24;
    let modules: Vec<String> = (0..ADAPTERS)
        .map(|i| format!("card-lora-{i}=/adapters/{i}"))
        .collect();
    let mut args = vec!["--max-loras", "4", "--lora-modules"];
    args.extend(modules.iter().map(String::as_str));
    let e = engine(&args);
    let gw = gateway(&[
        "--backend",
        &e.base,
        "--strict-models",
        "--admin-token",
        "t",
    ]);
    let c = client();
    let listed = poll(std::time::Duration::from_secs(10), || async {
        let r = get_with(&c, &gw.url("/v1/models"), &[]).await;
        let n = r.json()["data"].as_array().map_or(0, Vec::len);
        (n == ADAPTERS + 1).then_some(())
    })
    .await;
    assert!(
        listed.is_some(),
        "the engine's adapters were not discovered"
    );
    let url = gw.url("/v1/chat/completions");
    let ask = |model: String| json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    // Every kind of answer once, so the series that exist have all been created.
    assert_eq!(post(&c, &url, &ask(MODEL.into())).await.status, 200);
    assert_eq!(post(&c, &url, &ask("card-lora-0".into())).await.status, 200);
    assert_eq!(post(&c, &url, &ask("nobody".into())).await.status, 404);
    let before = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    for i in 0..ADAPTERS {
        for _ in 0..2 {
            let r = post(&c, &url, &ask(format!("card-lora-{i}"))).await;
            assert_eq!(r.status, 200, "{}", r.text);
        }
        let r = post(&c, &url, &ask(format!("card-lora-{i}-unknown"))).await;
        assert_eq!(r.status, 404);
        let r = post(&c, &url, &ask(format!("other-model-{i}"))).await;
        assert_eq!(r.status, 404);
        let snap = get_with(
            &c,
            &gw.url("/dashboard/snapshot"),
            &[("authorization", "Bearer t")],
        )
        .await;
        assert_eq!(snap.status, 200);
    }
    let after = get_with(&c, &gw.url("/metrics"), &[]).await.text;
    let (b, a) = (series(&before), series(&after));
    assert_eq!(
        a.len(),
        b.len(),
        "series grew with adapters and models requested"
    );
    for line in &a {
        for leaked in ["card-lora-", "other-model-", "nobody"] {
            assert!(!line.contains(leaked), "a model name in a label: {line}");
        }
    }
}
