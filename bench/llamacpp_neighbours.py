#!/usr/bin/env python3
"""How much busy neighbours slow one llama.cpp engine on this machine.

    .venv/bin/python bench/llamacpp_neighbours.py [--engines 4] [--probes 25] [--words 300]

Starts `--engines` llama.cpp servers as bench/llamacpp.sh does (scripts/llamacpp_server.py,
the tiny GGUF that scripts/make_tiny_llama.py writes, one thread and two slots each, no host
prompt cache), then for 0, 1, ... engines-1 busy neighbours (each sent new prompts back to back
from its own thread) times `--probes` new prompts of `--words` words sent one at a time to the
first engine (1 output token, prompt caching off) and prints the median and mean latency.
On independent hardware the rows are equal; four one-thread engines on two cores show how much
an idle engine's compute is its neighbours' (docs/benchmarks.md, twenty-first session). Every
server binds 127.0.0.1 on a free port and is stopped on exit.
"""

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.expanduser("~/.cache/switchyard-bench/tiny-llama.gguf")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(port, prompt, max_tokens):
    """Seconds for one non-streamed completion."""
    body = json.dumps(
        {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "cache_prompt": False}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
    return time.perf_counter() - start


def text(words, seed):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def wait_ready(port, deadline_s=60.0):
    end = time.monotonic() + deadline_s
    while True:
        try:
            complete(port, "hi", 1)
            return
        except OSError:
            if time.monotonic() > end:
                raise SystemExit(f"engine on port {port} did not answer within {deadline_s} s")
            time.sleep(0.1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--probes", type=int, default=25)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--model", default=MODEL)
    args = ap.parse_args()
    if not os.path.exists(args.model):
        raise SystemExit(f"no model at {args.model}: run bench/llamacpp.sh once (it writes it)")
    ports = [free_port() for _ in range(args.engines)]
    engines = [
        subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts/llamacpp_server.py"), args.model,
             "--alias", "tiny-llama", "--ctx", "4096", "--parallel", "2", "--threads", "1",
             "--cache-ram", "0", "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    try:
        for port in ports:
            wait_ready(port)
        stop = threading.Event()

        def keep_busy(port, seed):
            n = 0
            while not stop.is_set():
                complete(port, text(args.words, seed * 100_000 + n), 20)
                n += 1

        print("busy neighbours | median (ms) | mean (ms)")
        for busy in range(args.engines):
            stop.clear()
            threads = [
                threading.Thread(target=keep_busy, args=(ports[1 + j], j), daemon=True)
                for j in range(busy)
            ]
            for t in threads:
                t.start()
            samples = [
                complete(ports[0], text(args.words, busy * 1000 + k), 1)
                for k in range(args.probes)
            ]
            stop.set()
            for t in threads:
                t.join()
            print(f"{busy} | {statistics.median(samples) * 1e3:.1f} | "
                  f"{statistics.mean(samples) * 1e3:.1f}", flush=True)
    finally:
        for e in engines:
            e.terminate()
        for e in engines:
            e.wait(timeout=10)


if __name__ == "__main__":
    main()
