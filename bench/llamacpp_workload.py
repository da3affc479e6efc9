#!/usr/bin/env python3
"""The Mooncake conversation trace as a request file for the tiny llama.cpp model.

    python3 bench/llamacpp_workload.py OUT.jsonl [--rate-scale 4] [--duration 60] ...

Reads data/traces/mooncake_conversation_trace.jsonl.xz (rows: timestamp in ms, input_length,
output_length, hash_ids; each hash id is one 512-token block, prefix-chained, so rows sharing
their first n hash ids share their first n x 512 tokens) and writes the requests that
`switchyard bench --workload OUT.jsonl` replays (one `Request` a line, see
crates/workload/src/request.rs), scaled for the tiny model that scripts/make_tiny_llama.py
writes:

- Tokens. Hash id h becomes a block of `--block-tokens` B (16) tokens: B "words" of one
  character each, a space then a letter or digit (" k"), drawn by a random stream seeded with
  h. The tiny vocabulary has each printable character with a leading `\u2581` as one piece, so
  every word is exactly one token and word boundaries never merge: equal hash-id prefixes are
  equal token prefixes, and a block is B tokens (`--check URL` verifies both against a running
  llama.cpp server's `POST /tokenize`). (The vocabulary's 30 whole words are not used: the SPM
  merge needs every intermediate piece, such as `\u2581ju` on the way to `\u2581jumps`, so
  llama.cpp tokenizes them character by character.)
- Input lengths are scaled by B / 512: a row of input_length L gets round(L x B / 512) tokens
  (its first full blocks, then the start of the next), at most `--max-prompt-tokens` (1900,
  so prompt + chat template (23 tokens) + answer fit a 2048-token slot: llama_server.py's
  default context 4096 over 2 slots).
- Output lengths: round(output_length / `--output-div` (16)), clamped to
  [`--output-min` (16), `--output-max` (48)].
- Time: offsets are the trace's timestamps divided by `--rate-scale` (4); only requests due
  in the first `--duration` (60) seconds are written, from `--start-s` (0) of trace time.

Each request is a text prompt of one segment per block, which `switchyard bench --api chat`
sends as one user message. Standard library only; the same arguments give the same bytes.
"""

import argparse
import json
import lzma
import os
import random
import string
import sys
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "data", "traces", "mooncake_conversation_trace.jsonl.xz")
SYMBOLS = string.ascii_letters + string.digits
TRACE_BLOCK = 512


def block(h, b):
    """The text of hash id `h`: b one-token words, deterministic in h."""
    rng = random.Random(h * 1_000_003 + 17)
    return "".join(" " + rng.choice(SYMBOLS) for _ in range(b))


def convert(rows, args):
    """Yields (request dict, hash ids used) for the rows in the window."""
    start_ms = args.start_s * 1000.0
    n = 0
    for row in rows:
        if row["timestamp"] < start_ms:
            continue
        offset = (row["timestamp"] - start_ms) / 1000.0 / args.rate_scale
        if offset >= args.duration:
            break
        hashes = row["hash_ids"]
        tokens = round(row["input_length"] * args.block_tokens / TRACE_BLOCK)
        tokens = max(1, min(tokens, args.max_prompt_tokens, len(hashes) * args.block_tokens))
        full, rest = divmod(tokens, args.block_tokens)
        segments = [block(h, args.block_tokens) for h in hashes[:full]]
        if rest:
            segments.append(block(hashes[full], args.block_tokens)[: 2 * rest])
        out = round(row["output_length"] / args.output_div)
        out = min(max(out, args.output_min), args.output_max)
        yield {
            "id": n,
            "arrival_s": round(offset, 6),
            "model": args.model,
            "prompt": {"text": segments},
            "max_tokens": out,
        }, hashes[: full + (1 if rest else 0)]
        n += 1


