#!/usr/bin/env bash
# Real-engine benchmark: routers in front of K llama.cpp servers (docs/benchmarks.md,
# "Real engines: llama.cpp").
#
# Engines: scripts/llamacpp_server.py (llama.cpp's C++ server in-process through the pinned
# xllamacpp wheel in ./.venv, see docs/llamacpp.md) serving the tiny random-weight GGUF that
# scripts/make_tiny_llama.py writes, one compute thread each, 2 slots over a 4096-token
# context, and a small host-RAM prompt cache (--cache-ram $CACHE_RAM MiB), so not every
# prefix of the run fits. Workload: the Mooncake conversation trace turned into prompts for
# the tiny model by bench/llamacpp_workload.py (each hash id a block of 16 one-character
# tokens, lengths scaled, answers capped; see there), sped up $RATE_SCALE times, $DURATION s
# of sending, open loop, streamed chat, replayed with `switchyard bench --workload`.
#
# For every router and repetition: K fresh engines (empty caches), the router in front of
# them (fresh too), the same requests at the same offsets, the engines' request counts (from
# their logs) and /metrics before and after, the router's CPU time before it is stopped:
#
#   sy-POLICY  `switchyard serve --policy POLICY` (POLICIES: cost and baselines);
#              sy-POLICY@TAG adds `--router-config $SY_CONFIG_DIR/TAG.json`
#   smg        SMG 1.13.0 (PyPI `smg`), `smg launch --policy cache_aware`
#   sglang     sglang-router 0.3.2, --policy cache_aware
#   vllm       vllm-router 0.1.17, --policy cache_aware
#   nginx      nginx round robin (as in bench/peers.sh)
#   random     no proxy: `switchyard bench` with one --url per engine, each request to one
#              drawn by a seeded random stream
#
# Everything binds 127.0.0.1 on free ports; every process started here is stopped on exit,
# failure or Ctrl-C. Results: $OUT/runs/ROUTER/REP/ (results.json from `switchyard bench`,
# engine metrics and request counts before/after, router CPU once ready and at the end,
# router and engine logs),
# $OUT/tables.md (bench/llamacpp_report.py), $OUT/sharing.txt (bench/llamacpp_sharing.py: how
# much the engines slowed each other, from their logs).
#
# Usage: bash bench/llamacpp.sh
# Knobs (environment):
#   K (4) engines; DURATION (60) seconds of sending per run; RATE_SCALE (8) trace speed-up;
#   REPEAT (2) runs per router; POLICIES ("cost sglang-cache-aware dynamo-kv round-robin")
#   switchyard policies; PEERS ("smg sglang vllm nginx random"); ROUTERS (default: sy-P for
#   each of POLICIES, then PEERS); CACHE_RAM (32) MiB of host prompt cache per engine;
#   CTX (4096) and PARALLEL (2) context over all slots and slots per engine;
#   BLOCK_TOKENS (16) tokens per trace block; SEED (1); CALIBRATE (0; 1: only scan
#   CAL_SCALES ("4 6 8 11 14") with random routing and print p50/p99);
#   DIAG (1: with switchyard, snapshot /admin/fleet every 10 s); OUT (default
#   /tmp/switchyard-llamacpp-DATE); CACHE (~/.cache/switchyard-bench: the peers' venvs);
#   SY (a switchyard binary to use instead of building this repository's release build);
#   SY_ROUTER_CONFIG (a router settings file for every switchyard run, `--router-config`;
#   a policy that is not `cost` still comes from the router name); SY_CONFIG_DIR (.) where
#   sy-POLICY@TAG finds TAG.json.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
K=${K:-4}
DURATION=${DURATION:-60}
RATE_SCALE=${RATE_SCALE:-8}
REPEAT=${REPEAT:-2}
POLICIES=${POLICIES:-"cost sglang-cache-aware dynamo-kv round-robin"}
PEERS=${PEERS:-"smg sglang vllm nginx random"}
if [[ -z ${ROUTERS:-} ]]; then
    ROUTERS=""
    for p in $POLICIES; do ROUTERS+="sy-$p "; done
    ROUTERS+=$PEERS
