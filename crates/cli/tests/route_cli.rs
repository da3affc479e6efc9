//! `switchyard route` against fleet files.

use std::process::Command;

fn switchyard(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .output()
        .expect("runs")
}

fn temp_file(name: &str, contents: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("switchyard-route-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
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
