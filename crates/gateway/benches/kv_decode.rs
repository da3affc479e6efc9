//! Cost of decoding one KV event batch as vLLM publishes it (`kv_events::wire`), per layout:
//! one engine step's `BlockStored` of 16 blocks of 16 tokens plus a `BlockRemoved` of 16 blocks.

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

criterion_group!(benches, batches);
criterion_main!(benches);
