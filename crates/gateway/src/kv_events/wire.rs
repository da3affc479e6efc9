//! vLLM's KV event wire format, decoded: a pure function from a ZeroMQ multipart message to the
//! core's [`KvEvent`]s and the message's sequence number.
//!
//! vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py) sends `[topic, seq, payload]`: `seq`
//! is an 8-byte big-endian counter, `payload` a msgpack `KVEventBatch`. Two layouts exist:
//! positional arrays (`array_like=True`, what vLLM sent until mid-2026: the batch
//! `[ts, [event, ...], data_parallel_rank]`, events `["BlockStored", block_hashes,
//! parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`, `["BlockRemoved",
//! block_hashes, medium]`, `["AllBlocksCleared"]`) and maps tagged by `"type"` (newer vLLM; the
//! batch may be a map `{ts, events, data_parallel_rank}` too). Both are accepted, in any mix.
//! SGLang publishes the same format (FIELD-NOTES documents no difference).
//!
//! Lenient where vLLM versions differ, strict where a wrong reading would corrupt the index:
//! trailing fields may be missing (older versions have no `medium` / `lora_name`), unknown event
//! types are skipped (newer versions may add some), block hashes may be integers (signed or not)
//! or bytes (vLLM's `ExternalBlockHash`, folded to 64 bits); an event whose required fields are
//! missing or of the wrong type fails the whole batch, so that the caller treats it like a lost
//! one instead of applying half of it. Events about another storage tier than the GPU (`medium`
//! `CPU`, `DISK`, …: KV offloading) are skipped: the prefix cache a request hits first is the GPU's.

use rmpv::Value;
use switchyard_core::KvEvent;
use thiserror::Error;

/// A decoded message: its sequence number, the batch's timestamp and its events.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// The publisher's sequence number (consecutive unless messages were lost).
    pub seq: u64,
    /// Wall-clock Unix time the batch was published, seconds, when it says.
    pub ts: Option<f64>,
    /// The events, in order.
    pub events: Vec<KvEvent>,
}

/// Why a message could not be decoded.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    /// Not `[topic, seq, payload]` (or `[seq, payload]`).
    #[error("expected 2 or 3 frames ([topic,] seq, payload), got {0}")]
    Frames(usize),
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame of {0} bytes, expected 8")]
    Seq(usize),
    /// The payload is not msgpack (or has bytes after the batch).
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    /// The payload is msgpack but not a batch of events.
    #[error("malformed batch: {0}")]
    Shape(String),
}

fn shape(why: impl Into<String>) -> DecodeError {
    DecodeError::Shape(why.into())
}

/// Decodes one multipart message (`[topic, seq, payload]`, or `[seq, payload]` from a publisher
/// without a topic frame).
pub fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<Batch, DecodeError> {
    let (seq, payload) = match frames {
        [_, seq, payload] | [seq, payload] => (seq.as_ref(), payload.as_ref()),
        _ => return Err(DecodeError::Frames(frames.len())),
    };
    let seq: [u8; 8] = seq.try_into().map_err(|_| DecodeError::Seq(seq.len()))?;
    let (ts, events) = decode_payload(payload)?;
    Ok(Batch {
        seq: u64::from_be_bytes(seq),
        ts,
        events,
    })
}

/// One reply from an engine's replay endpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum Replayed {
    /// A buffered batch.
    Batch(Batch),
    /// The end marker: nothing more follows.
    End,
}

