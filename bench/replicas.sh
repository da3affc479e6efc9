#!/usr/bin/env bash
# Router replicas on real processes: R `switchyard serve` replicas in front of the same K
# emulated engines, the load generator spreading the requests uniformly over the replicas
# (`switchyard bench --url A --url B ...`, as a Service without session affinity would), against
# one replica taking all of it (docs/benchmarks.md, "Router replicas").
#
#   one      one replica
#   apart    R replicas that know nothing of each other
#   shared   R replicas told of each other with --peer (decisions and outcomes shared)
#
# For every mode and workload: fresh engines (caches empty) and fresh replicas, the same
# requests at the same offsets (same seed). Everything binds to 127.0.0.1 on free ports and is
# stopped on exit. Results: $OUT/MODE-WORKLOAD/results.json (from `switchyard bench`) and the
# table printed at the end (also in $OUT/tables.md).
#
# Usage: bash bench/replicas.sh
# Knobs (environment): R (2) replicas; K (4) engines; MODES ("one apart shared");
#   WORKLOADS ("chat shared"); CHAT_RATE (4 conversations started a second); SHARED_RATE (16
#   requests/s); DURATION (60 s of sending); SEED (1); REPEAT (1); OUT; SY (a switchyard
#   binary instead of building one).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
R=${R:-2}
K=${K:-4}
MODES=${MODES:-"one apart shared"}
WORKLOADS=${WORKLOADS:-"chat shared"}
CHAT_RATE=${CHAT_RATE:-4}
SHARED_RATE=${SHARED_RATE:-16}
DURATION=${DURATION:-60}
SEED=${SEED:-1}
REPEAT=${REPEAT:-1}
OUT=${OUT:-${TMPDIR:-/tmp}/switchyard-replicas-$(date +%Y%m%d-%H%M%S)}
MODEL=emulated-llama-8b
TOKEN=replicas-bench
# Multi-turn chat: each conversation's next turn (after a 4 s think time) carries the whole
# conversation so far, so it hits the cache only where the conversation went.
CHAT_FLAGS=(--chat --sessions 400 --turns 6 --system-prompt-len 1024 --user-len 256
    --output-len 64 --think-time 4)
# As bench/peers.sh: 128 system prompts of 8,192 tokens, Zipf 1.1, engines holding 32 of them.
SHARED_FLAGS=(--shared-prefix --groups 128 --prompts-per-group 64 --system-prompt-len 8192
    --question-len 256 --output-len 64 --zipf 1.1)
SHARED_ENGINE_FLAGS=(--num-gpu-blocks 16384)

log() { printf '[replicas %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
bench_processes replicas
mkdir -p "$OUT"

if [[ -z ${SY:-} ]]; then
    log "building switchyard (release)..."
    (cd "$ROOT" && cargo build --release -q -p switchyard) || die "build failed"
    SY=$ROOT/target/release/switchyard
fi

# run_one MODE WORKLOAD DIR
run_one() {
    local mode=$1 workload=$2 dir=$3 engine_flags=() load_flags=()
    mkdir -p "$dir"
    if [[ $workload == shared ]]; then
        engine_flags=("${SHARED_ENGINE_FLAGS[@]}")
        load_flags=("${SHARED_FLAGS[@]}" --rate "$SHARED_RATE")
    else
        load_flags=("${CHAT_FLAGS[@]}" --rate "$CHAT_RATE")
    fi
    local engines=() backends=() pids=() i
    for i in $(seq 1 "$K"); do
        start "engine$i" "$SY" engine --port 0 --model "$MODEL" "${engine_flags[@]}"
        pids+=("$LAST_PID")
        engines+=("$(address "engine$i" "$LAST_PID")")
    done
    for e in "${engines[@]}"; do backends+=(--backend "$e,models=$MODEL"); done
    local n=$R ports=() urls=()
    [[ $mode == one ]] && n=1
    for i in $(seq 1 "$n"); do ports+=("$(free_port)"); done
    for i in $(seq 0 $((n - 1))); do
        local peers=()
        if [[ $mode == shared ]]; then
            for j in $(seq 0 $((n - 1))); do
                ((j == i)) || peers+=(--peer "http://127.0.0.1:${ports[j]}")
            done
        fi
        start "replica$i" "$SY" serve --listen "127.0.0.1:${ports[i]}" --admin-token "$TOKEN" \
            "${backends[@]}" "${peers[@]}"
        pids+=("$LAST_PID")
        urls+=(--url "$(address "replica$i" "$LAST_PID")")
    done
    log "$mode / $workload: $n replica(s), $K engines"
    "$SY" bench "${urls[@]}" --api chat --model "$MODEL" --label "$mode" "${load_flags[@]}" \
        --duration "$DURATION" --seed "$SEED" --timeout 300 --max-concurrency 4096 \
        --out "$dir" --quiet >"$dir/bench.txt" || die "bench failed ($mode / $workload)"
    head -1 "$dir/bench.txt" >&2
    for i in $(seq 0 $((n - 1))); do
        curl -s "http://127.0.0.1:${ports[i]}/metrics" >"$dir/replica$i.metrics" || true
    done
    stop "${pids[@]}"
}

for rep in $(seq 1 "$REPEAT"); do
    for workload in $WORKLOADS; do
        for mode in $MODES; do
            run_one "$mode" "$workload" "$OUT/$mode-$workload-$rep"
        done
    done
done

python3 - "$OUT" <<'EOF' | tee "$OUT/tables.md"
import json, os, sys
out = sys.argv[1]
rows = {}
for d in sorted(os.listdir(out)):
    p = os.path.join(out, d, "results.json")
    if not os.path.exists(p):
        continue
    mode, workload, rep = d.rsplit("-", 2)
    s = json.load(open(p))["summary"]
    rows.setdefault((workload, mode), []).append(s)
print("| workload | mode | TTFT mean (ms) | TTFT p99 (ms) | cached | ok / sent | runs |")  # medians over runs
print("|---|---|---:|---:|---:|---:|---:|")
def med(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
for (workload, mode), ss in sorted(rows.items()):
    print(f"| {workload} | {mode} | {med([s['ttft']['mean_ms'] for s in ss]):.0f} | "
          f"{med([s['ttft']['p99_ms'] for s in ss]):.0f} | "
          f"{100 * med([s['cached_fraction'] for s in ss]):.1f} % | "
          f"{sum(s['ok'] for s in ss)} / {sum(s['sent'] for s in ss)} | {len(ss)} |")
EOF
log "results in $OUT"
