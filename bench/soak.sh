#!/usr/bin/env bash
# Soak: `switchyard serve` under a steady mixed load for an hour (DURATION), with malformed and
# abusive requests mixed in, sampling the gateway's RSS, open file descriptors, threads and
# in-flight counters every SAMPLE_S seconds (docs/gateway.md, "Soak"). Not part of CI.
#
#   bash bench/soak.sh                      # one hour
#   DURATION=600 bash bench/soak.sh         # ten minutes
#
# K emulated engines (`switchyard engine`, SPEED x real time) behind one gateway on 127.0.0.1;
# the load is `switchyard bench --chat` (multi-turn sessions, streamed) at RATE sessions/s, and
# bench/soak_abuse.py sends ABUSE_RATE bad requests/s of a dozen kinds (broken JSON, missing
# model, oversized headers, bodies cut short, clients that stall or leave, unknown paths). At the
# end the load stops and the gateway must return to 0 requests in flight.
# Results in $OUT: samples.csv, soak.md (the summary), bench/ (the load's results), abuse.json.
# Knobs: K (3), DURATION (3600), RATE (2), SPEED (20), ABUSE_RATE (1), SAMPLE_S (10), OUT, SY.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
K=${K:-3}
DURATION=${DURATION:-3600}
RATE=${RATE:-2}
SPEED=${SPEED:-20}
ABUSE_RATE=${ABUSE_RATE:-1}
SAMPLE_S=${SAMPLE_S:-10}
OUT=${OUT:-/tmp/switchyard-soak-$(date +%Y%m%d-%H%M%S)}
SY=${SY:-}

log() { echo "[soak $(date +%H:%M:%S)] $*" >&2; }
die() {
    log "error: $*"
    exit 1
}
# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
bench_processes soak
mkdir -p "$OUT"

if [[ -z $SY ]]; then
    log "building the release binary"
    (cd "$ROOT" && cargo build --release --quiet -p switchyard)
    SY=$ROOT/target/release/switchyard
fi

backends=()
for i in $(seq 1 "$K"); do
    start "engine$i" "$SY" engine --host 127.0.0.1 --port 0 --model soak-model --seed "$i" \
        --speed "$SPEED"
    backends+=(--backend "$(address "engine$i" "$LAST_PID")")
done
TOKEN=soak-$RANDOM$RANDOM
start gateway "$SY" serve --listen 127.0.0.1:0 --admin-token "$TOKEN" \
    --stream-idle-timeout 30 "${backends[@]}"
GW_PID=$LAST_PID
GW=$(address gateway "$GW_PID")
log "gateway $GW (pid $GW_PID), $K engines, $DURATION s, $RATE sessions/s, $ABUSE_RATE bad requests/s"

sample() { # one CSV row: t, rss_kb, fds, threads, in_flight, admission_queue, requests by outcome
    local t=$1 rss fds threads metrics in_flight queue outcomes
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$GW_PID/status")
    threads=$(awk '/^Threads:/ {print $2}' "/proc/$GW_PID/status")
    fds=$(find "/proc/$GW_PID/fd" -mindepth 1 -maxdepth 1 | wc -l)
    metrics=$(curl -sf --max-time 5 "$GW/metrics" || true)
    in_flight=$(awk '/^switchyard_backend_in_flight\{/ {s += $2} END {print s + 0}' <<<"$metrics")
    queue=$(awk '/^switchyard_admission_queue_length / {print $2 + 0}' <<<"$metrics")
    outcomes=$(awk '/^switchyard_requests_total\{/ {
        match($0, /outcome="[a-z_]*"/); o = substr($0, RSTART + 9, RLENGTH - 10); n[o] += $2 }
        END { for (o in n) printf "%s=%d ", o, n[o] }' <<<"$metrics")
    echo "$t,$rss,$fds,$threads,$in_flight,${queue:-0},\"${outcomes% }\""
}

echo "t_s,rss_kb,fds,threads,in_flight,admission_queue,requests" >"$OUT/samples.csv"
sample 0 >>"$OUT/samples.csv"

