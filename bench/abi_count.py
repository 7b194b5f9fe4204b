#!/usr/bin/env python3
"""What the plugin asks of Envoy per request, counted exactly: host calls and Wasm work.

    .venv/bin/python bench/abi_count.py A.wasm [B.wasm] [--requests 200]

A small proxy-wasm host (ABI 0.2.1) over wasmtime plays Envoy for one VM: shared data, the
shared queue, metrics, local replies, `dispatch_http_call` answered at once by a stand-in
upstream (201). It drives the same requests as `make bench` (a POST with a small JSON body,
`Authorization: Bearer bench`) through each build and prints, per request and path, the host
calls by kind and the fuel wasmtime charged (about one unit per Wasm instruction, including
the plugin's own allocations called back from the host). Both are deterministic: two builds
are compared without timing noise. What a host call costs Envoy is measured by
`make bench-hostcalls` (docs/performance.md); this counts how many the plugin makes.
"""

import argparse
import collections
import json
import os
import struct
import sys
import time
import urllib.error
import urllib.request

import wasmtime

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

OK, NOT_FOUND, EMPTY, CAS_MISMATCH = 0, 1, 7, 8
REQUEST_HEADERS, RESPONSE_HEADERS, CALL_HEADERS, CALL_TRAILERS = 0, 2, 6, 7
REQUEST_BODY, RESPONSE_BODY, CALL_BODY, VM_CONFIG, PLUGIN_CONFIG = 0, 1, 4, 6, 7
ROOT = 1
BODY = b'{"amount":10}'


def pairs(data):
    """Decodes a proxy-wasm header map."""
    (n,) = struct.unpack_from("<I", data, 0)
    sizes = [struct.unpack_from("<II", data, 4 + 8 * i) for i in range(n)]
    at, out = 4 + 8 * n, []
    for k, v in sizes:
        out.append((data[at:at + k], data[at + k + 1:at + k + 1 + v]))
        at += k + v + 2
    return out


def encode_pairs(items):
    head = struct.pack("<I", len(items)) + b"".join(struct.pack("<II", len(k), len(v)) for k, v in items)
    return head + b"".join(k + b"\0" + v + b"\0" for k, v in items)


