#!/usr/bin/env bash
# Gateway overhead benchmark (docs/gateway.md, "Overhead").
#
# Starts two zero-delay emulators (`switchyard engine --instant`), `switchyard serve` over
# both (cost policy) and nginx (Debian package; round robin over both, keep-alive upstream
# connections), all on 127.0.0.1, then drives each target with the open-loop load generator
# (crates/loadgen/examples/overhead.rs, over switchyard_loadgen::fixed): a 2,048-token chat
# request (8 KiB of text, max_tokens 4, non-streaming) at a constant rate, latency to the
# complete response.
#
#   1. fixed rates (RATES, default 500 and 2000 req/s): DURATION s measured after WARMUP s,
#      REPEATS rounds, each round direct -> switchyard -> nginx; the table shows the median
#      over rounds of p50 / p99 / p99.9, and the added latency (target minus direct);
#   2. the highest sustained rate of each target: achieved >= 98 % of offered, no errors and
#      p99 < P99_LIMIT_US in one of SEARCH_TRIES runs (search: x1.5 steps from SEARCH_START,
#      then bisection).
#
# PIN=split (default) puts the load generator on CPU 0, busy-polling (--spin), and the
# emulators and proxies on CPU 1 (so the proxy and the backend share one core, in every
# configuration; switchyard serves with `--worker-threads 1`, nginx with one worker process);
# PIN=none leaves placement to the scheduler (and switchyard to its default thread count) and
# the generator sleeps between sends. The fixed-rate rounds run in each IDLE mode (default both): `idle` leaves CPU 1 free to
# go idle between requests (on a VM every wake-up from idle costs tens to hundreds of µs, and
# that shows up in every target's latency); `busy` keeps it out of idle with a SCHED_IDLE spin
# loop, which yields to any real work at once, so what remains is the work on the request path.
# STREAM=1 adds streamed rows. BASELINE=PATH (another build's `switchyard` binary) adds a
# `baseline` target served by it, measured in the same rounds as `switchyard` (before/after
# comparisons without the drift between runs). TOKENIZER=1 makes the emulators publish KV
# events and gives switchyard (and the baseline) the emulators' tokenizer.json and each
# backend's event stream, so chat prompts are tokenized for exact matching; UNIQUE=1 starts
# every prompt with its request number (spelled in the prompt's words), so no two share a
# prefix and every prompt is new to the tokenizer's piece cache. SPECIAL_TOKENS=1 starts the
# emulators with --special-tokens (their chat markers are special tokens, as a chat model's
# are, and the tokenizer written for switchyard has them: prompts are cut into pieces there).
# CONVERSATIONS=1 sends two-turn conversations (the generator's --conversations: every other
# request is the next turn, with the engine's answer, of a conversation opened 50 ms before,
# both turns naming it in x-session-id) and measures only the next turns. ENGINE_SPEED=N runs
# the emulators' engine model N times faster than real time instead of --instant, which answers
# without it: then the engines hold prompts in their KV cache (and publish it with TOKENIZER=1),
# so a conversation's next turn is matched, and tokenized, as far as its history is held.
# Everything stops by itself and
# every process and temp file is removed on exit, failure or Ctrl-C.
#
# Usage: bash bench/overhead.sh
# Knobs (environment): RATES DURATION WARMUP REPEATS IDLE SEARCH SEARCH_START SEARCH_MAX
#   SEARCH_DURATION SEARCH_WARMUP SEARCH_TRIES P99_LIMIT_US PIN STREAM WORDS MAX_TOKENS QUIET_WAIT
#   BASELINE TOKENIZER UNIQUE SPECIAL_TOKENS CONVERSATIONS ENGINE_SPEED
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RATES=${RATES:-"500 2000"}
DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
REPEATS=${REPEATS:-3}
SEARCH=${SEARCH:-1}
SEARCH_START=${SEARCH_START:-2000}
SEARCH_MAX=${SEARCH_MAX:-60000}
SEARCH_DURATION=${SEARCH_DURATION:-5}
SEARCH_WARMUP=${SEARCH_WARMUP:-1}
SEARCH_TRIES=${SEARCH_TRIES:-2}
BISECT=${BISECT:-4}
P99_LIMIT_US=${P99_LIMIT_US:-10000}
PIN=${PIN:-split}
IDLE=${IDLE:-"idle busy"}
STREAM=${STREAM:-0}
WORDS=${WORDS:-2048}
MAX_TOKENS=${MAX_TOKENS:-4}
QUIET_WAIT=${QUIET_WAIT:-120}
BASELINE=${BASELINE:-}
TOKENIZER=${TOKENIZER:-0}
UNIQUE=${UNIQUE:-0}
SPECIAL_TOKENS=${SPECIAL_TOKENS:-0}
ENGINE_SPEED=${ENGINE_SPEED:-}
ENGINE_MODE=(--instant)
[[ -n $ENGINE_SPEED ]] && ENGINE_MODE=(--speed "$ENGINE_SPEED")
CONVERSATIONS=${CONVERSATIONS:-0}
MODEL=m

