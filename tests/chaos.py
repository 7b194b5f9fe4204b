#!/usr/bin/env python3
"""A bounded retry storm against real Envoy (issue "Reliability: retry storms, crashes and
hostile input"; docs/behaviour.md §1 rules 1-5, §3.5, §3.8).

Many clients, each with keys of their own plus a few keys shared by several clients at once
(concurrent duplicates), retry every key until they get a 2xx or give up after a bounded
number of attempts. Per attempt, at random:

- the upstream is slow (`x-delay-ms`), answers 500/503 (`x-status`) or resets the connection
  (`x-reset: 1`): the upstream decides by what the *client* sends, so two attempts of one key
  may carry different fault headers (they are not in the fingerprint);
- the client gives up early (socket timeout shorter than the upstream's delay) or hangs up
  mid-request (harness.abandon, half of them with RST), then retries with the same key;
- and once, in the middle, Envoy is killed with SIGKILL and restarted (shared data: the store
  is lost with the process; etcd: it is kept).

The upstream is tests/upstream.py with one addition (this file, `--serve-upstream`): each
effect's log entry also gets `t_answer`, the moment the upstream started to answer (or reset),
so an effect that arrived while the previous one was still running is seen.

At the end every key gets one clean request (no fault), after the marks of the killed Envoy
had time to expire, and the upstream's log is checked per key:

- duplicates: every effect after a key's first must be explained: the previous effect failed
  (5xx or reset: the key was released) and had ended, or the Envoy kill lost the mark or the
  stored answer (shared data: any effect before the kill; etcd: an effect whose completion the
  etcd watcher had not seen written when Envoy was killed), or (router mode only) the client of a
  successful effect left before its answer, so the mark expired. Anything else, in particular
  a second effect while the first was still running, or an effect after a stored success, is
  *unexplained*;
- lost answers: every 2xx a client got must be the upstream's answer of a successful effect of
  that key, byte for byte, and a replay must not be older than a newer success that had
  completed before the request was sent;
- plugin 5xx: problem+json 5xx, except 502 upstream-failed after an `x-reset` attempt, by type;
- unexpected answers (400/413/422/non-retryable 409 to identical requests) and stuck keys (the
  final clean request still gets 409 long after every call ended), and Wasm VM failures.

Exit status 0 only if unexplained duplicates, lost answers, plugin 5xx, other 5xx, unexpected
answers, stuck keys and VM failures are all 0.

    python tests/chaos.py --store shared_data|etcd --duration 120 --clients 40

Only 127.0.0.1; every loop is bounded in count and time; processes are stopped by their PID.
"""

import argparse
import collections
import hashlib
import json
import os
import random
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import harness  # noqa: E402
from harness import CALLER, Envoy, Upstream, abandon, request, wait_until  # noqa: E402

HOST = "chaos.example"
PATH = "/payments"
NAMESPACE = "idem"
PROBLEM_PREFIX = "urn:idempotency-filter:problem:"
# Lines of an Envoy log that mean the Wasm VM failed or the plugin panicked.
VM_FAILURE_LOG = re.compile(
    r"panicked|Function: proxy_on_\w+ failed|wasm trap|RuntimeError|invalid context_id|"
    r"Plugin configured to fail closed|wasm vm failed",
    re.IGNORECASE)


# --- store keys (src/key.rs StoreKey::derive, src/store/etcd.rs key_name) -------------------


def store_key(key, authority=HOST, scopes=(CALLER[1],), namespace=NAMESPACE):
    """The plugin's store key: SHA-256 over length-prefixed fields (u64 LE length + bytes):
    namespace, :authority, each scope value (absent = b"\\x00absent"), the client's key. The
    default scope is the `authorization` every test request carries (harness.CALLER)."""
    h = hashlib.sha256()

    def field_(data):
        if isinstance(data, str):
            data = data.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    field_(namespace)
    field_(authority)
    for scope in scopes:
        field_(b"\x00absent" if scope is None else scope)
    field_(key)
    return h.digest()


def etcd_key(key, **kwargs):
    """`/<namespace>/<hex of the store key>`, the etcd key of a client's key."""
    namespace = kwargs.get("namespace", NAMESPACE)
    return f"/{namespace}/{store_key(key, **kwargs).hex()}"


def log_tags(key, **kwargs):
    """How the plugin's debug log names a key: the first 6 bytes of the store key in hex
    (shared data), the last 12 hex digits of the etcd key (etcd)."""
    digest = store_key(key, **kwargs).hex()
    return digest[:12], digest[-12:]


# --- Wasm VM health -------------------------------------------------------------------------


def vm_failure_stats(envoy):
    """Wasm stats that say a VM failed: nonzero counters with fail/crash/error in the name."""
    stats = envoy.stats("wasm")
    return {name: value for name, value in stats.items()
            if value and re.search(r"fail|crash|error|panic", name)
            and not name.startswith("wasmcustom.")}


def vm_failure_lines(log_text):
    return [line for line in log_text.splitlines() if VM_FAILURE_LOG.search(line)]


def active_vms(envoy):
    return envoy.stat("wasm.envoy.wasm.runtime.v8.active", None)


