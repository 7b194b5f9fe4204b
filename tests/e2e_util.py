"""Helpers shared by the end-to-end tests, the chaos run and the scripts of bench/.

Requests, checks of the plugin's problem+json answers, replays, and the retry loops that
model a client which waits for its answer (docs/behaviour.md §3).
"""

import json
import time
import uuid

from harness import CALLER, request

PROBLEM_PREFIX = "urn:idempotency-filter:problem:"
IN_PROGRESS_TITLE = "A request is outstanding for this Idempotency-Key"
NOT_STORED_TITLE = ("The request for this Idempotency-Key was completed; "
                    "its response is not stored")
PROBLEM_FIELDS_RETRYABLE = {"type", "title", "status", "detail", "retryable", "retry_after"}
PROBLEM_FIELDS_FINAL = {"type", "title", "status", "detail", "retryable"}

# Headers whose value Envoy sets per response: never compared between first answer and replay.
VOLATILE_HEADERS = {"date", "server", "content-length", "x-envoy-upstream-service-time",
                    "idempotent-replayed", "connection", "transfer-encoding"}


def new_key(tag="k"):
    return f"{tag}-{uuid.uuid4()}"


# The store key includes the host (docs/behaviour.md §3.1): every request of these tests names the same
# one, whether sent by http.client (which would say 127.0.0.1:<port>) or as raw bytes.
HOST = "localhost"


def key_headers(key, extra=None, content_type="application/json", host=HOST):
    """Host, the caller (unless `extra` names one), content-type, the key header (none if key
    is None), then `extra` (a dict or a list of pairs; a None value sends no such header)."""
    extra = list(extra.items()) if isinstance(extra, dict) else list(extra or [])
    headers = [("Host", host)]
    if not any(name.lower() == "authorization" for name, _ in extra):
        headers.append(CALLER)
    if content_type is not None:
        headers.append(("content-type", content_type))
    if key is not None:
        headers.append(("Idempotency-Key", key))
    headers.extend((n, v) for n, v in extra if v is not None)
    return headers


def post(target, key=None, body=b'{"amount":1}', path="/payments", extra=None, timeout=15,
         method="POST", content_type="application/json", host=HOST, **more):
    """The tests' one client: a POST (or `method`) to `target` (a port, or an Envoy) with the
    key header (none if key is None), `extra` headers, and more as keywords (`x_delay_ms=1500`
    sends `x-delay-ms: 1500`)."""
    port = getattr(target, "port", target)
    extra = list(extra.items()) if isinstance(extra, dict) else list(extra or [])
    extra += [(name.replace("_", "-"), str(value)) for name, value in more.items()]
    return request(port, method, path, key_headers(key, extra, content_type, host), body,
                   timeout=timeout)


def is_replay(resp):
    return resp.header_all("idempotent-replayed") == ["true"]


def describe(resp):
    """A short text of a response for assertion messages."""
    if isinstance(resp, BaseException):
        return f"<exception {resp!r}>"
    return f"{resp.status} {resp.headers} {resp.body[:400]!r}"


def problem(resp, status, slug, retryable, title=None, retry_after=1):
    """Asserts resp is the plugin's problem+json with these fields; returns the parsed body.
    `retry_after` None: any positive number of seconds, the same in the header."""
    assert resp.status == status, describe(resp)
    assert resp.header_all("content-type") == ["application/problem+json"], describe(resp)
    assert resp.header("idempotent-replayed") is None, describe(resp)
    assert resp.header_all("content-length") == [str(len(resp.body))], describe(resp)
    body = json.loads(resp.body)
    assert set(body) == (PROBLEM_FIELDS_RETRYABLE if retryable else PROBLEM_FIELDS_FINAL), body
    assert body["type"] == PROBLEM_PREFIX + slug, body
    assert body["status"] == status, body
    assert body["retryable"] is retryable, body
    assert isinstance(body["title"], str) and body["title"], body
    if title is not None:
        assert body["title"] == title, body
    assert isinstance(body["detail"], str) and body["detail"], body
    if retryable:
        if retry_after is None:
            assert isinstance(body["retry_after"], int) and body["retry_after"] > 0, body
        else:
            assert body["retry_after"] == retry_after, body
        assert resp.header_all("retry-after") == [str(body["retry_after"])], describe(resp)
    else:
        assert resp.header("retry-after") is None, describe(resp)
    return body


