//! The documentation keeps up with the binary: every flag a subcommand's `--help` lists is in
//! its document's flags table, and every flag such a table lists still exists.

use std::collections::BTreeSet;
use std::process::Command;

/// The long flags of a `--help` text (`--help` and `--version` aside).
fn help_flags(help: &str) -> BTreeSet<String> {
    help.lines()
        .map(str::trim_start)
        .filter_map(|l| {
            let l = l.strip_prefix("-h, ").unwrap_or(l);
            let l = l.strip_prefix("--")?;
            let name: String = l
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            Some(format!("--{name}"))
        })
        .filter(|f| f != "--help" && f != "--version" && f.len() > 2)
        .collect()
}

/// Every subcommand that takes `--policy` names every policy in its help.
#[test]
fn policy_lists_are_complete() {
    for command in ["serve", "epp", "route"] {
        let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .args([command, "--help"])
            .output()
            .expect("runs");
        let help = String::from_utf8_lossy(&out.stdout).replace('\n', " ");
        for policy in switchyard_core::policy::POLICY_NAMES {
            assert!(
                help.contains(policy),
                "`switchyard {command} --help` lacks {policy}"
            );
        }
    }
}

/// The long flags in the table under `heading` (a `## ` line) of a document.
fn section_flags(doc: &str, heading: &str) -> BTreeSet<String> {
    let section = doc
        .split(&format!("\n{heading}\n"))
        .nth(1)
        .unwrap_or_else(|| panic!("no section {heading}"))
        .split("\n## ")
        .next()
        .unwrap_or_default();
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `--"))
        .filter_map(|l| l.split('`').next())
        .map(|f| format!("--{f}"))
        .collect()
}

/// Every subcommand's flags are in its document's flags table, and nothing more.
#[test]
fn every_subcommands_flags_are_documented() {
    for (command, doc, heading) in [
        (
            "serve",
            "docs/gateway.md",
            "## Flags (`switchyard serve --help`)",
        ),
        ("epp", "docs/epp.md", "## Flags (`switchyard epp --help`)"),
        (
            "route",
            "docs/gateway.md",
            "## Dry run flags (`switchyard route --help`)",
        ),
        (
            "demo",
            "docs/gateway.md",
            "## Demo flags (`switchyard demo --help`)",
        ),
        (
            "sim",
            "docs/simulator.md",
            "## Flags (`switchyard sim --help`)",
        ),
        (
            "engine",
            "docs/emulator.md",
            "## Flags (`switchyard engine --help`)",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .args([command, "--help"])
            .output()
            .expect("runs");
        assert!(out.status.success());
        let help = help_flags(&String::from_utf8_lossy(&out.stdout));
        let text = std::fs::read_to_string(format!("{}/../../{doc}", env!("CARGO_MANIFEST_DIR")))
            .expect("the document");
        let documented = section_flags(&text, heading);
        let missing: Vec<_> = help.difference(&documented).collect();
        let stale: Vec<_> = documented.difference(&help).collect();
        assert!(
            missing.is_empty(),
            "{command}: undocumented in {doc}: {missing:?}"
        );
        assert!(
            stale.is_empty(),
            "{command}: documented in {doc} but gone: {stale:?}"
        );
    }
}

/// Every metric the gateway registers is in docs/gateway.md's metrics table (counters with the
/// `_total` their exposition adds). Read from the source: a family nobody has touched yet is not
/// in `/metrics`.
#[test]
fn every_gateway_metric_is_documented() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let source = std::fs::read_to_string(format!("{root}/crates/gateway/src/metrics.rs"))
        .expect("metrics.rs");
    let doc = std::fs::read_to_string(format!("{root}/docs/gateway.md")).expect("gateway.md");
    let table = doc
        .split("## Metrics")
        .nth(1)
        .expect("a Metrics section")
        .split("\n## ")
        .next()
        .unwrap_or_default();
    let names: BTreeSet<&str> = source
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| {
            s.starts_with("switchyard_") && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        })
        .collect();
    assert!(names.len() >= 25, "found only {names:?}");
    let missing: Vec<&&str> = names
        .iter()
        .filter(|n| !table.contains(&format!("`{n}")))
        .collect();
    assert!(
        missing.is_empty(),
        "not in docs/gateway.md's metrics: {missing:?}"
    );
}
