#!/usr/bin/env python3
"""Tables for docs/benchmarks.md from the output directory of bench/llamacpp.sh.

    python3 bench/llamacpp_report.py OUT                 # the comparison (OUT/runs)
    python3 bench/llamacpp_report.py --calibration OUT   # the rate scan (CALIBRATE=1)

Per run (OUT/runs/ROUTER/REP): latencies from results.json (`switchyard bench`, measured at
the client from each request's send); cache-hit share = sum(usage cached_tokens) /
sum(usage prompt_tokens), the engines' own counts as reported in each response's usage;
request share per engine = the growth of that engine's finished-request count (the
`print_timing ... total time` lines in its log, one per finished request) over the sum;
router CPU = user + system seconds of the router process and its children (/proc) from
when it is ready (answered its first request) to just before it is stopped (runs made
before bench/llamacpp.sh recorded the ready figure: from its start, start-up included). Per router: the median over the repetitions, then the range
(min-max) in brackets when there were several. Standard library only.
"""

import json
import os
import statistics
import sys

ROUTER_NAMES = {
    "sy-cost": "switchyard `cost`",
    "smg": "SMG 1.13.0 `cache_aware`",
    "sglang": "sglang-router 0.3.2 `cache_aware`",
    "vllm": "vllm-router 0.1.17 `cache_aware`",
    "nginx": "nginx round robin",
    "random": "random (no proxy)",
}


def router_name(r):
    if r in ROUTER_NAMES:
        return ROUTER_NAMES[r]
    if r.startswith("sy-"):
        return f"switchyard `{r[3:]}`"
    return r


def load_json(path):
    with open(path) as f:
        return json.load(f)


def read_num(path, default=None):
    try:
        with open(path) as f:
            return float(f.read().strip() or 0)
    except (OSError, ValueError):
        return default


def engine_requests(run_dir):
    """Finished requests per engine during the run."""
    out = []
    i = 1
    while os.path.exists(os.path.join(run_dir, "after", f"engine{i}.requests")):
        a = read_num(os.path.join(run_dir, "after", f"engine{i}.requests"), 0)
        b = read_num(os.path.join(run_dir, "before", f"engine{i}.requests"), 0)
        out.append(int(a - b))
        i += 1
    return out


def router_cpu(run_dir):
    """Router CPU seconds over the run: at the end less once ready (older runs: at the end)."""
    end = read_num(os.path.join(run_dir, "router-cpu-s"))
    ready = read_num(os.path.join(run_dir, "router-cpu-ready-s"))
    if end is None:
        return None
    return end - ready if ready is not None else end


def hist_quantile(prom_text, name, q):
    """The q-quantile of a Prometheus histogram from its cumulative buckets (the upper bound of
    the bucket it falls in), or None when the histogram is absent or empty."""
    buckets = []
    for line in prom_text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets.append((bound, float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] <= 0:
        return None
    buckets.sort()
    total = buckets[-1][1]
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return None


def prediction_figures(run_dir):
    """Switchyard's own prediction error (the router's /metrics at the end of the run)."""
    path = os.path.join(run_dir, "router.prom")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        text = f.read()
    out = {}
    for key, name in (("ratio", "switchyard_ttft_prediction_ratio"),
                      ("cached_err", "switchyard_cached_prediction_error")):
        for q in (0.5, 0.9):
            out[f"{key}_p{int(q * 100)}"] = hist_quantile(text, name, q)
    return out


def run_figures(run_dir):
    """The figures of one run, or None if it is missing."""
    path = os.path.join(run_dir, "results.json")
    if not os.path.exists(path):
        return None
    s = load_json(path)["summary"]
    reqs = engine_requests(run_dir)
    total = sum(reqs)
    ttft, e2e = s.get("ttft") or {}, s.get("e2e") or {}
    return {
        "ttft_mean": ttft.get("mean_ms"),
        "ttft_p50": ttft.get("p50_ms"),
        "ttft_p99": ttft.get("p99_ms"),
        "e2e_p99": e2e.get("p99_ms"),
        "cache": s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else None,
        "share_min": min(reqs) / total if total else None,
        "share_max": max(reqs) / total if total else None,
        "reqs": reqs,
        "cpu": router_cpu(run_dir),
        "errors": s["failed"],
        "error_kinds": s.get("errors", {}),
        "ok": s["ok"],
        "planned": s["planned"],
        "rps": s["requests_per_s"],
        "late": s.get("late_sends", 0),
        **prediction_figures(run_dir),
    }


def fmt_ms(v):
    if v is None:
        return "—"
    return f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:.0f}"


def fmt_pct(v):
    return "—" if v is None else f"{100 * v:.1f} %"


def fmt_cpu(v):
    return "—" if v is None else f"{v:.1f}"


