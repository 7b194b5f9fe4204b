"""Detached forwarding (docs/behaviour.md §3.2, §3.5, §4): the plugin's own upstream call outlives the
client, so a client that gives up and retries gets the one stored answer, and one effect.

Each test runs against a fresh Envoy and a fresh effect-counting upstream.
"""

import hashlib
import random
import re
import time

import pytest

from e2e_util import (assert_in_progress, assert_not_stored, assert_replay_of, describe,
                      is_replay, key_headers, new_key, plugin_counters, post,
                      retry_until_answer)
from harness import abandon, request, run_concurrently, wait_until
from upstream import pattern_body

BODY = b'{"amount":1}'


@pytest.fixture
def start(make_envoy, upstream, wasm):
    """start(config=None, forward="detached", **envoy_kwargs) -> a fresh Envoy."""

    def start_envoy(config=None, forward="detached", **kwargs):
        return make_envoy({"forward": forward, **(config or {})}, upstream.port, **kwargs)

    return start_envoy


def upstream_json(key, effect, body=BODY):
    return {"key": key, "effect": effect, "method": "POST", "path": "/payments",
            "body_sha256": hashlib.sha256(body).hexdigest()}


def all_answered(upstream, keys):
    """Every effect of these keys has finished at the upstream (no handler still sleeping)."""
    wanted = set(keys)
    return all(e["outcome"] != "pending" for e in upstream.log() if e["key"] in wanted)


def assert_stored_first_answer(resp, key):
    """The replay of the first call's 201 (effect 1)."""
    assert resp.status == 201 and is_replay(resp), describe(resp)
    assert resp.header_all("x-effect") == ["1"], describe(resp)
    assert resp.header_all("content-type") == ["application/json"], describe(resp)
    assert resp.json() == upstream_json(key, 1), describe(resp)


# --- 1. the phone's timeout -------------------------------------------------------------


@pytest.mark.every_envoy
def test_client_timeout_then_retries_get_the_stored_answer(upstream, start):
    envoy = start()
    key = new_key("phone")
    extra = {"x-delay-ms": "2000"}

    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        post(envoy.port, key, extra=extra, timeout=0.3)  # the client gives up at 300 ms
    seen, final, _ = retry_until_answer(lambda: post(envoy.port, key, extra=extra, timeout=5),
                                        interval=0.5, timeout=15, tolerate=())
    done_at = time.monotonic() - t0

    for resp in seen:
        assert_in_progress(resp)
    assert len(seen) >= 2, f"only {len(seen)} retries met the call in progress"
    assert done_at >= 1.9, f"answered at {done_at:.2f}s, before the upstream could"
    assert_stored_first_answer(final, key)
    assert upstream.effects() == {key: 1}
    wait_until(lambda: all_answered(upstream, [key]), timeout=5, message="the upstream's write")
    assert upstream.resets(key) == 0
    assert [e["outcome"] for e in upstream.log()] == ["answered"]
    counters = plugin_counters(envoy)
    assert (counters["claimed"], counters["completed"], counters["replayed"]) == (1, 1, 1)
    assert counters["conflict"] == len(seen)


# --- 2. many phones at once --------------------------------------------------------------


def test_50_clients_give_up_early_and_all_get_their_answer(upstream, start):
    envoy = start()
    keys = [new_key(f"early{i}") for i in range(50)]
    extra = {"x-delay-ms": "1000"}

    def client(i):
        key = keys[i]
        abandon(envoy.port, "POST", "/payments", key_headers(key, extra), BODY, after_s=0.2)
        return retry_until_answer(lambda: post(envoy.port, key, extra=extra, timeout=10),
                                  interval=0.25, timeout=30, tolerate=())

    results = run_concurrently(client, len(keys), timeout=90)

    conflicts = 0
    for key, (seen, final, _) in zip(keys, results):
        for resp in seen:
            assert_in_progress(resp)
        conflicts += len(seen)
        assert_stored_first_answer(final, key)
    assert upstream.effects() == {k: 1 for k in keys}
    wait_until(lambda: all_answered(upstream, keys), timeout=5, message="the upstream's writes")
    assert upstream.resets() == {}
    counters = plugin_counters(envoy)
    assert (counters["claimed"], counters["completed"], counters["replayed"]) == (50, 50, 50)
    assert counters["conflict"] == conflicts


