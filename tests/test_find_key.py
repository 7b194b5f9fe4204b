"""docs/operations.md, "Finding one key", done for real: `idempotency-key` (src/bin) names the
etcd key (and cluster) of a key a client sent through Envoy, and that is where the entry is;
deleting an in-progress mark lets a retry run again; deleting a completed entry leaves this
Envoy's local copy replaying until its retention ends."""

import base64
import functools
import json
import subprocess
import threading
import uuid

import pytest

import e2e_util
from etcd_util import Etcd, cluster as etcd_cluster
from harness import CALLER, REPO_ROOT, Envoy, wait_until

HOST = "api.example"
# An entry as the etcd store writes it (src/encoding.rs `encode_entry`): magic `E` 2, then the
# header (state u8, token u64, key tag [16], fingerprint [16], deadline u64, age u64, size u32),
# then the stored response, body first.
HEADER_BYTES = 2 + 1 + 8 + 16 + 16 + 8 + 8 + 4
IN_PROGRESS, COMPLETED = 1, 2

post = functools.partial(e2e_util.post, body=b'{"amount":10}', host=HOST, timeout=10)


@pytest.fixture(scope="module")
def idempotency_key():
    """The tool's path, built (natively) if it is not up to date."""
    out = subprocess.run(["cargo", "build", "--quiet", "--bin", "idempotency-key", "--message-format=json"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg["target"]["name"] == "idempotency-key":
            return msg["executable"]
    pytest.fail(f"cargo built no idempotency-key: {out.stdout[-2000:]}")


def find(tool, key, clusters=None):
    """What the tool prints (--json) for this test's requests: Host api.example, scoped by the
    caller's authorization header."""
    args = [tool, "--json", "--namespace", "idem", "--host", HOST, "--scope", CALLER[1]]
    if clusters:
        args += ["--clusters", ",".join(clusters)]
    out = subprocess.run([*args, key], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def read_entry(etcd, name):
    """The value of etcd key `name` read with etcd's JSON API, or None."""
    kvs = etcd.call("/v3/kv/range", {"key": base64.b64encode(name.encode()).decode()}).get("kvs", [])
    return base64.b64decode(kvs[0]["value"]) if kvs else None


def delete_entry(etcd, name):
    return int(etcd.call("/v3/kv/deleterange", {"key": base64.b64encode(name.encode()).decode()})
               .get("deleted", 0))


def config(clusters):
    return {"lease_ms": 3000, "store": {"kind": "etcd", "clusters": clusters, "timeout_ms": 1000}}


def test_the_printed_etcd_key_holds_the_entry(wasm, upstream, idempotency_key):
    with Etcd() as etcd:
        envoy = Envoy(config(["etcd"]), upstream.port, extra_clusters=[etcd_cluster(etcd.port)])
        try:
            key = f"find-{uuid.uuid4()}"
            first = post(envoy, key)
            assert first.status == 201
            found = find(idempotency_key, key, ["etcd"])
            assert found["etcd_cluster"] == "etcd"
            assert found["etcd_key"] == f"/idem/{found['store_key']}"
            value = read_entry(etcd, found["etcd_key"])
            assert value is not None, f"nothing at {found['etcd_key']}"
            assert value[:2] == b"E\x02" and value[2] == COMPLETED, value[:HEADER_BYTES]
            # The entry's key tag is bytes 8..24 of the store key the tool printed.
            assert value[11:27] == bytes.fromhex(found["store_key"])[8:24]
            assert value[HEADER_BYTES:HEADER_BYTES + len(first.body)] == first.body
            # Another caller's same key is another entry.
            other = post(envoy, key, extra={"Authorization": "Bearer someone-else"})
            assert other.status == 201 and other.header("idempotent-replayed") is None
            assert upstream.effects(key) == 2

            # The stored answer keeps replaying from this Envoy's local copy after the entry
            # is deleted from etcd (until its retention ends): docs/operations.md says so.
            assert delete_entry(etcd, found["etcd_key"]) == 1
            again = post(envoy, key)
            assert again.status == 201 and again.header("idempotent-replayed") == "true"
            assert upstream.effects(key) == 2
        finally:
            envoy.stop()


def test_deleting_an_in_progress_mark_lets_a_retry_run_again(wasm, upstream, idempotency_key):
    with Etcd() as etcd:
        envoy = Envoy(config(["etcd"]), upstream.port, extra_clusters=[etcd_cluster(etcd.port)])
        try:
            key = f"stuck-{uuid.uuid4()}"
            first = {}
            thread = threading.Thread(target=lambda: first.setdefault("r", post(envoy, key, x_delay_ms=2500)))
            thread.start()
            wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="first call upstream")
            name = find(idempotency_key, key, ["etcd"])["etcd_key"]
            value = read_entry(etcd, name)
            assert value is not None and value[2] == IN_PROGRESS
            assert post(envoy, key).status == 409
            assert delete_entry(etcd, name) == 1
            retry = post(envoy, key)
            assert retry.status == 201 and retry.header("idempotent-replayed") is None
            assert upstream.effects(key) == 2
            thread.join(10)
            # The first owner finds its mark gone: its result is not stored (owner_lost, the
            # alert IdempotencyOwnerLost); the retry's is.
            assert first["r"].status == 201
            wait_until(lambda: envoy.stat("wasmcustom.idempotency.owner_lost") == 1, timeout=5,
                       message="owner_lost counted")
            replay = post(envoy, key)
            assert replay.header("idempotent-replayed") == "true" and replay.body == retry.body
        finally:
            envoy.stop()


def test_with_two_clusters_the_printed_cluster_holds_the_key(wasm, upstream, idempotency_key):
    with Etcd() as etcd_a, Etcd() as etcd_b:
        servers = {"etcd_a": etcd_a, "etcd_b": etcd_b}
        clusters = [etcd_cluster(s.port, name=n) for n, s in servers.items()]
        envoy = Envoy(config(list(servers)), upstream.port, extra_clusters=clusters)
        try:
            placed = {"etcd_a": 0, "etcd_b": 0}
            for i in range(12):
                key = f"shard-{i}-{uuid.uuid4()}"
                assert post(envoy, key).status == 201
                found = find(idempotency_key, key, list(servers))
                home = found["etcd_cluster"]
                placed[home] += 1
                for name, server in servers.items():
                    held = read_entry(server, found["etcd_key"])
                    assert (held is not None) == (name == home), (key, name, home)
            assert all(placed.values()), f"12 keys all on one cluster: {placed}"
        finally:
            envoy.stop()
