"""Writes the hand-made seed inputs of the fuzz corpus (fuzz/corpus/TARGET/seed-*); the rest of
the corpus is what libFuzzer kept from runs seeded with them (FUZZ_GROW_CORPUS=1)."""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    os.makedirs(os.path.join(HERE, "corpus", target), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(HERE, "corpus", target, "seed-" + name), "wb") as f:
        f.write(data)


requests = {
    "chat": {"model": "m", "messages": [{"role": "system", "content": "You are helpful."},
                                         {"role": "user", "content": "Hi"}], "max_tokens": 16},
    "chat_stream": {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                    "stream": True, "stream_options": {"include_usage": True}},
    "chat_parts": {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
    "completion": {"model": "m", "prompt": "Once upon a time", "max_completion_tokens": 8,
                   "user": "u1", "cache_salt": "s"},
    "completion_list": {"model": "m", "prompt": ["a", "b"], "max_tokens": None},
    "tokens": {"model": "m", "prompt": [1, 2, 3, 4]},
    "embeddings": {"model": "e", "input": "text to embed"},
    "odd_messages": {"model": "m", "messages": [1, 2]},
    "escapes": {"model": "m\u00e9", "prompt": "line\nbreak \"quoted\" \\ back \U0001F600"},
}
for name, body in requests.items():
    put("request_parser", name, json.dumps(body))
put("request_parser", "dup_keys", '{"model":"a","model":"b","prompt":"x"}')
put("request_parser", "whitespace", '  \n{ "model" : "m" , "stream" : false }  ')
put("request_parser", "big_number", '{"model":"m","max_tokens":99999999999,"prompt":"x"}')
put("request_parser", "negative", '{"model":"m","max_tokens":-1,"prompt":"x"}')
put("request_parser", "float", '{"model":"m","max_tokens":1.5,"prompt":"x"}')
put("request_parser", "unicode_escape", '{"model":"\\u006d","prompt":"\\ud83d\\ude00"}')

# The SSE target reads an `arbitrary` struct: the stream's bytes come first (length-prefixed at
# the end of the input by arbitrary's rules), so plain streams are reasonable seeds.
put("sse_scanner", "vllm",
    'data: {"id":"1","choices":[{"delta":{"content":"Hi"}}]}\n\n'
    'data: {"id":"1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
    '"prompt_tokens_details":{"cached_tokens":3}}}\n\n'
    "data: [DONE]\n\n\x05\x03\x07\x01")
put("sse_scanner", "llamacpp",
    'data: {"choices":[{"delta":{"content":"x"}}],"timings":{"prompt_n":4,"cache_n":2,'
    '"predicted_n":1}}\r\n\r\ndata: [DONE]\r\n\r\n\x02\x09\x01')
put("sse_scanner", "comments", ": keep-alive\n\nevent: x\ndata: a\ndata: b\n\n\x01")

put("prometheus_text", "vllm",
    "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="m",engine="0"} 2.0\n'
    'vllm:num_requests_waiting{model_name="m",engine="0"} 3.0\n'
    'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.25\n'
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9\n'
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",model_name="m"} 1.0\n')
put("prometheus_text", "llamacpp",
    "llamacpp:requests_processing 1\nllamacpp:requests_deferred 2\nllamacpp:prompt_tokens_total 10\n")
put("prometheus_text", "sglang",
    'sglang:num_running_reqs{model_name="m"} 3\nsglang:num_queue_reqs{model_name="m"} 1\n'
    'sglang:token_usage{model_name="m"} 0.5\nsglang:cache_hit_rate{model_name="m"} NaN\n')
put("prometheus_text", "trtllm", 'trtllm_request_count{status="running"} 2\ntrtllm_kv_cache_utilization +Inf\n')
put("prometheus_text", "escapes", 'm{a="x\\"y\\\\z\\n",b="",} 1e-3 1700000000000\n')

# fleet_file: the first byte picks the format (0 YAML, 1 TOML, 2 JSON); the rest is the text
# (also tried as a --backend flag).
put("fleet_file", "yaml", b"\x00" + (
    "backends:\n  - address: http://127.0.0.1:8000\n    name: a\n    kind: vllm\n"
    "    role: prefill\n    weight: 2\n  - address: http://127.0.0.1:8001\n    models: [m]\n"
    "    adapters: [x]\nmodel_aliases:\n  gpt-4: m\n").encode())
put("fleet_file", "toml", b"\x01" + (
    '[[backends]]\naddress = "http://127.0.0.1:8000"\nname = "a"\nkind = "llamacpp"\n\n'
    '[model_aliases]\nx = "m"\n').encode())
put("fleet_file", "json", b"\x02" + json.dumps(
    {"backends": [{"address": "http://[::1]:8000", "role": "decode"}]}).encode())
put("fleet_file", "empty_list", b"\x00backends: []\n")
put("fleet_file", "flag", b"\x00http://127.0.0.1:8000,kind=vllm,role=decode,models=a;b,weight=0.5,name=x")


def msgpack(v):
    """A minimal msgpack encoder for the KV-event seeds (nil, bool, int, float, str, array, map)."""
    import struct
    if v is None:
        return b"\xc0"
    if v is True:
        return b"\xc3"
    if v is False:
        return b"\xc2"
    if isinstance(v, int):
        if 0 <= v < 128:
            return bytes([v])
        if v < 0 and v >= -32:
            return struct.pack("b", v)
        return b"\xcf" + struct.pack(">Q", v) if v >= 0 else b"\xd3" + struct.pack(">q", v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        b = v.encode()
        return (bytes([0xA0 | len(b)]) if len(b) < 32 else b"\xd9" + bytes([len(b)])) + b
    if isinstance(v, list):
        head = bytes([0x90 | len(v)]) if len(v) < 16 else b"\xdc" + struct.pack(">H", len(v))
        return head + b"".join(msgpack(x) for x in v)
    if isinstance(v, dict):
        head = bytes([0x80 | len(v)])
        return head + b"".join(msgpack(k) + msgpack(x) for k, x in v.items())
    raise TypeError(v)


stored = ["BlockStored", [11, 12], None, list(range(32)), 16, None]
removed = ["BlockRemoved", [11]]
cleared = ["AllBlocksCleared"]
put("kv_events", "positional", msgpack([1700000000.5, [stored, removed, cleared], 0]))
put("kv_events", "tagged", msgpack([1700000000.5, [
    {"type": "BlockStored", "block_hashes": [21], "parent_block_hash": 11,
     "token_ids": list(range(16)), "block_size": 16, "lora_id": None},
    {"type": "BlockRemoved", "block_hashes": [21]}, {"type": "AllBlocksCleared"}]]))
put("kv_events", "multipart", b"k" + (7).to_bytes(8, "big") + msgpack([0.0, [cleared], None]))
# A replay reply's end marker: sequence -1 (all ones) and an empty payload.
put("kv_events", "replay-end", b"k" + b"\xff" * 8)
