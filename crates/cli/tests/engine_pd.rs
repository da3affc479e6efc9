//! Disaggregated prefill/decode through two emulators, the way vLLM's
//! NixlConnector proxies do it: prefill with `do_remote_decode`, then send
//! the returned `kv_transfer_params` with the original request to decode.

mod engine_support;
mod support;

use engine_support::*;
use serde_json::json;

const MODEL: &str = "pd-model";

#[tokio::test]
async fn prefill_then_decode_round_trip() {
    let prefill = Emulator::start(&["--model", MODEL, "--role", "prefill", "--speed", "100"]);
    let decode = Emulator::start(&["--model", MODEL, "--role", "decode", "--speed", "100"]);
    let c = client();
    let p = prompt("pd", 100);

    let (s, v) = post_json(
        &c,
        &prefill.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": p, "max_tokens": 1, "stream": false,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                    "remote_engine_id": null, "remote_block_ids": null,
                    "remote_host": null, "remote_port": null}}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let kv = v["kv_transfer_params"].clone();
    assert_eq!(kv["do_remote_prefill"], true, "{v}");
    assert_eq!(kv["do_remote_decode"], false);
    assert!(
        kv["remote_block_ids"]
            .as_array()
            .is_some_and(|b| !b.is_empty()),
        "{kv}"
    );
    assert!(kv["remote_engine_id"]
        .as_str()
        .is_some_and(|e| !e.is_empty()));
    assert!(kv["remote_request_id"].is_string());
    assert_eq!(kv["remote_host"], "127.0.0.1");
    assert!(kv["remote_port"].as_u64().is_some());
    assert_eq!(kv["tp_size"], 1);
    assert_eq!(v["usage"]["prompt_tokens"], 100);

    // Decode leg: original request plus the hand-off; streamed this time.
    let r = c
        .post(decode.url("/v1/completions"))
        .json(
            &json!({"model": MODEL, "prompt": p, "max_tokens": 8, "stream": true,
                      "stream_options": {"include_usage": true}, "kv_transfer_params": kv}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let chunks = sse_chunks(&r.text().await.unwrap());
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 8);
    assert_eq!(usage["prompt_tokens"], 100);

    // Chat through the same path works as well.
    let msgs = json!([{"role": "user", "content": p}]);
    let (s, v) = post_json(
        &c,
        &prefill.url("/v1/chat/completions"),
        &json!({"model": MODEL, "messages": msgs, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let kv = v["kv_transfer_params"].clone();
    let (s, v) = post_json(
        &c,
        &decode.url("/v1/chat/completions"),
        &json!({"model": MODEL, "messages": msgs, "max_tokens": 4, "kv_transfer_params": kv}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert!(v["kv_transfer_params"].is_null());
}

#[tokio::test]
async fn sglang_bootstrap_fields_are_accepted() {
    let prefill = Emulator::start(&["--model", MODEL, "--role", "prefill", "--speed", "100"]);
    let decode = Emulator::start(&["--model", MODEL, "--role", "decode", "--speed", "100"]);
    let c = client();
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                      "max_tokens": 4, "bootstrap_host": "127.0.0.1",
                      "bootstrap_port": 8998, "bootstrap_room": 1234567u64});
    let (pu, du) = (
        prefill.url("/v1/chat/completions"),
        decode.url("/v1/chat/completions"),
    );
    let (pr, dr) = tokio::join!(post_json(&c, &pu, &body), post_json(&c, &du, &body));
    assert_eq!(pr.0, 200, "{}", pr.1);
    assert_eq!(dr.0, 200, "{}", dr.1);
    assert_eq!(dr.1["usage"]["completion_tokens"], 4);
}
