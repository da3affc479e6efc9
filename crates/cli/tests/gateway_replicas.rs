//! Two `switchyard serve` replicas in front of the same emulated engines, told of each other
//! with `--peer`: a conversation one replica placed continues on the same engine through the
//! other, the other counts the first one's requests as load, and forgets them when the first
//! one dies. With `--peer-dns` they find each other by resolving a name.

mod gateway_support;
mod support;

use std::time::Duration;

use gateway_support::*;
use serde_json::json;

const TOKEN: &str = "replica-token";

/// `RUST_LOG` with the default filter and the `--peer-dns` resolver at debug.
const DNS_DEBUG: &str = "warn,kube_client=off,switchyard_gateway::peer_dns=debug";

fn replica(port: u16, peer: u16, backends: &[String]) -> Proc {
    replica_with(port, peer, backends, &[])
}

fn replica_with(port: u16, peer: u16, backends: &[String], extra: &[&str]) -> Proc {
    let listen = format!("127.0.0.1:{port}");
    let peer = format!("http://127.0.0.1:{peer}");
    let mut args = vec![
        "--listen",
        &listen,
        "--peer",
        &peer,
        "--admin-token",
        TOKEN,
        "--debug-header",
    ];
    args.extend_from_slice(extra);
    for b in backends {
        args.extend(["--backend", b.as_str()]);
    }
    gateway(&args)
}

/// A replica that finds its peer by resolving `localhost` on `peer` (`--peer-dns`), every 0.1 s.
fn dns_replica(port: u16, peer: u16, backends: &[String]) -> Proc {
    let listen = format!("127.0.0.1:{port}");
    let peer = format!("localhost:{peer}");
    let mut args = vec![
        "--listen",
        &listen,
        "--peer-dns",
        &peer,
        "--peer-dns-interval",
        "0.1",
        "--admin-token",
        TOKEN,
        "--debug-header",
    ];
    for b in backends {
        args.extend(["--backend", b.as_str()]);
    }
    gateway(&args)
}

