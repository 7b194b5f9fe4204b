"""Plugin builds side by side in one Envoy: the Envoy CPU per request of each build on one path
against the least control filter of that path and its floor (bench.py): the replay (W6, W4),
the 409 (W7, W5), the first call detached (W9, W3) or through the router (W10, W1). With
several builds it also prints the first build's CPU over each other's (above 1: that one costs
less), paired by round.

The builds run in the same process, one Envoy worker on one core and wrk on the other, in many
short rounds whose order rotates; each figure is the median over the rounds of that round's
ratio, with its confidence interval (bench.median_interval). floor/this of the least is the
limit (bench.py's LIMIT, in CPU per request); floor/this of a build, its VS_FLOOR. On the
2-core CI machine two copies of one build came out 0.009 apart in one run, and one pair of
builds moved by up to 0.10 between runs: run it several times (docs/performance.md).
Not a timed test: it prints ratios measured in one run.

    .venv/bin/python bench/ab.py replay 14 1 A.wasm B.wasm [...]   (mode, rounds, seconds)

A build named `A.wasm@via` sends its detached calls through an internal listener with the same
routes (`detached_via`, docs/deployment.md): `first 14 1 A.wasm A.wasm@via` measures the hop.

Modes: replay, conflict, first (detached), router.
"""
import os
import statistics
import sys
import time
from types import SimpleNamespace

import bench as B


def main():
    if len(sys.argv) < 5 or sys.argv[1] not in ("replay", "conflict", "first", "router"):
        sys.exit(__doc__)
    mode, rounds, seconds, wasms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    first_call = mode in ("first", "router")
    slow, up = B.Upstream(), B.upstream_envoy("0-1")
    front, socks = None, []
    try:
        answers = B.probe_answers(wasms[0], up.port, slow.port, "0-1")
        answer = answers[0] if mode == "replay" else answers[1]
        routes = [B.SLOW_ROUTE, B.to_cluster("upstream")]
        ports, listeners = {}, []
        hop = False
        for i, wasm in enumerate(wasms):
            name = f"build{i}"
            ports[name] = B.free_port()
            conf = {"capacity": 262144, "namespace": f"ab{i}", "lease_ms": 2000}
            if mode == "router":
                conf["forward"] = "router"
            if wasm.endswith("@via"):
                wasm, hop = wasm[:-len("@via")], True
                conf["detached_via"] = "hop"
            listeners.append(B.listener(name, ports[name], routes, [B.plugin(conf, name, wasm)]))
        floor = {"first": "detach", "router": "buffer"}.get(mode, answer)
        least = {"replay": "least-kept-"}.get(mode, "least-") + floor
        for name, control in (("least", least), ("floor", floor)):
            ports[name] = B.free_port()
            listeners.append(B.listener(name, ports[name], routes, [B.control(control, B.CONTROL_WASM, name=name)]))
        clusters = [B.static_cluster("upstream", up.port), B.static_cluster("slow", slow.port)]
        extra = {}
        if hop:
            import harness
            listeners.append(harness.internal_listener([{"name": "all", "domains": ["*"], "routes": routes}], "hop"))
            clusters.append(harness.internal_cluster("hop", http2=os.environ.get("AB_HOP_HTTP2") == "1"))
            extra = {"bootstrap_extensions": [harness.INTERNAL_LISTENER_EXTENSION]}
        workers = int(os.environ.get("AB_WORKERS", "1"))  # 2: as make bench, wrk sharing the cores
        front = B.EnvoyProc("front", {**extra, **B.bootstrap(listeners, clusters)}, concurrency=workers,
                            cpus="0" if workers == 1 else "0-1")
        key = f"ab-{os.urandom(4).hex()}"
        hold_ms = (rounds * seconds * len(ports) * 2 + 60) * 1000
        for i in range(len(wasms)):
            port = ports[f"build{i}"]
            if mode == "replay":
                B.post(port, key)
                if B.post(port, key).header("idempotent-replayed") != "true":
                    sys.exit(f"build {i}: the key does not replay")
            elif mode == "conflict":
                socks.append(B.open_slow_call(port, key, hold_ms))
        if mode == "conflict":
            deadline = time.monotonic() + 5
            while front.counters().get("claimed", 0) < len(wasms) and time.monotonic() < deadline:
                time.sleep(0.02)
            for i in range(len(wasms)):
                status = B.post(ports[f"build{i}"], key).status
                if status != 409:
                    sys.exit(f"build {i}: the held key answers {status}, not 409")
        args = SimpleNamespace(threads=1, connections=32)
        case = {"script": "unique", "method": "POST"} if first_call else {"script": "fixed"}
        names = list(ports)
        cpu_us = {n: [] for n in names}
        for n in names:
            B.run_wrk(ports[n], case, args, 1, prefix=f"{key}-w-{n}", key=key, cpus="1")  # warm-up
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in reversed(order) if r % 2 else order:
                before = front.cpu_s()
                out = B.run_wrk(ports[n], case, args, seconds, prefix=f"{key}-{r}-{n}", key=key, cpus="1")
                if first_call and out["status_errors"]:
                    sys.exit(f"{n}: {out['status_errors']} answers were not 2xx")
                cpu_us[n].append((front.cpu_s() - before) / max(out["requests"], 1) * 1e6)
        def against(other, n):
            ratios = [o / this for o, this in zip(cpu_us[other], cpu_us[n])]
            lo, hi, _ = B.median_interval(ratios)
            return f"{statistics.median(ratios):.3f} ({lo:.3f}..{hi:.3f})"
        coverage = B.interval_rank(rounds)[1]
        print(f"per request, median over {rounds} rounds (its {coverage:.0%} interval):")
        for i, n in enumerate(names):
            label = wasms[i] if n.startswith("build") else n
            print(f"{label}: Envoy CPU {statistics.median(cpu_us[n]):.1f} us/req, "
                  f"least/this {against('least', n)}, floor/this {against('floor', n)}")
        # Builds against the first, round by round: tighter than two ratios to the least.
        for i in range(1, len(wasms)):
            print(f"{wasms[0]}/{wasms[i]}: {against('build0', f'build{i}')}")
    finally:
        for s in socks:
            s.close()
        for proc in (front, up, slow):
            if proc:
                proc.stop()


if __name__ == "__main__":
    main()
