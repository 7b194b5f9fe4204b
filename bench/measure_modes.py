#!/usr/bin/env python3
"""Throughput of `forward: "router"` against `forward: "detached"`, measured in one run.

Not a test: one upstream, two Envoys (one per mode), and
N unique-key POSTs with T threads on keep-alive connections through each, interleaved
(router, detached, router, detached, ...). Prints req/s per run and the ratio
detached/router of the means. Absolute numbers are noise on a shared 2-core machine; the
ratio within one run is the result (docs/behaviour.md §4 measured 10-25 % cost for detached).

Run: .venv/bin/python bench/measure_modes.py [--requests 3000] [--threads 16] [--rounds 2]
"""

import argparse
import collections
import http.client
import os
import statistics
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from e2e_util import key_headers  # noqa: E402
from harness import Envoy, Upstream, connection, request  # noqa: E402

BODY = b'{"amount":1}'


def send_all(port, keys, threads):
    """POST each key once with `threads` keep-alive clients; returns (seconds, statuses)."""
    cursor = iter(range(len(keys)))
    lock = threading.Lock()
    statuses = collections.Counter()
    barrier = threading.Barrier(threads + 1)

    def worker():
        conn = connection(port, timeout=30)
        local = collections.Counter()
        barrier.wait()
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                break
            try:
                resp = request(port, "POST", "/payments", key_headers(keys[i]), BODY, conn=conn)
            except (OSError, http.client.HTTPException):
                conn.close()  # the proxy closed the connection: resend on a new one
                conn = connection(port, timeout=30)
                resp = request(port, "POST", "/payments", key_headers(keys[i]), BODY,
                               conn=conn)
            local[resp.status] += 1
        conn.close()
        with lock:
            statuses.update(local)

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in workers:
        t.start()
    barrier.wait()
    started = time.monotonic()
    for t in workers:
        t.join()
    return time.monotonic() - started, statuses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=300)
    args = parser.parse_args()

    modes = ("router", "detached")
    rates = {m: [] for m in modes}
    with Upstream() as upstream:
        envoys = {}
        try:
            for mode in modes:
                # Decisions are logged at debug; keep the log out of the measurement.
                envoys[mode] = Envoy({"forward": mode}, upstream.port, wasm_log_level="info")
            for mode in modes:
                send_all(envoys[mode].port, [f"warm-{mode}-{uuid.uuid4()}"
                                             for _ in range(args.warmup)], args.threads)
            print(f"{args.requests} unique-key POSTs x {args.threads} threads per run, "
                  f"{args.rounds} rounds, Envoy --concurrency {envoys['router'].concurrency}")
            for round_no in range(1, args.rounds + 1):
                for mode in modes:
                    keys = [f"{mode}-{round_no}-{uuid.uuid4()}" for _ in range(args.requests)]
                    seconds, statuses = send_all(envoys[mode].port, keys, args.threads)
                    effects = upstream.effects()
                    once = sum(1 for k in keys if effects.get(k) == 1)
                    rate = args.requests / seconds
                    rates[mode].append(rate)
                    print(f"round {round_no} {mode:8s}: {rate:8.0f} req/s  ({seconds:.2f}s, "
                          f"statuses {dict(statuses)}, keys with exactly 1 effect: "
                          f"{once}/{len(keys)})")
            for mode in modes:
                stats = envoys[mode].stats("cluster\\.upstream\\.upstream_(cx_total|rq_total)$")
                print(f"{mode:8s} upstream connections opened: "
                      f"{stats.get('cluster.upstream.upstream_cx_total')}, requests: "
                      f"{stats.get('cluster.upstream.upstream_rq_total')}")
        finally:
            for envoy in envoys.values():
                envoy.stop()
    means = {m: statistics.mean(rates[m]) for m in modes}
    for mode in modes:
        print(f"mean {mode:8s}: {means[mode]:8.0f} req/s")
    print(f"ratio detached/router: {means['detached'] / means['router']:.3f}")


if __name__ == "__main__":
    main()