def plugin_counters(envoy):
    prefix = "wasmcustom.idempotency."
    return {name[len(prefix):]: value for name, value in envoy.stats(re.escape(prefix)).items()
            if name.startswith(prefix)}


# --- the upstream, with the time each effect was answered ------------------------------------


def serve_upstream():
    """tests/upstream.py with `t_answer` on each effect's log entry (see the module doc)."""
    import http.client

    import upstream as up

    up.LOG_LIMIT = 5_000_000  # a storm must not push effects out of the log
    # http.server refuses requests with over 100 headers (431); Envoy adds a few of its own,
    # so a client's 100 headers would not reach the upstream.
    http.client._MAXHEADERS = 1000
    local = threading.local()
    count_effect, handle_any = up.EffectStore.count_effect, up.Handler.handle_any
    answer, reset_connection = up.Handler.answer, up.Handler.reset_connection

    def stamp(store, entry):
        if entry is not None and "t_answer" not in entry:
            with store.lock:
                entry["t_answer"] = time.time()

    def patched_count(self, key, method, path, status, headers=None):
        effect, entry = count_effect(self, key, method, path, status, headers)
        local.entry = entry
        return effect, entry

    def patched_handle(self):
        local.entry = None
        return handle_any(self)

    def patched_answer(self, key, effect, status, request_body, entry):
        stamp(self.server.store, entry)  # before the first byte is written
        return answer(self, key, effect, status, request_body, entry)

    def patched_reset(self):
        stamp(self.server.store, getattr(local, "entry", None))  # before the RST
        return reset_connection(self)

    up.EffectStore.count_effect = patched_count
    up.Handler.handle_any = patched_handle
    up.Handler.answer = patched_answer
    up.Handler.reset_connection = patched_reset
    server = up.make_server("127.0.0.1", 0)
    server.store.clear()  # the log's bound is read at clear()
    print(f"READY {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


class ChaosUpstream(Upstream):
    """harness.Upstream running `chaos.py --serve-upstream` instead of upstream.py."""

    def __init__(self, start_timeout=10.0):
        super().__init__(start_timeout, command=[os.path.abspath(__file__), "--serve-upstream"])

    def settled(self, timeout=30.0):
        """Waits until no effect is still running at the upstream; returns the snapshot."""
        snap = {}

        def done():
            snap.update(self.snapshot())
            return all(e["outcome"] != "pending" for e in snap["log"])

        try:
            wait_until(done, timeout=timeout, interval=0.2, message="every effect ended")
        except TimeoutError:
            pass  # reported: pending effects stay pending in the analysis
        return snap


# --- etcd's own record of the plugin's writes --------------------------------------------------


class EtcdWatcher(threading.Thread):
    """Watches the plugin's prefix through etcd's JSON gateway and keeps, per etcd key, every
    write as (time received, PUT|DELETE, mod_revision, state, gen, deadline_ms): the evidence
    of when a mark was renewed, completed, released or taken over."""

    def __init__(self, port, prefix=f"/{NAMESPACE}/"):
        super().__init__(daemon=True)
        self.port, self.prefix = port, prefix
        self.events = collections.defaultdict(list)
        self.lock = threading.Lock()
        self.error = None
        self.ready = threading.Event()

    def run(self):
        import base64
        import urllib.request
        end = self.prefix[:-1] + chr(ord(self.prefix[-1]) + 1)
        body = {"create_request": {"key": base64.b64encode(self.prefix.encode()).decode(),
                                   "range_end": base64.b64encode(end.encode()).decode()}}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v3/watch",
                                     data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(req) as resp:  # ends when etcd stops
                for line in resp:
                    self.ready.set()
                    now = time.time()
                    for ev in json.loads(line).get("result", {}).get("events", []):
                        kv = ev.get("kv", {})
                        key = base64.b64decode(kv.get("key", "")).decode("latin-1")
                        value = base64.b64decode(kv.get("value", ""))
                        with self.lock:
                            self.events[key].append(
                                (now, ev.get("type", "PUT"), int(kv.get("mod_revision", 0)),
                                 *decode_way(value)))
        except Exception as exc:  # noqa: BLE001 - etcd stopped, or the stream broke
            self.error = repr(exc)
        finally:
            self.ready.set()

    def history(self, name):
        with self.lock:
            return list(self.events.get(name, []))


def renewal_gaps(events, lease_ms):
    """Times between two writes of one in-progress mark by its owner (same gen): renewals
    should come every lease_ms/4; a gap near lease_ms lets the mark expire under a live call."""
    gaps = []
    for writes in events.values():
        for (t1, k1, _, s1, g1, _), (t2, k2, _, s2, g2, _) in zip(writes, writes[1:]):
            if k1 == k2 == "PUT" and s1 == "in_progress" and g1 == g2 and s2 == "in_progress":
                gaps.append(t2 - t1)
    if not gaps:
        return "renewals of in-progress marks: none seen"
    gaps.sort()
    q = lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))]  # noqa: E731
    late = sum(g > 0.75 * lease_ms / 1000 for g in gaps)
    return (f"renewals of in-progress marks (etcd writes by the same owner): {len(gaps)}, gap "
            f"p50 {q(0.5) * 1000:.0f} ms p99 {q(0.99) * 1000:.0f} ms max {gaps[-1] * 1000:.0f} ms, "
            f"{late} over 3/4 of lease_ms")


