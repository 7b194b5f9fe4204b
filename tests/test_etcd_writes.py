"""What requests cost etcd (docs/fleet.md): a duplicate of a call in progress (409) and a replay
without a local copy read the key (a Range) and write nothing, so they add no raft proposal;
only a claim, a renewal, a completion and a release write. Measured on a real etcd with its
own counters (/metrics): `etcd_server_proposals_committed_total`, the gRPC requests it handled
by method (the JSON gateway's included: it calls etcd's gRPC server), and its lease grants and
revocations, which are proposals too (a VM's lease rotates, an old one expires).

The first call's cost (etcd requests and median latency) is printed; with IDEM_WASM_BASELINE
naming another build, that build is measured beside this one in the same run.
"""

import os
import re
import statistics
import threading
import time
import urllib.request
import uuid

import pytest

from e2e_util import plugin_counters, post
from etcd_util import Etcd, cluster as etcd_cluster
from harness import run_concurrently, wait_until

# Long enough that no renewal and no VM lease rotation falls in a storm (a renewal every
# LEASE_MS/4, a VM lease of 2 x LEASE_MS rotated every quarter of it); they are counted anyway.
LEASE_MS = 30_000
STORM = 200
FIRST_CALL_DELAY_MS = 3_000


def config(api, local_replays):
    store = {"kind": "etcd", "cluster": "etcd", "api": api, "timeout_ms": 1000, "local_replays": local_replays}
    return {"lease_ms": LEASE_MS, "store": store}


@pytest.fixture
def etcd():
    server = Etcd()
    yield server
    server.close()