def tokenize(url, text):
    req = urllib.request.Request(
        url.rstrip("/") + "/tokenize", data=json.dumps({"content": text}).encode(),
        headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["tokens"]


def check(url, requests, b):
    """Verifies one-token words and equal token prefixes for equal hash-id prefixes."""
    toks = tokenize(url, block(0, b))
    # With add_space_prefix the text's first word also gets a leading `▁`: the first token
    # is the lone `▁`, then the B words.
    if len(toks) != b + 1:
        raise SystemExit(f"check: block 0 is {len(toks) - 1} tokens, not {b}")
    pairs = 0
    by_first = {}
    for req, hashes in requests[:400]:
        by_first.setdefault(hashes[0], []).append((req, hashes))
    for group in by_first.values():
        for (r1, h1), (r2, h2) in zip(group, group[1:]):
            common = 0
            while common < min(len(h1), len(h2)) and h1[common] == h2[common]:
                common += 1
            t1 = tokenize(url, "".join(r1["prompt"]["text"]))
            t2 = tokenize(url, "".join(r2["prompt"]["text"]))
            want = sum(len(s) // 2 for s in r1["prompt"]["text"][:common])
            # Token prefix shared: at least the common blocks' tokens (+ the leading `▁`).
            same = 0
            while same < min(len(t1), len(t2)) and t1[same] == t2[same]:
                same += 1
            if same < want + 1:
                raise SystemExit(f"check: requests {r1['id']} and {r2['id']} share {common} "
                                 f"hash ids ({want} tokens) but only {same} tokens")
            if len(t1) != sum(len(s) // 2 for s in r1["prompt"]["text"]) + 1:
                raise SystemExit(f"check: request {r1['id']} is not one token a word")
            pairs += 1
            if pairs >= 40:
                print(f"check ok: blocks of {b} tokens; {pairs} pairs of requests share "
                      "their common hash-id prefix as a token prefix", file=sys.stderr)
                return
    print(f"check ok: blocks of {b} tokens; {pairs} pairs checked", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the .jsonl file to write ('-': stdout)")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--max-prompt-tokens", type=int, default=1900)
    ap.add_argument("--output-div", type=float, default=16.0)
    ap.add_argument("--output-min", type=int, default=16)
    ap.add_argument("--output-max", type=int, default=48)
    ap.add_argument("--rate-scale", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--start-s", type=float, default=0.0)
    ap.add_argument("--check", metavar="URL", help="verify the tokenization against a "
                    "llama.cpp server serving the tiny model")
    ap.add_argument("--stats", action="store_true", help="print workload statistics")
    args = ap.parse_args(argv)

    with lzma.open(args.trace, "rt") as f:
        rows = (json.loads(line) for line in f if line.strip())
        requests = list(convert(rows, args))
    out = sys.stdout if args.out == "-" else open(args.out + ".tmp", "w")
    for req, _ in requests:
        out.write(json.dumps(req, separators=(",", ":")) + "\n")
    if out is not sys.stdout:
        out.close()
        os.replace(args.out + ".tmp", args.out)
    if args.stats or args.out != "-":
        n = len(requests)
        tokens = sum(sum(len(s) // 2 for s in r["prompt"]["text"]) for r, _ in requests)
        seen, reused, distinct = set(), 0, 0
        for r, hashes in requests:
            k = 0
            while k < len(hashes) and hashes[k] in seen:
                k += 1
            reused += sum(len(s) // 2 for s in r["prompt"]["text"][:k])
            distinct += sum(len(s) // 2 for s in r["prompt"]["text"][k:])
            seen.update(hashes)
        outs = sum(r["max_tokens"] for r, _ in requests)
        last = requests[-1][0]["arrival_s"] if requests else 0
        print(f"{n} requests over {last:.1f} s ({n / max(last, 1e-9):.2f} req/s), "
              f"prompt tokens {tokens} (mean {tokens / max(n, 1):.0f}), "
              f"of them a prefix seen before {reused} ({100 * reused / max(tokens, 1):.1f} %), "
              f"distinct {distinct}; output tokens {outs} (mean {outs / max(n, 1):.1f})",
              file=sys.stderr)
    if args.check:
        check(args.check, requests, args.block_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
