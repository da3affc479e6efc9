//! Engines' KV-event messages (vLLM's msgpack batches, positional or tagged, in ZMQ frames, live
//! or replayed): any bytes give a batch, an end marker or an error, never a panic or an
//! unbounded allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use switchyard_gateway::kv_events::wire::{decode_message, decode_payload, decode_replay};

fuzz_target!(|data: &[u8]| {
    let _ = decode_payload(data);
    // The same bytes as a multipart message: topic, 8-byte sequence, payload.
    if data.len() >= 9 {
        let (head, payload) = data.split_at(9);
        let _ = decode_message(&[&head[..1], &head[1..], payload]);
        // As a replay reply: the empty delimiter, topic, sequence, payload (the end marker when
        // the sequence is all ones).
        let _ = decode_replay(&[&[][..], &head[..1], &head[1..], payload]);
    }
});
