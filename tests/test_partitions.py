"""Fleet mode under real network faults (docs/behaviour.md §3.4, §3.8, §3.9; docs/fleet.md): a 3-member
etcd cluster and two Envoys, each in its own Linux network namespace (tests/netns_util.py).

- the etcd leader is SIGKILLed in the middle of a bounded retry storm;
- one Envoy is cut off the etcd net (its veth down) during a call, during its completion,
  and for longer than the lease;
- every etcd member is SIGSTOPped, then continued;
- tests/chaos.py's storm runs on a 3-member etcd (on 127.0.0.1) whose leader is SIGKILLed.

The Envoys' `etcd` cluster is netns_util.etcd_cluster(): HTTP/2, the three members, an
active gRPC health check (0.5 s interval, 1 s timeout, unhealthy after 1 failure, healthy
after 1 success). IDEM_PARTITIONS_ETCD_CLUSTER='{"health_check": false}' (JSON of its
keyword arguments) runs the same tests with another cluster, for measurements.

Needs root and iproute2 (fails otherwise). Each test builds its own network and cleans it
up (namespaces deleted, processes stopped by PID), even when it fails; with IDEM_KEEP_TMP set
the logs are kept, and on a failure the Envoys' and etcd's logs are copied to
/tmp/idem-partitions-<test>-<time>/ and the path is printed.
"""

import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

import e2e_util
import netns_util
from harness import wait_until
from netns_util import EtcdCluster, Net, NsEnvoy, NsUpstream, etcd_cluster, http_to

HOST = "api.example"
BODY = b'{"amount":10}'
LEASE_MS = 3000
TIMEOUT_MS = 1000
FENCE = "x-fence"
PLUGIN = {"lease_ms": LEASE_MS, "fencing_header": FENCE,
          "store": {"kind": "etcd", "cluster": "etcd", "timeout_ms": TIMEOUT_MS}}

# The etcd cluster's options (netns_util.etcd_cluster), for measurements only: e.g.
# IDEM_PARTITIONS_ETCD_CLUSTER='{"health_check": false}' shows what the health check buys.
CLUSTER_OPTIONS = json.loads(os.environ.get("IDEM_PARTITIONS_ETCD_CLUSTER") or "{}")

@pytest.fixture(autouse=True)
def network_namespaces():
    """Fails, never skips: partitions untested would leave CI green with fleet mode untried."""
    if not netns_util.netns_available():
        pytest.fail("needs root, iproute2 (make tools installs it) and network namespaces")


class Fleet:
    def __init__(self, net, etcd, upstream, a, b):
        self.net, self.etcd, self.upstream, self.a, self.b = net, etcd, upstream, a, b


@pytest.fixture
def fleet(request, wasm):
    net = Net()
    etcd = upstream = None
    envoys = []
    try:
        etcd = EtcdCluster(net)
        upstream = NsUpstream(net)
        cluster = etcd_cluster(etcd.endpoints, **CLUSTER_OPTIONS)
        nodes = [net.add_node("a", front=11, etcd=141), net.add_node("b", front=12, etcd=142)]
        # Both Envoys compile the module at once (about 1 s each on this machine).
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(NsEnvoy, node, PLUGIN, upstream, cluster, port=10001 + i,
                                   admin_port=19001 + i) for i, node in enumerate(nodes)]
            errors = []
            for f in futures:
                try:
                    envoys.append(f.result())
                except Exception as exc:  # noqa: BLE001 - the other one is stopped below
                    errors.append(exc)
            if errors:
                raise errors[0]
        # Every Envoy's health checker has seen every member once.
        wait(lambda: all(set(e.etcd_hosts().values()) == {"healthy"} for e in envoys),
                      10, "etcd members healthy in both Envoys")
        yield Fleet(net, etcd, upstream, *envoys)
    finally:
        # Each step on its own: one that fails must not leave the others' processes or
        # namespaces behind.
        report = getattr(request.node, "rep_call", None)
        steps = [lambda: keep_logs(request.node.name, envoys, etcd)] \
            if report is not None and report.failed else []
        steps += [e.stop for e in envoys]
        steps += [upstream.stop] if upstream is not None else []
        steps += [etcd.close] if etcd is not None else []
        steps.append(net.close)
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - reported, the next step still runs
                print(f"teardown step failed: {exc!r}")


