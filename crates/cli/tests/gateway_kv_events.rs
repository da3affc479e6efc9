//! KV events end to end: real `switchyard engine` emulators publishing vLLM-format events over
//! ZeroMQ, a real `switchyard serve` subscribed with `kv_events=`, and a publisher in this test
//! for what an emulator never does on purpose (a sequence gap, a bad batch). Everything on
//! 127.0.0.1 with ephemeral ports; polled with deadlines, never fixed sleeps.

mod engine_support;
mod gateway_support;
mod support;

use std::time::Duration;

use engine_support::Emulator;
use gateway_support::{client, gateway, metric_sum, poll, post, Proc, MODEL};
use rmpv::Value as Mp;
use serde_json::json;
use zeromq::{Socket, SocketSend};

fn backend_flag(name: &str, emu: &Emulator, kv: &str) -> String {
    format!("{},models={MODEL},name={name},kv_events={kv}", emu.base)
}

async fn metrics(c: &reqwest::Client, gw: &Proc) -> String {
    c.get(gw.url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text")
}

fn series(text: &str, name: &str, backend: &str) -> f64 {
    metric_sum(text, name, &[&format!("backend=\"{backend}\"")])
}

/// Token ids unique to `tag`: `len` of them.
fn tokens(tag: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| 1000 + tag * 10_000 + i).collect()
}

/// Sends a token prompt straight to an emulator (the gateway's approximate index never sees it).
async fn seed(c: &reqwest::Client, emu: &Emulator, ids: &[u32]) {
    let (status, _) = engine_support::post_json(
        c,
        &emu.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": ids, "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
}

/// Waits until the gateway matches `backend` exactly, seeding fresh prompts on its engine so
/// events flow while the subscription settles (a PUB socket drops what it sends before then).
async fn until_exact(c: &reqwest::Client, gw: &Proc, emu: &Emulator, backend: &str, tag: u32) {
    let mut n = 0;
    let exact = poll(Duration::from_secs(30), || {
        n += 1;
        async move {
            seed(c, emu, &tokens(tag * 100 + n, 48)).await;
            let m = metrics(c, gw).await;
            (series(&m, "switchyard_kv_events_exact", backend) == 1.0).then_some(m)
        }
    })
    .await
    .unwrap_or_else(|| panic!("{backend} never became exact"));
    assert!(series(&exact, "switchyard_kv_events_received_total", backend) > 0.0);
}

/// A gateway over backends `a` and `b` subscribed to their emulators' events, with the
/// decision header and a short probation.
fn exact_gateway(a: &Emulator, b: &Emulator, extra: &[&str]) -> Proc {
    let backend_a = backend_flag("a", a, a.kv_endpoint.as_deref().unwrap());
    let backend_b = backend_flag("b", b, b.kv_endpoint.as_deref().unwrap());
    let mut args = vec![
        "--backend",
        &backend_a,
        "--backend",
        &backend_b,
        "--debug-header",
        "--kv-events-probation",
        "0.3",
    ];
    args.extend_from_slice(extra);
    gateway(&args)
}

/// A prompt (`/v1/completions`) or chat messages (`/v1/chat/completions`).
#[derive(Clone)]
enum Ask {
    Prompt(serde_json::Value),
    Chat(serde_json::Value),
}

impl Ask {
    fn path(&self) -> &'static str {
        match self {
            Ask::Prompt(_) => "/v1/completions",
            Ask::Chat(_) => "/v1/chat/completions",
        }
    }

    fn body(&self) -> serde_json::Value {
        match self {
            Ask::Prompt(p) => json!({"model": MODEL, "prompt": p, "max_tokens": 1}),
            Ask::Chat(m) => json!({"model": MODEL, "messages": m, "max_tokens": 1}),
        }
    }
}