def decode_way(value):
    """(state, gen, deadline_ms) of an etcd entry (src/entry.rs: b"E\\x02", then the way:
    state u8, gen u64, key tag [16], fingerprint [16], deadline u64, since u64, bytes u32,
    little endian)."""
    if len(value) < 2 + 61 or value[:2] != b"E\x02":
        return ("?", 0, 0)
    state = {0: "free", 1: "in_progress", 2: "completed", 3: "completed_no_body"}.get(
        value[2], str(value[2]))
    gen = int.from_bytes(value[3:11], "little")
    deadline = int.from_bytes(value[43:51], "little")
    return (state, gen, deadline)


# --- clients --------------------------------------------------------------------------------


@dataclass
class Attempt:
    key: str
    client: int
    phase: str  # "storm" or "verify"
    t0: float
    kind: str = "normal"  # normal | timeout (short socket timeout) | abandon
    fault: str = "none"  # none | 500 | 503 | reset
    delay_ms: int = 0
    t1: float = 0.0
    status: int = None
    error: str = None
    replayed: bool = False
    problem: str = None
    content_type: str = None
    body: bytes = b""


def body_for(key):
    amount = int(hashlib.sha256(key.encode()).hexdigest()[:4], 16)
    return json.dumps({"amount": amount, "ref": key}).encode()


def base_headers(key):
    return [("Host", HOST), CALLER, ("content-type", "application/json"), ("Idempotency-Key", key)]


def problem_slug(resp):
    if resp.header("content-type") != "application/problem+json":
        return None
    try:
        kind = json.loads(resp.body).get("type", "")
    except ValueError:
        return "unparsable"
    return kind[len(PROBLEM_PREFIX):] if kind.startswith(PROBLEM_PREFIX) else kind