def assert_in_progress(resp):
    """The 409 of docs/behaviour.md §3.3, every field checked."""
    return problem(resp, 409, "in-progress", True, IN_PROGRESS_TITLE)


def assert_not_stored(resp):
    """The 409 of docs/behaviour.md §3.4 for a completed key whose response was too large to keep."""
    return problem(resp, 409, "response-not-stored", False, NOT_STORED_TITLE)


def is_in_progress(resp):
    return (not isinstance(resp, BaseException) and resp.status == 409
            and b"problem:in-progress" in resp.body)


def stable_headers(resp):
    """The headers a replay must repeat: all but the volatile ones, in order, repeats kept."""
    return [(n.lower(), v) for n, v in resp.headers if n.lower() not in VOLATILE_HEADERS]


def assert_replay_of(replay, first):
    """replay is `first` replayed: same status, non-volatile headers and body, plus the mark."""
    assert is_replay(replay), describe(replay)
    assert not is_replay(first), describe(first)
    assert replay.status == first.status, (describe(first), describe(replay))
    assert stable_headers(replay) == stable_headers(first), (first.headers, replay.headers)
    assert replay.body == first.body, (describe(first), describe(replay))
    assert replay.header_all("content-length") == [str(len(replay.body))], describe(replay)


def retry_until_answer(send, interval=0.25, timeout=15.0, tolerate=(OSError,)):
    """Calls send() every `interval` s until it answers something other than the in-progress
    409. Returns (in_progress_responses, final_response, seconds_waited). Client errors in
    `tolerate` (a retry that itself timed out) are kept in the 409 list as exceptions."""
    started = time.monotonic()
    seen = []
    while True:
        try:
            resp = send()
        except tolerate as exc:  # noqa: PERF203 - a client timeout is a retry too
            resp = exc
        if not isinstance(resp, BaseException) and not is_in_progress(resp):
            return seen, resp, time.monotonic() - started
        seen.append(resp)
        if time.monotonic() - started > timeout:
            raise AssertionError(f"still in progress after {timeout}s: {describe(seen[-1])}")
        time.sleep(interval)


def plugin_counters(envoy):
    """The plugin's stats without the `wasmcustom.idempotency.` prefix."""
    prefix = "wasmcustom.idempotency."
    return {name[len(prefix):]: value for name, value in envoy.stats_matching(prefix).items()
            if name.startswith(prefix)}


def parse_raw_response(data):
    """One HTTP/1.1 response from raw bytes (as send_raw returns them) -> harness.Response."""
    from harness import Response
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or not lines[0].startswith("HTTP/1."):
        raise AssertionError(f"not an HTTP response: {data[:200]!r}")
    status = int(lines[0].split()[1])
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    lengths = [v for n, v in headers if n.lower() == "content-length"]
    if lengths:
        body = body[:int(lengths[0])]
    return Response(status, headers, body)


def raw_exchange(port, data, timeout=10):
    """Send raw request bytes; read one response (framed by Content-Length) -> Response."""
    return parse_raw_response(raw_exchange_bytes(port, data, timeout))


def raw_exchange_bytes(port, data, timeout=10):
    """Send raw request bytes; read one response, framed by its Content-Length, or until the
    peer closes or `timeout` passes -> the bytes read.

    Unlike harness.send_raw this does not wait for the peer to close (Envoy delays the close
    of a connection it answered early by up to 1 s)."""
    import socket
    buf = b""
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        while time.monotonic() < deadline:
            head, sep, body = buf.partition(b"\r\n\r\n")
            if sep:
                lengths = [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")[1:]
                           if line.lower().startswith(b"content-length:")]
                if lengths and len(body) >= int(lengths[0]):
                    break
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            buf += chunk
    return buf
