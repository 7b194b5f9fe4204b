#!/usr/bin/env python3
"""Performance: the plugin against bare Envoy, measured in one run (`make bench`).

Processes (all on 127.0.0.1, each stopped through its own PID):
  - an upstream Envoy answering by itself (direct_response: 201 + a small JSON body, or
    1 KiB on /kib), so the upstream is never the bottleneck;
  - the Python test upstream (tests/upstream.py), only for the one slow request that keeps
    the conflict key in progress (case B4);
  - etcd (tests/etcd_util.Etcd) for the fleet-store case;
  - the Envoy under test, Envoy 1.40.0 with --concurrency 2, one listener per case family:
      bare   no plugin, route to the upstream                        -> A (POST), A (GET)
      local  no plugin, direct_response (Envoy answers by itself)    -> C
      plugin the plugin, default config (forward "detached")         -> B1 B2 B3 B4
      router the plugin, forward "router"                            -> B2 router
      etcd   the plugin, store etcd (gRPC API, one local member)     -> B2 etcd, B3 etcd
      wasm_noop  the control filter "noop", route to the upstream    -> W0 (GET)
      wasm_local the control filter "local" (answers by itself)      -> W2
      wasm_buffer the control filter "buffer", route to the upstream -> W1 (POST)
      wasm_detach the control filter "detach" (root sends upstream)  -> W3 (POST)
    Each plugin listener has its own vm_id and namespace (its own VMs and table); each
    control listener has its own vm_id too.

The controls (bench/controls/, built by `make bench`) are the floor of any proxy-wasm filter:
W0 a Wasm filter that does nothing, W2 a Wasm filter that reads the whole request and answers
201 itself, W1 a Wasm filter that reads the whole request before it lets it go to the router
(what a first call in forward "router" needs: the body is part of the fingerprint), W3 a Wasm
filter that reads the whole request and has its root send it upstream and answers the client
with the upstream's answer (what a first call in forward "detached" needs). Envoy pays for the
VM calls, the header map, the paused request, the root's call and the local reply through the
ABI whatever the filter does, so W0/A GET, W3/A and W2/C are the best ratios a Wasm filter
can reach on this machine for B1, B2 and B3/B4, and B1/W0, B2/W3, B3/W2, B4/W2 what the
plugin costs above that floor.

Load: wrk (one thread pinned to core 1, 32 keep-alive connections, 4 s per run) with
bench/unique.lua (a new Idempotency-Key per request) or bench/fixed.lua (one request,
formatted once). Every listener splits wrk's connections evenly over Envoy's two workers
(exact_balance). The cases are interleaved: every round runs every case, grouped (each plugin
case beside the floors it is judged against, so a ratio compares runs seconds apart), the
groups rotated by one each round and run backwards every other round (5 rounds). The table's
figures are the medians over the rounds; each ratio is the median over the rounds of that
round's ratio (paired), so that the machine's drift from one round to the next cancels. Every run is
checked: statuses (wrk counts answers > 399) and the plugin's own counters (claimed,
completed, replayed, conflict) must say that the path under test is the one that ran. The
CPU time the Envoy under test used per request is recorded too: it moves less than req/s
when other work shares the machine.

Then memory: a fresh Envoy with the plugin (capacity 16,384), RSS (and tcmalloc's bytes in
use) before and after 10,000 unique keys whose upstream answer is 1 KiB; the control is the
same number of requests without a key on the same listener.

Writes docs/bench/results.json, results.md and chart.svg; the lines printed last are
`FLOOR passthrough=<W0/A GET> first_call=<W3/A> first_call_router=<W1/A> local_answer=<W2/C>`,
`VS_FLOOR passthrough=<B1/W0> first_call=<B2 detached/W3> first_call_router=<B2 router/W1>
replay=<B3/W4> conflict=<B4/W5> replay_w2=<B3/W2> conflict_w2=<B4/W2>` (W4 and W5 answer
with the same status, headers and body as the plugin's replay and 409, probed from the plugin
before the run: the fair floors), `LIMIT passthrough=<W8/W0> first_call=<W9/W3>
first_call_router=<W10/W1> replay=<W6/W4> conflict=<W7/W5>` (the least an idempotency filter
keeping its table in shared data must do, above each floor: bench/controls' "least-" modes;
a VS_FLOOR goal above its LIMIT cannot be met), `VS_LEAST` (the plugin against those), the
`INTERVALS` of those three lines' medians (`low..high`, see median_interval) and
`RATIOS passthrough=<B1/A GET> first_call=<B2 detached/A> replay=<B3/C> conflict=<B4/C>`;
with etcd, after them, `FLEET first_call=<B2 etcd/B2 detached> replay=<B3 etcd/B3>` and
`FLEET_COST` (etcd requests and etcd CPU µs per first call; `cpu_bound`: the FLEET first_call
ratio that the machine's CPU allows at most, from every process's CPU per request on both
paths; etcd requests per replay).
"""

import argparse
import datetime
import hashlib
import http.client
import json
import math
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))

from harness import (LOCALHOST, Envoy, Upstream, admin_stats, envoy_binary, free_port,  # noqa: E402
                     request, rss_bytes, static_cluster, wasm_filter, wasm_path)

# The caller every bench request speaks for (keys are scoped by Authorization): the same
# value as bench/unique.lua and bench/fixed.lua send.
CALLER = ("Authorization", "Bearer bench")

CONTROL_WASM = os.path.join(BENCH_DIR, "controls", "target", "wasm32-wasip1", "release",
                            "bench_controls.wasm")
HOST = "bench"  # the :authority of every request (it is part of the store key)
BODY = b'{"amount":10}'  # what bench/*.lua send
UPSTREAM_BODY = '{"id":"pay_1","status":"created"}'
KIB_BODY = ("0123456789abcdef" * 64)[:1024]
ROUTER = {"name": "envoy.filters.http.router", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
# A direct_response sent before the request's body is read makes Envoy close the connection
# (`connection: close`): every request would open a new one. The buffer filter holds the
# request until its body is complete, so Envoy answers a whole request and keeps the
# connection, as the plugin does (it reads the whole body before it answers).
BUFFER = {"name": "envoy.filters.http.buffer", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
    "max_request_bytes": 65536}}
