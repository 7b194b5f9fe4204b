"""How the plugin names an etcd cluster to Envoy's gRPC client (docs/behaviour.md §4, etcd;
docs/configuration.md, refused combinations). Envoy reads the name it is given as a serialized
GrpcService whenever its bytes parse as one: a cluster named `etcd-east1` or `xa` then names no
cluster, and Envoy aborts ("unset oneof"). The plugin sends a GrpcService naming the cluster
instead, so any name works, and a cluster that does not exist is a store that does not answer,
as before."""

import uuid

import pytest

from e2e_util import is_replay, post
from etcd_util import Etcd, cluster as etcd_cluster


@pytest.mark.parametrize("name", ["etcd-east1", "xa"])
def test_a_cluster_name_that_parses_as_a_grpc_service_serves(upstream, make_envoy, wasm, name):
    with Etcd() as etcd:
        envoy = make_envoy({"store": {"kind": "etcd", "clusters": [name], "timeout_ms": 1000}},
                           upstream.port, extra_clusters=[etcd_cluster(etcd.port, name=name)])
        keys = [f"name-{uuid.uuid4()}" for _ in range(4)]
        firsts = [post(envoy, k) for k in keys]
        replays = [post(envoy, k) for k in keys]
        assert [r.status for r in firsts] == [201] * 4
        assert all(is_replay(r) and r.body == f.body for f, r in zip(firsts, replays))
        assert all(upstream.effects(k) == 1 for k in keys)
        assert envoy.alive()
        assert "unset oneof" not in envoy.log_text()


def test_a_missing_etcd_cluster_is_a_store_that_does_not_answer(upstream, make_envoy, wasm):
    envoy = make_envoy({"store": {"kind": "etcd", "clusters": ["no-such-cluster"],
                                  "timeout_ms": 1000}}, upstream.port)
    key = f"missing-{uuid.uuid4()}"
    answers = [post(envoy, key) for _ in range(3)]
    assert [r.status for r in answers] == [503] * 3
    assert all(r.json()["retryable"] is True for r in answers)
    assert upstream.effects(key) == 0
    envoy.wait_log(r'dispatch to cluster "no-such-cluster" failed', timeout=5)
    assert envoy.alive()