class Storm:
    """One run: processes, clients, the kill, the final pass and the analysis."""

    def __init__(self, store="shared_data", duration=90.0, clients=40, forward="detached",
                 lease_ms=None, kill_at=None, seed=None, shared_fraction=0.15,
                 max_attempts=40, max_session_s=60.0, retry_scale=0.3,
                 log=print, wasm_log_level=None, report_path=None, keep_logs=None):
        self.store = store
        self.duration = float(duration)
        self.clients = int(clients)
        self.forward = forward
        # The smallest leases the plugin accepts: 1 s on shared data, 3 s with etcd.
        self.lease_ms = int(lease_ms if lease_ms is not None else (3000 if store == "etcd" else 1000))
        self.kill_at = self.duration / 2 if kill_at is None else kill_at  # < 0: no kill
        self.seed = random.randrange(1 << 30) if seed is None else seed
        self.shared_fraction = shared_fraction
        self.max_attempts = max_attempts
        self.max_session_s = max_session_s
        self.retry_scale = retry_scale
        self.log = log
        self.wasm_log_level = wasm_log_level
        self.report_path = report_path
        self.keep_logs = keep_logs
        self.run_id = f"{self.seed:08x}"
        self.attempts = []
        self.lock = threading.Lock()
        self.keys = {}  # key -> "own" | "shared"
        self.gave_up = collections.Counter()
        self.stop = threading.Event()
        self.envoy = self.upstream = self.etcd = None
        self.t_start = self.t_kill = self.t_ready = None
        self.restart_s = None
        self.envoy_logs = []
        self.counters = []
        self.vm_failures = []
        self.kill_error = None
        self.skipped_verify = set()
        self.etcd_latency = []
        self.watcher = None

    # --- processes ------------------------------------------------------------------------

    def plugin_config(self):
        config = {"forward": self.forward, "lease_ms": self.lease_ms,
                  "upstream_timeout_ms": 10000, "retry_after_s": 1}
        if self.store == "etcd":
            config["store"] = {"kind": "etcd", "cluster": "etcd"}
        return config

    def start(self):
        self.upstream = ChaosUpstream()
        kwargs = {}
        if self.store == "etcd":
            from etcd_util import Etcd, cluster as etcd_cluster
            self.etcd = Etcd()
            kwargs["extra_clusters"] = [etcd_cluster(self.etcd.port)]
            self.watcher = EtcdWatcher(self.etcd.port)
            self.watcher.start()
            self.watcher.ready.wait(2)
        if self.wasm_log_level:
            kwargs["wasm_log_level"] = self.wasm_log_level
        self.envoy = Envoy(self.plugin_config(), self.upstream.port, concurrency=2, **kwargs)
        self.vms_at_start = active_vms(self.envoy)

    def snapshot_stats(self, name):
        """The plugin's counters; with etcd also Envoy's view of the etcd cluster (timeouts,
        overflows, and the latency histogram: a slow etcd delays renewals)."""
        self.counters.append((name, plugin_counters(self.envoy)))
        if self.store == "etcd":
            stats = self.envoy.stats(r"^cluster\.etcd\.upstream_rq_")
            wanted = ("timeout", "5xx", "overflow", "total", "retry")
            self.counters.append((f"{name}, etcd cluster", {
                k[len("cluster.etcd."):]: v for k, v in stats.items()
                if any(w in k for w in wanted)}))
            text = self.envoy.admin("/stats?filter=" + "cluster.etcd.upstream_rq_time")
            self.etcd_latency.append((name, " ".join(text.split())[:400]))

    def close(self):
        self.stop.set()
        for proc in (self.envoy, self.upstream):
            if proc is not None:
                try:
                    proc.stop()
                except Exception as exc:  # noqa: BLE001 - keep stopping the others
                    self.log(f"stop failed: {exc!r}")
        if self.etcd is not None:
            self.etcd.stop()
            if self.keep_logs:
                os.makedirs(self.keep_logs, exist_ok=True)
                with open(os.path.join(self.etcd.tmp, "etcd.log"), "rb") as src, \
                        open(os.path.join(self.keep_logs, "etcd.log"), "wb") as dst:
                    dst.write(src.read())
            self.etcd.close()

    def record(self, attempt):
        with self.lock:
            self.attempts.append(attempt)

    # --- one attempt ----------------------------------------------------------------------

    def plan(self, rng, attempt):
        r = rng.random()
        if r < 0.06:
            attempt.fault = "reset"
        elif r < 0.15:
            attempt.fault = rng.choice(["500", "503"])
        r = rng.random()
        if r < 0.45:
            attempt.delay_ms = 0
        elif r < 0.85:
            attempt.delay_ms = rng.randint(1, 300)
        else:
            attempt.delay_ms = rng.randint(800, 2500)
        r = rng.random()
        if r < 0.10:
            attempt.kind = "abandon"
        elif r < 0.25:
            attempt.kind = "timeout"
        return attempt

    def send(self, rng, attempt):
        """Runs one attempt; returns the Response, or None (abandoned or failed)."""
        headers = base_headers(attempt.key)
        if attempt.delay_ms:
            headers.append(("x-delay-ms", str(attempt.delay_ms)))
        if attempt.fault == "reset":
            headers.append(("x-reset", "1"))
        elif attempt.fault != "none":
            headers.append(("x-status", attempt.fault))
        body = body_for(attempt.key)
        try:
            if attempt.kind == "abandon":
                abandon(self.envoy.port, "POST", PATH, headers, body,
                        after_s=rng.uniform(0.0, 0.6), rst=rng.random() < 0.5)
                return None
            timeout = rng.uniform(0.15, 1.0) if attempt.kind == "timeout" else 8.0
            resp = request(self.envoy.port, "POST", PATH, headers, body, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - timeouts, resets, refused: all retried
            attempt.error = type(exc).__name__
            return None
        finally:
            attempt.t1 = time.time()
        attempt.status = resp.status
        attempt.content_type = resp.header("content-type")
        attempt.replayed = resp.header("idempotent-replayed") == "true"
        attempt.problem = problem_slug(resp)
        if 200 <= resp.status < 300:
            attempt.body = resp.body
        return resp

    def pause_after(self, rng, attempt, resp):
        """How long a client waits before its next attempt: Retry-After, scaled down."""
        if resp is not None and resp.header("retry-after"):
            try:
                wait = float(resp.header("retry-after")) * self.retry_scale
            except ValueError:
                wait = 0.3
            return wait * rng.uniform(0.5, 1.5)
        if attempt.error == "ConnectionRefusedError":
            return rng.uniform(0.2, 0.5)  # Envoy is restarting
        return rng.uniform(0.02, 0.2)

    def session(self, rng, cid, key, phase, hard_deadline):
        """Attempts for one key until a 2xx, a final refusal, or the bounds. Returns why it
        ended: "ok", "refused <status>", "gave_up" or "stopped"."""
        started = time.time()
        for _ in range(self.max_attempts):
            if time.time() > hard_deadline:
                return "stopped"
            if time.time() - started > self.max_session_s:
                return "gave_up"
            attempt = Attempt(key, cid, phase, time.time())
            if phase == "storm":
                self.plan(rng, attempt)
            resp = self.send(rng, attempt)
            self.record(attempt)
            if resp is not None:
                if 200 <= resp.status < 300:
                    return "ok"
                retryable = resp.status == 409 and attempt.problem == "in-progress"
                if not retryable and resp.status < 500:
                    return f"refused {resp.status}"
            time.sleep(self.pause_after(rng, attempt, resp))
        return "gave_up"

    def shared_key(self, rng):
        epoch = int((time.time() - self.t_start) / 3.0)
        return f"{self.run_id}-s{epoch}-{rng.randrange(4)}"

    def client(self, cid):
        rng = random.Random(self.seed * 1000 + cid)
        end = self.t_start + self.duration
        hard = end + 20.0
        n = 0
        while time.time() < end and not self.stop.is_set():
            if rng.random() < self.shared_fraction:
                key, kind = self.shared_key(rng), "shared"
            else:
                key, kind = f"{self.run_id}-c{cid}-{n}", "own"
                n += 1
            with self.lock:
                self.keys.setdefault(key, kind)
            outcome = self.session(rng, cid, key, "storm", hard)
            if outcome != "ok":
                with self.lock:
                    self.gave_up[outcome.split()[0] if outcome != "gave_up" else outcome] += 1

    # --- the kill ---------------------------------------------------------------------------

    def killer(self):
        if self.kill_at < 0 or self.stop.wait(self.kill_at):
            return
        try:
            self.snapshot_stats("before kill")
            self.vm_failures += [f"before kill: {k}={v}" for k, v in
                                 vm_failure_stats(self.envoy).items()]
            self.envoy.kill(signal.SIGKILL)
            self.t_kill = time.time()
            self.envoy_logs.append(("before kill", self.envoy.log_text()))
            self.log(f"[{self.t_kill - self.t_start:6.1f}s] Envoy {self.envoy.pid} "
                     f"killed (SIGKILL)")
            self.envoy.restart()
            self.t_ready = time.time()
            self.restart_s = self.t_ready - self.t_kill
            self.log(f"[{self.t_ready - self.t_start:6.1f}s] Envoy restarted as {self.envoy.pid} "
                     f"in {self.restart_s:.1f}s")
            self.vms_at_start = active_vms(self.envoy)
        except Exception as exc:  # noqa: BLE001 - the run goes on; reported
            self.kill_error = repr(exc)
            self.log(f"kill/restart failed: {exc!r}")

    # --- the run ----------------------------------------------------------------------------

    def run(self):
        try:
            self.start()
            return self._run()
        finally:
            self.close()

    def _run(self):
        with open(harness.wasm_path(), "rb") as f:
            wasm_sha = hashlib.sha256(f.read()).hexdigest()
        self.log(f"plugin {harness.wasm_path()} sha256 {wasm_sha[:16]}")
        self.log(f"chaos: store={self.store} forward={self.forward} lease_ms={self.lease_ms} "
                 f"duration={self.duration:.0f}s clients={self.clients} seed={self.seed} "
                 f"kill_at={self.kill_at:.0f}s envoy={self.envoy.port} "
                 f"upstream={self.upstream.port}")
        self.t_start = time.time()
        killer = threading.Thread(target=self.killer, daemon=True)
        killer.start()
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True)
                   for i in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, self.t_start + self.duration + 60 - time.time()))
        self.stop.set()
        killer.join(60)
        stragglers = sum(t.is_alive() for t in threads)
        storm_s = time.time() - self.t_start
        self.log(f"[{storm_s:6.1f}s] storm over ({len(self.attempts)} attempts); "
                 f"{stragglers} clients still running")

        # The final pass, once every call has ended (the killed Envoy's marks expired long
        # ago) and the plugin had a moment to write the last completions (a 409 is retried).
        self.upstream.settled(timeout=30)
        time.sleep(1.0)
        self.verify_all()
        snap = self.upstream.settled(timeout=30)
        self.snapshot_stats("end")
        self.vm_failures += [f"end: {k}={v}" for k, v in vm_failure_stats(self.envoy).items()]
        if active_vms(self.envoy) != self.vms_at_start:
            self.vm_failures.append(f"active VMs {self.vms_at_start} -> {active_vms(self.envoy)}")
        self.envoy_logs.append(("end", self.envoy.log_text()))
        for name, text in self.envoy_logs:
            self.vm_failures += [f"{name} log: {line[-240:]}"
                                 for line in vm_failure_lines(text)[:20]]
        if stragglers:
            self.vm_failures.append(f"{stragglers} client threads did not stop")
        if self.keep_logs:
            os.makedirs(self.keep_logs, exist_ok=True)
            for i, (name, text) in enumerate(self.envoy_logs):
                path = os.path.join(self.keep_logs, f"envoy-{i}-{name.replace(' ', '-')}.log")
                with open(path, "w") as f:
                    f.write(text)
            self.log(f"Envoy logs kept in {self.keep_logs}")
        return self.analyse(snap["log"])

    def verify_all(self):
        """One clean request per key: a replay of its stored answer, or (no success yet) the
        work done now; never a 409 long after every call ended. With shared data, keys whose
        client got its answer before the kill are left out: the store died with the process,
        so asking again would only run them again (explained, but it tells nothing)."""
        done_before_kill = set()
        if self.store == "shared_data" and self.t_kill is not None:
            last_ok = {}
            for a in self.attempts:
                if a.status is not None and 200 <= a.status < 300:
                    last_ok[a.key] = max(last_ok.get(a.key, 0.0), a.t1)
            done_before_kill = {k for k, t in last_ok.items() if t < self.t_kill}
        self.skipped_verify = done_before_kill
        keys = sorted(set(self.keys) - done_before_kill)
        rng = random.Random(self.seed + 7)
        self.verify_outcomes = collections.Counter()
        hard = time.time() + 240

        def one(i):
            return self.session(random.Random(rng.random() + i), -1, keys[i], "verify", hard)

        started = time.time()
        with ThreadPoolExecutor(max(4, min(self.clients, 32))) as pool:
            for outcome in pool.map(one, range(len(keys))):
                self.verify_outcomes[outcome] += 1
        self.log(f"final pass over {len(keys)} keys in {time.time() - started:.1f}s: "
                 f"{dict(self.verify_outcomes)} ({len(done_before_kill)} keys answered before "
                 f"the kill left out)")

    # --- analysis ---------------------------------------------------------------------------

    def analyse(self, log):
        effects = collections.defaultdict(list)
        for e in log:
            effects[e["key"]].append(e)
        for key in effects:
            effects[key].sort(key=lambda e: e["effect"])
        by_key = collections.defaultdict(list)
        for a in self.attempts:
            by_key[a.key].append(a)

        result = Result(store=self.store, forward=self.forward, duration=self.duration,
                        clients=self.clients, seed=self.seed)
        result.requests = len(self.attempts)
        result.keys = len(self.keys)
        result.effects = len(log)
        result.restart_s = self.restart_s
        result.kill_error = self.kill_error
        result.gave_up = dict(self.gave_up)
        result.counters = self.counters
        if self.watcher is not None:
            with self.watcher.lock:
                events = {k: list(v) for k, v in self.watcher.events.items()}
            writes = sum(len(v) for v in events.values())
            result.notes.append(f"etcd watch saw {writes} writes on {len(events)} keys"
                                + (f" (stream ended: {self.watcher.error})"
                                   if self.watcher.error else ""))
            result.notes.append(renewal_gaps(events, self.lease_ms))
            if self.keep_logs:
                os.makedirs(self.keep_logs, exist_ok=True)
                with open(os.path.join(self.keep_logs, "etcd-writes.json"), "w") as f:
                    json.dump({"t_start": self.t_start, "t_kill": self.t_kill, "events": events}, f)
        result.notes += [f"etcd latency seen by Envoy ({n}): {t}" for n, t in self.etcd_latency]
        result.vm_failures = list(self.vm_failures)
        result.statuses = collections.Counter(
            (a.status if a.status is not None else (a.error or a.kind)) for a in self.attempts)
        foreign = [k for k in effects if k not in self.keys]
        if foreign:
            result.notes.append(f"effects for keys no client sent: {foreign[:5]}")
        pending = [e for e in log if e["outcome"] == "pending"]
        if pending:
            result.notes.append(f"{len(pending)} effects still pending at the end")

        for key, elist in effects.items():
            for j in range(1, len(elist)):
                reason = self.explain(elist, j, by_key.get(key, []))
                if reason.startswith("UNEXPLAINED"):
                    result.unexplained.append((key, elist[j]["effect"], reason))
                else:
                    result.explained[reason] += 1
        for a in self.attempts:
            self.check_answer(a, effects.get(a.key, []), result)

        verify_last = {}
        for a in self.attempts:
            if a.phase == "verify":
                verify_last[a.key] = a
        for key in set(self.keys) - self.skipped_verify:
            last = verify_last.get(key)
            if last is None or last.status is None or not 200 <= last.status < 300:
                what = "no answer" if last is None else (last.status or last.error)
                result.stuck.append((key, what))
        shown = result.unexplained[:5] + [(k, None, w) for k, w in result.stuck[:3]]
        for key, effect, reason in shown:
            result.details.append(self.describe_key(key, effects.get(key, []),
                                                    by_key.get(key, []), reason))
        if self.report_path:
            with open(self.report_path, "w") as f:
                f.write(result.summary() + "\n\n" + "\n\n".join(
                    self.describe_key(k, effects.get(k, []), by_key.get(k, []), r)
                    for k, _, r in result.unexplained) + "\n")
        return result

    def lost_by_kill(self, success, later):
        """The kill explains why `success` (an earlier successful effect) neither blocked nor
        was replayed to `later`."""
        if self.t_kill is None or not success["t"] < self.t_kill <= later["t"]:
            return False
        if self.store == "shared_data":
            return True  # the store died with the process
        # etcd keeps completed entries: only a completion not written when Envoy died is lost.
        # The watcher saw every write: a completion of this key before the kill excuses nothing.
        return not self.completed_in_etcd_before_kill(success["key"])

    def completed_in_etcd_before_kill(self, key):
        if self.watcher is None:
            return False
        return any(kind == "PUT" and state.startswith("completed") and t < self.t_kill
                   for t, kind, _, state, _, _ in self.watcher.history(etcd_key(key)))

    def lost_by_disconnect(self, success, later, attempts):
        """Router mode: the client of `success` left before its answer; the mark expired."""
        if self.forward != "router":
            return False
        end = (success.get("t_answer") or success["t"]) + 0.5
        return any(a.kind in ("abandon", "timeout") or a.error
                   for a in attempts if success["t"] - 0.05 <= a.t1 <= end and a.t1 <= later["t"])

    def explain(self, elist, j, attempts):
        e, prev = elist[j], elist[j - 1]
        for s in elist[:j]:
            if is_success(s) and not (self.lost_by_kill(s, e)
                                      or self.lost_by_disconnect(s, e, attempts)):
                return (f"UNEXPLAINED: effect {e['effect']} after successful effect "
                        f"{s['effect']} ({s['status']}, {s['outcome']})")
        prev_end = prev.get("t_answer")
        if prev_end is None or e["t"] < prev_end:
            if self.t_kill is not None and prev["t"] < self.t_kill <= e["t"]:
                return "kill"
            if self.forward == "router" and self.lost_by_disconnect(prev, e, attempts):
                return "expiry"
            return (f"UNEXPLAINED: effect {e['effect']} arrived while effect {prev['effect']} "
                    f"was still running at the upstream "
                    f"({(prev_end or float('nan')) - e['t']:.3f}s before its answer)")
        if is_success(prev):
            return "kill" if self.lost_by_kill(prev, e) else "expiry"
        return "released"

    def check_answer(self, a, elist, result):
        if a.status is None:
            return
        if 200 <= a.status < 300:
            self.check_success(a, elist, result)
        elif a.status >= 500:
            if a.problem is not None:
                expected = a.problem == "upstream-failed" and a.status == 502 and a.fault == "reset"
                if not expected:
                    result.plugin_5xx[f"{a.status} {a.problem}"] += 1
            elif a.fault in ("500", "503") and str(a.status) == a.fault:
                pass  # the upstream's own failure, passed through
            elif self.forward == "router" and a.fault == "reset" and a.status == 503:
                pass  # Envoy's own answer to the reset, passed through (docs/limits.md)
            else:
                result.other_5xx[f"{a.status} {a.content_type}"] += 1
        elif a.status == 409 and a.problem == "in-progress":
            pass
        else:
            result.unexpected[f"{a.status} {a.problem}"] += 1
            result.unexpected_examples.append((a.key, a.phase, a.status, a.problem))

    def check_success(self, a, elist, result):
        def lost(why):
            result.lost.append((a.key, why))

        try:
            body = json.loads(a.body)
            n = int(body["effect"])
        except (ValueError, KeyError, TypeError):
            return lost(f"{a.status} body is not the upstream's: {a.body[:120]!r}")
        if body.get("key") != a.key:
            return lost(f"answer of key {body.get('key')!r}")
        match = [e for e in elist if e["effect"] == n]
        if not match:
            return lost(f"effect {n} is not in the upstream's log")
        e = match[0]
        if not is_success(e) or e["status"] != a.status:
            return lost(f"got {a.status} of effect {n}, which was {e['status']} {e['outcome']}")
        expected = json.dumps({"key": a.key, "effect": n, "method": "POST", "path": PATH,
                               "body_sha256": hashlib.sha256(body_for(a.key)).hexdigest()}).encode()
        if a.body != expected:
            return lost(f"body of effect {n} differs: {a.body[:160]!r}")
        if a.replayed:
            newer = [s for s in elist if is_success(s) and s["effect"] > n
                     and s["outcome"] == "answered" and s.get("t_answer") is not None
                     and s["t_answer"] + 1.0 < a.t0]
            if newer:
                return lost(f"replay of effect {n} although effect {newer[-1]['effect']} "
                            f"completed {a.t0 - newer[-1]['t_answer']:.1f}s before the request")
        result.successes += 1

    def describe_key(self, key, elist, attempts, reason):
        t0 = self.t_start
        lines = [f"key {key} ({self.keys.get(key)}): {reason}"]
        if self.t_kill:
            lines.append(f"  kill at +{self.t_kill - t0:.3f}s, "
                         f"ready at +{(self.t_ready or 0) - t0:.3f}s")
        for e in elist:
            ta = e.get("t_answer")
            lines.append(f"  effect {e['effect']}: arrived +{e['t'] - t0:.3f}s answered "
                         f"{'+%.3fs' % (ta - t0) if ta else '-'} "
                         f"status {e['status']} {e['outcome']}")
        for a in sorted(attempts, key=lambda a: a.t0):
            got = a.status if a.status is not None else (a.error or "-")
            extra = f" {a.problem}" if a.problem else ""
            if a.status and 200 <= a.status < 300:
                try:
                    extra += f" effect {json.loads(a.body)['effect']}"
                except (ValueError, KeyError):
                    pass
                extra += " (replay)" if a.replayed else ""
            lines.append(f"  attempt c{a.client} {a.phase} +{a.t0 - t0:.3f}s..+{a.t1 - t0:.3f}s "
                         f"{a.kind} fault={a.fault} delay={a.delay_ms}: {got}{extra}")
        if self.watcher is not None:
            for (t, kind, rev, state, gen, deadline) in self.watcher.history(etcd_key(key))[:30]:
                lines.append(f"  etcd write seen +{t - t0:.3f}s: {kind} rev {rev} {state} "
                             f"gen {gen:016x} deadline "
                             f"{'+%.3fs' % (deadline / 1000 - t0) if deadline else '-'}")
        tags = log_tags(key)
        times = [e["t"] for e in elist] + [e.get("t_answer") or e["t"] for e in elist]
        window = (min(times) - 0.5, max(times) + 0.5) if times else None
        for name, text in self.envoy_logs:
            hits = [line for line in text.splitlines() if any(t in line for t in tags)]
            for line in hits[:12]:
                lines.append(f"  envoy ({name}): {line[-160:]}")
            if window:  # Envoy's warnings and errors while this key's effects ran
                near = [line for line in text.splitlines()
                        if re.search(r"\]\[(warning|error|critical)\]", line)
                        and window[0] <= log_time(line) <= window[1]]
                for line in near[:8]:
                    lines.append(f"  envoy ({name}) nearby: {line[-200:]}")
        return "\n".join(lines)


