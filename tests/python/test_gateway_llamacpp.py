"""`switchyard serve` in front of three real llama.cpp servers.

The engines are llama.cpp's own C++ HTTP server, run in-process by the pinned `xllamacpp`
wheel (scripts/llamacpp_server.py), serving a tiny random-weight Llama that
scripts/make_tiny_llama.py writes at test time (nothing is downloaded). Checked through the
gateway: chat and completions, streaming SSE passthrough (and llama.cpp closing the
connection after every streamed response), scraping of the `llamacpp:*` metrics, and cache
affinity shown by the engine's own `usage.prompt_tokens_details.cached_tokens`.

Needs `scripts/python-env.sh` and `scripts/llamacpp-env.sh`; the binary comes from
$SWITCHYARD_BIN (default target/debug/switchyard).
"""

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

if not os.environ.get("CI"):
    # Outside CI a venv without the engine skips. In CI (scripts/test.sh installs it) there is
    # no skip: a missing package fails the fixture, with the engine's import error.
    pytest.importorskip("xllamacpp", reason="run scripts/llamacpp-env.sh")

REPO = Path(__file__).resolve().parents[2]
BIN = os.environ.get("SWITCHYARD_BIN", str(REPO / "target" / "debug" / "switchyard"))
MODEL = "tiny-llama"
ADMIN_TOKEN = "llamacpp-admin-token"
N_ENGINES = 3


def read_address(proc, what, log, deadline_s=45.0):
    """Wait (with a deadline) for `listening on URL` on the process's stdout."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + deadline_s
    buf = b""
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith("listening on "):
                    return line.split("listening on ", 1)[1].strip()
    finally:
        sel.close()
    tail = Path(log).read_text(errors="replace")[-2000:] if log else ""
    raise AssertionError(f"{what} did not print its address (exit {proc.poll()}):\n{tail}")


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def metric_samples(text, name):
    """{labels string: value} for every sample of `name` in Prometheus text."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def backend_value(samples, backend, **labels):
    total = 0.0
    for k, v in samples.items():
        if f'backend="{backend}"' in k and all(f'{lk}="{lv}"' in k for lk, lv in labels.items()):
            total += v
    return total


def poll(check, what, deadline_s=15.0):
    """Call `check()` until it returns something truthy, or fail after the deadline."""
    deadline = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if not Path(BIN).exists():
        pytest.fail(f"switchyard binary not found at {BIN}; run `cargo build -p switchyard`")
    tmp = tmp_path_factory.mktemp("llamacpp")
    model = tmp / "tiny-llama.gguf"
    made = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_llama.py"), str(model)],
        capture_output=True, text=True, timeout=60,
    )
    assert made.returncode == 0, made.stderr
    procs = []
    try:
        engines = []
        for i in range(N_ENGINES):
            log = tmp / f"engine-{i}.log"
            with open(log, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, str(REPO / "scripts" / "llamacpp_server.py"), str(model),
                     "--alias", MODEL, "--port", "0"],
                    stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                )
            procs.append(proc)
            engines.append((proc, log))
        urls = [read_address(p, f"llama.cpp server {i}", log) for i, (p, log) in enumerate(engines)]
        names = [f"llama-{i}" for i in range(N_ENGINES)]
        args = [BIN, "serve", "--listen", "127.0.0.1:0", "--admin-token", ADMIN_TOKEN,
                "--debug-header", "--scrape-interval", "0.2", "--health-interval", "0.5"]
        for name, url in zip(names, urls):
            args += ["--backend", f"{url},kind=llamacpp,models={MODEL},name={name}"]
        glog = tmp / "gateway.log"
        with open(glog, "wb") as err:
            gw = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        procs.append(gw)
        base = read_address(gw, "switchyard serve", glog, deadline_s=30)
        yield {"base": base, "engines": dict(zip(names, urls)), "names": names, "gateway": gw}
    finally:
        for p in reversed(procs):  # the gateway first, then the engines
            stop(p)


