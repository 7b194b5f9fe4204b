"""Network partitions for the fleet tests: Linux network namespaces joined by veth pairs and
two Linux bridges, a 3-member etcd cluster (one member per namespace), Envoys and the
upstream reachable from the test process.

Layout of one `Net` (names carry a per-run prefix `idm<pid>x<n>`, addresses are ours only,
10.77.K.0/24 with a K no address of this host uses):

    root namespace (tests, upstream)  10.77.K.1   (front)   10.77.K.129 (etcd net)
    hub namespace: bridges `bf` (front, 10.77.K.0/25) and `be` (etcd net, 10.77.K.128/25)
    node namespaces, each with a veth on either bridge:
        Envoy a: front 10.77.K.11, etcd net 10.77.K.141    Envoy b: .12 / .142
        etcd e0, e1, e2: etcd net 10.77.K.131, .132, .133

The bridges live in the hub namespace, so the host's own firewall and bridge-netfilter rules
never see the traffic. `Net.cut(node)` sets the node's veth toward the etcd net down (by
default the end inside the node: its route goes, connects fail at once; `side="hub"` downs
the hub's end instead: the node keeps its route and its packets vanish, a black hole).

Requires root (ip netns). Every process is stopped through its own PID, every namespace is
deleted by `close()`, and every wait is bounded.
"""

import base64
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import harness
from harness import Envoy, Upstream, envoy_config, request, wait_until

ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
_COUNTER = itertools.count(1)
# Where the etcd members keep their data: tmpfs if there is one (fsync is cheap there; the
# 2-core test machine has three members, two Envoys and the clients at once).
DATA_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None


def ip(*args, check=True, timeout=10):
    """Runs `ip <args>`; returns its stdout."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.returncode} {proc.stderr.strip()}")
    return proc.stdout


def netns_available():
    """Whether this process may create namespaces, veths and bridges (root, iproute2)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    probe = f"idm{os.getpid()}p"
    try:
        ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.SubprocessError):
        return False
    try:
        ip("-n", probe, "link", "add", "br0", "type", "bridge")
        return True
    except RuntimeError:
        return False
    finally:
        ip("netns", "del", probe, check=False)


def _used_third_octets():
    out = ip("-4", "-o", "addr", "show", check=False)
    return {int(m.group(1)) for m in re.finditer(r"inet 10\.77\.(\d+)\.", out)}


class Net:
    """The namespaces of one test; see the module's doc. Use as a context manager."""

    def __init__(self):
        n = next(_COUNTER)
        self.prefix = f"idm{os.getpid()}x{n}"
        used = _used_third_octets()
        start = (os.getpid() * 7 + n) % 200
        self.k = next((20 + (start + i) % 200 for i in range(200)
                       if 20 + (start + i) % 200 not in used), None)
        if self.k is None:
            raise RuntimeError("no free 10.77.K.0/24 for the test network")
        self.hub = self.prefix + "h"
        self.namespaces = []
        self.root_links = []
        self.nodes = {}
        self.root_front = self.addr(1)
        self.root_etcd = self.addr(129)
        try:
            self._add_ns(self.hub)
            for bridge in ("bf", "be"):
                ip("-n", self.hub, "link", "add", bridge, "type", "bridge")
                # No STP, no forwarding delay: a port is forwarding as soon as it is up.
                ip("-n", self.hub, "link", "set", bridge, "type", "bridge", "stp_state", "0",
                   "forward_delay", "0")
                ip("-n", self.hub, "link", "set", bridge, "up")
            for suffix, bridge, address in (("f", "bf", self.root_front),
                                            ("e", "be", self.root_etcd)):
                name = self.prefix + suffix
                ip("link", "add", name, "type", "veth", "peer", "name", "r-" + suffix,
                   "netns", self.hub)
                self.root_links.append(name)
                ip("-n", self.hub, "link", "set", "r-" + suffix, "master", bridge, "up")
                ip("addr", "add", f"{address}/25", "dev", name)
                ip("link", "set", name, "up")
        except BaseException:
            self.close()
            raise

    def addr(self, host):
        return f"10.77.{self.k}.{host}"

    def _add_ns(self, name):
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def add_node(self, name, front=None, etcd=None):
        """A namespace `<prefix><name>` with a veth on the front net (address host `front`)
        and/or on the etcd net (host `etcd`); returns its Node."""
        ns = self.prefix + name
        self._add_ns(ns)
        node = Node(self, name, ns)
        for kind, bridge, host in (("f", "bf", front), ("e", "be", etcd)):
            if host is None:
                continue
            inner, outer = "eth-" + kind, f"{name}-{kind}"
            ip("link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer,
               "netns", self.hub)
            ip("-n", self.hub, "link", "set", outer, "master", bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.addr(host)}/25", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            setattr(node, "front" if kind == "f" else "etcd", self.addr(host))
        self.nodes[name] = node
        return node

    def _link(self, node, net, side):
        kind = "e" if net == "etcd" else "f"
        if side == "node":
            return ("-n", node.ns, "link", "set", "eth-" + kind)
        return ("-n", self.hub, "link", "set", f"{node.name}-{kind}")

    def cut(self, node, net="etcd", side="node"):
        """Takes `node`'s link to `net` ("etcd" or "front") down."""
        ip(*self._link(node, net, side), "down")

    def restore(self, node, net="etcd", side="node"):
        """Brings the link up again (and, when the node's end went down, its route back)."""
        ip(*self._link(node, net, side), "up")

    def close(self):
        """Deletes every namespace (their veths go with them) and the root's veths."""
        for name in reversed(self.namespaces):
            ip("netns", "del", name, check=False)
        self.namespaces = []
        for name in self.root_links:
            if os.path.exists(f"/sys/class/net/{name}"):
                ip("link", "del", name, check=False)
        self.root_links = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Node:
    def __init__(self, net, name, ns):
        self.net, self.name, self.ns = net, name, ns
        self.front = self.etcd = None

    def wrapper(self):
        """The command prefix that runs a program in this namespace (`ip netns exec` execs
        it, so the child's PID is the program's own)."""
        return ("ip", "netns", "exec", self.ns)


