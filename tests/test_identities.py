"""Identities are free (docs/behaviour.md §3.4, §3.13): a caller is whatever its scope header
says, so a hostile client can invent a new one per request. None of them may evict, lock out or
outspend an established caller: stored answers keep their replay window (`min_retention_s`),
answers that prove nothing (401, 403, 407) are not kept, the fleet's write budget judges the
unknown callers together, callers' tags cannot be computed without the Envoy's secret, and a
worker's wait slots are shared per caller. Also the small holes: an empty scope value is no
caller, and `//` cannot escape a rule."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_util import (assert_replay_of, describe, is_replay, new_key, plugin_counters, post,
                      problem)
from etcd_util import Etcd, cluster as etcd_cluster
from harness import run_concurrently, wait_until

ROOT = Path(__file__).resolve().parent.parent
ESTABLISHED = {"authorization": "Bearer established-tenant"}
CAPACITY = 1024


def established_answers(envoy, n=64):
    keys = [new_key("est") for _ in range(n)]
    firsts = [post(envoy, k, extra=ESTABLISHED) for k in keys]
    for first in firsts:
        assert first.status == 201 and not is_replay(first), describe(first)
    return keys, firsts


def assert_all_replay(envoy, upstream, keys, firsts, extra=ESTABLISHED):
    for key, first in zip(keys, firsts):
        assert_replay_of(post(envoy, key, extra=extra), first)
    effects = upstream.effects()
    assert all(effects[k] == 1 for k in keys), {k: effects[k] for k in keys if effects[k] != 1}


def invented(n, status=None):
    """The flood: each request a new key under a new made-up `Authorization`."""
    def one(i):
        extra = {"authorization": f"Bearer junk-{i}-{new_key('id')}"}
        if status:
            extra["x-status"] = str(status)
        return extra
    return [one(i) for i in range(n)]


def test_junk_tokens_the_upstream_refuses_store_nothing(upstream, make_envoy, wasm):
    """4,096 new keys under 4,096 junk tokens the upstream refuses with 401, through a
    1,024-entry table beside an established caller's 64 answers: the 401s release their keys
    (nothing ran, nothing is kept), and every established answer replays, one effect each."""
    envoy = make_envoy({"capacity": CAPACITY}, upstream.port)
    keys, firsts = established_answers(envoy)
    identities = invented(4 * CAPACITY, status=401)
    flood = [new_key("junk") for _ in identities]
    answers = run_concurrently(lambda i: post(envoy, flood[i], extra=identities[i]), len(flood),
                               max_workers=8, timeout=300)
    assert all(a.status == 401 for a in answers), [describe(a) for a in answers if a.status != 401][:3]
    assert_all_replay(envoy, upstream, keys, firsts)
    counters = plugin_counters(envoy)
    assert counters["released"] == len(flood), counters
    assert counters.get("evicted", 0) == 0, counters
    assert envoy.stat("wasmcustom.idempotency.entries_completed") == len(keys)
    print(f"401 flood: {len(flood)} released, {counters.get('evicted', 0)} evicted, "
          f"{len(keys)} established answers replayed")


@pytest.mark.parametrize("window", [60, 0], ids=["window", "no-window"])
def test_invented_identities_cannot_evict_answers_inside_their_window(upstream, make_envoy, wasm,
                                                                      window):
    """4,096 new keys under 4,096 identities the upstream accepts, through a 1,024-entry table
    beside an established caller's 64 answers. With the replay window (the default), no
    answer a client received is evicted inside it: what does not fit is refused (503
    `store-full`, retryable) without reaching the upstream, and every answer served replays.
    Without the window (`min_retention_s: 0`), the same flood evicts the established answers
    (the check can fail)."""
    envoy = make_envoy({"capacity": CAPACITY, "min_retention_s": window}, upstream.port)
    keys, firsts = established_answers(envoy)
    identities = invented(4 * CAPACITY)
    flood = [new_key("inv") for _ in identities]
    answers = run_concurrently(lambda i: post(envoy, flood[i], extra=identities[i]), len(flood),
                               max_workers=8, timeout=300)
    served = [i for i, a in enumerate(answers) if a.status == 201]
    refused = [i for i, a in enumerate(answers) if a.status != 201]
    effects = upstream.effects()
    counters = plugin_counters(envoy)
    if window == 0:
        replayed = sum(is_replay(post(envoy, k, extra=ESTABLISHED)) for k in keys)
        assert replayed < len(keys), "without the window, invented identities evict the established"
        print(f"no window: {len(served)} served, {counters.get('evicted', 0)} evicted, "
              f"{replayed} of {len(keys)} established answers left")
        return
    assert served and refused, f"{len(served)} served, {len(refused)} refused"
    for i in refused:
        problem(answers[i], 503, "store-full", True, retry_after=None)
        assert effects.get(flood[i], 0) == 0, "a refused key reached the upstream"
    assert counters.get("evicted", 0) == 0, counters
    assert counters["store_full"] == len(refused), counters
    assert_all_replay(envoy, upstream, keys, firsts)
    # Every flood answer a client received replays too: none was evicted inside the window.
    for i in served:
        assert_replay_of(post(envoy, flood[i], extra=identities[i]), answers[i])
    print(f"window {window} s: {len(served)} served, {len(refused)} refused (503 store-full, "
          f"no upstream call), 0 evicted; {len(keys)} established and {len(served)} flood "
          f"answers replayed")


def tag_key_of(envoy):
    match = envoy.wait_log(r"keyed with this Envoy's secret ([0-9a-f]{32})", timeout=5)
    return match.group(1)


def caller_tag(key, scope):
    out = subprocess.run([sys.executable, str(ROOT / "tools/caller_tag.py"), "--key", key, scope],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def unkeyed_tag(scope):
    """The tag of the releases before 0.3.0: FNV-1a, folded to 20 bits, computed by anyone."""
    h = 0xCBF29CE484222325
    for b in len(scope).to_bytes(8, "little") + scope:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return ((h ^ (h >> 20) ^ (h >> 40)) & 0xFFFFF) or 1


def test_a_scope_forged_to_match_a_victims_old_tag_is_its_own_caller(upstream, make_envoy, wasm):
    """A client searches for an `Authorization` value with the victim's tag as the releases
    before 0.3.0 computed it (unkeyed, 20 bits: a few hundred thousand tries), and floods under
    it, hoping to share the victim's fair share. The tag is now keyed with the Envoy's secret:
    the forged scope is a caller of its own, fair share evicts its answers only, and the
    victim's all replay."""
    victim = b"Bearer victim-tenant"
    target = unkeyed_tag(victim)
    forged = next(f"Bearer forged-{n}".encode() for n in range(10_000_000)
                  if unkeyed_tag(f"Bearer forged-{n}".encode()) == target)
    capacity = 256
    envoy = make_envoy({"capacity": capacity, "min_retention_s": 0}, upstream.port)
    key = tag_key_of(envoy)
    assert caller_tag(key, forged.decode()) != caller_tag(key, victim.decode())
    keys = [new_key("victim") for _ in range(64)]
    firsts = [post(envoy, k, extra={"authorization": victim.decode()}) for k in keys]
    flood = [new_key("forged") for _ in range(8 * capacity)]
    run_concurrently(lambda i: post(envoy, flood[i], extra={"authorization": forged.decode()}),
                     len(flood), max_workers=8, timeout=300)
    assert_all_replay(envoy, upstream, keys, firsts, extra={"authorization": victim.decode()})
    assert plugin_counters(envoy)["evicted_below_share"] == 0
    print(f"forged scope {forged!r} (old tag {target:05x}) flooded {len(flood)} keys: "
          f"its tag under this Envoy's key is {caller_tag(key, forged.decode())}, the victim's "
          f"{caller_tag(key, victim.decode())}; all 64 victim answers replayed")


