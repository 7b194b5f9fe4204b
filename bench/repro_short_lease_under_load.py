#!/usr/bin/env python3
"""Repro (not a test): detached calls lose their in-progress
mark under load when lease_ms is short, and duplicates follow.

Pairs of clients send the same key at about the same moment and leave after 0-30 ms
(half with RST); the upstream answers after 0-30 ms. Every key must have exactly one
effect (docs/behaviour.md §3.5: a detached call's mark is renewed while the call is in flight). On a busy
2-core machine the Envoy worker stalls for hundreds of ms: renewal (only from on_tick, every
lease_ms/4, and first due lease_ms/4 after the *dispatch*, not the claim) comes too late, the
sweep or the pair's second request finds the mark expired, and the upstream runs twice.

Run: .venv/bin/python bench/repro_short_lease_under_load.py [lease_ms=200] [pairs=1500]
"""

import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from e2e_util import key_headers, new_key, plugin_counters  # noqa: E402
from harness import Envoy, Upstream, abandon, run_concurrently, wait_until  # noqa: E402


def main():
    lease = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
    rng = random.Random(1)
    with Upstream() as upstream:
        envoy = Envoy({"forward": "detached", "lease_ms": lease}, upstream.port)
        try:
            keys = [new_key("pair") for _ in range(pairs)]
            plans = [(rng.uniform(0, 0.03), rng.randint(0, 30), rng.random() < 0.5)
                     for _ in range(2 * pairs)]

            def client(i):
                after_s, delay_ms, rst = plans[i]
                abandon(envoy.port, "POST", "/payments",
                        key_headers(keys[i // 2], {"x-delay-ms": str(delay_ms)}),
                        b'{"amount":1}', after_s=after_s, rst=rst)

            run_concurrently(client, 2 * pairs, max_workers=60, timeout=300)
            wait_until(lambda: plugin_counters(envoy)["entries_in_progress"] == 0, timeout=60)
            effects = upstream.effects()
            twice = [k for k in keys if effects.get(k, 0) > 1]
            counters = {k: v for k, v in plugin_counters(envoy).items() if v}
            print(f"lease_ms {lease}: {len(twice)} of {pairs} keys ran more than once; "
                  f"counters {counters}")
            taken = [line for line in envoy.log_text().splitlines() if "taken over" in line]
            print(f"{len(taken)} log lines like: {taken[0][-120:] if taken else '-'}")
        finally:
            envoy.stop()


if __name__ == "__main__":
    main()
