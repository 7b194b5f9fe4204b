#!/usr/bin/env python3
"""`make grpc`: the plugin in front of a gRPC service, and a short session with a grpcio client.

Starts the gRPC test upstream (tests/grpc_util.py, 127.0.0.1:50051: `idem.Test/Pay` counts
effects per idempotency-key, sleeps `x-delay-ms`, fails with `x-grpc-status`) and Envoy from
envoy/envoy-grpc.yaml (127.0.0.1:10003), makes the calls below, prints what the client saw, and
stops both by their own PIDs.
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402  (process handling shared with `make run`)

sys.path.insert(0, os.path.join(demo.REPO_ROOT, "tests"))
from grpc_util import GrpcUpstream, pay  # noqa: E402

PORT, ADMIN = 10003, 9904


def show(what, result):
    code, message, initial, trailing = result
    initial = {k: v for k, v in initial.items() if k not in ("date", "server")}
    trailing = {k: v for k, v in trailing.items() if k not in ("date", "server")}
    print(f"{what}\n  -> {code.name} {message!r}\n     initial metadata {initial}\n"
          f"     trailing metadata {trailing}", flush=True)


def main():
    os.chdir(demo.REPO_ROOT)
    upstream = GrpcUpstream(port=50051)
    cmd = [demo.envoy_binary(), "-c", "envoy/envoy-grpc.yaml", "--concurrency", "2",
           "--base-id", "80030000", "--log-level", "warning"]
    envoy = demo.spawn("envoy", cmd)
    try:
        deadline = time.monotonic() + demo.START_TIMEOUT_S
        while not demo.admin_ready(ADMIN) and time.monotonic() < deadline:
            time.sleep(0.1)
        first = {}
        t = threading.Thread(target=lambda: first.setdefault(
            "r", pay(PORT, "order-1", x_delay_ms=1000)))
        t.start()
        time.sleep(0.3)
        show("$ pay(key='order-1')   # while the first call (1 s) runs", pay(PORT, "order-1"))
        t.join()
        show("$ pay(key='order-1', x_delay_ms=1000)   # the first call", first["r"])
        show("$ pay(key='order-1')   # the retry", pay(PORT, "order-1"))
        show("$ pay(key='order-2', x_grpc_status=14)   # UNAVAILABLE: released",
             pay(PORT, "order-2", x_grpc_status=14))
        show("$ pay(key='order-2')   # the retry runs", pay(PORT, "order-2"))
        show("$ pay(key='order-1', body=b'amount=99')   # the key, another request",
             pay(PORT, "order-1", body=b"amount=99"))
        print(f"effects per key at the upstream: {dict(upstream.effects)}")
    finally:
        demo.stop(envoy, "envoy")
        upstream.stop()


if __name__ == "__main__":
    main()
