//! KV events over ZeroMQ in vLLM's format: a SUB socket receives
//! `[topic, seq, msgpack batch]` with a `BlockStored` event after a request.

mod engine_support;
mod support;

use std::time::{Duration, Instant};

use engine_support::*;
use rmpv::Value as Mp;
use serde_json::json;
use zeromq::{Socket, SocketRecv};

const MODEL: &str = "kv-model";

/// Decode one multipart message; returns (seq, event tags) of the batch.
fn decode(msg: zeromq::ZmqMessage) -> (u64, Vec<Mp>) {
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "multipart [topic, seq, payload]");
    assert_eq!(frames[1].len(), 8, "seq is 8 bytes");
    let seq = u64::from_be_bytes(frames[1][..].try_into().unwrap());
    let batch = rmpv::decode::read_value(&mut &frames[2][..]).expect("msgpack");
    let arr = batch.as_array().expect("batch is an array");
    assert!(arr[0].as_f64().is_some(), "ts");
    assert_eq!(arr[2].as_u64(), Some(0), "data_parallel_rank");
    (seq, arr[1].as_array().expect("events").clone())
}

async fn expect_block_stored(sub: &mut zeromq::SubSocket, emu: &Emulator) {
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut i = 0;
    // A PUB socket drops messages until the subscription has propagated, so
    // keep sending fresh prompts until an event arrives.
    while Instant::now() < deadline {
        i += 1;
        let (s, _) = post_json(
            &c,
            &emu.url("/v1/completions"),
            &json!({"model": MODEL, "prompt": prompt(&format!("kv-{i}"), 64), "max_tokens": 1}),
        )
        .await;
        assert_eq!(s, 200);
        if let Ok(Ok(msg)) = tokio::time::timeout(Duration::from_millis(500), sub.recv()).await {
            let (_seq, events) = decode(msg);
            let stored = events
                .iter()
                .filter_map(|e| e.as_array())
                .find(|e| e[0].as_str() == Some("BlockStored"))
                .expect("a BlockStored event");
            assert!(!stored[1].as_array().unwrap().is_empty(), "block_hashes");
            assert!(!stored[3].as_array().unwrap().is_empty(), "token_ids");
            assert_eq!(stored[4].as_u64(), Some(16), "block_size");
            assert_eq!(stored[6].as_str(), Some("GPU"), "medium");
            return;
        }
    }
    panic!("no BlockStored event within the deadline");
}

#[tokio::test]
async fn subscriber_receives_block_stored_when_emulator_binds() {
    let emu = Emulator::start_publishing(MODEL);
    let ep = emu.kv_endpoint.clone().expect("kv-events line");
    let mut sub = zeromq::SubSocket::new();
    sub.subscribe("").await.unwrap();
    sub.connect(&ep).await.unwrap();
    expect_block_stored(&mut sub, &emu).await;
}

// Multi-threaded: the SUB socket must accept while this thread blocks in
// `Emulator::start`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulator_connects_to_a_binding_subscriber() {
    let mut sub = zeromq::SubSocket::new();
    sub.subscribe("").await.unwrap();
    let ep = sub.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let emu = Emulator::start(&[
        "--model",
        MODEL,
        "--speed",
        "100",
        "--kv-events-endpoint",
        &ep,
    ]);
    expect_block_stored(&mut sub, &emu).await;
}
