"""Upgrades (docs/upgrading.md): configurations an earlier release documented load in this one
and keep their meaning; what an old form now means is logged once, and what the plugin
derived is readable as gauges.

The two configurations below are the issue's: 0.1.0 refused both, and with FAIL_CLOSED Envoy
then exited at startup."""

import threading

import pytest

from e2e_util import new_key, plugin_counters, post
from etcd_util import Etcd, cluster as etcd_cluster
from harness import Envoy, EnvoyStartError, wait_until
from test_config_update import NAME, ecds_filter, write_ecds


def claim_conflict_replay(envoy, upstream, tag):
    """A slow first call, a duplicate during it (409), a retry after it (the replay): one
    effect upstream."""
    key = new_key(tag)
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("r", post(envoy, key, x_delay_ms=1200)))
    t.start()
    wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first call upstream")
    during = post(envoy, key)
    t.join()
    replay = post(envoy, key)
    assert during.status == 409 and during.json()["retryable"] is True, during.body
    assert first["r"].status == 201, first["r"].body
    assert replay.status == 201 and replay.header("idempotent-replayed") == "true", replay.body
    assert replay.body == first["r"].body
    assert upstream.effects(key) == 1


def test_a_large_max_response_bytes_without_a_budget_loads_with_a_derived_budget(wasm, upstream):
    # 20,000 entries in 313 buckets and 1 MiB answers (the documented default before 0.2.0):
    # the default budget's share (428,810 bytes a bucket) cannot hold one.
    envoy = Envoy({"capacity": 20000, "max_response_bytes": 1048576}, upstream.port)
    try:
        claim_conflict_replay(envoy, upstream, "budget")
        # An answer of 600 KiB, above the default budget's share, is stored and replayed.
        key = new_key("large")
        first = post(envoy, key, x_body_bytes=600 * 1024)
        again = post(envoy, key)
        assert first.status == 201 and len(first.body) == 600 * 1024
        assert again.header("idempotent-replayed") == "true" and again.body == first.body
        assert upstream.effects(key) == 1
        gauges = plugin_counters(envoy)
        assert gauges["config_max_store_bytes"] == 313 << 20, gauges
        assert gauges["config_buckets"] == 313
        assert gauges["config_bucket_share_bytes"] == 1 << 20
        assert gauges["config_max_response_bytes"] == 1 << 20
        envoy.wait_log(r"max_store_bytes not given: derived 328204288")
        envoy.wait_log(r"idempotency 0\.\d+\.\d+: configured; idempotency\.config_max_store_bytes=328204288")
        # Told once per process, not by each of the three VMs (main thread and 2 workers).
        assert envoy.log_text().count("max_store_bytes not given") == 1
    finally:
        envoy.stop()


def test_the_first_documented_fleet_store_runs_on_its_http1_cluster(wasm, upstream):
    etcd = Etcd()
    config = {"lease_ms": 3000, "store": {"kind": "etcd", "cluster": "etcd", "authority": "127.0.0.1:2379",
                                          "timeout_ms": 500, "on_unavailable": "reject"}}
    try:
        # As first documented: the JSON gateway on an HTTP/1.1 cluster.
        envoy = Envoy(config, upstream.port, extra_clusters=[etcd_cluster(etcd.port, api="json")])
        try:
            claim_conflict_replay(envoy, upstream, "fleet")
            assert plugin_counters(envoy).get("store_error", 0) == 0
            envoy.wait_log(r'store.authority without store.api: the JSON gateway')
            assert etcd.count_keys("/idem/") >= 1
        finally:
            envoy.stop()
    finally:
        etcd.close()


def test_a_fleet_store_without_api_on_an_http1_cluster_turns_to_the_json_gateway(wasm, upstream):
    """Before the gRPC API, a fleet store named no api and ran on an HTTP/1.1 cluster (corpus
    008, envoy/envoy-fleet.yaml then). etcd answers gRPC there UNIMPLEMENTED: the store turns
    to the JSON gateway rather than answering 503 for ever."""
    etcd = Etcd()
    config = {"lease_ms": 3000, "store": {"kind": "etcd", "cluster": "etcd", "timeout_ms": 1000}}
    try:
        envoy = Envoy(config, upstream.port, extra_clusters=[etcd_cluster(etcd.port, api="json")])
        try:
            # Each VM turns on its own first answer: the main thread's and the two workers'.
            turned = "answers gRPC calls UNIMPLEMENTED (an HTTP/1.1 cluster): using the JSON gateway"
            wait_until(lambda: envoy.log_text().count(turned) >= 3, timeout=10,
                       message="every VM on the JSON gateway")
            claim_conflict_replay(envoy, upstream, "h1fleet")
            assert etcd.count_keys("/idem/") >= 1
        finally:
            envoy.stop()
    finally:
        etcd.close()


