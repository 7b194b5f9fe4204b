"""Hostile requests end to end on real Envoy (issue "Reliability: retry storms, crashes and
hostile input"; docs/behaviour.md §3.1, §3.6: no input can make the plugin panic).

Huge keys, non-ASCII and control bytes in keys, 100 headers, repeated key headers, bodies at
and one byte over `max_request_body_bytes`, and foreign values planted in the store. After
each case Envoy keeps serving (a normal request is claimed, then replayed) and no Wasm VM
failed: no `wasm.*` stat with fail/crash/error in its name moves, the count of active VMs
stays, and Envoy's log has no panic, `Function: proxy_on_… failed`, trap or fail-closed line.

Planting a foreign value is tested on etcd only: shared data can only be written from inside
the Envoy process, by a Wasm module loaded with the same `vm_id`; the plugin itself writes
only values it encoded, and loading a second, purpose-built module is out of scope here. The
shared-data decoders are covered by the `entry` fuzz target and its corpus (`make unit`).
"""

import base64
import functools
import json
import re
import socket
import struct
import time
import uuid

import pytest

from chaos import (ChaosUpstream, active_vms, etcd_key, log_tags, plugin_counters,
                   vm_failure_lines, vm_failure_stats)
import e2e_util
from e2e_util import key_headers, raw_exchange_bytes
from etcd_util import cluster as etcd_cluster
from harness import CALLER, raw_request_bytes, request

HOST = "hostile.example"
BODY = b'{"amount":1}'
PROBLEM = "urn:idempotency-filter:problem:"


# --- helpers ---------------------------------------------------------------------------------


def new_key(tag):
    return f"{tag}-{uuid.uuid4().hex}"


def headers_for(key, extra=()):
    return key_headers(key, extra, host=HOST)


# The tests' client, with this file's host and body.
post = functools.partial(e2e_util.post, body=BODY, host=HOST, timeout=10)


def raw_post(envoy, header_lines, body=BODY):
    """Sends a POST whose header block is given as raw bytes (anything http.client refuses)
    and returns (status or None, headers {lower name: value}, body). None: Envoy closed the
    connection without an answer. Connection: close, so the read ends with the answer."""
    head = [b"POST /payments HTTP/1.1", b"Host: " + HOST.encode(),
            f"{CALLER[0]}: {CALLER[1]}".encode(), b"content-type: application/json",
            b"Connection: close"]
    head += header_lines
    head.append(b"Content-Length: %d" % len(body))
    data = b"\r\n".join(head) + b"\r\n\r\n" + body
    return parse_response(raw_exchange_bytes(envoy.port, data, timeout=5.0))


def parse_response(data):
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep or not head.startswith(b"HTTP/1."):
        return None, {}, data
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.setdefault(name.strip().lower(), value.strip())
    if "content-length" in headers:
        body = body[:int(headers["content-length"])]
    return int(lines[0].split()[1]), headers, body


def slug(status_headers_body):
    _, headers, body = status_headers_body
    if headers.get("content-type") != "application/problem+json":
        return None
    kind = json.loads(body)["type"]
    assert kind.startswith(PROBLEM), kind
    return kind[len(PROBLEM):]


def as_triple(resp):
    return resp.status, {n.lower(): v for n, v in reversed(resp.headers)}, resp.body


def assert_problem(resp, status, kind, retryable):
    triple = as_triple(resp) if not isinstance(resp, tuple) else resp
    got_status, headers, body = triple
    assert got_status == status, triple
    assert headers.get("content-type") == "application/problem+json", triple
    doc = json.loads(body)
    assert doc["type"] == PROBLEM + kind and doc["status"] == status, doc
    assert doc["retryable"] is retryable, doc
    if retryable:
        assert headers.get("retry-after") == "1" and doc["retry_after"] == 1, triple


def post_until_final(envoy, key, attempts=20, **kwargs):
    """Retries a retryable in-progress 409 (with etcd the completion is written just after the
    answer: docs/limits.md) a bounded number of times, 50 ms apart."""
    for _ in range(attempts):
        resp = post(envoy, key, **kwargs)
        if not (resp.status == 409 and b"problem:in-progress" in resp.body):
            return resp
        time.sleep(0.05)
    return resp


