"""Wait mode (docs/behaviour.md §3.3, `on_conflict: "wait"`) end to end.

A duplicate that meets an in-progress first call is held; the root's timer polls the entry;
when the first completes every held duplicate gets the replay, when it is released one held
duplicate becomes the first, after `wait_max_ms` a held duplicate gets the 409. Each test runs
a fresh Envoy (exact counters) against a fresh effect-counting upstream.
"""

import hashlib
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_util import (assert_in_progress, assert_not_stored, assert_replay_of, describe,
                      is_replay, new_key, plugin_counters, post)
from harness import CALLER, abandon, run_concurrently, wait_until

BODY = b'{"amount":1}'
FORWARDS = ["router", "detached"]
# What Envoy (V8) logs when the plugin panics or traps: a panic kills the VM.
PANIC_PATTERNS = re.compile(r"panicked at|RuntimeError|wasm trap|Function: \S+ failed|"
                            r"invalid context_id", re.I)


@pytest.fixture
def start(make_envoy, upstream, wasm):
    """start(config=None, forward="detached", **envoy_kwargs) -> a fresh Envoy."""

    def start_envoy(config=None, forward="detached", **kwargs):
        return make_envoy({"forward": forward, **(config or {})}, upstream.port, **kwargs)

    return start_envoy


def upstream_json(key, effect, path="/payments", body=BODY):
    """The body tests/upstream.py answers for a POST without x-body-bytes."""
    return {"key": key, "effect": effect, "method": "POST", "path": path,
            "body_sha256": hashlib.sha256(body).hexdigest()}


def assert_original(resp, key, effect, status=201, path="/payments"):
    assert resp.status == status, describe(resp)
    assert not is_replay(resp), describe(resp)
    assert resp.header_all("x-effect") == [str(effect)], describe(resp)
    assert resp.json() == upstream_json(key, effect, path), describe(resp)


def split_original(responses, key, effect=1, path="/payments"):
    """Exactly one original answer (the given effect) among responses; returns (it, others)."""
    errors = [r for r in responses if isinstance(r, BaseException)]
    assert not errors, f"client errors: {errors[:3]}"
    originals = [r for r in responses if not is_replay(r)]
    assert len(originals) == 1, [describe(r) for r in originals]
    assert_original(originals[0], key, effect, path=path)
    return originals[0], [r for r in responses if r is not originals[0]]


def assert_no_panic(envoy):
    hits = [line for line in envoy.log_text().splitlines() if PANIC_PATTERNS.search(line)]
    assert not hits, "wasm panic/trap in the Envoy log:\n" + "\n".join(hits[:20])


# --- 1. many waiters, one effect ---------------------------------------------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_50_concurrent_copies_one_effect_49_replays(upstream, start, forward):
    envoy = start({"on_conflict": "wait"}, forward)
    key = new_key("w50")

    t0 = time.monotonic()
    results = run_concurrently(
        lambda: post(envoy.port, key, extra={"x-delay-ms": "1000"}, timeout=30), 50,
        timeout=90, return_exceptions=True)
    took = time.monotonic() - t0

    first, others = split_original(results, key)
    for r in others:
        assert_replay_of(r, first)
    held = sorted(r.elapsed_s for r in others)
    print(f"[{forward}] 50 copies in {took:.2f}s; replays answered after "
          f"{held[0]:.2f}..{held[-1]:.2f}s (first {first.elapsed_s:.2f}s)")
    assert upstream.effects() == {key: 1}
    counters = plugin_counters(envoy)
    assert counters["claimed"] == 1, counters
    assert counters["completed"] == 1, counters
    assert counters["conflict"] == 0, counters
    assert counters["waited"] == 49, counters
    assert counters["replayed"] == 49, counters


# --- 2. the first is released: one waiter takes over ------------------------------------