@pytest.fixture(scope="module")
def http(fleet):
    with httpx.Client(base_url=fleet["base"], timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=fleet["base"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def long_prompt(tag: str) -> str:
    # About 650 tokens with the tiny model's vocabulary; a unique tag up front so no earlier
    # test has this prefix cached anywhere.
    return f"[{tag}] " + ("the quick brown fox jumps over the lazy dog " * 20)


def test_models_through_the_gateway(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_discovery_and_kind_detection(fleet):
    # A second gateway given only the addresses: it finds the model in llama.cpp's
    # /v1/models and the engine kind from the `llamacpp:` metric names.
    args = [BIN, "serve", "--listen", "127.0.0.1:0", "--admin-token", ADMIN_TOKEN,
            "--scrape-interval", "0.2", "--health-interval", "0.5"]
    for name, url in fleet["engines"].items():
        args += ["--backend", f"{url},name={name}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    try:
        base = read_address(proc, "switchyard serve (discovery)", None, deadline_s=30)
        auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}

        def discovered():
            backends = httpx.get(base + "/admin/fleet", headers=auth, timeout=10).json()["backends"]
            done = len(backends) == N_ENGINES and all(
                b["models"] == [MODEL] and b["kind"] == "llamacpp" for b in backends)
            return done and backends

        poll(discovered, "every backend discovered with its model and detected as llamacpp")
        assert [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]] == [MODEL]
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        stop(proc)


def test_chat(client, fleet):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        max_tokens=6,
    )
    assert raw.headers["x-switchyard-backend"] in fleet["names"]
    r = raw.parse()
    assert r.object == "chat.completion"
    assert r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 0


def test_completions(client, fleet):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="once upon a time", max_tokens=5)
    assert raw.headers["x-switchyard-backend"] in fleet["names"]
    r = raw.parse()
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def sse_events(resp):
    """The `data:` payloads of an SSE response, as they arrive."""
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def test_streaming_passthrough_without_usage(http, fleet):
    # The gateway injects include_usage for itself and strips the usage-only chunk again.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream please"}],
            "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-switchyard-backend"] in fleet["names"]
        events = list(sse_events(resp))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["choices"] for c in chunks), "the injected usage chunk leaked to the client"
    assert all("usage" not in c or c["usage"] is None for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]


def test_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "usage please"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None


def test_llamacpp_closing_after_streams_fails_nothing(fleet, http):
    # llama.cpp closes the connection after every streamed response although it answers
    # `Keep-Alive: timeout=5, max=100`; a request the gateway sends on such a pooled
    # connection must be retried on a fresh one (`result="stale"`), not failed and not held
    # against the engine's health. Streamed and plain requests interleave from four clients.
    def client_loop(i):
        statuses = []
        with httpx.Client(base_url=fleet["base"], timeout=60) as c:
            for j in range(10):
                body = {"model": MODEL, "prompt": f"interleave {i} {j}", "max_tokens": 3}
                if (i + j) % 2:
                    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        events = list(sse_events(r))
                        statuses.append((r.status_code, events[-1] if events else None))
                else:
                    r = c.post("/v1/completions", json=body)
                    statuses.append((r.status_code, r.json()["choices"][0]["finish_reason"]))
        return statuses

    with ThreadPoolExecutor(4) as pool:
        results = [s for batch in pool.map(client_loop, range(4)) for s in batch]
    assert len(results) == 40
    assert all(status == 200 and end in ("[DONE]", "length") for status, end in results), results

    metrics = http.get("/metrics").text
    failures = metric_samples(metrics, "switchyard_upstream_failures_total")
    outcomes = metric_samples(metrics, "switchyard_requests_total")
    for name in fleet["names"]:
        for result in ("closed", "refused", "connect", "status_5xx", "status_429"):
            assert backend_value(failures, name, result=result) == 0, (name, result, failures)
        for outcome in ("server_error", "stream_error", "timeout"):
            assert backend_value(outcomes, name, outcome=outcome) == 0, (name, outcome, outcomes)
        assert backend_value(metric_samples(metrics, "switchyard_backend_healthy"), name) == 1
        # Probes too retry a connection llama.cpp closed, on a fresh one: no scrape or health
        # check fails under this traffic.
        scrapes = metric_samples(metrics, "switchyard_scrapes_total")
        checks = metric_samples(metrics, "switchyard_health_checks_total")
        assert backend_value(scrapes, name, result="error") == 0, (name, scrapes)
        assert backend_value(checks, name, result="error") == 0, (name, checks)


def test_metrics_are_scraped(http, fleet):
    def scrapes():
        s = metric_samples(http.get("/metrics").text, "switchyard_scrapes_total")
        return {n: (backend_value(s, n, result="ok"), backend_value(s, n, result="error"))
                for n in fleet["names"]}

    first = scrapes()

    def risen():
        now = scrapes()
        return all(now[n][0] >= first[n][0] + 2 for n in now) and now

    now = poll(risen, "the scrape counters of every llama.cpp backend to rise")
    # With no traffic in between, every scrape succeeds (under traffic too: see
    # test_llamacpp_closing_after_streams_fails_nothing).
    assert all(now[n][1] == first[n][1] for n in now), (first, now)


def test_admin_fleet_shows_llamacpp_metrics(http, fleet):
    assert http.get("/admin/fleet").status_code == 403
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}

    def fresh():
        r = http.get("/admin/fleet", headers=auth)
        assert r.status_code == 200
        backends = {b["name"]: b for b in r.json()["backends"]}
        if set(backends) != set(fleet["names"]):
            return None
        if all(b.get("engine") and b["engine"]["fresh"] for b in backends.values()):
            return backends
        return None

    backends = poll(fresh, "fresh engine metrics for every backend in /admin/fleet")
    for name, b in backends.items():
        assert b["kind"] == "llamacpp"
        assert b["address"].rstrip("/") == fleet["engines"][name].rstrip("/")
        assert b["models"] == [MODEL]
        # A scrape only yields metrics when `llamacpp:requests_processing` or
        # `llamacpp:requests_deferred` is there; idle engines report 0 for both.
        m = b["engine"]["metrics"]
        assert m["running"] == 0 and m["waiting"] == 0, m
        # The slot count comes from the engine's `/props` (`total_slots`; the launcher's
        # default is 2 slots), which its metrics do not carry.
        assert m["max_running"] == 2, m


