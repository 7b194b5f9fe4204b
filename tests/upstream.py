#!/usr/bin/env python3
"""A test and demo upstream that counts effects per idempotency key.

Every request that is not a GET and not to an `/__` admin path is one *effect*, counted at
arrival (after its body is read, before any delay) under its raw `Idempotency-Key` value
("" when absent). The end-to-end tests compare these counts with what the clients saw.

Request headers drive the answer:
  x-delay-ms: N      sleep N ms before answering
  x-status-first: N  answer the key's first effect with status N (a route's retries)
  x-status: N        answer with status N (default 201 for writes, 200 for GET)
  x-body-bytes: N    answer with exactly N bytes of a pattern that names the effect
  x-set-cookie: a,b  one `set-cookie` header per comma-separated value
  x-reset: 1         count the effect, then reset the connection without answering
  x-hold: NAME       count the effect, then wait (60 s at most) for POST /__release?hold=NAME
  x-fence: N         a fencing token (docs/behaviour.md §3.9): after any delay or hold, the effect commits
                     only if N is at least the largest token committed for its key; else the
                     answer is 409 {"fenced": N, "largest": M}. Counted: "committed", "fenced".

Admin (never counted): GET /__effects -> {"effects", "resets", "committed", "fenced", "log"};
POST /__reset;
POST /__release?hold=NAME lets the requests held under NAME (now and later) answer.

Run: python3 tests/upstream.py --port N [--host 127.0.0.1]   (prints "READY <port>")
Import: make_server(host, port) or serve_in_thread(host, port).
"""

import argparse
import collections
import hashlib
import json
import select
import socket
import struct
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The log is for tests, not for load runs: bounded so a long benchmark cannot eat memory.
LOG_LIMIT = 100_000
# A held request answers after this long even if nobody releases it.
HOLD_LIMIT_S = 60
# Statuses that must not carry a body (RFC 9110 §6.4.1); 204 must not carry Content-Length.
NO_BODY_STATUSES = {204, 304}