def log_time(line):
    """The time of an Envoy log line ("[2026-11-29 10:55:37.942]..."), or 0."""
    match = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(\.\d+)\]", line)
    if not match:
        return 0.0
    return time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + float(match.group(2))


def is_success(effect):
    return 200 <= effect["status"] < 300 and effect["outcome"] in ("answered", "write_failed",
                                                                   "pending")


@dataclass
class Result:
    store: str
    forward: str
    duration: float
    clients: int
    seed: int
    requests: int = 0
    keys: int = 0
    effects: int = 0
    successes: int = 0
    restart_s: float = None
    kill_error: str = None
    explained: collections.Counter = field(default_factory=collections.Counter)
    unexplained: list = field(default_factory=list)
    lost: list = field(default_factory=list)
    plugin_5xx: collections.Counter = field(default_factory=collections.Counter)
    other_5xx: collections.Counter = field(default_factory=collections.Counter)
    unexpected: collections.Counter = field(default_factory=collections.Counter)
    unexpected_examples: list = field(default_factory=list)
    stuck: list = field(default_factory=list)
    gave_up: dict = field(default_factory=dict)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    counters: list = field(default_factory=list)
    vm_failures: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    details: list = field(default_factory=list)

    @property
    def ok(self):
        # A 5xx the plugin made itself, or one nobody explains, is a failure too: clients that
        # retry would otherwise hide a plugin that keeps answering 503.
        return not (self.unexplained or self.lost or self.unexpected or self.stuck
                    or self.vm_failures or self.kill_error or self.plugin_5xx
                    or self.other_5xx)

    def summary(self):
        explained = sum(self.explained.values())
        return (f"CHAOS store={self.store} forward={self.forward} duration={self.duration:.0f}s "
                f"clients={self.clients}: requests={self.requests} keys={self.keys} "
                f"effects={self.effects} duplicates_explained={explained} "
                f"{dict(sorted(self.explained.items()))} "
                f"duplicates_unexplained={len(self.unexplained)} lost_answers={len(self.lost)} "
                f"plugin_5xx={dict(sorted(self.plugin_5xx.items()))} "
                f"other_5xx={dict(sorted(self.other_5xx.items()))} "
                f"unexpected={dict(sorted(self.unexpected.items()))} stuck_keys={len(self.stuck)} "
                f"vm_failures={len(self.vm_failures)} "
                f"restart={'%.1fs' % self.restart_s if self.restart_s else 'none'} "
                f"seed={self.seed}")

    def report(self):
        out = [f"answers: {dict(sorted(self.statuses.items(), key=str))}",
               f"sessions that ended without a 2xx during the storm: {self.gave_up}",
               f"other 5xx (not problem+json, not the upstream's x-status): {dict(self.other_5xx)}"]
        for name, counters in self.counters:
            out.append(f"counters ({name}): "
                       f"{ {k: v for k, v in sorted(counters.items()) if v} }")
        out += [f"note: {n}" for n in self.notes]
        if self.kill_error:
            out.append(f"KILL/RESTART FAILED: {self.kill_error}")
        out += [f"UNEXPLAINED {k} effect {n}: {r}" for k, n, r in self.unexplained[:20]]
        out += [f"LOST {k}: {why}" for k, why in self.lost[:20]]
        out += [f"UNEXPECTED {x}" for x in self.unexpected_examples[:20]]
        out += [f"STUCK {k}: last answer {w}" for k, w in self.stuck[:20]]
        out += [f"VM FAILURE {x}" for x in self.vm_failures[:20]]
        out += self.details
        out.append(self.summary())
        return "\n".join(out)


