#!/usr/bin/env python3
"""Two builds of the plugin side by side in one Envoy: before and after a change.

    .venv/bin/python bench/compare.py OLD.wasm NEW.wasm [--mode detached|router] [--rounds 8]

One Envoy 1.40.0 (--concurrency 2) gets one listener per build, each with its own vm_id and
namespace, in front of the same upstream (an Envoy answering by itself). wrk drives each path
on each listener in turn, alternating which build goes first, for --rounds rounds; the figures
are medians of Envoy's CPU time per request (from /proc) and of req/s. Paths: the first call (a
new key per POST), the replay (one completed key) and a request the plugin does not cover (a
GET). Measured in one run, the two builds share the machine's noise.
"""

import argparse
import os
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

from bench import (EnvoyProc, bootstrap, free_port, listener, log, median, post,  # noqa: E402
                   run_wrk, static_cluster, to_cluster, upstream_envoy, wasm_filter)

PATHS = [
    ("first call", {"id": "first", "script": "unique", "method": "POST"}),
    ("replay", {"id": "replay", "script": "fixed"}),
    ("not covered (GET)", {"id": "get", "script": "unique", "method": "GET"}),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--mode", default="detached", choices=["detached", "router"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--duration", type=int, default=3, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    builds = [("old", os.path.abspath(args.old)), ("new", os.path.abspath(args.new))]
    up = upstream_envoy("0-1")
    front = None
    try:
        ports = {name: free_port() for name, _ in builds}
        listeners = []
        for name, wasm in builds:
            config = {"namespace": f"compare_{name}", "capacity": 262144, "lease_ms": 2000,
                      "forward": args.mode}
            listeners.append(listener(name, ports[name], [to_cluster("upstream")],
                                      [wasm_filter(config, vm_id=f"compare_{name}", wasm=wasm)]))
        front = EnvoyProc("compare", bootstrap(listeners, [static_cluster("upstream", up.port)]),
                          concurrency=2, cpus="0-1")
        key = "compare-replay"
        for name, _ in builds:
            first, again = post(ports[name], key), post(ports[name], key)
            assert again.header("idempotent-replayed") == "true", (name, first, again)
        runs = {(p, name): [] for p, _ in PATHS for name, _ in builds}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            order = builds if rnd % 2 else builds[::-1]
            for path, case in PATHS:
                for name, _ in order:
                    c0 = front.cpu_s()
                    r = run_wrk(ports[name], case, args, args.duration if rnd else 1,
                                prefix=f"{rnd}-{name}-{case['id']}", key=key, cpus="1")
                    if r["status_errors"] or r["requests"] == 0:
                        sys.exit(f"{path} on {name}: {r['status_errors']} errors")
                    if rnd:
                        cpu = (front.cpu_s() - c0) / r["requests"] * 1e6
                        runs[(path, name)].append((cpu, r["rps"]))
        print(f"forward: {args.mode}; medians of {args.rounds} rounds of {args.duration} s")
        print("| path | Envoy CPU µs/req, old | new | req/s, old | new |")
        print("|---|---:|---:|---:|---:|")
        for path, _ in PATHS:
            o, n = runs[(path, "old")], runs[(path, "new")]
            print(f"| {path} | {median([c for c, _ in o]):.0f} | {median([c for c, _ in n]):.0f} "
                  f"| {median([q for _, q in o]):,.0f} | {median([q for _, q in n]):,.0f} |")
    finally:
        if front:
            front.stop()
        up.stop()
        log("stopped")


if __name__ == "__main__":
    main()
