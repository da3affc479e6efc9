#!/usr/bin/env bash
# Offline check of deploy/prometheus/ and deploy/grafana/; CI runs it from scripts/test.sh (no
# build needed). About 2 s once promtool is installed.
#
#   bash scripts/check-prometheus.sh
#
# - promtool check config / check rules: the scrape config and the rule files parse, every
#   PromQL expression is valid.
# - promtool test rules deploy/prometheus/tests.yml: example series in, the expected alerts (with
#   their rendered annotations) and recording-rule values out.
# - scripts/check_prometheus.py: every metric name the rules and the dashboards read is one the
#   gateway exports (docs/gateway.md's table, itself held to metrics.rs), and every alert has a
#   `for:`, a severity, a summary and a description.
#
# promtool comes with Debian's `prometheus` package (bookworm: 2.42), installed here with
# apt-get when missing (CI runs as root on Debian bookworm). PROMTOOL=/path/to/promtool
# overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."

PROMTOOL="${PROMTOOL:-promtool}"
if ! command -v "$PROMTOOL" >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "check-prometheus: installing prometheus (Debian) for promtool" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    else
        echo "check-prometheus: needs promtool (apt-get install prometheus) or PROMTOOL=/path" >&2
        exit 1
    fi
fi
"$PROMTOOL" --version 2>&1 | head -1

"$PROMTOOL" check config deploy/prometheus/prometheus.yml
"$PROMTOOL" check rules deploy/prometheus/recording.yml deploy/prometheus/alerts.yml
(cd deploy/prometheus && "$PROMTOOL" test rules tests.yml)

# PyYAML: the system's if it has it, else the project's pinned .venv (scripts/python-env.sh).
PY=python3
if [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
elif ! python3 -c 'import yaml' 2>/dev/null; then
    bash scripts/python-env.sh >/dev/null
    PY=.venv/bin/python
fi
PROMTOOL="$(command -v "$PROMTOOL")" "$PY" scripts/check_prometheus.py
