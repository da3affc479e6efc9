#!/usr/bin/env python3
"""Tables for docs/benchmarks.md from the output directory of bench/peers.sh.

    python3 bench/peers_report.py OUT                 # the comparison and overhead tables
    python3 bench/peers_report.py --calibration OUT   # the saturation scan (CALIBRATE=1)

Client-side figures come from each run's results.json (written by `switchyard bench`);
cache and spread figures from the engines' own Prometheus metrics, scraped before and after
each run: prompt tokens served from cache = growth of vllm:prefix_cache_hits_total over growth
of vllm:prefix_cache_queries_total, summed over the engines; requests per engine = growth of
vllm:e2e_request_latency_seconds_count. Standard library only.
"""

import json
import os
import re
import sys

ROUTER_ORDER = ["switchyard", "envoy-epp", "sglang", "vllm", "nginx"]
ROUTER_NAMES = {
    "direct": "direct (engine 1)",
    "switchyard": "switchyard `cost`",
    "envoy-epp": "Envoy + switchyard epp `cost`",
    "sglang": "sglang-router `cache_aware`",
    "vllm": "vllm-router `cache_aware`",
    "nginx": "nginx round robin",
}
WORKLOAD_NAMES = {
    "mooncake": "Mooncake conversation trace (slice)",
    "shared": "Shared-prefix groups, Zipf popularity",
}
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metrics(path):
    """Sums of each metric name over its series in one Prometheus text file."""
    out = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                try:
                    out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
                except ValueError:
                    pass
    return out


def engine_deltas(run_dir):
    """Per engine: growth of each metric over the run."""
    before_dir = os.path.join(run_dir, "before")
    after_dir = os.path.join(run_dir, "after")
    deltas = []
    for name in sorted(os.listdir(after_dir), key=lambda n: int(re.sub(r"\D", "", n) or 0)):
        a = metrics(os.path.join(after_dir, name))
        b = metrics(os.path.join(before_dir, name)) if os.path.exists(
            os.path.join(before_dir, name)) else {}
        deltas.append({k: v - b.get(k, 0.0) for k, v in a.items()})
    return deltas


def load_json(path):
    with open(path) as f:
        return json.load(f)


def fmt_ms(lat, key):
    if not lat:
        return "—"
    v = lat[key]
    return f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:.0f}"


def row(run_dir):
    """Cells of one comparison row, or None if the run is missing."""
    path = os.path.join(run_dir, "results.json")
    if not os.path.exists(path):
        return None
    r = load_json(path)
    s = r["summary"]
    d = engine_deltas(run_dir)
    hits = sum(e.get("vllm:prefix_cache_hits_total", 0) for e in d)
    queries = sum(e.get("vllm:prefix_cache_queries_total", 0) for e in d)
    reqs = [int(round(e.get("vllm:e2e_request_latency_seconds_count", 0))) for e in d]
    total = sum(reqs)
    spread = "/".join(str(n) for n in reqs)
    imbalance = f"{max(reqs) / (total / len(reqs)):.2f}" if total else "—"
    errors = s["failed"]
    if errors:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["errors"].items()))
        errors = f"{errors} ({kinds})"
    ttft, e2e = s.get("ttft"), s.get("e2e")
    return [
        fmt_ms(ttft, "mean_ms"),
        fmt_ms(ttft, "p50_ms"),
        fmt_ms(ttft, "p99_ms"),
        fmt_ms(e2e, "p99_ms"),
        f"{s['requests_per_s']:.2f}",
        f"{s['output_tokens_per_s']:.0f}",
        f"{100 * hits / queries:.1f} % ({hits / 1e6:.2f}M)" if queries else "—",
        f"{spread} ({imbalance})",
        str(errors),
        f"{s['ok']}/{s['planned']}",
    ]