class Health:
    """What must hold after every hostile case: Envoy serves, no VM failed."""

    def __init__(self, envoy, upstream):
        self.envoy, self.upstream = envoy, upstream
        self.vms = active_vms(envoy)
        assert self.vms, "no wasm.envoy.wasm.runtime.v8.active stat"
        self.check("start")

    def check(self, case):
        envoy = self.envoy
        assert envoy.alive(), f"Envoy died after {case}"
        key = new_key("probe")
        first = post(envoy, key)
        assert first.status == 201 and first.header("idempotent-replayed") is None, \
            (case, first.status, first.body[:300])
        again = post_until_final(envoy, key)
        assert again.status == 201 and again.header("idempotent-replayed") == "true", \
            (case, again.status, again.body[:300])
        assert again.body == first.body, case
        assert self.upstream.effects(key) == 1, case
        assert vm_failure_stats(envoy) == {}, (case, vm_failure_stats(envoy))
        assert active_vms(envoy) == self.vms, (case, self.vms, active_vms(envoy))
        bad = vm_failure_lines(envoy.log_text())
        assert not bad, (case, bad[:5])


@pytest.fixture
def upstream():
    """tests/upstream.py as chaos.py runs it: it also takes requests with over 100 headers."""
    with ChaosUpstream() as up:
        yield up


@pytest.fixture
def start(make_envoy, upstream, wasm):
    """start(config) -> (envoy, health); detached, 2 workers, a 4 KiB listener buffer."""

    def start_envoy(config=None, **kwargs):
        kwargs.setdefault("buffer_limit_bytes", 4096)
        envoy = make_envoy({"forward": "detached", "max_request_body_bytes": 1000,
                            **(config or {})}, upstream.port, **kwargs)
        return envoy, Health(envoy, upstream)

    return start_envoy


# --- 1. huge keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("forward", ["detached", "router"])
def test_huge_keys(upstream, start, forward):
    envoy, health = start({"forward": forward})
    answers = {}
    for name, size in [("256", 256), ("10KiB", 10 * 1024), ("50KiB", 50 * 1024),
                       ("100KiB", 100 * 1024), ("1MiB", 1024 * 1024)]:
        key = ("k" * size)
        try:
            resp = post(envoy, key, timeout=10)
            answers[name] = (resp.status, resp.header("content-type"), resp.body[:200])
        except OSError as exc:  # Envoy may close the connection on a huge header block
            answers[name] = (None, type(exc).__name__, b"")
        quoted = '"' + "q" * size + '"'
        try:
            resp = post(envoy, quoted, timeout=10)
            answers[name + " quoted"] = (resp.status, resp.header("content-type"))
        except OSError as exc:
            answers[name + " quoted"] = (None, type(exc).__name__)
        health.check(f"key of {name}")
    print(f"[{forward}] huge keys: {answers}")
    for name, answer in answers.items():
        status, ctype = answer[0], answer[1]
        if status == 400:  # the plugin read the header: too long
            assert ctype == "application/problem+json", (name, answer)
        else:  # Envoy refused the header block itself: 431, or the connection closed
            assert status in (431, None), (name, answer)
    # Within Envoy's 60 KiB header limit the plugin itself refuses the key.
    assert answers["256"][0] == answers["10KiB"][0] == answers["50KiB"][0] == 400
    assert upstream.effects() == {k: 1 for k in upstream.effects() if k.startswith("probe-")}
    assert plugin_counters(envoy)["invalid_key"] >= 6


def test_long_keys_up_to_max_key_length(upstream, start):
    """With max_key_length 8192 (its maximum), an 8 KiB key is a key like any other: claimed,
    forwarded in full, replayed; one character more is a 400."""
    envoy, health = start({"max_key_length": 8192})
    key = "L" * 8192
    first = post(envoy, key)
    replay = post(envoy, key)
    quoted = post(envoy, '"' + key + '"')
    over = post(envoy, key + "x")
    ten_k = post(envoy, "T" * 10240)
    assert first.status == 201 and first.header("idempotent-replayed") is None, first.body
    assert json.loads(first.body)["key"] == key  # the detached call sent the whole header
    assert replay.header("idempotent-replayed") == "true" and replay.body == first.body
    assert quoted.header("idempotent-replayed") == "true" and quoted.body == first.body
    assert_problem(over, 400, "invalid-key", False)
    assert_problem(ten_k, 400, "invalid-key", False)
    assert upstream.effects(key) == 1
    health.check("8 KiB keys")


# --- 2. non-ASCII and control bytes -------------------------------------------------------------