def wait(predicate, timeout, message):
    return wait_until(predicate, timeout, interval=0.1, message=message)


def keep_logs(test_name, envoys, etcd):
    where = f"/tmp/idem-partitions-{re.sub(r'[^A-Za-z0-9_.-]', '_', test_name)}-{int(time.time())}"
    os.makedirs(where, exist_ok=True)
    for e in envoys:
        if os.path.exists(e.log_path):
            shutil.copy(e.log_path, os.path.join(where, f"envoy-{e.node.name}.log"))
        if e.alive():
            try:
                with open(os.path.join(where, f"envoy-{e.node.name}-stats.json"), "w") as f:
                    json.dump(e.stats(), f, indent=1)
            except Exception:  # noqa: BLE001 - a dead Envoy has no stats
                pass
        lines = [ln for ln in e.log_text().splitlines()
                 if re.search(r"\]\[(wasm|warning|error|critical)\]", ln)]
        print(f"--- envoy {e.node.name} log (wasm, warnings, errors), last 60 ---\n"
              + "\n".join(lines[-60:]))
    if etcd is not None:
        for m in etcd.members:
            if os.path.exists(m.log_path):
                shutil.copy(m.log_path, os.path.join(where, f"etcd-{m.name}.log"))
    print(f"logs kept in {where}")


# --- the client ---------------------------------------------------------------------------


def post(envoy, key, timeout=15, **more):
    """One POST with the key to `envoy` (a NsEnvoy), more headers as keywords
    (x_delay_ms=1500 sends x-delay-ms: 1500)."""
    extra = [(name.replace("_", "-"), str(value)) for name, value in more.items()]
    headers = e2e_util.key_headers(key, extra, host=HOST)
    return http_to(envoy.host, envoy.port, "POST", "/payments", headers, BODY, timeout=timeout)


def slug(resp):
    """The plugin's problem type without its prefix ("in-progress", "store-unavailable"), or
    None for any other answer."""
    if resp.header("content-type") != "application/problem+json":
        return None
    return resp.json().get("type", "").removeprefix(e2e_util.PROBLEM_PREFIX)


def retry_until_2xx(envoys, key, deadline_s, sleep_s=0.1, max_attempts=200, **more):
    """Retries on 409 in-progress and 503 store-unavailable (as a client honouring
    Retry-After would, faster), alternating over `envoys`; returns (final, [responses])."""
    seen = []
    end = time.monotonic() + deadline_s
    for attempt in range(max_attempts):
        r = post(envoys[attempt % len(envoys)], key, **more)
        seen.append(r)
        if 200 <= r.status < 300 or time.monotonic() > end:
            return r, seen
        if slug(r) not in ("in-progress", "store-unavailable"):
            return r, seen
        time.sleep(sleep_s)
    return seen[-1], seen


def effect_of(resp):
    return resp.json()["effect"]


def delta(after, before, name):
    return after.get(name, 0) - before.get(name, 0)


# --- 1. the etcd leader dies in the middle of a retry storm -----------------------------


THREADS, KEYS_PER_THREAD = 8, 40


