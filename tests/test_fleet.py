"""Fleet mode (docs/behaviour.md §2 `store`, issue "Fleet mode"): two Envoy processes share one etcd.

Both Envoys are addressed with the same Host, as a fleet behind one name is (the store key
includes the host).
"""

import functools
import signal
import threading
import time
import uuid

import pytest

import e2e_util
from etcd_util import Etcd, cluster as etcd_cluster
from harness import Envoy, run_concurrently, wait_until

HOST = "api.example"


def fleet_config(**overrides):
    store = {"kind": "etcd", "cluster": "etcd", "timeout_ms": 1000}
    store.update(overrides.pop("store", {}))
    config = {"lease_ms": 3000, "store": store}  # the smallest lease accepted with etcd
    config.update(overrides)
    return config


@pytest.fixture
def etcd():
    server = Etcd()
    yield server
    server.close()


def start_pair(upstream, etcd, **config):
    clusters = [etcd_cluster(etcd.port)]
    a = Envoy(fleet_config(**config), upstream.port, extra_clusters=clusters)
    b = Envoy(fleet_config(**config), upstream.port, extra_clusters=clusters)
    return a, b


# The tests' client, with this file's host and body.
post = functools.partial(e2e_util.post, body=b'{"amount":10}', host=HOST, timeout=10)


def retry_until_final(envoy, key, deadline_s=10):
    """Retries while the answer is 409 retryable, as a client honouring Retry-After would
    (faster, to keep the test short)."""
    end = time.time() + deadline_s
    while True:
        r = post(envoy, key)
        if r.status != 409 or time.time() > end:
            return r
        time.sleep(0.1)