class Host:
    """One Envoy worker as far as one VM can tell."""

    def __init__(self, wasm, config, etcd_port=None):
        self.etcd_port = etcd_port
        self.hold = set()  # keys whose upstream call is never answered
        self.tick_ms, self.next_tick_ns = 0, 0
        cfg = wasmtime.Config()
        cfg.consume_fuel = True
        self.engine = wasmtime.Engine(cfg)
        self.store = wasmtime.Store(self.engine)
        self.store.set_wasi(wasmtime.WasiConfig())
        self.store.set_fuel(10**15)
        module = wasmtime.Module.from_file(self.engine, wasm)
        linker = wasmtime.Linker(self.engine)
        linker.define_wasi()
        for imp in module.imports:
            if imp.module == "env":
                linker.define_func("env", imp.name, imp.type, self._import(imp.name))
        self.instance = linker.instantiate(self.store, module)
        ex = self.instance.exports(self.store)
        self.memory = ex["memory"]
        self.fn = {name: ex[name] for name in ex if name.startswith("proxy_on_") or name == "_initialize"}
        self.calls = collections.Counter()
        self.by_callback = collections.Counter()  # (callback, host call)
        self.callback = None
        self.fuel = collections.Counter()
        self.shared = {}
        self.queues, self.queue_owner = {}, {}
        self.maps = collections.defaultdict(list)
        raw = config.get("raw") if isinstance(config, dict) else None
        self.buffers = {PLUGIN_CONFIG: raw.encode() if raw else json.dumps(config).encode(), VM_CONFIG: b""}
        self.properties = {}
        self.filter_state = {}
        self.current = ROOT
        self.now_ns = 1_700_000_000_000 * 10**6
        self.pending = []  # host events that follow the current callback
        self.replies, self.dispatched, self.resumed = {}, {}, set()
        self.next_token = 1
        if "_initialize" in self.fn:
            self.fn["_initialize"](self.store)
        self.call("proxy_on_context_create", ROOT, 0)
        self.call("proxy_on_vm_start", ROOT, 0)
        assert self.call("proxy_on_configure", ROOT, len(self.buffers[PLUGIN_CONFIG])) == 1, "config refused"

    # --- memory -----------------------------------------------------------------------
    def read(self, ptr, size):
        return bytes(self.memory.read(self.store, ptr, ptr + size)) if size else b""

    def write_u32(self, ptr, v):
        self.memory.write(self.store, struct.pack("<I", v), ptr)

    def give(self, data, ret_ptr, ret_size):
        """Hands bytes to the plugin the way Envoy does: in memory the plugin allocates."""
        ptr = self.fn["proxy_on_memory_allocate"](self.store, len(data)) if data else 0
        if data:
            self.memory.write(self.store, data, ptr)
        self.write_u32(ret_ptr, ptr)
        self.write_u32(ret_size, len(data))
        return OK

    def run(self, name, *args):
        """One callback into the plugin; its fuel is filed under its name."""
        before, outer = self.store.get_fuel(), self.callback
        self.callback = name
        out = self.fn[name](self.store, *args)
        self.callback = outer
        self.fuel[name] += before - self.store.get_fuel()
        return out

    def call(self, name, *args):
        out = self.run(name, *args)
        while self.pending:
            self.pending.pop(0)()
        return out

    # --- the ABI --------------------------------------------------------------------------
    def _import(self, name):
        impl = getattr(self, "abi_" + name[len("proxy_"):], None)

        def counted(*args):
            self.calls[name] += 1
            self.by_callback[(self.callback, name)] += 1
            if impl is None:
                return 12  # Unimplemented
            return impl(*args)
        return counted

    def abi_log(self, level, ptr, size):
        if level >= 3:  # warn and above
            print("plugin:", self.read(ptr, size).decode(errors="replace"), file=sys.stderr)
        return OK

    def abi_get_log_level(self, ret):
        self.write_u32(ret, 2)  # info: Envoy's default
        return OK

    def abi_get_current_time_nanoseconds(self, ret):
        self.memory.write(self.store, struct.pack("<Q", self.now_ns), ret)
        return OK

    def abi_set_tick_period_milliseconds(self, ms):
        self.tick_ms = ms
        return OK

    def abi_get_header_map_value(self, kind, kp, ks, ret_ptr, ret_size):
        key = self.read(kp, ks)
        for k, v in self.maps[(self.current, kind)]:
            if k == key:
                return self.give(v, ret_ptr, ret_size)
        return NOT_FOUND

    def abi_get_header_map_pairs(self, kind, ret_ptr, ret_size):
        return self.give(encode_pairs(self.maps[(self.current, kind)]), ret_ptr, ret_size)

    def abi_set_header_map_pairs(self, kind, ptr, size):
        self.maps[(self.current, kind)] = pairs(self.read(ptr, size))
        return OK

    def abi_add_header_map_value(self, kind, kp, ks, vp, vs):
        self.maps[(self.current, kind)].append((self.read(kp, ks), self.read(vp, vs)))
        return OK

    def abi_replace_header_map_value(self, kind, kp, ks, vp, vs):
        key = self.read(kp, ks)
        m = [(k, v) for k, v in self.maps[(self.current, kind)] if k != key]
        self.maps[(self.current, kind)] = m + [(key, self.read(vp, vs))]
        return OK

    def abi_remove_header_map_value(self, kind, kp, ks):
        key = self.read(kp, ks)
        self.maps[(self.current, kind)] = [(k, v) for k, v in self.maps[(self.current, kind)] if k != key]
        return OK

    def abi_get_buffer_bytes(self, kind, start, size, ret_ptr, ret_size):
        data = self.buffers.get((self.current, kind), self.buffers.get(kind, b""))
        return self.give(data[start:start + (size & 0xFFFFFFFF)], ret_ptr, ret_size)

    def abi_set_buffer_bytes(self, kind, start, size, ptr, data_size):
        return OK

    def abi_get_property(self, pp, ps, ret_ptr, ret_size):
        path = tuple(self.read(pp, ps).rstrip(b"\0").split(b"\0"))
        value = self.properties.get((self.current, path), self.properties.get(path))
        return NOT_FOUND if value is None else self.give(value, ret_ptr, ret_size)

    def abi_set_property(self, pp, ps, vp, vs):
        path = tuple(self.read(pp, ps).rstrip(b"\0").split(b"\0"))
        self.filter_state[(self.current, path)] = self.read(vp, vs)
        return OK

    def abi_get_shared_data(self, kp, ks, ret_ptr, ret_size, ret_cas):
        entry = self.shared.get(self.read(kp, ks))
        if entry is None:
            return NOT_FOUND
        self.give(entry[0], ret_ptr, ret_size)
        self.write_u32(ret_cas, entry[1])
        return OK

    def abi_set_shared_data(self, kp, ks, vp, vs, cas):
        key = self.read(kp, ks)
        old = self.shared.get(key)
        if cas and (old is None or old[1] != cas):
            return CAS_MISMATCH
        self.shared[key] = (self.read(vp, vs), (old[1] + 1) if old else 1)
        return OK

    def abi_register_shared_queue(self, np, ns, ret):
        qid = len(self.queues) + 1
        self.queues[qid], self.queue_owner[qid] = [], self.current
        self.write_u32(ret, qid)
        return OK

    def abi_enqueue_shared_queue(self, qid, vp, vs):
        self.queues[qid].append(self.read(vp, vs))
        owner = self.queue_owner[qid]
        self.pending.append(lambda: self.on(owner, "proxy_on_queue_ready", owner, qid))
        return OK

    def abi_dequeue_shared_queue(self, qid, ret_ptr, ret_size):
        if not self.queues.get(qid):
            return EMPTY
        return self.give(self.queues[qid].pop(0), ret_ptr, ret_size)

    def abi_define_metric(self, kind, np, ns, ret):
        self.write_u32(ret, self.calls["proxy_define_metric"])
        return OK

    def abi_increment_metric(self, mid, offset):
        return OK

    def abi_record_metric(self, mid, value):
        return OK

    def abi_set_effective_context(self, ctx):
        self.current = ctx
        return OK

    def abi_continue_stream(self, kind):
        self.resumed.add(self.current)
        return OK

    def abi_done(self):
        return OK

    def abi_send_local_response(self, status, dp, ds, bp, bs, hp, hs, grpc):
        stream, body = self.current, self.read(bp, bs)
        headers = [(b":status", str(status).encode())] + pairs(self.read(hp, hs))
        self.replies[stream] = (status, headers, body)
        self.pending.append(lambda: self.respond(stream, headers, body, via_upstream=False))
        return OK

    def abi_http_call(self, up, us, hp, hs, bp, bs, tp, ts, timeout, ret):
        token = self.next_token
        self.next_token += 1
        self.dispatched[token] = (self.read(up, us), pairs(self.read(hp, hs)), self.read(bp, bs))
        self.write_u32(ret, token)
        return OK

    # --- driving ------------------------------------------------------------------------
    def on(self, ctx, name, *args):
        """A callback in context `ctx` (Envoy sets the effective context before each)."""
        self.current = ctx
        return self.run(name, *args)

    def respond(self, stream, headers, body, via_upstream):
        self.maps[(stream, RESPONSE_HEADERS)] = headers
        self.buffers[(stream, RESPONSE_BODY)] = body
        details = b"via_upstream" if via_upstream else b"direct_response"
        self.properties[(stream, (b"response", b"code_details"))] = details
        self.on(stream, "proxy_on_response_headers", stream, len(headers), 0 if body else 1)
        if body:
            self.on(stream, "proxy_on_response_body", stream, len(body), 1)

    def answer_calls(self):
        """Answers every dispatched call, and the calls those answers lead to: etcd's by the
        real etcd, the upstream's with a 201, but for keys in `self.hold` (never answered)."""
        while True:
            ready = [t for t, (_, h, _) in self.dispatched.items()
                     if dict(h).get(b"idempotency-key", b"") not in self.hold]
            if not ready:
                return
            for token in ready:
                cluster, headers, body = self.dispatched.pop(token)
                if cluster == b"etcd":
                    status, answer = self.etcd(dict(headers)[b":path"], body)
                    headers = [(b":status", str(status).encode()), (b"content-type", b"application/json")]
                else:
                    answer = b'{"charged":10}'
                    headers = [(b":status", b"201"), (b"content-type", b"application/json"),
                               (b"content-length", b"14")]
                self.maps[(ROOT, CALL_HEADERS)] = headers
                self.buffers[(ROOT, CALL_BODY)] = answer
                self.call_on(ROOT, "proxy_on_http_call_response", ROOT, token, len(headers), len(answer), 0)

    def etcd(self, path, body):
        url = f"http://127.0.0.1:{self.etcd_port}{path.decode()}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def advance(self, ms):
        """The clock moves on; the root's timer fires when its period has passed."""
        self.now_ns += ms * 1_000_000
        if self.tick_ms and self.now_ns >= self.next_tick_ns:
            self.next_tick_ns = self.now_ns + self.tick_ms * 1_000_000
            self.call_on(ROOT, "proxy_on_tick", ROOT)
            self.answer_calls()

    def call_on(self, ctx, name, *args):
        self.current = ctx
        out = self.run(name, *args)
        while self.pending:
            self.pending.pop(0)()
        return out

    def request(self, stream, method, key):
        """One client request on a new stream, to its end; returns the status it got."""
        headers = [(b":method", method), (b":path", b"/payments"), (b":authority", b"bench"),
                   (b":scheme", b"http"), (b"authorization", b"Bearer bench"),
                   (b"user-agent", b"wrk"), (b"x-request-id", b"5f0c6a4e-0d7b-4c9e-9a53-2f8d1e6b7c10")]
        if method != b"GET":
            headers += [(b"content-type", b"application/json"), (b"content-length", b"13"),
                        (b"idempotency-key", key)]
        self.maps[(stream, REQUEST_HEADERS)] = headers
        self.buffers[(stream, REQUEST_BODY)] = BODY if method != b"GET" else b""
        self.properties[(stream, (b"xds", b"cluster_name"))] = b"upstream"
        self.call_on(stream, "proxy_on_context_create", stream, ROOT)
        eos = 1 if method == b"GET" else 0
        action = self.call_on(stream, "proxy_on_request_headers", stream, len(headers), eos)
        if not eos and stream not in self.replies:
            action = self.call_on(stream, "proxy_on_request_body", stream, len(BODY), 1)
        self.answer_calls()
        if stream not in self.replies and (action == 0 or stream in self.resumed):
            # As Envoy's router passes an upstream's answer on (it adds the service time).
            upstream = [(b":status", b"201"), (b"content-type", b"application/json"), (b"content-length", b"14"),
                        (b"date", b"Tue, 01 Dec 2026 22:00:00 GMT"), (b"server", b"envoy"),
                        (b"x-envoy-upstream-service-time", b"0")]
            self.respond(stream, upstream, b'{"charged":10}', True)
            status = 201
        else:
            status = self.replies.get(stream, (0,))[0]
        self.call_on(stream, "proxy_on_log", stream)
        self.call_on(stream, "proxy_on_done", stream)
        self.call_on(stream, "proxy_on_delete", stream)
        for k in [k for k in self.maps if k[0] == stream]:
            del self.maps[k]
        self.replies.pop(stream, None)
        self.resumed.discard(stream)
        return status


