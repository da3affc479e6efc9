#!/usr/bin/env python3
"""Holds deploy/prometheus/ and deploy/grafana/ to the metrics the code exports; run by
scripts/check-prometheus.sh (after promtool has checked the syntax and the alert tests).

1. The metrics table of docs/gateway.md ("Metrics") lists exactly the families that
   crates/gateway/src/metrics.rs registers (counters with `_total`).
2. Every metric name in a PromQL expression of the recording rules, the alerting rules, the
   alert tests' expressions and every Grafana dashboard (panel targets and template variables)
   is in that table (histograms with `_bucket`, `_sum`, `_count`), a recording rule's name,
   or one of ALSO_ALLOWED; PENDING names only warn. The dashboards' expressions, variables
   filled in, go through `promtool check rules` ($PROMTOOL) to prove they parse.
3. Every alerting rule has `for`, a `severity` label and `summary` and `description`
   annotations and a test in tests.yml; every alert and recording rule is listed in
   docs/observability.md; every Grafana target's datasource is the `${DS_PROMETHEUS}` input.

A self-test first feeds the extractor expressions with a known answer, so a broken extractor
cannot pass everything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROM = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"

# Series that are not Switchyard's but that Prometheus itself provides.
ALSO_ALLOWED = {"up", "ALERTS", "ALERTS_FOR_STATE"}
# Metrics being added on another branch (name -> branch): allowed with a warning until
# docs/gateway.md has them.
PENDING: dict[str, str] = {}

KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "offset", "bool", "inf", "nan", "atan2",
}


def documented() -> dict[str, str]:
    """metric -> type, from the table in docs/gateway.md's Metrics section."""
    text = (ROOT / "docs" / "gateway.md").read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    out = {}
    for m in re.finditer(r"^\| `(switchyard_[a-z0-9_]+)` \| (\w+) \|", section, re.M):
        out[m.group(1)] = m.group(2)
    if not out:
        sys.exit("check-prometheus: no metrics table found in docs/gateway.md")
    return out


def registered() -> set[str]:
    """Family names metrics.rs registers, as exposed (counters get `_total` from the docs)."""
    text = (ROOT / "crates" / "gateway" / "src" / "metrics.rs").read_text()
    text = text.split("#[cfg(test)]", 1)[0]
    # Every whole string literal that is a metric name (registered directly or from a table).
    return set(re.findall(r'"(switchyard_[a-z0-9_]+)"', text))


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (Grafana variables allowed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    e = re.sub(r"\$\{[^}]*\}|\$\w+", "1", e)  # Grafana variables
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges, subqueries
    e = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e
    )  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


def promql_syntax(exprs: list[tuple[str, str]]) -> list[str]:
    """The dashboards' expressions, Grafana variables filled in, through `promtool check rules`
    (the rule files get that from promtool directly); skipped without $PROMTOOL."""
    promtool = os.environ.get("PROMTOOL")
    if not promtool:
        print("check-prometheus: warning: PROMTOOL unset, dashboard PromQL syntax not checked")
        return []
    rules = []
    for i, (_, expr) in enumerate(exprs):
        e = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
        e = re.sub(r"\$\{?\w+\}?", ".*", e)
        rules.append({"record": f"dashboard:expr:{i}", "expr": e})
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
        f.flush()
        r = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
    if r.returncode == 0:
        return []
    return [f"dashboard PromQL does not parse (rules are numbered in order):\n{r.stdout}{r.stderr}"]


def self_test() -> None:
    cases = {
        'sum by (job, le) (rate(a_bucket{x="y", le!="b"}[5m])) / on (job) group_left c': {
            "a_bucket", "c"},
        'histogram_quantile(0.99, sum by (le) (rate(m_bucket{backend=~"$backend"}[$__rate_interval])))': {
            "m_bucket"},
        "x > 1.5 and on (job, backend) sum by (job) (rate(y[1m])) > 0.1": {"x", "y"},
        "level:metric:rate5m offset 5m > bool 1e3": {"level:metric:rate5m"},
    }
    for expr, want in cases.items():
        got = metric_names(expr)
        assert got == want, f"extractor self-test: {expr!r} gave {got}, want {want}"


