//! `switchyard engine` error answers: vLLM's `{"error": {...}}` shape with the
//! right status, and the server keeps serving afterwards.

mod engine_support;
mod support;

use engine_support::*;
use serde_json::{json, Value};

const MODEL: &str = "err-model";

fn assert_error(status: u16, body: &Value, want: u16) {
    assert_eq!(status, want, "{body}");
    let e = &body["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e["type"].is_string(), "{body}");
    assert!(e.get("param").is_some(), "{body}");
    assert_eq!(e["code"], want, "{body}");
}

#[tokio::test]
async fn every_error_case() {
    let emu = Emulator::start(&[
        "--model",
        MODEL,
        "--speed",
        "100",
        "--max-model-len",
        "256",
        "--max-body-bytes",
        "100000",
        "--lora-modules",
        "known=/a/known",
    ]);
    let c = client();
    let comp = emu.url("/v1/completions");
    let chat = emu.url("/v1/chat/completions");

    // Malformed JSON.
    for url in [&comp, &chat] {
        let (s, v) = post_raw(&c, url, "{\"model\": ").await;
        assert_error(s, &v, 400);
        assert_eq!(v["error"]["type"], "BadRequestError");
    }
    // Wrong types.
    let (s, v) = post_raw(
        &c,
        &comp,
        r#"{"model":"err-model","prompt":"x","max_tokens":"many"}"#,
    )
    .await;
    assert_error(s, &v, 400);
    // Missing model.
    let (s, v) = post_json(&c, &comp, &json!({"prompt": "x"})).await;
    assert_error(s, &v, 400);
    assert_eq!(v["error"]["param"], "model");
    let (s, v) = post_json(
        &c,
        &chat,
        &json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_error(s, &v, 400);
    // Unknown model and unknown adapter.
    let (s, v) = post_json(&c, &comp, &json!({"model": "other-model", "prompt": "x"})).await;
    assert_error(s, &v, 404);
    assert_eq!(v["error"]["type"], "NotFoundError");
    let (s, v) = post_json(
        &c,
        &chat,
        &json!({"model": "unknown-lora", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_error(s, &v, 404);
    // max_tokens beyond the context.
    let (s, v) = post_json(
        &c,
        &comp,
        &json!({"model": MODEL, "prompt": "x", "max_tokens": 1000}),
    )
    .await;
    assert_error(s, &v, 400);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length"));
    let (s, v) = post_json(
        &c,
        &chat,
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000}),
    )
    .await;
    assert_error(s, &v, 400);
    // Prompt alone longer than the context.
    let (s, v) = post_json(
        &c,
        &comp,
        &json!({"model": MODEL, "prompt": prompt("long", 300), "max_tokens": 1}),
    )
    .await;
    assert_error(s, &v, 400);
    // Wrong role, missing and empty messages.
    let (s, v) = post_json(
        &c,
        &chat,
        &json!({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}),
    )
    .await;
    assert_error(s, &v, 400);
    let (s, v) = post_json(&c, &chat, &json!({"model": MODEL})).await;
    assert_error(s, &v, 400);
    let (s, v) = post_json(&c, &chat, &json!({"model": MODEL, "messages": []})).await;
    assert_error(s, &v, 400);
    // Missing prompt, zero max_tokens, n > 1.
    let (s, v) = post_json(&c, &comp, &json!({"model": MODEL})).await;
    assert_error(s, &v, 400);
    let (s, v) = post_json(
        &c,
        &comp,
        &json!({"model": MODEL, "prompt": "x", "max_tokens": 0}),
    )
    .await;
    assert_error(s, &v, 400);
    let (s, v) = post_json(&c, &comp, &json!({"model": MODEL, "prompt": "x", "n": 2})).await;
    assert_error(s, &v, 400);
    // stream_options without stream (vLLM refuses it).
    let (s, v) = post_json(
        &c,
        &comp,
        &json!({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_error(s, &v, 400);
    // Bad PD parameters.
    let (s, v) = post_json(
        &c,
        &comp,
        &json!({"model": MODEL, "prompt": "x", "kv_transfer_params": "yes"}),
    )
    .await;
    assert_error(s, &v, 400);
    // Body too large.
    let big = json!({"model": MODEL, "prompt": "y".repeat(200_000)});
    let (s, v) = post_json(&c, &comp, &big).await;
    assert_error(s, &v, 413);
    // The server closes a connection whose oversized body it did not read; a pooled client
    // could pick that connection up again before noticing, so start afresh.
    let c = client();
    // Unknown route.
    let (s, t) = get_text(&c, &emu.url("/v1/nothing")).await;
    assert_error(s, &serde_json::from_str(&t).unwrap(), 404);
    // Adapter management errors.
    let (s, v) = post_json(
        &c,
        &emu.url("/v1/unload_lora_adapter"),
        &json!({"lora_name": "ghost"}),
    )
    .await;
    assert_error(s, &v, 404);
    let (s, v) = post_json(
        &c,
        &emu.url("/v1/load_lora_adapter"),
        &json!({"lora_name": "known", "lora_path": "/a/known"}),
    )
    .await;
    assert_error(s, &v, 400);
    let (s, v) = post_json(
        &c,
        &emu.url("/v1/load_lora_adapter"),
        &json!({"lora_name": "x"}),
    )
    .await;
    assert_error(s, &v, 400);

    // Still healthy and serving.
    let (s, _) = get_text(&c, &emu.url("/health")).await;
    assert_eq!(s, 200);
    let (s, v) = post_json(
        &c,
        &comp,
        &json!({"model": MODEL, "prompt": "fine", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
}
