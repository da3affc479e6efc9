#!/usr/bin/env python3
"""How much the engines of one bench/llamacpp.sh run slowed each other, from their own logs.

    .venv/bin/python bench/llamacpp_sharing.py RUN_DIR [RUN_DIR ...]

RUN_DIR: one run's directory of bench/llamacpp.sh (`$OUT/runs/ROUTER/N`, holding
engine1.log.xz ... engineK.log.xz). Each llama.cpp log gives, per request, when a slot took it
and let it go, its prompt evaluation (time and new tokens) and its answer (time and tokens).
The logs' clocks start with each process; they are put on one clock with the slot lines'
`t_last`, the monotonic time of the slot's previous release, which every engine reads from the
same system clock (alignment within about 0.1 ms; the engines start up to 0.1 s apart, more
than an answer lasts).

Two least-squares fits, over every request of the run:

- answers (at least 8 tokens): time per output token against the mean number of sequences on
  its engine meanwhile (itself included), the prompt tokens its engine evaluated meanwhile per
  output token, and the mean number of *other* engines with a request meanwhile: the last
  coefficient, over the time per token with no other engine busy, is the share of its speed an
  engine loses per busy neighbour, the figure the router learns (`Learned::shared_compute`,
  docs/core.md);
- prompt evaluations (at least 64 new tokens): time against the new tokens, the other requests
  on its engine evaluating a prompt meanwhile, those decoding meanwhile, and the other engines
  busy meanwhile (llama.cpp evaluates the prompts of its busy slots in the same batches, so a
  prompt evaluated beside another takes longer by about the other's evaluation).

On engines that do not share compute both neighbour coefficients are zero within their standard
errors. Needs numpy (the project's .venv has it).
"""

import lzma
import re
import sys

import numpy as np

LAUNCH = re.compile(r"launch_slot_: id +\d+ \| task (\d+)")
PROMPT = re.compile(r"task (\d+) \| prompt eval time = +([\d.]+) ms / +(\d+) tokens")
ANSWER = re.compile(r"task (\d+) \| +eval time = +([\d.]+) ms / +(\d+) tokens")
RELEASE = re.compile(r"release: id +(\d+) \| task (\d+)")
T_LAST = re.compile(r"get_availabl: id +(\d+) .*t_last = (\d+)")


def log_seconds(stamp):
    """llama.cpp's log stamp, minutes.seconds.milliseconds.microseconds since start, in s."""
    minutes, seconds, millis, micros = stamp.split(".")
    return int(minutes) * 60 + int(seconds) + int(millis) / 1e3 + int(micros) / 1e6


def load(path):
    """The requests of one engine log, on the system's monotonic clock (s)."""
    tasks, last_release, offsets = {}, {}, []
    with lzma.open(path, "rt") as log:
        for line in log:
            at = log_seconds(line.split(" ", 1)[0])
            if m := T_LAST.search(line):
                slot = int(m[1])
                if slot in last_release:
                    offsets.append(int(m[2]) / 1e6 - last_release[slot])
            elif m := LAUNCH.search(line):
                tasks.setdefault(int(m[1]), {})["start"] = at
            elif m := PROMPT.search(line):
                tasks.setdefault(int(m[1]), {}).update(P=float(m[2]) / 1e3, N=int(m[3]))
            elif m := ANSWER.search(line):
                tasks.setdefault(int(m[1]), {}).update(E=float(m[2]) / 1e3, M=int(m[3]))
            elif m := RELEASE.search(line):
                last_release[int(m[1])] = at
                tasks.setdefault(int(m[2]), {})["end"] = at
    if not offsets:
        sys.exit(f"{path}: no slot line with t_last to align the clock")
    offset = float(np.median(offsets))
    done = [t for t in tasks.values() if {"start", "end", "P", "N", "E", "M"} <= t.keys()]
    for t in done:
        t["start"] += offset
        t["end"] += offset
    return done


def overlap(a0, a1, b0, b1):
    return max(0.0, min(a1, b1) - max(a0, b0))