fi
CACHE_RAM=${CACHE_RAM:-32}
CTX=${CTX:-4096}
PARALLEL=${PARALLEL:-2}
BLOCK_TOKENS=${BLOCK_TOKENS:-16}
SEED=${SEED:-1}
CALIBRATE=${CALIBRATE:-0}
CAL_SCALES=${CAL_SCALES:-"4 6 8 11 14"}
DIAG=${DIAG:-1}
CACHE=${CACHE:-$HOME/.cache/switchyard-bench}
OUT=${OUT:-${TMPDIR:-/tmp}/switchyard-llamacpp-$(date +%Y%m%d-%H%M%S)}
MODEL=tiny-llama
SMG_VERSION=1.13.0
SGLANG_ROUTER_VERSION=0.3.2
VLLM_ROUTER_VERSION=0.1.17
PY=$ROOT/.venv/bin/python

log() { printf '[llamacpp %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# --- tools ------------------------------------------------------------------------------
if [[ -n ${SY:-} ]]; then
    [[ -x $SY ]] || die "SY=$SY is not an executable"
else
    log "building switchyard (release)..."
    (cd "$ROOT" && cargo build --release --quiet -p switchyard) || die "build failed"
    SY=$ROOT/target/release/switchyard
fi

(cd "$ROOT" && bash scripts/python-env.sh >/dev/null && bash scripts/llamacpp-env.sh >/dev/null) ||
    die "cannot set up ./.venv (scripts/python-env.sh, scripts/llamacpp-env.sh)"

# pip_venv DIR PINS...: a venv with exactly these pins (stamp DIR/.pins)
pip_venv() {
    local dir=$1
    shift
    if [[ "$(cat "$dir/.pins" 2>/dev/null || true)" != "$*" ]]; then
        log "installing $* into $dir..."
        mkdir -p "$CACHE"
        [[ -x $dir/bin/python ]] || python3 -m venv "$dir"
        "$dir/bin/pip" install --quiet --disable-pip-version-check "$@" || die "pip install failed"
        echo "$*" >"$dir/.pins"
    fi
}
need() { [[ " $ROUTERS " == *" $1 "* ]]; }
# The same venv as bench/peers.sh; SMG in its own (it is sglang-router's successor).
VENV=$CACHE/peers-venv
SMG_VENV=$CACHE/smg-venv
if need sglang || need vllm; then
    pip_venv "$VENV" "sglang-router==$SGLANG_ROUTER_VERSION" "vllm-router==$VLLM_ROUTER_VERSION"
fi
if need smg; then
    pip_venv "$SMG_VENV" "smg==$SMG_VERSION"
fi
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
NGINX=""
if need nginx; then
    install_nginx
fi

# --- processes and cleanup --------------------------------------------------------------
mkdir -p "$OUT"
bench_processes llamacpp

# cpu_seconds PID: user + system CPU seconds of PID and its descendants (from /proc)
cpu_seconds() {
    python3 - "$1" <<'EOF'
import os, sys
root = int(sys.argv[1])
tick = os.sysconf("SC_CLK_TCK")
stat = {}
for d in os.listdir("/proc"):
    if d.isdigit():
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        fields = s[s.rindex(")") + 2:].split()
        stat[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
todo, total = [root], 0
while todo:
    p = todo.pop()
    if p in stat:
        total += stat[p][1]
        todo += [c for c, (pp, _) in stat.items() if pp == p]
print(f"{total / tick:.2f}")
EOF
}

# chat_ok URL: one tiny streamed chat request answers 200 (the router is ready end to end)
chat_ok() {
    curl -sf -o /dev/null --max-time 10 "$1/v1/chat/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"ok\"}],\"max_tokens\":1,\"stream\":true}"
}

# wait_ready URL PID NAME: until a chat request through URL succeeds (90 s at most)
wait_ready() {
    for _ in $(seq 1 450); do
        chat_ok "$1" && return
        kill -0 "$2" 2>/dev/null || { tail -20 "$TMP/$3.err" >&2; die "$3 exited"; }
        sleep 0.2
    done
    tail -20 "$TMP/$3.err" >&2
    die "$1 does not answer chat requests"
}

# --- engines ----------------------------------------------------------------------------
GGUF=$CACHE/tiny-llama.gguf
mkdir -p "$CACHE"
"$PY" "$ROOT/scripts/make_tiny_llama.py" "$GGUF" >/dev/null || die "cannot write the model"
ENGINES=()
ENGINE_PIDS=()
start_engines() {
    ENGINES=()
    ENGINE_PIDS=()
    local i
    for i in $(seq 1 "$K"); do
        start "engine$i" "$PY" "$ROOT/scripts/llamacpp_server.py" "$GGUF" --alias "$MODEL" \
            --ctx "$CTX" --parallel "$PARALLEL" --threads 1 --cache-ram "$CACHE_RAM" --seed "$i"
        ENGINE_PIDS+=("$LAST_PID")
    done
    for i in $(seq 1 "$K"); do
        ENGINES+=("$(address "engine$i" "${ENGINE_PIDS[$((i - 1))]}")")
    done
}
stop_engines() { stop "${ENGINE_PIDS[@]}"; }

# snapshot DIR: each engine's /metrics and finished-request count (its log's timing lines)
snapshot() {
    mkdir -p "$1"
    local i
    for i in $(seq 1 "$K"); do
        curl -sf --max-time 5 "${ENGINES[$((i - 1))]}/metrics" >"$1/engine$i.prom" ||
            die "scraping engine $i failed"
        grep -c 'print_timing: .* total time' "$TMP/engine$i.err" >"$1/engine$i.requests" || true
    done
}

# --- routers ----------------------------------------------------------------------------
ROUTER_URL=""
ROUTER_PIDS=()
ROUTER_LOG=""
ADMIN_TOKEN=bench-$RANDOM$RANDOM
start_router() { # NAME
    local name=$1 port e
    ROUTER_PIDS=()
    ROUTER_URL=""
    ROUTER_LOG=$name
    case $name in
    random) return ;;
    sy-*)
        local backends=()
        for e in "${ENGINES[@]}"; do backends+=(--backend "$e,kind=llamacpp,models=$MODEL"); done
        ROUTER_LOG=switchyard
        local config=() policy=${name#sy-}
        [[ -n ${SY_ROUTER_CONFIG:-} ]] && config=(--router-config "$SY_ROUTER_CONFIG")
        # sy-POLICY@TAG: the same policy with the settings in $SY_CONFIG_DIR/TAG.json, so two
        # settings of one policy are compared side by side in one run.
        if [[ $policy == *@* ]]; then
            config=(--router-config "${SY_CONFIG_DIR:-.}/${policy#*@}.json")
            policy=${policy%@*}
        fi
        start switchyard "$SY" serve --listen 127.0.0.1:0 --policy "$policy" \
            --admin-token "$ADMIN_TOKEN" "${config[@]}" "${backends[@]}"
        ROUTER_PIDS+=("$LAST_PID")
        ROUTER_URL=$(address switchyard "$LAST_PID")
        ;;
    smg)
        port=$(free_port)
        start smg "$SMG_VENV/bin/smg" launch --host 127.0.0.1 --port "$port" \
            --policy cache_aware --worker-urls "${ENGINES[@]}" \
            --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" --log-level warn
        ROUTER_PIDS+=("$LAST_PID")
        ROUTER_URL=http://127.0.0.1:$port
        ;;
    sglang)
        port=$(free_port)
        start sglang "$VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 \
            --port "$port" --policy cache_aware --worker-urls "${ENGINES[@]}" \
            --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" --log-level warn
        ROUTER_PIDS+=("$LAST_PID")
        ROUTER_URL=http://127.0.0.1:$port
        ;;
    vllm)
        port=$(free_port)
        start vllm "$VENV/bin/vllm-router" --host 127.0.0.1 --port "$port" \
            --policy cache_aware --worker-urls "${ENGINES[@]}" \
            --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" --log-level warning
        ROUTER_PIDS+=("$LAST_PID")
        ROUTER_URL=http://127.0.0.1:$port
        ;;
    nginx)
        port=$(free_port)
        local dir=$TMP/nginx servers=""
        rm -rf "$dir"
        mkdir -p "$dir"
        for e in "${ENGINES[@]}"; do servers+="        server ${e#http://};"$'\n'; done
        cat >"$dir/nginx.conf" <<EOF