@pytest.mark.every_envoy
@pytest.mark.parametrize("forward", FORWARDS)
def test_first_released_by_500_one_waiter_becomes_first(upstream, start, forward):
    envoy = start({"on_conflict": "wait"}, forward)
    key = new_key("w500")

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, envoy.port, key,
                              extra={"x-status": "500", "x-delay-ms": "500"}, timeout=30)
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first upstream")
        time.sleep(0.05)
        waiters = run_concurrently(lambda: post(envoy.port, key, timeout=30), 10, timeout=60,
                                   return_exceptions=True)
        failed = pending.result(30)

    assert_original(failed, key, 1, status=500)  # the upstream's 500 passes through
    new_first, others = split_original(waiters, key, effect=2)
    for r in others:
        assert_replay_of(r, new_first)
    assert upstream.effects() == {key: 2}
    counters = plugin_counters(envoy)
    print(f"[{forward}] counters: {counters}")
    assert counters["waited"] == 10, counters
    assert counters["claimed"] == 2, counters
    assert counters["released"] == 1, counters
    assert counters["completed"] == 1, counters
    assert counters["replayed"] == 9, counters
    assert counters["conflict"] == 0, counters


# --- 3. upstream slower than wait_max_ms -------------------------------------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_wait_max_ms_then_409(upstream, start, forward):
    envoy = start({"on_conflict": "wait", "wait_max_ms": 1000}, forward)
    key = new_key("wmax")
    extra = {"x-delay-ms": "4000"}

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, envoy.port, key, extra=extra, timeout=30)
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first upstream")
        waiters = run_concurrently(lambda: post(envoy.port, key, extra=extra, timeout=30), 5,
                                   timeout=60, return_exceptions=True)
        first = pending.result(30)

    holds = [round(r.elapsed_s, 3) for r in waiters if not isinstance(r, BaseException)]
    print(f"[{forward}] hold times of the 409s (wait_max_ms 1000): {holds}")
    for r in waiters:
        assert not isinstance(r, BaseException), r
        body = assert_in_progress(r)
        assert body["retry_after"] == 1
        assert 0.9 <= r.elapsed_s <= 2.5, f"held {r.elapsed_s:.3f}s: {describe(r)}"
    assert_original(first, key, 1)
    assert_replay_of(post(envoy.port, key, extra=extra), first)
    assert upstream.effects() == {key: 1}
    counters = plugin_counters(envoy)
    assert counters["waited"] == 5, counters
    assert counters["conflict"] == 5, counters
    assert counters["replayed"] == 1, counters


# --- 4. waiters whose clients leave --------------------------------------------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_waiters_that_disconnect(upstream, start, forward):
    envoy = start({"on_conflict": "wait"}, forward)
    key = new_key("wgone")
    headers = [("content-type", "application/json"), ("Idempotency-Key", key),
               ("x-delay-ms", "1500"), CALLER]

    with ThreadPoolExecutor(21) as pool:
        pending = pool.submit(post, envoy.port, key, extra={"x-delay-ms": "1500"}, timeout=30)
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first upstream")
        gone = [pool.submit(abandon, envoy.port, "POST", "/payments", headers, BODY,
                            after_s=0.3) for _ in range(20)]
        for g in gone:
            g.result(30)
        # Envoy keeps serving while the first call is in progress.
        other = new_key("other")
        meanwhile = post(envoy.port, other)
        first = pending.result(30)

    assert_original(meanwhile, other, 1)
    assert_original(first, key, 1)
    assert first.elapsed_s >= 1.4, describe(first)
    retry = post(envoy.port, key, extra={"x-delay-ms": "1500"})
    assert_replay_of(retry, first)
    assert upstream.effects() == {key: 1, other: 1}
    counters = plugin_counters(envoy)
    print(f"[{forward}] counters: {counters}")
    assert counters["waited"] == 20, counters
    assert counters["claimed"] == 2 and counters["completed"] == 2, counters
    assert counters["replayed"] == 1, counters
    assert counters["conflict"] == 0, counters
    # One more fresh request after the dust settled: the VMs are alive.
    later = new_key("later")
    assert_original(post(envoy.port, later), later, 1)
    assert envoy.alive()
    time.sleep(0.3)  # the log is flushed every 100 ms
    assert_no_panic(envoy)