# Bytes Envoy passes on: the plugin must refuse the key (400 invalid-key, docs/behaviour.md §3.1).
BAD_KEY_BYTES = {
    "latin1": b"caf\xe9",
    "utf8": "caf\u00e9".encode(),
    "utf8_4byte": "key-\U0001f4b3".encode(),
    "invalid_utf8": b"\xff\xfe\xfd",
    "lone_continuation": b"a\x80b",
    "inner_tab": b"a\tb",
    "inner_space": b"a b",
    "obs_fold": b"a\r\n b",  # Envoy unfolds it to "a b"
    "quoted_utf8": b'"caf\xc3\xa9"',
    "quoted_unterminated": b'"abc',
    "quoted_bad_escape": b'"a\\nb"',
    "quoted_trailing": b'"abc"x',
    "lone_quote": b'"',
    "empty_quoted": b'""',
}
# Control bytes: Envoy's HTTP/1 codec refuses most of them itself (a text/plain 400, or a
# closed connection) before any filter runs; a plugin 400 would do as well.
CONTROL_KEY_BYTES = {"nul": b"a\x00b", "ctl_01": b"a\x01b", "esc": b"a\x1b[31mred",
                     "del": b"a\x7fb", "quoted_ctl": b'"a\x01b"', "bell": b"\x07"}


def test_non_ascii_and_control_bytes_in_the_key(upstream, start):
    envoy, health = start()
    seen = {}
    for name, value in {**BAD_KEY_BYTES, **CONTROL_KEY_BYTES}.items():
        answer = raw_post(envoy, [b"Idempotency-Key: " + value])
        seen[name] = (answer[0], slug(answer) if answer[0] else None)
        health.check(f"key {name}")
    print(f"answers: {seen}")
    for name in BAD_KEY_BYTES:
        assert seen[name] == (400, "invalid-key"), (name, seen[name])
    for name in CONTROL_KEY_BYTES:
        assert seen[name] in ((400, None), (None, None), (400, "invalid-key")), (name, seen[name])
    assert all(k.startswith("probe-") for k in upstream.effects()), upstream.effects()


def test_bare_cr_in_the_key_is_dropped_by_envoy(upstream, start):
    """Envoy 1.40's codec removes a bare CR from a header value ("a\\rb" reaches filters and
    the upstream as "ab"): the plugin sees a valid key, the same as "ab" itself."""
    envoy, health = start()
    key = new_key("cr")
    head, tail = key[:8], key[8:]
    first = raw_post(envoy, [b"Idempotency-Key: " + head.encode() + b"\r" + tail.encode()])
    again = post(envoy, key)
    if first[0] == 400:  # a stricter codec refuses it: fine too
        assert upstream.effects(key) == 0
    else:
        assert first[0] == 201 and json.loads(first[2])["key"] == key, first
        assert again.header("idempotent-replayed") == "true" and again.body == first[2]
        assert upstream.effects(key) == 1
    health.check("bare CR")


def test_padded_key_is_trimmed_by_envoy(upstream, start):
    """Optional whitespace around a header value is not part of it (RFC 9110 §5.5)."""
    envoy, health = start()
    key = new_key("pad")
    first = raw_post(envoy, [b"Idempotency-Key:   \t" + key.encode() + b" \t "])
    second = post(envoy, key)
    assert first[0] == 201, first
    assert second.header("idempotent-replayed") == "true" and second.body == first[2]
    assert upstream.effects(key) == 1
    health.check("padded key")


@pytest.mark.parametrize("header", [b"x-note", b"authorization", b"content-type"])
def test_non_utf8_values_in_other_headers(upstream, start, header):
    """A valid key with a non-UTF-8 value elsewhere (a plain header, the scope header, a
    fingerprint header): forwarded by the router instead of a detached call
    (docs/limits.md), claimed and replayed all the same."""
    envoy, health = start()
    key = new_key("bytes")
    lines = [b"Idempotency-Key: " + key.encode(), header + b": \xff\xfe caf\xe9 \x80"]
    first = raw_post(envoy, lines)
    again = raw_post(envoy, lines)
    assert first[0] == 201 and "idempotent-replayed" not in first[1], first
    assert again[0] == 201 and again[1].get("idempotent-replayed") == "true", again
    assert again[2] == first[2]
    assert upstream.effects(key) == 1
    health.check(f"non-UTF-8 {header!r}")


# --- 3. many headers ---------------------------------------------------------------------------


