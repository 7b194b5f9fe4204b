#!/usr/bin/env python3
"""Two builds of the plugin side by side in one Envoy: before and after a change.

    .venv/bin/python bench/compare.py OLD.wasm NEW.wasm [--mode detached|router]
        [--store shared_data|etcd] [--apis json,grpc] [--rounds 8]

One Envoy 1.40.0 (--concurrency 2) gets one listener per build, each with its own vm_id and
namespace, in front of the same upstream (an Envoy answering by itself). wrk drives each path
on each listener in turn, alternating which build goes first, for --rounds rounds; the figures
are medians of Envoy's CPU time per request (from /proc) and of req/s, and the median (with
min–max) of the new/old ratio of CPU per request within each round. Paths: the first call (a
new key per POST), the replay (one completed key) and a request the plugin does not cover (a
GET). With --store etcd both listeners use one local etcd (tests/etcd_util.py), each under its
own namespace, and the table also gives etcd requests per client request; --apis gives each
listener's etcd API (`store.api`; the same build twice compares the APIs). Measured in one run,
the two builds share the machine's noise.
"""

import argparse
import os
import sys
import time

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
    ap.add_argument("--store", default="shared_data", choices=["shared_data", "etcd"])
    ap.add_argument("--apis", default="grpc,grpc", help="etcd API of old,new (json|grpc)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--duration", type=int, default=3, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    builds = [("old", os.path.abspath(args.old)), ("new", os.path.abspath(args.new))]
    up = upstream_envoy("0-1")
    front = etcd = None
    try:
        clusters = [static_cluster("upstream", up.port)]
        if args.store == "etcd":
            sys.path.insert(0, os.path.join(os.path.dirname(BENCH_DIR), "tests"))
            from etcd_util import Etcd, cluster as etcd_cluster
            etcd = Etcd()
            clusters.append(etcd_cluster(etcd.port))
            clusters.append(etcd_cluster(etcd.port, name="etcd_json", api="json"))
        apis = dict(zip(("old", "new"), args.apis.split(",")))
        ports = {name: free_port() for name, _ in builds}
        listeners = []
        for name, wasm in builds:
            config = {"namespace": f"compare_{name}", "forward": args.mode}
            if etcd:
                api = apis[name]
                cluster = "etcd" if api == "grpc" else "etcd_json"
                config.update(store={"kind": "etcd", "cluster": cluster, "api": api}, lease_ms=3000)
            else:
                config.update(capacity=262144, lease_ms=2000)
            listeners.append(listener(name, ports[name], [to_cluster("upstream")],
                                      [wasm_filter(config, vm_id=f"compare_{name}", wasm=wasm)]))
        front = EnvoyProc("compare", bootstrap(listeners, clusters), concurrency=2, cpus="0-1")
        runs = {(p, name): [] for p, _ in PATHS for name, _ in builds}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            order = builds if rnd % 2 else builds[::-1]
            for path, case in PATHS:
                for name, _ in order:
                    # A replay key stored just now: the first-call rounds fill the table, and
                    # a full bucket evicts its oldest answers.
                    key = f"compare-replay-{rnd}"
                    if case["id"] == "replay":
                        stored_replay(ports[name], key, name)
                    c0, e0, k0 = front.cpu_s(), etcd_requests(front), etcd_cpu_s(etcd)
                    r = run_wrk(ports[name], case, args, args.duration if rnd else 1,
                                prefix=f"{rnd}-{name}-{case['id']}", key=key, cpus="1")
                    if r["status_errors"] or r["requests"] == 0:
                        sys.exit(f"{path} on {name}: {r['status_errors']} errors")
                    if rnd:
                        cpu = (front.cpu_s() - c0) / r["requests"] * 1e6
                        etcd_cpu = (etcd_cpu_s(etcd) - k0) / r["requests"] * 1e6
                        per = (etcd_requests(front) - e0) / r["requests"]
                        runs[(path, name)].append((cpu, r["rps"], per, etcd_cpu))
        print(f"forward: {args.mode}, store: {args.store}; medians of {args.rounds} rounds of "
              f"{args.duration} s")
        extra = " etcd requests per request, old | new | etcd CPU µs/req, old | new |" if etcd else ""
        print(f"| path | Envoy CPU µs/req, old | new | new/old, per round | req/s, old | new |{extra}")
        print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if etcd else ""))
        for path, _ in PATHS:
            o, n = runs[(path, "old")], runs[(path, "new")]
            # Each round runs both builds back to back: the ratio within a round cancels the
            # machine's drift between rounds; its median and spread say what changed.
            ratios = sorted(b[0] / a[0] for a, b in zip(o, n))
            spread = f"{median(ratios):.2f} ({ratios[0]:.2f}–{ratios[-1]:.2f})"
            row = (f"| {path} | {median([x[0] for x in o]):.0f} | {median([x[0] for x in n]):.0f} "
                   f"| {spread} | {median([x[1] for x in o]):,.0f} | {median([x[1] for x in n]):,.0f} |")
            if etcd:
                row += f" {median([x[2] for x in o]):.2f} | {median([x[2] for x in n]):.2f} |"
                row += f" {median([x[3] for x in o]):.0f} | {median([x[3] for x in n]):.0f} |"
            print(row)
    finally:
        if front:
            front.stop()
        up.stop()
        if etcd:
            etcd.stop()
        log("stopped")


def stored_replay(port, key, name):
    """Stores `key`'s answer and checks that it replays."""
    first = post(port, key)
    for _ in range(20):  # etcd: the completion lands just after the answer
        again = post(port, key)
        if again.header("idempotent-replayed") == "true":
            return
        time.sleep(0.05)
    raise AssertionError((name, first, again))


def etcd_cpu_s(etcd):
    """CPU time etcd has used so far (0 without it)."""
    if not etcd:
        return 0.0
    with open(f"/proc/{etcd.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def etcd_requests(front):
    """Requests Envoy has sent to etcd so far (0 without it), over either API."""
    return front.cluster_requests("etcd") + front.cluster_requests("etcd_json")


if __name__ == "__main__":
    main()
