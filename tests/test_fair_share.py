"""Fair share (docs/how-it-works.md, "Fair share"): one caller's flood of new keys, or of large
answers, evicts that caller's own answers; another caller's stored answers all replay, one
upstream effect each. The figures (evicted_below_share, the heaviest caller's share) and the
log line that names the flooding caller by its tag, never its scope."""

import subprocess
import sys
from pathlib import Path

from e2e_util import assert_replay_of, describe, is_replay, new_key, plugin_counters, post
from etcd_util import Etcd, cluster as etcd_cluster
from harness import run_concurrently, wait_until

ROOT = Path(__file__).resolve().parent.parent
QUIET = {"authorization": "Bearer quiet-tenant"}
FLOOD = {"authorization": "Bearer flooding-tenant"}


def gauge(envoy, name):
    return envoy.stat(f"wasmcustom.idempotency.{name}")


def caller_tag(envoy, scope):
    """The tag `envoy` logs for `scope`: keyed with the secret it logged when it made it."""
    key = envoy.wait_log(r"keyed with this Envoy's secret ([0-9a-f]{32})", timeout=5).group(1)
    out = subprocess.run([sys.executable, str(ROOT / "tools/caller_tag.py"), "--key", key, scope],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def flood_then_retry(envoy, upstream, capacity):
    """The quiet caller stores 64 answers, the flooder sends 8 × `capacity` new keys; then the
    quiet caller's 64 retries and the flooder's newest 64 must replay, one effect per key.
    Returns the keys sent and the plugin's counters from just before the retries."""
    quiet = [new_key("quiet") for _ in range(64)]
    firsts = [post(envoy, k, extra=QUIET) for k in quiet]
    flood = [new_key("flood") for _ in range(8 * capacity)]
    answers = run_concurrently(lambda i: post(envoy, flood[i], extra=FLOOD), len(flood),
                               max_workers=8, timeout=300)
    before = plugin_counters(envoy)
    retries = [post(envoy, k, extra=QUIET) for k in quiet]
    newest = [post(envoy, k, extra=FLOOD) for k in flood[-64:]]

    for first in firsts + answers:
        assert first.status == 201 and not is_replay(first), describe(first)
    for first, again in zip(firsts, retries):
        assert_replay_of(again, first)
    for first, again in zip(answers[-64:], newest):
        assert_replay_of(again, first)
    effects = upstream.effects()
    assert all(effects[k] == 1 for k in quiet + flood), {k: n for k, n in effects.items() if n != 1}
    return quiet, flood, before


def test_a_flood_of_new_keys_leaves_another_callers_answers_stored(upstream, make_envoy, wasm):
    capacity = 256
    envoy = make_envoy({"capacity": capacity, "min_retention_s": 0}, upstream.port)
    quiet, flood, _ = flood_then_retry(envoy, upstream, capacity)
    counters = plugin_counters(envoy)
    # Every way taken, each new key evicted one of the flooder's own answers.
    assert counters["evicted"] == len(quiet) + len(flood) - capacity, counters
    assert counters["evicted_below_share"] == 0, counters
    # The flooder holds the rest of the table: 192 of 256 entries.
    wait_until(lambda: gauge(envoy, "heaviest_caller_entries_permille") == 750, timeout=10,
               message="the sweep's pass counts the heaviest caller")
    tag = caller_tag(envoy, FLOOD["authorization"])
    line = envoy.wait_log(rf"fair share: caller {tag} holds \d+\.\d% of the table.s entries",
                          timeout=10)
    assert "flooding-tenant" not in envoy.log_text(), "the scope itself is never logged"
    print(f"flood of {len(flood)} keys through capacity {capacity}: evicted "
          f"{counters['evicted']}, evicted_below_share {counters['evicted_below_share']}, "
          f"effective retention {gauge(envoy, 'effective_retention_ms')} ms; all "
          f"{len(quiet)} quiet answers replayed; log: "
          f"{next(l for l in envoy.log_text().splitlines() if line.group(0) in l)}")


def test_a_flood_of_large_answers_leaves_another_callers_answers_stored(upstream, make_envoy,
                                                                        wasm):
    """25 MiB of one caller's answers through a 2 MiB budget; another caller's six answers
    of 16 KiB stay."""
    budget = 2 << 20
    envoy = make_envoy({"capacity": 128, "max_store_bytes": budget, "min_retention_s": 0,
                        "max_response_bytes": 256 << 10}, upstream.port)
    small = {**QUIET, "x-body-bytes": str(16 << 10)}
    big = {**FLOOD, "x-body-bytes": str(64 << 10)}
    quiet = [new_key("quiet") for _ in range(6)]
    firsts = [post(envoy, k, extra=small) for k in quiet]
    flood = [new_key("big") for _ in range(400)]
    answers = run_concurrently(lambda i: post(envoy, flood[i], extra=big, timeout=30),
                               len(flood), max_workers=4, timeout=300)
    retries = [post(envoy, k, extra=small) for k in quiet]
    newest = [post(envoy, k, extra=big, timeout=30) for k in flood[-4:]]

    for first in firsts + answers:
        assert first.status == 201 and not is_replay(first), describe(first)
    for first, again in zip(firsts, retries):
        assert_replay_of(again, first)
    for first, again in zip(answers[-4:], newest):
        assert_replay_of(again, first)
    effects = upstream.effects()
    assert all(effects[k] == 1 for k in quiet + flood)
    counters = plugin_counters(envoy)
    assert counters["evicted_below_share"] == 0, counters
    assert 0 < gauge(envoy, "stored_bytes") <= budget
    wait_until(lambda: gauge(envoy, "heaviest_caller_bytes_permille") > 900, timeout=10,
               message="the flooder holds most bytes")
    print(f"{len(flood)} answers of 64 KiB through a {budget} B budget: evicted "
          f"{counters['evicted']}, stored {gauge(envoy, 'stored_bytes')} B, heaviest caller "
          f"{gauge(envoy, 'heaviest_caller_bytes_permille')}‰ of bytes; all six answers of "
          f"16 KiB replayed")


def test_a_flood_through_etcd_leaves_another_callers_local_copies(upstream, make_envoy, wasm):
    """The etcd store's local copies (`local_replays`) evict by the same rule: after the
    flooder's 8 × `capacity` new keys, the other caller's 64 retries all replay from this
    Envoy's copies, without asking etcd, as do the flooder's newest 64."""
    capacity = 256
    with Etcd() as etcd:
        envoy = make_envoy({"capacity": capacity,
                            "store": {"kind": "etcd", "clusters": ["etcd"], "timeout_ms": 1000}},
                           upstream.port, extra_clusters=[etcd_cluster(etcd.port)])
        quiet, flood, before = flood_then_retry(envoy, upstream, capacity)
        wait_until(lambda: plugin_counters(envoy).get("local_replays", 0)
                   >= before.get("local_replays", 0) + 128, timeout=5,
                   message="every retry replayed from a local copy")
        counters = plugin_counters(envoy)
        assert counters["local_replays"] - before.get("local_replays", 0) == 128, counters
        assert counters["evicted"] == len(quiet) + len(flood) - capacity, counters
        assert counters["evicted_below_share"] == 0, counters
        print(f"etcd, flood of {len(flood)} keys through local copies of capacity {capacity}: "
              f"evicted {counters['evicted']}, evicted_below_share "
              f"{counters['evicted_below_share']}; all {len(quiet)} quiet answers and the "
              f"flooder's newest 64 replayed from local copies")
