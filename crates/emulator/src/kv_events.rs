//! KV-cache events over ZeroMQ in vLLM's wire format.
//!
//! Follows vllm/distributed/kv_events.py (`ZmqEventPublisher`): a PUB socket
//! sends multipart messages `[topic, seq, payload]` where `seq` is an 8-byte
//! big-endian counter starting at 0 and `payload` is a msgpack
//! `KVEventBatch`. Two payload layouts exist in the wild:
//!
//! * `array` (default; vLLM's `array_like=True, tag=True` structs, what
//!   vllm-router, Dynamo and llm-d decode): the batch is
//!   `[ts, [event, ...], data_parallel_rank]` and each event a tagged array
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//!   lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`,
//!   `["AllBlocksCleared"]`;
//! * `map` (newer vLLM): the same fields as maps, events tagged by `"type"`.
//!
//! Like vLLM, the socket binds when the endpoint has a wildcard (`*`, `::`)
//! and connects otherwise; `--kv-events-bind` forces binding (e.g. to a
//! loopback address). `ts` is wall-clock Unix time, as in vLLM.

use std::collections::HashMap;

use bytes::Bytes;
use rmpv::Value;
use switchyard_engine::KvEvent;
use thiserror::Error;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Storage medium reported in events (vLLM's `MEDIUM_GPU`).
const MEDIUM_GPU: &str = "GPU";

/// Errors setting up the publisher.
#[derive(Debug, Error)]
pub enum KvEventsError {
    /// The ZeroMQ socket could not bind or connect.
    #[error("kv events socket on {endpoint}: {source}")]
    Socket {
        /// The endpoint tried.
        endpoint: String,
        /// The ZeroMQ error.
        source: zeromq::ZmqError,
    },
}

/// msgpack layout of the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// Tagged positional arrays (`array_like=True`).
    #[default]
    Array,
    /// Maps with a `"type"` tag.
    Map,
}

/// One event with the adapter id resolved, ready to encode.
#[derive(Debug, Clone, PartialEq)]
pub struct WireEvent<'a> {
    /// The engine's event.
    pub event: &'a KvEvent,
    /// vLLM's integer LoRA id for the event's adapter, if any.
    pub lora_id: Option<u32>,
}

/// Encode one batch as msgpack bytes.
pub fn encode_batch(ts: f64, events: &[WireEvent<'_>], dp_rank: u32, format: Format) -> Vec<u8> {
    let evs: Vec<Value> = events.iter().map(|e| encode_event(e, format)).collect();
    let batch = match format {
        Format::Array => Value::Array(vec![
            Value::F64(ts),
            Value::Array(evs),
            Value::from(dp_rank),
        ]),
        Format::Map => Value::Map(vec![
            (Value::from("ts"), Value::F64(ts)),
            (Value::from("events"), Value::Array(evs)),
            (Value::from("data_parallel_rank"), Value::from(dp_rank)),
        ]),
    };
    let mut buf = Vec::with_capacity(256);
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut buf, &batch);
    buf
}

fn opt_u64(v: Option<u64>) -> Value {
    v.map(Value::from).unwrap_or(Value::Nil)
}

fn hashes(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|x| Value::from(*x)).collect())
}

fn encode_event(e: &WireEvent<'_>, format: Format) -> Value {
    let fields: Vec<(&str, Value)> = match e.event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_name,
        } => vec![
            ("type", Value::from("BlockStored")),
            ("block_hashes", hashes(block_hashes)),
            ("parent_block_hash", opt_u64(*parent_block_hash)),
            (
                "token_ids",
                Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect()),
            ),
            ("block_size", Value::from(*block_size)),
            ("lora_id", opt_u64(e.lora_id.map(u64::from))),
            ("medium", Value::from(MEDIUM_GPU)),
            (
                "lora_name",
                lora_name.as_deref().map(Value::from).unwrap_or(Value::Nil),
            ),
        ],
        KvEvent::BlockRemoved { block_hashes } => vec![
            ("type", Value::from("BlockRemoved")),
            ("block_hashes", hashes(block_hashes)),
            ("medium", Value::from(MEDIUM_GPU)),
        ],
        KvEvent::AllBlocksCleared => vec![("type", Value::from("AllBlocksCleared"))],
    };
    match format {
        Format::Array => Value::Array(fields.into_iter().map(|(_, v)| v).collect()),
        Format::Map => Value::Map(
            fields
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        ),
    }
}

/// Publisher settings.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// ZeroMQ endpoint, e.g. `tcp://*:5557` or `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    /// Bind even when the endpoint has no wildcard.
    pub force_bind: bool,
    /// Topic frame (vLLM's default is empty).
    pub topic: String,
    /// Payload layout.
    pub format: Format,
}

/// Handle that queues engine KV events for publishing.
#[derive(Debug, Clone)]
pub struct KvEventPublisher {
    tx: mpsc::UnboundedSender<Vec<KvEvent>>,
}

impl KvEventPublisher {
    /// Queue one batch (one engine step's events); never blocks.
    pub fn publish(&self, events: Vec<KvEvent>) {
        if !events.is_empty() {
            // A closed channel means the publisher task ended; events are
            // best-effort, as with vLLM's PUB socket.
            let _ = self.tx.send(events);
        }
    }
}