@pytest.mark.parametrize("config, field", [
    ({"capacity": 64, "max_store_bytes": 1000, "max_response_bytes": 1001}, "max_response_bytes"),
    ({"store": {"kind": "etcd", "cluster": "etcd", "api": "grpc", "authority": "x"}}, "store.authority"),
])
def test_what_contradicts_itself_is_still_refused_naming_the_field(wasm, upstream, make_envoy, config,
                                                                  field):
    with pytest.raises(EnvoyStartError) as refused:
        make_envoy(config, upstream.port, extra_clusters=[etcd_cluster(1)])
    assert f"invalid configuration: field `{field}`" in refused.value.log


# --- Stored entries across releases (N-1 both ways) ------------------------------------------

FLEET = {"lease_ms": 3000, "store": {"kind": "etcd", "cluster": "etcd", "timeout_ms": 1000}}


def storm(envoys, upstream, keys, per_key=6):
    """Each key: a first call that takes 400 ms on one Envoy, `per_key` retries spread over
    every Envoy while it runs, then one more retry on each once it is done. Returns every
    answer by key, in order of sending."""
    answers = {key: [] for key in keys}
    lock = threading.Lock()

    def send(key, envoy, delay_ms=None):
        extra = {"x-delay-ms": str(delay_ms)} if delay_ms else None
        r = post(envoy, key, extra=extra)
        with lock:
            answers[key].append(r)

    threads = []
    for i, key in enumerate(keys):
        threads.append(threading.Thread(target=send, args=(key, envoys[i % len(envoys)], 400)))
        for j in range(per_key):
            threads.append(threading.Thread(target=send, args=(key, envoys[(i + j + 1) % len(envoys)])))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for key in keys:
        for envoy in envoys:
            wait_until(lambda: post(envoy, key).status != 409, timeout=10, message=f"{key} done")
            send(key, envoy)
    return answers


def assert_one_effect_and_exact_replays(upstream, answers):
    for key, rs in answers.items():
        assert upstream.effects(key) == 1, (key, [r.status for r in rs])
        done = [r for r in rs if r.status == 201]
        assert all(r.status in (201, 409) for r in rs), (key, [(r.status, r.body) for r in rs])
        firsts = [r for r in done if r.header("idempotent-replayed") != "true"]
        assert len(firsts) == 1, (key, len(firsts))
        for r in done:
            assert r.body == firsts[0].body, key
            assert r.header("content-type") == firsts[0].header("content-type"), key


def test_a_rolling_upgrade_on_one_etcd_keeps_every_key_once(wasm, previous_wasm, upstream):
    """Two Envoys on one etcd, one on the previous release and one on this: each reads and
    replays what the other wrote, under a retry storm across both."""
    etcd = Etcd()
    started = []
    try:
        clusters = [etcd_cluster(etcd.port)]
        old = Envoy(FLEET, upstream.port, extra_clusters=clusters, wasm=previous_wasm)
        started.append(old)
        new = Envoy(FLEET, upstream.port, extra_clusters=clusters)
        started.append(new)
        keys = [new_key(f"roll{i}") for i in range(24)]
        answers = storm([old, new], upstream, keys)
        assert_one_effect_and_exact_replays(upstream, answers)
        for envoy in (old, new):
            counters = plugin_counters(envoy)
            assert counters.get("store_error", 0) == 0, counters
            assert counters.get("replayed", 0) > 0, counters
    finally:
        for envoy in started:
            envoy.stop()
        etcd.close()


def test_a_new_wasm_in_a_running_envoy_replays_what_the_old_one_stored(wasm, previous_wasm, upstream,
                                                                      make_envoy, tmp_path):
    """Shared data outlives the plugin's code: the previous release stores answers, the
    configuration update swaps in this release (same vm_id), which replays them and stores
    its own; swapped back (a rollback), the previous release replays those."""
    ecds = str(tmp_path / "ecds.json")
    config = {"lease_ms": 3000}
    reloads = f"extension_config_discovery.http_filter.{NAME}.config_reload"

    def swap(path, n):
        write_ecds(ecds, config, wasm=path)
        wait_until(lambda: envoy.stat(reloads) >= n, timeout=10, message=f"configuration {n}")

    write_ecds(ecds, config, wasm=previous_wasm)
    envoy = make_envoy(None, upstream.port, with_plugin=False, extra_filters=[ecds_filter(ecds)],
                       node={"id": "gateway", "cluster": "gateway"})
    wait_until(lambda: envoy.stat(reloads) >= 1, timeout=10, message="the first configuration")
    stored_old = {}
    for i in range(8):
        key = new_key(f"old{i}")
        stored_old[key] = post(envoy, key, x_body_bytes=2000 + i)
        assert stored_old[key].status == 201
    swap(wasm, 2)
    envoy.wait_log(r"idempotency 0\.2\.\d+: configured")
    stored_new = {}
    for key, first in stored_old.items():
        r = post(envoy, key)
        assert r.header("idempotent-replayed") == "true" and r.body == first.body, key
    for i in range(8):
        key = new_key(f"new{i}")
        stored_new[key] = post(envoy, key, x_body_bytes=3000 + i)
    swap(previous_wasm, 3)
    for key, first in {**stored_old, **stored_new}.items():
        r = post(envoy, key)
        assert r.header("idempotent-replayed") == "true" and r.body == first.body, key
        assert upstream.effects(key) == 1, key
