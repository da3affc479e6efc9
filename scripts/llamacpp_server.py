#!/usr/bin/env python3
"""Run one llama.cpp HTTP server (the C++ server, in-process through `xllamacpp`) on loopback.

    .venv/bin/python scripts/llamacpp_server.py MODEL.gguf [--port 0] [--alias NAME]

Binds 127.0.0.1 only (port 0: ephemeral), with `/metrics` and `/slots` on and the prompt
cache on (`cache_prompt`, the server default). Prints `listening on http://127.0.0.1:PORT`
once `GET /health` answers 200, then serves until SIGTERM or SIGINT. llama.cpp's own log
goes to stderr. Install the package with `scripts/llamacpp-env.sh`; make a model with
`scripts/make_tiny_llama.py`.
"""

import argparse
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import xllamacpp as xlc


def wait_healthy(base: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:  # loading (503) or not yet bound
            last = e
        time.sleep(0.05)
    raise RuntimeError(f"{base}/health not OK within {deadline_s}s: {last}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="path to a .gguf model")
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: ephemeral)")
    ap.add_argument("--alias", default=None, help="model name served (default: the path)")
    ap.add_argument("--ctx", type=int, default=4096, help="context size over all slots")
    ap.add_argument("--parallel", type=int, default=2, help="slots (concurrent sequences)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for compute")
    ap.add_argument("--seed", type=int, default=42, help="sampling seed")
    ap.add_argument("--cache-ram", type=int, default=None, metavar="MIB",
                    help="host-RAM prompt cache in MiB (llama.cpp's --cache-ram; 0: off; "
                         "default: llama.cpp's own, 8192)")
    args = ap.parse_args(argv)

    params = xlc.CommonParams()
    params.model.path = args.model
    if args.alias:
        params.model_alias = {args.alias}
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.endpoint_metrics = True
    params.endpoint_slots = True
    params.cache_prompt = True
    if args.cache_ram is not None:
        params.cache_ram_mib = args.cache_ram
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.n_threads_http = 4
    params.sampling.seed = args.seed

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    server = xlc.Server(params)  # loads the model and starts the HTTP server thread
    base = server.listening_address.rstrip("/")
    wait_healthy(base, 60)
    print(f"listening on {base}", flush=True)
    while not stop.wait(0.5):
        pass
    del server  # the destructor stops the HTTP server and the main loop
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
