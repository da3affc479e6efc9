//! The gateway with LoRA adapters, against real `switchyard engine` processes with adapter
//! slots: requests naming an adapter (model = adapter name, as vLLM takes them) reach only
//! backends that hold it, `/v1/models` lists every adapter, and with
//! `--dynamic-lora-placement` a hot adapter is loaded onto another backend
//! (`/v1/load_lora_adapter`) without swapping back and forth when demand swings; a failing load
//! is counted and not retried within the cooldown.

mod gateway_support;
mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use gateway_support::*;
use serde_json::{json, Value};

/// A short completion for `model` (a base model or an adapter).
async fn complete(c: &reqwest::Client, gw: &Proc, model: &str) -> Reply {
    let body = json!({"model": model, "prompt": format!("{model}: hello"), "max_tokens": 2});
    post(c, &gw.url("/v1/completions"), &body).await
}

/// The adapters a process lists in `/v1/models`: id -> root (its path).
async fn adapters_of(c: &reqwest::Client, p: &Proc) -> BTreeMap<String, String> {
    let r = get_with(c, &p.url("/v1/models"), &[]).await;
    r.json()["data"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|m| !m["parent"].is_null())
        .map(|m| {
            (
                m["id"].as_str().unwrap_or_default().to_string(),
                m["root"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// `GET /metrics` of a process.
async fn metrics(c: &reqwest::Client, p: &Proc) -> String {
    get_with(c, &p.url("/metrics"), &[]).await.text
}

/// Every placement action the gateway counted: (backend, adapter, action, outcome) -> count.
fn placements(text: &str) -> BTreeMap<(String, String, String, String), f64> {
    let name = "switchyard_adapter_placements_total{";
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with(name)) {
        let Some((labels, value)) = line[name.len()..].split_once("} ") else {
            continue;
        };
        let label = |key: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{key}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        out.insert(
            (
                label("backend"),
                label("adapter"),
                label("action"),
                label("outcome"),
            ),
            value.trim().parse().unwrap_or(0.0),
        );
    }
    out
}

/// The gateway's demand gauge for `adapter` (requests/s at its last plan), if published.
fn demand(text: &str, adapter: &str) -> Option<f64> {
    let prefix = format!("switchyard_adapter_demand{{adapter=\"{adapter}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

/// Sends requests for `model` until the gateway's published demand satisfies `until`; the
/// gauge is set by a placement plan, so the plan saw that demand.
async fn drive(
    c: &reqwest::Client,
    gw: &Proc,
    model: &str,
    until: impl Fn(&str) -> bool,
    what: &str,
) {
    let reached = poll(Duration::from_secs(30), || async {
        let r = complete(c, gw, model).await;
        assert_eq!(r.status, 200, "{}", r.text);
        until(&metrics(c, gw).await).then_some(())
    })
    .await;
    assert!(reached.is_some(), "{what} never happened");
}

/// Waits (idle) until the gateway's published demand satisfies `until`.
async fn settle(c: &reqwest::Client, gw: &Proc, until: impl Fn(&str) -> bool, what: &str) {
    let reached = poll(Duration::from_secs(30), || async {
        until(&metrics(c, gw).await).then_some(())
    })
    .await;
    assert!(reached.is_some(), "{what} never happened");
}

#[tokio::test]
async fn adapter_requests_reach_only_the_backends_that_hold_them() {
    let two = engine(&[
        "--max-loras",
        "2",
        "--lora-modules",
        "sql-lora=/adapters/sql",
        "chat-lora=/adapters/chat",
    ]);
    let one = engine(&[
        "--max-loras",
        "1",
        "--lora-modules",
        "code-lora=/adapters/code",
    ]);
    let plain = engine(&["--max-loras", "1"]);
    // Models and adapters discovered from /v1/models. A path alone does not enable placement.
    let gw = gateway(&[
        "--backend",
        &two.base,
        "--backend",
        &one.base,
        "--backend",
        &plain.base,
        "--debug-header",
        "--admin-token",
        "tok",
        "--lora-path",
        "sql-lora=/adapters/sql",
        // An unknown adapter name is refused below, not sent to the only base model.
        "--strict-models",
    ]);
    let c = client();

    // The gateway lists every adapter once, with its base model.
    let listed = poll(Duration::from_secs(10), || async {
        let r = get_with(&c, &gw.url("/v1/models"), &[]).await;
        let data = r.json()["data"].as_array().cloned().unwrap_or_default();
        (data.len() == 4).then_some(data)
    })
    .await
    .expect("the model and three adapters listed");
    for adapter in ["sql-lora", "chat-lora", "code-lora"] {
        let card = listed
            .iter()
            .find(|m| m["id"] == adapter)
            .unwrap_or_else(|| panic!("{adapter} listed: {listed:?}"));
        assert_eq!(card["parent"], MODEL);
    }

    // Each adapter only where it is registered; the base model anywhere.
    for (adapter, holder) in [("sql-lora", &two), ("chat-lora", &two), ("code-lora", &one)] {
        for _ in 0..6 {
            let r = complete(&c, &gw, adapter).await;
            assert_eq!(r.status, 200, "{}", r.text);
            assert_eq!(r.json()["model"], adapter);
            assert_eq!(
                r.header("x-switchyard-backend").as_deref(),
                Some(holder.authority().as_str()),
                "{adapter}"
            );
        }
    }
    // Unrelated prompts (one repeated prompt would rightly stay where it is cached).
    let mut bases = std::collections::BTreeSet::new();
    for i in 0..24 {
        let body = json!({"model": MODEL, "prompt": format!("{i} unrelated base request"), "max_tokens": 2});
        let r = post(&c, &gw.url("/v1/completions"), &body).await;
        assert_eq!(r.status, 200, "{}", r.text);
        bases.insert(r.header("x-switchyard-backend").unwrap_or_default());
    }
    assert!(
        bases.len() >= 2,
        "base model requests all went to {bases:?}"
    );
    let r = complete(&c, &gw, "no-such-lora").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");

    // The engine's own LoRA metrics: while a long sql-lora stream runs, `two` reports it
    // running (vllm:lora_requests_info) and the others never run it.
    let long = json!({
        "model": "sql-lora", "prompt": "SELECT", "max_tokens": 8000, "stream": true,
    });
    let stream_client = c.clone();
    let stream_url = gw.url("/v1/completions");
    let stream = tokio::spawn(async move { post(&stream_client, &stream_url, &long).await });
    let seen = poll(Duration::from_secs(20), || async {
        metrics(&c, &two)
            .await
            .lines()
            .any(|l| {
                l.starts_with("vllm:lora_requests_info{")
                    && l.contains("max_lora=\"2\"")
                    && l.contains("running_lora_adapters=\"sql-lora\"")
            })
            .then_some(())
    })
    .await;
    assert!(seen.is_some(), "the engine never reported sql-lora running");
    let r = stream.await.expect("stream task");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-switchyard-backend").as_deref(),
        Some(two.authority().as_str())
    );
    for other in [&one, &plain] {
        let text = metrics(&c, other).await;
        assert!(!text.contains("sql-lora"), "{text}");
        assert!(text.contains("max_lora=\"1\""));
    }

    // The gateway knows each backend's slots from the engine's max_lora.
    let fleet = get_with(
        &c,
        &gw.url("/admin/fleet"),
        &[("authorization", "Bearer tok")],
    )
    .await;
    let slots: BTreeMap<String, Value> = fleet.json()["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .map(|b| {
            (
                b["name"].as_str().unwrap_or_default().to_string(),
                b["engine"]["metrics"]["max_adapters"].clone(),
            )
        })
        .collect();
    assert_eq!(slots[&two.authority()], 2);
    assert_eq!(slots[&one.authority()], 1);

    // Placement is off by default: nothing was loaded anywhere, nothing counted.
    assert!(!adapters_of(&c, &plain).await.contains_key("sql-lora"));
    let text = metrics(&c, &gw).await;
    assert!(placements(&text).is_empty(), "{text}");
    assert!(demand(&text, "sql-lora").is_none());
}

#[tokio::test]
async fn a_hot_adapter_is_loaded_onto_another_backend_and_swings_do_not_thrash() {
    // `full` holds x, y and z in its 3 slots; `spare` has one empty slot.
    let full = engine(&[
        "--max-loras",
        "3",
        "--lora-modules",
        "x=/adapters/x",
        "y=/adapters/y",
        "z=/adapters/z",
    ]);
    let spare = engine(&["--max-loras", "1"]);
    // z has no path: it is never loaded anywhere.
    let mut gw = gateway(&[
        "--backend",
        &full.base,
        "--backend",
        &spare.base,
        "--debug-header",
        "--dynamic-lora-placement",
        "--lora-path",
        "x=/adapters/x",
        "--lora-path",
        "y=/adapters/y",
        "--placement-interval",
        "0.1",
        "--placement-half-life",
        "0.5",
        "--placement-scale-up-rps",
        "3",
        "--placement-scale-down-rps",
        "0.5",
        "--placement-cooldown",
        "120",
        "--placement-min-residency",
        "120",
    ]);
    let c = client();
    let ready = poll(Duration::from_secs(10), || async {
        (adapters_of(&c, &gw).await.len() == 3).then_some(())
    })
    .await;
    assert!(ready.is_some(), "adapters discovered");
    let hot = |adapter: &'static str| move |t: &str| demand(t, adapter).is_some_and(|d| d > 3.0);

    // z is hot but has no path: a plan sees it hot and does nothing.
    drive(&c, &gw, "z", hot("z"), "z demand over the scale-up rate").await;

    // x is hot: it is loaded onto `spare`, from its configured path.
    let loaded = poll(Duration::from_secs(30), || async {
        let r = complete(&c, &gw, "x").await;
        assert_eq!(r.status, 200, "{}", r.text);
        adapters_of(&c, &spare).await.get("x").cloned()
    })
    .await;
    assert_eq!(loaded.as_deref(), Some("/adapters/x"), "x never loaded");
    // The fleet view has it at once: x requests now also reach `spare`.
    let reached = poll(Duration::from_secs(10), || async {
        let r = complete(&c, &gw, "x").await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.json()["model"], "x");
        (r.header("x-switchyard-backend").as_deref() == Some(spare.authority().as_str()))
            .then_some(())
    })
    .await;
    assert!(reached.is_some(), "no x request reached the new holder");

    // The swing: x goes cold (one holder fewer would be below the scale-down rate) while y
    // gets hot (it would take x's slot on `spare`): the cooldown and the residency time keep
    // everything where it is.
    drive(
        &c,
        &gw,
        "y",
        |t| demand(t, "y").is_some_and(|d| d > 3.0) && demand(t, "x").is_some_and(|d| d < 0.25),
        "y hot while x is cold",
    )
    .await;
    // And back: x hot again.
    drive(&c, &gw, "x", hot("x"), "x hot again").await;
    settle(
        &c,
        &gw,
        |t| demand(t, "x").is_some_and(|d| d < 0.25) && demand(t, "y").is_some_and(|d| d < 0.25),
        "quiet",
    )
    .await;

    let counted = placements(&metrics(&c, &gw).await);
    let expected: BTreeMap<_, _> = [(
        (
            spare.authority(),
            "x".to_string(),
            "load".to_string(),
            "ok".to_string(),
        ),
        1.0,
    )]
    .into_iter()
    .collect();
    assert_eq!(counted, expected, "exactly one load over the whole window");
    assert_eq!(
        adapters_of(&c, &spare).await.keys().collect::<Vec<_>>(),
        vec!["x"]
    );
    assert_eq!(adapters_of(&c, &full).await.len(), 3);

    // Shutdown stops the placement task with the rest.
    gw.terminate();
    assert_eq!(gw.wait_exit(Duration::from_secs(15)), Some(0));
}

#[tokio::test]
async fn a_failed_load_is_counted_and_not_retried_within_the_cooldown() {
    let holder = engine(&["--max-loras", "2", "--lora-modules", "x=/adapters/x"]);
    // Passes health checks, answers 429 to everything else (the load call included).
    let broken = FakeEngine::start(Fake::Status429).await;
    let broken_backend = format!("{},adapter_slots=2,name=broken", broken.backend());
    let gw = gateway(&[
        "--backend",
        &holder.base,
        "--backend",
        &broken_backend,
        "--dynamic-lora-placement",
        "--lora-path",
        "x=/adapters/x",
        "--placement-interval",
        "0.1",
        "--placement-half-life",
        "0.5",
        "--placement-scale-up-rps",
        "3",
        "--placement-scale-down-rps",
        "0.5",
        "--placement-cooldown",
        "120",
    ]);
    let c = client();
    let ready = poll(Duration::from_secs(10), || async {
        adapters_of(&c, &gw).await.contains_key("x").then_some(())
    })
    .await;
    assert!(ready.is_some(), "x discovered");
    let key = (
        "broken".to_string(),
        "x".to_string(),
        "load".to_string(),
        "error".to_string(),
    );
    drive(
        &c,
        &gw,
        "x",
        |t| placements(t).get(&key) == Some(&1.0),
        "the failed load counted",
    )
    .await;
    // Demand stays high over ten more plans (each publishes a new gauge value): no second
    // attempt on the broken backend.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (mut plans, mut last) = (0, None);
    while plans < 10 {
        assert!(
            std::time::Instant::now() < deadline,
            "demand did not stay high over ten plans"
        );
        let r = complete(&c, &gw, "x").await;
        assert_eq!(r.status, 200, "{}", r.text);
        let d = demand(&metrics(&c, &gw).await, "x");
        if d.is_some_and(|d| d > 3.0) && d != last {
            plans += 1;
            last = d;
        }
    }
    let text = metrics(&c, &gw).await;
    assert_eq!(placements(&text).get(&key), Some(&1.0), "{text}");
    assert_eq!(placements(&text).len(), 1, "{text}");
    // Only the load call reached the broken backend: no x request was routed there.
    assert_eq!(broken.hits(), 1);
}