def test_100_headers(upstream, start):
    """Envoy's default max_headers_count is 100: up to it the plugin sees every header (and a
    replay ignores their order), past it Envoy refuses the request itself (431)."""
    envoy, health = start()
    key = new_key("many")
    base = 5  # Host, Authorization, content-type, Idempotency-Key, Content-Length
    extra = [(f"x-h-{i:03d}", f"value-{i}-" + "v" * 200) for i in range(100 - base)]
    first = post(envoy, key, extra=extra)
    shuffled = post(envoy, key, extra=list(reversed(extra)))
    repeated = post(envoy, new_key("same"), extra=[("x-same", str(i)) for i in range(95)])
    assert len(headers_for(key, extra)) + 1 == 100  # with Content-Length
    scopes = [("authorization", f"Bearer t{i}") for i in range(96)]
    scoped = post(envoy, new_key("scope"), extra=scopes)
    scoped_again = post(envoy, scoped_key := json.loads(scoped.body)["key"], extra=scopes)
    other_scope = post(envoy, scoped_key, extra=scopes[:-1])
    too_many = post(envoy, new_key("over"), extra=[(f"x-o-{i}", "v") for i in range(150)])
    print(f"100 headers -> {first.status}; 150 -> {too_many.status} {too_many.body[:80]!r}")
    assert first.status == 201 and first.header("idempotent-replayed") is None, first.body
    assert shuffled.header("idempotent-replayed") == "true" and shuffled.body == first.body
    assert repeated.status == 201, repeated.body
    assert scoped.status == 201 and scoped_again.header("idempotent-replayed") == "true"
    # 95 of the 96 values: another scope, so another caller's key.
    assert other_scope.status == 201 and other_scope.header("idempotent-replayed") is None
    assert too_many.status == 431, (too_many.status, too_many.body[:200])
    assert upstream.effects(key) == 1 and upstream.effects(scoped_key) == 2
    health.check("100 headers")


def test_repeated_key_headers(upstream, start):
    envoy, health = start()
    key = new_key("rep")
    cases = {
        "twice_same": [("Idempotency-Key", key)] * 2,
        "twice_other": [("Idempotency-Key", key), ("Idempotency-Key", key + "-2")],
        "case_variants": [("Idempotency-Key", key), ("IDEMPOTENCY-KEY", key),
                          ("idempotency-key", key)],
        "fifty": [("Idempotency-Key", f"{key}-{i}") for i in range(50)],
        "empty_and_valid": [("Idempotency-Key", ""), ("Idempotency-Key", key)],
    }
    for name, keys in cases.items():
        resp = request(envoy.port, "POST", "/payments",
                       [("Host", HOST), ("content-type", "application/json"), *keys], BODY)
        assert_problem(resp, 400, "invalid-key", False)
        health.check(f"repeated key header {name}")
    # A list in one header is one (odd but visible-ASCII) key, not two keys.
    listed = post(envoy, f"{key},{key}-2")
    assert listed.status == 201, listed.body
    spaced = post(envoy, f"{key}, {key}-2")
    assert_problem(spaced, 400, "invalid-key", False)
    assert upstream.effects(key) == 0 and upstream.effects(f"{key},{key}-2") == 1
    assert plugin_counters(envoy)["invalid_key"] == len(cases) + 1


# --- 4. bodies at the limit ----------------------------------------------------------------------


