"""Room in a full store (docs/behaviour.md §3.4 "Room", §3.8): a flood of new keys evicts the oldest
completed entries, never the work in progress nor the next caller's new request; the byte
budget bounds what the store holds, however large the answers."""

from concurrent.futures import ThreadPoolExecutor

from e2e_util import (assert_in_progress, assert_replay_of, describe, is_replay, new_key,
                      plugin_counters, post)
from harness import run_concurrently, wait_until
from upstream import pattern_body


def gauge(envoy, name):
    return envoy.stat(f"wasmcustom.idempotency.{name}")


def test_a_flood_of_new_keys_evicts_old_answers_never_work_in_progress(upstream, make_envoy,
                                                                       wasm):
    capacity = 1024
    # Eviction as it works without the replay window (tests/test_identities.py has the window).
    envoy = make_envoy({"capacity": capacity, "min_retention_s": 0}, upstream.port)  # forward: detached
    slow = [new_key("slow") for _ in range(16)]
    held = {"x-hold": "slow-calls"}
    flood = [new_key(f"flood{i}") for i in range(4 * capacity)]
    with ThreadPoolExecutor(len(slow)) as pool:
        firsts = [pool.submit(post, envoy.port, k, extra=held, timeout=120) for k in slow]
        wait_until(lambda: all(upstream.effects(k) == 1 for k in slow), timeout=20,
                   message="the slow calls reached the upstream")
        # The flood: four times the table, one new key after the other (8 clients).
        answers = run_concurrently(lambda i: post(envoy.port, flood[i]), len(flood),
                                   max_workers=8, timeout=300)
        # After it, the calls in progress still hold their keys.
        during = [post(envoy.port, k, extra=held) for k in slow]
        # Another caller's new key is served.
        other_key = new_key("other")
        other = post(envoy.port, other_key, extra={"authorization": "Bearer another-caller"})
        upstream.release("slow-calls")
        originals = [f.result() for f in firsts]
    replays = [post(envoy.port, k, extra=held) for k in slow]
    newest = [post(envoy.port, k) for k in flood[-100:]]

    refused = [(k, describe(a)) for k, a in zip(flood, answers)
               if a.status != 201 or is_replay(a)]
    assert not refused, f"{len(refused)} new keys not served first try: {refused[:3]}"
    for resp in during:
        assert_in_progress(resp)
    assert other.status == 201 and not is_replay(other), describe(other)
    for first, again in zip(originals, replays):
        assert first.status == 201 and not is_replay(first), describe(first)
        assert_replay_of(again, first)
    for answer, again in zip(answers[-100:], newest):
        assert_replay_of(again, answer)
    effects = upstream.effects()
    assert all(effects[k] == 1 for k in slow + flood + [other_key]), \
        {k: n for k, n in effects.items() if n != 1}
    counters = plugin_counters(envoy)
    claimed = len(slow) + len(flood) + 1
    assert counters["claimed"] == claimed, counters
    # Once every way is taken, each new key evicts one completed entry: all but `capacity`.
    assert counters["evicted"] == claimed - capacity, counters
    assert counters["store_full"] == 0, counters
    assert counters["completed"] == claimed, counters
    assert gauge(envoy, "entries_completed") == capacity
    assert gauge(envoy, "entries_in_progress") == 0
    wait_until(lambda: gauge(envoy, "effective_retention_ms") > 0, timeout=5,
               message="the effective retention gauge")
    print(f"flood of {len(flood)} keys: evicted {counters['evicted']}, effective retention "
          f"{gauge(envoy, 'effective_retention_ms')} ms, stored {gauge(envoy, 'stored_bytes')} B")


def test_the_byte_budget_bounds_what_the_store_holds(upstream, make_envoy, wasm):
    """2 MiB of stored responses in 2 buckets of 1 MiB: 400 answers of 64 KiB all reach
    their clients whole, the newest replay, and Envoy's memory stays flat."""
    budget, size = 2 << 20, 64 << 10
    envoy = make_envoy({"capacity": 128, "max_store_bytes": budget,
                        "max_response_bytes": 128 << 10, "min_retention_s": 0}, upstream.port)
    big = {"x-body-bytes": str(size)}
    for _ in range(4):  # warm the VMs up: their heaps grow to hold one answer
        post(envoy.port, new_key("warm"), extra=big, timeout=30)
    rss_before = envoy.rss_bytes()
    keys = [new_key("big") for _ in range(400)]
    answers = run_concurrently(lambda i: post(envoy.port, keys[i], extra=big, timeout=30),
                               len(keys), max_workers=4, timeout=300)
    rss_after = envoy.rss_bytes()
    newest = [post(envoy.port, k, extra=big, timeout=30) for k in keys[-10:]]

    for key, answer in zip(keys, answers):
        assert answer.status == 201 and not is_replay(answer), describe(answer)
        assert answer.body == pattern_body(key, 1, size), f"{key}: the answer was altered"
    for answer, again in zip(answers[-10:], newest):
        assert_replay_of(again, answer)
    stored = gauge(envoy, "stored_bytes")
    counters = plugin_counters(envoy)
    print(f"400 answers of 64 KiB: stored {stored} B in {gauge(envoy, 'entries_completed')} "
          f"entries, evicted {counters['evicted']}, RSS +{(rss_after - rss_before) / 2**20:.1f} MiB")
    assert 0 < stored <= budget
    assert gauge(envoy, "entries_completed") <= budget // size
    assert counters["evicted"] >= len(keys) + 4 - budget // size
    assert counters["response_not_stored"] == 0
    assert rss_after - rss_before < 12 * 2**20