def test_leader_killed_in_a_retry_storm_loses_no_answer_and_duplicates_no_effect(fleet):
    a, b, etcd, upstream = fleet.a, fleet.b, fleet.etcd, fleet.upstream
    run = uuid.uuid4().hex[:8]
    keys = [[f"{run}-{t}-{i}" for i in range(KEYS_PER_THREAD)] for t in range(THREADS)]
    results = {}   # key -> (final response, [(t, envoy, status, slug)])
    errors = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 45

    def client(t):
        for i, key in enumerate(keys[t]):
            attempts = []
            final = None
            for n in range(200):
                envoy = (a, b)[(i + n) % 2]
                try:
                    r = post(envoy, key, x_delay_ms=100)
                except OSError as exc:  # a client timeout: retried like a 503
                    attempts.append((time.monotonic(), envoy.node.name, "exc", repr(exc)))
                    continue
                attempts.append((time.monotonic(), envoy.node.name, r.status, slug(r)))
                if 200 <= r.status < 300:
                    final = r
                    break
                if slug(r) not in ("in-progress", "store-unavailable") \
                        or time.monotonic() > stop_at:
                    break
                time.sleep(0.1)
            with lock:
                results[key] = (final, attempts)
                if final is None:
                    errors.append((key, attempts[-5:]))

    leader = etcd.leader()
    assert leader is not None
    started = time.monotonic()
    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(client, t) for t in range(THREADS)]
        # In the middle: about a third of the keys done.
        wait(lambda: len(results) >= THREADS * KEYS_PER_THREAD // 3, 20,
                      "a third of the storm")
        killed_at = time.monotonic()
        leader.signal(signal.SIGKILL)
        survivors = [m for m in etcd.members if m is not leader]
        new_leader = wait(lambda: etcd.leader(survivors), 15, "a new leader")
        elected_at = time.monotonic()
        for f in futures:
            f.result(timeout=60)
    storm_s = time.monotonic() - started
    assert not errors, errors[:5]

    all_keys = [k for ks in keys for k in ks]
    attempts = [x for k in all_keys for x in results[k][1]]
    unavailable = [x for x in attempts if x[3] == "store-unavailable"]
    conflicts = [x for x in attempts if x[3] == "in-progress"]
    others = [x for x in attempts
              if not (200 <= x[2] < 300 if isinstance(x[2], int) else False)
              and x[3] not in ("store-unavailable", "in-progress")]
    window = (f"{min(x[0] for x in unavailable) - killed_at:+.2f}s .. "
              f"{max(x[0] for x in unavailable) - killed_at:+.2f}s") if unavailable else "-"
    replayed_finals = [k for k in all_keys
                       if results[k][0].header("idempotent-replayed") == "true"]
    print(f"storm: {len(all_keys)} keys, {len(attempts)} requests in {storm_s:.1f}s; "
          f"leader {leader.name} killed, {new_leader.name} leader "
          f"{elected_at - killed_at:.2f}s later; 503 store-unavailable: {len(unavailable)} "
          f"(from {window} of the kill), 409 in-progress: {len(conflicts)}, "
          f"other non-2xx/exceptions: {len(others)}; finals that were replays: "
          f"{len(replayed_finals)}")
    for name, envoy in (("a", a), ("b", b)):
        c = envoy.counters()
        print(f"envoy {name}: " + ", ".join(f"{k} {c.get(k, 0)}" for k in (
            "claimed", "replayed", "conflict", "store_error", "completion_unacknowledged",
            "owner_lost", "expired_takeover")) + f"; etcd hosts {envoy.etcd_hosts()}")
    assert others == [], others[:10]
    # The dead member stops getting requests (the cluster's health check): no 503 later than
    # 3 s after the new leader's election (the plugin's backoff is at most ~2 s per VM).
    late = [round(x[0] - elected_at, 2) for x in unavailable if x[0] > elected_at + 3.0]
    assert late == [], f"503s this long after the election: {late[:10]} (of {len(late)})"

    # No lost answer: every client ended with the key's one effect, original or replayed.
    effects = upstream.effects()
    wrong = {k: effects.get(k, 0) for k in all_keys if effects.get(k, 0) != 1}
    assert wrong == {}, f"keys whose effect count is not 1: {wrong}"
    for k in all_keys:
        body = results[k][0].json()
        assert body["key"] == k and body["effect"] == 1, (k, body)

    # No key stuck: once the new leader is there, every key replays on both Envoys within a
    # few seconds, byte for byte what its client got.
    settle_started = time.monotonic()

    def replays(k):
        out = []
        for envoy in (a, b):
            r, seen = retry_until_2xx([envoy], k, deadline_s=8)
            out.append((r, len(seen)))
        return k, out

    with ThreadPoolExecutor(8) as pool:
        checked = list(pool.map(replays, all_keys))
    settle_s = time.monotonic() - settle_started
    not_replayed = [(k, [(r.status, r.header("idempotent-replayed"), n) for r, n in out])
                    for k, out in checked
                    if any(r.header("idempotent-replayed") != "true"
                           or r.body != results[k][0].body for r, _ in out)]
    retried = sum(1 for _, out in checked for _, n in out if n > 1)
    print(f"after the storm: {2 * len(all_keys)} replays checked in {settle_s:.1f}s "
          f"({retried} needed a retry)")
    assert not_replayed == [], not_replayed[:10]
    assert all(upstream.effects(k) == 1 for k in all_keys)