def main() -> int:
    self_test()
    errors: list[str] = []
    warnings: list[str] = []

    docs = documented()
    exposed_from_code = set()
    for name in registered():
        kinds = [t for d, t in docs.items() if d in (name, name + "_total")]
        exposed_from_code.add(name + "_total" if kinds == ["counter"] else name)
    if exposed_from_code != set(docs):
        errors.append(
            "docs/gateway.md's metrics table and metrics.rs differ: only in the docs "
            f"{sorted(set(docs) - exposed_from_code)}, only in the code "
            f"{sorted(exposed_from_code - set(docs))}"
        )

    allowed = set(ALSO_ALLOWED)
    for name, kind in docs.items():
        allowed.add(name)
        if kind == "histogram":
            allowed.update(name + s for s in ("_bucket", "_sum", "_count"))

    exprs: list[tuple[str, str]] = []  # (where, expr)
    rule_files = [PROM / "recording.yml", PROM / "alerts.yml"]
    for path in rule_files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    allowed.add(rule["record"])
    for path in rule_files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                where = f"{path.relative_to(ROOT)}: {rule.get('record') or rule.get('alert')}"
                exprs.append((where, rule["expr"]))
                if "alert" in rule:
                    if "for" not in rule:
                        errors.append(f"{where}: no `for:`")
                    if "severity" not in rule.get("labels", {}):
                        errors.append(f"{where}: no severity label")
                    for a in ("summary", "description"):
                        if not rule.get("annotations", {}).get(a):
                            errors.append(f"{where}: no {a} annotation")
    tests = yaml.safe_load((PROM / "tests.yml").read_text())
    for t in tests["tests"]:
        for e in t.get("promql_expr_test", []):
            exprs.append((f"tests.yml: {t['name']}", e["expr"]))
    alert_names = {
        r["alert"]
        for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    guide = (ROOT / "docs" / "observability.md").read_text()
    recorded = {r for r in allowed if ":" in r}
    for name in sorted(alert_names | recorded):
        if f"`{name}`" not in guide:
            errors.append(f"docs/observability.md does not list {name}")
    tested = {a["alertname"] for t in tests["tests"] for a in t.get("alert_rule_test", [])}
    for a in sorted(alert_names - tested):
        errors.append(f"deploy/prometheus/tests.yml: alert {a} has no test")

    dashboards = sorted(GRAFANA.glob("*.json"))
    if not dashboards:
        errors.append("no dashboard in deploy/grafana/")
    dashboard_exprs: list[tuple[str, str]] = []
    for path in dashboards:
        board = json.loads(path.read_text())
        where = path.relative_to(ROOT)
        if not any(i.get("name") == "DS_PROMETHEUS" for i in board.get("__inputs", [])):
            errors.append(f"{where}: no DS_PROMETHEUS input")
        panels = list(board.get("panels", []))
        for p in list(panels):
            panels.extend(p.get("panels", []))  # collapsed rows
        for p in panels:
            for t in p.get("targets", []):
                dashboard_exprs.append((f"{where}: panel {p.get('title')!r}", t["expr"]))
                ds = t.get("datasource") or p.get("datasource") or {}
                if ds.get("uid") != "${DS_PROMETHEUS}":
                    errors.append(f"{where}: panel {p.get('title')!r}: datasource is not ${{DS_PROMETHEUS}}")
        for v in board.get("templating", {}).get("list", []):
            q = v.get("query")
            q = q.get("query", "") if isinstance(q, dict) else (q or "")
            m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", q)
            if m:
                dashboard_exprs.append((f"{where}: variable {v.get('name')}", m.group(1)))
    exprs += dashboard_exprs
    errors += promql_syntax(dashboard_exprs)

    for where, expr in exprs:
        for name in sorted(metric_names(expr)):
            if name in allowed:
                continue
            if name in PENDING:
                warnings.append(f"{where}: {name} is pending ({PENDING[name]})")
            else:
                errors.append(f"{where}: unknown metric {name}")

    for w in sorted(set(warnings)):
        print(f"check-prometheus: warning: {w}")
    for e in errors:
        print(f"check-prometheus: {e}", file=sys.stderr)
    if errors:
        return 1
    print(
        f"check-prometheus: {len(exprs)} expressions over {len(docs)} documented metrics, "
        f"{len(alert_names)} alerts with tests, {len(dashboards)} dashboard(s): ok"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
