#!/usr/bin/env bash
# The simulator's replay of bench/llamacpp.sh (docs/simulator.md, "Engines on one machine"):
# the same request file, four engines of the CPU profile with two sequence slots each, the
# engines sharing $SHARED_CORES cores as the real benchmark's four one-thread servers share a
# 2-core machine with the router and the load generator. Seconds instead of minutes, no
# engines: a first look at a routing change before the real benchmark.
#
# Usage: bash bench/llamacpp_replay.sh
# Knobs (environment):
#   SHARED_CORES (1.5; "none": a device per engine); POLICIES ("cost,round-robin,
#   sglang-cache-aware,dynamo-kv"); SEEDS ("1 2 3"); ROUTER_CONFIG (a router settings file,
#   `--router-config`); RATE_SCALE (8), DURATION (60), BLOCK_TOKENS (16), CTX (4096) and
#   PARALLEL (2) as in bench/llamacpp.sh; OUT (default /tmp/switchyard-replay-DATE: the request
#   file and one results directory per seed); SY (a switchyard binary instead of building).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHARED_CORES=${SHARED_CORES:-1.5}
POLICIES=${POLICIES:-cost,round-robin,sglang-cache-aware,dynamo-kv}
SEEDS=${SEEDS:-"1 2 3"}
RATE_SCALE=${RATE_SCALE:-8}
DURATION=${DURATION:-60}
BLOCK_TOKENS=${BLOCK_TOKENS:-16}
CTX=${CTX:-4096}
PARALLEL=${PARALLEL:-2}
OUT=${OUT:-${TMPDIR:-/tmp}/switchyard-replay-$(date +%Y%m%d-%H%M%S)}

die() {
    printf '[replay] error: %s\n' "$*" >&2
    exit 1
}

if [[ -z ${SY:-} ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p switchyard) || die "build failed"
    SY=$ROOT/target/release/switchyard
fi
[[ -x $SY ]] || die "no switchyard binary at $SY"

# shellcheck source=bench/lib.sh
source "$ROOT/bench/lib.sh"
workload=$OUT/mooncake-x$RATE_SCALE.jsonl
llamacpp_workload "$workload" "$RATE_SCALE" "$DURATION" "$BLOCK_TOKENS" $((CTX / PARALLEL - 148))

args=(sim --workload "$workload" --profile "$ROOT/bench/profiles/cpu-tiny-llamacpp.json"
    --instances 4 --max-num-seqs "$PARALLEL" --max-model-len $((CTX / PARALLEL))
    --num-gpu-blocks 4096 --policies "$POLICIES" --quiet)
[[ $SHARED_CORES == none ]] || args+=(--shared-cores "$SHARED_CORES")
[[ -z ${ROUTER_CONFIG:-} ]] || args+=(--router-config "$ROUTER_CONFIG")

for seed in $SEEDS; do
    echo "== seed $seed (shared cores: $SHARED_CORES)"
    "$SY" "${args[@]}" --seed "$seed" --out "$OUT/seed-$seed" |
        awk 'NR == 1 || /^[a-z]/ { printf "%-20s %9s %9s %9s %7s\n", $1, $2, $3, $5, $13 }' |
        grep -v -e '^wall' -e '^peak' -e '^wrote'
done
echo "results in $OUT"