# --- 3. an upstream failure after the client left -----------------------------------------


def test_upstream_500_after_the_client_left_releases_the_key(upstream, start):
    envoy = start()
    key = new_key("late500")

    t0 = time.monotonic()
    abandon(envoy.port, "POST", "/payments",
            key_headers(key, {"x-status": "500", "x-delay-ms": "1000"}), BODY, after_s=0.2)
    seen, retry, _ = retry_until_answer(lambda: post(envoy.port, key), interval=0.2,
                                        timeout=15, tolerate=())
    done_at = time.monotonic() - t0
    again = post(envoy.port, key)

    for resp in seen:
        assert_in_progress(resp)
    assert seen, "no retry met the first call in progress"
    assert done_at >= 0.95, f"processed at {done_at:.2f}s, before the upstream's 500"
    assert retry.status == 201 and not is_replay(retry), describe(retry)
    assert retry.header_all("x-effect") == ["2"]
    assert retry.json() == upstream_json(key, 2)
    assert_replay_of(again, retry)
    assert upstream.effects() == {key: 2}
    assert [e["status"] for e in upstream.log()] == [500, 201]
    counters = plugin_counters(envoy)
    assert (counters["claimed"], counters["released"], counters["completed"]) == (2, 1, 1)


# --- 4. response shapes, both modes ------------------------------------------------------


def fetch_from_upstream(upstream, key, size):
    """What the upstream sends for this key now (a GET is no effect), for a byte compare."""
    resp = request(upstream.port, "GET", "/payments",
                   {"Idempotency-Key": key, "x-body-bytes": str(size)}, timeout=30)
    assert resp.status == 200
    return resp.body


@pytest.mark.parametrize("forward", ["router", "detached"])
def test_response_shapes_reach_the_client_intact(upstream, start, forward):
    # 16 buckets of 4 MiB: responses up to 1 MiB are stored (the default, fitted to them).
    envoy = start({"capacity": 1024, "max_store_bytes": 64 << 20}, forward=forward)
    cookie_key, mid_key, big_key = new_key("cookie"), new_key("mid"), new_key("big")
    mid_size, big_size = 256 * 1024, 4 * 1024 * 1024
    mid_extra = {"x-body-bytes": str(mid_size)}
    big_extra = {"x-body-bytes": str(big_size)}

    cookies = post(envoy.port, cookie_key, extra={"x-set-cookie": "a=1,b=2"})
    cookies_again = post(envoy.port, cookie_key, extra={"x-set-cookie": "a=1,b=2"})
    mid = post(envoy.port, mid_key, extra=mid_extra, timeout=30)
    mid_again = post(envoy.port, mid_key, extra=mid_extra, timeout=30)
    big = post(envoy.port, big_key, extra=big_extra, timeout=60)
    big_again = post(envoy.port, big_key, extra=big_extra, timeout=60)

    assert cookies.status == 201 and not is_replay(cookies), describe(cookies)
    assert cookies.header_all("set-cookie") == ["a=1", "b=2"]
    assert_replay_of(cookies_again, cookies)
    assert cookies_again.header_all("set-cookie") == ["a=1", "b=2"]

    for resp, key, size in ((mid, mid_key, mid_size), (big, big_key, big_size)):
        assert resp.status == 201 and not is_replay(resp), describe(resp)
        assert resp.header_all("content-type") == ["application/octet-stream"]
        assert resp.header_all("x-effect") == ["1"]
        assert len(resp.body) == size, f"{key}: {len(resp.body)} bytes, expected {size}"
        assert resp.body == pattern_body(key, 1, size)
        assert resp.body == fetch_from_upstream(upstream, key, size)
    assert_replay_of(mid_again, mid)
    assert mid_again.body == pattern_body(mid_key, 1, mid_size)
    assert_not_stored(big_again)  # completed without its body: never run again
    assert upstream.effects() == {cookie_key: 1, mid_key: 1, big_key: 1}
    counters = plugin_counters(envoy)
    assert counters["completed"] == 3 and counters["response_not_stored"] == 1