# --- 2. one Envoy cut off the etcd net ----------------------------------------------------


@pytest.mark.parametrize("side", ["node", "hub"])
def test_cut_during_a_call_shorter_than_the_lease(fleet, side):
    """The link to etcd goes down while the upstream holds the call (x-delay-ms 1500) and
    comes back after 1 s (side "node": A's own end of the veth, its route goes and connects
    fail at once; "hub": the bridge's end, A's packets vanish): the client gets the
    upstream's answer, the other Envoy's retry the replay, one effect."""
    a, b, net, upstream = fleet.a, fleet.b, fleet.net, fleet.upstream
    key = uuid.uuid4().hex
    before = a.counters()
    first = {}
    sent = time.monotonic()
    t = threading.Thread(target=lambda: first.setdefault("r", post(a, key, x_delay_ms=1500)))
    t.start()
    wait(lambda: upstream.effects(key) == 1, 5, "the call at the upstream")
    net.cut(a.node, side=side)
    cut_at = time.monotonic()
    during = post(b, key)
    time.sleep(max(0.0, 1.0 - (time.monotonic() - cut_at)))
    net.restore(a.node, side=side)
    restored_at = time.monotonic()
    t.join(15)
    assert not t.is_alive()
    r = first["r"]
    answered_s = r.elapsed_s
    after = a.counters()
    replay, seen = retry_until_2xx([b], key, deadline_s=8)
    print(f"[{side}] cut {cut_at - sent:.2f}s after the call was sent, restored "
          f"{restored_at - cut_at:.2f}s later; client answered after {answered_s:.2f}s; "
          f"completion_unacknowledged "
          f"+{delta(after, before, 'completion_unacknowledged')}, store_error "
          f"+{delta(after, before, 'store_error')}; B's retry: {[x.status for x in seen]}")
    assert slug(during) == "in-progress", e2e_util.describe(during)
    assert r.status == 201 and r.header("idempotent-replayed") is None, e2e_util.describe(r)
    assert effect_of(r) == 1
    # The answer waits for the completion's acknowledgement at most 2 x timeout_ms.
    assert answered_s < 1.5 + 2 * TIMEOUT_MS / 1000 + 0.5, answered_s
    e2e_util.assert_replay_of(replay, r)
    assert upstream.effects(key) == 1
    assert upstream.snapshot()["committed"].get(key) == 1


