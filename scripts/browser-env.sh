#!/usr/bin/env bash
# Installs what the browser tests (tests/browser/) need, idempotently:
# - Debian's `chromium` (apt-get, when /usr/bin/chromium is missing and we are root);
# - Node.js 20 or later with npm (apt-get for npm when missing; the node it brings must be 20+);
# - playwright-core 1.65.2, pinned in tests/browser/package-lock.json, installed with `npm ci`
#   into tests/browser/node_modules (only the driver library: it downloads no browser, it drives
#   Debian's chromium).
#
#   bash scripts/browser-env.sh        # exits non-zero, saying why, when something is missing
set -euo pipefail
cd "$(dirname "$0")/.."

CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
apt_updated=""

apt_install() {
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "browser-env: needs $* (apt-get install $*; not root here)" >&2
        exit 1
    fi
    if [ -z "$apt_updated" ]; then
        apt-get update -qq
        apt_updated=1
    fi
    echo "browser-env: installing $* (Debian)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if [ ! -x "$CHROMIUM" ]; then
    apt_install chromium
fi
if [ ! -x "$CHROMIUM" ]; then
    echo "browser-env: $CHROMIUM is still missing after installing chromium" >&2
    exit 1
fi
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
    apt_install nodejs npm
fi
node_major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$node_major" -lt 20 ]; then
    echo "browser-env: playwright-core needs Node.js 20 or later; found $(node --version)" >&2
    exit 1
fi

# npm ci only when the lock file changed since the last install.
stamp="tests/browser/node_modules/.switchyard-lock"
want="$(sha256sum tests/browser/package-lock.json | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    (cd tests/browser && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
    echo "$want" > "$stamp"
fi
echo "browser env ready: $("$CHROMIUM" --version 2>/dev/null | head -1), node $(node --version), playwright-core $(node -p 'require("./tests/browser/node_modules/playwright-core/package.json").version')"
