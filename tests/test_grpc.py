"""gRPC through Envoy and the plugin, with grpcio on both sides (SPEC §3.10).

What works: one effect per key under concurrent duplicates, the plugin's own answers as gRPC
errors (ABORTED with grpc-retry-pushback-ms and a google.rpc.RetryInfo), release on the
server-side failures, and failed results replayed as the same status and trailers. What the
platform does not allow yet (docs/limits.md): a local reply to a gRPC call cannot carry
messages, so a successful result is not replayed; its retry gets FAILED_PRECONDITION and is
never run again.
"""

import threading
import uuid

import grpc
import pytest

from grpc_util import GrpcUpstream, pay
from harness import Envoy, wait_until


@pytest.fixture
def grpc_upstream():
    up = GrpcUpstream()
    yield up
    up.stop()


@pytest.fixture(params=["detached", "router"])
def envoy(request, wasm, grpc_upstream):
    e = Envoy({"forward": request.param, "retry_after_s": 2}, grpc_upstream.port,
              upstream_http2=True)
    yield e
    e.stop()


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
    # The platform's limit: the successful result cannot be replayed to a gRPC client; the
    # retry is told so, and the work is not done again.
    code, details, _, trailing = pay(envoy.port, key)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
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