"$SY" bench --url "$GW" --chat --sessions $((RATE * DURATION)) --turns 4 --rate "$RATE" \
    --user-len 64 --output-len 32 --think-time 2 --duration "$DURATION" --seed 1 --quiet \
    --out "$OUT/bench" >"$OUT/bench.txt" 2>&1 &
BENCH_PID=$!
PIDS+=("$BENCH_PID")
python3 "$ROOT/bench/soak_abuse.py" --url "$GW" --rate "$ABUSE_RATE" --duration "$DURATION" \
    --out "$OUT/abuse.json" 2>"$OUT/abuse.err" &
ABUSE_PID=$!
PIDS+=("$ABUSE_PID")

start_s=$SECONDS
while kill -0 "$BENCH_PID" 2>/dev/null || kill -0 "$ABUSE_PID" 2>/dev/null; do
    sleep "$SAMPLE_S"
    kill -0 "$GW_PID" 2>/dev/null || die "the gateway exited (see $TMP/gateway.err)"
    sample $((SECONDS - start_s)) >>"$OUT/samples.csv"
    if (((SECONDS - start_s) % 300 < SAMPLE_S)); then
        log "$(tail -1 "$OUT/samples.csv")"
    fi
    ((SECONDS - start_s < DURATION + 300)) || die "the load did not stop 300 s after DURATION"
done
wait "$BENCH_PID" || log "bench exited with $? (see $OUT/bench.txt)"
wait "$ABUSE_PID" || die "the abuse sender failed (see $OUT/abuse.err)"

# Everything sent has ended: the gateway's own accounting must come back to zero.
drained=0
for _ in $(seq 1 300); do
    row=$(sample $((SECONDS - start_s)))
    if [[ $(cut -d, -f5 <<<"$row") == 0 && $(cut -d, -f6 <<<"$row") == 0 ]]; then
        drained=1
        echo "$row" >>"$OUT/samples.csv"
        break
    fi
    sleep 0.1
done

python3 - "$OUT" "$drained" "$DURATION" "$RATE" "$ABUSE_RATE" "$K" <<'PY'
import csv, json, sys
out, drained, duration, rate, abuse_rate, k = sys.argv[1:]
rows = list(csv.DictReader(open(f"{out}/samples.csv")))
def col(name): return [int(float(r[name])) for r in rows]
rss, fds, thr = col("rss_kb"), col("fds"), col("threads")
tenth = max(1, len(rows) // 10)
def mean(xs): return sum(xs) / len(xs)
abuse = json.load(open(f"{out}/abuse.json"))
lines = [
    "# Soak summary", "",
    f"{duration} s, {k} engines, {rate} chat sessions/s (4 turns), {abuse_rate} bad requests/s; "
    f"{len(rows)} samples.", "",
    "| | first | max | last | mean of first 10 % | mean of last 10 % |",
    "|---|---:|---:|---:|---:|---:|",
    f"| RSS (MB) | {rss[0]/1024:.1f} | {max(rss)/1024:.1f} | {rss[-1]/1024:.1f} | "
    f"{mean(rss[:tenth])/1024:.1f} | {mean(rss[-tenth:])/1024:.1f} |",
    f"| open fds | {fds[0]} | {max(fds)} | {fds[-1]} | {mean(fds[:tenth]):.0f} | {mean(fds[-tenth:]):.0f} |",
    f"| threads | {thr[0]} | {max(thr)} | {thr[-1]} | {mean(thr[:tenth]):.0f} | {mean(thr[-tenth:]):.0f} |",
    "",
    f"In flight and queued after the load stopped: {'0 (drained)' if drained == '1' else 'NOT 0'}.",
    f"Requests by outcome at the end: {rows[-1]['requests']}.", "",
    "Bad requests sent, by kind: answer (count):", "",
]
for kind, answers in sorted(abuse["answers"].items()):
    lines.append(f"- `{kind}`: " + ", ".join(f"{a} ({n})" for a, n in sorted(answers.items())))
bench = open(f"{out}/bench.txt").read().strip()
lines += ["", "Load generator (`switchyard bench`):", "", bench]
open(f"{out}/soak.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
((drained)) || die "in-flight accounting did not return to 0"
log "results in $OUT"