@pytest.mark.parametrize("forward", ["detached", "router"])
def test_bodies_at_and_over_max_request_body_bytes(upstream, start, forward):
    """max_request_body_bytes 1000, listener buffer 4096 (at least twice the limit)."""
    envoy, health = start({"forward": forward})
    at = bytes(range(256)) * 3 + b"z" * 232  # 1000 bytes, every byte value
    assert len(at) == 1000
    over = at + b"!"
    keys = {name: new_key(name) for name in
            ("at", "over", "at_chunked", "over_chunked", "empty", "huge", "then_ok")}

    r_at = post(envoy, keys["at"], body=at)
    r_at_again = post(envoy, keys["at"], body=at)
    r_over = post(envoy, keys["over"], body=over)
    r_at_chunked = post(envoy, keys["at_chunked"], body=[at[i:i + 99] for i in range(0, 1000, 99)])
    r_over_chunked = post(envoy, keys["over_chunked"], body=[over[:500], over[500:]])
    r_empty = post(envoy, keys["empty"], body=b"")
    r_huge = post(envoy, keys["huge"], body=b"h" * 100_000)
    r_over_then = post(envoy, keys["then_ok"], body=over)
    r_then_ok = post(envoy, keys["then_ok"], body=at)

    assert r_at.status == 201 and r_at.header("idempotent-replayed") is None, r_at.body
    assert r_at_again.header("idempotent-replayed") == "true" and r_at_again.body == r_at.body
    assert r_at_chunked.status == 201, r_at_chunked.body
    assert r_empty.status == 201, r_empty.body
    for resp in (r_over, r_over_chunked, r_over_then):
        assert_problem(resp, 413, "body-too-large", False)
    # 100 kB is far over the listener's buffer too: Envoy's own 413 may win (docs/limits.md).
    assert r_huge.status == 413, (r_huge.status, r_huge.body[:200])
    # A 413 takes nothing: the same key with a body within the limit is processed.
    assert r_then_ok.status == 201 and r_then_ok.header("idempotent-replayed") is None
    assert upstream.effects() == {**{k: 1 for k in upstream.effects() if k.startswith("probe-")},
                                  keys["at"]: 1, keys["at_chunked"]: 1, keys["empty"]: 1,
                                  keys["then_ok"]: 1}
    health.check("bodies at the limit")


def test_body_shorter_than_its_content_length(upstream, start):
    """The client promises 1000 bytes, sends 400 and hangs up: nothing is claimed for good,
    nothing reaches the upstream, the same key works afterwards."""
    envoy, health = start()
    key = new_key("short")
    data = raw_request_bytes("POST", "/payments", headers_for(key) + [("Content-Length", "1000")])
    with socket.create_connection(("127.0.0.1", envoy.port), timeout=5) as sock:
        sock.sendall(data + b"x" * 400)
        time.sleep(0.3)
    after = post(envoy, key, body=b"y" * 1000)
    assert after.status == 201 and after.header("idempotent-replayed") is None, after.body
    assert upstream.effects(key) == 1
    health.check("short body")


# --- 5. foreign values in the store (etcd) ----------------------------------------------------


@pytest.fixture
def etcd():
    from etcd_util import Etcd
    server = Etcd()
    yield server
    server.close()


def b64(data):
    return base64.b64encode(data).decode()


def etcd_get(etcd, name):
    out = etcd.call("/v3/kv/range", {"key": b64(name.encode())})
    kvs = out.get("kvs") or []
    return base64.b64decode(kvs[0].get("value", "")) if kvs else None


def etcd_put(etcd, name, value):
    etcd.call("/v3/kv/put", {"key": b64(name.encode()), "value": b64(value)})


WAY = 1 + 8 + 16 + 16 + 8 + 8 + 4  # src/entry.rs: state, gen, tag, fingerprint, deadline, since, bytes
RESPONSE_AT = 2 + WAY  # after the entry's magic and way
FOOTER = 2 + 2 + 4 + 4 + 8 + 16 + 2  # status, count, headers length, body length, gen, key, magic


def mutations(real, body):
    """Values the plugin cannot read, most derived from a real completed entry whose stored
    response body is `body` (src/entry.rs: the response is body, headers, then a footer)."""
    footer_at = len(real) - FOOTER
    count_at = footer_at + 2
    headers_len_at = footer_at + 4
    body_len_at = footer_at + 8
    stamp_at = footer_at + 12
    first_name_len_at = RESPONSE_AT + len(body)
    assert real[:2] == b"E\x02" and real.endswith(b"R\x02"), (real[:4], real[-2:])
    assert real[RESPONSE_AT:].startswith(body)
    assert real[body_len_at:body_len_at + 4] == struct.pack("<I", len(body))

    def patch(at, packed):
        return real[:at] + packed + real[at + len(packed):]

    return {
        "text": b"this is not an entry",
        "empty": b"",
        "json": b'{"state":"completed","status":201}',
        "magic_only": b"E\x02",
        "old_format": b"E\x01" + real[2:],
        "truncated_way": real[:RESPONSE_AT - 1],
        "truncated_by_one": real[:-1],
        "one_byte_more": real + b"\x00",
        "state_7": patch(2, b"\x07"),
        "completed_without_response": patch(2, b"\x02")[:RESPONSE_AT],
        "in_progress_with_response": patch(2, b"\x01"),
        "wrong_response_magic": patch(len(real) - 2, b"X\x02"),
        "stamp_gen_differs": patch(stamp_at, struct.pack("<Q", 0xDEADBEEF)),
        "header_count_65535": patch(count_at, struct.pack("<H", 0xFFFF)),
        "headers_length_off_by_one": patch(headers_len_at, struct.pack(
            "<I", struct.unpack("<I", real[headers_len_at:headers_len_at + 4])[0] + 1)),
        "name_len_65535": patch(first_name_len_at, struct.pack("<H", 0xFFFF)),
        "body_len_4G": patch(body_len_at, struct.pack("<I", 0xFFFFFFFF)),
        "random_64": bytes(uuid.uuid4().bytes * 4),
        "random_1MiB": (uuid.uuid4().bytes * 65536),
    }


