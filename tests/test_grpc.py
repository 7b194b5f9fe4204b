"""gRPC through Envoy and the plugin, with grpcio on both sides (docs/behaviour.md §3.10).

One effect per key under concurrent duplicates, the plugin's own answers as gRPC errors
(ABORTED with grpc-retry-pushback-ms and a google.rpc.RetryInfo), release on the server-side
failures, failed results replayed as the same status and trailers. A local reply to a gRPC call
cannot carry messages (Envoy makes it trailers-only), so results with messages replay through
the replay loopback (`grpc_replays: "loopback"`); without it their retry gets
FAILED_PRECONDITION and is never run again.
"""

import os
import threading
import uuid

import grpc
import pytest
import yaml

from grpc_util import GrpcUpstream, pay, with_replay_loopback
from harness import REPO_ROOT, Envoy, envoy_config, free_port, point_clusters, wait_until


@pytest.fixture
def grpc_upstream():
    up = GrpcUpstream()
    yield up
    up.stop()


def start(grpc_upstream, config, loopback):
    """An Envoy with the plugin in front of the gRPC upstream (and the replay loopback)."""
    if loopback:
        config = {**config, "grpc_replays": "loopback"}
    port, admin = free_port(), free_port()
    bootstrap = envoy_config(port, admin, grpc_upstream.port, config, upstream_http2=True)
    if loopback:
        bootstrap = with_replay_loopback(bootstrap)
    e = Envoy(None, grpc_upstream.port, bootstrap=bootstrap)
    e.loopback = loopback
    return e


@pytest.fixture(params=[("detached", True), ("router", True), ("router", False)],
                ids=["detached-loopback", "router-loopback", "router-no-loopback"])
def envoy(request, wasm, grpc_upstream):
    forward, loopback = request.param
    config = {"forward": forward, "retry_after_s": 2}
    e = start(grpc_upstream, config, loopback)
    yield e
    e.stop()


@pytest.mark.every_envoy
def test_duplicates_in_progress_get_aborted_with_the_pushback_and_one_effect(envoy, grpc_upstream):
    key = uuid.uuid4().hex
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("r", pay(envoy.port, key, x_delay_ms=1500)))
    t.start()
    wait_until(lambda: grpc_upstream.effects_of(key) == 1, timeout=5, message="first call upstream")
    code, details, _, trailing = pay(envoy.port, key)
    assert code == grpc.StatusCode.ABORTED, (code, details)
    assert trailing["grpc-retry-pushback-ms"] == "2000"
    status = trailing["grpc-status-details-bin"]
    assert status[:2] == b"\x08\x0a", status  # google.rpc.Status, code 10
    assert b"type.googleapis.com/google.rpc.RetryInfo" in status and b"\x08\x02" in status
    t.join(10)
    code, response, _, _ = first["r"]
    assert code == grpc.StatusCode.OK and response.startswith(f"paid {key} #1".encode())
    code, response, initial, trailing = pay(envoy.port, key)
    if envoy.loopback:
        # The same message and trailers, marked in the initial metadata.
        assert code == grpc.StatusCode.OK and response == first["r"][1], (code, response)
        assert initial["idempotent-replayed"] == "true" and trailing["x-cost"] == "7"
    else:
        # Without the loopback the result cannot be replayed; the retry is told so.
        assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, response)
    assert grpc_upstream.effects_of(key) == 1
    assert envoy.stat("wasmcustom.idempotency.conflict") >= 1


def test_unavailable_releases_the_key_and_the_retry_runs(envoy, grpc_upstream):
    key = uuid.uuid4().hex
    code, _, _, _ = pay(envoy.port, key, x_grpc_status=14)
    assert code == grpc.StatusCode.UNAVAILABLE
    code, response, _, _ = pay(envoy.port, key)
    assert code == grpc.StatusCode.OK and response.startswith(f"paid {key} #2".encode())
    assert grpc_upstream.effects_of(key) == 2
    assert envoy.stat("wasmcustom.idempotency.released") == 1