def cell(runs, key, fmt):
    vals = [r[key] for r in runs if r[key] is not None]
    if not vals:
        return "—"
    med = fmt(statistics.median(vals))
    if len(vals) == 1:
        return med
    lo, hi = fmt(min(vals)), fmt(max(vals))
    return med if lo == hi else f"{med} ({lo}–{hi})"


def comparison(out):
    runs_dir = os.path.join(out, "runs")
    if not os.path.isdir(runs_dir):
        return []
    setup_path = os.path.join(out, "setup.json")
    setup = load_json(setup_path) if os.path.exists(setup_path) else {}
    order = setup.get("routers", "").split()
    routers = [r for r in order if os.path.isdir(os.path.join(runs_dir, r))]
    routers += sorted(set(os.listdir(runs_dir)) - set(routers))
    lines = [
        "| router | TTFT mean (ms) | TTFT p50 (ms) | TTFT p99 (ms) | e2e p99 (ms) "
        "| cache-hit share | request share min / max | router CPU (s) | errors | runs |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    detail = ["", "Requests per engine, each run (engine 1/2/...):", ""]
    for router in routers:
        rdir = os.path.join(runs_dir, router)
        reps = sorted(os.listdir(rdir), key=lambda x: int(x) if x.isdigit() else 99)
        runs = [f for f in (run_figures(os.path.join(rdir, rep)) for rep in reps) if f]
        if not runs:
            continue
        share = (f"{cell(runs, 'share_min', fmt_pct)} / {cell(runs, 'share_max', fmt_pct)}")
        errors = sum(r["errors"] for r in runs)
        if errors:
            kinds = {}
            for r in runs:
                for k, v in r["error_kinds"].items():
                    kinds[k] = kinds.get(k, 0) + v
            errors = f"{errors} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})"
        lines.append(
            f"| {router_name(router)} | {cell(runs, 'ttft_mean', fmt_ms)} | "
            f"{cell(runs, 'ttft_p50', fmt_ms)} | {cell(runs, 'ttft_p99', fmt_ms)} | "
            f"{cell(runs, 'e2e_p99', fmt_ms)} | {cell(runs, 'cache', fmt_pct)} | {share} | "
            f"{cell(runs, 'cpu', fmt_cpu)} | {errors} | {len(runs)} |")
        detail.append(f"- {router_name(router)}: "
                      + "; ".join("/".join(str(n) for n in r["reqs"]) + f" (ok {r['ok']}/"
                                  f"{r['planned']}, late sends {r['late']})" for r in runs))
    pred = ["", "Switchyard's predictions against outcomes (from its /metrics; bucket upper "
            "bounds, median over runs): observed ÷ estimated TTFT at p50 / p90, and "
            "|predicted − reported| cached tokens ÷ prompt tokens at p50 / p90:", ""]
    shown = False
    for router in routers:
        rdir = os.path.join(runs_dir, router)
        runs = [f for f in (run_figures(os.path.join(rdir, rep)) for rep in sorted(os.listdir(rdir)))
                if f]
        vals = {k: [r[k] for r in runs if r.get(k) is not None]
                for k in ("ratio_p50", "ratio_p90", "cached_err_p50", "cached_err_p90")}
        if not any(vals.values()):
            continue
        shown = True
        med = {k: (sorted(v)[len(v) // 2] if v else None) for k, v in vals.items()}
        f = lambda x: "-" if x is None else f"{x:.2f}"
        pred.append(f"- {router_name(router)}: TTFT ratio {f(med['ratio_p50'])} / "
                    f"{f(med['ratio_p90'])}; cached error {f(med['cached_err_p50'])} / "
                    f"{f(med['cached_err_p90'])}")
    return lines + detail + (pred if shown else [])


def calibration(out):
    cdir = os.path.join(out, "calibrate")
    lines = [
        "| rate scale | offered req/s | achieved req/s | TTFT p50 (ms) | TTFT p99 (ms) "
        "| p99 / p50 | e2e p99 (ms) | cache-hit share | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scale in sorted(os.listdir(cdir), key=float):
        path = os.path.join(cdir, scale, "results.json")
        if not os.path.exists(path):
            continue
        s = load_json(path)["summary"]
        f = run_figures(os.path.join(cdir, scale))
        offered = s["sent"] / s["schedule_s"] if s["schedule_s"] > 0 else 0
        ratio = (f["ttft_p99"] / f["ttft_p50"]) if f["ttft_p50"] else None
        lines.append(
            f"| {scale} | {offered:.2f} | {s['requests_per_s']:.2f} | {fmt_ms(f['ttft_p50'])} | "
            f"{fmt_ms(f['ttft_p99'])} | {'—' if ratio is None else f'{ratio:.1f}'} | "
            f"{fmt_ms(f['e2e_p99'])} | {fmt_pct(f['cache'])} | {f['errors']} |")
    return lines


def main(argv):
    if len(argv) == 3 and argv[1] == "--calibration":
        print("\n".join(calibration(argv[2])))
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(comparison(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
