#!/usr/bin/env python3
"""What a claim costs on etcd against shared data (docs/fleet.md): 200 sequential first calls
through each store, the median of the whole request through Envoy, measured in one run. Not a
test: it prints what it measured.

Run: .venv/bin/python bench/claim_latency.py [--calls 200]
"""

import argparse
import os
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from e2e_util import post  # noqa: E402
from etcd_util import Etcd, cluster as etcd_cluster  # noqa: E402
from harness import Envoy, Upstream  # noqa: E402


def median_ms(envoy, calls):
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        r = post(envoy.port, uuid.uuid4().hex)
        times.append((time.perf_counter() - t0) * 1000)
        assert r.status == 201, r.status
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    with Upstream() as up:
        etcd = Etcd()
        shared = Envoy({"lease_ms": 3000}, up.port)
        fleet = Envoy({"lease_ms": 3000, "store": {"kind": "etcd", "cluster": "etcd"}}, up.port,
                      extra_clusters=[etcd_cluster(etcd.port)])
        try:
            median_ms(shared, args.calls), median_ms(fleet, args.calls)  # warm up
            s, f = median_ms(shared, args.calls), median_ms(fleet, args.calls)
        finally:
            shared.stop()
            fleet.stop()
            etcd.close()
    print(f"CLAIM_LATENCY calls={args.calls} shared_data_median_ms={s:.2f} "
          f"etcd_median_ms={f:.2f} extra_ms={f - s:.2f}")


if __name__ == "__main__":
    main()