@pytest.mark.parametrize("side", ["node", "hub"])
def test_cut_while_the_completion_is_written(fleet, side):
    """The link to etcd is down when the upstream answers (the call is held, the link cut,
    then the call released), and comes back 1 s later: the client gets the answer after at
    most 2 x timeout_ms (completion_unacknowledged), the completion is retried and lands, the
    other Envoy's retry gets 409 meanwhile and then the replay; one effect."""
    a, b, net, upstream = fleet.a, fleet.b, fleet.net, fleet.upstream
    key = uuid.uuid4().hex
    hold = "h-" + key
    before = a.counters()
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("r", post(a, key, x_hold=hold)))
    t.start()
    wait(lambda: upstream.effects(key) == 1, 5, "the call at the upstream")
    net.cut(a.node, side=side)
    cut_at = time.monotonic()
    upstream.release(hold)
    released_at = time.monotonic()
    t.join(10)
    answered_at = time.monotonic()
    assert not t.is_alive()
    during = [post(b, key)]
    time.sleep(max(0.0, 1.0 - (time.monotonic() - cut_at)))
    during.append(post(b, key))
    net.restore(a.node, side=side)
    restored_at = time.monotonic()
    replay, seen = retry_until_2xx([b], key, deadline_s=LEASE_MS / 1000 + 5)
    replayed_at = time.monotonic()
    after = a.counters()
    r = first["r"]
    print(f"[{side}] answer {answered_at - released_at:.2f}s after the upstream answered "
          f"(link down); "
          f"B before the restore: {[x.status for x in during]}; B replayed "
          f"{replayed_at - restored_at:.2f}s after the restore, after {len(seen)} tries "
          f"{[x.status for x in seen]}; A: completion_unacknowledged "
          f"+{delta(after, before, 'completion_unacknowledged')}, completed "
          f"+{delta(after, before, 'completed')}, owner_lost +{delta(after, before, 'owner_lost')}")
    assert r.status == 201 and r.header("idempotent-replayed") is None, e2e_util.describe(r)
    assert answered_at - released_at <= 2 * TIMEOUT_MS / 1000 + 0.5
    assert delta(after, before, "completion_unacknowledged") == 1
    assert all(slug(x) == "in-progress" for x in during), [e2e_util.describe(x) for x in during]
    e2e_util.assert_replay_of(replay, r)
    # The retried completion landed before the mark's deadline: nobody took the key over.
    assert delta(after, before, "owner_lost") == 0
    assert b.counters().get("expired_takeover", 0) == 0
    assert upstream.effects(key) == 1
    # A replays too.
    again, _ = retry_until_2xx([a], key, deadline_s=5)
    e2e_util.assert_replay_of(again, r)


