//! Disaggregated prefill/decode through `switchyard serve`, against emulators in prefill and
//! decode roles: vLLM NixlConnector style and SGLang bootstrap style, streamed and not; the wire
//! format of both styles (recording fakes); retries of a failed prefill and of a failed decode;
//! clear errors when every candidate fails or hangs; a proof that no leg ever reaches an
//! instance of the wrong role; and a mixed fleet (both-role + prefill + decode).
//!
//! The emulator refuses what its role cannot serve (a prefill-only instance takes only prefill
//! legs; a decode-only instance never a prefill leg) with 400, which the gateway passes through:
//! a misrouted leg would show up as a failed request, and in the emulators' own counters.

mod gateway_support;
mod support;

use std::time::Duration;

use gateway_support::*;
use serde_json::{json, Value};
use support::temp_file;

/// Output tokens asked of every test request.
const MAX: u64 = 6;
/// Prompt tokens of the long requests.
const LONG: usize = 3000;
/// A baseline policy: baselines always hand off, as the routers they model do (the default
/// `cost` policy may run a prompt whole on a decode instance: selective disaggregation).
const SPLITTING: &str = "least-load";

fn role_backend(p: &Proc, role: &str, name: &str) -> String {
    format!("{},role={role},name={name}", backend(p))
}

fn fake_backend(f: &FakeEngine, role: &str, name: &str) -> String {
    format!("{},role={role},name={name}", f.backend())
}

/// `--backend` flags for `(value)` pairs.
fn flags(backends: &[String], extra: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for b in backends {
        out.push("--backend".to_string());
        out.push(b.clone());
    }
    out.extend(extra.iter().map(|s| s.to_string()));
    out
}

fn start_gateway(args: &[String]) -> Proc {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    gateway(&refs)
}

/// A completions or chat body of `tokens` prompt tokens, unique per `tag`.
fn body(chat_api: bool, tag: &str, tokens: usize, stream: bool, usage: bool) -> Value {
    let mut b = if chat_api {
        json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(tag, tokens)}],
               "max_tokens": MAX})
    } else {
        json!({"model": MODEL, "prompt": prompt(tag, tokens), "max_tokens": MAX})
    };
    if stream {
        b["stream"] = json!(true);
        if usage {
            b["stream_options"] = json!({"include_usage": true});
        }
    }
    b
}

