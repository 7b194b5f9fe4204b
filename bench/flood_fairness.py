#!/usr/bin/env python3
"""The flood of docs/memory.md "Fair share", on `make run`'s setup (envoy/demo.py: the shipped
envoy/envoy.yaml and its default configuration): one caller sends new keys as fast as wrk can
(32 connections, bench/unique.lua, `Authorization: Bearer bench`) for FLOOD_SECONDS, while a
second caller (`Bearer steady`) first stores 200 keys and then retries them in a loop. Prints
the flood's figures, the gauges, and how many times the second caller's keys ran upstream
(each must run once: its answers stay stored while the flood evicts the flooder's own).

    python3 bench/flood_fairness.py [FLOOD_SECONDS]   # default 25

Needs wrk (apt-get install wrk) and the built plugin (make build). Ports as make run's
(10000, 9901, 8080): nothing else may use them. Not a timed test: it prints what it measured.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTENER = "http://127.0.0.1:10000"
ADMIN = "http://127.0.0.1:9901"
UPSTREAM = "http://127.0.0.1:8080"
STEADY_KEYS = 200


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def post(key, caller):
    req = urllib.request.Request(f"{LISTENER}/payments", data=b'{"amount":1}', method="POST", headers={
        "Authorization": caller, "Idempotency-Key": key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("idempotent-replayed")
    except urllib.error.HTTPError as e:
        return e.code, None


def stats():
    out = {}
    for line in get(f"{ADMIN}/stats?filter=wasmcustom.idempotency").splitlines():
        name, _, value = line.partition(": ")
        out[name.removeprefix("wasmcustom.idempotency.")] = int(value)
    return out


def main():
    seconds = int(sys.argv[1]) if len(sys.argv) > 1 else 25
    python = os.path.join(ROOT, ".venv/bin/python")
    log = tempfile.NamedTemporaryFile(prefix="flood-", suffix=".log", delete=False)
    demo = subprocess.Popen([python, os.path.join(ROOT, "envoy/demo.py")], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "IDEM_DEMO_WASM_LOG": "warning"})
    try:
        for _ in range(300):
            try:
                get(f"{ADMIN}/ready")
                get(f"{UPSTREAM}/__effects")
                break
            except OSError:
                time.sleep(0.1)
        steady = [f"steady-{i}" for i in range(STEADY_KEYS)]
        first = [post(k, "Bearer steady") for k in steady]
        assert all(s == 201 for s, _ in first), first[:3]
        stop = threading.Event()
        retried = {"requests": 0, "replays": 0, "other": {}}

        def retry_loop():
            while not stop.is_set():
                for k in steady:
                    status, replayed = post(k, "Bearer steady")
                    retried["requests"] += 1
                    if replayed == "true":
                        retried["replays"] += 1
                    else:
                        retried["other"][status] = retried["other"].get(status, 0) + 1

        loop = threading.Thread(target=retry_loop, daemon=True)
        loop.start()
        wrk = subprocess.run(["wrk", "-t2", "-c32", f"-d{seconds}s", "-s", os.path.join(ROOT, "bench/unique.lua"),
                              LISTENER, "--", f"flood{int(time.time())}"], capture_output=True, text=True)
        stop.set()
        loop.join()
        time.sleep(2)  # a sweep pass and the retention report
        s = stats()
        effects = json.loads(get(f"{UPSTREAM}/__effects"))["effects"]
        runs = [effects.get(k, 0) for k in steady]
        flood = re.search(r"(\d+) requests in", wrk.stdout)
        print(f"flood: {flood.group(1) if flood else '?'} requests in {seconds} s from one caller (wrk -c32)")
        print(f"steady caller: {retried['requests']} retries of its {STEADY_KEYS} keys during the flood, "
              f"{retried['replays']} replays, others {retried['other']}; upstream runs per key: "
              f"min {min(runs)} max {max(runs)} total {sum(runs)}")
        keys = ["claimed", "evicted", "evicted_below_share", "store_full", "effective_retention_ms",
                "heaviest_caller_entries_permille", "heaviest_caller_bytes_permille", "entries_completed"]
        print("stats: " + ", ".join(f"{k} {s.get(k)}" for k in keys))
        with open(log.name, errors="replace") as f:
            told = [line for line in f if "fair share" in line]
        if told:
            print("log: " + told[-1][-220:])
        return 0 if max(runs) == 1 else 1
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(timeout=15)
        except subprocess.TimeoutExpired:
            demo.kill()


if __name__ == "__main__":
    sys.exit(main())
