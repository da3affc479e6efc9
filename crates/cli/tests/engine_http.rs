//! `switchyard engine` over HTTP: completions and chat (streamed and not),
//! usage with cached tokens, models and adapters, metrics, tokenization,
//! render endpoints, SGLang worker endpoints, instant mode, abort on
//! disconnect.

mod engine_support;
mod support;

use std::time::Duration;

use engine_support::*;
use serde_json::{json, Value};

const MODEL: &str = "test-model";

fn start() -> Emulator {
    Emulator::start(&[
        "--model",
        MODEL,
        "--speed",
        "100",
        "--lora-modules",
        "sql-lora=/adapters/sql",
        "--max-loras",
        "2",
    ])
}

#[tokio::test]
async fn completion_non_streaming_and_cached_tokens() {
    let emu = start();
    let c = client();
    let p = prompt("cache-test", 200);
    let body = json!({"model": MODEL, "prompt": p, "max_tokens": 5});
    let (s, v) = post_json(&c, &emu.url("/v1/completions"), &body).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], MODEL);
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["choices"][0]["text"].is_string());
    assert_eq!(v["usage"]["prompt_tokens"], 200);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], 205);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let (s, v) = post_json(&c, &emu.url("/v1/completions"), &body).await;
    assert_eq!(s, 200);
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= 128,
        "second identical prompt should hit the cache: {v}"
    );
    assert!(cached <= 200);
}