# --- 5. clients leaving at random moments ---------------------------------------------------


FAILURE_PATTERNS = re.compile(r"panic|wasm vm failed|Failed to|invalid context_id|"
                              r"Plugin configured to fail closed|wasm.*\b(critical|error)\b",
                              re.IGNORECASE)


def test_1000_clients_leaving_at_random_moments(upstream, start):
    envoy = start()
    rng = random.Random(20261129)
    n = 1000
    keys = [new_key(f"rand{i}") for i in range(n)]
    plans = [(rng.uniform(0, 0.3), rng.randint(0, 300), rng.random() < 0.3) for _ in range(n)]
    vms_before = envoy.stat("wasm.envoy.wasm.runtime.v8.active", None)
    assert vms_before, "no wasm VM count in the stats"

    def client(i):
        after_s, delay_ms, rst = plans[i]
        abandon(envoy.port, "POST", "/payments",
                key_headers(keys[i], {"x-delay-ms": str(delay_ms)}), BODY, after_s=after_s,
                rst=rst)

    started = time.monotonic()
    run_concurrently(client, n, max_workers=50, timeout=120)
    print(f"{n} abandoned requests in {time.monotonic() - started:.1f}s")
    wait_until(lambda: all_answered(upstream, keys), timeout=10, message="the upstream's writes")
    wait_until(lambda: plugin_counters(envoy)["entries_in_progress"] == 0, timeout=10,
               message="no call in flight")
    effects_before = upstream.effects()

    # Every key that reached the upstream was stored; the others were never claimed.
    retries = run_concurrently(lambda i: post(envoy.port, keys[i], timeout=15), n,
                               max_workers=32, timeout=120)
    probe_key = new_key("after")
    probe = post(envoy.port, probe_key)

    never = 0
    for key, resp in zip(keys, retries):
        if effects_before.get(key, 0) == 1:
            assert_stored_first_answer(resp, key)
        else:
            never += 1
            assert effects_before.get(key, 0) == 0, (key, effects_before.get(key))
            assert resp.status == 201 and not is_replay(resp), describe(resp)
    print(f"keys never claimed before the client left: {never}")
    # A client leaves after 0-300 ms and the claim takes about 1: only those that left at once
    # (about 2 %) can find their key unclaimed. A plugin that stopped claiming would show 1000.
    assert never <= n // 20, never
    assert probe.status == 201 and not is_replay(probe), describe(probe)
    assert upstream.effects() == {**{k: 1 for k in keys}, probe_key: 1}
    assert upstream.resets() == {}  # no detached call was cut by its client's departure

    log = envoy.log_text()
    failures = [line for line in log.splitlines() if FAILURE_PATTERNS.search(line)]
    assert not failures, failures[:10]
    wasm_stats = envoy.stats("wasm")  # wasm.* and *.wasm.*
    failed = {name: v for name, v in wasm_stats.items() if "fail" in name and v}
    assert not failed, failed
    assert envoy.stat("wasm.envoy.wasm.runtime.v8.active", None) == vms_before
    counters = plugin_counters(envoy)
    plugin_errors = {name: counters[name]
                     for name in ("upstream_failed", "store_error", "store_full", "owner_lost")}
    assert plugin_errors == dict.fromkeys(plugin_errors, 0)
    assert envoy.stat("http.ingress.downstream_rq_5xx") == 0