case $PIN in
split)
    GEN_CPU=0
    SUT_CPU=1
    GEN_SPIN=(--spin)
    # One core for the proxy: one serving thread (nginx runs one worker process too).
    SW_THREADS=(--worker-threads 1)
    ;;
none)
    GEN_CPU=""
    SUT_CPU=""
    GEN_SPIN=()
    SW_THREADS=()
    IDLE=idle
    ;;
*)
    echo "PIN must be split or none" >&2
    exit 2
    ;;
esac
if [[ -n $SUT_CPU ]] && (($(nproc) < 2)); then
    echo "PIN=split needs 2 CPUs; use PIN=none" >&2
    exit 2
fi

log() { printf '%s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"

# --- build ------------------------------------------------------------------------------
log "building (release)..."
(cd "$ROOT" && cargo build --release --quiet -p switchyard --bin switchyard \
    -p switchyard-loadgen --example overhead) || die "build failed"
SY=$ROOT/target/release/switchyard
GEN=$ROOT/target/release/examples/overhead
if [[ -n $BASELINE ]]; then
    [[ -x $BASELINE ]] || die "BASELINE=$BASELINE is not an executable"
fi

install_nginx
bench_processes overhead

# start_on NAME CPU CMD...: `start` pinned to CPU (anywhere when CPU is empty); sets LAST_PID
start_on() {
    local name=$1 cpu=$2
    shift 2
    if [[ -n $cpu ]]; then
        # taskset execs the command: the recorded pid is still the process itself.
        start "$name" taskset -c "$cpu" "$@"
    else
        start "$name" "$@"
    fi
}

pinned() { # CPU CMD... : runs CMD on CPU (or anywhere when CPU is empty)
    local cpu=$1
    shift
    if [[ -n $cpu ]]; then
        taskset -c "$cpu" "$@"
    else
        "$@"
    fi
}

wait_ok() { # URL
    for _ in $(seq 1 200); do
        curl -sf -o /dev/null --max-time 1 "$1" && return
        sleep 0.05
    done
    die "$1 does not answer"
}

busy_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
HZ=$(getconf CLK_TCK)

# Waits (up to QUIET_WAIT s) until the machine is idle: other work on 2 cores ruins latency tails.
wait_quiet() {
    local waited=0 a b busy
    while :; do
        a=$(busy_ticks)
        sleep 2
        b=$(busy_ticks)
        busy=$(((b - a) * 100 / (2 * HZ)))
        if ((busy < 10)); then
            log "machine idle (${busy}% of one core busy before the run)"
            return
        fi
        if ((waited >= QUIET_WAIT)); then
            log "warning: machine still busy (${busy}% of one core) after ${QUIET_WAIT} s; measuring anyway"
            return
        fi
        log "machine busy (${busy}% of one core in use by other work); waiting..."
        waited=$((waited + 2))
    done
}

# --- start the fleet --------------------------------------------------------------------
log "starting 2 instant emulators, switchyard serve and nginx (PIN=$PIN)..."
EMU_KV=()
E1_EXTRA=()
[[ $SPECIAL_TOKENS == 1 ]] && EMU_KV=(--special-tokens)
if [[ $TOKENIZER == 1 ]]; then
    mkdir -p "$TMP/tokenizer"
    EMU_KV+=(--kv-events-endpoint tcp://127.0.0.1:0 --kv-events-bind)
    E1_EXTRA=(--write-tokenizer "$TMP/tokenizer/tokenizer.json")
fi
start_on e1 "$SUT_CPU" "$SY" engine "${ENGINE_MODE[@]}" --port 0 --model "$MODEL" --seed 1 "${EMU_KV[@]}" \
    "${E1_EXTRA[@]}"
E1_PID=$LAST_PID
start_on e2 "$SUT_CPU" "$SY" engine "${ENGINE_MODE[@]}" --port 0 --model "$MODEL" --seed 2 "${EMU_KV[@]}"
E2_PID=$LAST_PID
E1=$(address e1 "$E1_PID")
E2=$(address e2 "$E2_PID")
# What switchyard is told of each backend (and, with TOKENIZER=1, of the tokenizer).
SW_BACKENDS=(--backend "$E1" --backend "$E2")
if [[ $TOKENIZER == 1 ]]; then
    kv_of() { grep -o -m1 'kv-events on tcp://[0-9.]*:[0-9]*' "$TMP/$1.out" | cut -d' ' -f3; }
    for _ in $(seq 1 200); do
        [[ -n $(kv_of e1) && -n $(kv_of e2) ]] && break
        sleep 0.05
    done
    [[ -n $(kv_of e1) && -n $(kv_of e2) ]] || die "the emulators printed no kv-events endpoint"
    SW_BACKENDS=(--backend "$E1,kv_events=$(kv_of e1)" --backend "$E2,kv_events=$(kv_of e2)"
        --tokenizer "$MODEL=$TMP/tokenizer/tokenizer.json")
fi
GEN_EXTRA=()
[[ $UNIQUE == 1 ]] && GEN_EXTRA+=(--unique)
[[ $CONVERSATIONS == 1 ]] && GEN_EXTRA+=(--conversations)

start_on switchyard "$SUT_CPU" "$SY" serve --listen 127.0.0.1:0 --policy cost "${SW_THREADS[@]}" \
    "${SW_BACKENDS[@]}"
SW_PID=$LAST_PID
SW=$(address switchyard "$SW_PID")
TARGETS=(direct switchyard nginx)
if [[ -n $BASELINE ]]; then
    start_on baseline "$SUT_CPU" "$BASELINE" serve --listen 127.0.0.1:0 --policy cost \
        "${SW_THREADS[@]}" "${SW_BACKENDS[@]}"
    BASE_PID=$LAST_PID
    BASE=$(address baseline "$BASE_PID")
    TARGETS=(direct baseline switchyard nginx)
fi

NGINX_PORT=$(free_port)
mkdir -p "$TMP/nginx"
cat >"$TMP/nginx/nginx.conf" <<EOF
# Generated by bench/overhead.sh: round robin over the two emulators, keep-alive both sides.
daemon off;
user root;
worker_processes 1;
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/error.log warn;
events {
    worker_connections 4096;
}
http {
    access_log off;
    client_body_temp_path $TMP/nginx/client_body;
    proxy_temp_path $TMP/nginx/proxy;
    fastcgi_temp_path $TMP/nginx/fastcgi;
    uwsgi_temp_path $TMP/nginx/uwsgi;
    scgi_temp_path $TMP/nginx/scgi;
    client_max_body_size 16m;
    client_body_buffer_size 64k;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    upstream emulators {
        server ${E1#http://};
        server ${E2#http://};
        keepalive 256;
        keepalive_requests 100000000;
        keepalive_timeout 300s;
    }
    server {
        listen 127.0.0.1:$NGINX_PORT;
        location / {
            proxy_pass http://emulators;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
EOF
start_on nginx "$SUT_CPU" "$NGINX" -e "$TMP/nginx/error.log" -p "$TMP/nginx" -c "$TMP/nginx/nginx.conf"
NG_PID=$LAST_PID
NG=http://127.0.0.1:$NGINX_PORT
wait_ok "$NG/v1/models"
wait_ok "$SW/health"
[[ -z $BASELINE ]] || wait_ok "$BASE/health"
NG_PIDS=("$NG_PID" $(pgrep -P "$NG_PID" || true))

log "direct: $E1 (and $E2); switchyard: $SW; nginx: $NG"

# --- one run ----------------------------------------------------------------------------
declare -A URL=([direct]=$E1 [switchyard]=$SW [nginx]=$NG [baseline]=${BASE:-})

# run TARGET RATE DURATION WARMUP [generator args...] -> prints the RESULT fields plus
# proxy_cpu_us (proxy CPU per request), backend_cpu_us, other_pct (CPU used outside our
# processes during the run, % of one core)
run() {
    local target=$1 rate=$2 duration=$3 warmup=$4
    shift 4
    local proxy_pids=() backend_pids=("$E1_PID" "$E2_PID")
    case $target in
    switchyard) proxy_pids=("$SW_PID") ;;
    baseline) proxy_pids=("$BASE_PID") ;;
    nginx) proxy_pids=("${NG_PIDS[@]}") ;;
    esac
    local p0 b0 all0 p1 b1 all1 s0 s1 line
    s0=$(cpu_ticks $SPIN_PID)
    p0=$(cpu_ticks "${proxy_pids[@]}")
    b0=$(cpu_ticks "${backend_pids[@]}")
    all0=$(busy_ticks)
    line=$(pinned "$GEN_CPU" "$GEN" --url "${URL[$target]}" --label "$target" --rate "$rate" \
        --duration "$duration" --warmup "$warmup" --model "$MODEL" --words "$WORDS" \
        --max-tokens "$MAX_TOKENS" "${GEN_SPIN[@]}" "${GEN_EXTRA[@]}" "$@" 2>>"$TMP/generator.err" |
        grep '^RESULT' || true)
    p1=$(cpu_ticks "${proxy_pids[@]}")
    b1=$(cpu_ticks "${backend_pids[@]}")
    all1=$(busy_ticks)
    s1=$(cpu_ticks $SPIN_PID)
    if [[ -z $line ]]; then
        tail -3 "$TMP/generator.err" >&2
        line="RESULT label=$target rate=$rate achieved=0 ok=0 errors=1 timeouts=0"
    fi
    awk -v line="$line" -v p=$((p1 - p0)) -v b=$((b1 - b0)) -v all=$((all1 - all0 - (s1 - s0))) \
        -v hz="$HZ" -v n="$(awk -v r="$rate" -v d="$duration" -v w="$warmup" 'BEGIN{print r*(d+w)}')" \
        -v secs="$(awk -v d="$duration" -v w="$warmup" 'BEGIN{print d+w}')" 'BEGIN {
            split(line, kv, " "); for (i in kv) { split(kv[i], f, "="); v[f[1]] = f[2] }
            gen = v["cpu_s"] * hz
            other = all - p - b - gen; if (other < 0) other = 0
            printf "%s proxy_cpu_us=%.1f backend_cpu_us=%.1f gen_cpu_pct=%.0f other_pct=%.0f\n",
                line, p / hz * 1e6 / n, b / hz * 1e6 / n, v["cpu_s"] / secs * 100,
                other / hz / secs * 100
        }'
}

show() { # LINE: one log line per run
    local l=$1
    log "$(printf '  %-10s %6s req/s: achieved %7s, p50 %7s µs, p99 %8s µs, p99.9 %8s µs, errors %s, late(p99) %s µs, proxy CPU %s µs/req, gen CPU %s%%, other %s%%' \
        "$(field "$l" label)" "$(field "$l" rate)" "$(field "$l" achieved)" "$(field "$l" p50_us)" \
        "$(field "$l" p99_us)" "$(field "$l" p999_us)" "$(( $(field "$l" errors) + $(field "$l" timeouts) ))" \
        "$(field "$l" lag_p99_us)" "$(field "$l" proxy_cpu_us)" "$(field "$l" gen_cpu_pct)" "$(field "$l" other_pct)")"
}

SPIN_PID=""

# --- 1. fixed rates ---------------------------------------------------------------------
RESULTS=$TMP/results
: >"$RESULTS"
MODES=(plain)
((STREAM)) && MODES+=(stream)
stop_spinner() {
    if [[ -n $SPIN_PID ]]; then
        kill "$SPIN_PID" 2>/dev/null || true
        wait "$SPIN_PID" 2>/dev/null || true
        SPIN_PID=""
    fi
}
wait_quiet
for idle in $IDLE; do
    if [[ $idle == busy ]]; then
        # Lowest-priority busy loop on the proxies' core: it runs only when nothing else wants
        # the CPU, so the core never halts and no request waits for it to wake up.
        exec chrt --idle 0 taskset -c "$SUT_CPU" bash -c 'while :; do :; done' &
        SPIN_PID=$!
        PIDS+=("$SPIN_PID")
    fi
    for mode in "${MODES[@]}"; do
        extra=()
        [[ $mode == stream ]] && extra=(--stream)
        for rate in $RATES; do
            for round in $(seq 1 "$REPEATS"); do
                log "[$mode, CPU $idle, $rate req/s, round $round/$REPEATS]"
                for target in "${TARGETS[@]}"; do
                    line=$(run "$target" "$rate" "$DURATION" "$WARMUP" "${extra[@]}")
                    show "$line"
                    echo "mode=$mode idle=$idle round=$round $line" >>"$RESULTS"
                    sleep 1
                done
            done
        done
    done
    stop_spinner
done

# --- 2. highest sustained rate ----------------------------------------------------------
passes() { # LINE RATE
    awk -v a="$(field "$1" achieved)" -v r="$2" -v e="$(field "$1" errors)" \
        -v t="$(field "$1" timeouts)" -v p="$(field "$1" p99_us)" -v lim="$P99_LIMIT_US" \
        'BEGIN { exit !(a >= 0.98 * r && e == 0 && t == 0 && p > 0 && p < lim) }'
}
# sustains TARGET RATE: passes in one of SEARCH_TRIES runs (a multi-millisecond stall of the VM,
# which direct calls see too, fails a run's p99 by itself).
sustains() {
    local line
    for _ in $(seq 1 "$SEARCH_TRIES"); do
        line=$(run "$1" "$2" "$SEARCH_DURATION" "$SEARCH_WARMUP")
        show "$line"
        sleep 1
        passes "$line" "$2" && return 0
    done
    return 1
}
declare -A MAXRATE
if ((SEARCH)); then
    wait_quiet
    for target in direct switchyard nginx; do
        log "[highest sustained rate: $target]"
        lo=0
        hi=0
        rate=$SEARCH_START
        while ((rate <= SEARCH_MAX)); do
            if sustains "$target" "$rate"; then
                lo=$rate
                rate=$(((rate * 3 / 2 + 50) / 100 * 100))
            else
                hi=$rate
                break
            fi
        done
        for _ in $(seq 1 "$BISECT"); do
            ((hi > 0)) || break
            mid=$((((lo + hi) / 2 + 50) / 100 * 100))
            ((mid > lo && mid < hi)) || break
            if sustains "$target" "$mid"; then lo=$mid; else hi=$mid; fi
        done
        if ((hi == 0)); then
            MAXRATE[$target]=">= $lo"
        else
            MAXRATE[$target]="$lo (fails at $hi)"
        fi
    done
fi

# --- report -----------------------------------------------------------------------------
stat_of() { # MODE IDLE RATE TARGET KEY -> median over rounds
    grep "^mode=$1 idle=$2 " "$RESULTS" | grep " label=$4 rate=$3 " | while read -r l; do field "$l" "$5"; done | median
}
echo
echo "Gateway overhead: 2,048-token chat request ($WORDS words, max_tokens $MAX_TOKENS), open loop, \
${DURATION} s after ${WARMUP} s warm-up, median of $REPEATS rounds; latency to the complete response, \
from each request's scheduled send time; PIN=$PIN; $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')); \
CPU 1 idle: free to halt between requests, busy: kept out of idle by a SCHED_IDLE spin loop"
echo
echo "| request | CPU 1 | rate (req/s) | target | achieved | p50 (µs) | p99 (µs) | p99.9 (µs) | added p50 | added p99 | added p99.9 | proxy CPU (µs/req) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for idle in $IDLE; do
    for mode in "${MODES[@]}"; do
        for rate in $RATES; do
            d50=$(stat_of "$mode" "$idle" "$rate" direct p50_us)
            d99=$(stat_of "$mode" "$idle" "$rate" direct p99_us)
            d999=$(stat_of "$mode" "$idle" "$rate" direct p999_us)
            for target in "${TARGETS[@]}"; do
                a=$(stat_of "$mode" "$idle" "$rate" "$target" achieved)
                p50=$(stat_of "$mode" "$idle" "$rate" "$target" p50_us)
                p99=$(stat_of "$mode" "$idle" "$rate" "$target" p99_us)
                p999=$(stat_of "$mode" "$idle" "$rate" "$target" p999_us)
                cpu=$(stat_of "$mode" "$idle" "$rate" "$target" proxy_cpu_us)
                if [[ $target == direct ]]; then
                    echo "| $mode | $idle | $rate | $target | $a | $p50 | $p99 | $p999 | — | — | — | — |"
                else
                    awk -v m="$mode" -v i="$idle" -v r="$rate" -v t="$target" -v a="$a" -v p50="$p50" \
                        -v p99="$p99" -v p999="$p999" -v d50="$d50" -v d99="$d99" -v d999="$d999" \
                        -v cpu="$cpu" 'BEGIN {
                        printf "| %s | %s | %s | %s | %s | %s | %s | %s | %+.1f | %+.1f | %+.1f | %s |\n",
                            m, i, r, t, a, p50, p99, p999, p50 - d50, p99 - d99, p999 - d999, cpu }'
                fi
            done
        done
    done
done
if ((SEARCH)); then
    echo
    echo "Highest sustained rate (achieved >= 98 % of offered, no errors, p99 < $P99_LIMIT_US µs, in one of $SEARCH_TRIES tries; ${SEARCH_DURATION} s after ${SEARCH_WARMUP} s warm-up):"
    echo
    echo "| target | req/s |"
    echo "|---|---|"
    for target in direct switchyard nginx; do
        echo "| $target | ${MAXRATE[$target]} |"
    done
fi
if [[ " $RATES " == *" 2000 "* ]]; then
    echo
    for idle in $IDLE; do
        d50=$(stat_of plain "$idle" 2000 direct p50_us)
        d99=$(stat_of plain "$idle" 2000 direct p99_us)
        sw50=$(stat_of plain "$idle" 2000 switchyard p50_us)
        sw99=$(stat_of plain "$idle" 2000 switchyard p99_us)
        swc=$(stat_of plain "$idle" 2000 switchyard proxy_cpu_us)
        ng50=$(stat_of plain "$idle" 2000 nginx p50_us)
        ng99=$(stat_of plain "$idle" 2000 nginx p99_us)
        ngc=$(stat_of plain "$idle" 2000 nginx proxy_cpu_us)
        awk -v a="$sw50" -v b="$sw99" -v c="$d50" -v d="$d99" -v e="$ng50" -v f="$ng99" \
            -v sc="$swc" -v nc="$ngc" -v i="$idle" 'BEGIN {
            x = a - c; y = b - d; nx = e - c; ny = f - d
            printf "Target (#12) at 2,000 req/s, CPU 1 %s (added latency and CPU per request at or below nginx'"'"'s): p50 %+.1f vs %+.1f µs %s, p99 %+.1f vs %+.1f µs %s, CPU %s vs %s µs %s\n",
                i, x, nx, (x <= nx ? "MET" : "NOT MET"), y, ny, (y <= ny ? "MET" : "NOT MET"),
                sc, nc, (sc <= nc ? "MET" : "NOT MET") }'
    done
fi