def busy_share(tasks, w0, w1):
    """Share of [w0, w1] during which the engine had at least one request."""
    spans = sorted((max(t["start"], w0), min(t["end"], w1)) for t in tasks
                   if t["end"] > w0 and t["start"] < w1)
    covered, cur0, cur1 = 0.0, None, None
    for a, b in spans:
        if cur1 is None or a > cur1:
            if cur1 is not None:
                covered += cur1 - cur0
            cur0, cur1 = a, b
        else:
            cur1 = max(cur1, b)
    if cur1 is not None:
        covered += cur1 - cur0
    return covered / (w1 - w0)


def fit(rows):
    """Least squares of the last column on the others (with an intercept): (coef, se)."""
    a = np.array(rows)
    x = np.column_stack([np.ones(len(a)), a[:, :-1]])
    y = a[:, -1]
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ beta
    s2 = residual @ residual / (len(y) - x.shape[1])
    se = np.sqrt(np.diag(s2 * np.linalg.inv(x.T @ x)))
    return beta, se, a


def others_busy(engines, e, w0, w1):
    return sum(busy_share(engines[o], w0, w1) for o in range(len(engines)) if o != e)


def analyse(run_dir):
    engines = []
    k = 1
    while True:
        try:
            engines.append(load(f"{run_dir}/engine{k}.log.xz"))
        except FileNotFoundError:
            break
        k += 1
    if len(engines) < 2:
        sys.exit(f"{run_dir}: fewer than two engine logs")
    answers, prompts = [], []
    for e, tasks in enumerate(engines):
        for t in tasks:
            w1 = t["end"]
            w0 = w1 - t["E"]
            if t["M"] >= 8 and w1 > w0:
                batch = sum(overlap(u["start"], u["end"], w0, w1) for u in tasks) / (w1 - w0)
                prefilled = sum(u["N"] * overlap(u["start"], u["start"] + u["P"], w0, w1)
                                / max(u["P"], 1e-6) for u in tasks if u is not t)
                answers.append((batch, prefilled / t["M"], others_busy(engines, e, w0, w1),
                                t["E"] / t["M"]))
            p1 = w0
            p0 = p1 - t["P"]
            if t["N"] >= 64 and p1 > p0:
                prefilling = sum(overlap(u["start"], u["end"] - u["E"], p0, p1) for u in tasks
                                 if u is not t) / (p1 - p0)
                decoding = sum(overlap(u["end"] - u["E"], u["end"], p0, p1) for u in tasks
                               if u is not t) / (p1 - p0)
                prompts.append((t["N"], prefilling, decoding, others_busy(engines, e, p0, p1),
                                t["P"]))
    beta, se, a = fit(answers)
    alone = a[:, 3].mean() - beta[3] * a[:, 2].mean()
    print(f"{run_dir}: {len(engines)} engines")
    print(f"  answers ({len(a)}): {a[:, 3].mean() * 1e3:.2f} ms per token; per sequence beside "
          f"{beta[1] * 1e3:.3f} ± {se[1] * 1e3:.3f} ms, per prompt token beside "
          f"{beta[2] * 1e6:.1f} ± {se[2] * 1e6:.1f} µs, per busy neighbour "
          f"{beta[3] * 1e3:.3f} ± {se[3] * 1e3:.3f} ms (share {beta[3] / alone:.3f}; "
          f"neighbours busy {a[:, 2].mean():.2f} on average)")
    beta, se, a = fit(prompts)
    print(f"  prompts ({len(a)}): {a[:, 4].mean() * 1e3:.1f} ms each; per new token "
          f"{beta[1] * 1e6:.1f} µs, per prompt evaluated beside {beta[2] * 1e3:.2f} ± "
          f"{se[2] * 1e3:.2f} ms, per answer decoding beside {beta[3] * 1e3:.2f} ± "
          f"{se[3] * 1e3:.2f} ms, per busy neighbour {beta[4] * 1e3:.2f} ± {se[4] * 1e3:.2f} ms "
          f"(neighbours busy {a[:, 3].mean():.2f} on average)")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for run_dir in sys.argv[1:]:
        analyse(run_dir)


if __name__ == "__main__":
    main()
