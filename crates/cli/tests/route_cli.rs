//! `switchyard route` against fleet files.

mod support;

use std::process::Command;

use support::temp_file;

fn switchyard(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .output()
        .expect("runs")
}

#[test]
fn route_ranks_the_fleet_and_explains_exclusions() {
    let fleet = temp_file(
        "fleet.json",
        r#"{"instances": [
              {"name": "busy", "address": "127.0.0.1:1", "models": ["m"]},
              {"name": "idle", "address": "127.0.0.1:2", "models": ["m"]},
              {"name": "decoder", "address": "127.0.0.1:3", "models": ["m"], "role": "decode"}],
            "metrics": {"busy": {"waiting": 40, "running": 64}}}"#,
    );
    let out = switchyard(&[
        "route",
        "--fleet",
        fleet.to_str().unwrap(),
        "--model",
        "m",
        "--prompt",
        "hello",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<&str> = text.lines().skip(2).collect();
    assert!(rows[0].contains("idle"), "{text}");
    assert!(rows[1].contains("busy"), "{text}");
    assert!(
        rows[2].contains("decoder") && rows[2].contains("WrongRole"),
        "{text}"
    );

    let out = switchyard(&[
        "route",
        "--fleet",
        fleet.to_str().unwrap(),
        "--model",
        "m",
        "--prompt",
        "x",
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["policy"], "cost");
    assert_eq!(json["eligible"], 2);
}

#[test]
fn route_reports_bad_input_clearly() {
    let fleet = temp_file("empty.json", r#"{"instances": []}"#);
    let out = switchyard(&[
        "route",
        "--fleet",
        fleet.to_str().unwrap(),
        "--model",
        "m",
        "--prompt",
        "x",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no instances"));

    let fleet = temp_file(
        "one.json",
        r#"{"instances": [{"name": "a", "models": ["m"]}]}"#,
    );
    let out = switchyard(&[
        "route",
        "--fleet",
        fleet.to_str().unwrap(),
        "--model",
        "other",
        "--prompt",
        "x",
        "--strict-models",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no instance serves model `other`"));

    let out = switchyard(&[
        "route",
        "--fleet",
        fleet.to_str().unwrap(),
        "--model",
        "m",
        "--prompt",
        "x",
        "--policy",
        "nope",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown policy"));
}

#[test]
fn route_resolves_model_names_as_the_gateway_does() {
    let two = temp_file(
        "two.json",
        r#"{"instances": [
              {"name": "a", "models": ["llama"], "adapters": ["sql-lora"]},
              {"name": "b", "models": ["qwen"]}]}"#,
    );
    let fleet = two.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["route", "--fleet", fleet, "--prompt", "x"];
        args.extend_from_slice(extra);
        let out = switchyard(&args);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // An alias to a base model, and to an adapter (routed to its holder).
    let (ok, text, err) = run(&["--model", "gpt-4o", "--model-alias", "gpt-4o=qwen"]);
    assert!(ok, "{err}");
    assert!(
        text.starts_with("model `gpt-4o` -> `qwen` (alias)"),
        "{text}"
    );
    assert!(
        text.lines().nth(3).unwrap_or_default().contains(" b "),
        "{text}"
    );
    let (ok, text, err) = run(&["--model", "sql", "--model-alias", "sql=sql-lora"]);
    assert!(ok, "{err}");
    assert!(
        text.starts_with("model `sql` -> `llama` adapter `sql-lora` (alias)"),
        "{text}"
    );
    // An adapter by its own name, as the gateway takes it.
    let (ok, text, err) = run(&["--model", "sql-lora"]);
    assert!(ok, "{err}");
    assert!(text.contains("(adapter)"), "{text}");
    // Two models: an unknown name is an error; a broken alias names both.
    let (ok, _, err) = run(&["--model", "gpt-4o"]);
    assert!(
        !ok && err.contains("no instance serves model `gpt-4o`"),
        "{err}"
    );
    let (ok, _, err) = run(&["--model", "x", "--model-alias", "x=nowhere"]);
    assert!(
        !ok && err.contains("`x`") && err.contains("`nowhere`"),
        "{err}"
    );
    let (ok, _, err) = run(&["--model", "x", "--model-alias", "x="]);
    assert!(!ok && err.contains("--model-alias"), "{err}");

    // One model: any name goes to it, unless strict.
    let one = temp_file(
        "single.json",
        r#"{"instances": [{"name": "a", "models": ["m"]}]}"#,
    );
    let out = switchyard(&[
        "route",
        "--fleet",
        one.to_str().unwrap(),
        "--model",
        "gpt-4o",
        "--prompt",
        "x",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.starts_with("model `gpt-4o` -> `m` (the fleet's only model)"),
        "{text}"
    );
}

/// The dry run takes the fleet file `serve` takes: its adapters and aliases resolve the same.
#[test]
fn route_takes_the_serve_fleet_file() {
    let fleet = temp_file(
        "serve-fleet.yaml",
        "backends:\n  - address: http://10.0.0.1:8000\n    models: [llama]\n    adapters: [sql-lora]\n  - address: http://10.0.0.2:8000\n    models: [llama]\nmodel_aliases:\n  sql: sql-lora\n",
    );
    let out = switchyard(&[
        "route",
        "--fleet",
        fleet.to_str().unwrap(),
        "--model",
        "sql",
        "--prompt",
        "select 1",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("model `sql` -> `llama` adapter `sql-lora` (alias)"),
        "{text}"
    );
    // Only the backend holding the adapter may take it.
    assert!(
        text.contains("10.0.0.2:8000") && text.contains("AdapterUnavailable"),
        "{text}"
    );
    // A backend whose models the engine would have to be asked for cannot be dry-run.
    let undiscovered = temp_file(
        "serve-fleet-bare.yaml",
        "backends:\n  - address: http://10.0.0.3:8000\n",
    );
    let out = switchyard(&[
        "route",
        "--fleet",
        undiscovered.to_str().unwrap(),
        "--model",
        "m",
        "--prompt",
        "x",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("lists no models"));
}