# --- 5. waiters on both workers ------------------------------------------------------------


def worker_cx_totals(envoy):
    """{worker index: downstream_cx_total} of the test listener."""
    stats = envoy.stats(r"worker_\d+\.downstream_cx_total")
    prefix = f"listener.127.0.0.1_{envoy.port}.worker_"
    totals = {}
    for name, value in stats.items():
        if name.startswith(prefix) and name.endswith(".downstream_cx_total"):
            totals[int(name[len(prefix):].split(".")[0])] = value
    return totals


@pytest.mark.parametrize("forward", FORWARDS)
def test_waiters_spread_over_both_workers(upstream, start, forward):
    envoy = start({"on_conflict": "wait"}, forward, concurrency=2)
    key = new_key("wboth")
    extra = {"x-delay-ms": "1500"}

    before = worker_cx_totals(envoy)
    assert sorted(before) == [0, 1], f"per-worker listener stats not found: {before}"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, envoy.port, key, extra=extra, timeout=30)
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first upstream")
        # One new connection per waiter (post() opens and closes its own).
        waiters = run_concurrently(lambda: post(envoy.port, key, extra=extra, timeout=30), 48,
                                   timeout=90, return_exceptions=True)
        first = pending.result(30)
    after = worker_cx_totals(envoy)

    grew = {w: after[w] - before[w] for w in before}
    print(f"[{forward}] new connections per worker: {grew}")
    assert sum(grew.values()) >= 49, grew
    assert grew[0] > 0 and grew[1] > 0, f"all connections on one worker: {grew}"
    assert_original(first, key, 1)
    for r in waiters:
        assert not isinstance(r, BaseException), r
        assert_replay_of(r, first)
    assert upstream.effects() == {key: 1}
    counters = plugin_counters(envoy)
    assert counters["waited"] == 48, counters
    assert counters["replayed"] == 48, counters


# --- 6. max_waiters ------------------------------------------------------------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_max_waiters_overflow_gets_409_at_once(upstream, start, forward):
    # max_waiters is per worker VM: one worker makes the numbers exact. One caller holds at
    # most half of them (docs/behaviour.md §3.4): 2 of 4.
    envoy = start({"on_conflict": "wait", "max_waiters": 4}, forward, concurrency=1)
    key = new_key("wmax2")
    extra = {"x-delay-ms": "1500"}

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, envoy.port, key, extra=extra, timeout=30)
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first upstream")
        dups = run_concurrently(lambda: post(envoy.port, key, extra=extra, timeout=30), 10,
                                timeout=60, return_exceptions=True)
        first = pending.result(30)

    assert_original(first, key, 1)
    for r in dups:
        assert not isinstance(r, BaseException), r
    overflow = [r for r in dups if r.status == 409]
    held = [r for r in dups if r.status != 409]
    print(f"[{forward}] overflow elapsed: {[round(r.elapsed_s, 3) for r in overflow]}; "
          f"held elapsed: {[round(r.elapsed_s, 3) for r in held]}")
    assert len(overflow) == 8 and len(held) == 2, [describe(r) for r in dups]
    for r in overflow:
        assert_in_progress(r)
        assert r.elapsed_s < 0.5, f"overflow held {r.elapsed_s:.3f}s"
    for r in held:
        assert_replay_of(r, first)
    assert upstream.effects() == {key: 1}
    counters = plugin_counters(envoy)
    assert counters["waited"] == 2, counters
    assert counters["conflict"] == 8, counters
    assert counters["replayed"] == 2, counters


