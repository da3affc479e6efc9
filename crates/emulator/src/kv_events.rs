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
//!
//! With a replay endpoint (vLLM's `replay_endpoint`), a ROUTER socket bound
//! beside the PUB one resends the last `replay_buffer` batches (vLLM's
//! `buffer_steps`): a client sends `[b"", start_seq]` (8 bytes big-endian)
//! and gets `[b"", seq, payload]` for every buffered batch with
//! `seq >= start_seq`, then the end marker `[b"", -1 as 8 bytes, b""]`. A
//! subscriber that sees a sequence gap can fetch what it missed there.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

/// Batches kept for replay by default (vLLM's `buffer_steps` default).
pub const DEFAULT_REPLAY_BUFFER: usize = 10_000;

/// The replay end marker's sequence frame: -1 as 8 signed big-endian bytes.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// How long one replay reply may wait on a client that does not read: a stuck client must not
/// stall the replay service for the others.
const REPLAY_SEND_TIMEOUT: Duration = Duration::from_secs(2);

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
    /// Replay endpoint (a ROUTER socket, always bound), e.g. `tcp://127.0.0.1:5558`.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay (at least 1).
    pub replay_buffer: usize,
    /// Fault injection for tests: every Nth batch (seq % N == N - 1) is not sent on the PUB
    /// socket, though it is kept for replay, so a subscriber sees a gap. 0 drops nothing.
    pub drop_every: u64,
}

impl PublisherConfig {
    /// Publishes on `endpoint` in vLLM's default layout, without replay.
    pub fn new(endpoint: impl Into<String>) -> Self {
        PublisherConfig {
            endpoint: endpoint.into(),
            force_bind: false,
            topic: String::new(),
            format: Format::Array,
            replay_endpoint: None,
            replay_buffer: DEFAULT_REPLAY_BUFFER,
            drop_every: 0,
        }
    }
}

/// Where a started publisher can be reached.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Endpoints {
    /// The PUB socket's resolved endpoint when it bound one (the real port if 0 was asked).
    pub events: Option<String>,
    /// The replay socket's resolved endpoint, when replay is on.
    pub replay: Option<String>,
}

/// The last batches published, oldest first, for replay.
type Ring = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

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