/// The replay end marker's sequence frame: -1 as 8 signed big-endian bytes.
pub const REPLAY_END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Decodes one reply from a replay endpoint (vLLM's ROUTER, as a DEALER receives it):
/// `[b"", seq, payload]`, `[b"", topic, seq, payload]` (newer vLLM), or without the empty
/// delimiter (a REQ client's view); the end marker has sequence -1 and an empty payload.
pub fn decode_replay<F: AsRef<[u8]>>(frames: &[F]) -> Result<Replayed, DecodeError> {
    // Four frames: the delimiter, then a message as the PUB socket sends it.
    let frames = match frames {
        [delimiter, rest @ ..] if rest.len() == 3 && delimiter.as_ref().is_empty() => rest,
        _ => frames,
    };
    match frames {
        [_, seq, _] | [seq, _] if seq.as_ref() == REPLAY_END_SEQ => Ok(Replayed::End),
        _ => decode_message(frames).map(Replayed::Batch),
    }
}

/// Decodes a msgpack `KVEventBatch` (either layout): its timestamp and events.
pub fn decode_payload(payload: &[u8]) -> Result<(Option<f64>, Vec<KvEvent>), DecodeError> {
    let mut rest = payload;
    // rmpv bounds recursion and never preallocates from a length prefix, so hostile bytes
    // cost at most their own size.
    let value =
        rmpv::decode::read_value(&mut rest).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::Msgpack(format!(
            "{} bytes after the batch",
            rest.len()
        )));
    }
    let (ts, events) = match &value {
        Value::Array(fields) => (fields.first(), fields.get(1)),
        Value::Map(_) => (field(&value, "ts"), field(&value, "events")),
        _ => return Err(shape("the batch is neither an array nor a map")),
    };
    let ts = ts.and_then(Value::as_f64).filter(|t| t.is_finite());
    let events = events
        .and_then(Value::as_array)
        .ok_or_else(|| shape("no events array"))?;
    let mut out = Vec::with_capacity(events.len());
    for (i, event) in events.iter().enumerate() {
        if let Some(e) = decode_event(event).map_err(|e| shape(format!("event {i}: {e}")))? {
            out.push(e);
        }
    }
    Ok((ts, out))
}

/// A map's value under a string key.
fn field<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// The fields of one event, whichever layout it came in.
struct Fields<'a> {
    event: &'a Value,
    positional: bool,
}

impl<'a> Fields<'a> {
    /// The field at `index` in the array layout, named `name` in the map layout; nil counts as
    /// absent.
    fn get(&self, index: usize, name: &str) -> Option<&'a Value> {
        let v = if self.positional {
            self.event.as_array()?.get(index)
        } else {
            field(self.event, name)
        };
        v.filter(|v| !v.is_nil())
    }
}

fn decode_event(event: &Value) -> Result<Option<KvEvent>, String> {
    let (tag, positional) = match event {
        Value::Array(a) => (a.first().and_then(Value::as_str), true),
        Value::Map(_) => (field(event, "type").and_then(Value::as_str), false),
        _ => return Err("neither an array nor a map".into()),
    };
    let f = Fields { event, positional };
    let tag = tag.ok_or("no type tag")?;
    let gpu = |index: usize| match f.get(index, "medium") {
        None => true,
        Some(m) => m.as_str().is_some_and(|m| m.eq_ignore_ascii_case("GPU")),
    };
    Ok(match tag {
        "BlockStored" => {
            if !gpu(6) {
                return Ok(None);
            }
            let block_hashes = hashes(f.get(1, "block_hashes"))?;
            let parent_block_hash = f.get(2, "parent_block_hash").map(hash).transpose()?;
            let token_ids = f
                .get(3, "token_ids")
                .and_then(Value::as_array)
                .ok_or("token_ids is not an array")?
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or("a token id is not a u32")
                })
                .collect::<Result<Vec<u32>, _>>()?;
            let block_size = f
                .get(4, "block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .filter(|&b| b > 0)
                .ok_or("block_size is not a positive u32")?;
            if token_ids.len() < block_hashes.len() * block_size as usize {
                return Err(format!(
                    "{} token ids for {} blocks of {block_size}",
                    token_ids.len(),
                    block_hashes.len()
                ));
            }
            let lora_name = match (f.get(7, "lora_name"), f.get(5, "lora_id")) {
                (Some(name), _) => Some(name.as_str().ok_or("lora_name is not a string")?.into()),
                // An adapter known only by its id: its blocks must never match a base-model
                // prompt, so they get a name no request carries.
                (None, Some(id)) => Some(format!("#lora-id-{id}")),
                (None, None) => None,
            };
            Some(KvEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_name,
            })
        }
        "BlockRemoved" => {
            if !gpu(2) {
                return Ok(None);
            }
            Some(KvEvent::Removed {
                block_hashes: hashes(f.get(1, "block_hashes"))?,
            })
        }
        "AllBlocksCleared" => Some(KvEvent::AllCleared),
        // A newer kind of event: skipping it loses nothing the index uses.
        _ => None,
    })
}

