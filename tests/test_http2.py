"""Plain HTTP calls over HTTP/2 downstream (h2c), with a real HTTP/2 client (curl
--http2-prior-knowledge): the core scenarios behave as over HTTP/1.1 (docs/behaviour.md §3.10)."""

import json
import subprocess
import threading
import uuid

import pytest

from harness import Envoy, wait_until

HOST = "api.example"


def h2_post(envoy, key, body=b'{"amount":10}', **headers):
    """One POST over h2c; returns (status, {header: value}, body)."""
    cmd = ["curl", "-s", "-i", "--http2-prior-knowledge", "--max-time", "10", "-X", "POST",
           f"http://127.0.0.1:{envoy.port}/payments", "-H", f"Host: {HOST}",
           "-H", "Authorization: Bearer alice", "-H", "Content-Type: application/json",
           "-H", f"Idempotency-Key: {key}", "--data-binary", "@-"]
    for name, value in headers.items():
        cmd += ["-H", f"{name.replace('_', '-')}: {value}"]
    out = subprocess.run(cmd, input=body, capture_output=True, timeout=15, check=True).stdout
    head, _, payload = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith("HTTP/2 "), lines[0]
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), fields, payload


@pytest.fixture(params=["detached", "router"])
def envoy(request, wasm, upstream):
    e = Envoy({"forward": request.param}, upstream.port)
    yield e
    e.stop()


def test_first_call_then_a_byte_identical_replay(envoy, upstream):
    key = uuid.uuid4().hex
    status, headers, body = h2_post(envoy, key)
    assert status == 201 and "idempotent-replayed" not in headers
    status2, headers2, body2 = h2_post(envoy, key)
    assert (status2, body2) == (201, body) and headers2["idempotent-replayed"] == "true"
    assert headers2["content-type"] == headers["content-type"] == "application/json"
    assert upstream.effects(key) == 1


def test_a_duplicate_in_progress_gets_409_and_a_reused_key_422(envoy, upstream):
    key = uuid.uuid4().hex
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("r", h2_post(envoy, key, x_delay_ms=1500)))
    t.start()
    wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="first call upstream")
    status, headers, body = h2_post(envoy, key)
    assert status == 409 and headers["retry-after"] == "1"
    assert headers["content-type"] == "application/problem+json"
    assert json.loads(body)["type"] == "urn:idempotency-filter:problem:in-progress"
    status, _, body = h2_post(envoy, key, body=b'{"amount":99}')
    assert status == 422 and json.loads(body)["type"].endswith(":key-reused")
    t.join(10)
    assert first["r"][0] == 201
    assert upstream.effects(key) == 1
