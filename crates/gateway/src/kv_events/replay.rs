//! Asking an engine's replay endpoint for the batches a sequence gap lost (vLLM's
//! `replay_endpoint`, a ROUTER socket beside the PUB one that keeps the last `buffer_steps`
//! batches).
//!
//! A DEALER sends `[b"", start]` (8 bytes big-endian); the engine answers every batch it holds
//! from `start` on ([`wire::decode_replay`]), then an end marker. Only the batches the gap lost
//! are kept, in order and without holes: a hole means the engine's buffer no longer holds them,
//! and what follows it cannot be applied in sequence. Bounded in time (the caller's timeout,
//! for connecting and receiving alike) and in batches (the gap's size, and at most
//! [`MAX_TRAILING_REPLIES`] more read to the end marker).

use std::time::Duration;

use bytes::Bytes;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::wire::{self, Batch, Replayed};

/// What a replay brought back.
#[derive(Debug, Default)]
pub struct Fetched {
    /// The batches from the start asked for, consecutive (possibly fewer than asked).
    pub batches: Vec<Batch>,
    /// Why it stopped short, when it did.
    pub stopped: Option<String>,
}

/// Fetches batches `from..until` from the replay endpoint, within `timeout` in all.
pub async fn fetch(endpoint: &str, from: u64, until: u64, timeout: Duration) -> Fetched {
    let mut batches = Vec::new();
    let stopped =
        match tokio::time::timeout(timeout, exchange(endpoint, from, until, &mut batches)).await {
            Ok(Ok(())) => None,
            Ok(Err(why)) => Some(why),
            Err(_) => Some(format!("no complete answer within {timeout:?}")),
        };
    Fetched { batches, stopped }
}

/// One request and its answers, pushed to `out` as they come (kept if the time runs out).
async fn exchange(
    endpoint: &str,
    from: u64,
    until: u64,
    out: &mut Vec<Batch>,
) -> Result<(), String> {
    let mut socket = zeromq::DealerSocket::new();
    socket
        .connect(endpoint)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let request = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
    let request = ZmqMessage::try_from(request).map_err(|e| format!("request: {e:?}"))?;
    socket
        .send(request)
        .await
        .map_err(|e| format!("send: {e}"))?;
    let mut next = from;
    while next < until {
        let frames = socket
            .recv()
            .await
            .map_err(|e| format!("receive: {e}"))?
            .into_vec();
        match wire::decode_replay(&frames).map_err(|e| format!("batch after {next}: {e}"))? {
            Replayed::End => return Err(format!("the engine no longer holds batch {next}")),
            // Older than the gap (the stream already had it) or a duplicate.
            Replayed::Batch(b) if b.seq < next => {}
            Replayed::Batch(b) if b.seq == next => {
                out.push(b);
                next += 1;
            }
            Replayed::Batch(b) => {
                return Err(format!(
                    "the engine no longer holds batch {next} (its replay starts at {})",
                    b.seq
                ))
            }
        }
    }
    // The rest of the answer (batches the stream delivers live) is read to the end marker
    // rather than abandoned: an engine still sending to a client that hung up may be slow to
    // answer the next request. Not decoded, bounded by the frames and by the caller's timeout,
    // and its trouble does not matter: the gap is filled.
    for _ in 0..MAX_TRAILING_REPLIES {
        match socket.recv().await {
            Ok(reply)
                if reply.len() >= 2
                    && reply
                        .get(reply.len() - 2)
                        .is_some_and(|seq| seq[..] == wire::REPLAY_END_SEQ) =>
            {
                break
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    Ok(())
}

/// Most replies read after the gap is filled, waiting for the end marker.
const MAX_TRAILING_REPLIES: usize = 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    /// A batch with no events, as msgpack.
    fn payload() -> Bytes {
        let mut out = Vec::new();
        let batch = Value::Array(vec![Value::F64(1.0), Value::Array(vec![]), Value::from(0)]);
        rmpv::encode::write_value(&mut out, &batch).unwrap();
        Bytes::from(out)
    }

    /// A replay endpoint answering every request with `answer` (sequence numbers; `None` sends
    /// nothing at all), the newer layout with a topic frame, then the end marker.
    async fn fake(answer: Option<Vec<u64>>) -> (String, tokio::task::JoinHandle<()>) {
        let mut socket = zeromq::RouterSocket::new();
        let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let task = tokio::spawn(async move {
            while let Ok(request) = socket.recv().await {
                let request = request.into_vec();
                assert_eq!(request.len(), 3, "[id, b\"\", start]");
                let Some(seqs) = &answer else { continue };
                let replies = seqs
                    .iter()
                    .map(|s| (Bytes::copy_from_slice(&s.to_be_bytes()), payload()))
                    .chain([(Bytes::copy_from_slice(&wire::REPLAY_END_SEQ), Bytes::new())]);
                for (seq, body) in replies {
                    let frames = vec![
                        request[0].clone(),
                        Bytes::new(),
                        Bytes::from_static(b"kv"),
                        seq,
                        body,
                    ];
                    if socket
                        .send(ZmqMessage::try_from(frames).unwrap())
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        });
        (endpoint, task)
    }

    fn seqs(f: &Fetched) -> Vec<u64> {
        f.batches.iter().map(|b| b.seq).collect()
    }

    const T: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn keeps_the_gap_in_order_and_skips_what_the_stream_had() {
        // Duplicates and older batches are skipped; it stops at the end of the gap.
        let (ep, task) = fake(Some(vec![3, 4, 4, 5, 6, 7, 8])).await;
        let f = fetch(&ep, 5, 8, T).await;
        assert_eq!(seqs(&f), vec![5, 6, 7]);
        assert_eq!(f.stopped, None);
        task.abort();
    }

    #[tokio::test]
    async fn a_buffer_that_moved_on_or_ended_early_is_partial_or_nothing() {
        let (ep, task) = fake(Some(vec![5, 6, 8, 9])).await;
        let f = fetch(&ep, 5, 9, T).await;
        assert_eq!(seqs(&f), vec![5, 6], "a hole at 7 ends it");
        assert!(f.stopped.unwrap().contains("no longer holds batch 7"));
        let f = fetch(&ep, 3, 9, T).await;
        assert!(f.batches.is_empty(), "starts at 5, not 3");
        task.abort();
        let (ep, task) = fake(Some(vec![5])).await;
        let f = fetch(&ep, 5, 7, T).await;
        assert_eq!(seqs(&f), vec![5]);
        assert!(f.stopped.unwrap().contains("no longer holds batch 6"));
        task.abort();
    }

    #[tokio::test]
    async fn silence_or_nobody_there_is_bounded_by_the_timeout() {
        let (ep, task) = fake(None).await;
        let start = std::time::Instant::now();
        let f = fetch(&ep, 1, 2, Duration::from_millis(200)).await;
        assert!(f.batches.is_empty());
        assert!(f.stopped.unwrap().contains("no complete answer"));
        assert!(start.elapsed() < Duration::from_secs(3));
        task.abort();
        let unreachable = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("tcp://{}", listener.local_addr().unwrap())
        };
        let start = std::time::Instant::now();
        let f = fetch(&unreachable, 1, 2, Duration::from_millis(500)).await;
        assert!(f.batches.is_empty());
        assert!(f.stopped.is_some());
        assert!(start.elapsed() < Duration::from_secs(3));
    }
}