def run(**kwargs):
    return Storm(**kwargs).run()


def main(argv=None):
    if argv is None and "--serve-upstream" in sys.argv[1:]:
        return serve_upstream()
    parser = argparse.ArgumentParser(description="A bounded retry storm against real Envoy.")
    parser.add_argument("--store", choices=["shared_data", "etcd"], default="shared_data")
    parser.add_argument("--duration", type=float, default=90.0, help="storm seconds (max 600)")
    parser.add_argument("--clients", type=int, default=40, help="client threads (max 200)")
    parser.add_argument("--forward", choices=["detached", "router"], default="detached")
    parser.add_argument("--lease-ms", type=int, default=None,
                        help="default: 1000 on shared data, 3000 with etcd")
    parser.add_argument("--kill-at", type=float, default=None,
                        help="seconds into the storm for the SIGKILL (default: half; <0: none)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--wasm-log", default=None, help="the wasm log level (default debug)")
    parser.add_argument("--report", default=None, help="write unexplained cases to this file")
    parser.add_argument("--keep-logs", default=None, help="save Envoy's logs in this directory")
    args = parser.parse_args(argv)
    if not 0 < args.duration <= 600 or not 0 < args.clients <= 200:
        parser.error("--duration must be in (0, 600] and --clients in (0, 200]")

    def on_term(signum, frame):
        raise KeyboardInterrupt  # runs the finally blocks: our processes are stopped

    signal.signal(signal.SIGTERM, on_term)
    result = run(store=args.store, duration=args.duration, clients=args.clients,
                 forward=args.forward, lease_ms=args.lease_ms, kill_at=args.kill_at,
                 seed=args.seed,
                 wasm_log_level=args.wasm_log, report_path=args.report,
                 keep_logs=args.keep_logs)
    print(result.report(), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
