"""Fencing tokens (docs/behaviour.md §3.9): every first call carries `fencing_header` with a token that grows
with every later claim of its key; the client's own value never reaches the upstream. The
upstream (tests/upstream.py, `x-fence`) commits an effect only if its token is at least the
largest one committed for the key, as a payment service keeping the largest token would.
"""

import signal
import threading
import time
import uuid

import pytest

import e2e_util
from test_fleet import HOST, etcd, fleet_config, retry_until_final  # noqa: F401 (fixture)
from etcd_util import cluster as etcd_cluster
from harness import Envoy, wait_until

FORGED = "99999999999999999"


def post(envoy, key, **kw):
    return e2e_util.post(envoy, key, body=b'{"amount":10}', host=HOST, timeout=20,
                         extra={"X-Fence": FORGED, **kw.pop("extra", {})}, **kw)


def log_of(upstream, key):
    return [e for e in upstream.snapshot()["log"] if e["key"] == key]


@pytest.mark.parametrize("forward", ["detached", "router"])
def test_first_calls_carry_growing_tokens_never_the_clients(wasm, upstream, forward):
    envoy = Envoy({"forward": forward, "fencing_header": "x-fence"}, upstream.port)
    try:
        key = uuid.uuid4().hex
        failed = post(envoy, key, x_status=503)  # released: the retry is a new claim
        assert failed.status == 503
        done = post(envoy, key)
        assert done.status == 201
        tokens = [e["fence"] for e in log_of(upstream, key)]
        assert len(tokens) == 2 and FORGED not in map(str, tokens), tokens
        assert 0 < tokens[0] < tokens[1], tokens
        replay = post(envoy, key)
        assert replay.header("idempotent-replayed") == "true" and replay.body == done.body
        # A request the plugin does not cover (PUT) loses the client's value all the same.
        other = uuid.uuid4().hex
        assert e2e_util.post(envoy, other, method="PUT", host=HOST,
                             extra={"X-Fence": "7"}).status == 201
        assert [e.get("fence") for e in log_of(upstream, other)] == [None]
        assert upstream.snapshot()["committed"] == {key: 2}
    finally:
        envoy.stop()


@pytest.mark.parametrize("forward", ["detached", "router"])
def test_an_owner_paused_past_its_lease_is_fenced_off_by_the_takeover(wasm, upstream, etcd,
                                                                       forward):
    """Envoy A claims and sends the call, then stops (SIGSTOP: a long GC, a VM migration)
    past its lease; B's retry takes the key over and commits with a larger token; A resumes
    and its call, answered later, is refused by the upstream. Exactly one effect commits, and
    every retry then gets B's answer."""
    config = fleet_config(forward=forward, fencing_header="x-fence")
    clusters = [etcd_cluster(etcd.port)]
    a = Envoy(config, upstream.port, extra_clusters=clusters)
    b = Envoy(config, upstream.port, extra_clusters=clusters)
    resumed = False
    try:
        key = uuid.uuid4().hex
        late = {}
        t = threading.Thread(target=lambda: late.setdefault("r", post(a, key, x_delay_ms=6000)))
        t.start()
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="A's call upstream")
        a.kill(signal.SIGSTOP)
        stopped_at = time.time()
        assert post(b, key).status == 409, "A's mark still holds the key"
        taken = retry_until_final(b, key, deadline_s=10)
        print(f"taken over {time.time() - stopped_at:.1f}s after A stopped (lease_ms 3000)")
        assert taken.status == 201 and taken.header("idempotent-replayed") is None
        a.kill(signal.SIGCONT)
        resumed = True
        t.join(20)
        assert late["r"].status == 409 and b'"fenced"' in late["r"].body, e2e_util.describe(late["r"])
        log = log_of(upstream, key)
        assert [e["outcome"] for e in log] == ["fenced", "answered"], log
        assert log[0]["fence"] < log[1]["fence"], log
        snapshot = upstream.snapshot()
        assert (snapshot["effects"][key], snapshot["committed"][key], snapshot["fenced"][key]) == (2, 1, 1)
        for envoy in (a, b):
            again = retry_until_final(envoy, key, deadline_s=5)
            assert again.header("idempotent-replayed") == "true" and again.body == taken.body
        wait_until(lambda: a.stat("wasmcustom.idempotency.owner_lost") >= 1, timeout=5,
                   message="A learns it lost the key")
    finally:
        if not resumed:
            a.kill(signal.SIGCONT)
        a.stop()
        b.stop()
