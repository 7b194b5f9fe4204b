"""Two plugin instances in one Envoy (docs/operations.md): with a `stat_prefix` each, each keeps
its own metrics (`idempotency.<stat_prefix>.<name>`); without, they add into the same stats,
and a gauge such as effective_retention_ms shows whichever wrote last."""

from e2e_util import is_replay, new_key, post
from harness import wasm_filter


def two_instances(make_envoy, upstream, prefixes):
    """Instance A covers POST, instance B covers PUT, on one listener."""
    a = {"namespace": "a", "methods": ["POST"]}
    b = {"namespace": "b", "methods": ["PUT"]}
    if prefixes:
        a["stat_prefix"], b["stat_prefix"] = prefixes
    second = wasm_filter(b, vm_id="idempotency_b", root_id="idempotency_b", name="idempotency_b")
    return make_envoy(a, upstream.port, extra_filters=[second])


def drive(envoy):
    post_key, put_key = new_key("post"), new_key("put")
    assert post(envoy, post_key).status == 201
    assert is_replay(post(envoy, post_key))
    assert post(envoy, put_key, method="PUT").status == 201


def test_with_a_stat_prefix_each_instance_keeps_its_own_metrics(upstream, make_envoy, wasm):
    envoy = two_instances(make_envoy, upstream, ("payments", "orders"))
    drive(envoy)
    stats = envoy.stats_matching("wasmcustom.idempotency.")
    assert stats["wasmcustom.idempotency.payments.claimed"] == 1, stats
    assert stats["wasmcustom.idempotency.payments.replayed"] == 1, stats
    assert stats["wasmcustom.idempotency.orders.claimed"] == 1, stats
    assert stats["wasmcustom.idempotency.orders.replayed"] == 0, stats
    assert "wasmcustom.idempotency.claimed" not in stats, stats
    assert stats["wasmcustom.idempotency.payments.config_buckets"] == 1024, stats


def test_without_one_the_instances_share_their_metrics(upstream, make_envoy, wasm):
    envoy = two_instances(make_envoy, upstream, None)
    drive(envoy)
    stats = envoy.stats_matching("wasmcustom.idempotency.")
    assert stats["wasmcustom.idempotency.claimed"] == 2, "both instances' first calls in one stat"
