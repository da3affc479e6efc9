//! The gateway's metrics follow Prometheus' naming conventions and stay bounded: what a client
//! chooses (model names, session ids, request ids, paths, prompts) never becomes a label value,
//! so a client cannot grow the series count.

mod gateway_support;

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