# Generated by bench/llamacpp.sh: round robin over the engines, keep-alive both sides, streaming.
daemon off;
user root;
worker_processes 1;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events {
    worker_connections 8192;
}
http {
    access_log off;
    client_body_temp_path $dir/client_body;
    proxy_temp_path $dir/proxy;
    fastcgi_temp_path $dir/fastcgi;
    uwsgi_temp_path $dir/uwsgi;
    scgi_temp_path $dir/scgi;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    upstream engines {
$servers        keepalive 512;
        keepalive_requests 100000000;
        keepalive_timeout 300s;
    }
    server {
        listen 127.0.0.1:$port;
        location / {
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }
    }
}
EOF
        start nginx "$NGINX" -e "$dir/error.log" -p "$dir" -c "$dir/nginx.conf"
        ROUTER_PIDS+=("$LAST_PID")
        ROUTER_URL=http://127.0.0.1:$port
        ;;
    *) die "unknown router $name" ;;
    esac
    wait_ready "$ROUTER_URL" "${ROUTER_PIDS[0]}" "$ROUTER_LOG"
}
stop_router() {
    if ((${#ROUTER_PIDS[@]})); then
        stop "${ROUTER_PIDS[@]}"
    fi
}

# --- one run ----------------------------------------------------------------------------
# workload SCALE: the request file for that rate scale (written once)
workload() {
    local file=$OUT/workload/mooncake-x$1.jsonl
    if [[ ! -s $file ]]; then
        llamacpp_workload "$file" "$1" "$DURATION" "$BLOCK_TOKENS" $((CTX / PARALLEL - 148))
        cat "$file.txt" >&2
    fi
    echo "$file"
}

# run_one ROUTER SCALE DIR: fresh engines, the router, the bench, the figures
run_one() {
    local router=$1 scale=$2 dir=$3 file
    file=$(workload "$scale")
    rm -rf "$dir"
    mkdir -p "$dir"
    start_engines
    start_router "$router"
    snapshot "$dir/before"
    if ((${#ROUTER_PIDS[@]})); then
        cpu_seconds "${ROUTER_PIDS[0]}" >"$dir/router-cpu-ready-s"
    fi
    local urls=()
    if [[ $router == random ]]; then
        for e in "${ENGINES[@]}"; do urls+=(--url "$e"); done
    else
        urls=(--url "$ROUTER_URL")
    fi
    log "$router x$scale -> $dir (engines ${ENGINES[*]}, router ${ROUTER_URL:-none})"
    "$SY" bench "${urls[@]}" --api chat --model "$MODEL" --label "$router" \
        --workload "$file" --seed "$SEED" --timeout 300 --max-concurrency 4096 \
        --out "$dir" --quiet >"$dir/bench.txt" &
    local bench_pid=$! n=0 rc=0
    PIDS+=("$bench_pid")
    # With switchyard: what the router knows of each engine, every 10 s.
    while kill -0 "$bench_pid" 2>/dev/null; do
        sleep 1
        n=$((n + 1))
        if [[ $router == sy-* ]] && ((DIAG)) && ((n % 10 == 0)); then
            curl -sf --max-time 5 -H "authorization: Bearer $ADMIN_TOKEN" \
                "$ROUTER_URL/admin/fleet" >"$dir/fleet-$((n / 10)).json" 2>/dev/null || true
        fi
    done
    wait "$bench_pid" || rc=$?
    stop "$bench_pid"
    ((rc == 0)) || die "bench failed ($router, exit $rc)"
    head -1 "$dir/bench.txt" >&2
    if [[ $router == sy-* ]]; then
        curl -sf --max-time 5 -H "authorization: Bearer $ADMIN_TOKEN" \
            "$ROUTER_URL/admin/fleet" >"$dir/fleet-end.json" 2>/dev/null || true
        curl -sf --max-time 5 "$ROUTER_URL/metrics" >"$dir/router.prom" 2>/dev/null || true
    fi
    snapshot "$dir/after"
    if ((${#ROUTER_PIDS[@]})); then
        cpu_seconds "${ROUTER_PIDS[0]}" >"$dir/router-cpu-s"
    fi
    stop_router
    stop_engines
    local f i
    for f in switchyard smg sglang vllm nginx; do
        [[ -s $TMP/$f.err ]] && cp "$TMP/$f.err" "$dir/$f.log"
        rm -f "$TMP/$f.err" "$TMP/$f.out"
    done
    for i in $(seq 1 "$K"); do
        xz -c "$TMP/engine$i.err" >"$dir/engine$i.log.xz"
        rm -f "$TMP/engine$i.err" "$TMP/engine$i.out"
    done
    return 0
}

cat >"$OUT/setup.json" <<EOF
{"k": $K, "duration_s": $DURATION, "rate_scale": $RATE_SCALE, "repeat": $REPEAT,
 "seed": $SEED, "cache_ram_mib": $CACHE_RAM, "ctx": $CTX, "parallel": $PARALLEL,
 "block_tokens": $BLOCK_TOKENS, "routers": "$ROUTERS",
 "smg": "$SMG_VERSION", "sglang_router": "$SGLANG_ROUTER_VERSION",
 "vllm_router": "$VLLM_ROUTER_VERSION",
 "nginx": "$([[ -n $NGINX ]] && "$NGINX" -v 2>&1 | sed 's/.*nginx\///')",
 "xllamacpp": "$("$PY" -c 'import importlib.metadata as m; print(m.version("xllamacpp"))')",
 "switchyard": "$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo unknown)",
 "switchyard_binary": "$SY", "switchyard_router_config": "${SY_ROUTER_CONFIG:-}",
 "cpus": $(nproc), "cpu": "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"}
EOF

if ((CALIBRATE)); then
    # Random routing (no proxy) over fresh engines at rising trace speed-ups.
    for scale in $CAL_SCALES; do
        run_one random "$scale" "$OUT/calibrate/$scale"
    done
    python3 "$ROOT/bench/llamacpp_report.py" --calibration "$OUT" | tee "$OUT/calibration.md"
    exit 0
fi

started=$(date +%s)
for rep in $(seq 1 "$REPEAT"); do
    for router in $ROUTERS; do
        run_one "$router" "$RATE_SCALE" "$OUT/runs/$router/$rep"
    done
done
python3 "$ROOT/bench/llamacpp_report.py" "$OUT" | tee "$OUT/tables.md"
# How much the engines slowed each other in each run, from their own logs (the router's
# shared-compute charge stays off where this is small; docs/benchmarks.md).
"$PY" "$ROOT/bench/llamacpp_sharing.py" "$OUT"/runs/*/* >"$OUT/sharing.txt" ||
    log "could not read the engines' logs for bench/llamacpp_sharing.py"
log "results in $OUT ($(($(date +%s) - started)) s); engines' sharing in $OUT/sharing.txt"