JSON_HEADER = [{"header": {"key": "content-type", "value": "application/json"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]

# The cases, in their base order. family: which listener; script: which wrk script;
# expect: what every answer must be, checked with wrk's error count and the plugin's counters.
CASES = [
    # Through the upstream: against A.
    {"id": "A", "group": "first", "label": "A: Envoy, no plugin (POST)", "listener": "bare",
     "script": "unique", "method": "POST", "expect": "2xx"},
    # B1's request (a GET) without the plugin: a POST costs Envoy more (its body), so B1 is
    # compared with the same GET.
    {"id": "A_GET", "group": "pass", "label": "A: Envoy, no plugin (GET)", "listener": "bare",
     "script": "unique", "method": "GET", "expect": "2xx"},
    # The floor of any Wasm filter on B1's path: the control filter, doing nothing.
    {"id": "W0", "group": "pass", "label": "W0: a Wasm filter that does nothing (GET)", "listener": "wasm_noop",
     "script": "unique", "method": "GET", "expect": "2xx"},
    # The least a filter covering some methods must do on a request it does not cover: read
    # its method (one header lookup), then let it go.
    {"id": "W8", "group": "pass", "label": "W8: a Wasm filter reading the method (GET)",
     "listener": "wasm_method", "script": "unique", "method": "GET", "expect": "2xx"},
    {"id": "B1", "group": "pass", "label": "B1: plugin, request not covered (GET)", "listener": "plugin",
     "script": "unique", "method": "GET", "expect": "2xx"},
    # The floors of any Wasm filter on B2's paths: the control filter reads the whole request,
    # then lets the router send it (W1), or has its root send it and answers itself (W3).
    {"id": "W1", "group": "router", "label": "W1: a Wasm filter reading the request, router", "listener": "wasm_buffer",
     "script": "unique", "method": "POST", "expect": "2xx"},
    {"id": "W3", "group": "first", "label": "W3: a Wasm filter reading the request, root sends it",
     "listener": "wasm_detach", "script": "unique", "method": "POST", "expect": "2xx"},
    # W3 and W1 plus the digests, the claim (a bucket read and write, the clock) and the
    # completion (bucket and response read and written, the clock), on a table as large as
    # the plugin's here (--capacity's default): the least first call.
    {"id": "W9", "group": "first", "label": "W9: W3 + digests, claim, completion (least first call)",
     "listener": "wasm_detach_least", "script": "unique", "method": "POST", "expect": "2xx"},
    {"id": "W10", "group": "router", "label": "W10: W1 + digests, claim, completion (least, router)",
     "listener": "wasm_buffer_least", "script": "unique", "method": "POST", "expect": "2xx"},
    {"id": "B2_detached", "group": "first", "label": "B2: plugin, first call, detached", "listener": "plugin",
     "script": "unique", "method": "POST", "expect": "claimed"},
    {"id": "B2_router", "group": "router", "label": "B2: plugin, first call, router", "listener": "router",
     "script": "unique", "method": "POST", "expect": "claimed"},
    {"id": "B2_etcd", "group": "first", "label": "B2: plugin, first call, etcd store", "listener": "etcd",
     "script": "unique", "method": "POST", "expect": "claimed"},
    # Answered by Envoy itself: against C.
    {"id": "C", "group": "local", "label": "C: Envoy answers by itself", "listener": "local",
     "script": "fixed", "expect": "2xx"},
    # The floor of any Wasm filter answering by itself (B3, B4): the control filter reads the
    # whole request and answers 201; the upstream must see none of these requests.
    {"id": "W2", "group": "local", "label": "W2: a Wasm filter answering by itself", "listener": "wasm_local",
     "script": "fixed", "expect": "local"},
    # The fair floors of B3 and B4: a Wasm filter answering with the same status, headers
    # and body as the plugin's replay (W4) and its 409 (W5), probed before the run.
    {"id": "W4", "group": "replay", "label": "W4: a Wasm filter answering as the replay does", "listener": "wasm_replay",
     "script": "fixed", "expect": "local"},
    {"id": "W5", "group": "conflict", "label": "W5: a Wasm filter answering as the 409 does", "listener": "wasm_conflict",
     "script": "fixed", "expect": "local_error"},
    # The same, plus what any idempotency filter keeping its table in shared data must do
    # on the path: the three SHA-256 digests of a covered request (store key, body,
    # fingerprint; a request repeating the last one byte for byte reuses its digests, as the
    # plugin's digest memo does), one read of the key's bucket and one of the clock. The least
    # such a filter costs: the limit of the plugin's replay and 409.
    {"id": "W6", "group": "replay", "label": "W6: W4 + digests, clock (least replay, from a kept copy)",
     "listener": "wasm_replay_least", "script": "fixed", "expect": "local"},
    {"id": "W7", "group": "conflict", "label": "W7: W5 + digests, bucket read, clock (least 409)",
     "listener": "wasm_conflict_least", "script": "fixed", "expect": "local_error"},
    {"id": "B3", "group": "replay", "label": "B3: plugin, replay", "listener": "plugin",
     "script": "fixed", "expect": "replayed"},
    {"id": "B4", "group": "conflict", "label": "B4: plugin, conflict (409)", "listener": "plugin",
     "script": "fixed", "expect": "conflict"},
    # Fleet mode's replay: the Envoy that completed the key replays it from its own copy
    # (store.local_replays); against B3.
    {"id": "B3_etcd", "group": "replay", "label": "B3: plugin, replay, etcd store", "listener": "etcd",
     "script": "fixed", "expect": "replayed"},
]
ETCD_CASES = ("B2_etcd", "B3_etcd")


def log(msg):
    print(msg, flush=True)


# --- processes ------------------------------------------------------------------------


def pinned(cmd, cpus):
    """cmd under `taskset -c cpus` (taskset execs it: the PID is the program's own)."""
    if cpus and shutil.which("taskset"):
        return ["taskset", "-c", cpus] + cmd
    return cmd


class EnvoyProc(Envoy):
    """An Envoy on a bootstrap we build here (several listeners), pinned to `cpus`, quiet;
    harness.Envoy runs it and stops it by its own PID."""

    def __init__(self, name, config, concurrency, cpus=None, start_timeout=90):
        self.name = name
        wrapper = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
        super().__init__(None, None, concurrency=concurrency, log_level="warning",
                         wasm_log_level="warning", bootstrap=config, wrapper=wrapper,
                         start_timeout=start_timeout)

    def live(self):
        try:
            return request(self.admin_port, "GET", "/ready", timeout=1).text.strip() == "LIVE"
        except (OSError, http.client.HTTPException):
            return False

    def counters(self):
        """The plugin's counters and gauges, summed over its VMs: {short name: value}."""
        out = {}
        for name, value in admin_stats(self.admin_port, r"^wasmcustom\.", timeout=10).items():
            short = name.rsplit(".", 1)[-1]
            out[short] = out.get(short, 0) + value
        return out

    def cluster_requests(self, cluster="upstream"):
        """Requests this Envoy sent to `cluster` (all listeners); 0 if it has no such cluster."""
        regex = rf"^cluster\.{re.escape(cluster)}\.upstream_rq_total$"
        return sum(admin_stats(self.admin_port, regex, timeout=10).values())

    def cpu_s(self):
        return process_cpu_s(self.pid)

    def rss(self):
        return rss_bytes(self.pid)

    def log_tail(self, n=30):
        return "\n".join(self.log_text().splitlines()[-n:])


def process_cpu_s(pid):
    """CPU time (user + system) process `pid` has used, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def listener(name, port, routes, filters=()):
    return {
        "name": name,
        "address": {"socket_address": {"address": LOCALHOST, "port_value": port}},
        # wrk's connections split evenly over the two workers: the kernel's reuse_port hash
        # may give one worker 20 of 32, and that worker alone then sets the pace (the same
        # case moved by up to 50 % between rounds).
        "enable_reuse_port": False,
        "connection_balance_config": {"exact_balance": {}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network."
                         "http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": name,
                "route_config": {"name": name, "virtual_hosts": [
                    {"name": "all", "domains": ["*"], "routes": routes}]},
                "http_filters": list(filters) + [ROUTER],
            }}]}],
    }


def to_cluster(cluster):
    return {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "30s"}}


def direct(status, body, prefix="/"):
    return {"match": {"prefix": prefix},
            "direct_response": {"status": status, "body": {"inline_string": body}},
            "response_headers_to_add": JSON_HEADER}


def bootstrap(listeners, clusters):
    return {"admin": {"address": {"socket_address": {"address": LOCALHOST,
                                                     "port_value": free_port()}}},
            "static_resources": {"listeners": listeners, "clusters": clusters}}


def upstream_envoy(cpus):
    """The upstream: Envoy answering 201 by itself (1 KiB on /kib)."""
    port = free_port()
    routes = [direct(201, KIB_BODY, "/kib"), direct(201, UPSTREAM_BODY)]
    env = EnvoyProc("upstream", bootstrap([listener("upstream", port, routes, [BUFFER])], []),
                    concurrency=1, cpus=cpus)
    env.port = port
    return env


def plugin(config, name, wasm):
    return wasm_filter(config, vm_id=f"bench_{name}", wasm=wasm)


def control(mode, wasm, name=None):
    """The control filter (bench/controls/) in `mode`, in VMs of its own."""
    return wasm_filter(mode, vm_id=f"bench_control_{name or mode}", wasm=wasm, name="bench_control",
                       root_id="bench_control")


def answer_mode(resp):
    """The control mode that answers as `resp` did (all its headers but content-length)."""
    headers = "".join(f"{n}: {v}\n" for n, v in resp.headers if n.lower() != "content-length")
    return f"answer:{resp.status}\n{headers}\n{resp.body.decode()}"


def probe_answers(wasm, upstream_port, slow_port, cpus):
    """The plugin's replay and its 409 as a client gets them, from an Envoy of their own: the
    answers of the controls W4 and W5."""
    port = free_port()
    conf = {"namespace": "bench_probe", "lease_ms": 2000}
    env = EnvoyProc("probe", bootstrap(
        [listener("plugin", port, [SLOW_ROUTE, to_cluster("upstream")], [plugin(conf, "probe", wasm)])],
        [static_cluster("upstream", upstream_port), static_cluster("slow", slow_port)]), concurrency=1, cpus=cpus)
    try:
        key = f"probe-{os.urandom(4).hex()}"
        post(port, key)
        replay = post(port, key)
        sock = open_slow_call(port, key + "-slow", 10_000)
        try:
            deadline = time.monotonic() + 5
            while env.counters().get("claimed", 0) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            conflict = post(port, key + "-slow")
        finally:
            sock.close()
    finally:
        env.stop()
    if replay.header("idempotent-replayed") != "true" or conflict.status != 409:
        raise RuntimeError(f"probe: replay {replay.status}, conflict {conflict.status}")
    return answer_mode(replay), answer_mode(conflict)


SLOW_ROUTE = {"match": {"prefix": "/", "headers": [{"name": "x-bench-slow", "present_match": True}]},
              "route": {"cluster": "slow", "timeout": "60s"}}


def front_envoy(wasm, control_wasm, upstream_port, slow_port, etcd_port, capacity, cpus,
                answers=None):
    """`answers`: the control modes of W4 and W5 (probe_answers)."""
    controls = ("wasm_noop", "wasm_method", "wasm_local", "wasm_buffer", "wasm_detach", "wasm_replay", "wasm_conflict",
                "wasm_replay_least", "wasm_conflict_least", "wasm_detach_least", "wasm_buffer_least")
    ports = {n: free_port() for n in ("bare", "local", "plugin", "router", "etcd", *controls)}
    base = {"capacity": capacity}
    # lease_ms 2000 (renewed every 500 ms): the conflict case's slow call (several seconds)
    # only stays in progress because its lease is renewed.
    p_conf = dict(base, namespace="bench_plugin", lease_ms=2000)
    r_conf = dict(base, namespace="bench_router", forward="router")
    e_conf = {"namespace": "bench_etcd", "store": {"kind": "etcd", "cluster": "etcd"}}
    # Every listener with a Wasm filter routes alike (the plugin's needs the slow route for
    # B4's held call): a floor must not match routes more cheaply than the case it is for.
    routes = [SLOW_ROUTE, to_cluster("upstream")]
    listeners = [
        listener("bare", ports["bare"], [to_cluster("upstream")]),
        listener("local", ports["local"], [direct(201, UPSTREAM_BODY)], [BUFFER]),
        listener("plugin", ports["plugin"], routes,
                 [plugin(p_conf, "plugin", wasm)]),
        listener("router", ports["router"], routes,
                 [plugin(r_conf, "router", wasm)]),
    ]
    if control_wasm:
        listeners += [
            listener("wasm_noop", ports["wasm_noop"], routes,
                     [control("noop", control_wasm)]),
            listener("wasm_method", ports["wasm_method"], routes,
                     [control("calls:header:1", control_wasm, name="method")]),
            # Routed to the upstream: an answer from there would be a failure of the case.
            listener("wasm_local", ports["wasm_local"], routes,
                     [control("local", control_wasm)]),
            listener("wasm_buffer", ports["wasm_buffer"], routes,
                     [control("buffer", control_wasm)]),
            # The root sends to the route's cluster (read as the plugin reads it).
            listener("wasm_detach", ports["wasm_detach"], routes,
                     [control("detach", control_wasm)]),
            listener("wasm_replay", ports["wasm_replay"], routes,
                     [control(answers[0], control_wasm, name="replay")]),
            listener("wasm_conflict", ports["wasm_conflict"], routes,
                     [control(answers[1], control_wasm, name="conflict")]),
            listener("wasm_replay_least", ports["wasm_replay_least"], routes,
                     [control("least-kept-" + answers[0], control_wasm, name="replay_least")]),
            listener("wasm_conflict_least", ports["wasm_conflict_least"], routes,
                     [control("least-" + answers[1], control_wasm, name="conflict_least")]),
            listener("wasm_detach_least", ports["wasm_detach_least"], routes,
                     [control("least-detach", control_wasm, name="detach_least")]),
            listener("wasm_buffer_least", ports["wasm_buffer_least"], routes,
                     [control("least-buffer", control_wasm, name="buffer_least")]),
        ]
    else:
        for name in controls:
            del ports[name]
    clusters = [static_cluster("upstream", upstream_port), static_cluster("slow", slow_port)]
    if etcd_port:
        listeners.append(listener("etcd", ports["etcd"], routes,
                                  [plugin(e_conf, "etcd", wasm)]))
        clusters.append(static_cluster("etcd", etcd_port, http2=True))  # gRPC: the default API
    else:
        del ports["etcd"]
    env = EnvoyProc("front", bootstrap(listeners, clusters), concurrency=2, cpus=cpus)
    env.listener_ports = ports
    return env


def memory_envoy(wasm, upstream_port, capacity, cpus):
    ports = {"plugin": free_port()}
    conf = {"namespace": "bench_mem", "capacity": capacity}
    listeners = [listener("plugin", ports["plugin"], [to_cluster("upstream")],
                          [plugin(conf, "mem", wasm)])]
    env = EnvoyProc("memory", bootstrap(listeners, [static_cluster("upstream", upstream_port)]),
                    concurrency=2, cpus=cpus)
    env.listener_ports = ports
    return env


# --- requests ---------------------------------------------------------------------------


def post(port, key, path="/payments", extra=None, timeout=10):
    headers = [("Host", HOST), ("Content-Type", "application/json"), CALLER]
    if key is not None:
        headers.append(("Idempotency-Key", key))
    headers += list(extra or [])
    return request(port, "POST", path, headers, BODY, timeout=timeout)


def open_slow_call(port, key, delay_ms):
    """Sends the first request of `key` to the slow upstream and leaves it in flight.

    Same method, path, content-type and body as fixed.lua (same fingerprint); the extra
    headers are not part of it. Detached forwarding: the call goes on whatever the client
    does; the socket is kept open anyway and closed by the caller.
    """
    head = (f"POST /payments HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"{CALLER[0]}: {CALLER[1]}\r\n"
            f"Content-Length: {len(BODY)}\r\nIdempotency-Key: {key}\r\n"
            f"x-bench-slow: 1\r\nx-delay-ms: {delay_ms}\r\n\r\n").encode()
    sock = socket.create_connection((LOCALHOST, port), timeout=5)
    sock.sendall(head + BODY)
    return sock


def send_many(port, keys, path, threads=8):
    """POSTs each key once on keep-alive connections; returns a {status: count}."""
    statuses = {}
    lock = threading.Lock()
    it = iter(keys)

    def worker():
        conn = http.client.HTTPConnection(LOCALHOST, port, timeout=30)
        local = {}
        while True:
            with lock:
                key = next(it, None)
            if key is None:
                break
            headers = [("Host", HOST), ("Content-Type", "application/json"), CALLER]
            if key:
                headers.append(("Idempotency-Key", key))
            try:
                status = request(port, "POST", path, headers, BODY, conn=conn).status
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(LOCALHOST, port, timeout=30)
                status = request(port, "POST", path, headers, BODY, conn=conn).status
            local[status] = local.get(status, 0) + 1
        conn.close()
        with lock:
            for s, n in local.items():
                statuses[s] = statuses.get(s, 0) + n

    ts = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    return statuses


def get_many(port, n, path):
    for _ in range(n):
        request(port, "GET", path, [("Host", HOST)], timeout=10)


# --- wrk ------------------------------------------------------------------------------


def run_wrk(port, case, args, duration, prefix=None, key=None, cpus=None):
    script = os.path.join(BENCH_DIR, f"{case['script']}.lua")
    cmd = ["wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{duration}s",
           "--timeout", "5s", "-s", script, f"http://{LOCALHOST}:{port}/payments", "--"]
    if case["script"] == "unique":
        cmd += [prefix, case["method"], "/payments", HOST]
    else:
        cmd += [key, "/payments", HOST]
    out = subprocess.run(pinned(cmd, cpus), capture_output=True, text=True,
                         timeout=duration + 30, stdin=subprocess.DEVNULL)
    m = re.search(r"^WRKJSON (\{.*\})$", out.stdout, re.M)
    if not m:
        raise RuntimeError(f"wrk gave no result: {out.stdout}\n{out.stderr}")
    r = json.loads(m.group(1))
    r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
    return r


def check_run(case, r, delta, connections):
    """Problems with a run, as strings (empty: the answers were those of the case)."""
    n = r["requests"]
    bad = []
    socket_errors = r["connect_errors"] + r["read_errors"] + r["write_errors"] + r["timeouts"]
    if socket_errors:
        bad.append(f"{socket_errors} socket errors/timeouts")
    if n == 0:
        return bad + ["no request completed"]
    expect = case["expect"]
    if expect == "local_error":
        if r["status_errors"] != n:
            bad.append(f"{n - r['status_errors']} of {n} answers were not the control's 409")
        if delta.get("upstream_rq", 0):
            bad.append(f"{delta['upstream_rq']} requests reached the upstream")
    elif expect == "conflict":
        if r["status_errors"] != n:
            bad.append(f"{n - r['status_errors']} of {n} answers were not errors (409 expected)")
        if delta.get("conflict", 0) < n:
            bad.append(f"conflict counter +{delta.get('conflict', 0)} < {n} requests")
    elif r["status_errors"]:
        bad.append(f"{r['status_errors']} answers > 399")
    if expect == "local" and delta.get("upstream_rq", 0):
        bad.append(f"{delta['upstream_rq']} requests reached the upstream")
    if expect == "claimed":
        claimed, completed = delta.get("claimed", 0), delta.get("completed", 0)
        if not n <= claimed <= n + connections:
            bad.append(f"claimed +{claimed} for {n} requests")
        if completed < n - connections:
            bad.append(f"completed +{completed} for {n} requests")
    if expect == "replayed" and delta.get("replayed", 0) < n:
        bad.append(f"replayed +{delta.get('replayed', 0)} < {n} requests")
    if expect in ("2xx", "local") and delta.get("claimed", 0):
        bad.append(f"claimed +{delta['claimed']} on a case that must not claim")
    # wrk closes its connections when a round ends: a claim etcd answers after its client
    # left is given back at once (nothing went upstream, docs/behaviour.md §3.5), at most one
    # per connection. Shared data answers a claim within the request's own callback.
    released_at_the_end = connections if expect == "claimed" and case.get("listener") == "etcd" else 0
    for c in ("store_full", "store_error", "upstream_failed", "released"):
        allowed = released_at_the_end if c == "released" else 0
        if delta.get(c, 0) > allowed:
            bad.append(f"{c} +{delta[c]}")
    return bad


# --- the run ----------------------------------------------------------------------------


def machine_info():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    envoy_version = subprocess.run([envoy_binary(), "--version"], capture_output=True,
                                   text=True).stdout.strip()
    m = re.search(r"/(\d+\.\d+\.\d+)/", envoy_version)
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "kernel": platform.release(),
        "envoy_version": m.group(1) if m else envoy_version,
        "wrk_version": (wrk_version.split("[")[0].replace("wrk", "").strip()
                        if wrk_version else "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_start": os.getloadavg()[0],
    }


def round_order(cases, rnd):
    """The cases of round `rnd`: each group (a plugin case and the floors it is judged
    against) runs back to back, so that a ratio compares runs seconds apart; the groups'
    order rotates by one each round and every other round runs each group backwards, so that
    no case always runs first or after the same neighbour."""
    by_group = {}
    for c in cases:
        by_group.setdefault(c["group"], []).append(c)
    groups = list(by_group.values())
    k = rnd % len(groups) if groups else 0
    groups = groups[k:] + groups[:k]
    return [c for g in groups for c in (g if rnd % 2 == 0 else g[::-1])]


def median(xs):
    return statistics.median(xs) if xs else 0.0


INTERVAL_COVERAGE = 0.90


def median_interval(xs):
    """A distribution-free confidence interval of the median: the k-th smallest and k-th
    largest of the values (interval_rank). With 8 rounds: the second smallest and second
    largest, 93 %. Returns (low, high, coverage)."""
    xs = sorted(xs)
    n = len(xs)
    if not n:
        return (float("nan"), float("nan"), 0.0)
    k, coverage = interval_rank(n)
    return (xs[k - 1], xs[n - k], coverage)


def interval_rank(n):
    """(k, coverage) for n values: k as large as keeps the chance that the true median lies
    between the k-th smallest and k-th largest at INTERVAL_COVERAGE or more (the count below
    the median is Binomial(n, 1/2)); k is at least 1."""
    k = 1
    while k + 1 <= n // 2 and median_coverage(n, k + 1) >= INTERVAL_COVERAGE:
        k += 1
    return k, median_coverage(n, k)


def median_ratio(xs):
    """The median of a run's per-round ratios; NaN when no round has the pair."""
    return statistics.median(xs) if xs else float("nan")


def median_coverage(n, k):
    """P(x_(k) <= median < x_(n+1-k)) for n independent values: 1 - 2 P(Binomial(n, 1/2) < k)."""
    below = sum(math.comb(n, i) for i in range(k)) / 2 ** n
    return 1 - 2 * below


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=int, default=3, help="seconds per measured run")
    ap.add_argument("--warmup", type=int, default=1, help="seconds of warm-up per case")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--capacity", type=int, default=262144,
                    help="table size of the first-call listeners (every key stays stored)")
    ap.add_argument("--memory-keys", type=int, default=10000)
    ap.add_argument("--memory-capacity", type=int, default=16384)
    two = (os.cpu_count() or 1) >= 2
    # Both Envoys may use cores 0-1; wrk (one thread) stays on core 1, so it never migrates.
    # On 2 cores, pinning wrk gave the highest and steadiest figures; putting the Envoy under
    # test on one core and wrk plus the upstream on the other gave the lowest.
    ap.add_argument("--cpus-envoy", default="0-1" if two else "",
                    help="taskset list for the Envoy under test ('' = no pinning)")
    ap.add_argument("--cpus-upstream", default="0-1" if two else "",
                    help="taskset list for the upstream Envoy")
    ap.add_argument("--cpus-wrk", default="1" if two else "", help="taskset list for wrk")
    ap.add_argument("--control-wasm", default=CONTROL_WASM,
                    help="the control filters (bench/controls/, built by make bench)")
    ap.add_argument("--no-etcd", action="store_true")
    ap.add_argument("--cases", default="", help="comma-separated case ids (default: all)")
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "docs", "bench"))
    args = ap.parse_args()

    if not shutil.which("wrk"):
        sys.exit("wrk not found (make bench installs it)")
    src_wasm = wasm_path()
    if not os.path.isfile(src_wasm):
        sys.exit(f"no plugin at {src_wasm}: run make build")
    started = time.monotonic()
    info = machine_info()
    work = tempfile.mkdtemp(prefix="idem-bench-")
    wasm = os.path.join(work, "idempotency.wasm")
    shutil.copyfile(src_wasm, wasm)  # a rebuild of dist/ during the run changes nothing
    with open(wasm, "rb") as f:
        wasm_bytes = f.read()
    info["wasm_bytes"] = len(wasm_bytes)
    info["wasm_sha256"] = hashlib.sha256(wasm_bytes).hexdigest()[:16]
    log(f"machine: {info['nproc']} cores, {info['cpu_model']}, kernel {info['kernel']}, "
        f"Envoy {info['envoy_version']}, wrk {info['wrk_version']}, "
        f"load {info['loadavg_start']:.2f}")
    log(f"plugin: {src_wasm}: {len(wasm_bytes):,} bytes ({len(wasm_bytes) / 1024:.0f} KiB)")

    cases = CASES
    etcd = None
    if args.no_etcd or not shutil.which("etcd"):
        cases = [c for c in cases if c["id"] not in ETCD_CASES]
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c["id"] in wanted]
    control_wasm = None
    if any(c["listener"].startswith("wasm_") for c in cases):
        if not os.path.isfile(args.control_wasm):
            sys.exit(f"no control filter at {args.control_wasm}: run make bench (it builds "
                     "bench/controls/)")
        control_wasm = os.path.join(work, "bench_controls.wasm")
        shutil.copyfile(args.control_wasm, control_wasm)
        with open(control_wasm, "rb") as f:
            control_bytes = f.read()
        info["control_wasm_bytes"] = len(control_bytes)
        info["control_wasm_sha256"] = hashlib.sha256(control_bytes).hexdigest()[:16]
        log(f"controls: {args.control_wasm}: {len(control_bytes):,} bytes")
    procs = []
    slow = up = front = None
    try:
        if any(c["id"] in ETCD_CASES for c in cases):
            from etcd_util import Etcd
            etcd = Etcd()
        slow = Upstream()
        up = upstream_envoy(args.cpus_upstream)
        procs.append(up)
        t0 = time.monotonic()
        answers = probe_answers(wasm, up.port, slow.port, args.cpus_envoy) if control_wasm else None
        front = front_envoy(wasm, control_wasm, up.port, slow.port, etcd.port if etcd else None,
                            args.capacity, args.cpus_envoy, answers)
        procs.append(front)
        log(f"envoy under test ready in {time.monotonic() - t0:.1f} s (pid {front.pid}, "
            f"upstream envoy pid {up.pid}); pinning: envoy={args.cpus_envoy or 'any'} "
            f"upstream={args.cpus_upstream or 'any'} wrk={args.cpus_wrk or 'any'}")
        ports = front.listener_ports
        nonce = os.urandom(4).hex()

        # Functional checks: each listener does what its cases assume.
        r = post(ports["bare"], f"chk-{nonce}")
        assert r.status == 201 and r.header("idempotent-replayed") is None, r
        assert post(ports["local"], None).status == 201
        if control_wasm:
            # W0 goes through to the upstream (the router adds its timing header); W2 is
            # answered by the control filter (same body as the upstream's, no such header).
            r = request(ports["wasm_noop"], "GET", "/payments",
                        [("Host", HOST), ("Idempotency-Key", f"chk-w0-{nonce}")])
            assert r.status == 201 and r.header("x-envoy-upstream-service-time") is not None, r
            r = post(ports["wasm_local"], f"chk-w2-{nonce}")
            assert r.status == 201 and r.body == UPSTREAM_BODY.encode() \
                and r.header("x-envoy-upstream-service-time") is None, r
            # W1 and W3 reach the upstream: W1 through the router, W3 by the root's call
            # (whose answer the control sends on, with the upstream's own headers).
            for fam in ("wasm_buffer", "wasm_detach", "wasm_buffer_least", "wasm_detach_least"):
                r = post(ports[fam], f"chk-{fam}-{nonce}")
                assert r.status == 201 and r.body == UPSTREAM_BODY.encode() \
                    and r.header("x-envoy-upstream-service-time") is not None, (fam, r)
        for fam in [c["listener"] for c in cases if c["expect"] == "claimed"]:
            k = f"chk-{fam}-{nonce}"
            # Read your writes, with etcd too: the retry right after the answer is a replay.
            first, again = post(ports[fam], k), post(ports[fam], k)
            assert first.status == 201 and again.header("idempotent-replayed") == "true", \
                (fam, first, again)
        replay_key = f"replay-{nonce}"
        first, again = post(ports["plugin"], replay_key), post(ports["plugin"], replay_key)
        assert first.status == 201 and again.header("idempotent-replayed") == "true", again

        runs = {c["id"]: [] for c in cases}
        problems = []
        slow_delay_ms = (args.duration + 4) * 1000  # outlives the run, > 2 x lease_ms

        def run_case(case, duration, tag):
            port = ports[case["listener"]]
            sock = None
            key = replay_key
            if case["expect"] == "replayed":
                # A key stored just now: the first-call rounds fill the table, and a full
                # bucket evicts its oldest answers (an older replay key among them).
                key = f"replay-{tag}-{nonce}"
                first, again = post(port, key), post(port, key)
                if first.status != 201 or again.header("idempotent-replayed") != "true":
                    raise RuntimeError(f"the replay key answers {again.status}, not a replay")
            if case["id"] == "B4":
                key = f"conflict-{tag}-{nonce}"
                claimed = front.counters().get("claimed", 0)
                sock = open_slow_call(ports["plugin"], key, slow_delay_ms)
                # Wait for its claim (nothing else runs now) before any other request of
                # that key: one sent earlier could win the claim itself.
                deadline = time.monotonic() + 5
                while front.counters().get("claimed", 0) <= claimed:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the slow call did not claim its key")
                    time.sleep(0.02)
                status = post(port, key).status
                if status != 409:
                    raise RuntimeError(f"the slow call's key answers {status}, not 409")
            before = front.counters()
            if case["expect"] in ("local", "local_error"):
                before["upstream_rq"] = front.cluster_requests()
            on_etcd = case["id"] in ETCD_CASES
            etcd_rq0 = front.cluster_requests("etcd") if on_etcd else 0
            cpu0 = (front.cpu_s(), up.cpu_s(), process_cpu_s(etcd.proc.pid) if on_etcd else 0)
            try:
                r = run_wrk(port, case, args, duration, prefix=f"{case['id']}-{tag}-{nonce}",
                            key=key, cpus=args.cpus_wrk)
                cpu1 = (front.cpu_s(), up.cpu_s(), process_cpu_s(etcd.proc.pid) if on_etcd else 0)
                # CPU per request: steadier than req/s on a shared machine.
                n = max(r["requests"], 1)
                r["envoy_cpu_us"] = (cpu1[0] - cpu0[0]) / n * 1e6
                r["upstream_cpu_us"] = (cpu1[1] - cpu0[1]) / n * 1e6
                if on_etcd:
                    r["etcd_cpu_us"] = (cpu1[2] - cpu0[2]) / n * 1e6
                    r["etcd_rq_per_req"] = (front.cluster_requests("etcd") - etcd_rq0) / n
                time.sleep(0.2)  # let the last in-flight detached calls complete
                after = front.counters()
                if case["expect"] in ("local", "local_error"):
                    after["upstream_rq"] = front.cluster_requests()
                if case["id"] == "B4":
                    # The mark outlived several lease_ms thanks to renewal: still 409 now.
                    still = post(port, key).status
                    if still != 409:
                        problems.append(f"{case['id']} {tag}: after the run the key "
                                        f"answered {still}, not 409")
            finally:
                if sock:
                    sock.close()
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            return r, delta

        log(f"warm-up: {args.warmup} s per case")
        for case in cases:
            run_case(case, args.warmup, "warm")

        log(f"measuring: {len(cases)} cases x {args.rounds} rounds x {args.duration} s, "
            f"wrk -t{args.threads} -c{args.connections}, interleaved")
        for rnd in range(args.rounds):
            for case in round_order(cases, rnd):
                r, delta = run_case(case, args.duration, f"r{rnd}")
                bad = check_run(case, r, delta, args.connections)
                r["round"] = rnd
                r["counters"] = {k: v for k, v in delta.items() if v}
                r["problems"] = bad
                runs[case["id"]].append(r)
                if bad:
                    problems.append(f"{case['id']} round {rnd}: " + "; ".join(bad))
                log(f"  round {rnd + 1} {case['id']:<12} {r['rps']:>9.0f} req/s  "
                    f"p50 {r['p50_us'] / 1000:6.2f} ms  p99 {r['p99_us'] / 1000:6.2f} ms  "
                    f"envoy {r['envoy_cpu_us']:5.0f} us CPU/req"
                    + (f"  !! {'; '.join(bad)}" if bad else ""))
        front.stop()
        procs.remove(front)
        front = None

        # Memory: bytes per stored entry, 1 KiB responses.
        log(f"memory: capacity {args.memory_capacity}, {args.memory_keys} keys, "
            f"1 KiB answers")
        mem_env = memory_envoy(wasm, up.port, args.memory_capacity, args.cpus_envoy)
        procs.append(mem_env)
        mem = measure_memory(mem_env, args.memory_keys, nonce, args.memory_capacity)
        if mem["statuses"] != {"201": args.memory_keys} or mem["completed"] != args.memory_keys \
                or mem["replayed_header"] != "true":
            problems.append(f"memory: statuses {mem['statuses']}, completed "
                            f"{mem['completed']}, replay {mem['replayed_header']}")
        mem_env.stop()
        procs.remove(mem_env)
    finally:
        for p in reversed(procs):
            p.stop()
        if slow:
            slow.stop()
        if etcd:
            etcd.close()
        shutil.rmtree(work, ignore_errors=True)

    info["loadavg_end"] = os.getloadavg()[0]
    summary = summarize(cases, runs)
    ratios = compute_ratios(runs)
    cpu_ratios = compute_ratios(runs, "envoy_cpu_us")
    floor, limit, vs_floor, vs_least = compute_floor(runs, "rps")
    cpu_floor, cpu_limit, cpu_vs_floor, cpu_vs_least = compute_floor(runs, "envoy_cpu_us")
    _, limit_ci, vs_floor_ci, vs_least_ci = compute_floor(runs, "rps", median_interval)
    fleet = compute_fleet(summary, runs)
    results = {
        "machine": info,
        "method": {
            "wrk": f"-t{args.threads} -c{args.connections} -d{args.duration}s",
            "rounds": args.rounds, "warmup_s": args.warmup,
            "pinning": {"envoy": args.cpus_envoy or "any",
                        "upstream": args.cpus_upstream or "any",
                        "wrk": args.cpus_wrk or "any"},
            "envoy_concurrency": 2, "upstream": "Envoy direct_response (concurrency 1)",
            "capacity_first_call": args.capacity,
        },
        "cases": summary,
        "runs": runs,
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        "floor": floor,
        "vs_floor": vs_floor,
        "cpu_floor": cpu_floor,
        "cpu_vs_floor": cpu_vs_floor,
        "limit": limit,
        "vs_least": vs_least,
        "cpu_limit": cpu_limit,
        "cpu_vs_least": cpu_vs_least,
        # Each ratio's confidence interval over the rounds: [low, high, coverage].
        "limit_interval": limit_ci,
        "vs_floor_interval": vs_floor_ci,
        "vs_least_interval": vs_least_ci,
        "fleet": fleet,
        "memory": mem,
        "problems": problems,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    write_outputs(args.out, results)
    print_table(summary, mem, info, problems)
    log(f"wrote {os.path.relpath(args.out, REPO_ROOT)}/results.json, results.md, chart.svg "
        f"({results['elapsed_s']:.0f} s)")
    log("CPU per request, same pairs (cost x): " + " ".join(
        f"{k}={v:.2f}" for k, v in cpu_ratios.items()))
    log("FLOOR " + " ".join(f"{k}={v:.2f}" for k, v in floor.items()))
    log("VS_FLOOR " + " ".join(f"{k}={v:.2f}" for k, v in vs_floor.items()))
    log("LIMIT " + " ".join(f"{k}={v:.2f}" for k, v in limit.items()))
    log("VS_LEAST " + " ".join(f"{k}={v:.2f}" for k, v in vs_least.items()))
    log(f"INTERVALS of the medians ({interval_coverage(vs_floor_ci):.0%}):")
    for name, cis in (("VS_FLOOR", vs_floor_ci), ("LIMIT", limit_ci), ("VS_LEAST", vs_least_ci)):
        log(f"  {name} " + " ".join(f"{k}={lo:.2f}..{hi:.2f}" for k, (lo, hi, _) in cis.items()))
    log("RATIOS " + " ".join(f"{k}={v:.2f}" for k, v in ratios.items()))
    if fleet:
        log("FLEET " + " ".join(f"{k}={fleet[k]:.2f}" for k in ("first_call", "replay") if k in fleet))
        log("FLEET_COST " + " ".join(f"{k}={v:.2f}" for k, v in fleet.items()
                                     if k not in ("first_call", "replay")))


def measure_memory(env, n, nonce, capacity):
    """Envoy's RSS (and tcmalloc's bytes in use) per stored entry, 1 KiB answers.

    Same listener, same route, same 1 KiB answers for the warm-up, the control and the
    measurement; only the measurement's requests carry a key (covered: stored). The control
    (as many requests without a key) shows what serving alone leaves behind.
    """
    port = env.listener_ports["plugin"]
    get_many(port, 300, "/kib")
    send_many(port, [""] * 2000, "/kib")

    def snapshot():
        time.sleep(1.5)  # let completions and frees settle
        samples = []
        for _ in range(5):
            samples.append(env.rss())
            time.sleep(0.1)
        heap = json.loads(request(env.admin_port, "GET", "/memory", timeout=10).text)
        return int(median(samples)), int(heap.get("allocated", 0)), \
            int(heap.get("pageheap_free", 0))

    rss0, alloc0, free0 = snapshot()
    control = send_many(port, [""] * n, "/kib")
    rss1, alloc1, free1 = snapshot()
    before = env.counters()
    stored = send_many(port, [f"mem-{nonce}-{i}" for i in range(n)], "/kib")
    rss2, alloc2, free2 = snapshot()
    after = env.counters()
    # One replay: what one stored entry holds (status, headers, 1 KiB body).
    replay = post(port, f"mem-{nonce}-0", path="/kib")
    headers = [(k, v) for k, v in replay.headers
               if k.lower() not in ("content-length", "idempotent-replayed", "connection",
                                    "transfer-encoding")]
    header_bytes = sum(6 + len(k) + len(v) for k, v in headers)
    return {
        "capacity": capacity,
        "keys": n,
        "statuses": {str(k): v for k, v in stored.items()},
        "statuses_control": {str(k): v for k, v in control.items()},
        "completed": after.get("completed", 0) - before.get("completed", 0),
        "entries_completed_gauge": after.get("entries_completed", 0),
        "replay_status": replay.status,
        "replayed_header": replay.header("idempotent-replayed"),
        "rss": [rss0, rss1, rss2],
        "heap_allocated": [alloc0, alloc1, alloc2],
        "pageheap_free": [free0, free1, free2],
        "bytes_per_entry": round((rss2 - rss1) / n),
        "heap_bytes_per_entry": round((alloc2 - alloc1) / n),
        "control_bytes_per_request": round((rss1 - rss0) / n),
        "stored_body_bytes": len(replay.body),
        "stored_header_bytes": header_bytes,
        # docs/memory.md's model: 93 (Envoy per key) + 38 (our footer) + H + R per stored
        # entry, H counting 6 bytes of framing per header besides name and value.
        "model_bytes_per_entry": 93 + 38 + header_bytes + len(replay.body),
    }


def summarize(cases, runs):
    out = []
    for c in cases:
        rs = runs[c["id"]]
        out.append({
            "id": c["id"], "label": c["label"],
            "rps": round(median([r["rps"] for r in rs]), 1),
            "rps_min": round(min(r["rps"] for r in rs), 1),
            "rps_max": round(max(r["rps"] for r in rs), 1),
            "p50_ms": round(median([r["p50_us"] for r in rs]) / 1000, 3),
            "p99_ms": round(median([r["p99_us"] for r in rs]) / 1000, 3),
            "envoy_cpu_us": round(median([r["envoy_cpu_us"] for r in rs]), 1),
            "upstream_cpu_us": round(median([r["upstream_cpu_us"] for r in rs]), 1),
            **({"etcd_cpu_us": round(median([r["etcd_cpu_us"] for r in rs]), 1),
                "etcd_rq_per_req": round(median([r["etcd_rq_per_req"] for r in rs]), 3)}
               if rs and "etcd_cpu_us" in rs[0] else {}),
            "requests": sum(r["requests"] for r in rs),
            "status_errors": sum(r["status_errors"] for r in rs),
            "ok": all(not r["problems"] for r in rs),
        })
    return out


def paired(runs, field, stat=median_ratio):
    """ratio(a, b): the median over rounds of a's `field` over b's in the same round (the two
    ran seconds apart, see round_order), so that the machine's drift between rounds cancels;
    with stat=median_interval, that median's confidence interval."""
    by_round = {cid: {r["round"]: r[field] for r in rs} for cid, rs in runs.items()}

    def ratio(a, b):
        xs, ys = by_round.get(a, {}), by_round.get(b, {})
        return stat([xs[k] / ys[k] for k in xs if k in ys and ys[k]])
    return ratio


def compute_ratios(runs, field="rps"):
    """Against Envoy alone; with field "envoy_cpu_us", as CPU per request (cost x)."""
    ratio = paired(runs, field)
    return {"passthrough": ratio("B1", "A_GET"), "first_call": ratio("B2_detached", "A"),
            "replay": ratio("B3", "C"), "conflict": ratio("B4", "C")}


def interval_coverage(intervals):
    return min((c for _, _, c in intervals.values()), default=0.0)


def compute_fleet(summary, runs):
    """Fleet mode against one Envoy (req/s, same run), what etcd costs, and the limit the
    machine puts on it: with every core busy, first calls/s are at most cores / (CPU per
    request of every process on the path), so etcd's CPU caps the ratio at `cpu_bound`."""
    s = {x["id"]: x for x in summary}
    if "B2_etcd" not in s or "B2_detached" not in s:
        return {}
    ratio = paired(runs, "rps")
    etcd, shared = s["B2_etcd"], s["B2_detached"]
    out = {"first_call": ratio("B2_etcd", "B2_detached")}
    if "B3_etcd" in s and "B3" in s:
        out["replay"] = ratio("B3_etcd", "B3")
    path = shared["envoy_cpu_us"] + shared["upstream_cpu_us"]
    path_etcd = etcd["envoy_cpu_us"] + etcd["upstream_cpu_us"] + etcd["etcd_cpu_us"]
    out.update({"etcd_rq_per_first_call": etcd["etcd_rq_per_req"],
                "etcd_cpu_us_per_first_call": etcd["etcd_cpu_us"],
                "cpu_bound": path / path_etcd if path_etcd else float("nan")})
    if "B3_etcd" in s:
        out["etcd_rq_per_replay"] = s["B3_etcd"]["etcd_rq_per_req"]
    return out


def compute_floor(runs, field, stat=median_ratio):
    """The controls against Envoy alone (floor), the plugin against the controls (vs_floor),
    paired by round.

    field "rps": ratios of req/s; "envoy_cpu_us": ratios of CPU per request (cost x);
    stat=median_interval: each ratio's confidence interval instead of its value.
    """
    ratio = paired(runs, field, stat)
    return ({"passthrough": ratio("W0", "A_GET"), "first_call": ratio("W3", "A"),
             "first_call_router": ratio("W1", "A"), "local_answer": ratio("W2", "C")},
            # What the least an idempotency filter does costs above each floor: how close to
            # the floor any plugin can come (the limit of the VS_FLOOR goals).
            {"passthrough": ratio("W8", "W0"), "first_call": ratio("W9", "W3"),
             "first_call_router": ratio("W10", "W1"), "replay": ratio("W6", "W4"),
             "conflict": ratio("W7", "W5")},
            {"passthrough": ratio("B1", "W0"), "first_call": ratio("B2_detached", "W3"),
             "first_call_router": ratio("B2_router", "W1"), "replay": ratio("B3", "W4"),
             "conflict": ratio("B4", "W5"), "replay_w2": ratio("B3", "W2"),
             "conflict_w2": ratio("B4", "W2")},
            # The plugin against the least: its own share above what the design needs.
            {"passthrough": ratio("B1", "W8"), "first_call": ratio("B2_detached", "W9"),
             "first_call_router": ratio("B2_router", "W10"), "replay": ratio("B3", "W6"),
             "conflict": ratio("B4", "W7")})


def table_lines(summary):
    lines = ["| case | req/s (median) | min–max | p50 ms | p99 ms | Envoy CPU µs/req | "
             "checks |", "|---|---:|---:|---:|---:|---:|---|"]
    for s in summary:
        lines.append(f"| {s['label']} | {s['rps']:,.0f} | {s['rps_min']:,.0f}–"
                     f"{s['rps_max']:,.0f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
                     f"{s['envoy_cpu_us']:.0f} | {'ok' if s['ok'] else 'FAILED'} |")
    return lines


def print_table(summary, mem, info, problems):
    log("")
    w = max(len(s["label"]) for s in summary)
    log(f"{'case':<{w}}  {'req/s':>9}  {'min':>8}  {'max':>8}  {'p50 ms':>7}  {'p99 ms':>7}"
        f"  {'CPU us/req':>10}")
    for s in summary:
        log(f"{s['label']:<{w}}  {s['rps']:>9,.0f}  {s['rps_min']:>8,.0f}  "
            f"{s['rps_max']:>8,.0f}  {s['p50_ms']:>7.2f}  {s['p99_ms']:>7.2f}"
            f"  {s['envoy_cpu_us']:>10.0f}"
            + ("" if s["ok"] else "  FAILED"))
    log("")
    log(f"memory: {mem['bytes_per_entry']:,} bytes of Envoy RSS per stored entry, "
        f"{mem['heap_bytes_per_entry']:,} bytes of heap in use ({mem['keys']:,} keys, "
        f"{mem['stored_body_bytes']} B body + {mem['stored_header_bytes']} B headers each; "
        f"model of docs/memory.md {mem['model_bytes_per_entry']:,} B); control (same requests "
        f"without a key): {mem['control_bytes_per_request']:,} B per request")
    log(f"plugin size: {info['wasm_bytes']:,} bytes")
    for p in problems:
        log(f"PROBLEM {p}")


def write_outputs(out, results):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "chart.svg"), "w") as f:
        f.write(svg_chart(results["cases"], results["machine"]))
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(results))