@pytest.mark.parametrize("moment", ["call", "completion"])
def test_cut_longer_than_the_lease_lets_the_other_envoy_take_over_with_a_larger_token(
        fleet, moment):
    """docs/behaviour.md §3.5, §3.9: A is cut off etcd for 5 s (lease 3 s) while its call is held at the
    upstream ("call") or just as the upstream answers ("completion": the link goes down, then
    the call is released). A's mark is not renewed (nor, once the call has ended, meant to
    be: its completion is pending) and expires; B's retry takes the key over and runs it
    again with a larger fencing token, which the upstream commits. A's completion, retried
    after the link returns, finds the key taken over and does not overwrite B's entry; both
    Envoys then replay B's answer: two effects, no key stuck.

    "call": A's call reaches the upstream's commit after B's, with the smaller token: the
    upstream refuses it (409 fenced), one effect committed. "completion": A's call committed
    first and its client got that answer (after at most 2 x timeout_ms, unacknowledged); B's
    larger token commits too: two committed effects, and A's client holds an answer that
    differs from the replay (the documented cost of a partition longer than the lease)."""
    a, b, net, upstream = fleet.a, fleet.b, fleet.net, fleet.upstream
    key = uuid.uuid4().hex
    hold = "h-" + key
    before_a, before_b = a.counters(), b.counters()
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("r", post(a, key, x_hold=hold)))
    t.start()
    wait(lambda: upstream.effects(key) == 1, 5, "the call at the upstream")
    net.cut(a.node)
    cut_at = time.monotonic()

    def release_a():
        upstream.release(hold)    # A's call answers now, while A cannot reach etcd
        released = time.monotonic()
        t.join(10)
        assert not t.is_alive()
        return released, time.monotonic()

    if moment == "completion":
        released_at, answered_at = release_a()
    took_over, seen = retry_until_2xx([b], key, deadline_s=LEASE_MS / 1000 + 3, sleep_s=0.2)
    took_over_at = time.monotonic()
    if moment == "call":
        released_at, answered_at = release_a()
    time.sleep(max(0.0, 5.0 - (time.monotonic() - cut_at)))
    net.restore(a.node)
    restored_at = time.monotonic()
    finals = {}
    for name, envoy in (("a", a), ("b", b)):
        finals[name] = retry_until_2xx([envoy], key, deadline_s=8)
    settled_at = time.monotonic()
    # A's completion is retried once A's backoff lets a request through (up to ~2 s after
    # the link is back, per worker VM); it then finds the key taken over (owner_lost).
    wait(lambda: delta(a.counters(), before_a, "owner_lost") >= 1, 8,
                  "A's retried completion, refused by the takeover")
    lost_at = time.monotonic()
    after_a, after_b = a.counters(), b.counters()
    snapshot = upstream.snapshot()
    log = [e for e in snapshot["log"] if e["key"] == key]
    late = first["r"]
    print(f"[{moment}] B took over {took_over_at - cut_at:.2f}s after the cut ({len(seen)} tries:"
          f" {[x.status for x in seen]}); A's answer {late.status} {late.body[:60]!r} "
          f"{answered_at - released_at:.2f}s after its release; replays on both "
          f"{settled_at - restored_at:.2f}s after the restore; A's completion refused "
          f"{lost_at - restored_at:.2f}s after the restore; upstream log "
          f"{[(e['effect'], e.get('fence'), e['outcome']) for e in log]}; A: "
          f"completion_unacknowledged +{delta(after_a, before_a, 'completion_unacknowledged')}, "
          f"owner_lost +{delta(after_a, before_a, 'owner_lost')}; B: expired_takeover "
          f"+{delta(after_b, before_b, 'expired_takeover')}")
    # B's retry ran the key again once A's mark expired: effect 2.
    assert took_over.status == 201 and took_over.header("idempotent-replayed") is None, \
        e2e_util.describe(took_over)
    assert effect_of(took_over) == 2
    assert all(slug(x) == "in-progress" for x in seen[:-1]), [x.status for x in seen]
    assert took_over_at - cut_at < LEASE_MS / 1000 + 1.5
    assert delta(after_b, before_b, "expired_takeover") == 1
    # The two effects carry tokens, the later the larger.
    assert snapshot["effects"][key] == 2
    tokens = {e["effect"]: e["fence"] for e in log}
    assert tokens[2] > tokens[1], tokens
    # A's client got the upstream's own answer, within 2 x timeout_ms of it.
    assert answered_at - released_at <= 2 * TIMEOUT_MS / 1000 + 0.5
    assert delta(after_a, before_a, "completion_unacknowledged") == 1
    if moment == "call":
        # ... which refused the late call by its fence: one effect committed.
        assert late.status == 409 and late.header("content-type") == "application/json", \
            e2e_util.describe(late)
        assert late.json() == {"fenced": str(tokens[1]), "largest": tokens[2]}
        assert snapshot["committed"].get(key) == 1 and snapshot["fenced"].get(key) == 1
    else:
        # ... its effect 1, committed before B's: both committed.
        assert late.status == 201 and late.header("idempotent-replayed") is None, \
            e2e_util.describe(late)
        assert effect_of(late) == 1
        assert snapshot["committed"].get(key) == 2 and not snapshot["fenced"].get(key)
    # A's completion, retried once the link was back, found the key taken over: not written.
    assert delta(after_a, before_a, "owner_lost") == 1
    # No key stuck: both Envoys replay B's answer.
    for name in ("a", "b"):
        r, _ = finals[name]
        e2e_util.assert_replay_of(r, took_over)
    assert upstream.effects(key) == 2


# --- 3. every etcd member stopped ---------------------------------------------------------