fn path(chat_api: bool) -> &'static str {
    if chat_api {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// Sends and checks a full answer: 200, `MAX` tokens, and the usage when there is one.
async fn ask(c: &reqwest::Client, gw: &Proc, chat_api: bool, b: &Value) -> (Reply, Option<Value>) {
    let r = post(c, &gw.url(path(chat_api)), b).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let streamed = b["stream"] == json!(true);
    let usage = if streamed {
        let chunks = sse_chunks(&r.text);
        let text: String = chunks
            .iter()
            .filter_map(|c| {
                let ch = &c["choices"][0];
                ch["text"].as_str().or(ch["delta"]["content"].as_str())
            })
            .collect();
        assert!(!text.is_empty(), "{}", r.text);
        let usage = chunks
            .iter()
            .find(|c| c["usage"].is_object())
            .map(|c| c["usage"].clone());
        // Asked for: present; not asked for: the gateway's injected chunk is stripped again.
        assert_eq!(
            usage.is_some(),
            b["stream_options"]["include_usage"] == json!(true),
            "{}",
            r.text
        );
        usage
    } else {
        Some(r.json()["usage"].clone())
    };
    if let Some(u) = &usage {
        assert_eq!(u["completion_tokens"].as_u64(), Some(MAX), "{u}");
    }
    (r, usage)
}

/// The decode instance got the prompt's KV from the prefill: it reports all but the last
/// prompt token as cached (a full request on it would report none for a new prompt).
fn assert_transferred(usage: &Value) {
    let prompt = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(prompt > 1 && cached + 1 >= prompt, "{usage}");
}

/// (finished requests, generated tokens) an emulator reports in its own metrics.
async fn engine_totals(c: &reqwest::Client, p: &Proc) -> (u64, u64) {
    let text = get_with(c, &p.url("/metrics"), &[]).await.text;
    (
        metric_sum(&text, "vllm:e2e_request_latency_seconds_count", &[]) as u64,
        metric_sum(&text, "vllm:generation_tokens_total", &[]) as u64,
    )
}

/// `engine_totals` summed over `procs`.
async fn sum_totals(c: &reqwest::Client, procs: &[&Proc]) -> (u64, u64) {
    let mut sum = (0, 0);
    for p in procs {
        let t = engine_totals(c, p).await;
        sum = (sum.0 + t.0, sum.1 + t.1);
    }
    sum
}

/// Waits until the summed totals of `procs` are `want` (SGLang-style prefill answers are
/// drained in the background); panics with what they are if they never get there.
async fn wait_totals(c: &reqwest::Client, procs: &[&Proc], want: (u64, u64)) {
    let reached = poll(Duration::from_secs(10), || async {
        (sum_totals(c, procs).await == want).then_some(())
    })
    .await;
    if reached.is_none() {
        let got = sum_totals(c, procs).await;
        panic!("engine totals (finished, generated) {got:?}, expected {want:?}");
    }
}

async fn gateway_metrics(c: &reqwest::Client, gw: &Proc) -> String {
    get_with(c, &gw.url("/metrics"), &[]).await.text
}

/// Admin token of the test gateways.
const ADMIN: &str = "adm";

/// Waits until neither the gateway nor its router counts a request in flight: every leg, retry,
/// abandoned pair and background prefill was settled.
async fn assert_settled(c: &reqwest::Client, gw: &Proc) {
    let auth = format!("Bearer {ADMIN}");
    let fleet = || async {
        get_with(c, &gw.url("/admin/fleet"), &[("authorization", &auth)])
            .await
            .json()
    };
    let in_flight = |v: &Value| {
        let gateway: i64 = v["backends"].as_array().map_or(0, |b| {
            b.iter()
                .filter_map(|b| b["gateway_in_flight"].as_i64())
                .sum()
        });
        gateway == 0 && v["router_in_flight"].as_u64() == Some(0)
    };
    let settled = poll(Duration::from_secs(10), || async {
        in_flight(&fleet().await).then_some(())
    })
    .await;
    assert!(settled.is_some(), "still in flight: {}", fleet().await);
}

/// Both styles' happy path over one prefill and one decode emulator: chat and completions,
/// streamed (with and without usage asked) and not.
async fn serves_disaggregated(style: &str) {
    let p = engine(&["--role", "prefill"]);
    let d = engine(&["--role", "decode"]);
    let gw = start_gateway(&flags(
        &[
            role_backend(&p, "prefill", "p0"),
            role_backend(&d, "decode", "d0"),
        ],
        &[
            "--debug-header",
            "--pd-style",
            style,
            "--policy",
            SPLITTING,
            "--admin-token",
            ADMIN,
        ],
    ));
    let c = client();
    let cases = [
        (true, false, false),
        (false, false, false),
        (true, true, false),
        (false, true, true),
        (true, true, true),
    ];
    for (i, &(chat_api, stream, usage)) in cases.iter().enumerate() {
        let b = body(chat_api, &format!("{style}-{i}"), LONG, stream, usage);
        let (r, u) = ask(&c, &gw, chat_api, &b).await;
        assert_eq!(r.header("x-switchyard-backend").as_deref(), Some("d0"));
        assert_eq!(r.header("x-switchyard-prefill").as_deref(), Some("p0"));
        assert!(r.header("x-switchyard-decision").is_some());
        if let Some(u) = u {
            assert_transferred(&u);
        }
    }
    let n = cases.len() as u64;
    // Each request: exactly one one-token prefill, one full decode.
    wait_totals(&c, &[&p], (n, n)).await;
    wait_totals(&c, &[&d], (n, n * MAX)).await;
    // Both legs recorded with their usage, per backend.
    let m = gateway_metrics(&c, &gw).await;
    for name in ["p0", "d0"] {
        let ok = metric_sum(
            &m,
            "switchyard_requests_total",
            &[&format!("backend=\"{name}\""), "outcome=\"ok\""],
        );
        assert_eq!(ok, n as f64, "{name}: {m}");
        let prompt = metric_sum(
            &m,
            "switchyard_prompt_tokens_total",
            &[&format!("backend=\"{name}\"")],
        );
        assert!(prompt >= (n as usize * LONG) as f64, "{name}: {m}");
    }
    assert_eq!(metric_sum(&m, "switchyard_retries_total", &[]), 0.0);
    assert_settled(&c, &gw).await;
}

#[tokio::test]
async fn nixl_style_hands_off_streamed_and_not() {
    serves_disaggregated("nixl").await;
}

#[tokio::test]
async fn sglang_style_runs_both_legs_streamed_and_not() {
    serves_disaggregated("sglang").await;
}

#[tokio::test]
async fn sglang_wire_format() {
    // bootstrap_port in a fleet file makes the pool SGLang-style without --pd-style.
    let rp = Recorder::start("rp").await;
    let rd = Recorder::start("rd").await;
    let fleet = temp_file(
        "fleet.yaml",
        &format!(
            "backends:\n  - address: {}\n    name: rp\n    role: prefill\n    models: [{MODEL}]\n    bootstrap_port: 9123\n  - address: {}\n    name: rd\n    role: decode\n    models: [{MODEL}]\n",
            rp.base, rd.base
        ),
    );
    // Baseline policies always hand off (the cost policy may keep short prompts whole).
    let gw = gateway(&[
        "--fleet-file",
        fleet.to_str().expect("path"),
        "--debug-header",
        "--policy",
        "round-robin",
    ]);
    let c = client();
    for i in 0..3 {
        let b = json!({"model": MODEL, "prompt": prompt(&format!("wire {i}"), 300),
                       "max_tokens": MAX, "temperature": 0.5});
        let r = post(&c, &gw.url("/v1/completions"), &b).await;
        assert_eq!(r.status, 200, "{}", r.text);
        // The client gets the decode's answer.
        assert_eq!(r.json()["choices"][0]["text"], "rd");
        assert_eq!(r.header("x-switchyard-prefill").as_deref(), Some("rp"));
    }
    let (pb, db) = (rp.bodies(), rd.bodies());
    assert_eq!((pb.len(), db.len()), (3, 3));
    let mut rooms = std::collections::HashSet::new();
    for (p, d) in pb.iter().zip(&db) {
        // Both legs get the same body: the original plus the bootstrap fields.
        assert_eq!(p, d);
        assert_eq!(p["bootstrap_host"], "127.0.0.1");
        assert_eq!(p["bootstrap_port"], 9123);
        let room = p["bootstrap_room"].as_u64().expect("room is an integer");
        assert!(room < 1 << 63);
        rooms.insert(room);
        assert_eq!(p["max_tokens"], MAX);
        assert_eq!(p["temperature"], 0.5);
        assert!(p.get("kv_transfer_params").is_none());
    }
    assert_eq!(rooms.len(), 3, "a new room per request");

    // Without a bootstrap_port, --pd-style sglang uses SGLang's default port.
    let rp2 = Recorder::start("rp2").await;
    let rd2 = Recorder::start("rd2").await;
    let gw = gateway(&[
        "--backend",
        &rp2.backend(",role=prefill"),
        "--backend",
        &rd2.backend(",role=decode"),
        "--pd-style",
        "sglang",
        "--policy",
        "round-robin",
    ]);
    let r = post(
        &c,
        &gw.url("/v1/completions"),
        &body(false, "default port", 50, false, false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(rp2.bodies()[0]["bootstrap_port"], 8998);
    assert_eq!(
        rd2.bodies()[0]["bootstrap_room"],
        rp2.bodies()[0]["bootstrap_room"]
    );
}

#[tokio::test]
async fn nixl_wire_format() {
    let rp = Recorder::start("rp").await;
    let rd = Recorder::start("rd").await;
    let gw = gateway(&[
        "--backend",
        &rp.backend(",role=prefill"),
        "--backend",
        &rd.backend(",role=decode"),
        "--policy",
        "round-robin",
    ]);
    let c = client();
    let b = json!({"model": MODEL, "prompt": prompt("nixl wire", 300), "max_tokens": MAX,
                   "stream": true, "stream_options": {"include_usage": true}});
    let r = post(&c, &gw.url("/v1/completions"), &b).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["choices"][0]["text"], "rd");
    let p = &rp.bodies()[0];
    assert_eq!(p["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(p["kv_transfer_params"]["do_remote_prefill"], false);
    assert!(p["kv_transfer_params"]["remote_block_ids"].is_null());
    assert_eq!(
        (p["stream"].clone(), p["max_tokens"].clone()),
        (json!(false), json!(1))
    );
    assert!(p.get("stream_options").is_none());
    let d = &rd.bodies()[0];
    // The prefill's hand-off, as it answered it, with the original request.
    assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "rp");
    assert_eq!(d["kv_transfer_params"]["do_remote_prefill"], true);
    assert_eq!(
        (d["stream"].clone(), d["max_tokens"].clone()),
        (json!(true), json!(MAX))
    );
    assert_eq!(d["prompt"], b["prompt"]);
    assert!(d.get("bootstrap_room").is_none());
}

/// Fakes that fail in every way a retry covers, plus real emulators; round-robin rotates the
/// prefill candidates and ranks equal decode candidates in fleet order, so which fails first
/// is known.
fn failing_flags(style: &str) -> Vec<&str> {
    vec![
        "--pd-style",
        style,
        "--policy",
        "round-robin",
        "--max-retries",
        "3",
        // The 500 fake fails health checks too: keep them rare and ejection far.
        "--health-interval",
        "30",
        "--eject-after",
        "1000",
        "--admin-token",
        ADMIN,
    ]
}

async fn retries_a_failed_prefill(style: &str) {
    let p = engine(&["--role", "prefill"]);
    let d = engine(&["--role", "decode"]);
    let broken = FakeEngine::start(Fake::Status500).await;
    let busy = FakeEngine::start(Fake::Status429).await;
    let closer = FakeEngine::start(Fake::Drop).await;
    let gw = start_gateway(&flags(
        &[
            fake_backend(&broken, "prefill", "broken"),
            fake_backend(&busy, "prefill", "busy"),
            fake_backend(&closer, "prefill", "closer"),
            role_backend(&p, "prefill", "p0"),
            role_backend(&d, "decode", "d0"),
        ],
        &failing_flags(style),
    ));
    let c = client();
    let n = 8;
    for i in 0..n {
        let stream = i % 2 == 1;
        let b = body(
            i % 3 == 0,
            &format!("{style} prefill retry {i}"),
            200,
            stream,
            true,
        );
        let (_, u) = ask(&c, &gw, i % 3 == 0, &b).await;
        assert_transferred(&u.expect("usage"));
    }
    // Round-robin put each fake first in turn; the real prefill served every request once.
    assert!(broken.hits() > 0 && busy.hits() > 0 && closer.hits() > 0);
    wait_totals(&c, &[&p], (n as u64, n as u64)).await;
    let m = gateway_metrics(&c, &gw).await;
    assert!(
        metric_sum(&m, "switchyard_retries_total", &[]) >= 3.0,
        "{m}"
    );
    for result in ["status_5xx", "status_429", "closed"] {
        let r = format!("result=\"{result}\"");
        assert!(
            metric_sum(&m, "switchyard_upstream_failures_total", &[&r]) > 0.0,
            "{result}: {m}"
        );
    }
    assert_settled(&c, &gw).await;
}

#[tokio::test]
async fn nixl_retries_a_failed_prefill_on_the_next_prefill() {
    retries_a_failed_prefill("nixl").await;
}

#[tokio::test]
async fn sglang_retries_a_failed_prefill_with_a_new_pair() {
    retries_a_failed_prefill("sglang").await;
}

#[tokio::test]
async fn nixl_retries_a_failed_decode_reusing_the_hand_off() {
    let p = engine(&["--role", "prefill"]);
    let d = engine(&["--role", "decode"]);
    let broken = FakeEngine::start(Fake::Status500).await;
    let closer = FakeEngine::start(Fake::Drop).await;
    let gw = start_gateway(&flags(
        &[
            role_backend(&p, "prefill", "p0"),
            fake_backend(&broken, "decode", "broken"),
            fake_backend(&closer, "decode", "closer"),
            role_backend(&d, "decode", "d0"),
        ],
        &failing_flags("nixl"),
    ));
    let c = client();
    let n = 4;
    for i in 0..n {
        let b = body(
            i % 2 == 0,
            &format!("decode retry {i}"),
            200,
            i % 2 == 1,
            true,
        );
        let (_, u) = ask(&c, &gw, i % 2 == 0, &b).await;
        assert_transferred(&u.expect("usage"));
    }
    // Every request met both broken decodes first, then d0, with one prefill each: the
    // kv_transfer_params were reused, the prefill not run again.
    assert_eq!(broken.hits(), n);
    assert!(closer.hits() >= n);
    wait_totals(&c, &[&p], (n as u64, n as u64)).await;
    wait_totals(&c, &[&d], (n as u64, n as u64 * MAX)).await;
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric_sum(&m, "switchyard_retries_total", &[]),
        2.0 * n as f64
    );
    assert_settled(&c, &gw).await;
}

#[tokio::test]
async fn sglang_retries_a_failed_decode_with_a_new_room() {
    // A recording prefill shows each pair's room; the real decode emulator serves the last.
    let rp = Recorder::start("rp").await;
    let d = engine(&["--role", "decode"]);
    let broken = FakeEngine::start(Fake::Status500).await;
    let closer = FakeEngine::start(Fake::Drop).await;
    let gw = start_gateway(&flags(
        &[
            rp.backend(",role=prefill,name=rp"),
            fake_backend(&broken, "decode", "broken"),
            fake_backend(&closer, "decode", "closer"),
            role_backend(&d, "decode", "d0"),
        ],
        &failing_flags("sglang"),
    ));
    let c = client();
    let n = 4;
    for i in 0..n {
        let b = body(
            true,
            &format!("sglang decode retry {i}"),
            200,
            i % 2 == 1,
            true,
        );
        let (_, u) = ask(&c, &gw, true, &b).await;
        assert_transferred(&u.expect("usage"));
    }
    assert_eq!(broken.hits(), n);
    assert!(closer.hits() >= n);
    wait_totals(&c, &[&d], (n as u64, n as u64 * MAX)).await;
    // Every pair had its own room (dropped prefills may not have arrived).
    let rooms: Vec<u64> = rp
        .bodies()
        .iter()
        .map(|b| b["bootstrap_room"].as_u64().expect("room"))
        .collect();
    let distinct: std::collections::HashSet<_> = rooms.iter().collect();
    assert!(rooms.len() >= n, "{rooms:?}");
    assert_eq!(distinct.len(), rooms.len(), "{rooms:?}");
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric_sum(&m, "switchyard_retries_total", &[]),
        2.0 * n as f64
    );
    assert_settled(&c, &gw).await;
}

/// The error a client gets: status, OpenAI-shaped body, its code and message.
fn error_of(r: &Reply) -> (u16, String, String) {
    let v = r.json();
    let e = &v["error"];
    assert!(
        e["type"].is_string() && e["message"].is_string(),
        "{}",
        r.text
    );
    (
        r.status,
        e["code"].as_str().unwrap_or_default().to_string(),
        e["message"].as_str().unwrap_or_default().to_string(),
    )
}

async fn clear_errors_when_everything_fails(style: &str) {
    let p = engine(&["--role", "prefill"]);
    let d = engine(&["--role", "decode"]);
    let broken = FakeEngine::start(Fake::Status500).await;
    let busy = FakeEngine::start(Fake::Status429).await;
    let closer = FakeEngine::start(Fake::Drop).await;
    let hang = FakeEngine::start(Fake::Hang).await;
    let c = client();
    let mut extra = failing_flags(style);
    extra.extend(["--upstream-timeout", "1"]);
    let b = body(true, &format!("{style} doomed"), 100, false, false);

    // Every prefill fails: 502 naming the leg and each failure.
    let gw = start_gateway(&flags(
        &[
            fake_backend(&broken, "prefill", "broken"),
            fake_backend(&busy, "prefill", "busy"),
            role_backend(&d, "decode", "d0"),
        ],
        &extra,
    ));
    let r = post(&c, &gw.url("/v1/chat/completions"), &b).await;
    assert_settled(&c, &gw).await;
    let (status, code, message) = error_of(&r);
    assert_eq!(
        (status, code.as_str()),
        (502, "upstream_error"),
        "{message}"
    );
    assert!(
        message.contains("prefill") && message.contains("broken: HTTP 500 (boom)"),
        "{message}"
    );
    assert!(message.contains("busy: HTTP 429"), "{message}");
    assert!(r.header("x-request-id").is_some());

    // Every prefill busy: 503 with Retry-After.
    let gw = start_gateway(&flags(
        &[
            fake_backend(&busy, "prefill", "busy"),
            role_backend(&d, "decode", "d0"),
        ],
        &extra,
    ));
    let r = post(&c, &gw.url("/v1/chat/completions"), &b).await;
    assert_settled(&c, &gw).await;
    let (status, code, message) = error_of(&r);
    assert_eq!(
        (status, code.as_str()),
        (503, "no_healthy_backend"),
        "{message}"
    );
    assert!(r.header("retry-after").is_some());

    // Every decode fails: 502 naming the decode leg.
    let gw = start_gateway(&flags(
        &[
            role_backend(&p, "prefill", "p0"),
            fake_backend(&broken, "decode", "broken"),
            fake_backend(&closer, "decode", "closer"),
        ],
        &extra,
    ));
    let r = post(&c, &gw.url("/v1/chat/completions"), &b).await;
    assert_settled(&c, &gw).await;
    let (status, code, message) = error_of(&r);
    assert_eq!(
        (status, code.as_str()),
        (502, "upstream_error"),
        "{message}"
    );
    assert!(
        message.contains("decode") && message.contains("broken") && message.contains("closer"),
        "{message}"
    );

    // A decode that never answers: 504 after --upstream-timeout, never a hang.
    let gw = start_gateway(&flags(
        &[
            role_backend(&p, "prefill", "p0"),
            fake_backend(&hang, "decode", "hang"),
        ],
        &extra,
    ));
    let t0 = std::time::Instant::now();
    let r = post(&c, &gw.url("/v1/chat/completions"), &b).await;
    assert_settled(&c, &gw).await;
    let (status, code, _) = error_of(&r);
    assert_eq!((status, code.as_str()), (504, "upstream_timeout"));
    assert!(t0.elapsed() < Duration::from_secs(20));

    // A prefill that never answers: 504 too.
    let gw = start_gateway(&flags(
        &[
            fake_backend(&hang, "prefill", "hang"),
            role_backend(&d, "decode", "d0"),
        ],
        &extra,
    ));
    let r = post(&c, &gw.url("/v1/chat/completions"), &b).await;
    assert_settled(&c, &gw).await;
    let (status, code, _) = error_of(&r);
    assert_eq!((status, code.as_str()), (504, "upstream_timeout"));

    // Nothing listening where the prefill should be: 503.
    let gone = format!("127.0.0.1:{},models={MODEL},role=prefill", closed_port());
    let gw = start_gateway(&flags(&[gone, role_backend(&d, "decode", "d0")], &extra));
    let r = post(&c, &gw.url("/v1/chat/completions"), &b).await;
    assert_settled(&c, &gw).await;
    let (status, code, message) = error_of(&r);
    assert_eq!(
        (status, code.as_str()),
        (503, "no_healthy_backend"),
        "{message}"
    );
}

#[tokio::test]
async fn nixl_failures_end_in_clear_errors() {
    clear_errors_when_everything_fails("nixl").await;
}

#[tokio::test]
async fn sglang_failures_end_in_clear_errors() {
    clear_errors_when_everything_fails("sglang").await;
}

#[tokio::test]
async fn the_emulator_refuses_legs_of_the_wrong_role() {
    // The premise of the wrong-role test below: a misrouted leg fails loudly.
    let p = engine(&["--role", "prefill"]);
    let d = engine(&["--role", "decode"]);
    let c = client();
    let plain = json!({"model": MODEL, "prompt": "plain", "max_tokens": 3});
    let mut prefill_leg = plain.clone();
    prefill_leg["kv_transfer_params"] = json!({"do_remote_decode": true});
    let mut decode_leg = plain.clone();
    decode_leg["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_block_ids": []});
    for (target, b) in [(&p, &plain), (&p, &decode_leg), (&d, &prefill_leg)] {
        let r = post(&c, &target.url("/v1/completions"), b).await;
        assert_eq!(r.status, 400, "{}", r.text);
        assert!(r.text.contains("does not accept"), "{}", r.text);
    }
    // A decode instance serves a plain request whole (what selective disaggregation needs).
    let r = post(&c, &d.url("/v1/completions"), &plain).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
}

