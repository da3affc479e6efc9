//! Model names through `switchyard serve` in front of real `switchyard engine` processes (which,
//! like vLLM, refuse a `model` they do not serve): the single-model fallback and
//! `--strict-models`, `--model-alias` to a base model and to an adapter in a two-model fleet,
//! `/v1/models` listing aliases, and fleet file `model_aliases` applied on reload.

mod gateway_support;
mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use gateway_support::*;
use serde_json::{json, Value};

/// The second engine's model.
const OTHER: &str = "gw-other-model";

/// `switchyard engine` serving `model` at 100x speed, with `extra` flags.
fn engine_serving(model: &str, extra: &[&str]) -> Proc {
    let mut args: Vec<String> = [
        "engine",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--speed",
        "100",
        "--model",
        model,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::start(&args)
}

fn chat_as(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
}

async fn listed(c: &reqwest::Client, gw: &Proc) -> Vec<Value> {
    let r = get_with(c, &gw.url("/v1/models"), &[]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json()["data"].as_array().cloned().unwrap_or_default()
}

#[tokio::test]
async fn a_single_model_fleet_serves_any_name_unless_strict() {
    let e = engine(&[]);
    let gw = gateway(&["--backend", &backend(&e)]);
    let strict = gateway(&["--backend", &backend(&e), "--strict-models"]);
    let c = client();

    // The engine itself refuses the name: the gateway must send the one it serves.
    let direct = post(&c, &e.url("/v1/chat/completions"), &chat_as("gpt-4o-mini")).await;
    assert_eq!(direct.status, 404, "{}", direct.text);

    let r = post(&c, &gw.url("/v1/chat/completions"), &chat_as("gpt-4o-mini")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["model"], MODEL);
    // Streamed and on completions too (the usage the gateway asks for is added to the rewritten
    // body and removed again).
    let body = json!({"model": "anything", "prompt": "x", "max_tokens": 3, "stream": true});
    let r = post(&c, &gw.url("/v1/completions"), &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let chunks = sse_chunks(&r.text);
    assert!(chunks.iter().all(|c| c["model"] == MODEL), "{}", r.text);
    assert!(
        chunks
            .iter()
            .all(|c| c.get("usage").is_none_or(|u| u.is_null())),
        "{}",
        r.text
    );
    // The served name still works, and only it is listed.
    let r = post(&c, &gw.url("/v1/chat/completions"), &chat_as(MODEL)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let models = listed(&c, &gw).await;
    assert_eq!(models.len(), 1, "{models:?}");

    // --strict-models keeps the 404.
    let r = post(
        &c,
        &strict.url("/v1/chat/completions"),
        &chat_as("gpt-4o-mini"),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    let r = post(&c, &strict.url("/v1/chat/completions"), &chat_as(MODEL)).await;
    assert_eq!(r.status, 200, "{}", r.text);
}

#[tokio::test]
async fn aliases_route_in_a_two_model_fleet() {
    let base = engine_serving(MODEL, &["--lora-modules", "sql-lora=/adapters/sql"]);
    let other = engine_serving(OTHER, &[]);
    let gw = gateway(&[
        "--backend",
        &format!("{},models={MODEL},adapters=sql-lora", base.base),
        "--backend",
        &format!("{},models={OTHER}", other.base),
        "--model-alias",
        &format!("gpt-4o={OTHER}"),
        "--model-alias",
        "sql=sql-lora",
        "--model-alias",
        "broken=nowhere",
        "--debug-header",
    ]);
    let c = client();
    let url = gw.url("/v1/chat/completions");

    for _ in 0..3 {
        let r = post(&c, &url, &chat_as("gpt-4o")).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(
            r.header("x-switchyard-backend").as_deref(),
            Some(other.authority().as_str())
        );
        assert_eq!(r.json()["model"], OTHER);
    }
    // An alias of an adapter: the adapter's holder, asked for the adapter.
    let r = post(&c, &url, &chat_as("sql")).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(
        r.header("x-switchyard-backend").as_deref(),
        Some(base.authority().as_str())
    );
    assert_eq!(r.json()["model"], "sql-lora");
    // The served names are untouched.
    let r = post(&c, &url, &chat_as(MODEL)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["model"], MODEL);

    // Two models: an unknown name is not guessed.
    let r = post(&c, &url, &chat_as("gpt-3.5")).await;
    assert_eq!(r.status, 404, "{}", r.text);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    // An alias of a model nobody serves names both.
    let r = post(&c, &url, &chat_as("broken")).await;
    assert_eq!(r.status, 404, "{}", r.text);
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        message.contains("`broken`") && message.contains("`nowhere`"),
        "{message}"
    );

    // /v1/models: the aliases that resolve, with their target as `root`.
    let models = listed(&c, &gw).await;
    let card = |id: &str| models.iter().find(|m| m["id"] == id).cloned();
    let gpt = card("gpt-4o").expect("alias listed");
    assert_eq!(
        (&gpt["root"], &gpt["parent"]),
        (&json!(OTHER), &Value::Null)
    );
    let sql = card("sql").expect("adapter alias listed");
    assert_eq!(
        (&sql["root"], &sql["parent"]),
        (&json!("sql-lora"), &json!(MODEL))
    );
    assert!(card("broken").is_none(), "{models:?}");
    assert_eq!(card(MODEL).expect("base listed")["root"], MODEL);
}

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
fn write_file(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn fleet_file_aliases_are_merged_and_reloaded() {
    let base = engine(&[]);
    let other = engine_serving(OTHER, &[]);
    let dir = temp_dir("aliases");
    let file = dir.join("fleet.yaml");
    let fleet = |aliases: &str| {
        format!(
            "backends:\n  - address: {}\n    models: [{OTHER}]\nmodel_aliases:\n{aliases}",
            other.base
        )
    };
    write_file(&file, &fleet(&format!("  fast: {OTHER}\n")));
    let gw = gateway(&[
        "--backend",
        &backend(&base),
        "--fleet-file",
        file.to_str().unwrap(),
        "--model-alias",
        &format!("default={MODEL}"),
    ]);
    let c = client();
    let url = gw.url("/v1/chat/completions");
    let status = |model: &'static str| {
        let (c, url) = (c.clone(), url.clone());
        async move { post(&c, &url, &chat_as(model)).await }
    };

    // The file's alias and the flag's, together.
    let r = poll(Duration::from_secs(10), || async {
        let r = status("fast").await;
        (r.status == 200).then_some(r)
    })
    .await
    .expect("the file's alias works");
    assert_eq!(r.json()["model"], OTHER);
    let r = status("default").await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["model"], MODEL);

    // A reload replaces the file's aliases; the flag's stay.
    write_file(&file, &fleet(&format!("  quick: {OTHER}\n")));
    let r = poll(Duration::from_secs(10), || async {
        let r = status("quick").await;
        (r.status == 200).then_some(r)
    })
    .await
    .expect("the reloaded alias works");
    assert_eq!(r.json()["model"], OTHER);
    assert_eq!(status("fast").await.status, 404);
    assert_eq!(status("default").await.status, 200);

    // A file alias that contradicts a flag is refused: the reload fails and changes nothing.
    write_file(&file, &fleet(&format!("  default: {OTHER}\n")));
    let failed = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        (metric_sum(&m, "switchyard_fleet_reloads_total", &["result=\"error\""]) >= 1.0)
            .then_some(())
    })
    .await;
    assert!(failed.is_some());
    let r = status("default").await;
    assert_eq!(r.json()["model"], MODEL, "{}", r.text);
    assert_eq!(status("quick").await.status, 200);
    let _ = std::fs::remove_dir_all(dir);
}