def test_one_caller_running_the_wait_slots_out_is_refused_itself(upstream, make_envoy, wasm):
    """Wait mode, 8 wait slots a worker (one worker): a caller holding half of them gets its
    next duplicate answered 409 at once, while another caller's duplicate is still held and
    gets the replay."""
    envoy = make_envoy({"on_conflict": "wait", "max_waiters": 8, "wait_max_ms": 5000},
                       upstream.port, concurrency=1)
    hog, other = {"authorization": "Bearer hog"}, {"authorization": "Bearer other"}
    # Both callers known to the worker: each claims twice.
    for who in (hog, other):
        for _ in range(2):
            assert post(envoy, new_key("warm"), extra=who).status == 201
    slow_hog, slow_other = new_key("slow-hog"), new_key("slow-other")
    held = dict(hog, **{"x-hold": "slow"})
    held_other = dict(other, **{"x-hold": "slow"})
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(12) as pool:
        firsts = [pool.submit(post, envoy, slow_hog, extra=held, timeout=30),
                  pool.submit(post, envoy, slow_other, extra=held_other, timeout=30)]
        wait_until(lambda: upstream.effects(slow_hog) == 1 and upstream.effects(slow_other) == 1,
                   timeout=10, message="both slow calls at the upstream")
        waiters = [pool.submit(post, envoy, slow_hog, extra=held, timeout=30) for _ in range(4)]
        wait_until(lambda: plugin_counters(envoy).get("waited", 0) == 4, timeout=10,
                   message="the hog's four duplicates held")
        refused = post(envoy, slow_hog, extra=held)
        other_waiter = pool.submit(post, envoy, slow_other, extra=held_other, timeout=30)
        wait_until(lambda: plugin_counters(envoy).get("waited", 0) == 5, timeout=10,
                   message="the other caller's duplicate held")
        upstream.release("slow")
        results = [f.result() for f in firsts + waiters + [other_waiter]]
    problem(refused, 409, "in-progress", True)
    for r in results[2:]:
        assert r.status == 201 and is_replay(r), describe(r)
    assert upstream.effects(slow_hog) == 1 and upstream.effects(slow_other) == 1


