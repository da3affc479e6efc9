#!/usr/bin/env bash
# Extend ./.venv (made by scripts/python-env.sh) with what the real-engine tests need:
# llama.cpp's HTTP server in-process (xllamacpp) and the GGUF writer (gguf) that
# scripts/make_tiny_llama.py uses to write a tiny random-weight Llama. Idempotent.
#
#   bash scripts/python-env.sh && bash scripts/llamacpp-env.sh
#
# Pins: xllamacpp 2026.10.11549 (prebuilt CPU wheel, llama.cpp's server with /metrics,
# /slots and the prompt cache), gguf 0.19.0, numpy 2.4.6 (latest for Python 3.11+).
# Nothing else is downloaded at test time: the model is written locally.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    bash scripts/python-env.sh
fi

want="xllamacpp==2026.10.11549 gguf==0.19.0 numpy==2.4.6"
stamp="$VENV/.switchyard-llamacpp-pins"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $want
    echo "$want" > "$stamp"
fi
echo "llama.cpp env ready: $VENV ($want)"