#[tokio::test]
async fn completion_streaming_with_usage() {
    let emu = start();
    let c = client();
    let body = json!({"model": MODEL, "prompt": prompt("stream", 40), "max_tokens": 6,
                      "stream": true, "stream_options": {"include_usage": true}});
    let r = c
        .post(emu.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let chunks = sse_chunks(&r.text().await.unwrap());
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    assert_eq!(usage["usage"]["prompt_tokens"], 40);
    assert!(usage["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    let finish: Vec<&Value> = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");
    for ch in &chunks[..chunks.len() - 1] {
        assert_eq!(ch["object"], "text_completion");
        assert!(ch.get("usage").is_none());
    }
}

#[tokio::test]
async fn chat_non_streaming_and_streaming() {
    let emu = start();
    let c = client();
    let msgs = json!([{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "hello there"}]);
    let (s, v) = post_json(
        &c,
        &emu.url("/v1/chat/completions"),
        &json!({"model": MODEL, "messages": msgs, "max_completion_tokens": 4}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["choices"][0]["message"]["content"].is_string());
    assert_eq!(v["usage"]["completion_tokens"], 4);

    // The prompt is the documented template, tokenized in 4-byte chunks.
    let (_, t) = post_json(
        &c,
        &emu.url("/tokenize"),
        &json!({"model": MODEL, "messages": msgs}),
    )
    .await;
    assert_eq!(v["usage"]["prompt_tokens"], t["count"]);

    let r = c
        .post(emu.url("/v1/chat/completions"))
        .json(
            &json!({"model": MODEL, "messages": msgs, "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let chunks = sse_chunks(&r.text().await.unwrap());
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let last = chunks.last().unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 3);
    assert!(last["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .is_some());
}

#[tokio::test]
async fn chat_default_max_tokens_is_remaining_context() {
    let emu = Emulator::start(&["--model", MODEL, "--speed", "1000", "--max-model-len", "64"]);
    let c = client();
    let (s, v) = post_json(
        &c,
        &emu.url("/v1/chat/completions"),
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap(), 64 - p);
}

#[tokio::test]
async fn models_and_adapters() {
    let emu = start();
    let c = client();
    let (s, t) = get_text(&c, &emu.url("/v1/models")).await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data[0]["id"], MODEL);
    assert_eq!(data[0]["root"], MODEL);
    assert!(data[0]["parent"].is_null());
    let lora = data.iter().find(|m| m["id"] == "sql-lora").unwrap();
    assert_eq!(lora["root"], "/adapters/sql");
    assert_eq!(lora["parent"], MODEL);

    // Load a new adapter, use it, list it, unload it.
    let r = c
        .post(emu.url("/v1/load_lora_adapter"))
        .json(&json!({"lora_name": "new-lora", "lora_path": "/adapters/new"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (s, v) = post_json(
        &c,
        &emu.url("/v1/completions"),
        &json!({"model": "new-lora", "prompt": "adapter prompt", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["model"], "new-lora");
    let (_, t) = get_text(&c, &emu.url("/v1/models")).await;
    assert!(t.contains("\"new-lora\""));
    let r = c
        .post(emu.url("/v1/unload_lora_adapter"))
        .json(&json!({"lora_name": "new-lora"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (_, t) = get_text(&c, &emu.url("/v1/models")).await;
    assert!(!t.contains("\"new-lora\""));
    let (s, _) = post_json(
        &c,
        &emu.url("/v1/completions"),
        &json!({"model": "new-lora", "prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn metrics_present_and_changing() {
    let emu = start();
    let c = client();
    let (s, before) = get_text(&c, &emu.url("/metrics")).await;
    assert_eq!(s, 200);
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:lora_requests_info",
        "vllm:cache_config_info",
    ] {
        assert!(before.contains(name), "missing {name}");
    }
    assert!(before.contains("model_name=\"test-model\""));
    assert!(before.contains("engine=\"0\""));
    assert!(before.contains("max_lora=\"2\""));
    let p0 = metric_value(&before, "vllm:prompt_tokens_total").unwrap();
    let (s, _) = post_json(
        &c,
        &emu.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": prompt("metrics", 64), "max_tokens": 3}),
    )
    .await;
    assert_eq!(s, 200);
    let (_, after) = get_text(&c, &emu.url("/metrics")).await;
    let p1 = metric_value(&after, "vllm:prompt_tokens_total").unwrap();
    assert!(p1 >= p0 + 64.0, "{p0} -> {p1}");
    let g = metric_value(&after, "vllm:generation_tokens_total").unwrap();
    assert!(g >= 3.0);
    for name in [
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
    ] {
        let v = metric_value(&after, name).unwrap_or(0.0);
        assert!(v >= 1.0, "{name} = {v}");
    }
}

#[tokio::test]
async fn tokenize_detokenize_and_render() {
    let emu = start();
    let c = client();
    let (s, v) = post_json(
        &c,
        &emu.url("/tokenize"),
        &json!({"model": MODEL, "prompt": "abcdefghij"}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["count"], 3);
    assert_eq!(v["tokens"].as_array().unwrap().len(), 3);
    assert!(v["max_model_len"].as_u64().unwrap() > 0);
    let (s, d) = post_json(
        &c,
        &emu.url("/detokenize"),
        &json!({"model": MODEL, "tokens": v["tokens"]}),
    )
    .await;
    assert_eq!(s, 200);
    assert!(d["prompt"].is_string());

    let (s, r) = post_json(
        &c,
        &emu.url("/v1/completions/render"),
        &json!({"model": MODEL, "prompt": "abcdefghij"}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(r[0]["token_ids"], v["tokens"]);
    assert!(r[0]["request_id"].as_str().unwrap().starts_with("cmpl-"));
    let (s, r) = post_json(
        &c,
        &emu.url("/v1/chat/completions/render"),
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(s, 200);
    let (_, t) = post_json(
        &c,
        &emu.url("/tokenize"),
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r["token_ids"], t["tokens"]);
}

#[tokio::test]
async fn sglang_worker_endpoints() {
    let emu = start();
    let c = client();
    for path in ["/health", "/health_generate"] {
        let (s, _) = get_text(&c, &emu.url(path)).await;
        assert_eq!(s, 200, "{path}");
    }
    for path in ["/get_server_info", "/server_info"] {
        let (s, t) = get_text(&c, &emu.url(path)).await;
        assert_eq!(s, 200);
        let v: Value = serde_json::from_str(&t).unwrap();
        assert_eq!(v["model_path"], MODEL);
        assert_eq!(v["dp_size"], 1);
        assert!(v["max_total_num_tokens"].as_u64().unwrap() > 0);
    }
    let (s, t) = get_text(&c, &emu.url("/get_model_info")).await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(v["is_generation"], true);
    let (s, t) = get_text(&c, &emu.url("/get_load")).await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&t).unwrap();
    assert!(v["load"].is_u64());
}

#[tokio::test]
async fn instant_mode_answers_at_once() {
    let emu = Emulator::start(&["--model", MODEL, "--instant"]);
    let c = client();
    let (s, v) = post_json(
        &c,
        &emu.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": prompt("instant", 100), "max_tokens": 500}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["usage"]["completion_tokens"], 500);
    assert_eq!(v["usage"]["prompt_tokens"], 100);
    let r = c
        .post(emu.url("/v1/chat/completions"))
        .json(
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                      "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    let chunks = sse_chunks(&r.text().await.unwrap());
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 5);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
}

#[tokio::test]
async fn client_disconnect_aborts_the_request() {
    // Real time, long output: the request would run for minutes.
    let emu = Emulator::start(&["--model", MODEL, "--speed", "1"]);
    let c = client();
    let mut r = c
        .post(emu.url("/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt("abort", 32), "max_tokens": 4000, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap();
    assert!(first.is_some());
    let running = |text: &str| metric_value(text, "vllm:num_requests_running").unwrap_or(-1.0);
    let (_, m) = get_text(&c, &emu.url("/metrics")).await;
    assert_eq!(running(&m), 1.0);
    drop(r);
    let idle = poll(Duration::from_secs(20), || {
        let c = c.clone();
        let url = emu.url("/metrics");
        async move {
            let (_, m) = get_text(&c, &url).await;
            (running(&m) == 0.0).then_some(())
        }
    })
    .await;
    assert!(
        idle.is_some(),
        "request still running after the client left"
    );
}

#[cfg(unix)]
#[test]
fn sigterm_and_sigint_shut_down_cleanly() {
    for sig in ["-TERM", "-INT"] {
        let mut emu = Emulator::start(&["--model", MODEL]);
        let status = std::process::Command::new("kill")
            .args([sig, &emu.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
        let exit = emu.wait_exit(Duration::from_secs(10)).expect("exited");
        assert_eq!(exit, 0, "{sig}");
    }
}