# --- 7. per-route override -------------------------------------------------------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_per_route_on_conflict_wait(upstream, start, forward):
    envoy = start({"on_conflict": "reject",
                   "routes": [{"match": {"prefix": "/wait"}, "on_conflict": "wait"}]}, forward)
    wkey, okey = new_key("route-wait"), new_key("route-other")
    extra = {"x-delay-ms": "1000"}

    with ThreadPoolExecutor(2) as pool:
        first_w = pool.submit(post, envoy.port, wkey, path="/wait", extra=extra, timeout=30)
        first_o = pool.submit(post, envoy.port, okey, path="/other", extra=extra, timeout=30)
        wait_until(lambda: upstream.effects(wkey) == 1 and upstream.effects(okey) == 1,
                   timeout=5, message="both firsts upstream")
        # /other first: its 409s come at once, while both firsts are still in progress.
        dups_o = run_concurrently(
            lambda: post(envoy.port, okey, path="/other", extra=extra, timeout=30), 4,
            timeout=60, return_exceptions=True)
        dups_w = run_concurrently(
            lambda: post(envoy.port, wkey, path="/wait", extra=extra, timeout=30), 4,
            timeout=60, return_exceptions=True)
        fw, fo = first_w.result(30), first_o.result(30)

    assert_original(fw, wkey, 1, path="/wait")
    assert_original(fo, okey, 1, path="/other")
    for r in dups_w:
        assert not isinstance(r, BaseException), r
        assert_replay_of(r, fw)
    for r in dups_o:
        assert not isinstance(r, BaseException), r
        assert_in_progress(r)
        assert r.elapsed_s < 0.5, f"/other held {r.elapsed_s:.3f}s"
    assert upstream.effects() == {wkey: 1, okey: 1}
    counters = plugin_counters(envoy)
    assert counters["waited"] == 4, counters
    assert counters["conflict"] == 4, counters
    assert counters["replayed"] == 4, counters


# --- 8. the first's response is not stored: every waiter gets the final 409 --------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_waiters_of_a_response_too_large_to_store(upstream, start, forward):
    envoy = start({"on_conflict": "wait", "max_response_bytes": 1024}, forward)
    key = new_key("wbig")
    extra = {"x-delay-ms": "1000", "x-body-bytes": "4096"}

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, envoy.port, key, extra=extra, timeout=30)
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first upstream")
        waiters = run_concurrently(lambda: post(envoy.port, key, extra=extra, timeout=30), 6,
                                   timeout=60, return_exceptions=True)
        first = pending.result(30)

    assert first.status == 201 and len(first.body) == 4096, describe(first)  # unaltered
    for r in waiters:
        assert not isinstance(r, BaseException), r
        assert_not_stored(r)
    assert upstream.effects() == {key: 1}
    counters = plugin_counters(envoy)
    assert counters["response_not_stored"] == 1, counters
    assert counters["waited"] == 6, counters
    assert counters["conflict"] == 6, counters  # one per 409 sent


# --- 9. the first's mark expires: one waiter takes over ----------------------------------------


def test_waiters_take_over_an_expired_mark_router(upstream, start):
    """forward "router": the first's client leaves, the outcome is unknown, its mark is no
    longer renewed and expires after lease_ms; exactly one held duplicate takes it over."""
    envoy = start({"on_conflict": "wait", "lease_ms": 1000, "wait_max_ms": 5000}, "router")
    key = new_key("wexp")
    headers = [("content-type", "application/json"), ("Idempotency-Key", key),
               ("x-delay-ms", "3000"), CALLER]

    with ThreadPoolExecutor(1) as pool:
        gone = pool.submit(abandon, envoy.port, "POST", "/payments", headers, BODY,
                           after_s=0.3)
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first upstream")
        t0 = time.monotonic()
        waiters = run_concurrently(lambda: post(envoy.port, key, timeout=30), 6, timeout=60,
                                   return_exceptions=True)
        took = time.monotonic() - t0
        gone.result(30)

    new_first, others = split_original(waiters, key, effect=2)
    for r in others:
        assert_replay_of(r, new_first)
    print(f"waiters answered after {took:.2f}s (lease 1 s)")
    assert 0.5 <= took <= 3.0, took
    assert upstream.effects() == {key: 2}
    counters = plugin_counters(envoy)
    assert counters["expired_takeover"] == 1, counters
    assert counters["waited"] == 6, counters
    assert counters["claimed"] == 2 and counters["completed"] == 1, counters
    assert counters["replayed"] == 5, counters
