#!/usr/bin/env python3
"""What one stored entry costs etcd (docs/memory.md: etcd's size), measured: a real etcd and an
Envoy with the plugin's etcd store, N first calls with a response of a chosen size, then etcd's
own figures (`dbSize`, `dbSizeInUse`) before and after, and after a compaction and a
defragmentation (what `--auto-compaction-*` and a periodic defrag do).

Run: .venv/bin/python bench/etcd_size.py [--keys 2000] [--body-bytes 1024]
"""

import argparse
import base64
import os
import sys
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from e2e_util import is_replay, post  # noqa: E402
from etcd_util import Etcd  # noqa: E402
from harness import Envoy, Upstream, run_concurrently, static_cluster, wait_until  # noqa: E402


def status(etcd):
    s = etcd.call("/v3/maintenance/status", {})
    return int(s["dbSize"]), int(s.get("dbSizeInUse", s["dbSize"])), int(s["header"]["revision"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--body-bytes", type=int, default=1024)
    args = ap.parse_args()
    with Upstream() as up:
        etcd = Etcd()
        envoy = Envoy({"store": {"kind": "etcd", "cluster": "etcd"}}, up.port,
                      extra_clusters=[static_cluster("etcd", etcd.port, http2=True)])
        try:
            extra = {"x-body-bytes": str(args.body_bytes)}
            warm = uuid.uuid4().hex
            post(envoy.port, warm, extra=extra)
            wait_until(lambda: is_replay(post(envoy.port, warm, extra=extra)), timeout=5)
            before = status(etcd)
            keys = [uuid.uuid4().hex for _ in range(args.keys)]
            answers = run_concurrently(lambda i: post(envoy.port, keys[i], extra=extra),
                                       len(keys), max_workers=8, timeout=600)
            assert all(a.status == 201 for a in answers)
            wait_until(lambda: is_replay(post(envoy.port, keys[-1], extra=extra)), timeout=5)
            after = status(etcd)
            etcd.call("/v3/kv/compaction", {"revision": str(after[2]), "physical": True})
            etcd.call("/v3/maintenance/defragment", {})
            compacted = status(etcd)
            count = etcd.count_keys("/idem/")
            value = base64.b64decode(etcd.call("/v3/kv/range", {"key": base64.b64encode(
                f"/idem/".encode()).decode(), "range_end": base64.b64encode(b"/idem0").decode(),
                "limit": 1})["kvs"][0]["value"])
        finally:
            envoy.stop()
            etcd.close()
    n = args.keys
    print(f"{n} first calls, answers of {args.body_bytes} B body (stored value {len(value)} B); "
          f"etcd revisions +{after[2] - before[2]} ({(after[2] - before[2]) / n:.2f} per call)")
    print(f"dbSizeInUse +{after[1] - before[1]} B ({(after[1] - before[1]) / n:.0f} B per call, "
          f"history kept); dbSize +{after[0] - before[0]} B")
    print(f"after compaction and defrag: dbSize {compacted[0]} B for {count} keys "
          f"({compacted[1] / count:.0f} B per entry in use)")


if __name__ == "__main__":
    main()
