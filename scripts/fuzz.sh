#!/usr/bin/env bash
# Builds the fuzz targets in fuzz/ with libFuzzer's coverage instrumentation and runs each one
# (docs/gateway.md, "Fuzzing"). Stable Rust is enough: the instrumentation is plain `-C` flags
# (what `cargo fuzz build --sanitizer none` passes), so neither cargo-fuzz nor nightly is needed.
#
#   bash scripts/fuzz.sh                 # every target, FUZZ_SECONDS (12) each: what CI runs
#   FUZZ_SECONDS=600 bash scripts/fuzz.sh sse_scanner   # one target, longer
#
# Each run starts from the committed corpus (fuzz/corpus/TARGET) and with a fixed seed, so a
# CI run repeats; new inputs go to a scratch copy unless FUZZ_GROW_CORPUS=1 (then into the
# committed corpus, minimised: commit what helps). A crash leaves its input in
# fuzz/artifacts/TARGET/ and fails the script.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

SECONDS_EACH=${FUZZ_SECONDS:-12}
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
    TARGETS=(request_parser sse_scanner prometheus_text fleet_file)
fi

export RUSTFLAGS="${RUSTFLAGS:-} --cfg fuzzing -Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares"
# An explicit --target keeps RUSTFLAGS off build scripts (they cannot link the coverage hooks).
HOST=$(rustc -vV | sed -n 's/^host: //p')
echo "== building fuzz targets (release, instrumented, $HOST)"
cargo build --release --quiet --bins --target "$HOST"

status=0
for target in "${TARGETS[@]}"; do
    corpus="corpus/$target"
    mkdir -p "$corpus" "artifacts/$target"
    if [ "${FUZZ_GROW_CORPUS:-0}" = 1 ]; then
        work="$corpus"
    else
        work="$(mktemp -d)"
        cp -r "$corpus/." "$work/" 2>/dev/null || true
    fi
    echo "== $target: ${SECONDS_EACH}s from $(find "$corpus" -type f | wc -l) corpus inputs"
    if ! "target/$HOST/release/$target" "$work" -seed=1 -max_total_time="$SECONDS_EACH" \
        -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="artifacts/$target/" 2>"artifacts/$target/log.txt"; then
        tail -40 "artifacts/$target/log.txt" >&2
        echo "fuzz: $target FAILED (input in fuzz/artifacts/$target/)" >&2
        status=1
    else
        grep -E "^stat::number_of_executed_units|^Done" "artifacts/$target/log.txt" | tail -2
    fi
    if [ "$work" != "$corpus" ]; then rm -rf "$work"; fi
done
exit $status
