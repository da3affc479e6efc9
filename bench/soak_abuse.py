"""Bad requests for bench/soak.sh: a dozen kinds of malformed or abusive HTTP, at a steady rate,
against a gateway on loopback. Records what each kind got back (status code, or how the
connection ended) and fails if any answer is a 5xx other than 503, or if the gateway stops
answering."""
import argparse
import collections
import concurrent.futures
import json
import random
import socket
import threading
import time
import urllib.parse


def raw(host, port, data, read=True, timeout=10.0):
    """Sends raw bytes; returns the status code, or a word for how the connection ended."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(data)
            if not read:
                return "left"
            head = s.recv(65536)
            if not head:
                return "closed"
            parts = head.split(b" ", 2)
            return parts[1].decode() if len(parts) > 1 and parts[0].startswith(b"HTTP/") else "garbled"
    except socket.timeout:
        return "timeout"
    except ConnectionError:
        return "reset"


def post(path, body, extra=b""):
    return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + extra + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def kinds(rng):
    chat = b'{"model":"soak-model","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
    return {
        "broken_json": lambda: post(b"/v1/chat/completions", b'{"model": "soak-model", "messages": [}'),
        "missing_model": lambda: post(b"/v1/chat/completions", b'{"messages":[]}'),
        "not_an_object": lambda: post(b"/v1/completions", b"[1,2,3]"),
        "unknown_model": lambda: post(b"/v1/completions", b'{"model":"x' + str(rng.random()).encode() + b'","prompt":"a"}'),
        "invalid_utf8": lambda: post(b"/v1/completions", b'{"model":"soak-model","prompt":"\xff\xfe"}'),
        "huge_header": lambda: post(b"/v1/chat/completions", chat, b"X-Big: " + b"a" * 200_000 + b"\r\n"),
        "many_headers": lambda: post(b"/v1/chat/completions", chat, b"".join(b"X-%d: y\r\n" % i for i in range(300))),
        "bad_request_line": lambda: b"GARBAGE / HTTP/9.9\r\n\r\n",
        "unknown_path": lambda: b"GET /v1/nothing-here HTTP/1.1\r\nHost: x\r\n\r\n",
        "bad_admin_path": lambda: b"GET /admin/../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n",
        "body_cut_short": lambda: (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + chat),
        "headers_cut_short": lambda: b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
        "leave_mid_request": lambda: post(b"/v1/chat/completions", chat.replace(b"}", b',"stream":true}', 1)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    u = urllib.parse.urlparse(a.url)
    rng = random.Random(1)
    table = kinds(rng)
    names = sorted(table)
    answers = collections.defaultdict(collections.Counter)
    bad = []
    lock = threading.Lock()

    def send(kind, data):
        # Cut-short requests wait for the gateway's read timeouts (they must not hang forever);
        # they run beside the others, so the rate holds.
        got = raw(u.hostname, u.port, data, read=kind != "leave_mid_request", timeout=120.0)
        with lock:
            answers[kind][got] += 1
            if (got.startswith("5") and got != "503") or got in ("timeout", "garbled"):
                bad.append((kind, got))

    start = time.monotonic()
    n = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=256) as pool:
        while time.monotonic() - start < a.duration:
            kind = names[n % len(names)]
            n += 1
            pool.submit(send, kind, table[kind]())
            next_at = start + n / a.rate
            time.sleep(max(0.0, next_at - time.monotonic()))
    json.dump({"sent": n, "answers": {k: dict(v) for k, v in answers.items()}, "bad": bad},
              open(a.out, "w"), indent=1)
    if bad:
        raise SystemExit(f"unexpected answers: {bad[:10]}")


if __name__ == "__main__":
    main()