def test_all_members_stopped_then_continued(fleet):
    a, b, etcd, upstream = fleet.a, fleet.b, fleet.etcd, fleet.upstream
    seen_by_a = uuid.uuid4().hex      # completed through A: A keeps a copy
    only_b = uuid.uuid4().hex         # completed through B, never seen by A
    first_a = post(a, seen_by_a)
    first_b = post(b, only_b)
    assert first_a.status == 201 and first_b.status == 201
    time.sleep(0.3)
    for m in etcd.members:
        m.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        new = uuid.uuid4().hex
        refused = [post(a, new) for _ in range(4)]
        local = post(a, seen_by_a)
        unseen = post(a, only_b)
        time.sleep(max(0.0, 3.0 - (time.monotonic() - stopped_at)))
        later = post(b, new)
    finally:
        for m in etcd.members:
            m.signal(signal.SIGCONT)
    continued_at = time.monotonic()
    # Claims again: every worker VM of both Envoys (new connections spread over workers).
    recovered = {}

    def protected(envoy):
        probe = "probe-" + uuid.uuid4().hex
        return post(envoy, probe).status == 201 and \
            post(envoy, probe).header("idempotent-replayed") == "true"
    for name, envoy in (("a", a), ("b", b)):
        wait(lambda: all(protected(envoy) for _ in range(4)), 15,
                      f"claims on {name} after SIGCONT")
        recovered[name] = time.monotonic() - continued_at
    print("while stopped: A's new key " + ", ".join(
        f"{r.status} in {r.elapsed_s:.2f}s" for r in refused)
        + f"; A's own replay {local.status} {local.header('idempotent-replayed')} in "
          f"{local.elapsed_s:.2f}s; B's entry on A {unseen.status} in {unseen.elapsed_s:.2f}s;"
          f" B later {later.status} in {later.elapsed_s:.2f}s; claims again "
          f"{recovered['a']:.2f}s (a) and {recovered['b']:.2f}s (b) after SIGCONT; "
          f"leader {etcd.leader().name if etcd.leader() else None}")
    for r in refused + [unseen, later]:
        e2e_util.problem(r, 503, "store-unavailable", True)
    # Within about timeout_ms: a claim sent to etcd waits for its timeout; while its VM
    # backs off (100 ms doubling to 2 s) the next ones are refused at once, and the one that
    # probes after the backoff waits for its timeout again.
    assert all(r.elapsed_s < TIMEOUT_MS / 1000 + 0.5 for r in refused + [unseen, later]), \
        [r.elapsed_s for r in refused + [unseen, later]]
    assert refused[0].elapsed_s > TIMEOUT_MS / 1000 - 0.1  # the first was sent, not refused
    e2e_util.assert_replay_of(local, first_a)
    assert upstream.effects(new) == 0
    assert max(recovered.values()) < 6
    # The refused key was never run: its first claim now is the first call. A claim etcd
    # applied after its answer was lost leaves our mark until the VM's cleanup runs, which
    # waits for its background backoff (up to 2 s, as lease grants do): until then the key is
    # in progress (seen in a CI run), never replayed and never run. The checks above may all
    # have landed on one worker of A while the other still backs off after a probe that timed
    # out (up to 2 s): that one refuses at once, and a client retries.
    r, seen = retry_until_2xx([a], new, deadline_s=5)
    assert all(slug(x) in ("in-progress", "store-unavailable") for x in seen[:-1]), \
        [(x.status, slug(x)) for x in seen]
    assert r.status == 201 and r.header("idempotent-replayed") is None and effect_of(r) == 1
    e2e_util.assert_replay_of(retry_until_2xx([b], new, deadline_s=5)[0], r)
    # A worker of B whose lease grant failed just before SIGCONT backs off (up to 2 s) and
    # refuses at once meanwhile (seen in a CI run on a loaded machine): a client retries.
    replay, seen = retry_until_2xx([b], seen_by_a, deadline_s=5)
    assert all(slug(x) == "store-unavailable" for x in seen[:-1]), [(x.status, slug(x)) for x in seen]
    e2e_util.assert_replay_of(replay, first_a)


# --- 4. tests/chaos.py's storm on a 3-member etcd, its leader killed ------------------------