def test_admin_fleet_shows_a_running_request(http, fleet):
    # While a long generation streams, the next scrape of that engine reads
    # `llamacpp:requests_processing 1`. About 1900 tokens take the tiny model a second or
    # more; scrapes come every 0.2 s. A generation that ends unseen is tried again.
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    body = {"model": MODEL, "prompt": "keep going", "max_tokens": 1900, "stream": True}
    seen = None
    with httpx.Client(base_url=fleet["base"], timeout=60) as admin:
        for _ in range(3):
            with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                backend = resp.headers["x-switchyard-backend"]
                deadline = time.monotonic() + 5
                engine_busy = False
                while seen is None and time.monotonic() < deadline:
                    fleet_now = admin.get("/admin/fleet", headers=auth).json()
                    b = next(b for b in fleet_now["backends"] if b["name"] == backend)
                    if b["engine"] and b["engine"]["metrics"]["running"] >= 1:
                        seen = b
                        break
                    engine = httpx.get(fleet["engines"][backend] + "/metrics", timeout=10).text
                    busy = metric_samples(engine, "llamacpp:requests_processing")[""] > 0
                    if engine_busy and not busy:
                        break  # the generation is over
                    engine_busy |= busy
                    time.sleep(0.05)
                events = list(sse_events(resp))
            assert events[-1] == "[DONE]"
            if seen:
                break
    assert seen, "no scrape caught llamacpp:requests_processing > 0 during a long generation"
    assert seen["engine"]["metrics"]["running"] == 1


def test_cache_affinity_with_engine_reported_cached_tokens(client, http, fleet):
    tag = uuid.uuid4().hex[:12]
    prefix = long_prompt(tag)
    first = client.completions.with_raw_response.create(model=MODEL, prompt=prefix + "one", max_tokens=2)
    backend = first.headers["x-switchyard-backend"]
    r1 = first.parse()
    assert r1.usage.prompt_tokens > 500
    # A fresh prefix: at most llama.cpp's usual few tokens in common with earlier prompts.
    assert r1.usage.prompt_tokens_details.cached_tokens < 50

    second = client.completions.with_raw_response.create(model=MODEL, prompt=prefix + "two", max_tokens=2)
    assert second.headers["x-switchyard-backend"] == backend, second.headers.get("x-switchyard-decision")
    r2 = second.parse()
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # This llama.cpp build reports both `usage.prompt_tokens_details.cached_tokens` and its
    # own `timings.cache_n`, with the same value: the shared prefix minus what differs.
    timings = r2.model_extra["timings"]
    assert cached == timings["cache_n"]
    assert cached > 500, r2.usage
    assert cached < r2.usage.prompt_tokens
    assert timings["prompt_n"] == r2.usage.prompt_tokens - cached

    # A chat conversation that grows keeps going to the same engine too.
    messages = [{"role": "system", "content": long_prompt("chat-" + tag)},
                {"role": "user", "content": "first question"}]
    c1 = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=3)
    chat_backend = c1.headers["x-switchyard-backend"]
    reply = c1.parse().choices[0].message.content
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "second"}]
    c2 = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=3)
    assert c2.headers["x-switchyard-backend"] == chat_backend
    assert c2.parse().usage.prompt_tokens_details.cached_tokens > 500

    # The gateway reads the engine-reported cached tokens, also at the end of a stream: a
    # third, streamed request.
    def reported_now():
        s = metric_samples(http.get("/metrics").text, "switchyard_reported_cached_tokens_total")
        return backend_value(s, backend)

    before = poll(lambda: (v := reported_now()) >= cached and v,
                  "switchyard_reported_cached_tokens_total to count the engine's cached tokens")
    body = {"model": MODEL, "prompt": prefix + "three", "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.headers["x-switchyard-backend"] == backend
        events = list(sse_events(resp))
    assert events[-1] == "[DONE]"
    # llama.cpp's streamed /v1/completions always ends with a chunk that has both the
    # finish_reason and `usage` (+ `timings`), asked for or not, and no usage-only chunk:
    # the gateway passes that through untouched.
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 500
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == last["timings"]["cache_n"]
    poll(lambda: reported_now() >= before + 500,
         "the streamed request's cached tokens in switchyard_reported_cached_tokens_total")

    # And the engine's own counter agrees that it reused its cache.
    engine_metrics = httpx.get(fleet["engines"][backend] + "/metrics", timeout=10).text
    assert metric_samples(engine_metrics, "llamacpp:prompt_tokens_cached_total")[""] >= cached