@pytest.mark.every_envoy
@pytest.mark.parametrize("forward", ["detached", "router"])
def test_retry_on_the_other_envoy_gets_409_then_the_replay(wasm, upstream, etcd, forward):
    a, b = start_pair(upstream, etcd, forward=forward)
    try:
        key = uuid.uuid4().hex
        first = {}
        t = threading.Thread(target=lambda: first.setdefault("r", post(a, key, x_delay_ms=1500)))
        t.start()
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="first call upstream")
        dup = post(b, key)
        assert dup.status == 409
        assert dup.json()["retryable"] is True and dup.header("retry-after") == "1"
        t.join()
        assert first["r"].status == 201
        replay = retry_until_final(b, key)
        assert replay.status == 201
        assert replay.header("idempotent-replayed") == "true"
        assert replay.body == first["r"].body
        assert upstream.effects(key) == 1
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("forward", ["detached", "router"])
def test_read_your_writes_a_retry_right_after_the_answer_is_replayed_on_the_other_envoy(
        wasm, upstream, etcd, forward):
    """docs/behaviour.md §3.4: the completion is in etcd before the answer's end reaches the client, so a
    retry sent the moment the answer arrived, to the other replica, is replayed (before:
    409 in 2 of 5 runs)."""
    a, b = start_pair(upstream, etcd, forward=forward)
    try:
        outcomes = []
        for i in range(40):
            key = uuid.uuid4().hex
            first = post(a, key)
            assert first.status == 201 and first.header("idempotent-replayed") is None
            again = post(b, key)
            outcomes.append((again.status, again.header("idempotent-replayed")))
            assert again.body == first.body
        assert outcomes == [(201, "true")] * 40, outcomes
        assert a.stat("wasmcustom.idempotency.completion_unacknowledged") == 0
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("local_replays", [True, False])
def test_replays_seen_before_need_no_round_trip_to_etcd(wasm, upstream, etcd, local_replays):
    """Each Envoy keeps copies of the completed entries it has seen (store.local_replays):
    the Envoy that completed a key replays it without asking etcd, the other asks once. A
    copy is the caller's own: another caller's same key is not replayed from it."""
    a, b = start_pair(upstream, etcd, store={"local_replays": local_replays})
    try:
        key = uuid.uuid4().hex
        first = post(a, key)
        assert first.status == 201
        time.sleep(0.3)  # the completion's own answers are in
        sent, local, grants = {}, {}, {}
        for name, envoy in (("a", a), ("b", b)):
            before = envoy.stat("cluster.etcd.upstream_rq_total")
            local_before = envoy.stat("wasmcustom.idempotency.local_replays")
            started = time.monotonic()
            replays = [post(envoy, key) for _ in range(20)]
            assert all(r.status == 201 and r.header("idempotent-replayed") == "true" for r in replays)
            assert all(r.body == first.body for r in replays)
            time.sleep(0.3)
            sent[name] = envoy.stat("cluster.etcd.upstream_rq_total") - before
            local[name] = envoy.stat("wasmcustom.idempotency.local_replays") - local_before
            # Lease rotation adds grants: one per 1.5 s and worker at lease_ms 3000, from the
            # worker's own timer (one more at either edge of the window; a loaded machine
            # stretches it). Far below the 20 calls the replays would otherwise make.
            grants[name] = 2 * (2 + int((time.monotonic() - started) // 1.5))
        if local_replays:
            assert local == {"a": 20, "b": 19}, local
            assert sent["a"] <= grants["a"] and 1 <= sent["b"] <= 1 + grants["b"], (sent, grants)
        else:
            assert sent["a"] >= 20 and sent["b"] >= 20, sent
        other = post(b, key, extra={"Authorization": "Bearer someone-else"})
        assert other.status == 201 and other.header("idempotent-replayed") is None
        assert upstream.effects(key) == 2  # one per caller
    finally:
        a.stop()
        b.stop()


def test_500_keys_sent_4_times_to_both_envoys_give_500_effects(wasm, upstream, etcd):
    a, b = start_pair(upstream, etcd)
    try:
        run = uuid.uuid4().hex[:8]
        keys = [f"{run}-{i}" for i in range(500)]
        jobs = [(k, (a, b)[j % 2]) for k in keys for j in range(4)]
        started = time.time()
        results = run_concurrently(lambda i: post(jobs[i][1], jobs[i][0], timeout=30), len(jobs), max_workers=48)
        elapsed = time.time() - started
        statuses = {}
        for r in results:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        print(f"2000 requests in {elapsed:.1f}s: {statuses}")
        assert set(statuses) <= {201, 409}
        assert sum(upstream.effects(k) for k in keys) == 500
        assert all(upstream.effects(k) == 1 for k in keys)
        # Per key: one original answer, and every other 201 is its replay, byte for byte.
        for key in keys:
            answers = [r for (k, _), r in zip(jobs, results) if k == key and r.status == 201]
            originals = [r for r in answers if r.header("idempotent-replayed") is None]
            assert len(originals) == 1, (key, [r.headers for r in answers])
            assert all(r.body == originals[0].body for r in answers), key
            for r in results:
                if r.status == 409:
                    assert b"problem:in-progress" in r.body, r.body
    finally:
        a.stop()
        b.stop()


def test_killed_envoy_marks_expire_and_the_retry_on_the_other_is_processed(wasm, upstream, etcd):
    a, b = start_pair(upstream, etcd, forward="router")
    try:
        key = uuid.uuid4().hex
        t = threading.Thread(target=lambda: _ignore(lambda: post(a, key, x_delay_ms=6000, timeout=10)))
        t.start()
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="first call upstream")
        a.kill(signal.SIGKILL)
        killed_at = time.time()
        assert post(b, key).status == 409  # the mark is still there
        r = retry_until_final(b, key, deadline_s=15)
        waited = time.time() - killed_at
        print(f"retry processed {waited:.1f}s after the kill (lease_ms 3000)")
        assert r.status == 201 and r.header("idempotent-replayed") is None
        assert upstream.effects(key) == 2
        assert waited < 8
        t.join()
    finally:
        a.stop()
        b.stop()


def _ignore(fn):
    try:
        fn()
    except Exception:
        pass


@pytest.mark.parametrize("on_unavailable", ["reject", "pass"])
def test_etcd_down_then_back(wasm, upstream, etcd, on_unavailable):
    a, b = start_pair(upstream, etcd, store={"on_unavailable": on_unavailable})
    try:
        assert post(a, uuid.uuid4().hex).status == 201  # everything is up
        etcd.stop()
        key = uuid.uuid4().hex
        r = post(a, key)
        if on_unavailable == "reject":
            assert r.status == 503
            assert r.header("content-type") == "application/problem+json"
            assert r.header("retry-after") == "1"
            assert r.json()["retryable"] is True
            assert upstream.effects(key) == 0
        else:
            assert r.status == 201
            assert upstream.effects(key) == 1
        assert a.stat("wasmcustom.idempotency.store_error") >= 1
        etcd.start()  # returns once etcd has its leader again
        back = time.monotonic()
        key = uuid.uuid4().hex
        # Normal behaviour resumes without restarting Envoy. Every worker's VM backs off on its
        # own, and the bound is the worst VM's: its probe may have reached etcd while it was
        # electing a leader (a restarted member holds calls for about a second), so it waits out
        # that call's timeout (1 s), then its backoff (at most 2 s), then probes on a tick.
        # Passing a few checks earlier proves nothing: first calls may all land on the VM that
        # has recovered while the other still refuses (seen in CI).
        recovered_by = 1.0 + 2.0 + 0.5
        time.sleep(max(0.0, back + recovered_by - time.monotonic()))
        for _ in range(8):  # new connections, spread over both workers of each Envoy
            for envoy in (a, b):
                probe = f"probe-{uuid.uuid4().hex}"
                assert post(envoy, probe).status == 201
                assert post(envoy, probe).header("idempotent-replayed") == "true"
        first = post(a, key)
        assert first.status == 201
        replay = retry_until_final(b, key)
        assert replay.header("idempotent-replayed") == "true"
        assert upstream.effects(key) == 1
    finally:
        a.stop()
        b.stop()


def test_upstream_failure_on_a_releases_the_key_for_b_at_once(wasm, upstream, etcd):
    a, b = start_pair(upstream, etcd)
    try:
        key = uuid.uuid4().hex
        r = post(a, key, x_status=500)
        assert r.status == 500
        time.sleep(0.2)  # the release is written right after the answer
        r = post(b, key)
        assert r.status == 201 and r.header("idempotent-replayed") is None
        assert upstream.effects(key) == 2
    finally:
        a.stop()
        b.stop()
