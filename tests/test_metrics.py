"""docs/behaviour.md §3.7: after a scripted scenario, each counter in /stats equals what the wire showed.

Counters are process-wide (`wasmcustom.idempotency.<name>`), so one Envoy per test.
"""

import functools
import threading
import time
import uuid

import pytest

import e2e_util
from harness import CALLER, request, wait_until

NAMES = ["claimed", "replayed", "conflict", "waited", "released", "completed", "expired_takeover", "expired",
         "fingerprint_mismatch", "missing_key", "invalid_key", "too_large", "response_not_stored",
         "store_error", "store_full", "owner_lost", "upstream_failed"]


def counters(envoy):
    return {n: envoy.stat(f"wasmcustom.idempotency.{n}") for n in NAMES}


def gauges(envoy):
    return {n: envoy.stat(f"wasmcustom.idempotency.entries_{n}") for n in ("in_progress", "completed")}


# The tests' client, with this file's path and body.
post = functools.partial(e2e_util.post, path="/pay", body=b'{"a":1}')


@pytest.mark.parametrize("forward", ["detached", "router"])
def test_counters_match_the_wire(wasm, upstream, make_envoy, forward):
    envoy = make_envoy({"forward": forward, "max_request_body_bytes": 1000,
                        "max_response_bytes": 2000, "lease_ms": 1000,
                        "routes": [{"match": {"prefix": "/strict"}, "require_key": True}]},
                       upstream.port, buffer_limit_bytes=1 << 20)
    seen = {n: 0 for n in NAMES}
    k = lambda: uuid.uuid4().hex  # noqa: E731

    # 3 first calls completed, each replayed twice.
    for _ in range(3):
        key = k()
        assert post(envoy.port, key).status == 201
        seen["claimed"] += 1
        seen["completed"] += 1
        for _ in range(2):
            r = post(envoy.port, key)
            assert r.header("idempotent-replayed") == "true"
            seen["replayed"] += 1
        # Same key, other body: 422.
        assert post(envoy.port, key, body=b'{"a":2}').status == 422
        seen["fingerprint_mismatch"] += 1

    # 2 upstream failures released, then retried.
    for _ in range(2):
        key = k()
        assert post(envoy.port, key, x_status=500).status == 500
        seen["claimed"] += 1
        seen["released"] += 1
        assert post(envoy.port, key).status == 201
        seen["claimed"] += 1
        seen["completed"] += 1

    # 4 duplicates while one call is in progress: 409.
    key = k()
    slow = threading.Thread(target=lambda: post(envoy.port, key, x_delay_ms=1500))
    slow.start()
    wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="slow call upstream")
    for _ in range(4):
        assert post(envoy.port, key).status == 409
        seen["conflict"] += 1
    slow.join()
    seen["claimed"] += 1
    seen["completed"] += 1

    # A response too large to store: completed without it; the retry gets 409 (not retryable).
    key = k()
    assert post(envoy.port, key, x_body_bytes=5000).status == 201
    seen["claimed"] += 1
    seen["completed"] += 1
    seen["response_not_stored"] += 1
    r = post(envoy.port, key)
    assert r.status == 409 and r.json()["retryable"] is False
    seen["conflict"] += 1

    # Bad keys, a missing required key, a body over the limit.
    assert post(envoy.port, "bad key").status == 400
    assert request(envoy.port, "POST", "/pay", [("Idempotency-Key", "a"), ("Idempotency-Key", "b")], b"{}").status == 400
    seen["invalid_key"] += 2
    assert request(envoy.port, "POST", "/strict", {}, b"{}").status == 400
    seen["missing_key"] += 1
    assert post(envoy.port, k(), body=b"x" * 1001).status == 413
    seen["too_large"] += 1

    # Key-less requests and GETs are not counted.
    assert post(envoy.port).status == 201
    assert request(envoy.port, "GET", "/pay").status == 200

    wait_until(lambda: counters(envoy) == seen, timeout=5, message="counters to settle")
    assert counters(envoy) == seen
    # Gauges: every completed entry is still held; nothing is in progress.
    assert gauges(envoy) == {"in_progress": 0, "completed": seen["completed"]}


def test_expiry_and_upstream_failure_are_counted(wasm, upstream, make_envoy):
    """Router mode. A client that leaves lets its mark expire; in a one-bucket table the timer
    sweeps that bucket every tick, so the sweep frees the mark before the retry: `expired`,
    not `expired_takeover`. An upstream that cannot be reached releases the key: each attempt
    is `upstream_failed` and `released`."""
    from harness import abandon, free_port, static_cluster
    dead = {"match": {"prefix": "/dead"}, "route": {"cluster": "dead", "timeout": "5s"}}
    envoy = make_envoy({"forward": "router", "lease_ms": 1000, "capacity": 64}, upstream.port,
                       extra_routes=[dead], extra_clusters=[static_cluster("dead", free_port())])
    key = uuid.uuid4().hex
    # The same Host on both requests: the store key includes it.
    abandon(envoy.port, "POST", "/pay", {"Host": "api", "Idempotency-Key": key, "x-delay-ms": "3000",
                                         "content-type": "application/json", CALLER[0]: CALLER[1]},
            b"{}", after_s=0.2)
    time.sleep(1.6)
    assert post(envoy.port, key, body=b"{}", host="api").status == 201
    stat = lambda name: envoy.stat(f"wasmcustom.idempotency.{name}")  # noqa: E731
    assert (stat("expired"), stat("expired_takeover"), stat("claimed")) == (1, 0, 2)

    gone = uuid.uuid4().hex
    answers = [request(envoy.port, "POST", "/dead", {"Idempotency-Key": gone, CALLER[0]: CALLER[1]},
                       b"{}") for _ in range(2)]
    assert [a.status for a in answers] == [503, 503], answers
    assert (stat("upstream_failed"), stat("released"), stat("claimed")) == (2, 2, 4)
    assert stat("completed") == 1 and stat("entries_in_progress") == 0
