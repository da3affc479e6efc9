//! Cost of the exact index's inputs: decoding one KV event batch as vLLM publishes it
//! (`kv_events::wire`), per layout (one engine step's `BlockStored` of 16 blocks of 16 tokens
//! plus a `BlockRemoved` of 16 blocks), and tokenizing a 1,000-token text prompt with the
//! emulator's tokenizer.json (`tokenize`).

use criterion::{criterion_group, criterion_main, Criterion};
use switchyard_emulator::kv_events::{encode_batch, Format, WireEvent};
use switchyard_engine::KvEvent;
use switchyard_gateway::kv_events::wire::decode_message;

fn batches(c: &mut Criterion) {
    let stored = KvEvent::BlockStored {
        block_hashes: (0..16)
            .map(|i| 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i + 1))
            .collect(),
        parent_block_hash: Some(7),
        token_ids: (0..256).map(|t| 1000 + t * 37).collect(),
        block_size: 16,
        lora_name: None,
    };
    let removed = KvEvent::BlockRemoved {
        block_hashes: (100..116).collect(),
    };
    let wire = [
        WireEvent {
            event: &stored,
            lora_id: None,
        },
        WireEvent {
            event: &removed,
            lora_id: None,
        },
    ];
    for format in [Format::Array, Format::Map] {
        let frames = [
            Vec::new(),
            41u64.to_be_bytes().to_vec(),
            encode_batch(1.7e9, &wire, 0, format),
        ];
        c.bench_function(
            &format!("decode_batch_{format:?}_{}B", frames[2].len()),
            |b| b.iter(|| decode_message(std::hint::black_box(&frames)).map(|b| b.events.len())),
        );
    }
}

fn tokenize(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, switchyard_emulator::tokenizer_json::tokenizer_json()).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        switchyard_emulator::tokenizer_json::tokenizer_config_json(),
    )
    .unwrap();
    let files = std::collections::BTreeMap::from([("m".to_string(), path)]);
    let tokenizers = switchyard_gateway::tokenize::Tokenizers::load(&files).unwrap();
    drop(dir);
    let words: Vec<&str> = switchyard_engine::tokenizer::vocabulary()
        .map(|(w, _)| w)
        .collect();
    let text = |n: usize| -> String { (0..n).map(|i| words[(i * 7) % words.len()]).collect() };
    for n in [1000, 2000, 32_000] {
        let prompt = text(n);
        c.bench_function(&format!("tokenize_{n}_tokens"), |b| {
            b.iter(|| {
                tokenizers
                    .token_ids("m", std::hint::black_box(&prompt))
                    .map(|ids| ids.len())
            })
        });
        // The same tokens as a conversation: a system prompt and three turns, rendered with
        // the chat template first.
        let (system, turn) = (text(n / 2), text(n / 6));
        let messages = [
            ("system", system.as_str()),
            ("user", turn.as_str()),
            ("assistant", turn.as_str()),
            ("user", turn.as_str()),
        ];
        c.bench_function(&format!("tokenize_chat_{n}_tokens"), |b| {
            b.iter(|| {
                tokenizers
                    .chat_token_ids("m", std::hint::black_box(&messages))
                    .map(|ids| ids.len())
            })
        });
    }
}

criterion_group!(benches, batches, tokenize);
criterion_main!(benches);