def test_chaos_storm_on_three_members_with_the_leader_killed(wasm):
    """chaos.py's retry storm (faults at the upstream, clients that give up or hang up, an
    Envoy SIGKILL and restart) with the store a 3-member etcd on 127.0.0.1 behind the
    health-checked cluster, and the etcd leader SIGKILLed a quarter into the storm. Every
    verdict of chaos.py holds, except that 503 store-unavailable is allowed, and only from
    the leader's kill until 3 s after the new leader was elected."""
    import chaos
    from harness import Envoy

    class ThreeMembers(chaos.Storm):
        def start(self):
            self.cluster = EtcdCluster(None)
            self.upstream = chaos.ChaosUpstream()
            follower = next(m for m in self.cluster.members if m is not self.cluster.leader())
            self.watcher = chaos.EtcdWatcher(follower.port)  # survives the leader's kill
            self.watcher.start()
            self.watcher.ready.wait(2)
            self.envoy = Envoy(self.plugin_config(), self.upstream.port, concurrency=2,
                               extra_clusters=[etcd_cluster(self.cluster.endpoints,
                                                             **CLUSTER_OPTIONS)])
            self.vms_at_start = chaos.active_vms(self.envoy)

        def killer(self):
            leader_at, envoy_at = self.duration / 4, self.kill_at
            if self.stop.wait(leader_at):
                return
            leader = self.cluster.leader()
            self.leader_killed = time.time()
            leader.signal(signal.SIGKILL)
            survivors = [m for m in self.cluster.members if m is not leader]
            try:
                wait(lambda: self.cluster.leader(survivors), 15, "a new leader")
            finally:
                self.leader_elected = time.time()
            self.log(f"[{self.leader_killed - self.t_start:6.1f}s] etcd leader {leader.name} "
                     f"killed; new leader after {self.leader_elected - self.leader_killed:.2f}s")
            self.kill_at = max(0.0, envoy_at - (time.time() - self.t_start))
            super().killer()

        def close(self):
            try:
                super().close()
            finally:
                self.raft = self.cluster.raft_events()
                for m in self.cluster.members:
                    if os.path.exists(m.log_path):
                        shutil.copy(m.log_path, os.path.join(self.keep_logs, f"etcd-{m.name}.log"))
                self.cluster.close()

    duration = 16.0
    # The run's logs (Envoy before the kill and at the end, the etcd members), kept only if
    # the test fails.
    logs = tempfile.mkdtemp(prefix="idem-partitions-chaos-")
    storm = ThreeMembers(store="etcd", duration=duration, clients=16, kill_at=duration * 0.6,
                         log=print, keep_logs=logs)
    try:
        result = storm.run()
        check_three_member_storm(storm, result)
    except BaseException:
        print(f"logs kept in {logs}")
        raise
    shutil.rmtree(logs, ignore_errors=True)


def check_three_member_storm(storm, result):
    print(result.report())
    # When etcd had no leader: from the kill to the new leader, and any later election (not
    # seen so far, but the two survivors on 2 busy cores may miss a heartbeat; a member
    # notices a lost leader up to one election timeout, 1 s, late). A 503 is allowed from
    # then until 3 s after the next leader, and at no other time.
    after = [e for e in storm.raft if e[0] > storm.leader_killed]
    windows = [(storm.leader_killed, storm.leader_elected + 3.0)]
    for term in sorted({term for _, _, _, term in after}):
        lost = [t for t, _, kind, tm in after if tm == term and kind == "lost"]
        elected = [t for t, _, kind, tm in after if tm == term and kind == "elected"]
        if lost and elected and min(lost) > storm.leader_elected:
            windows.append((min(lost) - 1.0, max(elected) + 3.0))
    unavailable = [a for a in storm.attempts
                   if a.status == 503 and a.problem == "store-unavailable"]
    outside = [(round(a.t0 - storm.leader_killed, 2), round(a.t1 - storm.leader_killed, 2))
               for a in unavailable if not any(w0 <= a.t1 <= w1 for w0, w1 in windows)]
    print(f"503 store-unavailable: {len(unavailable)}, {len(outside)} outside the leaderless "
          f"windows (+3 s) " + ", ".join(f"+{w0 - storm.leader_killed:.1f}s..+"
                                          f"{w1 - storm.leader_killed:.1f}s" for w0, w1 in windows)
          + "; raft events after the kill: "
          + ", ".join(f"+{t - storm.leader_killed:.2f}s {m} {kind} term {term}"
                      for t, m, kind, term in after))
    assert result.restart_s is not None and result.kill_error is None, result.kill_error
    assert result.keys > 50 and result.successes > result.keys / 2, result.summary()
    assert not result.unexplained, "\n".join(result.details) or result.unexplained[:10]
    assert not result.lost, result.lost[:10]
    assert set(result.plugin_5xx) <= {"503 store-unavailable"}, result.plugin_5xx
    assert outside == [], outside[:10]
    assert not result.other_5xx, result.other_5xx
    assert not result.unexpected, result.unexpected_examples[:10]
    assert not result.stuck, result.stuck[:10]
    assert not result.vm_failures, result.vm_failures[:10]
