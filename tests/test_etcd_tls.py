"""Fleet mode with etcd over TLS and client-certificate authentication (issue "Fleet mode for
real traffic"): etcd with `--client-cert-auth`, Envoy's `etcd` cluster with a TLS transport
socket that checks etcd's certificate and presents its own; certificates made by the test.
"""

import json
import os
import uuid

import pytest
import yaml

from etcd_util import Etcd, cluster as etcd_cluster
from harness import REPO_ROOT, Envoy, free_port, point_clusters
from pki_util import make_pki
from test_fleet import fleet_config, post, retry_until_final
import e2e_util


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(str(tmp_path_factory.mktemp("pki")))


@pytest.fixture
def tls_etcd(pki):
    server = Etcd(tls=pki)
    yield server
    server.close()


@pytest.mark.parametrize("api", ["grpc", "json"])
def test_a_fleet_shares_keys_through_etcd_over_tls(wasm, upstream, tls_etcd, pki, api):
    clusters = [etcd_cluster(tls_etcd.port, api=api, tls=pki)]
    config = fleet_config(store={"api": api})
    a = Envoy(config, upstream.port, extra_clusters=clusters)
    b = Envoy(config, upstream.port, extra_clusters=clusters)
    try:
        key = uuid.uuid4().hex
        first = post(a, key)
        assert first.status == 201, e2e_util.describe(first)
        replay = retry_until_final(b, key)
        assert replay.header("idempotent-replayed") == "true" and replay.body == first.body
        assert upstream.effects(key) == 1
        assert tls_etcd.count_keys("/idem/") >= 1, "the entry is in etcd"
        assert a.stat("cluster.etcd.ssl.handshake") >= 1
    finally:
        a.stop()
        b.stop()


def test_without_a_client_certificate_etcd_refuses_and_claims_fail_closed(wasm, upstream,
                                                                          tls_etcd, pki):
    """etcd refuses a TLS client without a certificate: the store is unavailable, so covered
    requests get 503 (on_unavailable "reject") and never reach the upstream unprotected."""
    clusters = [etcd_cluster(tls_etcd.port, tls=pki, client_cert=False)]
    envoy = Envoy(fleet_config(), upstream.port, extra_clusters=clusters)
    try:
        key = uuid.uuid4().hex
        r = post(envoy, key)
        e2e_util.problem(r, 503, "store-unavailable", True)
        assert upstream.effects(key) == 0
        assert tls_etcd.count_keys("/idem/") == 0
    finally:
        envoy.stop()


def shipped_fleet_config(upstream_port, etcds, pki):
    """envoy/envoy-fleet.yaml as it ships, on free ports, with the test's certificates."""
    with open(os.path.join(REPO_ROOT, "envoy", "envoy-fleet.yaml")) as f:
        doc = yaml.safe_load(f)
    doc["admin"]["address"]["socket_address"]["port_value"] = free_port()
    # The ingress and the internal listener of detached_via (no address).
    listener, internal = doc["static_resources"]["listeners"]
    assert "internal_listener" in internal
    listener["address"]["socket_address"]["port_value"] = free_port()
    point_clusters(doc, {"demo_upstream": upstream_port, **{n: e.port for n, e in etcds.items()}})
    for c in doc["static_resources"]["clusters"]:
        if "transport_socket" in c:
            text = json.dumps(c["transport_socket"]).replace(".fleet-pki/", pki["dir"] + "/")
            c["transport_socket"] = json.loads(text)
    return doc


def test_the_shipped_fleet_config_spreads_keys_over_two_etcd_clusters_over_tls(wasm, upstream,
                                                                               pki):
    """envoy/envoy-fleet.yaml for real: two replicas, two TLS etcd clusters (shards). Every
    key is claimed once, replayed by the other replica, and lives on exactly one shard; both
    shards get keys."""
    etcds = {"etcd_a": Etcd(tls=pki), "etcd_b": Etcd(tls=pki)}
    envoys = []
    try:
        for _ in range(2):
            envoys.append(Envoy(None, upstream.port,
                                bootstrap=shipped_fleet_config(upstream.port, etcds, pki)))
        a, b = envoys
        keys = [uuid.uuid4().hex for _ in range(24)]
        for key in keys:
            first = post(a, key)
            assert first.status == 201, e2e_util.describe(first)
            again = post(b, key)
            assert again.header("idempotent-replayed") == "true" and again.body == first.body
        assert {k: upstream.effects(k) for k in keys} == {k: 1 for k in keys}
        per_shard = {n: e.count_keys("/demo/") for n, e in etcds.items()}
        print(f"entries per shard: {per_shard}")
        assert all(n > 0 for n in per_shard.values()), per_shard
        for name in etcds:
            assert a.stat(f"cluster.{name}.ssl.handshake") >= 1
    finally:
        for envoy in envoys:
            envoy.stop()
        for e in etcds.values():
            e.close()
