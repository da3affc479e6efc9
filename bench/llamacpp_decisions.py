#!/usr/bin/env python3
"""Why did switchyard route there? Replays a request file and keeps the decision headers.

    python3 bench/llamacpp_decisions.py WORKLOAD.jsonl URL OUT.jsonl [--model tiny-llama]
    python3 bench/llamacpp_decisions.py WORKLOAD.jsonl - OUT.jsonl --analyse

For diagnosis only (bench/llamacpp.sh does the measuring): sends every request of a
bench/llamacpp_workload.py file to URL (a `switchyard serve --debug-header`) at its offset,
streamed chat like `switchyard bench`, one thread a request, and writes one line a request:
its id, the backend (`x-switchyard-backend`), the decision (`x-switchyard-decision`), the
engine's prompt and cached tokens, and TTFT. Then prints how often a request that shares a
prefix with an earlier one went to the backend that served the earlier one (its prompt's
blocks are its segments, so the longest common run of leading segments is the shared
prefix), and a few decisions that went elsewhere. Standard library only.
"""

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse

# Tokens per trace block (bench/llamacpp_workload.py's `--block-tokens`; `--block-tokens` here).
BLOCK_TOKENS = 16


def send(base, model, req, out, lock):
    u = urllib.parse.urlsplit(base)
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": "".join(req["prompt"]["text"])}],
        "max_tokens": req["max_tokens"],
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    rec = {"id": req["id"]}
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
        c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = c.getresponse()
        rec["status"] = r.status
        rec["backend"] = r.getheader("x-switchyard-backend")
        rec["decision"] = r.getheader("x-switchyard-decision")
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                if (ch.get("delta") or {}).get("content") and "ttft_ms" not in rec:
                    rec["ttft_ms"] = (time.monotonic() - t0) * 1000
            if chunk.get("usage"):
                u_ = chunk["usage"]
                rec["prompt_tokens"] = u_.get("prompt_tokens")
                rec["cached_tokens"] = (u_.get("prompt_tokens_details") or {}).get("cached_tokens")
        c.close()
    except Exception as e:  # noqa: BLE001 (diagnosis: keep going, record it)
        rec["error"] = str(e)
    with lock:
        out[req["id"]] = rec


def analyse(requests, recs):
    """Share of prefix-sharing requests that went to the earlier sharer's backend, and where the
    cache hits they could have had went: the shared tokens of those sent to the sharer's backend
    against the cached tokens its engine reported (what eviction cost), and the shared tokens of
    those sent elsewhere (what routing away cost)."""
    seen = []  # (segments, backend) of earlier requests, in send order
    hits = misses = 0
    examples = []
    # "holder" / "away": [requests, shared tokens (blocks x BLOCK_TOKENS), cached tokens reported]
    split = {"holder": [0, 0, 0], "away": [0, 0, 0]}
    prompt_tokens = 0
    for req in requests:
        rec = recs.get(req["id"], {})
        segs = req["prompt"]["text"]
        best, best_backend = 0, None
        for psegs, pbackend in seen[-400:]:
            k = 0
            while k < min(len(segs), len(psegs)) and segs[k] == psegs[k]:
                k += 1
            if k >= best and k > 0:
                best, best_backend = k, pbackend
        prompt_tokens += rec.get("prompt_tokens") or 0
        # Only prefixes beyond the first block (the trace's common system block) count.
        if best >= 2 and rec.get("backend"):
            kind = "holder" if rec["backend"] == best_backend else "away"
            row = split[kind]
            row[0] += 1
            row[1] += best * BLOCK_TOKENS
            row[2] += rec.get("cached_tokens") or 0
            if kind == "holder":
                hits += 1
            else:
                misses += 1
                if len(examples) < 8:
                    examples.append((req["id"], best, best_backend, rec))
        seen.append((segs, rec.get("backend")))
    return hits, misses, examples, split, prompt_tokens


def report(requests, out):
    hits, misses, examples, split, prompt_tokens = analyse(requests, out)
    total = hits + misses
    print(f"requests sharing >= 2 blocks with an earlier one: {total}; sent to the backend "
          f"of the longest earlier sharer: {hits} ({100 * hits / max(total, 1):.1f} %)")
    for kind, (n, shared, cached) in split.items():
        print(f"- {kind:6}: {n} requests, shared tokens {100 * shared / max(prompt_tokens, 1):.1f} %"
              f" of all prompt tokens, cached {100 * cached / max(prompt_tokens, 1):.1f} %")
    for rid, blocks, want, rec in examples:
        print(f"- request {rid}: shares {blocks} blocks with a request served by {want}; went "
              f"to {rec.get('backend')} (cached {rec.get('cached_tokens')} of "
              f"{rec.get('prompt_tokens')}):\n  {rec.get('decision')}")


def main(argv=None):
    global BLOCK_TOKENS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("url", help="the router, or with --analyse: unused (write -)")
    ap.add_argument("out")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--analyse", action="store_true",
                    help="only analyse OUT, written by an earlier run, against WORKLOAD")
    ap.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS,
                    help="tokens per trace block the workload was written with (16)")
    args = ap.parse_args(argv)
    BLOCK_TOKENS = args.block_tokens
    with open(args.workload) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    if args.analyse:
        with open(args.out) as f:
            out = {r["id"]: r for r in (json.loads(line) for line in f if line.strip())}
        report(requests, out)
        return 0
    out, lock, threads = {}, threading.Lock(), []
    start = time.monotonic() + 0.05
    for req in requests:
        delay = start + req["arrival_s"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=send, args=(args.url, args.model, req, out, lock),
                             daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    with open(args.out, "w") as f:
        for req in requests:
            f.write(json.dumps(out.get(req["id"], {"id": req["id"]})) + "\n")
    report(requests, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