# --- HTTP to an address of ours -----------------------------------------------------------


def http_to(host, port, method, path, headers=None, body=b"", timeout=10):
    """harness.request, to `host` instead of 127.0.0.1."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        return request(port, method, path, headers, body, timeout=timeout, conn=conn)
    finally:
        conn.close()


def _accepts(host, port, timeout=0.2):
    import socket
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --- etcd ----------------------------------------------------------------------------------


class EtcdMember:
    def __init__(self, cluster, index, ip, client_port=ETCD_CLIENT_PORT,
                 peer_port=ETCD_PEER_PORT, wrapper=()):
        self.cluster, self.index, self.wrapper = cluster, index, tuple(wrapper)
        self.name = f"m{index}"
        self.ip, self.port = ip, client_port
        self.client_url = f"http://{ip}:{client_port}"
        self.peer_url = f"http://{ip}:{peer_port}"
        self.data_dir = os.path.join(cluster.tmp, self.name)
        self.log_path = os.path.join(cluster.tmp, f"{self.name}.log")
        self.proc = None
        self.stopped = False  # SIGSTOPped by us

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def start(self):
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.wrapper, etcd_binary(), "--name", self.name,
                 "--data-dir", self.data_dir,
                 "--listen-client-urls", self.client_url,
                 "--advertise-client-urls", self.client_url,
                 "--listen-peer-urls", self.peer_url,
                 "--initial-advertise-peer-urls", self.peer_url,
                 "--initial-cluster", self.cluster.initial_cluster,
                 "--initial-cluster-state", "new",
                 "--initial-cluster-token", self.cluster.token,
                 "--logger", "zap", "--log-outputs", "stderr"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self.stopped = False

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig):
        """Signals this member's own process (by its PID)."""
        if not self.alive():
            return
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False
        elif sig == signal.SIGKILL:
            self.proc.wait(10)

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if self.stopped:
                os.kill(self.proc.pid, signal.SIGCONT)
            harness.stop_process(self.proc, 10)
        self.stopped = False

    def call(self, path, body, timeout=2):
        req = urllib.request.Request(self.client_url + path, data=json.dumps(body).encode(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def status(self, timeout=1):
        """etcd's maintenance status (JSON gateway), or None if it does not answer."""
        try:
            return self.call("/v3/maintenance/status", {}, timeout=timeout)
        except Exception:  # noqa: BLE001 - down, stopped, cut off: no answer
            return None

    def log_text(self):
        return harness.read_text(self.log_path)


def etcd_binary():
    return os.environ.get("ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"


class EtcdCluster:
    """Three etcd members (3.4), each in its own namespace on the etcd net of `net`; with
    net=None, all three on 127.0.0.1 (free ports) in this namespace, for runs that need a
    real cluster but no partition (tests/chaos.py's storm)."""

    def __init__(self, net, size=3, start_timeout=30):
        self.net = net
        self.tmp = tempfile.mkdtemp(prefix="idem-etcd3-", dir=DATA_ROOT)
        self.token = net.prefix if net else f"idm{os.getpid()}l{next(_COUNTER)}"
        self.members = []
        for i in range(size):
            if net is None:
                member = EtcdMember(self, i, harness.LOCALHOST, harness.free_port(),
                                    harness.free_port())
            else:
                node = net.add_node(f"e{i}", etcd=131 + i)
                member = EtcdMember(self, i, node.etcd, wrapper=node.wrapper())
            self.members.append(member)
        self.initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        try:
            for m in self.members:
                m.start()
            wait_until(lambda: self.leader() is not None and self.writable(), start_timeout,
                       interval=0.1, message="etcd cluster with a leader")
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self):
        return [(m.ip, m.port) for m in self.members]

    def leader(self, members=None):
        """The member every answering member names leader (they agree), or None."""
        leaders = set()
        ids = {}
        for m in members or self.members:
            if not m.alive() or m.stopped:
                continue
            s = m.status()
            if s is None:
                continue
            ids[s["header"]["member_id"]] = m
            leaders.add(s.get("leader"))
        if len(leaders) != 1:
            return None
        return ids.get(leaders.pop())

    def writable(self, member=None):
        """A put through `member` (default: the first that answers) succeeds."""
        for m in [member] if member else self.members:
            if not m.alive() or m.stopped:
                continue
            try:
                m.call("/v3/kv/put", {"key": b64("/probe"), "value": b64("1")}, timeout=1)
                return True
            except Exception:  # noqa: BLE001
                continue
        return False

    def raft_events(self):
        """Every member's log lines about leaders, [(epoch seconds, member, kind, term)],
        kind "elected" (a member learned a new leader) or "lost" (it lost its leader), in
        time order: when the cluster had no leader."""
        from datetime import datetime
        pattern = re.compile(
            r'"ts":"([^"]+)".*raft\.node: \w+ (elected|lost) leader \w+ at term (\d+)')
        events = []
        for m in self.members:
            for line in m.log_text().splitlines():
                found = pattern.search(line)
                if found:
                    ts = datetime.fromisoformat(found.group(1).replace("Z", "+00:00"))
                    events.append((ts.timestamp(), m.name, found.group(2), int(found.group(3))))
        return sorted(events)

    def count_keys(self, prefix, member=None):
        start = b64(prefix)
        end = b64(prefix[:-1] + chr(ord(prefix[-1]) + 1))
        m = member or next(m for m in self.members if m.alive() and not m.stopped)
        out = m.call("/v3/kv/range", {"key": start, "range_end": end, "count_only": True})
        return int(out.get("count", 0))

    def close(self):
        for m in self.members:
            m.stop()
        if not os.environ.get("IDEM_KEEP_TMP"):
            shutil.rmtree(self.tmp, ignore_errors=True)


def b64(text):
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def etcd_cluster(endpoints, name="etcd", health_check=True, interval_ms=500, timeout_ms=1000,
                 unhealthy_interval_ms=None, unhealthy_threshold=1, healthy_threshold=1,
                 panic_threshold=None,
                 outlier_detection=False, connect_timeout_ms=500, cluster_type=None):
    """The Envoy cluster for a multi-member etcd, [(address, port)]: HTTP/2 (the plugin speaks
    etcd's gRPC API), with an active gRPC health check (etcd serves `grpc.health.v1.Health`
    on its client port, service ""), so a member that is dead, stopped or cut off stops
    getting a share of the plugin's requests within about one interval.

    `timeout_ms` 1000, not less: Envoy starts with every member unhealthy until its first
    check passes, and its cluster is ready after the first round; when that round times out
    (measured: 0.5 s timeouts, Envoy starting on a busy 2-core machine, 3 starts of 6), every
    member stays unhealthy for another round or two, Envoy ignores health (panic), a dead
    member gets a third of the requests and each plugin VM that hits it backs off: ~370
    requests answered 503 in the first 2 s. With 1 s: 0 of 6.
    `unhealthy_interval_ms`: how often a member found unhealthy is checked (default: the
    interval).
    `panic_threshold`: the percentage of healthy members under which Envoy ignores health
    (Envoy's default is 50: with two of three members unhealthy it sends to all three);
    `outlier_detection`: also eject a member after consecutive connect failures (local-origin
    errors only: a gRPC error that etcd itself answered, e.g. during an election, does not
    eject it); `cluster_type`: STATIC when every address is an IP address (the default then),
    else STRICT_DNS (e.g. a StatefulSet's etcd-0.etcd)."""
    if cluster_type is None:
        import ipaddress
        try:
            for host, _ in endpoints:
                ipaddress.ip_address(host)
            cluster_type = "STATIC"
        except ValueError:
            cluster_type = "STRICT_DNS"
    cluster = {
        "name": name,
        "type": cluster_type,
        "connect_timeout": f"{connect_timeout_ms / 1000}s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
            for host, port in endpoints]}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                         "HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
    }
    if health_check:
        cluster["health_checks"] = [{
            "timeout": f"{timeout_ms / 1000}s",
            "interval": f"{interval_ms / 1000}s",
            "no_traffic_interval": f"{interval_ms / 1000}s",
            "unhealthy_threshold": unhealthy_threshold,
            "healthy_threshold": healthy_threshold,
            "grpc_health_check": {},
        }]
        if unhealthy_interval_ms is not None:
            cluster["health_checks"][0]["unhealthy_interval"] = f"{unhealthy_interval_ms / 1000}s"
    if panic_threshold is not None:
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": panic_threshold}}
    if outlier_detection:
        cluster["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 2,
            "enforcing_consecutive_local_origin_failure": 100,
            "consecutive_5xx": 1000000,  # etcd's own errors (gRPC statuses) never eject
            "enforcing_consecutive_5xx": 0,
            "enforcing_success_rate": 0,
            "interval": "0.5s",
            "base_ejection_time": "1s",
            "max_ejection_percent": 34,
        }
    return cluster