fn hashes(v: Option<&Value>) -> Result<Vec<u64>, String> {
    v.and_then(Value::as_array)
        .ok_or("block_hashes is not an array")?
        .iter()
        .map(hash)
        .collect()
}

/// One engine block hash as 64 bits: an integer as it is (Python's signed hashes wrap), bytes
/// (vLLM's `ExternalBlockHash`, e.g. 32 bytes of SHA-256) folded by xxh3. Only equality
/// matters: the index keys blocks by its own hash of their tokens.
fn hash(v: &Value) -> Result<u64, String> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|s| s as u64))
            .ok_or_else(|| "a block hash is out of range".into()),
        Value::Binary(b) => Ok(xxhash_rust::xxh3::xxh3_64(b)),
        _ => Err("a block hash is neither an integer nor bytes".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn ints<T: Into<Value> + Copy>(xs: &[T]) -> Value {
        Value::Array(xs.iter().map(|&x| x.into()).collect())
    }

    fn encode(v: &Value) -> Vec<u8> {
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, v).unwrap();
        buf
    }

    fn frames(seq: u64, payload: Vec<u8>) -> Vec<Vec<u8>> {
        vec![b"kv".to_vec(), seq.to_be_bytes().to_vec(), payload]
    }

    fn map(pairs: Vec<(&str, Value)>) -> Value {
        Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    fn expected() -> Vec<KvEvent> {
        vec![
            KvEvent::Stored {
                block_hashes: vec![11, u64::MAX],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_name: None,
            },
            KvEvent::Stored {
                block_hashes: vec![12],
                parent_block_hash: Some(u64::MAX),
                token_ids: vec![5, 6],
                block_size: 2,
                lora_name: Some("sql".into()),
            },
            KvEvent::Removed {
                block_hashes: vec![11],
            },
            KvEvent::AllCleared,
        ]
    }

    #[test]
    fn positional_arrays_as_vllm_sends_them() {
        let batch = Value::Array(vec![
            Value::F64(1700000000.5),
            Value::Array(vec![
                Value::Array(vec![
                    s("BlockStored"),
                    ints(&[11u64, u64::MAX]),
                    Value::Nil,
                    ints(&[1u32, 2, 3, 4]),
                    Value::from(2),
                    Value::Nil,
                    s("GPU"),
                    Value::Nil,
                ]),
                Value::Array(vec![
                    s("BlockStored"),
                    ints(&[12u64]),
                    Value::from(u64::MAX),
                    ints(&[5u32, 6]),
                    Value::from(2),
                    Value::from(1),
                    s("GPU"),
                    s("sql"),
                ]),
                Value::Array(vec![s("BlockRemoved"), ints(&[11u64]), s("GPU")]),
                Value::Array(vec![s("AllBlocksCleared")]),
            ]),
            Value::from(0),
        ]);
        let b = decode_message(&frames(7, encode(&batch))).unwrap();
        assert_eq!(b.seq, 7);
        assert_eq!(b.ts, Some(1700000000.5));
        assert_eq!(b.events, expected());
    }

    #[test]
    fn tagged_maps_in_a_map_batch_and_an_array_batch() {
        let events = Value::Array(vec![
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", ints(&[11u64, u64::MAX])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", ints(&[1u32, 2, 3, 4])),
                ("block_size", Value::from(2)),
            ]),
            // Fields in another order, as a map allows.
            map(vec![
                ("lora_name", s("sql")),
                ("block_size", Value::from(2)),
                ("token_ids", ints(&[5u32, 6])),
                ("parent_block_hash", Value::from(u64::MAX)),
                ("block_hashes", ints(&[12u64])),
                ("type", s("BlockStored")),
                ("medium", s("GPU")),
            ]),
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", ints(&[11u64])),
            ]),
            map(vec![("type", s("AllBlocksCleared"))]),
        ]);
        let as_map = map(vec![
            ("ts", Value::F64(2.0)),
            ("events", events.clone()),
            ("data_parallel_rank", Value::from(0)),
        ]);
        let as_array = Value::Array(vec![Value::F64(2.0), events, Value::from(0)]);
        for batch in [as_map, as_array] {
            let b = decode_message(&[3u64.to_be_bytes().to_vec(), encode(&batch)]).unwrap();
            assert_eq!((b.seq, b.ts), (3, Some(2.0)));
            assert_eq!(b.events, expected());
        }
    }

    #[test]
    fn what_the_emulator_publishes_decodes_in_both_layouts() {
        use switchyard_emulator::kv_events::{encode_batch, Format, WireEvent};
        use switchyard_engine::KvEvent as EngineEvent;
        let stored = EngineEvent::BlockStored {
            block_hashes: vec![1, 2],
            parent_block_hash: Some(9),
            token_ids: (0..32).collect(),
            block_size: 16,
            lora_name: None,
        };
        let removed = EngineEvent::BlockRemoved {
            block_hashes: vec![1],
        };
        let cleared = EngineEvent::AllBlocksCleared;
        let wire: Vec<WireEvent<'_>> = [&stored, &removed, &cleared]
            .into_iter()
            .map(|event| WireEvent {
                event,
                lora_id: None,
            })
            .collect();
        for format in [Format::Array, Format::Map] {
            let (ts, events) = decode_payload(&encode_batch(5.0, &wire, 0, format)).unwrap();
            assert_eq!(ts, Some(5.0));
            assert_eq!(
                events,
                vec![
                    KvEvent::Stored {
                        block_hashes: vec![1, 2],
                        parent_block_hash: Some(9),
                        token_ids: (0..32).collect(),
                        block_size: 16,
                        lora_name: None,
                    },
                    KvEvent::Removed {
                        block_hashes: vec![1]
                    },
                    KvEvent::AllCleared,
                ],
                "{format:?}"
            );
        }
    }

    #[test]
    fn older_shorter_events_bytes_hashes_signed_hashes_and_other_tiers() {
        let digest = vec![7u8; 32];
        let batch = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![
                // No medium, no lora_name (older vLLM); an adapter known by id only.
                Value::Array(vec![
                    s("BlockStored"),
                    Value::Array(vec![Value::Binary(digest.clone())]),
                    Value::from(-5i64),
                    ints(&[1u32, 2]),
                    Value::from(2),
                    Value::from(3),
                ]),
                // An offloaded copy: not the GPU cache.
                Value::Array(vec![s("BlockRemoved"), ints(&[1u64]), s("CPU")]),
                Value::Array(vec![s("SomethingNew"), Value::from(1)]),
                Value::Array(vec![s("BlockRemoved"), ints(&[2u64])]),
            ]),
        ]);
        let (_, events) = decode_payload(&encode(&batch)).unwrap();
        assert_eq!(
            events,
            vec![
                KvEvent::Stored {
                    block_hashes: vec![xxhash_rust::xxh3::xxh3_64(&digest)],
                    parent_block_hash: Some(-5i64 as u64),
                    token_ids: vec![1, 2],
                    block_size: 2,
                    lora_name: Some("#lora-id-3".into()),
                },
                KvEvent::Removed {
                    block_hashes: vec![2]
                },
            ]
        );
    }

    #[test]
    fn bad_input_is_an_error_not_half_a_batch() {
        let ok_event = Value::Array(vec![s("AllBlocksCleared")]);
        let batch = |events: Vec<Value>| {
            encode(&Value::Array(vec![
                Value::F64(1.0),
                Value::Array(events),
                Value::from(0),
            ]))
        };
        let stored = |tokens: Value, size: Value| {
            Value::Array(vec![
                s("BlockStored"),
                ints(&[1u64]),
                Value::Nil,
                tokens,
                size,
            ])
        };
        let cases: Vec<(Vec<Vec<u8>>, &str)> = vec![
            (vec![b"only".to_vec()], "one frame"),
            (
                frames(0, vec![]).into_iter().chain([vec![]]).collect(),
                "four frames",
            ),
            (vec![b"t".to_vec(), vec![0; 4], batch(vec![])], "short seq"),
            (frames(0, vec![0xc1]), "0xc1 is never msgpack"),
            (frames(0, vec![0x92, 0x01]), "truncated array"),
            (
                frames(0, [batch(vec![]), vec![0]].concat()),
                "trailing bytes",
            ),
            (frames(0, encode(&Value::from(5))), "a number"),
            (
                frames(0, encode(&Value::Array(vec![Value::F64(1.0)]))),
                "no events",
            ),
            (
                frames(0, batch(vec![Value::from(1)])),
                "an event that is a number",
            ),
            (frames(0, batch(vec![Value::Array(vec![])])), "no tag"),
            (
                frames(
                    0,
                    batch(vec![
                        ok_event.clone(),
                        stored(ints(&[1u32]), Value::from(2)),
                    ]),
                ),
                "fewer tokens than blocks need",
            ),
            (
                frames(0, batch(vec![stored(ints(&[1u32, 2]), Value::from(0))])),
                "block size 0",
            ),
            (
                frames(0, batch(vec![stored(ints(&[-1i64, 2]), Value::from(2))])),
                "a negative token",
            ),
            (
                frames(0, batch(vec![stored(s("12"), Value::from(2))])),
                "tokens as a string",
            ),
            (
                frames(
                    0,
                    batch(vec![Value::Array(vec![s("BlockRemoved"), s("x")])]),
                ),
                "hashes as a string",
            ),
        ];
        for (message, why) in cases {
            assert!(decode_message(&message).is_err(), "{why}");
        }
        assert_eq!(
            decode_message(&frames(9, batch(vec![ok_event])))
                .unwrap()
                .events,
            vec![KvEvent::AllCleared]
        );
    }

    #[test]
    fn replay_replies_in_both_layouts_and_the_end_marker() {
        let payload = encode(&Value::Array(vec![
            Value::F64(3.0),
            Value::Array(vec![Value::Array(vec![s("AllBlocksCleared")])]),
            Value::from(0),
        ]));
        let seq = 41u64.to_be_bytes().to_vec();
        let want = Replayed::Batch(Batch {
            seq: 41,
            ts: Some(3.0),
            events: vec![KvEvent::AllCleared],
        });
        // Legacy `[b"", seq, payload]`, newer `[b"", topic, seq, payload]`, a REQ's `[seq, payload]`.
        for frames in [
            vec![vec![], seq.clone(), payload.clone()],
            vec![vec![], b"kv".to_vec(), seq.clone(), payload.clone()],
            vec![vec![], vec![], seq.clone(), payload.clone()],
            vec![seq.clone(), payload.clone()],
        ] {
            assert_eq!(decode_replay(&frames), Ok(want.clone()), "{frames:?}");
        }
        let end = REPLAY_END_SEQ.to_vec();
        assert_eq!(
            decode_replay(&[vec![], end.clone(), vec![]]),
            Ok(Replayed::End)
        );
        assert_eq!(
            decode_replay(&[vec![], b"kv".to_vec(), end.clone(), vec![]]),
            Ok(Replayed::End)
        );
        assert_eq!(REPLAY_END_SEQ, [0xff; 8]);
        let garbage: Vec<Vec<Vec<u8>>> = vec![
            vec![],
            vec![vec![]],
            vec![vec![], vec![1, 2, 3], payload.clone()],
            vec![vec![], seq.clone(), vec![0xc1]],
            vec![b"x".to_vec(), b"kv".to_vec(), seq.clone(), payload.clone()],
            vec![vec![], vec![], vec![], seq.clone(), payload],
        ];
        for frames in garbage {
            assert!(decode_replay(&frames).is_err(), "{frames:?}");
        }
    }

    proptest! {
        #[test]
        fn arbitrary_replay_frames_never_panic(
            frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..16), 0..6),
        ) {
            let _ = decode_replay(&frames);
        }

        #[test]
        fn arbitrary_bytes_never_panic(
            topic in proptest::collection::vec(any::<u8>(), 0..4),
            seq in proptest::collection::vec(any::<u8>(), 0..10),
            payload in proptest::collection::vec(any::<u8>(), 0..512),
        ) {
            let _ = decode_message(&[topic, seq, payload]);
        }

        #[test]
        fn mutated_valid_batches_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
            let mut payload = encode(&Value::Array(vec![
                Value::F64(1.0),
                Value::Array(vec![Value::Array(vec![
                    s("BlockStored"), ints(&[1u64, 2]), Value::from(3), ints(&[1u32, 2, 3, 4]), Value::from(2),
                ])]),
                Value::from(0),
            ]));
            for (at, byte) in flips {
                let at = at % payload.len();
                payload[at] = byte;
            }
            let _ = decode_payload(&payload);
        }
    }
}
