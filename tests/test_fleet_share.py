"""The fleet's share of etcd (docs/fleet.md, "The fleet's share of etcd"): an Envoy bounds the
bytes it writes to etcd by `store.write_budget_bytes`; past it, the caller that wrote the most
gets 429 for new keys while its stored keys replay and other callers' new keys go on, so one
caller's flood never fills etcd to its quota alarm. The same flood without a budget does."""

import pytest

from e2e_util import assert_replay_of, describe, is_replay, new_key, plugin_counters, post, problem
from etcd_util import Etcd, cluster as etcd_cluster
from harness import run_concurrently

QUOTA = 4 << 20
BODY = 8 << 10
FLOOD = {"authorization": "Bearer flooding-tenant", "x-body-bytes": str(BODY)}
OTHER = {"authorization": "Bearer other-tenant"}


@pytest.fixture
def small_etcd():
    server = Etcd(extra_args=["--quota-backend-bytes", str(QUOTA)])
    yield server
    server.close()


def flood(make_envoy, upstream, etcd, budget):
    """600 new keys of 8 KiB answers from one caller (about 5 MB: more than the quota)."""
    store = {"kind": "etcd", "cluster": "etcd", "write_budget_bytes": budget}
    envoy = make_envoy({"store": store, "max_response_bytes": 64 << 10}, upstream.port,
                       extra_clusters=[etcd_cluster(etcd.port)])
    keys = [new_key("flood") for _ in range(600)]
    answers = run_concurrently(lambda i: post(envoy, keys[i], extra=FLOOD), len(keys),
                               max_workers=8, timeout=300)
    return envoy, keys, answers


def alarms(etcd):
    return etcd.call("/v3/maintenance/alarm", {"action": "GET"}).get("alarms", [])


def db_size(etcd):
    return int(etcd.call("/v3/maintenance/status", {})["dbSize"])


def test_a_flood_stops_at_the_envoys_share_and_never_fills_etcd(upstream, small_etcd, make_envoy,
                                                                 wasm):
    budget = 1 << 20
    before = db_size(small_etcd)
    envoy, keys, answers = flood(make_envoy, upstream, small_etcd, budget)
    served = [(k, a) for k, a in zip(keys, answers) if a.status == 201]
    refused = [a for a in answers if a.status != 201]
    assert served and refused, f"{len(served)} served, {len(refused)} refused"
    for answer in refused:
        problem(answer, 429, "share-full", True, retry_after=None)
    assert not alarms(small_etcd), "etcd raised its quota alarm"
    counters = plugin_counters(envoy)
    assert counters.get("store_no_space", 0) == 0, counters
    assert counters["share_full"] == len(refused), counters
    # What it stored still replays (no write), and another caller's new keys go on.
    for key, first in served[:20]:
        assert_replay_of(post(envoy, key, extra=FLOOD), first)
    others = [new_key("other") for _ in range(20)]
    for key in others:
        answer = post(envoy, key, extra=OTHER)
        assert answer.status == 201 and not is_replay(answer), describe(answer)
    assert all(upstream.effects(k) == 1 for k, _ in served)
    assert all(upstream.effects(k) == 1 for k in others)
    assert all(upstream.effects(k) == 0 for k, a in zip(keys, answers) if a.status == 429)
    used = envoy.stat("wasmcustom.idempotency.write_budget_used_bytes")
    grown = db_size(small_etcd) - before
    assert budget <= used < budget + 64 * (BODY + 2048), used
    print(f"budget {budget} B: {len(served)} of {len(keys)} new keys of {BODY} B answers served, "
          f"{len(refused)} got 429 (Retry-After {refused[0].header('retry-after')} s); the ledger "
          f"counted {used} B; etcd's dbSize grew {grown} B (ratio {grown / used:.2f}); no alarm; "
          f"20 replays and 20 new keys of another caller served")


def test_the_same_flood_without_a_budget_fills_etcd(upstream, small_etcd, make_envoy, wasm):
    """The control: with `write_budget_bytes: 0` the flood trips etcd's quota alarm, and then
    every caller's new key is refused (503) until an operator acts."""
    envoy, keys, answers = flood(make_envoy, upstream, small_etcd, 0)
    assert [a["alarm"] for a in alarms(small_etcd)] == ["NOSPACE"], alarms(small_etcd)
    counters = plugin_counters(envoy)
    assert counters["store_no_space"] > 0 and counters.get("share_full", 0) == 0, counters
    other = post(envoy, new_key("other"), extra=OTHER)
    problem(other, 503, "store-unavailable", True)
    served = sum(a.status == 201 for a in answers)
    print(f"no budget: {served} of {len(keys)} new keys served before etcd's quota alarm "
          f"({QUOTA} B); then another caller's new key got 503")