# --- Envoy and upstream in namespaces --------------------------------------------------------


class NsEnvoy(Envoy):
    """An Envoy inside `node`'s namespace: its listener and admin on the node's front
    address, its upstream the test's upstream on the root's front address, its `etcd` cluster
    `etcd` (a dict, e.g. etcd_cluster(...))."""

    def __init__(self, node, plugin_config, upstream, etcd, *, port=10000, admin_port=19000,
                 route_timeout_s=30, **kwargs):
        self.host = node.front
        self.node = node
        config = envoy_config(port, admin_port, upstream.port, plugin_config,
                              extra_clusters=[etcd], route_timeout_s=route_timeout_s)
        config["admin"]["address"]["socket_address"]["address"] = self.host
        for listener in config["static_resources"]["listeners"]:
            listener["address"]["socket_address"]["address"] = self.host
        for cluster in config["static_resources"]["clusters"]:
            if cluster["name"] == "upstream":
                for ep in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]:
                    ep["endpoint"]["address"]["socket_address"]["address"] = upstream.host
        super().__init__(plugin_config, upstream.port, bootstrap=config,
                         wrapper=node.wrapper(), **kwargs)

    def _wait_ready(self):
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise harness.EnvoyStartError(f"envoy exited with {self.proc.returncode}",
                                              self._startup_output())
            if self._admin_says_live() and all(_accepts(self.host, p) for p in self.ports):
                return
            time.sleep(0.05)
        raise harness.EnvoyStartError(f"envoy not ready after {self.start_timeout}s",
                                      self._startup_output())

    def admin(self, path, method="GET", timeout=5):
        return http_to(self.host, self.admin_port, method, path, timeout=timeout).text

    def stats(self, filter_regex=None):
        time.sleep(harness.METRICS_LAG_S)  # the plugin writes its counters from its tick
        query = "/stats?format=json"
        if filter_regex:
            query += "&filter=" + urllib.request.quote(filter_regex)
        data = json.loads(self.admin(query))
        return {s["name"]: s["value"] for s in data.get("stats", [])
                if "name" in s and isinstance(s.get("value"), int)}

    def counters(self):
        """The plugin's stats without the `wasmcustom.idempotency.` prefix."""
        prefix = "wasmcustom.idempotency."
        return {n[len(prefix):]: v for n, v in self.stats(re.escape(prefix)).items()
                if n.startswith(prefix)}

    def etcd_hosts(self):
        """{address: health flags} of the etcd cluster as Envoy sees it ("healthy" when none)."""
        out = {}
        for line in self.admin("/clusters").splitlines():
            m = re.match(r"etcd::([\d.]+):\d+::health_flags::(.*)$", line)
            if m:
                out[m.group(1)] = m.group(2)
        return out


class NsUpstream(Upstream):
    """tests/upstream.py in the root namespace on the root's front address."""

    def __init__(self, net):
        self.host = net.root_front
        super().__init__(command=[os.path.join(harness.TESTS_DIR, "upstream.py"), "--port", "0",
                                  "--host", self.host])

    def _admin(self, method, path):
        resp = http_to(self.host, self.port, method, path, timeout=5)
        if resp.status != 200:
            raise harness.HarnessError(f"upstream {path}: {resp.status} {resp.text}")
        return resp.json()
