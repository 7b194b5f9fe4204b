#!/usr/bin/env python3
"""What one proxy-wasm host call costs Envoy (`make bench-hostcalls`).

The control filter (bench/controls/) in mode "calls:<kind>:<n>" makes n host calls of one kind
in each request's header callback; mode "noop" makes none. Every listener sends GETs through
to the same upstream (an Envoy answering by itself), driven by wrk as in bench/bench.py. The
cost of one call is (CPU per request of the kind - CPU per request of noop) / n, with Envoy's
CPU time read from /proc. Kinds are interleaved and repeated; the figure is the median.

These are the calls the plugin makes on its paths (see docs/performance.md): the
shared-data value is the size of one of its buckets (3,138 bytes).
"""

import argparse
import os
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

from bench import (CONTROL_WASM, EnvoyProc, bootstrap, control, free_port, listener,  # noqa: E402
                   log, median, run_wrk, static_cluster, to_cluster, upstream_envoy)

KINDS = ["shared_get", "shared_set", "header", "headers", "property", "metric", "time"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=50, help="host calls per request")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=3, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not os.path.isfile(CONTROL_WASM):
        sys.exit(f"no control filter at {CONTROL_WASM}: run make bench-hostcalls")
    modes = ["noop"] + [f"calls:{k}:{args.calls}" for k in KINDS]
    up = upstream_envoy("0-1")
    front = None
    try:
        ports = {m: free_port() for m in modes}
        listeners = [listener(f"l{i}", ports[m], [to_cluster("upstream")], [control(m, CONTROL_WASM)])
                     for i, m in enumerate(modes)]
        front = EnvoyProc("hostcalls", bootstrap(listeners, [static_cluster("upstream", up.port)]),
                          concurrency=2, cpus="0-1")
        case = {"id": "calls", "script": "unique", "method": "GET"}
        cpu = {m: [] for m in modes}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
            for m in order:
                c0 = front.cpu_s()
                r = run_wrk(ports[m], case, args, args.duration if rnd else 1,
                            prefix=f"{rnd}-{m}", cpus="1")
                if r["status_errors"] or r["requests"] == 0:
                    sys.exit(f"{m}: {r['status_errors']} errors in {r['requests']} requests")
                if rnd:
                    cpu[m].append((front.cpu_s() - c0) / r["requests"] * 1e6)
        base = median(cpu["noop"])
        print(f"Envoy CPU per request, no call: {base:.0f} µs (median of {args.rounds})")
        print(f"| host call ({args.calls} per request) | µs per call | CPU per request, µs |")
        print("|---|---:|---:|")
        for k, m in zip(KINDS, modes[1:]):
            med = median(cpu[m])
            print(f"| {k} | {(med - base) / args.calls:.2f} | {med:.0f} |")
    finally:
        if front:
            front.stop()
        up.stop()
        log("stopped")


if __name__ == "__main__":
    main()