/// Open the sockets and start the publishing task (and the replay service).
///
/// Returns the handle and where it can be reached.
pub async fn start(cfg: PublisherConfig) -> Result<(KvEventPublisher, Endpoints), KvEventsError> {
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
    let ring: Ring = Arc::new(Mutex::new(VecDeque::new()));
    let replay = match &cfg.replay_endpoint {
        Some(endpoint) => {
            let mut router = zeromq::RouterSocket::new();
            let ep = router
                .bind(endpoint)
                .await
                .map_err(|source| KvEventsError::Socket {
                    endpoint: endpoint.clone(),
                    source,
                })?;
            tokio::spawn(serve_replay(router, ring.clone()));
            Some(ep.to_string())
        }
        None => None,
    };
    let keep = if cfg.replay_endpoint.is_some() {
        cfg.replay_buffer.max(1)
    } else {
        0
    };
    let drop_every = cfg.drop_every;
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
            let payload = Bytes::from(encode_batch(unix_now(), &wire, 0, format));
            // Buffered before it is sent, as in vLLM: a subscriber that sees the next batch
            // and asks for this one finds it.
            if keep > 0 {
                let mut ring = ring.lock().unwrap_or_else(|e| e.into_inner());
                if ring.len() == keep {
                    ring.pop_front();
                }
                ring.push_back((seq, payload.clone()));
            }
            let frames = vec![
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            let dropped = drop_every > 0 && seq % drop_every == drop_every - 1;
            seq += 1;
            if dropped {
                tracing::debug!(
                    "kv events: batch {} not sent (--kv-events-drop-every)",
                    seq - 1
                );
                continue;
            }
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
    Ok((
        KvEventPublisher { tx },
        Endpoints {
            events: bound,
            replay,
        },
    ))
}

/// The start sequence number of a replay request: its last frame, 8 bytes big-endian (vLLM's
/// legacy form, `[client_id, b"", start]` as the ROUTER receives it).
pub fn replay_start<F: AsRef<[u8]>>(frames: &[F]) -> Option<u64> {
    let last: [u8; 8] = frames.last()?.as_ref().try_into().ok()?;
    Some(u64::from_be_bytes(last))
}

/// Answers replay requests from the ring until the socket fails: every buffered batch from the
/// start asked for, then the end marker.
async fn serve_replay(mut socket: zeromq::RouterSocket, ring: Ring) {
    use zeromq::SocketRecv;
    loop {
        let request = match socket.recv().await {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!("kv events replay socket: {e}");
                return;
            }
        };
        let (Some(client), Some(start)) = (request.first().cloned(), replay_start(&request)) else {
            tracing::debug!(
                "kv events: invalid replay request of {} frames",
                request.len()
            );
            continue;
        };
        // Copied out (payloads are shared bytes) so publishing goes on while this is sent.
        let batches: Vec<(u64, Bytes)> = ring
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let replies = batches
            .into_iter()
            .map(|(seq, payload)| (Bytes::copy_from_slice(&seq.to_be_bytes()), payload))
            .chain([(Bytes::copy_from_slice(&END_SEQ), Bytes::new())]);
        for (seq, payload) in replies {
            let frames = vec![client.clone(), Bytes::new(), seq, payload];
            let sent = match ZmqMessage::try_from(frames) {
                Ok(msg) => tokio::time::timeout(REPLAY_SEND_TIMEOUT, socket.send(msg)).await,
                Err(e) => {
                    tracing::debug!("kv events replay frame error: {e:?}");
                    break;
                }
            };
            if !matches!(sent, Ok(Ok(()))) {
                tracing::debug!("kv events: replay client gone or stuck");
                break;
            }
        }
    }
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

    /// Asks `endpoint` for a replay from `start`: the sequence numbers and payloads sent, up to
    /// the end marker.
    async fn ask_replay(endpoint: &str, start: u64) -> Vec<(u64, Bytes)> {
        use zeromq::SocketRecv;
        let mut dealer = zeromq::DealerSocket::new();
        dealer.connect(endpoint).await.unwrap();
        let request = vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())];
        dealer
            .send(ZmqMessage::try_from(request).unwrap())
            .await
            .unwrap();
        let mut out = Vec::new();
        loop {
            let frames = tokio::time::timeout(Duration::from_secs(10), dealer.recv())
                .await
                .expect("a reply in time")
                .unwrap()
                .into_vec();
            assert_eq!(frames.len(), 3, "[b\"\", seq, payload]");
            assert!(frames[0].is_empty());
            if frames[1][..] == END_SEQ {
                assert!(frames[2].is_empty());
                return out;
            }
            let seq = u64::from_be_bytes(frames[1][..].try_into().unwrap());
            out.push((seq, frames[2].clone()));
        }
    }

    #[tokio::test]
    async fn replay_serves_the_last_batches_from_the_start_asked_for() {
        let cfg = PublisherConfig {
            force_bind: true,
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            replay_buffer: 3,
            drop_every: 2,
            ..PublisherConfig::new("tcp://127.0.0.1:0")
        };
        let (publisher, endpoints) = start(cfg).await.unwrap();
        let replay = endpoints.replay.expect("bound");
        assert!(endpoints.events.is_some());
        for _ in 0..5 {
            publisher.publish(vec![KvEvent::AllBlocksCleared]);
        }
        // The publishing task buffers them in the background: ask until the last is there.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let all = loop {
            let got = ask_replay(&replay, 0).await;
            if got.last().map(|b| b.0) == Some(4) {
                break got;
            }
            assert!(std::time::Instant::now() < deadline, "{got:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        // A buffer of 3 keeps the last 3, dropped ones (1 and 3) included.
        let seqs: Vec<u64> = all.iter().map(|b| b.0).collect();
        assert_eq!(seqs, vec![2, 3, 4]);
        let v = rmpv::decode::read_value(&mut &all[0].1[..]).unwrap();
        assert_eq!(v.as_array().unwrap()[1].as_array().unwrap().len(), 1);
        let from_4: Vec<u64> = ask_replay(&replay, 4).await.iter().map(|b| b.0).collect();
        assert_eq!(from_4, vec![4]);
        assert!(
            ask_replay(&replay, 9).await.is_empty(),
            "just the end marker"
        );
    }

    #[test]
    fn replay_requests_carry_the_start_in_their_last_frame() {
        let id = b"id".to_vec();
        let start = 7u64.to_be_bytes().to_vec();
        assert_eq!(replay_start(&[id.clone(), vec![], start.clone()]), Some(7));
        assert_eq!(replay_start(&[id.clone(), vec![], vec![1, 2]]), None);
        assert_eq!(replay_start::<Vec<u8>>(&[]), None);
    }

    #[test]
    fn bind_heuristic() {
        assert!(should_bind("tcp://*:5557"));
        assert!(!should_bind("tcp://127.0.0.1:5557"));
    }
}
