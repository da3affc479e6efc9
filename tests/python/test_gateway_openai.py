"""The official `openai` client through `switchyard serve` in front of two `switchyard engine`s.

Run with `scripts/python-env.sh && .venv/bin/pytest tests/python`.
The binary comes from $SWITCHYARD_BIN (default target/debug/switchyard).
"""

import os
import subprocess
import time
from pathlib import Path

import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = os.environ.get("SWITCHYARD_BIN", str(REPO / "target" / "debug" / "switchyard"))
MODEL = "py-gw-model"
API_KEY = "py-test-key"


def spawn(args, env=None):
    """Start `switchyard ARGS` and return (process, base URL) once it prints its address."""
    proc = subprocess.Popen([BIN, *args], stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("listening on "):
            return proc, line.split("listening on ", 1)[1].strip()
    proc.kill()
    proc.wait(timeout=10)
    raise AssertionError(f"switchyard {args[0]} did not print its address")


@pytest.fixture(scope="module")
def base_url():
    if not Path(BIN).exists():
        pytest.fail(f"switchyard binary not found at {BIN}; run `cargo build -p switchyard`")
    procs = []
    engines = []
    try:
        for _ in range(2):
            proc, url = spawn(["engine", "--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--speed", "100"])
            procs.append(proc)
            engines.append(url)
        backends = []
        for url in engines:
            backends += ["--backend", f"{url},models={MODEL}"]
        env = dict(os.environ, SWITCHYARD_API_KEYS=API_KEY)
        proc, url = spawn(["serve", "--listen", "127.0.0.1:0", *backends], env=env)
        procs.append(proc)
        yield url + "/v1"
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


@pytest.fixture()
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)


def long_prompt(tag: str) -> str:
    return (f"[{tag}] " + "the quick brown fox jumps over the lazy dog " * 30)[:800]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        max_completion_tokens=5,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.completion_tokens == 5


def test_chat_streaming_without_usage(client):
    # The gateway asks the engine for usage and removes that chunk: the client sees none.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=4,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "usage please"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=3)
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == 3
    stream = client.completions.create(model=MODEL, prompt="stream a completion", max_tokens=6, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_cache_affinity_through_the_gateway(client):
    prompt = long_prompt("py-affinity")
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_models_and_errors(client, base_url):
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]
    # A single-model fleet takes any name and sends the served one to the engine (which refuses
    # others); `--strict-models` would make this a NotFoundError (crates/cli/tests/gateway_models.rs).
    anyname = client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert anyname.model == MODEL
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    bad = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