/// Sends `held` straight to `holder`'s engine, waits until its events reach the gateway (a
/// request routed before would teach the approximate index instead), then sends `asked`
/// through the gateway and checks it went to `holder`. Returns the decision header and the
/// cached tokens the engine reported.
async fn seed_then_route(
    c: &reqwest::Client,
    gw: &Proc,
    (holder, emu): (&str, &Emulator),
    held: Ask,
    asked: Ask,
) -> (String, u64) {
    let received = |m: &str| series(m, "switchyard_kv_events_received_total", holder);
    let before = received(&metrics(c, gw).await);
    let (status, _) = engine_support::post_json(c, &emu.url(held.path()), &held.body()).await;
    assert_eq!(status, 200);
    poll(Duration::from_secs(10), || async {
        (received(&metrics(c, gw).await) > before).then_some(())
    })
    .await
    .expect("the seed's events arrive");
    let r = post(c, &gw.url(asked.path()), &asked.body()).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let decision = r.header("x-switchyard-decision").unwrap_or_default();
    assert_eq!(
        r.header("x-switchyard-backend").as_deref(),
        Some(holder),
        "{decision}"
    );
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("usage with cached tokens");
    (decision, cached)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_route_token_prompts_to_their_holder_and_a_killed_publisher_falls_back() {
    let a = Emulator::start_publishing(MODEL);
    let mut b = Emulator::start_publishing(MODEL);
    let gw = exact_gateway(&a, &b, &[]);
    let c = client();
    until_exact(&c, &gw, &a, "a", 1).await;
    until_exact(&c, &gw, &b, "b", 2).await;

    // A prompt only one engine holds, learned from its events alone, draws the request there,
    // and the decision shows the exact cached tokens (3 blocks of 16 of the 48 seeded).
    for round in 0..6u32 {
        let holder = if round % 2 == 0 { ("a", &a) } else { ("b", &b) };
        let held = tokens(50 + round, 48);
        let mut asked = held.clone();
        asked.extend(tokens(90 + round, 20));
        let (decision, cached) = seed_then_route(
            &c,
            &gw,
            holder,
            Ask::Prompt(json!(held)),
            Ask::Prompt(json!(asked)),
        )
        .await;
        assert!(decision.contains("cached=48"), "round {round}: {decision}");
        assert_eq!(cached, 48, "the engine confirms it held the prompt");
    }

    // Killing the publisher drops the connection: b falls back to the approximate index.
    let before = series(
        &metrics(&c, &gw).await,
        "switchyard_kv_events_fallbacks_total",
        "b",
    );
    b.kill();
    let m = poll(Duration::from_secs(15), || {
        let (c, gw) = (&c, &gw);
        async move {
            let m = metrics(c, gw).await;
            (series(&m, "switchyard_kv_events_fallbacks_total", "b") > before).then_some(m)
        }
    })
    .await
    .expect("the fallback is counted");
    assert_eq!(series(&m, "switchyard_kv_events_exact", "b"), 0.0);
    assert_eq!(
        series(&m, "switchyard_kv_events_exact", "a"),
        1.0,
        "a is untouched"
    );
}

/// `/admin/fleet` shows the first backend's KV event endpoint and mode.
async fn admin_kv_events(c: &reqwest::Client, gw: &Proc) -> serde_json::Value {
    let r = gateway_support::get_with(c, &gw.url("/admin/fleet"), &[("authorization", "Bearer t")])
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.json()["backends"][0]["kv_events"].clone()
}

/// A publisher in the test: sends what it is told, sequence numbers included.
struct FakePublisher {
    socket: zeromq::PubSocket,
    endpoint: String,
}

impl FakePublisher {
    async fn bind() -> FakePublisher {
        let mut socket = zeromq::PubSocket::new();
        let endpoint = socket
            .bind("tcp://127.0.0.1:0")
            .await
            .expect("bind")
            .to_string();
        FakePublisher { socket, endpoint }
    }

    /// Publishes `[topic, seq, payload]`.
    async fn send(&mut self, seq: u64, payload: Vec<u8>) {
        let frames = vec![
            bytes::Bytes::from_static(b"kv"),
            bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
            bytes::Bytes::from(payload),
        ];
        let message = zeromq::ZmqMessage::try_from(frames).expect("frames");
        self.socket.send(message).await.expect("send");
    }
}

/// A batch in vLLM's array layout with one `BlockStored` of one 16-token block.
fn stored_batch(hash: u64) -> Vec<u8> {
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let event = Mp::Array(vec![
        Mp::from("BlockStored"),
        Mp::Array(vec![Mp::from(hash)]),
        Mp::Nil,
        Mp::Array((0..16u32).map(|t| Mp::from(t + hash as u32)).collect()),
        Mp::from(16),
        Mp::Nil,
        Mp::from("GPU"),
        Mp::Nil,
    ]);
    let batch = Mp::Array(vec![Mp::F64(unix), Mp::Array(vec![event]), Mp::from(0)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

/// Publishes consecutive batches from `*seq` until `done` holds for the gateway's metrics.
async fn publish_until(
    publisher: &mut FakePublisher,
    seq: &mut u64,
    c: &reqwest::Client,
    gw: &Proc,
    what: &str,
    done: impl Fn(&str) -> bool,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        publisher.send(*seq, stored_batch(*seq)).await;
        *seq += 1;
        if done(&metrics(c, gw).await) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether backend `e` is matched exactly, by its metrics.
fn exact(metrics: &str) -> bool {
    series(metrics, "switchyard_kv_events_exact", "e") == 1.0
}

/// An emulator whose KV events come from a test publisher, behind a gateway (probation 0.3 s,
/// admin token `t`, the replay endpoint if any, plus `extra`), once the stream is trusted:
/// (engine, publisher, gateway, client, the next sequence number).
async fn trusted_fake_stream(
    replay: Option<&str>,
    extra: &[&str],
) -> (Emulator, FakePublisher, Proc, reqwest::Client, u64) {
    let engine = Emulator::start(&["--model", MODEL, "--speed", "100"]);
    let mut publisher = FakePublisher::bind().await;
    let mut backend = backend_flag("e", &engine, &publisher.endpoint);
    if let Some(replay) = replay {
        backend.push_str(&format!(",kv_events_replay={replay}"));
    }
    let mut args = vec![
        "--backend",
        backend.as_str(),
        "--kv-events-probation",
        "0.3",
        "--admin-token",
        "t",
    ];
    args.extend_from_slice(extra);
    let gw = gateway(&args);
    let c = client();
    let mut seq = 0;
    publish_until(&mut publisher, &mut seq, &c, &gw, "trusted", exact).await;
    (engine, publisher, gw, c, seq)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_gap_or_a_bad_batch_falls_back_until_the_stream_runs_clean() {
    let (_engine, mut publisher, gw, c, mut seq) = trusted_fake_stream(None, &[]).await;
    assert_eq!(
        admin_kv_events(&c, &gw).await,
        json!({"endpoint": publisher.endpoint, "exact": true})
    );
    let m = metrics(&c, &gw).await;
    assert_eq!(series(&m, "switchyard_kv_events_fallbacks_total", "e"), 0.0);
    assert_eq!(series(&m, "switchyard_kv_events_gaps_total", "e"), 0.0);

    // Two messages never arrive.
    seq += 2;
    let fell_back = |m: &str| series(m, "switchyard_kv_events_fallbacks_total", "e") == 1.0;
    publish_until(&mut publisher, &mut seq, &c, &gw, "gap", fell_back).await;
    let m = metrics(&c, &gw).await;
    assert_eq!(series(&m, "switchyard_kv_events_gaps_total", "e"), 1.0);
    // Clean batches earn trust back after the probation.
    publish_until(&mut publisher, &mut seq, &c, &gw, "trusted again", exact).await;

    // A batch that does not decode is a loss too.
    publisher.send(seq, vec![0xc1]).await;
    seq += 1;
    let twice = |m: &str| series(m, "switchyard_kv_events_fallbacks_total", "e") == 2.0;
    publish_until(&mut publisher, &mut seq, &c, &gw, "bad batch", twice).await;
    let m = metrics(&c, &gw).await;
    assert_eq!(
        series(&m, "switchyard_kv_events_decode_errors_total", "e"),
        1.0
    );
    assert_eq!(series(&m, "switchyard_kv_events_gaps_total", "e"), 1.0);
    publish_until(&mut publisher, &mut seq, &c, &gw, "trusted at last", exact).await;
}

/// A replay endpoint in the test, as vLLM's `_service_replay` answers: every batch it holds from
/// the start asked for (in the newer layout, with the topic frame), then the end marker.
struct FakeReplay {
    endpoint: String,
    held: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<u64, Vec<u8>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeReplay {
    async fn bind() -> FakeReplay {
        use zeromq::SocketRecv;
        let mut socket = zeromq::RouterSocket::new();
        let endpoint = socket
            .bind("tcp://127.0.0.1:0")
            .await
            .expect("bind")
            .to_string();
        let held = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::<
            u64,
            Vec<u8>,
        >::new()));
        let shared = held.clone();
        let task = tokio::spawn(async move {
            while let Ok(request) = socket.recv().await {
                let request = request.into_vec();
                let (client, start) = (&request[0], &request[request.len() - 1]);
                let start = u64::from_be_bytes(start[..].try_into().expect("8 bytes"));
                let replies: Vec<(Vec<u8>, Vec<u8>)> = shared
                    .lock()
                    .unwrap()
                    .range(start..)
                    .map(|(seq, payload)| (seq.to_be_bytes().to_vec(), payload.clone()))
                    .chain([((-1i64).to_be_bytes().to_vec(), vec![])])
                    .collect();
                for (seq, payload) in replies {
                    let frames = vec![
                        client.clone(),
                        bytes::Bytes::new(),
                        bytes::Bytes::from_static(b"kv"),
                        bytes::Bytes::from(seq),
                        bytes::Bytes::from(payload),
                    ];
                    let message = zeromq::ZmqMessage::try_from(frames).expect("frames");
                    socket.send(message).await.expect("reply");
                }
            }
        });
        FakeReplay {
            endpoint,
            held,
            task,
        }
    }

    /// Keeps batch `seq` for replay.
    fn hold(&self, seq: u64, payload: Vec<u8>) {
        self.held.lock().unwrap().insert(seq, payload);
    }
}

impl Drop for FakeReplay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The decision header of a one-token request through the gateway whose prompt starts with
/// the 16 tokens of `stored_batch(hash)`.
async fn decision_for_block(c: &reqwest::Client, gw: &Proc, hash: u64) -> String {
    let mut prompt: Vec<u32> = (0..16u32).map(|t| t + hash as u32).collect();
    prompt.extend(tokens(7, 5));
    let r = post(
        c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    r.header("x-switchyard-decision").unwrap_or_default()
}

fn replays(metrics: &str, outcome: &str) -> f64 {
    metric_sum(
        metrics,
        "switchyard_kv_events_replays_total",
        &["backend=\"e\"", &format!("outcome=\"{outcome}\"")],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_the_replay_endpoint_fills_keeps_the_stream_exact() {
    let replay = FakeReplay::bind().await;
    let (_engine, mut publisher, gw, c, mut seq) =
        trusted_fake_stream(Some(&replay.endpoint), &["--debug-header"]).await;
    let m = metrics(&c, &gw).await;
    for outcome in ["filled", "partial", "failed"] {
        assert_eq!(
            replays(&m, outcome),
            0.0,
            "{outcome}: the series exist at 0"
        );
        assert!(m.contains(&format!("outcome=\"{outcome}\"")), "{outcome}");
    }

    // Two batches never arrive on the stream; the replay endpoint holds them.
    let lost = [seq, seq + 1];
    for &s in &lost {
        replay.hold(s, stored_batch(s));
    }
    seq += 2;
    let filled = |m: &str| replays(m, "filled") == 1.0;
    publish_until(&mut publisher, &mut seq, &c, &gw, "replay", filled).await;
    let m = metrics(&c, &gw).await;
    assert_eq!(series(&m, "switchyard_kv_events_gaps_total", "e"), 1.0);
    assert_eq!(series(&m, "switchyard_kv_events_fallbacks_total", "e"), 0.0);
    assert_eq!(series(&m, "switchyard_kv_events_exact", "e"), 1.0);
    assert_eq!(replays(&m, "partial") + replays(&m, "failed"), 0.0);
    assert_eq!(
        admin_kv_events(&c, &gw).await,
        json!({"endpoint": publisher.endpoint, "exact": true, "replay": replay.endpoint})
    );

    // The router's exact view holds the replayed blocks, and one never published is not there.
    for s in lost {
        let decision = decision_for_block(&c, &gw, s).await;
        assert!(decision.contains("cached=16 "), "batch {s}: {decision}");
    }
    let never = decision_for_block(&c, &gw, 900_000).await;
    assert!(never.contains("cached=0 "), "{never}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_the_replay_endpoint_cannot_fill_falls_back_as_before() {
    // Nothing listens there.
    let unreachable = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("tcp://{}", listener.local_addr().expect("addr"))
    };
    let (engine, mut publisher, gw, c, mut seq) =
        trusted_fake_stream(Some(&unreachable), &[]).await;
    seq += 1;
    let fell_back = |m: &str| series(m, "switchyard_kv_events_fallbacks_total", "e") == 1.0;
    publish_until(&mut publisher, &mut seq, &c, &gw, "fallback", fell_back).await;
    let m = metrics(&c, &gw).await;
    assert_eq!(replays(&m, "failed"), 1.0);
    assert_eq!(replays(&m, "filled") + replays(&m, "partial"), 0.0);
    assert_eq!(series(&m, "switchyard_kv_events_gaps_total", "e"), 1.0);
    publish_until(&mut publisher, &mut seq, &c, &gw, "trusted again", exact).await;

    // A replay endpoint whose buffer has moved on gives back what it holds: applied, and the
    // rest of the gap still falls back.
    drop((engine, publisher, gw));
    let replay = FakeReplay::bind().await;
    let (_engine, mut publisher, gw, c, mut seq) =
        trusted_fake_stream(Some(&replay.endpoint), &[]).await;
    replay.hold(seq, stored_batch(seq));
    seq += 3;
    publish_until(&mut publisher, &mut seq, &c, &gw, "fallback", fell_back).await;
    let m = metrics(&c, &gw).await;
    assert_eq!(replays(&m, "partial"), 1.0);
    assert_eq!(series(&m, "switchyard_kv_events_gaps_total", "e"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_emulators_replay_endpoint_fills_the_batches_it_did_not_send() {
    // Every other batch is kept off the stream; only its replay endpoint has them.
    let a = Emulator::start(&[
        "--model",
        MODEL,
        "--speed",
        "100",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-bind",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-drop-every",
        "2",
    ]);
    let replay = a
        .kv_replay_endpoint
        .clone()
        .expect("a kv-events-replay line");
    let backend = format!(
        "{},kv_events_replay={replay}",
        backend_flag("a", &a, a.kv_endpoint.as_deref().expect("kv-events line"))
    );
    let gw = gateway(&[
        "--backend",
        &backend,
        "--debug-header",
        "--kv-events-probation",
        "0.3",
    ]);
    let c = client();
    until_exact(&c, &gw, &a, "a", 5).await;

    for round in 0..4u32 {
        let held = tokens(60 + round, 48);
        seed(&c, &a, &held).await;
        // Another prompt's batch follows the held one's, so that one, if not sent, is a gap.
        seed(&c, &a, &tokens(70 + round, 32)).await;
        // Requests that start with the held prompt and end differently each time (so each is
        // predicted the held 48 tokens at most) until the router's exact view has the held
        // blocks: each adds a batch, so a held batch kept off the stream shows as a gap.
        let mut n = 0;
        let decision = poll(Duration::from_secs(15), || {
            n += 1;
            let mut asked = held.clone();
            asked.extend(tokens(1000 + round * 100 + n, 20));
            let (c, gw) = (&c, &gw);
            async move {
                let r = post(
                    c,
                    &gw.url("/v1/completions"),
                    &json!({"model": MODEL, "prompt": asked, "max_tokens": 1}),
                )
                .await;
                assert_eq!(r.status, 200, "{}", r.text);
                assert_eq!(
                    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
                    Some(48),
                    "the engine holds the held prompt"
                );
                let decision = r.header("x-switchyard-decision").unwrap_or_default();
                decision.contains("cached=48 ").then_some(decision)
            }
        })
        .await;
        assert!(
            decision.is_some(),
            "round {round}: the held blocks never showed"
        );
    }
    let m = metrics(&c, &gw).await;
    let filled = metric_sum(
        &m,
        "switchyard_kv_events_replays_total",
        &["backend=\"a\"", "outcome=\"filled\""],
    );
    assert!(filled > 0.0, "gaps filled: {filled}");
    assert_eq!(series(&m, "switchyard_kv_events_gaps_total", "a"), filled);
    assert_eq!(series(&m, "switchyard_kv_events_fallbacks_total", "a"), 0.0);
    assert_eq!(series(&m, "switchyard_kv_events_exact", "a"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_silent_while_its_engine_works_falls_back() {
    let (_engine, _publisher, gw, c, _) =
        trusted_fake_stream(None, &["--kv-events-silence", "0.5"]).await;

    // The publisher says nothing more while the engine computes fresh prompts: blocks it must
    // have stored go unreported, so the view is not to be trusted.
    let mut n = 0;
    let m = poll(Duration::from_secs(20), || {
        n += 1;
        let (c, gw) = (&c, &gw);
        async move {
            let r = post(
                c,
                &gw.url("/v1/completions"),
                &json!({"model": MODEL, "prompt": tokens(n, 80), "max_tokens": 1}),
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.text);
            let m = metrics(c, gw).await;
            (series(&m, "switchyard_kv_events_fallbacks_total", "e") == 1.0).then_some(m)
        }
    })
    .await
    .expect("silence is noticed");
    assert_eq!(series(&m, "switchyard_kv_events_exact", "e"), 0.0);
    assert_eq!(series(&m, "switchyard_kv_events_gaps_total", "e"), 0.0);
    // The publisher sends nothing more, so trust cannot come back: the router says so too.
    assert_eq!(admin_kv_events(&c, &gw).await["exact"], false);
}

/// Two emulators publishing KV events (`extra` flags on both; the second writes its tokenizer
/// into `dir`) and a gateway subscribed to both with that tokenizer, once both are matched
/// exactly (`tags` seed them).
async fn tokenizing_fleet(
    dir: &std::path::Path,
    extra: &[&str],
    tags: [u32; 2],
) -> (Emulator, Emulator, Proc, reqwest::Client) {
    let tokenizer = dir.join("tokenizer.json");
    let tokenizer = tokenizer.to_str().unwrap();
    let publishing = |more: &[&str]| {
        let mut args = vec![
            "--model",
            MODEL,
            "--speed",
            "100",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-bind",
        ];
        args.extend_from_slice(extra);
        args.extend_from_slice(more);
        Emulator::start(&args)
    };
    let a = publishing(&[]);
    // Also writes tokenizer_config.json (the chat template) beside the tokenizer.
    let b = publishing(&["--write-tokenizer", tokenizer]);
    let flag = format!("{MODEL}={tokenizer}");
    let gw = exact_gateway(&a, &b, &["--tokenizer", &flag]);
    let c = client();
    until_exact(&c, &gw, &a, "a", tags[0]).await;
    until_exact(&c, &gw, &b, "b", tags[1]).await;
    (a, b, gw, c)
}

/// Text of `len` vocabulary words (one token each) picked by `seed`.
fn words(seed: u32, len: u32) -> String {
    let vocab: Vec<&str> = switchyard_emulator::engine::tokenizer::vocabulary()
        .map(|(w, _)| w)
        .collect();
    (0..len)
        .map(|i| vocab[((seed.wrapping_mul(2654435761) ^ i.wrapping_mul(40503)) % 64) as usize])
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_prompts_tokenized_by_the_gateway_predict_cached_tokens_to_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, gw, c) = tokenizing_fleet(dir.path(), &[], [3, 4]).await;

    for round in 0..7u32 {
        let holder = if round % 2 == 0 { ("a", &a) } else { ("b", &b) };
        // Lengths off the block size: the engine holds whole blocks only. The last prompt is
        // long enough to be tokenized on the blocking pool (`TOKENIZE_ON_POOL_BYTES`).
        let len = if round == 6 { 4_500 } else { 37 + 5 * round };
        let held = words(100 + round, len);
        let asked = format!("{held}{}", words(200 + round, 20));
        if round == 6 {
            assert!(asked.len() >= switchyard_gateway::state::TOKENIZE_ON_POOL_BYTES);
        }
        let (decision, reported) = seed_then_route(
            &c,
            &gw,
            holder,
            Ask::Prompt(json!(held)),
            Ask::Prompt(json!(asked)),
        )
        .await;
        assert_eq!(reported, u64::from(len / 16 * 16), "whole blocks");
        assert!(
            decision.contains(&format!("cached={reported} ")),
            "round {round}: the engine reported {reported}: {decision}"
        );
    }
    // A long prompt nobody holds: tokenized for its first blocks only, still predicted right.
    let r = post(
        &c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": words(900, 2_000), "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    // Text outside the tokenizer's vocabulary goes to the approximate index, counted.
    let r = post(
        &c,
        &gw.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": " the zebra", "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    // Every request's prediction was the engine's report, to the token.
    let m = metrics(&c, &gw).await;
    let tokenized = |result: &str| {
        metric_sum(
            &m,
            "switchyard_tokenized_prompts_total",
            &[&format!("result=\"{result}\"")],
        )
    };
    // Whole, or as far as the holder's blocks reach (the rest is new text nobody holds).
    assert_eq!(
        tokenized("ids") + tokenized("prefix"),
        8.0,
        "every text prompt through the gateway"
    );
    assert!(tokenized("prefix") >= 1.0, "the long new prompt");
    assert_eq!(tokenized("unknown"), 1.0);
    for backend in ["a", "b"] {
        let predicted = series(&m, "switchyard_predicted_cached_tokens_total", backend);
        assert!(predicted > 0.0);
        assert_eq!(
            predicted,
            series(&m, "switchyard_reported_cached_tokens_total", backend),
            "{backend}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_messages_tokenized_with_the_chat_template_predict_cached_tokens_to_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, gw, c) = tokenizing_fleet(dir.path(), &[], [5, 6]).await;

    for round in 0..6u32 {
        let holder = if round % 2 == 0 { ("a", &a) } else { ("b", &b) };
        // A conversation held by the engine, then its next turn: the chat template's markers
        // and the system prompt's length put block boundaries anywhere.
        let system = words(300 + round, 30 + 3 * round);
        let question = words(400 + round, 25);
        let held = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]);
        let asked = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": question},
            {"role": "assistant", "content": words(500 + round, 12)},
            {"role": "user", "content": words(600 + round, 9)},
        ]);
        let (decision, reported) =
            seed_then_route(&c, &gw, holder, Ask::Chat(held), Ask::Chat(asked)).await;
        assert!(reported >= 48, "round {round}: {reported} cached");
        assert!(
            decision.contains(&format!("cached={reported} ")),
            "round {round}: the engine reported {reported}: {decision}"
        );
    }
    let m = metrics(&c, &gw).await;
    for backend in ["a", "b"] {
        let predicted = series(&m, "switchyard_predicted_cached_tokens_total", backend);
        assert!(predicted > 0.0);
        assert_eq!(
            predicted,
            series(&m, "switchyard_reported_cached_tokens_total", backend),
            "{backend}"
        );
    }
}

/// The answer's text in a chat completion, streamed (SSE chunks) or not.
fn answer_text(body: &str, stream: bool) -> String {
    if !stream {
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        return v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string();
    }
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_answer_is_tokenized_for_the_next_turn_as_it_ends() {
    // Emulators whose chat markers are special tokens, as a chat model's are: the gateway's
    // tokenizer cuts prompts into pieces at them, caches the pieces' ids, and warms the cache
    // with each answer as it ends.
    let dir = tempfile::tempdir().unwrap();
    let (_a, _b, gw, c) = tokenizing_fleet(dir.path(), &["--special-tokens"], [9, 10]).await;
    let total = |m: &str, name: &str, label: &str| metric_sum(m, name, &[label]);

    let system = words(700, 30);
    let mut warmed_bytes = 0.0;
    // First turns, streamed and not: the answer is warmed, the question is not (a one-off
    // prompt does not pay for text no next turn may send) unless the request names its
    // session.
    for (n, (stream, session)) in [(true, false), (false, false), (true, true)]
        .into_iter()
        .enumerate()
    {
        let question = words(710 + n as u32, 200);
        let messages = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]);
        let body =
            json!({"model": MODEL, "stream": stream, "max_tokens": 12, "messages": messages});
        let headers: &[(&str, &str)] = if session {
            &[("x-session-id", "conversation-1")]
        } else {
            &[]
        };
        let url = gw.url("/v1/chat/completions");
        let r = gateway_support::post_with(&c, &url, &body, headers).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let holder = r.header("x-switchyard-backend").expect("backend header");
        let answer = answer_text(&r.text, stream);
        assert!(!answer.is_empty(), "{}", r.text);
        // The pieces the next turn sends again: "\n" and the answer between the assistant's
        // markers, and with a session "\n" and the question between the user's.
        warmed_bytes += (answer.len() + 1) as f64;
        if session {
            warmed_bytes += (question.len() + 1) as f64;
        }
        let m = poll(Duration::from_secs(20), || {
            let (c, gw) = (&c, &gw);
            async move {
                let m = metrics(c, gw).await;
                let warmed = total(
                    &m,
                    "switchyard_tokenizer_warmups_total",
                    "result=\"warmed\"",
                );
                (warmed == (n + 1) as f64).then_some(m)
            }
        })
        .await
        .unwrap_or_else(|| panic!("answer {n} was never warmed"));
        let fresh = |m: &str, path: &str| {
            total(
                m,
                "switchyard_tokenizer_new_bytes_total",
                &format!("path=\"{path}\""),
            )
        };
        assert_eq!(fresh(&m, "warmup"), warmed_bytes, "answer {n}: {answer:?}");
        if !session {
            continue;
        }
        // The next turn: back to the instance holding the conversation, its cached tokens
        // predicted to the token, and nothing of it tokenized on the way but the new question.
        let next = words(720, 10);
        let mut turn = messages.as_array().unwrap().clone();
        turn.push(json!({"role": "assistant", "content": answer}));
        turn.push(json!({"role": "user", "content": next}));
        let before = fresh(&m, "request");
        let body = json!({"model": MODEL, "max_tokens": 1, "messages": turn});
        let r = gateway_support::post_with(&c, &url, &body, headers).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let decision = r.header("x-switchyard-decision").unwrap_or_default();
        assert_eq!(r.header("x-switchyard-backend"), Some(holder), "{decision}");
        let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("usage with cached tokens");
        assert!(
            cached as usize * 4 > answer.len() + question.len(),
            "{cached}"
        );
        assert!(
            decision.contains(&format!("cached={cached} ")),
            "{cached}: {decision}"
        );
        let m = metrics(&c, &gw).await;
        let on_the_way = fresh(&m, "request") - before;
        assert!(
            on_the_way <= (next.len() + 1) as f64,
            "{on_the_way} bytes tokenized on the way"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completions_conversation_is_tokenized_from_where_its_last_turn_ended() {
    let dir = tempfile::tempdir().unwrap();
    let (_a, _b, gw, c) = tokenizing_fleet(dir.path(), &[], [11, 12]).await;
    let url = gw.url("/v1/completions");
    let headers: &[(&str, &str)] = &[("x-session-id", "story")];
    let fresh = |m: &str, path: &str| {
        metric_sum(
            m,
            "switchyard_tokenizer_new_bytes_total",
            &[&format!("path=\"{path}\"")],
        )
    };
    let mut prompt = words(800, 600);
    for turn in 0..3u32 {
        let m = metrics(&c, &gw).await;
        let before = fresh(&m, "request");
        let warmed = metric_sum(&m, "switchyard_tokenizer_warmups_total", &[]);
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 20});
        let r = gateway_support::post_with(&c, &url, &body, headers).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("usage with cached tokens");
        let decision = r.header("x-switchyard-decision").unwrap_or_default();
        assert!(
            decision.contains(&format!("cached={cached} ")),
            "turn {turn}: {cached}: {decision}"
        );
        let m = metrics(&c, &gw).await;
        let on_the_way = fresh(&m, "request") - before;
        if turn > 0 {
            // The last turn's prompt and answer were kept as the answer ended: only the new
            // question and the margins around the splice are tokenized on the way.
            assert!(
                cached as usize * 4 >= prompt.len() - 120,
                "turn {turn}: {cached}"
            );
            assert!(
                on_the_way <= 40.0 + 256.0,
                "turn {turn}: {on_the_way} bytes"
            );
        }
        let answer = r.json()["choices"][0]["text"]
            .as_str()
            .expect("text")
            .to_string();
        poll(Duration::from_secs(20), || {
            let (c, gw) = (&c, &gw);
            async move {
                let m = metrics(c, gw).await;
                (metric_sum(&m, "switchyard_tokenizer_warmups_total", &[]) > warmed).then_some(())
            }
        })
        .await
        .unwrap_or_else(|| panic!("turn {turn}'s answer was never warmed"));
        prompt = format!("{prompt}{answer}{}", words(810 + turn, 10));
    }
}