/// Sends a mix of requests (short and long, chat and completions, streamed and not); returns
/// how many were split (the others ran whole on one instance).
async fn mixed_traffic(c: &reqwest::Client, gw: &Proc, tag: &str, n: usize) -> u64 {
    let mut split = 0;
    for i in 0..n {
        let tokens = if i % 2 == 0 { LONG } else { 40 };
        let chat_api = i % 3 != 0;
        let b = body(chat_api, &format!("{tag} {i}"), tokens, i % 4 == 1, true);
        let (r, u) = ask(c, gw, chat_api, &b).await;
        if r.header("x-switchyard-prefill").is_some() {
            split += 1;
            assert_transferred(&u.expect("usage"));
        }
    }
    split
}

#[tokio::test]
async fn nothing_ever_reaches_an_instance_of_the_wrong_role() {
    let prefills = [
        engine(&["--role", "prefill"]),
        engine(&["--role", "prefill"]),
    ];
    let decodes = [engine(&["--role", "decode"]), engine(&["--role", "decode"])];
    let mut backends = Vec::new();
    for (i, p) in prefills.iter().enumerate() {
        backends.push(role_backend(p, "prefill", &format!("p{i}")));
    }
    for (i, d) in decodes.iter().enumerate() {
        backends.push(role_backend(d, "decode", &format!("d{i}")));
    }
    let c = client();
    let n = 12;
    let mut split = 0;
    let mut runs = 0;
    // Both styles, under the default policy (which may keep short prompts whole on a decode
    // instance) and under one that always splits.
    for style in ["nixl", "sglang"] {
        for policy in ["cost", SPLITTING] {
            let tag = format!("{style} {policy}");
            let extra = [
                "--debug-header",
                "--pd-style",
                style,
                "--policy",
                policy,
                "--admin-token",
                ADMIN,
            ];
            let gw = start_gateway(&flags(&backends, &extra));
            let s = mixed_traffic(&c, &gw, &tag, n).await;
            if policy == SPLITTING {
                assert_eq!(s, n as u64, "{tag}");
            }
            split += s;
            runs += 1;
            let m = gateway_metrics(&c, &gw).await;
            // No engine refused anything (a wrong-role leg gets a 400 from the emulator).
            assert_eq!(
                metric_sum(
                    &m,
                    "switchyard_requests_total",
                    &["outcome=\"client_error\""]
                ),
                0.0,
                "{tag}: {m}"
            );
            assert_settled(&c, &gw).await;
        }
    }
    let total = runs * n as u64;
    // Prefill instances finished one one-token prefill per split request and nothing else;
    // decode instances finished every request exactly once, each with all its tokens.
    let p: Vec<&Proc> = prefills.iter().collect();
    let d: Vec<&Proc> = decodes.iter().collect();
    wait_totals(&c, &p, (split, split)).await;
    wait_totals(&c, &d, (total, total * MAX)).await;
    for e in &prefills {
        let (finished, generated) = engine_totals(&c, e).await;
        assert_eq!(
            finished, generated,
            "a prefill instance only ever prefilled"
        );
    }
}

#[tokio::test]
async fn a_mixed_fleet_serves_every_request_on_a_fitting_role() {
    let both = engine(&[]);
    let p = engine(&["--role", "prefill"]);
    let d = engine(&["--role", "decode"]);
    let gw = start_gateway(&flags(
        &[
            role_backend(&both, "both", "b0"),
            role_backend(&p, "prefill", "p0"),
            role_backend(&d, "decode", "d0"),
        ],
        &["--debug-header"],
    ));
    let c = client();
    let n = 12;
    let split = mixed_traffic(&c, &gw, "mixed", n).await;
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric_sum(
            &m,
            "switchyard_requests_total",
            &["outcome=\"client_error\""]
        ),
        0.0,
        "{m}"
    );
    // Whatever the router chose, every request ended once on an instance that decodes, and the
    // prefill-only instance saw only the prefill legs of split requests.
    wait_totals(&c, &[&p], (split, split)).await;
    wait_totals(&c, &[&both, &d], (n as u64, n as u64 * MAX)).await;
}