/// Whether vLLM's heuristic binds this endpoint.
pub fn should_bind(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// Open the socket and start the publishing task.
///
/// Returns the handle and, when bound, the resolved endpoint (with the real
/// port if port 0 was asked for).
pub async fn start(
    cfg: PublisherConfig,
) -> Result<(KvEventPublisher, Option<String>), KvEventsError> {
    let mut socket = zeromq::PubSocket::new();
    let bind = cfg.force_bind || should_bind(&cfg.endpoint);
    let bound = if bind {
        let ep = socket
            .bind(&cfg.endpoint)
            .await
            .map_err(|source| KvEventsError::Socket {
                endpoint: cfg.endpoint.clone(),
                source,
            })?;
        Some(ep.to_string())
    } else {
        None
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<KvEvent>>();
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    let format = cfg.format;
    let endpoint = cfg.endpoint.clone();
    tokio::spawn(async move {
        if !bind {
            // Connect in the background (the subscriber may start later);
            // like a ZeroMQ PUB socket, events before that are dropped.
            loop {
                match socket.connect(&endpoint).await {
                    Ok(()) => break,
                    Err(e) => {
                        tracing::debug!("kv events connect to {endpoint}: {e}; retrying");
                        while let Ok(_dropped) = rx.try_recv() {}
                        if rx.is_closed() {
                            return;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                    }
                }
            }
        }
        let mut seq: u64 = 0;
        let mut lora_ids: HashMap<String, u32> = HashMap::new();
        while let Some(events) = rx.recv().await {
            let wire: Vec<WireEvent<'_>> = events
                .iter()
                .map(|event| {
                    let lora_id = match event {
                        KvEvent::BlockStored {
                            lora_name: Some(name),
                            ..
                        } => {
                            let next = lora_ids.len() as u32 + 1;
                            Some(*lora_ids.entry(name.clone()).or_insert(next))
                        }
                        _ => None,
                    };
                    WireEvent { event, lora_id }
                })
                .collect();
            let payload = encode_batch(unix_now(), &wire, 0, format);
            let frames = vec![
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(payload),
            ];
            seq += 1;
            match ZmqMessage::try_from(frames) {
                Ok(msg) => {
                    if let Err(e) = socket.send(msg).await {
                        tracing::debug!("kv events send failed: {e}");
                    }
                }
                Err(e) => tracing::debug!("kv events frame error: {e:?}"),
            }
        }
    });
    Ok((KvEventPublisher { tx }, bound))
}

/// Wall-clock seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![1, u64::MAX],
            parent_block_hash: None,
            token_ids: vec![5, 6],
            block_size: 16,
            lora_name: Some("ad".into()),
        }
    }

    #[test]
    fn array_layout_matches_vllm() {
        let ev = stored();
        let rm = KvEvent::BlockRemoved {
            block_hashes: vec![7],
        };
        let clr = KvEvent::AllBlocksCleared;
        let wire = [
            WireEvent {
                event: &ev,
                lora_id: Some(1),
            },
            WireEvent {
                event: &rm,
                lora_id: None,
            },
            WireEvent {
                event: &clr,
                lora_id: None,
            },
        ];
        let bytes = encode_batch(12.5, &wire, 0, Format::Array);
        let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let arr = v.as_array().unwrap();
        assert_eq!(arr.len(), 3);
        assert_eq!(arr[0].as_f64(), Some(12.5));
        assert_eq!(arr[2].as_u64(), Some(0));
        let evs = arr[1].as_array().unwrap();
        let s = evs[0].as_array().unwrap();
        assert_eq!(s[0].as_str(), Some("BlockStored"));
        assert_eq!(s[1].as_array().unwrap()[1].as_u64(), Some(u64::MAX));
        assert!(s[2].is_nil());
        assert_eq!(s[3].as_array().unwrap().len(), 2);
        assert_eq!(s[4].as_u64(), Some(16));
        assert_eq!(s[5].as_u64(), Some(1));
        assert_eq!(s[6].as_str(), Some("GPU"));
        assert_eq!(s[7].as_str(), Some("ad"));
        let r = evs[1].as_array().unwrap();
        assert_eq!(r[0].as_str(), Some("BlockRemoved"));
        assert_eq!(r.len(), 3);
        assert_eq!(
            evs[2].as_array().unwrap()[0].as_str(),
            Some("AllBlocksCleared")
        );
    }

    #[test]
    fn map_layout_has_type_tag() {
        let ev = stored();
        let bytes = encode_batch(
            1.0,
            &[WireEvent {
                event: &ev,
                lora_id: None,
            }],
            0,
            Format::Map,
        );
        let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let m = v.as_map().unwrap();
        assert_eq!(m[0].0.as_str(), Some("ts"));
        let evs = m[1].1.as_array().unwrap();
        let e = evs[0].as_map().unwrap();
        assert_eq!(e[0].0.as_str(), Some("type"));
        assert_eq!(e[0].1.as_str(), Some("BlockStored"));
    }

    #[test]
    fn bind_heuristic() {
        assert!(should_bind("tcp://*:5557"));
        assert!(!should_bind("tcp://127.0.0.1:5557"));
    }
}