@pytest.mark.every_envoy
def test_not_found_is_stored_and_replayed_with_its_status_message_and_trailers(envoy, grpc_upstream):
    key = uuid.uuid4().hex
    first = pay(envoy.port, key, x_grpc_status=5, x_grpc_message="no such account: 42%")
    assert first[0] == grpc.StatusCode.NOT_FOUND and first[1] == "no such account: 42%"
    assert first[3]["x-cost"] == "7"
    again = pay(envoy.port, key, x_grpc_status=5, x_grpc_message="no such account: 42%")
    assert again[:2] == first[:2]
    assert again[3]["x-cost"] == "7" and again[3]["idempotent-replayed"] == "true"
    assert grpc_upstream.effects_of(key) == 1
    assert envoy.stat("wasmcustom.idempotency.replayed") == 1


def test_a_reused_key_with_another_message_is_invalid_argument(envoy, grpc_upstream):
    key = uuid.uuid4().hex
    assert pay(envoy.port, key, x_grpc_status=5)[0] == grpc.StatusCode.NOT_FOUND
    code, details, _, _ = pay(envoy.port, key, body=b"amount=99")
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert grpc_upstream.effects_of(key) == 1


def test_a_client_deadline_shorter_than_the_call_costs_one_effect(wasm, grpc_upstream):
    """The phone's story in gRPC: the client gives up (DEADLINE_EXCEEDED) while the call
    runs. Detached, the call goes on: the retry gets ABORTED while it runs and the stored
    result after. Through the router, the call is reset with the client: its mark expires
    after lease_ms and a retry then runs again (docs/limits.md)."""
    envoy = start(grpc_upstream, {"forward": "detached", "retry_after_s": 2}, loopback=True)
    try:
        deadline_story(envoy, grpc_upstream)
    finally:
        envoy.stop()


def deadline_story(envoy, grpc_upstream):
    key = uuid.uuid4().hex
    code, _, _, _ = pay(envoy.port, key, timeout=0.5, x_delay_ms=1500)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    code, _, _, trailing = pay(envoy.port, key)
    assert code == grpc.StatusCode.ABORTED and trailing["grpc-retry-pushback-ms"] == "2000"
    wait_until(lambda: pay(envoy.port, key)[0] == grpc.StatusCode.OK, timeout=5,
               message="the stored result")
    code, response, initial, trailing = pay(envoy.port, key)
    assert code == grpc.StatusCode.OK and response.startswith(f"paid {key} #1".encode())
    assert initial["idempotent-replayed"] == "true" and trailing["x-cost"] == "7"
    assert grpc_upstream.effects_of(key) == 1


def shipped_grpc_config(upstream_port):
    """envoy/envoy-grpc.yaml as it ships, on free ports."""
    with open(os.path.join(REPO_ROOT, "envoy", "envoy-grpc.yaml")) as f:
        doc = yaml.safe_load(f)
    doc["admin"]["address"]["socket_address"]["port_value"] = free_port()
    front, loopback, internal = doc["static_resources"]["listeners"]
    assert "internal_listener" in internal  # detached_via
    front["address"]["socket_address"]["port_value"] = free_port()
    loopback_port = free_port()
    loopback["address"]["socket_address"]["port_value"] = loopback_port
    point_clusters(doc, {"grpc_upstream": upstream_port, "idempotency_replay": loopback_port})
    return doc


def test_the_shipped_grpc_config_replays_a_result_with_its_messages(wasm, grpc_upstream):
    envoy = Envoy(None, grpc_upstream.port, bootstrap=shipped_grpc_config(grpc_upstream.port))
    try:
        key = uuid.uuid4().hex
        first = pay(envoy.port, key)
        assert first[0] == grpc.StatusCode.OK, first
        again = pay(envoy.port, key)
        assert again[:2] == first[:2] and again[2]["idempotent-replayed"] == "true"
        assert again[3]["x-cost"] == "7"
        assert grpc_upstream.effects_of(key) == 1
        # Detached: the first answer goes through the loopback too, then the replay.
        assert envoy.stat("cluster.idempotency_replay.upstream_rq_total") == 2
    finally:
        envoy.stop()
