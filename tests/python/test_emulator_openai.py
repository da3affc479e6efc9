"""The official `openai` client against a spawned `switchyard engine`.

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
MODEL = "py-test-model"


@pytest.fixture(scope="module")
def base_url():
    if not Path(BIN).exists():
        pytest.fail(f"switchyard binary not found at {BIN}; run `cargo build -p switchyard`")
    proc = subprocess.Popen(
        [BIN, "engine", "--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--speed", "100"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        url = None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("listening on "):
                url = line.split("listening on ", 1)[1].strip()
                break
        assert url, "emulator did not print its address"
        yield url + "/v1"
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture()
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


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
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_chat_streaming(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None


def test_completion_non_streaming(client):
    r = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=3)
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens == 3


def test_completion_streaming(client):
    stream = client.completions.create(
        model=MODEL,
        prompt="stream a completion",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6
    assert any(c.choices and c.choices[0].text for c in chunks)


def test_cached_tokens_on_repeated_prompt(client):
    prompt = long_prompt("cache")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens

    messages = [{"role": "user", "content": long_prompt("chat-cache")}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert "does not exist" in str(e.value)


def test_context_overflow_is_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000_000)
