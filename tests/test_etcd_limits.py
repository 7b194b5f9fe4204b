"""etcd on its worst days (docs/behaviour.md §3.8): out of space (its quota alarm), and stopped. Writes that
etcd refuses follow `on_unavailable` while stored answers still replay; a store that does not
answer is not hammered: requests back off (bounded, jittered)."""

import base64
import time
import uuid

import pytest

from e2e_util import assert_in_progress, assert_replay_of, describe, is_replay, plugin_counters, \
    post, problem
from etcd_util import Etcd, cluster as etcd_cluster
from harness import wait_until

QUOTA = 2 << 20


def b64(data):
    return base64.b64encode(data).decode()


def fleet_envoy(make_envoy, upstream, etcd, **store):
    config = {"store": {"kind": "etcd", "cluster": "etcd", **store}}
    return make_envoy(config, upstream.port, extra_clusters=[etcd_cluster(etcd.port)])


def fill(etcd):
    """Puts 60 KB values until etcd refuses them for lack of space; returns how many fit."""
    for i in range(1000):
        try:
            etcd.call("/v3/kv/put", {"key": b64(f"/junk/{i}".encode()), "value": b64(b"x" * 60_000)})
        except Exception as exc:  # urllib raises HTTPError 429 "database space exceeded"
            assert "429" in str(exc), exc
            return i
    raise AssertionError("etcd never ran out of space")


def free_space(etcd):
    """What an operator does: delete, compact, defragment, then disarm the alarm."""
    etcd.call("/v3/kv/deleterange", {"key": b64(b"/junk/"), "range_end": b64(b"/junk0")})
    status = etcd.call("/v3/maintenance/status", {})
    etcd.call("/v3/kv/compaction", {"revision": status["header"]["revision"], "physical": True})
    etcd.call("/v3/maintenance/defragment", {})
    etcd.call("/v3/maintenance/alarm", {"action": "DEACTIVATE", "alarm": "NOSPACE",
                                        "memberID": status["header"]["member_id"]})


@pytest.fixture
def small_etcd():
    server = Etcd(extra_args=["--quota-backend-bytes", str(QUOTA)])
    yield server
    server.close()


def test_etcd_out_of_space_replays_what_it_holds_and_recovers(upstream, small_etcd, make_envoy,
                                                              wasm):
    reject = fleet_envoy(make_envoy, upstream, small_etcd)
    passing = fleet_envoy(make_envoy, upstream, small_etcd, on_unavailable="pass")
    done_key, running_key = uuid.uuid4().hex, uuid.uuid4().hex
    done = post(reject.port, done_key)
    assert done.status == 201
    wait_until(lambda: is_replay(post(reject.port, done_key)), timeout=5,
               message="the completion in etcd")
    held = {"x-hold": "running"}
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, reject.port, running_key, extra=held, timeout=30)
        wait_until(lambda: upstream.effects(running_key) == 1, timeout=10,
                   message="the running call upstream")
        fitted = fill(small_etcd)

        new_key = uuid.uuid4().hex
        refused = post(reject.port, new_key)
        replay = post(reject.port, done_key)
        duplicate = post(reject.port, running_key, extra=held)
        passed_key = uuid.uuid4().hex
        passed = post(passing.port, passed_key)
        upstream.release("running")
        first = running.result()

        # No new work without a claim (reject), or unprotected work (pass); what etcd holds
        # still answers: the replay, and the 409 of the call in progress.
        problem(refused, 503, "store-unavailable", True)
        assert upstream.effects(new_key) == 0
        assert_replay_of(replay, done)
        assert_in_progress(duplicate)
        assert passed.status == 201 and not is_replay(passed), describe(passed)
        assert upstream.effects(passed_key) == 1
        assert first.status == 201, describe(first)
        for envoy in (reject, passing):
            assert plugin_counters(envoy)["store_no_space"] >= 1
        reject.wait_log(r"over its space quota")
        print(f"etcd filled with {fitted} values of 60 KB; quota {QUOTA} B")

        # Space is freed: new keys are claimed again, and the completion that etcd refused
        # meanwhile lands (it is retried), so the call that ran is replayed.
        free_space(small_etcd)
        after = uuid.uuid4().hex
        wait_until(lambda: post(reject.port, after).status == 201, timeout=10,
                   message="claims after the space was freed")
        assert is_replay(post(reject.port, after))
        again = None

        def replayed():
            nonlocal again
            again = post(reject.port, running_key, extra=held)
            return is_replay(again)
        wait_until(replayed, timeout=8, message="the refused completion, retried")
        assert_replay_of(again, first)
        assert upstream.effects(running_key) == 1


def etcd_requests(envoy):
    """Requests the plugin sent to the etcd cluster that ended, failed connects included."""
    return envoy.stat("cluster.etcd.upstream_rq_completed")


def test_a_stopped_etcd_is_not_hammered(upstream, make_envoy, wasm):
    etcd = Etcd()
    try:
        envoy = fleet_envoy(make_envoy, upstream, etcd)
        key = uuid.uuid4().hex
        assert post(envoy.port, key).status == 201
        wait_until(lambda: is_replay(post(envoy.port, key)), timeout=5, message="completion")
        etcd.stop()
        time.sleep(1)
        before = etcd_requests(envoy)
        window_s = 10
        time.sleep(window_s)
        sent = etcd_requests(envoy) - before
        # Three VMs (main thread and two workers) each probe at most once per backoff, which
        # grows from 0.1 s to 2 s: about 6 requests each in 10 s.
        print(f"etcd stopped {window_s} s, no client traffic: {sent} requests to the etcd cluster")
        assert sent <= 3 * window_s, sent
        etcd.start()
        key = uuid.uuid4().hex

        def protected():
            return post(envoy.port, key).status == 201 and is_replay(post(envoy.port, key))
        started = time.monotonic()
        wait_until(protected, timeout=15, message="recovery without restarting Envoy")
        print(f"claims again {time.monotonic() - started:.1f} s after etcd was back")
    finally:
        etcd.close()