def test_foreign_values_planted_in_etcd_get_503(upstream, make_envoy, wasm, etcd):
    """Garbage at the etcd key the plugin uses (`/<namespace>/<hex of the store key>`): the
    request gets 503 store-unavailable problem+json (docs/behaviour.md §3.6), nothing runs, Envoy lives."""
    config = {"forward": "detached", "store": {"kind": "etcd", "cluster": "etcd"}}
    envoy = make_envoy(config, upstream.port, extra_clusters=[etcd_cluster(etcd.port)])
    health = Health(envoy, upstream)

    # A real completed entry, to derive near-valid values from.
    source = new_key("source")
    source_answer = post(envoy, source)
    assert source_answer.status == 201
    real = None
    for _ in range(50):  # the completion is written just after the answer
        real = etcd_get(etcd, etcd_key(source, authority=HOST))
        if real and real[2] == 2:
            break
        time.sleep(0.05)
    assert real and real[2] == 2, \
        f"no completed entry at {etcd_key(source, authority=HOST)}: {real!r}"

    results = {}
    for name, value in mutations(real, source_answer.body).items():
        key = new_key(f"planted-{name}")
        etcd_put(etcd, etcd_key(key, authority=HOST), value)
        resp = post(envoy, key)
        results[name] = resp
        assert upstream.effects(key) == 0, (name, resp.status, resp.body[:200])
        health.check(f"planted {name}")
        assert etcd_get(etcd, etcd_key(key, authority=HOST)) == value, \
            f"{name}: the plugin overwrote a value it cannot read"
    print("planted values:", {n: (r.status, slug(as_triple(r))) for n, r in results.items()})
    for name, resp in results.items():
        assert resp.status == 503, (name, resp.status, resp.body[:300])
        assert_problem(resp, 503, "store-unavailable", True)
    assert plugin_counters(envoy)["store_error"] >= len(results)
    lines = [line for line in envoy.log_text().splitlines()
             if re.search(r"corrupt|cannot read|store", line, re.IGNORECASE)]
    print("\n".join(lines[-5:]))


def test_entry_of_another_key_planted_in_etcd(upstream, make_envoy, wasm, etcd):
    """A well-formed entry copied from key A to key B's etcd key. It carries A's key tag: the
    plugin refuses it with the 503 problem and leaves the value alone. B never gets A's
    answer (docs/behaviour.md §3.1)."""
    config = {"forward": "detached", "store": {"kind": "etcd", "cluster": "etcd"}}
    envoy = make_envoy(config, upstream.port, extra_clusters=[etcd_cluster(etcd.port)])
    health = Health(envoy, upstream)
    a, b = new_key("owner-a"), new_key("victim-b")
    first = post(envoy, a)
    assert first.status == 201
    value = None
    for _ in range(50):
        value = etcd_get(etcd, etcd_key(a, authority=HOST))
        if value and value[2] == 2:
            break
        time.sleep(0.05)
    etcd_put(etcd, etcd_key(b, authority=HOST), value)
    got = post_until_final(envoy, b)  # same path and body as A's request: the fingerprints agree
    print(f"entry of {a} planted at {b}'s etcd key -> {got.status} "
          f"replayed={got.header('idempotent-replayed')} {got.body[:160]!r} "
          f"(store key tags: a {log_tags(a, authority=HOST)[0]}, "
          f"b {log_tags(b, authority=HOST)[0]})")
    assert upstream.effects(b) == 0
    assert_problem(got, 503, "store-unavailable", True)
    assert got.body != first.body and got.header("idempotent-replayed") is None
    assert etcd_get(etcd, etcd_key(b, authority=HOST)) == value, "the plugin overwrote it"
    health.check("entry of another key")
