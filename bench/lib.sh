# shellcheck shell=bash
# Shared pieces of the bench/*.sh scripts that start processes on loopback: `source` it after
# defining log and die.
#
#   bench_processes NAME   $TMP (a fresh directory), $PIDS, and a trap that stops every
#                          process started with `start` and removes $TMP on exit
#   start NAME CMD...      a background process, output in $TMP/NAME.{out,err}; sets LAST_PID
#   stop PID...            TERM, then KILL after 5 s; forgets them
#   address NAME PID       the URL of the process's `listening on` line (60 s at most)
#   free_port              a free port on 127.0.0.1
#   install_nginx          Debian's nginx-light if no nginx is installed; sets NGINX
#   cpu_ticks PID...       user + system clock ticks those processes have used
#   median                 the median of the numbers on stdin (0 if none)
#   field LINE KEY         the value of KEY=VALUE in a line of such pairs (0 if absent)
#   llamacpp_workload FILE SCALE DURATION BLOCK_TOKENS MAX_PROMPT_TOKENS
#                          bench/llamacpp_workload.py's request file for the tiny model (written
#                          once; its summary in FILE.txt)

bench_processes() {
    TMP=$(mktemp -d "${TMPDIR:-/tmp}/switchyard-$1.XXXXXX")
    PIDS=()
    trap bench_cleanup EXIT
    trap 'exit 130' INT TERM
}

# TERM every pid given, wait up to 5 s for them to exit, then KILL and reap what is left.
bench_kill_all() {
    local pid
    for pid in "$@"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for _ in $(seq 1 50); do
        local alive=0
        for pid in "$@"; do
            kill -0 "$pid" 2>/dev/null && alive=1
        done
        ((alive)) || break
        sleep 0.1
    done
    for pid in "$@"; do
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}

bench_cleanup() {
    bench_kill_all "${PIDS[@]}"
    rm -rf "$TMP"
}

start() {
    local name=$1
    shift
    # exec: the recorded pid is the process itself, so it can be stopped.
    exec "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
    LAST_PID=$!
    PIDS+=("$LAST_PID")
}

stop() {
    local pid keep=()
    bench_kill_all "$@"
    for pid in "${PIDS[@]}"; do
        [[ " $* " == *" $pid "* ]] || keep+=("$pid")
    done
    PIDS=("${keep[@]}")
}

address() {
    local url
    for _ in $(seq 1 1200); do
        if url=$(grep -o -m1 'http://[0-9.]*:[0-9]*' "$TMP/$1.out" 2>/dev/null); then
            echo "$url"
            return
        fi
        kill -0 "$2" 2>/dev/null || { tail -20 "$TMP/$1.err" >&2; die "$1 exited"; }
        sleep 0.05
    done
    die "$1 printed no address"
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

install_nginx() {
    if ! command -v nginx >/dev/null 2>&1 && [[ ! -x /usr/sbin/nginx ]]; then
        log "installing nginx (Debian package)..."
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y nginx-light >/dev/null 2>&1 ||
            { apt-get update >/dev/null && apt-get install -y nginx-light >/dev/null; } ||
            die "cannot install nginx"
    fi
    # shellcheck disable=SC2034 # used by the scripts that source this
    NGINX=$(command -v nginx || echo /usr/sbin/nginx)
}

cpu_ticks() {
    local t=0 p v
    for p in "$@"; do
        v=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)
        t=$((t + v))
    done
    echo "$t"
}

median() {
    sort -g | awk '{a[NR]=$1} END {if (NR==0) print 0; else if (NR%2) print a[(NR+1)/2]; else printf "%.1f\n", (a[NR/2]+a[NR/2+1])/2}'
}

field() {
    local kv
    for kv in $1; do
        [[ $kv == "$2="* ]] && {
            echo "${kv#*=}"
            return
        }
    done
    echo 0
}

llamacpp_workload() {
    local file=$1
    [[ -s $file ]] && return 0
    mkdir -p "$(dirname "$file")"
    python3 "$(dirname "${BASH_SOURCE[0]}")/llamacpp_workload.py" "$file" --model tiny-llama \
        --rate-scale "$2" --duration "$3" --block-tokens "$4" --max-prompt-tokens "$5" \
        2>"$file.txt" || die "cannot write the workload"
}