class EffectStore:
    """Effects, write failures and a log, per key; one lock, since handlers run in threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.clear()

    def clear(self):
        with self.lock:
            self.effects = collections.Counter()
            self.resets = collections.Counter()
            self.committed = collections.Counter()
            self.fenced = collections.Counter()
            self.largest_token = {}
            self.log = collections.deque(maxlen=LOG_LIMIT)

    def count_effect(self, key, method, path, status, headers=None):
        """Record one effect; returns (its 1-based number for this key, its log entry).
        `headers`: the request's headers as received (name lowercased, repeated values
        joined with ", "), kept in the entry with the body's length."""
        with self.lock:
            self.effects[key] += 1
            entry = {"key": key, "effect": self.effects[key], "status": status,
                     "t": time.time(), "method": method, "path": path, "outcome": "pending",
                     "headers": headers or {}}
            self.log.append(entry)
            return entry["effect"], entry

    def commit(self, key, token, entry):
        """An effect with a fencing token commits unless a larger token committed first, as
        an upstream that remembers the largest token it acted on per key does."""
        with self.lock:
            largest = self.largest_token.get(key, -1)
            if token < largest:
                self.fenced[key] += 1
                if entry is not None:
                    entry["fence"] = token
                return largest
            self.largest_token[key] = token
            self.committed[key] += 1
            if entry is not None:
                entry["fence"] = token
            return None

    def current(self, key):
        with self.lock:
            return self.effects[key]

    def finish(self, entry, outcome):
        """outcome: "answered", "reset" (x-reset) or "write_failed" (peer gone)."""
        with self.lock:
            if entry is not None:
                entry["outcome"] = outcome
            if outcome == "write_failed" and entry is not None:
                self.resets[entry["key"]] += 1

    def count_write_failure(self, key):
        with self.lock:
            self.resets[key] += 1

    def snapshot(self):
        with self.lock:
            return {"effects": dict(self.effects), "resets": dict(self.resets),
                    "committed": dict(self.committed), "fenced": dict(self.fenced),
                    "log": [dict(e) for e in self.log]}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Envoy's upstream pool expects
    server_version = "idem-upstream/1"
    # The head and the body of an answer are two writes: with Nagle on, the body waits for
    # the ACK of the head, which the proxy delays (delayed ACK), so every answer on a
    # keep-alive connection took ~40 ms more.
    disable_nagle_algorithm = True

    def __getattr__(self, name):
        # BaseHTTPRequestHandler looks up do_<METHOD>; serve every method with one function.
        if name.startswith("do_"):
            return self.handle_any
        raise AttributeError(name)

    def log_message(self, fmt, *args):
        if self.server.verbose:
            super().log_message(fmt, *args)

    # --- request ----------------------------------------------------------------------

    def handle_any(self):
        body = self.read_body()
        if body is None:
            return  # malformed framing: the connection is closed
        if self.path.startswith("/__"):
            self.handle_admin()
            return
        key = self.headers.get("idempotency-key", "")
        status = self.int_header("x-status", 200 if self.command == "GET" else 201)
        entry = None
        if self.command == "GET":
            effect = self.server.store.current(key)
        else:
            received = {}
            for name, value in self.headers.items():
                name = name.lower()
                received[name] = f"{received[name]}, {value}" if name in received else value
            if "x-status-first" in self.headers and self.server.store.current(key) == 0:
                status = self.int_header("x-status-first", status)
            reset_status = 0 if self.headers.get("x-reset") == "1" else status
            effect, entry = self.server.store.count_effect(key, self.command, self.path,
                                                           reset_status, received)
        if self.headers.get("x-reset") == "1":
            self.reset_connection()
            self.server.store.finish(entry, "reset")
            return
        delay_ms = self.int_header("x-delay-ms", 0)
        if delay_ms > 0:
            time.sleep(delay_ms / 1000)
        hold = self.headers.get("x-hold")
        if hold:
            self.server.gate(hold).wait(HOLD_LIMIT_S)
        token = self.headers.get("x-fence")
        if token is not None and self.command != "GET":
            largest = self.server.store.commit(key, int(token) if token.isdigit() else -1, entry)
            if largest is not None:
                self.send_json(409, {"fenced": token, "largest": largest})
                self.server.store.finish(entry, "fenced")
                return
        self.answer(key, effect, status, body, entry)

    def read_body(self):
        """The whole request body (Content-Length or chunked), or None if the framing is bad."""
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                return self.read_chunked()
            length = int(self.headers.get("content-length") or 0)
            return self.rfile.read(length) if length > 0 else b""
        except (ValueError, OSError):
            self.close_connection = True
            return None

    def read_chunked(self):
        parts = []
        while True:
            size = int(self.rfile.readline(1024).split(b";")[0].strip(), 16)
            if size == 0:
                break
            parts.append(self.rfile.read(size))
            self.rfile.readline(16)  # the CRLF after the chunk
        while self.rfile.readline(8192) not in (b"\r\n", b"\n", b""):
            pass  # trailers, ignored
        return b"".join(parts)

    def int_header(self, name, default):
        try:
            return int(self.headers.get(name, default))
        except ValueError:
            return default

    # --- response ---------------------------------------------------------------------

    def answer(self, key, effect, status, request_body, entry):
        if self.peer_closed():
            # The proxy gave up while we "worked": the write would fail (or vanish into a
            # socket that only the kernel still holds), so record it as a failed write.
            self.close_connection = True
            self.record_write_failure(key, entry)
            return
        headers = [("x-effect", str(effect))]
        if "x-body-bytes" in self.headers:
            body = pattern_body(key, effect, self.int_header("x-body-bytes", 0))
            headers.append(("content-type", "application/octet-stream"))
        else:
            body = json.dumps({"key": key, "effect": effect, "method": self.command,
                               "path": self.path,
                               "body_sha256": hashlib.sha256(request_body).hexdigest()},
                              ).encode()
            headers.append(("content-type", "application/json"))
        for cookie in self.headers.get("x-set-cookie", "").split(","):
            if cookie.strip():
                headers.append(("set-cookie", cookie.strip()))
        try:
            self.send_raw(status, headers, body)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True
            self.record_write_failure(key, entry)
            return
        self.server.store.finish(entry, "answered")

    def send_raw(self, status, headers, body):
        no_body = status in NO_BODY_STATUSES or status < 200 or self.command == "HEAD"
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        if status != 204:
            self.send_header("content-length", "0" if no_body and status != 304
                             else str(len(body)))
        self.end_headers()  # flushes the header block: a dead peer shows up here or below
        if not no_body and body:
            self.wfile.write(body)

    def record_write_failure(self, key, entry):
        if entry is None:
            self.server.store.count_write_failure(key)  # a GET whose answer was lost
        else:
            self.server.store.finish(entry, "write_failed")

    def peer_closed(self):
        """True when the peer has closed or reset the connection (EOF or RST pending)."""
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (ConnectionResetError, OSError):
            return True

    def reset_connection(self):
        """Close abruptly: SO_LINGER 0 makes close() send RST instead of FIN."""
        self.close_connection = True
        sock = self.connection
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        # rfile holds a reference to the socket: the fd only closes once both are closed.
        self.rfile.close()
        sock.close()

    def handle_admin(self):
        path = self.path.split("?", 1)[0]
        if path == "/__effects":
            self.send_json(200, self.server.store.snapshot())
        elif path == "/__reset":
            self.server.store.clear()
            self.send_json(200, {"ok": True})
        elif path == "/__release":
            query = urllib.parse.parse_qs(self.path.partition("?")[2])
            for name in query.get("hold", []):
                self.server.gate(name).set()
            self.send_json(200, {"released": query.get("hold", [])})
        else:
            self.send_json(404, {"error": "unknown admin path"})

    def send_json(self, status, obj):
        body = json.dumps(obj).encode()
        try:
            self.send_raw(status, [("content-type", "application/json")], body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def pattern_body(key, effect, size):
    """Exactly `size` deterministic bytes; the effect number is in it, so effects differ."""
    unit = f"[{key}#{effect}]abcdefghijklmnopqrstuvwxyz0123456789\n".encode()
    return (unit * (size // len(unit) + 1))[:size]


class UpstreamServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck handler must never keep the process alive
    allow_reuse_address = True
    # Bursts of simultaneous connections (the concurrency tests send tens at once) must not
    # overflow the accept backlog: a dropped SYN costs a 1 s retransmit.
    request_queue_size = 1024

    def __init__(self, addr, verbose=False):
        super().__init__(addr, Handler)
        self.store = EffectStore()
        self.verbose = verbose
        self.gates = {}
        self.gates_lock = threading.Lock()

    def gate(self, name):
        """The event requests held under `name` wait for (x-hold)."""
        with self.gates_lock:
            return self.gates.setdefault(name, threading.Event())

    def handle_error(self, request, client_address):
        # Peers that vanish are part of the tests; only report real bugs.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def make_server(host="127.0.0.1", port=0, verbose=False):
    return UpstreamServer((host, port), verbose=verbose)


def serve_in_thread(host="127.0.0.1", port=0):
    """In-process server for quick experiments: returns (server, thread); server.shutdown()."""
    server = make_server(host, port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="log each request to stderr")
    args = parser.parse_args()
    server = make_server(args.host, args.port, verbose=args.verbose)
    print(f"READY {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