def markdown(res):
    m, meth, mem, ratios = res["machine"], res["method"], res["memory"], res["ratios"]
    cpu_ratios = res["cpu_ratios"]
    floor, vs_floor = res["floor"], res["vs_floor"]
    cpu_floor, cpu_vs_floor = res["cpu_floor"], res["cpu_vs_floor"]
    limit, vs_least = res["limit"], res["vs_least"]
    cpu_limit, cpu_vs_least = res["cpu_limit"], res["cpu_vs_least"]
    intervals = {name: res.get(name + "_interval") or {} for name in ("vs_floor", "limit", "vs_least")}

    def ci(name, k):
        lo, hi, _ = intervals[name].get(k, (float("nan"), float("nan"), 0))
        return f"{lo:.2f}–{hi:.2f}"
    coverage = interval_coverage(intervals["vs_floor"])
    pin = meth["pinning"]
    lines = [
        "# Benchmark: the plugin against bare Envoy",
        "",
        f"Generated by `make bench` (bench/bench.py) on {m['date']}. Figures are medians of "
        f"{meth['rounds']} interleaved rounds of `wrk {meth['wrk']}` per case "
        f"(after {meth['warmup_s']} s of warm-up per case); min–max is the spread over the "
        "rounds. Each ratio below is the median over the rounds of that round's ratio: the "
        "two cases of a ratio run back to back in every round. The machine is shared: "
        "absolute numbers move from run to run, the ratios within one run are the result.",
        "",
        "![req/s per case](chart.svg)",
        "",
    ] + table_lines(res["cases"]) + [
        "",
        "| ratio (req/s) | value | Envoy CPU per request (×) | meaning |",
        "|---|---:|---:|---|",
        f"| passthrough = B1/A (GET) | {ratios['passthrough']:.2f} | "
        f"{cpu_ratios['passthrough']:.2f} | a request the plugin does not cover |",
        f"| first_call = B2 detached/A (POST) | {ratios['first_call']:.2f} | "
        f"{cpu_ratios['first_call']:.2f} | claim, upstream, store |",
        f"| replay = B3/C | {ratios['replay']:.2f} | {cpu_ratios['replay']:.2f} | "
        "stored answer against Envoy's own |",
        f"| conflict = B4/C | {ratios['conflict']:.2f} | {cpu_ratios['conflict']:.2f} | "
        "409 against Envoy's own answer |",
        "",
        "The floor: what any proxy-wasm filter costs, measured in the same run with the "
        "control filters of `bench/controls/` (W0 does nothing; W1 reads the whole request, "
        "then lets the router send it; W3 reads the whole request, has its root send it "
        "upstream through a shared queue and answers the client with the upstream's answer; "
        "W2 reads the whole request and answers 201 with the same body as C). The floor ratios "
        "are about the best a Wasm filter reaches here; the second table is the plugin's cost "
        "above them.",
        "",
        "| floor (req/s) | value | Envoy CPU per request (×) | meaning |",
        "|---|---:|---:|---|",
        f"| passthrough = W0/A (GET) | {floor['passthrough']:.2f} | "
        f"{cpu_floor['passthrough']:.2f} | a Wasm filter that does nothing |",
        f"| first_call = W3/A (POST) | {floor['first_call']:.2f} | "
        f"{cpu_floor['first_call']:.2f} | a Wasm filter whose root sends the request |",
        f"| first_call_router = W1/A (POST) | {floor['first_call_router']:.2f} | "
        f"{cpu_floor['first_call_router']:.2f} | a Wasm filter reading the request first |",
        f"| local_answer = W2/C | {floor['local_answer']:.2f} | "
        f"{cpu_floor['local_answer']:.2f} | a Wasm filter answering by itself |",
        "",
        f"| against the floor (req/s) | value | {coverage:.0%} interval | Envoy CPU per request (×) | meaning |",
        "|---|---:|---:|---:|---|",
        f"| passthrough = B1/W0 | {vs_floor['passthrough']:.2f} | {ci('vs_floor', 'passthrough')} | "
        f"{cpu_vs_floor['passthrough']:.2f} | the plugin on a request it does not cover |",
        f"| first_call = B2 detached/W3 | {vs_floor['first_call']:.2f} | {ci('vs_floor', 'first_call')} | "
        f"{cpu_vs_floor['first_call']:.2f} | claim and store, detached |",
        f"| first_call_router = B2 router/W1 | {vs_floor['first_call_router']:.2f} | {ci('vs_floor', 'first_call_router')} | "
        f"{cpu_vs_floor['first_call_router']:.2f} | claim and store, router |",
        f"| replay = B3/W4 | {vs_floor['replay']:.2f} | {ci('vs_floor', 'replay')} | {cpu_vs_floor['replay']:.2f} | "
        "the plugin's replay against a Wasm filter sending the same answer |",
        f"| conflict = B4/W5 | {vs_floor['conflict']:.2f} | {ci('vs_floor', 'conflict')} | {cpu_vs_floor['conflict']:.2f} | "
        "the plugin's 409 against a Wasm filter sending the same 409 |",
        f"| replay_w2 = B3/W2 | {vs_floor['replay_w2']:.2f} | {ci('vs_floor', 'replay_w2')} | {cpu_vs_floor['replay_w2']:.2f} | "
        "the replay against a minimal local answer (one header) |",
        f"| conflict_w2 = B4/W2 | {vs_floor['conflict_w2']:.2f} | {ci('vs_floor', 'conflict_w2')} | {cpu_vs_floor['conflict_w2']:.2f} | "
        "the 409 against a minimal local answer |",
        "",
        "The limit: what the least an idempotency filter keeping its table in shared data "
        "costs above each floor, measured with the same controls doing that work besides "
        "their answer (W8 reads the method; W6 and W7 compute the three SHA-256 digests of a "
        "covered request, or reuse the last request's when a request repeats it byte for byte "
        "(a retry storm, as the plugin's digest memo does), and read the clock, and W7 a "
        "bucket-sized value (W6 answers a retry storm from a kept copy, as the plugin does); "
        "W9 and W10 compute the "
        "digests, claim (read and write a bucket, the clock) and complete (read the bucket "
        "and the response's key, write both, the clock)). A VS_FLOOR goal above its LIMIT "
        "cannot be met by any filter of this design; VS_LEAST is the plugin's own share.",
        "",
        f"Each interval is where the median of the per-round ratios lies with {coverage:.0%} "
        "confidence (distribution-free: the k-th smallest and k-th largest of the rounds' "
        "ratios, `median_interval` in bench/bench.py). A goal above a LIMIT's interval is out "
        "of reach of this design; two intervals that overlap are not told apart by this run.",
        "",
        f"| limit (req/s) | value | {coverage:.0%} interval | Envoy CPU per request (×) | the least a filter does |",
        "|---|---:|---:|---:|---|",
        f"| passthrough = W8/W0 (GET) | {limit['passthrough']:.2f} | {ci('limit', 'passthrough')} | "
        f"{cpu_limit['passthrough']:.2f} | reads the method (one header lookup) |",
        f"| first_call = W9/W3 | {limit['first_call']:.2f} | {ci('limit', 'first_call')} | {cpu_limit['first_call']:.2f} | "
        "digests, claim, completion |",
        f"| first_call_router = W10/W1 | {limit['first_call_router']:.2f} | {ci('limit', 'first_call_router')} | "
        f"{cpu_limit['first_call_router']:.2f} | the same, and reads the router's answer |",
        f"| replay = W6/W4 | {limit['replay']:.2f} | {ci('limit', 'replay')} | {cpu_limit['replay']:.2f} | "
        "digests, the clock (a kept copy answers) |",
        f"| conflict = W7/W5 | {limit['conflict']:.2f} | {ci('limit', 'conflict')} | {cpu_limit['conflict']:.2f} | "
        "digests, a bucket read, the clock |",
        "",
        f"| against the least (req/s) | value | {coverage:.0%} interval | Envoy CPU per request (×) |",
        "|---|---:|---:|---:|",
        f"| passthrough = B1/W8 | {vs_least['passthrough']:.2f} | {ci('vs_least', 'passthrough')} | {cpu_vs_least['passthrough']:.2f} |",
        f"| first_call = B2 detached/W9 | {vs_least['first_call']:.2f} | {ci('vs_least', 'first_call')} | {cpu_vs_least['first_call']:.2f} |",
        f"| first_call_router = B2 router/W10 | {vs_least['first_call_router']:.2f} | {ci('vs_least', 'first_call_router')} | "
        f"{cpu_vs_least['first_call_router']:.2f} |",
        f"| replay = B3/W6 | {vs_least['replay']:.2f} | {ci('vs_least', 'replay')} | {cpu_vs_least['replay']:.2f} |",
        f"| conflict = B4/W7 | {vs_least['conflict']:.2f} | {ci('vs_least', 'conflict')} | {cpu_vs_least['conflict']:.2f} |",
        "",
        *fleet_lines(res.get("fleet") or {}),
        "## Memory",
        "",
        f"Envoy RSS per stored entry with 1 KiB responses: **{mem['bytes_per_entry']:,} "
        f"bytes**; heap in use (tcmalloc `allocated`, admin `/memory`): "
        f"**{mem['heap_bytes_per_entry']:,} bytes** per entry. {mem['keys']:,} unique keys "
        f"through the plugin (capacity {mem['capacity']:,}); each entry stores "
        f"{mem['stored_body_bytes']} B of body and {mem['stored_header_bytes']} B of headers; "
        f"docs/memory.md's model says {mem['model_bytes_per_entry']:,} B. Control: the same "
        f"number of requests without a key (not covered, nothing stored) on the same "
        f"listener: {mem['control_bytes_per_request']:,} B of RSS per request. RSS: "
        f"{mem['rss'][0] / 2**20:.1f} MiB after warm-up, {mem['rss'][1] / 2**20:.1f} MiB "
        f"after the control, {mem['rss'][2] / 2**20:.1f} MiB after storing; RSS can grow "
        "less than the heap when tcmalloc still had free pages (`pageheap_free`: "
        f"{mem['pageheap_free'][1] / 2**20:.1f} MiB before, "
        f"{mem['pageheap_free'][2] / 2**20:.1f} MiB after).",
        "",
        f"Plugin size: `dist/idempotency.wasm` is {m['wasm_bytes']:,} bytes "
        f"({m['wasm_bytes'] / 1024:.0f} KiB)."
        + (f" The control filters (`bench/controls/`): {m['control_wasm_bytes']:,} bytes."
           if m.get("control_wasm_bytes") else ""),
        "",
        "## Machine",
        "",
        f"- cores (`nproc`): {m['nproc']}",
        f"- CPU: {m['cpu_model']}",
        f"- kernel: {m['kernel']}",
        f"- Envoy: {m['envoy_version']} (`--concurrency 2`), wrk {m['wrk_version']}",
        f"- date: {m['date']}",
        f"- load average (1 min) at start / end: {m['loadavg_start']:.2f} / "
        f"{m['loadavg_end']:.2f}",
        f"- pinning (taskset): Envoy under test {pin['envoy']}, upstream Envoy "
        f"{pin['upstream']}, wrk {pin['wrk']}",
        "",
        "## Setup",
        "",
        "- Upstream: a second Envoy answering 201 with a 33-byte JSON body by itself "
        "(`direct_response`), so the upstream is never the bottleneck; the Python test "
        "upstream only serves the one slow request of B4.",
        "- A, B1, B2: `bench/unique.lua`, a new `Idempotency-Key` per request: a POST with a "
        "13-byte JSON body (A, B2), or a GET with the same header (A GET, B1; a GET costs "
        "Envoy less than a POST, so passthrough compares B1 with A GET). B3, B4, C: "
        "`bench/fixed.lua`, one POST formatted once.",
        "- B2 stores every key (default `retention_s`), in a table of "
        f"{meth['capacity_first_call']:,} entries; B2 etcd uses one local etcd "
        "(tests/etcd_util.py, data on local disk).",
        "- W0–W3: the control filters (`bench/controls/`, built by `make bench`), each "
        "listener with its own `vm_id`: W0 (`noop`) returns Continue from every callback, "
        "GET through the upstream as A GET and B1; W1 (`buffer`) and W3 (`detach`) send "
        "`bench/unique.lua`'s POSTs as A and B2 (W3's root sends them with "
        "`dispatch_http_call`, as the plugin's detached mode); W2 (`local`) waits for the whole request, "
        "reads its headers and body and answers 201 itself, `bench/fixed.lua` as C, B3 and "
        "B4 (checked: no request of W2 reaches the upstream).",
        "- B3: one key completed before the run, replayed. B4: per run, one request with a "
        "new key is sent first to the slow upstream (answering after the run), with "
        "`lease_ms` 2000: the mark is renewed every 500 ms and the key still answers 409 "
        "after the run (checked).",
        "- Each run is checked: wrk's error count and the plugin's counters (claimed, "
        "completed, replayed, conflict) match the path of the case.",
        "- Envoy CPU µs/req: user + system CPU time of the Envoy under test during the run "
        "(/proc/PID/stat) over the requests answered; less sensitive to other load on the "
        "machine than req/s. The upstream Envoy's own share is in results.json.",
    ]
    if res["problems"]:
        lines += ["", "## Problems seen", ""] + [f"- {p}" for p in res["problems"]]
    return "\n".join(lines) + "\n"


