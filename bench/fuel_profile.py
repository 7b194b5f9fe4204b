#!/usr/bin/env python3
"""The Wasm work of one path by function: fuel per request, exactly, for one plugin build.

    .venv/bin/python bench/fuel_profile.py A.wasm [--path replay] [--top 30] [--callers memcmp]

It rewrites a copy of the module (wabt's wasm2wat and wat2wasm: `apt-get install wabt`) so that
every function tells the host when it is entered and left, then drives `bench/abi_count.py`'s
host through the path's steady state (after five requests) and files the fuel wasmtime charged
between two such events under the function then running. So each figure is a function's own
work, callees excluded, with the number of calls per request. The probes cost a few units per
call; the total is a little above abi_count's.

This found the byte-by-byte `memcmp` (a fifth of a replay's work) and the 64 entry decodings of
a claim's scan (CHANGELOG.md, "Performance notes"). Fuel counts instructions, not time: a tight loop costs
less per unit in Envoy than branchy code over cold memory.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import abi_count  # noqa: E402

# Lines of wasm2wat's output that start a module field: the function before them has ended.
FIELDS = ("  (func", "  (table", "  (memory", "  (global", "  (export", "  (elem", "  (data", "  (type",
          "  (import", ")")


def instrument(wat):
    """The module with an `enter(i)` at each function's start and a `leave()` at each exit (its
    end, and every `return`); the functions' names, by `i`. Each body goes in a block of the
    function's result type, so that a branch out of the body also passes the `leave()`."""
    lines, out, names = wat.split("\n"), [], []
    last_import = max(i for i, line in enumerate(lines) if line.startswith("  (import"))
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        out.append(line)
        if i - 1 == last_import:
            out.append('  (import "env" "proxy_profile_enter" (func $__profile_enter (param i32)))')
            out.append('  (import "env" "proxy_profile_leave" (func $__profile_leave))')
            continue
        func = re.match(r"  \(func (\$\S+|\(;\d+;\))", line)
        if not func:
            continue
        probe = f"i32.const {len(names)} call $__profile_enter"
        names.append(func.group(1))
        if line.count("(") == line.count(")"):  # an empty function on one line
            out[-1] = line[:-1] + f" {probe} call $__profile_leave)"
            continue
        while i < len(lines) and lines[i].lstrip().startswith("(local"):
            out.append(lines[i])
            i += 1
        result = re.search(r"\(result ([^)]*)\)", line)
        out.append(f"    {probe}")
        out.append(f"    block (result {result.group(1)})" if result else "    block")
        body = []
        while i < len(lines) and not lines[i].startswith(FIELDS):
            body.append(re.sub(r"^(\s+)return\b", r"\1call $__profile_leave return", lines[i]))
            i += 1
        if not body or not body[-1].endswith(")"):
            raise SystemExit(f"unexpected end of {names[-1]}")
        body[-1] = body[-1][:-1]
        out.extend(body)
        out.append("    end")
        out.append("    call $__profile_leave)")
    return "\n".join(out), names


class Host(abi_count.Host):
    """abi_count's host, with the two probes: fuel between events goes to the running function."""

    def _import(self, name):
        if name == "proxy_profile_enter":
            return self.enter
        if name == "proxy_profile_leave":
            return self.leave
        return super()._import(name)

    def start(self):
        self.stack, self.last = [], self.store.get_fuel()
        self.own, self.calls, self.callers = (collections.Counter() for _ in range(3))
        self.profiling = True

    def charge(self):
        fuel = self.store.get_fuel()
        if self.stack:
            self.own[self.stack[-1]] += self.last - fuel
        self.last = fuel

    def enter(self, index):
        if getattr(self, "profiling", False):
            self.charge()
            self.calls[index] += 1
            self.callers[(self.stack[-1] if self.stack else None, index)] += 1
            self.stack.append(index)

    def leave(self):
        if getattr(self, "profiling", False) and self.stack:
            self.charge()
            self.stack.pop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("wasm")
    ap.add_argument("--path", default="replay", choices=["first", "replay", "conflict"])
    ap.add_argument("--forward", default="detached", choices=["detached", "router"])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--callers", nargs="*", default=[], help="also who calls functions whose name has this")
    args = ap.parse_args()
    wat = subprocess.run(["wasm2wat", "--enable-all", args.wasm], check=True, capture_output=True, text=True).stdout
    wat, names = instrument(wat)
    with tempfile.TemporaryDirectory() as tmp:
        src, wasm = os.path.join(tmp, "profiled.wat"), os.path.join(tmp, "profiled.wasm")
        with open(src, "w") as f:
            f.write(wat)
        subprocess.run(["wat2wasm", "--enable-all", src, "-o", wasm], check=True)
        host = Host(wasm, {"namespace": "profile", "forward": args.forward})
    host.advance(1)
    stream, key = 2, {"replay": b"fixed", "conflict": b"held"}.get(args.path)
    if args.path == "conflict":
        host.hold.add(key)
    if key:
        host.request(stream, b"POST", key)
        stream += 1
    for i in range(5):
        host.request(stream, b"POST", key or f"warm-{i}".encode())
        stream += 1
        host.advance(1)
    host.start()
    for i in range(args.requests):
        host.request(stream, b"POST", key or f"k-{i}".encode())
        stream += 1
        host.advance(1)
    n, total = args.requests, sum(host.own.values())
    print(f"{os.path.basename(args.wasm)}, {args.path} ({args.forward}): {total / n:,.0f} fuel per request, "
          f"by function (own work, calls per request)")
    for index, fuel in host.own.most_common(args.top):
        print(f"{fuel / n:9,.0f} {100 * fuel / total:5.1f}% x{host.calls[index] / n:5.1f}  {names[index]}")
    for part in args.callers:
        for (caller, callee), count in host.callers.most_common():
            if part in names[callee]:
                who = names[caller] if caller is not None else "(the host)"
                print(f"  {names[callee]} x{count / n:.1f} from {who}")


if __name__ == "__main__":
    main()