PATHS = ["first call", "replay", "conflict (409)", "not covered (GET)"]


def measure(wasm, config, path, n, etcd_port=None):
    config = dict(config, namespace=f"abi{time.monotonic_ns()}")  # etcd: a prefix of its own
    host = Host(wasm, config, etcd_port)
    host.advance(1)
    stream = 2
    if path == "replay":
        assert host.request(stream, b"POST", b"fixed") == 201
        stream += 1
    if path == "conflict (409)":
        host.hold.add(b"held")
        host.request(stream, b"POST", b"held")
        stream += 1
    host.calls.clear()
    host.by_callback.clear()
    host.fuel.clear()
    statuses = collections.Counter()
    for i in range(n):
        method = b"GET" if path == "not covered (GET)" else b"POST"
        key = {"first call": f"k-{i}".encode(), "replay": b"fixed", "conflict (409)": b"held"}.get(path, b"")
        statuses[host.request(stream + i, method, key)] += 1
        host.advance(1)
    def per_request(counts):
        return {k: v / n for k, v in counts.items()}
    return per_request(host.calls), per_request(host.fuel), statuses, per_request(host.by_callback)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("wasm", nargs="+")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--forward", default="detached", choices=["detached", "router"])
    ap.add_argument("--store", default="shared_data", choices=["shared_data", "etcd"])
    ap.add_argument("--write-budget-bytes", type=int,
                    help="with --store etcd: store.write_budget_bytes (0: no write ledger)")
    ap.add_argument("--raw", help="the plugin configuration as given (a control filter's mode, "
                    "bench/controls/), instead of the plugin's JSON")
    ap.add_argument("--by-callback", action="store_true", help="also the host calls of each callback")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated paths")
    ap.add_argument("--budget", help="host calls allowed per path, e.g. 'first call=22,replay=5.5': "
                    "exits 1 when the first build's count is over one (make test runs it)")
    ap.add_argument("--fuel-budget", help="Wasm fuel allowed per path, e.g. 'replay=23000': exits 1 "
                    "when the first build's fuel is over one; each figure must be written in "
                    "CHANGELOG.md, so raising it takes a line there (make test runs it)")
    args = ap.parse_args()
    config = {"namespace": "abi", "forward": args.forward}
    if args.raw:
        config["raw"] = args.raw.replace("\\n", "\n")
    etcd = None
    if args.store == "etcd":
        from etcd_util import Etcd
        etcd = Etcd()
        # The JSON gateway: this host answers `dispatch_http_call` only (no gRPC calls).
        config["store"] = {"kind": "etcd", "cluster": "etcd", "api": "json"}
        if args.write_budget_bytes is not None:
            config["store"]["write_budget_bytes"] = args.write_budget_bytes
    try:
        totals, fuel_totals = report(args, config, etcd.port if etcd else None)
    finally:
        if etcd:
            etcd.close()
    failed = 0
    if args.budget:
        over = []
        for item in args.budget.split(","):
            path, _, limit = item.rpartition("=")
            got = totals[path.strip()][0]
            print(f"budget {path.strip()}: {got:.2f} host calls, at most {float(limit)}")
            if got > float(limit):
                over.append(path.strip())
        if over:
            print(f"over the host-call budget: {', '.join(over)}")
            failed = 1
    if args.fuel_budget:
        failed |= check_fuel_budget(args.fuel_budget, fuel_totals, args.store)
    return failed


