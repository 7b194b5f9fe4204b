"""TCP relays for the end-to-end tests: a slow network in front of etcd, and a broken HTTP/2
upstream in front of a gRPC server.

`Relay(target_port, delay_ms=150)` listens on a free 127.0.0.1 port and forwards every
connection to `target_port`, delaying every chunk it reads, in each direction, by `delay_ms`
(a link with that one-way latency: chunk order is kept, throughput is not limited). An Envoy
cluster pointed at `relay.port` instead of etcd's client port sees etcd `2 × delay_ms` away.

`Relay(..., downstream_filter=H2TrailersCut)` rewrites what the target sends back: a factory
called once per connection, whose `feed(bytes) -> (bytes, close)` returns what to pass on and
whether to close the connection after it. `H2TrailersCut` turns a gRPC server into one whose
answer ends without trailers (`mode="end"`: an empty DATA frame with END_STREAM instead) or is
reset after its headers and message (`mode="reset"`: RST_STREAM instead), while `.armed` is
true; it only parses HTTP/2 frame headers (9 bytes), never HPACK.

Threads and sockets only; every wait is bounded; stop() closes everything it opened.
"""

import collections
import queue
import socket
import struct
import threading
import time

LOCALHOST = "127.0.0.1"
CHUNK = 65536
# A pump thread looks at the stop flag at least this often.
POLL_S = 0.1
_EOF = object()


class Relay:
    def __init__(self, target_port, delay_ms=0, *, downstream_filter=None, host=LOCALHOST):
        self.target = (host, target_port)
        self.delay_s = delay_ms / 1000.0
        self.downstream_filter = downstream_filter
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets = set()
        self._threads = []
        self.connections = 0
        # Set once a downstream filter has closed a connection.
        self.closed_by_filter = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(128)
        self._listener.settimeout(POLL_S)
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop, "relay-accept")

    # --- threads ------------------------------------------------------------------------

    def _spawn(self, target, name, *args):
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _track(self, sock):
        with self._lock:
            self._sockets.add(sock)

    def _accept_loop(self):
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(POLL_S)
                self._track(s)
            self.connections += 1
            conn = _Connection(client, server)
            filt = self.downstream_filter() if self.downstream_filter else None
            self._pipe(conn, client, server, None, "up")
            self._pipe(conn, server, client, filt, "down")

    def _pipe(self, conn, src, dst, filt, name):
        """One direction: a reader that stamps chunks, a writer that sends each one when due."""
        chunks = queue.Queue()
        self._spawn(self._read_loop, f"relay-{name}-read", conn, src, chunks)
        self._spawn(self._write_loop, f"relay-{name}-write", conn, dst, chunks, filt)

    def _read_loop(self, conn, src, chunks):
        while not self._stop.is_set() and not conn.closed:
            try:
                data = src.recv(CHUNK)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                data = b""
            chunks.put((time.monotonic() + self.delay_s, data if data else _EOF))
            if not data:
                return

    def _write_loop(self, conn, dst, chunks, filt):
        while not self._stop.is_set() and not conn.closed:
            try:
                due, data = chunks.get(timeout=POLL_S)
            except queue.Empty:
                continue
            wait = due - time.monotonic()
            # Sleep in slices, so stop() is never held up by a long delay.
            while wait > 0 and not self._stop.is_set():
                time.sleep(min(wait, POLL_S))
                wait = due - time.monotonic()
            if data is _EOF:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    conn.close()
                conn.half_closed()
                return
            close = False
            if filt is not None:
                data, close = filt.feed(data)
            try:
                if data:
                    dst.sendall(data)
            except OSError:
                conn.close()
                return
            if close:
                time.sleep(0.05)  # the peer reads what was sent before the close
                conn.close()
                self.closed_by_filter.set()
                return

    # --- control ------------------------------------------------------------------------

    def stop(self, timeout=5.0):
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for s in sockets:
            try:
                s.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class _Connection:
    """A relayed connection: both sockets close when either side fails, or when both
    directions have ended."""

    def __init__(self, client, server):
        self.client, self.server = client, server
        self.closed = False
        self._ended = 0
        self._lock = threading.Lock()

    def half_closed(self):
        with self._lock:
            self._ended += 1
            done = self._ended >= 2
        if done:
            self.close()

    def close(self):
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass


# --- HTTP/2 ---------------------------------------------------------------------------------

DATA, HEADERS, RST_STREAM = 0x0, 0x1, 0x3
END_STREAM = 0x1
INTERNAL_ERROR = 0x2


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


class H2TrailersCut:
    """Server-to-client filter control: `Relay(port, downstream_filter=cut.filter)`. While
    `armed`, the second HEADERS frame of a stream (its trailers) is replaced, and the connection
    closed after it (the trailers' HPACK updates are lost, so it could not be used again).

    `mode`: "end" (an empty DATA frame with END_STREAM: the answer ends without trailers) or
    "reset" (RST_STREAM INTERNAL_ERROR after the headers and the message). `cut` counts the
    streams cut, over all connections."""

    def __init__(self, mode="end"):
        assert mode in ("end", "reset"), mode
        self.mode = mode
        self.armed = False
        self.cut = 0

    def filter(self):
        return _H2Filter(self)


class _H2Filter:
    """One connection's server-to-client frames."""

    def __init__(self, control):
        self.control = control
        self.buf = b""
        self.headers_seen = collections.Counter()
        self.done = False

    def feed(self, data):
        if self.done:
            return b"", True
        self.buf += data
        out = []
        while len(self.buf) >= 9:
            length = int.from_bytes(self.buf[0:3], "big")
            if len(self.buf) < 9 + length:
                break
            kind = self.buf[3]
            stream = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            raw, self.buf = self.buf[:9 + length], self.buf[9 + length:]
            if kind == HEADERS and stream:
                self.headers_seen[stream] += 1
                if self.control.armed and self.headers_seen[stream] >= 2:
                    self.control.cut += 1
                    if self.control.mode == "reset":
                        out.append(frame(RST_STREAM, 0, stream, struct.pack(">I", INTERNAL_ERROR)))
                    else:
                        out.append(frame(DATA, END_STREAM, stream))
                    self.done = True
                    return b"".join(out), True
            out.append(raw)
        return b"".join(out), False