/// The replica's peer URLs (`/admin/fleet`), without a trailing slash.
async fn peer_urls(c: &reqwest::Client, gw: &Proc) -> Vec<String> {
    let fleet = get_with(
        c,
        &gw.url("/admin/fleet"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
    )
    .await
    .json();
    fleet["peers"]["urls"]
        .as_array()
        .map(|urls| {
            urls.iter()
                .filter_map(|u| u.as_str())
                .map(|u| u.trim_end_matches('/').to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Requests the replica counts in flight over all backends (`/admin/fleet`).
async fn in_flight(c: &reqwest::Client, gw: &Proc) -> u64 {
    let fleet = get_with(
        c,
        &gw.url("/admin/fleet"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
    )
    .await
    .json();
    in_flight_in(&fleet)
}

/// Requests one `/admin/fleet` snapshot counts in flight over all backends.
fn in_flight_in(fleet: &serde_json::Value) -> u64 {
    fleet["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .map(|b| {
            b["router_load"]["pending_requests"].as_u64().unwrap_or(0)
                + b["router_load"]["running_requests"].as_u64().unwrap_or(0)
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_share_decisions_continue_each_others_conversations() {
    let engines = [engine_on(0, &[]), engine_on(0, &[])];
    let backends: Vec<String> = engines.iter().map(backend).collect();
    let (port_a, port_b) = (closed_port(), closed_port());
    let a = replica(port_a, port_b, &backends);
    let mut b = replica(port_b, port_a, &backends);
    let c = client();

    // Four conversations, each started on A and continued on B: without the shared decisions B
    // would pick between two idle engines with nothing cached for it (by chance right for all
    // four one time in sixteen).
    for conversation in 0..4 {
        let tag = format!("replica-conversation-{conversation}");
        let served = |r: &Reply| r.header("x-switchyard-backend");
        continue_on_peer(&c, &a.url("/v1/completions"), served, &b, &tag).await;
    }

    // A long generation through B is counted by A while it runs ...
    let long = json!({"model": MODEL, "prompt": prompt("replica-long", 50), "max_tokens": 3000, "stream": true});
    let stream = tokio::spawn({
        let c = c.clone();
        let url = b.url("/v1/completions");
        // Read to the end: dropping the answer would cancel the request.
        async move {
            let r = c.post(url).json(&long).send().await?;
            r.text().await
        }
    });
    // Held for a peer, not merely in flight: A's own last turn may still be settling there.
    let counted = poll(Duration::from_secs(10), || async {
        let fleet = get_with(
            &c,
            &a.url("/admin/fleet"),
            &[("authorization", &format!("Bearer {TOKEN}"))],
        )
        .await
        .json();
        (fleet["peers"]["held_for_peers"].as_u64() >= Some(1)).then_some(fleet)
    })
    .await;
    let Some(fleet) = counted else {
        panic!("A never counted B's request");
    };
    // The same snapshot: on an instant engine the generation may end before a second look.
    assert!(in_flight_in(&fleet) >= 1, "{fleet}");
    assert_eq!(
        fleet["peers"]["urls"][0]
            .as_str()
            .map(|u| u.trim_end_matches('/')),
        Some(format!("http://127.0.0.1:{port_b}").as_str())
    );
    // ... and forgotten once B is gone (its heartbeats stop).
    b.kill();
    let forgotten = poll(Duration::from_secs(20), || async {
        (in_flight(&c, &a).await == 0).then_some(())
    })
    .await;
    assert!(
        forgotten.is_some(),
        "A still counts the dead replica's request"
    );
    let _ = stream.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_found_by_dns_continue_each_others_conversations() {
    // Both replicas listen on 127.0.0.1, where `localhost` resolves for both: each is given the
    // other's port (leaving itself out of what a name resolves to is unit-tested in
    // crates/gateway/src/peer_dns.rs).
    let engines = [engine_on(0, &[]), engine_on(0, &[])];
    let backends: Vec<String> = engines.iter().map(backend).collect();
    let (port_a, port_b) = (closed_port(), closed_port());
    let a = dns_replica(port_a, port_b, &backends);
    let b = dns_replica(port_b, port_a, &backends);
    let c = client();
    for (gw, other) in [(&a, port_b), (&b, port_a)] {
        let want = vec![format!("http://127.0.0.1:{other}")];
        let found = poll(Duration::from_secs(10), || async {
            (peer_urls(&c, gw).await == want).then_some(())
        })
        .await;
        assert!(
            found.is_some(),
            "no peer found by DNS: {:?}",
            peer_urls(&c, gw).await
        );
    }
    // The lookups and what they found are counted.
    let m = get_with(&c, &a.url("/metrics"), &[]).await.text;
    let lookups = metric_sum(&m, "switchyard_peer_dns_lookups_total", &["result=\"ok\""]);
    assert!(lookups >= 1.0, "{m}");
    assert_eq!(metric_sum(&m, "switchyard_peer_dns_peers", &[]), 1.0, "{m}");
    // Conversations started on A continue on B on the engine A picked, with the first turn
    // cached (two idle engines: all three right by chance one time in eight).
    for conversation in 0..3 {
        let tag = format!("dns-replica-conversation-{conversation}");
        let served = |r: &Reply| r.header("x-switchyard-backend");
        continue_on_peer(&c, &a.url("/v1/completions"), served, &b, &tag).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_both_legs_of_a_disaggregated_request() {
    // Two prefill and two decode engines; `cost` told to hand every prompt off.
    let prefills = [
        engine(&["--role", "prefill"]),
        engine(&["--role", "prefill"]),
    ];
    let decodes = [engine(&["--role", "decode"]), engine(&["--role", "decode"])];
    let mut backends = Vec::new();
    for (i, p) in prefills.iter().enumerate() {
        backends.push(format!("{},role=prefill,name=p{i}", backend(p)));
    }
    for (i, d) in decodes.iter().enumerate() {
        backends.push(format!("{},role=decode,name=d{i}", backend(d)));
    }
    let config = support::temp_file(
        "replicas-pd.json",
        r#"{"cost": {"local_prefill_max_tokens": 0}}"#,
    );
    let config = config.to_str().expect("utf-8 path").to_string();
    let extra = ["--router-config", config.as_str()];
    let (port_a, port_b) = (closed_port(), closed_port());
    let a = replica_with(port_a, port_b, &backends, &extra);
    let b = replica_with(port_b, port_a, &backends, &extra);
    let c = client();
    // Four conversations started on A and continued on B: B puts each next turn on the prefill
    // engine A's prefill leg went to and the decode engine holding the first turn. Without both
    // legs shared, B would pick each between two idle engines (both right for all four by
    // chance one time in 256).
    for conversation in 0..4 {
        let first_turn = prompt(&format!("replica-pd-{conversation}"), 600);
        let before = peer_messages_applied(&c, &b).await;
        let body = json!({"model": MODEL, "prompt": first_turn, "max_tokens": 2});
        let first = post(&c, &a.url("/v1/completions"), &body).await;
        assert_eq!(first.status, 200, "{}", first.text);
        let legs = |r: &Reply| {
            (
                r.header("x-switchyard-prefill"),
                r.header("x-switchyard-backend"),
            )
        };
        let (prefill, decode) = legs(&first);
        assert!(
            prefill.is_some(),
            "handed off: {:?}",
            first.header("x-switchyard-decision")
        );
        // Each leg's pick and end reach B.
        let heard = poll(Duration::from_secs(10), || async {
            (peer_messages_applied(&c, &b).await >= before + 4.0).then_some(())
        })
        .await;
        assert!(heard.is_some(), "B did not hear both legs");
        let next = format!("{first_turn} and then the next question");
        let body = json!({"model": MODEL, "prompt": next, "max_tokens": 2});
        let second = post(&c, &b.url("/v1/completions"), &body).await;
        assert_eq!(second.status, 200, "{}", second.text);
        assert_eq!(
            legs(&second),
            (prefill, decode),
            "{}",
            second.header("x-switchyard-decision").unwrap_or_default()
        );
    }
}

#[tokio::test]
async fn peer_sync_is_refused_without_the_token_or_the_flag() {
    let engine = engine(&[]);
    let c = client();
    let plain = gateway(&["--backend", &backend(&engine), "--admin-token", TOKEN]);
    let auth = [("authorization", format!("Bearer {TOKEN}"))];
    let batch = "{\"origin\":1}\n";
    let r = c
        .post(plain.url("/admin/peer-sync"))
        .header(auth[0].0, &auth[0].1)
        .body(batch)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "a gateway without --peer takes no batches");
    let port = closed_port();
    let peered = replica(0, port, &[backend(&engine)]);
    let r = c
        .post(peered.url("/admin/peer-sync"))
        .body(batch)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let r = c
        .post(peered.url("/admin/peer-sync"))
        .header(auth[0].0, &auth[0].1)
        .body("not json\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = c
        .post(peered.url("/admin/peer-sync"))
        .header(auth[0].0, &auth[0].1)
        .body("{\"origin\":1}\n{\"failed\":{\"id\":9}}\n{\"routed\":{\"id\":1,\"backend\":\"nope\",\"endpoint\":\"chat\",\"body\":{}}}\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let answer: serde_json::Value = r.json().await.unwrap();
    assert_eq!(answer, json!({"applied": 0, "ignored": 2}));

    // A peer's request counts as load here until a heartbeat no longer lists it (its end was
    // lost on the way).
    let name = engine.authority();
    let routed = json!({"routed": {"id": 5, "backend": name, "endpoint": "completions",
        "body": {"model": MODEL, "prompt": prompt("peer-routed", 100), "max_tokens": 2}}});
    let r = c
        .post(peered.url("/admin/peer-sync"))
        .header(auth[0].0, &auth[0].1)
        .body(format!("{{\"origin\":2}}\n{routed}\n"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["applied"], 1);
    assert_eq!(in_flight(&c, &peered).await, 1);
    let r = c
        .post(peered.url("/admin/peer-sync"))
        .header(auth[0].0, &auth[0].1)
        .body("{\"origin\":2,\"live\":[]}\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(in_flight(&c, &peered).await, 0);

    let err = fails(&[
        "serve",
        "--backend",
        &backend(&engine),
        "--peer",
        "http://127.0.0.1:1",
    ]);
    assert!(err.contains("--peer needs --admin-token"), "{err}");
    let err = fails(&[
        "serve",
        "--backend",
        &backend(&engine),
        "--admin-token",
        "t",
        "--peer",
        "ftp://x",
    ]);
    assert!(err.contains("expected http://HOST:PORT"), "{err}");
    let err = fails(&[
        "serve",
        "--backend",
        &backend(&engine),
        "--peer-dns",
        "localhost:8080",
    ]);
    assert!(err.contains("--peer-dns needs --admin-token"), "{err}");
    let err = fails(&[
        "serve",
        "--backend",
        &backend(&engine),
        "--admin-token",
        "t",
        "--peer-dns",
        "localhost",
    ]);
    assert!(err.contains("port is missing"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_does_not_resolve_leaves_the_replica_serving_and_stopping_cleanly() {
    // `.invalid` never resolves (RFC 6761): every lookup fails.
    let engines = [engine_on(0, &[])];
    let backends: Vec<String> = engines.iter().map(backend).collect();
    let mut args = vec![
        "--peer-dns",
        "replicas.switchyard.invalid:8080",
        "--peer-dns-interval",
        "0.05",
        "--admin-token",
        TOKEN,
    ];
    for b in &backends {
        args.extend(["--backend", b.as_str()]);
    }
    // Debug on for the resolver alone, to see that the later failures go there.
    let mut gw = gateway_logging(&args, &[("RUST_LOG", DNS_DEBUG)]);
    let c = client();
    // Lookups fail, are counted, and keep failing; no peer is found.
    let failed = poll(Duration::from_secs(10), || async {
        let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
        let n = metric_sum(
            &m,
            "switchyard_peer_dns_lookups_total",
            &["result=\"failed\""],
        );
        (n >= 3.0).then_some(m)
    })
    .await
    .expect("failed lookups counted");
    assert_eq!(
        metric_sum(
            &failed,
            "switchyard_peer_dns_lookups_total",
            &["result=\"ok\""]
        ),
        0.0
    );
    assert_eq!(metric_sum(&failed, "switchyard_peer_dns_peers", &[]), 0.0);
    assert!(peer_urls(&c, &gw).await.is_empty());
    // The replica serves on its own meanwhile.
    let reply = post(&c, &gw.url("/v1/chat/completions"), &chat("hello", 4)).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    // One warning however many lookups fail; the later failures at debug (the log lags the
    // counter by a moment, hence the poll).
    let later = poll(Duration::from_secs(10), || async {
        let n = gw
            .log()
            .iter()
            .filter(|l| l.contains("DEBUG") && l.contains("--peer-dns: resolution still failing"))
            .count();
        (n >= 2).then_some(n)
    })
    .await;
    assert!(later.is_some(), "later failures at debug: {:#?}", gw.log());
    let warned: Vec<String> = gw
        .log()
        .into_iter()
        .filter(|l| l.contains("WARN") && l.contains("--peer-dns"))
        .collect();
    assert_eq!(warned.len(), 1, "{warned:#?}");
    assert!(
        warned[0].contains("resolution failing")
            && warned[0].contains("replicas.switchyard.invalid:8080"),
        "{warned:#?}"
    );
    // SIGTERM while lookups go on every 50 ms: it stops promptly and cleanly.
    gw.terminate();
    assert_eq!(gw.wait_exit(Duration::from_secs(10)), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_back_to_back_peer_dns_lookups_exits_promptly_with_status_0() {
    let engine = engine_on(0, &[]);
    let backend = backend(&engine);
    let c = client();
    // A name that resolves (to a peer that is down, its sends failing meanwhile) and one that
    // does not; on the single-threaded runtime (`--worker-threads 1`) and the multi-threaded
    // one, which stop differently.
    let resolving = format!("localhost:{}", closed_port());
    for (name, threads) in [
        (resolving.as_str(), "1"),
        ("replicas.switchyard.invalid:8080", "2"),
    ] {
        let mut gw = gateway(&[
            "--peer-dns",
            name,
            "--peer-dns-interval",
            "0.01",
            "--worker-threads",
            threads,
            "--admin-token",
            TOKEN,
            "--backend",
            &backend,
        ]);
        // Lookups under way, and what they found in place, before the signal.
        let found = poll(Duration::from_secs(10), || async {
            let m = get_with(&c, &gw.url("/metrics"), &[]).await.text;
            let lookups = metric_sum(&m, "switchyard_peer_dns_lookups_total", &[]);
            let peers = metric_sum(&m, "switchyard_peer_dns_peers", &[]);
            let want = if name == resolving { 1.0 } else { 0.0 };
            (lookups >= 5.0 && peers == want).then_some(())
        })
        .await;
        assert!(found.is_some(), "{name}: lookups did not run");
        let reply = post(&c, &gw.url("/v1/chat/completions"), &chat("hello", 4)).await;
        assert_eq!(reply.status, 200, "{name}: {}", reply.text);
        gw.terminate();
        assert_eq!(
            gw.wait_exit(Duration::from_secs(10)),
            Some(0),
            "{name}, --worker-threads {threads}: no clean exit within 10 s of SIGTERM"
        );
    }
}