def etcd_metrics(etcd):
    """The counters of etcd's /metrics this file uses."""
    with urllib.request.urlopen(f"http://127.0.0.1:{etcd.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {"proposals": 0.0, "granted": 0.0, "revoked": 0.0, "Range": 0.0, "Txn": 0.0, "LeaseGrant": 0.0}
    for line in text.splitlines():
        if line.startswith("etcd_server_proposals_committed_total "):
            out["proposals"] = float(line.split()[-1])
        elif line.startswith("etcd_debugging_lease_granted_total "):
            out["granted"] = float(line.split()[-1])
        elif line.startswith("etcd_debugging_lease_revoked_total "):
            out["revoked"] = float(line.split()[-1])
        elif line.startswith("grpc_server_handled_total{"):
            method = re.search(r'grpc_method="([^"]+)"', line)
            if method and method.group(1) in out:
                out[method.group(1)] += float(line.split()[-1])
    return {k: int(v) for k, v in out.items()}


def etcd_cpu_us(etcd):
    """etcd's CPU time so far, in µs: the sum over its threads' schedstat (ns). Over a window
    it includes etcd's own background work (raft ticks, its timers): a comparison, not a
    per-request cost."""
    total = 0
    task_dir = f"/proc/{etcd.proc.pid}/task"
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that just ended
    return total // 1000


def delta(before, after):
    return {k: after[k] - before[k] for k in before}


def renewals_possible(claimed_at, until):
    """How many renewals of a mark claimed at `claimed_at` can fall before `until`: one every
    LEASE_MS/4 from the claim, the timer checking every LEASE_MS/16."""
    quarter, tick = LEASE_MS / 4000, LEASE_MS / 16000
    return max(0, int((until + tick - claimed_at) // quarter))


def accounted(d):
    """Every proposal is a lease grant, a lease revocation or a transaction (each of the
    plugin's transactions writes in its success branch): the proposals nothing explains."""
    return d["proposals"] - d["granted"] - d["revoked"] - d["Txn"]


@pytest.mark.parametrize("api", ["grpc", "json"])
def test_duplicates_and_replays_add_no_raft_proposal(wasm, upstream, etcd, make_envoy, api):
    envoy = make_envoy(config(api, local_replays=False), upstream.port,
                       extra_clusters=[etcd_cluster(etcd.port, api=api)])
    # Warm: each worker's leases granted, connections to etcd open.
    for _ in range(6):
        assert post(envoy, uuid.uuid4().hex).status == 201
    key = uuid.uuid4().hex
    first = {}
    sent_at = time.monotonic()
    t = threading.Thread(target=lambda: first.setdefault("r", post(envoy, key, x_delay_ms=FIRST_CALL_DELAY_MS)))
    t.start()
    wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first call upstream")

    # The storm of duplicates while the first call runs: every one a 409.
    before, cpu, started = etcd_metrics(etcd), etcd_cpu_us(etcd), time.monotonic()
    dups = run_concurrently(lambda i: post(envoy, key), STORM, max_workers=20)
    ended = time.monotonic()
    during = delta(before, etcd_metrics(etcd))
    during["etcd_cpu_us"] = etcd_cpu_us(etcd) - cpu
    statuses = sorted({r.status for r in dups})
    renewals = renewals_possible(sent_at, ended)
    print(f"\n[{api}] {STORM} duplicates in {ended - started:.2f} s (statuses {statuses}): etcd {during}; "
          f"owner's renewals possible in the window: {renewals}")
    assert statuses == [409], statuses
    assert ended - sent_at < FIRST_CALL_DELAY_MS / 1000, "the storm outlasted the first call"
    assert during["Range"] == STORM, during
    assert during["Txn"] <= renewals, during  # only the owner writes: its renewals
    assert accounted(during) == 0, during

    t.join()
    assert first["r"].status == 201

    # The storm of replays after it completed, without local copies: each one asks etcd.
    before, cpu, started = etcd_metrics(etcd), etcd_cpu_us(etcd), time.monotonic()
    replays = run_concurrently(lambda i: post(envoy, key), STORM, max_workers=20)
    ended = time.monotonic()
    after = delta(before, etcd_metrics(etcd))
    after["etcd_cpu_us"] = etcd_cpu_us(etcd) - cpu
    print(f"[{api}] {STORM} replays in {ended - started:.2f} s: etcd {after}")
    assert all(r.status == 201 and r.header("idempotent-replayed") == "true" for r in replays)
    assert all(r.body == first["r"].body for r in replays)
    assert after["Range"] == STORM, after
    assert after["Txn"] == 0, after  # the owner completed before its answer left
    assert accounted(after) == 0, after
    assert upstream.effects(key) == 1
    counters = plugin_counters(envoy)
    assert counters.get("local_replays", 0) == 0 and counters.get("store_error", 0) == 0, counters


def first_calls(envoy, etcd, n, times, counts):
    """`n` sequential first calls on `envoy`: their times (ms) and what etcd handled."""
    before = etcd_metrics(etcd)
    rq_before = envoy.stat("cluster.etcd.upstream_rq_total")
    cpu_before = etcd_cpu_us(etcd)
    for _ in range(n):
        t0 = time.perf_counter()
        r = post(envoy, uuid.uuid4().hex)
        times.append((time.perf_counter() - t0) * 1000)
        assert r.status == 201 and r.header("idempotent-replayed") is None, r.status
    d = delta(before, etcd_metrics(etcd))
    d["etcd_cpu_us"] = etcd_cpu_us(etcd) - cpu_before
    d["envoy_rq"] = envoy.stat("cluster.etcd.upstream_rq_total") - rq_before
    for k, v in d.items():
        counts[k] = counts.get(k, 0) + v


def test_a_first_call_reads_claims_and_completes(wasm, upstream, etcd, make_envoy):
    """A first call: one Range, then the claim and the completion (two transactions, two
    proposals). 100 calls, in blocks of 10 alternating with the baseline build if one is
    given (IDEM_WASM_BASELINE), so that both share the machine's noise."""
    builds = [("this build", wasm)]
    baseline = os.environ.get("IDEM_WASM_BASELINE")
    if baseline:
        builds.append(("baseline " + os.path.basename(baseline), os.path.abspath(baseline)))
    envoys = {name: make_envoy(config("grpc", local_replays=True), upstream.port, wasm=path,
                               extra_clusters=[etcd_cluster(etcd.port)])
              for name, path in builds}
    times = {name: [] for name, _ in builds}
    counts = {name: {} for name, _ in builds}
    for name, envoy in envoys.items():  # warm up
        first_calls(envoy, etcd, 20, [], {})
    blocks, per_block = 10, 10
    for b in range(blocks):
        order = list(envoys.items()) if b % 2 == 0 else list(reversed(envoys.items()))
        for name, envoy in order:
            first_calls(envoy, etcd, per_block, times[name], counts[name])
    n = blocks * per_block
    for name, _ in builds:
        c = counts[name]
        per_call = {k: round(v / n, 2) for k, v in c.items()}
        print(f"\nfirst call, {name}: median {statistics.median(times[name]):.2f} ms "
              f"(p90 {sorted(times[name])[int(n * 0.9)]:.2f} ms) over {n}; etcd per first call {per_call}")
    mine = counts["this build"]
    assert (mine["Range"], mine["Txn"]) == (n, 2 * n), mine
    assert accounted(mine) == 0, mine