def check_fuel_budget(spec, fuel_totals, store):
    """Each path's fuel against its budget; a budget not written in the CHANGELOG (with its
    digits grouped by commas, as `fuel budget, <store>: <path> <figure>`) is refused too, so
    that raising one leaves a line that says why (docs/performance.md)."""
    changelog = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "CHANGELOG.md")).read()
    over, unwritten = [], []
    for item in spec.split(","):
        path, _, limit = item.rpartition("=")
        path, limit = path.strip(), int(limit)
        got = fuel_totals[path][0]
        print(f"fuel budget {store} {path}: {got:,.0f} fuel, at most {limit:,}")
        if got > limit:
            over.append(path)
        if f"fuel budget, {store}: {path} {limit:,}" not in changelog:
            unwritten.append(f"fuel budget, {store}: {path} {limit:,}")
    if over:
        print(f"over the fuel budget: {', '.join(over)}")
    if unwritten:
        print("budgets not written in CHANGELOG.md: " + "; ".join(unwritten))
    return 1 if over or unwritten else 0


def report(args, config, etcd_port):
    names = [w.rsplit("/", 1)[-1] for w in args.wasm]
    totals, fuel_totals = {}, {}
    print(f"forward: {args.forward}, store: {args.store}; per request, mean of {args.requests}")
    for path in [p for p in PATHS if p in args.paths.split(",")]:
        rows = [measure(w, config, path, args.requests, etcd_port) for w in args.wasm]
        kinds = sorted(set().union(*(r[0] for r in rows)))
        print(f"\n{path}: statuses " + "; ".join(f"{n} {dict(r[2])}" for n, r in zip(names, rows)))
        print("| host call | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
        for k in kinds:
            print(f"| {k[len('proxy_'):]} | " + " | ".join(f"{r[0].get(k, 0):.2f}" for r in rows) + " |")
        print("| **all host calls** | " + " | ".join(f"{sum(r[0].values()):.2f}" for r in rows) + " |")
        totals[path] = [sum(r[0].values()) for r in rows]
        callbacks = sorted(set().union(*(r[1] for r in rows)))
        for k in callbacks:
            print(f"| fuel in {k[len('proxy_'):]} | " + " | ".join(f"{r[1].get(k, 0):,.0f}" for r in rows) + " |")
        print("| **fuel (Wasm work)** | " + " | ".join(f"{sum(r[1].values()):,.0f}" for r in rows) + " |")
        fuel_totals[path] = [sum(r[1].values()) for r in rows]
        if args.by_callback:
            for name, r in zip(names, rows):
                print(f"\n{name}, host calls by callback:")
                for (cb, call), v in sorted(r[3].items(), key=str):
                    print(f"  {cb[len('proxy_'):] if cb else '(outside)'}: {call[len('proxy_'):]} {v:.2f}")

    return totals, fuel_totals

if __name__ == "__main__":
    sys.exit(main())