@pytest.mark.parametrize("missing_scope", ["reject", "pass"])
def test_an_empty_scope_value_is_no_caller(upstream, make_envoy, wasm, missing_scope):
    """`Authorization:` sent empty is no caller: refused with `missing_scope: "reject"`, passed
    on unprotected with "pass" (the default) — never a scope that every sender of an empty
    one shares, so one of them never gets another's answer."""
    envoy = make_envoy({"missing_scope": missing_scope}, upstream.port)
    key = new_key("empty")
    first = post(envoy, key, extra={"authorization": ""})
    again = post(envoy, key, extra={"authorization": ""})
    if missing_scope == "reject":
        problem(first, 401, "scope-missing", False)
        assert upstream.effects(key) == 0
        return
    assert first.status == 201 and not is_replay(first), describe(first)
    assert again.status == 201 and not is_replay(again), "not another empty sender's answer"
    assert upstream.effects(key) == 2
    assert plugin_counters(envoy)["scope_missing"] == 2


@pytest.mark.parametrize("path", ["//v1/payments", "/v1//payments", "/v1/./payments",
                                  "/x/../v1/payments"])
def test_a_rule_holds_for_a_path_envoy_did_not_normalize(upstream, make_envoy, wasm, path):
    """A rule that requires a key on `/v1/payments`: the same path written with doubled
    slashes or dot segments is held to it too, on an Envoy that does not normalize paths."""
    envoy = make_envoy({"routes": [{"match": {"prefix": "/v1/payments"}, "require_key": True}]},
                       upstream.port)
    problem(post(envoy, None, path=path), 400, "missing-key", False)
    assert post(envoy, None, path="/v2/payments").status == 201, "other paths are not held to it"


def test_invented_identities_cannot_fill_a_fleets_etcd(upstream, make_envoy, wasm):
    """Two Envoys on one etcd (24 MiB quota, 2 MiB write budget each) and 1,200 invented
    identities with 32 KiB answers: the unknown callers are judged together, so past each
    Envoy's budget their new keys get 429; etcd never raises its quota alarm, and the
    established caller's new keys go on."""
    etcd = Etcd(extra_args=["--quota-backend-bytes", str(24 << 20)])
    try:
        store = {"kind": "etcd", "cluster": "etcd", "write_budget_bytes": 2 << 20}
        config = {"store": store, "max_response_bytes": 64 << 10}
        envoys = [make_envoy(config, upstream.port, extra_clusters=[etcd_cluster(etcd.port)])
                  for _ in range(2)]
        # Established: each worker of each Envoy has seen the caller claim at least twice
        # (16 connections an Envoy, spread over its 2 workers by the kernel).
        warm = [post(e, new_key("est"), extra=ESTABLISHED) for e in envoys for _ in range(16)]
        assert all(w.status == 201 for w in warm), [describe(w) for w in warm]
        identities = invented(1_200)
        for extra in identities:
            extra["x-body-bytes"] = str(32 << 10)
        flood = [new_key("fleet") for _ in identities]
        answers = run_concurrently(lambda i: post(envoys[i % 2], flood[i], extra=identities[i]),
                                   len(flood), max_workers=8, timeout=600)
        served = [a for a in answers if a.status == 201]
        refused = [a for a in answers if a.status == 429]
        others = [describe(a) for a in answers if a.status not in (201, 429)]
        assert not others, others[:3]
        assert refused, f"{len(served)} served, none refused"
        for a in refused[:20]:
            problem(a, 429, "share-full", True, retry_after=None)
        alarms = etcd.call("/v3/maintenance/alarm", {"action": "GET"}).get("alarms", [])
        assert not alarms, f"etcd raised {alarms}"
        # Each Envoy stops the flood within about 64 writes past its budget (docs/fleet.md).
        assert len(served) <= 2 * ((2 << 20) // (32 << 10) + 64 + 2), f"{len(served)} served"
        for e in envoys:
            for _ in range(8):
                again = post(e, new_key("est"), extra=ESTABLISHED)
                assert again.status == 201 and not is_replay(again), describe(again)
        size = int(etcd.call("/v3/maintenance/status", {})["dbSize"])
        print(f"fleet: {len(served)} served, {len(refused)} refused 429, etcd {size} bytes, "
              f"no alarm; the established caller's new keys served on both Envoys")
    finally:
        etcd.close()