def comparison(out):
    lines = []
    setup_path = os.path.join(out, "setup.json")
    setup = load_json(setup_path) if os.path.exists(setup_path) else {}
    runs = os.path.join(out, "runs")
    if not os.path.isdir(runs):
        return lines
    for workload in sorted(os.listdir(runs), key=lambda w: list(WORKLOAD_NAMES).index(w)
                           if w in WORKLOAD_NAMES else 99):
        lines.append(f"### {WORKLOAD_NAMES.get(workload, workload)}\n")
        lines.append(
            "| load | router | TTFT mean (ms) | TTFT p50 (ms) | TTFT p99 (ms) | e2e p99 (ms) "
            "| req/s | output tok/s | prompt tokens from cache (engines) "
            "| requests per engine (max/mean) | errors | ok/planned |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
        wdir = os.path.join(runs, workload)
        for load in ["moderate", "saturation"] + sorted(
                set(os.listdir(wdir)) - {"moderate", "saturation"}):
            ldir = os.path.join(wdir, load)
            if not os.path.isdir(ldir):
                continue
            rate = setup.get(workload, {}).get(load, "")
            unit = "× trace rate" if workload == "mooncake" else "req/s"
            label = f"{load} ({rate} {unit})" if rate != "" else load
            for router in ROUTER_ORDER + sorted(set(os.listdir(ldir)) - set(ROUTER_ORDER)):
                cells = row(os.path.join(ldir, router))
                if cells:
                    lines.append(f"| {label} | {ROUTER_NAMES.get(router, router)} | "
                                 + " | ".join(cells) + " |")
        lines.append("")
    return lines


def overhead(out):
    odir = os.path.join(out, "overhead")
    if not os.path.isdir(odir):
        return []
    direct_path = os.path.join(odir, "direct", "results.json")
    if not os.path.exists(direct_path):
        return []
    d = load_json(direct_path)["summary"]
    lines = [
        "| target | TTFT p50 (ms) | TTFT p99 (ms) | e2e p50 (ms) | e2e p99 (ms) "
        "| added TTFT p50 | added TTFT p99 | added e2e p50 | added e2e p99 | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for target in ["direct"] + ROUTER_ORDER:
        path = os.path.join(odir, target, "results.json")
        if not os.path.exists(path):
            continue
        s = load_json(path)["summary"]
        t, e = s["ttft"], s["e2e"]
        cells = [f"{t['p50_ms']:.2f}", f"{t['p99_ms']:.2f}", f"{e['p50_ms']:.2f}",
                 f"{e['p99_ms']:.2f}"]
        if target == "direct":
            cells += ["—"] * 4
        else:
            cells += [f"{t['p50_ms'] - d['ttft']['p50_ms']:+.2f}",
                      f"{t['p99_ms'] - d['ttft']['p99_ms']:+.2f}",
                      f"{e['p50_ms'] - d['e2e']['p50_ms']:+.2f}",
                      f"{e['p99_ms'] - d['e2e']['p99_ms']:+.2f}"]
        cells.append(str(s["failed"]))
        lines.append(f"| {ROUTER_NAMES.get(target, target)} | " + " | ".join(cells) + " |")
    return lines


def calibration(out):
    lines = []
    cdir = os.path.join(out, "calibrate")
    for workload in sorted(os.listdir(cdir)):
        lines.append(f"### {WORKLOAD_NAMES.get(workload, workload)}: round robin, rising load\n")
        lines.append("| load | offered req/s | achieved req/s | TTFT p50 (ms) | TTFT p99 (ms) "
                     "| e2e p50 (ms) | e2e p99 (ms) | from cache | errors |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        wdir = os.path.join(cdir, workload)
        for load in sorted(os.listdir(wdir), key=float):
            path = os.path.join(wdir, load, "results.json")
            if not os.path.exists(path):
                continue
            s = load_json(path)["summary"]
            offered = s["sent"] / s["schedule_s"] if s["schedule_s"] > 0 else 0
            d = engine_deltas(os.path.join(wdir, load))
            hits = sum(e.get("vllm:prefix_cache_hits_total", 0) for e in d)
            queries = sum(e.get("vllm:prefix_cache_queries_total", 0) for e in d)
            lines.append(
                f"| {load} | {offered:.2f} | {s['requests_per_s']:.2f} | "
                f"{fmt_ms(s['ttft'], 'p50_ms')} | {fmt_ms(s['ttft'], 'p99_ms')} | "
                f"{fmt_ms(s['e2e'], 'p50_ms')} | {fmt_ms(s['e2e'], 'p99_ms')} | "
                f"{100 * hits / queries if queries else 0:.1f} % | {s['failed']} |")
        lines.append("")
    return lines


def main(argv):
    if len(argv) == 3 and argv[1] == "--calibration":
        print("\n".join(calibration(argv[2])))
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = argv[1]
    lines = comparison(out)
    o = overhead(out)
    if o:
        lines.append("### Overhead: added latency over calling one engine directly\n")
        lines += o
        lines.append("")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