def fleet_lines(fleet):
    if not fleet:
        return []
    return [
        "## Fleet mode (etcd) against one Envoy (shared data)",
        "",
        "| ratio | value | what it is |",
        "|---|---:|---|",
        f"| first_call = B2 etcd/B2 detached | {fleet['first_call']:.2f} | req/s, same run |",
        f"| replay = B3 etcd/B3 | {fleet.get('replay', float('nan')):.2f} | req/s, the "
        "replaying Envoy's own copy |",
        f"| etcd requests per first call | {fleet['etcd_rq_per_first_call']:.2f} | read, "
        "claim and completion (and the VMs' lease grants) |",
        f"| etcd CPU per first call | {fleet['etcd_cpu_us_per_first_call']:.0f} µs | "
        "one local member |",
        f"| cpu_bound | {fleet['cpu_bound']:.2f} | the first_call ratio this machine's "
        "CPU allows at most: every process's CPU per request on both paths |",
        "",
    ]


def svg_chart(summary, machine):
    """Horizontal bars of req/s per case (median), with the min–max spread as a whisker."""
    row, top, left, width = 34, 58, 320, 430
    height = top + row * len(summary) + 64
    vmax = max(s["rps_max"] for s in summary) or 1
    scale = width / (vmax * 1.08)
    legend = [("#7f7f7f", "Envoy, no filter"), ("#8e6bbf", "control Wasm filter"),
              ("#2f6db5", "the plugin"), ("#d9822b", "the plugin, etcd store")]
    colors = {"A": "#7f7f7f", "A_GET": "#7f7f7f", "C": "#7f7f7f", "W0": "#8e6bbf",
              "W2": "#8e6bbf", "W1": "#8e6bbf", "W3": "#8e6bbf", "B2_etcd": "#d9822b"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 90}" '
           f'height="{height}" font-family="sans-serif" font-size="13">',
           f'<rect width="100%" height="100%" fill="white"/>',
           f'<text x="12" y="24" font-size="16" font-weight="bold">Requests per second '
           f'(median of rounds; whisker: min–max)</text>',
           f'<text x="12" y="44" fill="#555">Envoy {esc(machine["envoy_version"])}, '
           f'--concurrency 2, {machine["nproc"]} cores ({esc(machine["cpu_model"])}), '
           f'{esc(machine["date"])}</text>']
    for i, s in enumerate(summary):
        y = top + i * row
        if s["id"] == "C" and i:
            out.append(f'<line x1="12" y1="{y}" x2="{left + width + 80}" y2="{y}" '
                       f'stroke="#bbb" stroke-dasharray="4 3"/>')
        w = s["rps"] * scale
        color = colors.get(s["id"], "#2f6db5")
        out.append(f'<text x="{left - 8}" y="{y + 17}" text-anchor="end">{esc(s["label"])}'
                   f'</text>')
        out.append(f'<rect x="{left}" y="{y + 4}" width="{w:.1f}" height="{row - 12}" '
                   f'fill="{color}"/>')
        x0, x1 = left + s["rps_min"] * scale, left + s["rps_max"] * scale
        ym = y + 4 + (row - 12) / 2
        out.append(f'<line x1="{x0:.1f}" y1="{ym:.1f}" x2="{x1:.1f}" y2="{ym:.1f}" '
                   f'stroke="black"/>')
        for x in (x0, x1):
            out.append(f'<line x1="{x:.1f}" y1="{ym - 5:.1f}" x2="{x:.1f}" y2="{ym + 5:.1f}" '
                       f'stroke="black"/>')
        out.append(f'<text x="{max(w, x1 - left) + left + 6:.1f}" y="{y + 17}">'
                   f'{s["rps"]:,.0f}</text>')
    axis_y = top + row * len(summary) + 6
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + width}" y2="{axis_y}" '
               f'stroke="#999"/>')
    step = nice_step(vmax * 1.08 / 5)
    v = 0
    while v <= vmax * 1.08:
        x = left + v * scale
        out.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" '
                   f'stroke="#999"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 18}" text-anchor="middle" fill="#555">'
                   f'{v:,.0f}</text>')
        v += step
    x = 12
    for color, text in legend:
        out.append(f'<rect x="{x}" y="{axis_y + 30}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 17}" y="{axis_y + 41}" fill="#555">{esc(text)}</text>')
        x += 30 + 7 * len(text)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def nice_step(x):
    mag = 10 ** int(f"{x:e}".split("e")[1])
    for m in (1, 2, 5, 10):
        if m * mag >= x:
            return m * mag
    return 10 * mag


def esc(text):
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))


if __name__ == "__main__":
    main()
