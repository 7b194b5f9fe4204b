"""A real etcd (3.4, from Debian's etcd-server) on free loopback ports, for the fleet tests."""

import json
import os
import shutil
import ssl
import subprocess
import tempfile
import urllib.request

from harness import free_port, static_cluster, stop_process, wait_until


def cluster(port, name="etcd", api="grpc", tls=None, client_cert=True):
    """The Envoy cluster for an etcd client port: HTTP/2 for the plugin's default gRPC API,
    HTTP/1.1 for the JSON gateway (`store.api: "json"`). `tls`: certificates of
    pki_util.make_pki: Envoy checks etcd's certificate against the CA and the address, and
    presents client_a's (unless not `client_cert`)."""
    c = static_cluster(name, port, http2=(api == "grpc"))
    if tls:
        c["transport_socket"] = tls_socket(tls["ca.crt"], tls["client_a.crt"] if client_cert else None,
                                           tls["client_a.key"], h2=(api == "grpc"))
    return c


def tls_socket(ca, cert, key, h2=True, san="127.0.0.1"):
    """Envoy's upstream TLS: etcd's certificate must chain to `ca` and name `san` (an IP)."""
    common = {
        "validation_context": {
            "trusted_ca": {"filename": ca},
            "match_typed_subject_alt_names": [{"san_type": "IP_ADDRESS", "matcher": {"exact": san}}],
        },
        # etcd serves gRPC and the JSON gateway on one TLS port, told apart by ALPN.
        "alpn_protocols": ["h2"] if h2 else ["http/1.1"],
    }
    if cert:
        common["tls_certificates"] = [{"certificate_chain": {"filename": cert},
                                       "private_key": {"filename": key}}]
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common}}


# etcd fsyncs every write. On disk, right after `make test`'s build left a gigabyte of dirty
# pages, one member waited over a second: three calls of the first chaos test timed out (1 s)
# and four clients got a (correct) 503. These tests are about the plugin, not the disk: the
# data lives in memory when the machine has a tmpfs.
MEMORY_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def etcd_binary():
    return os.environ.get("ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"


class Etcd:
    """One etcd member on 127.0.0.1; stop() and start() keep its data and ports."""

    def __init__(self, extra_args=(), tls=None):
        """`tls`: certificates of pki_util.make_pki: etcd serves its client port with
        server.crt and accepts only clients with a certificate of the CA."""
        self.tmp = tempfile.mkdtemp(prefix="idem-etcd-", dir=MEMORY_DIR)
        self.port, self.peer_port = free_port(), free_port()
        self.extra_args = list(extra_args)
        self.tls = tls
        self.scheme = "https" if tls else "http"
        if tls:
            self.extra_args += ["--cert-file", tls["server.crt"], "--key-file", tls["server.key"],
                                "--client-cert-auth", "--trusted-ca-file", tls["ca.crt"]]
        self.proc = None
        self.start()

    def start(self):
        url = f"{self.scheme}://127.0.0.1:{self.port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.log = open(os.path.join(self.tmp, "etcd.log"), "ab")
        self.proc = subprocess.Popen(
            [etcd_binary(), "--name", "t", "--data-dir", os.path.join(self.tmp, "data"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", "--logger", "zap", "--log-outputs", "stderr",
             *self.extra_args],
            stdout=self.log, stderr=self.log)
        wait_until(self.healthy, timeout=20, message="etcd healthy")
        return self

    def healthy(self):
        try:
            with urllib.request.urlopen(f"{self.scheme}://127.0.0.1:{self.port}/health", timeout=1,
                                        context=self.client_context()) as r:
                return json.loads(r.read()).get("health") == "true"
        except Exception:
            return False

    def call(self, path, body):
        req = urllib.request.Request(f"{self.scheme}://127.0.0.1:{self.port}{path}",
                                     data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=5, context=self.client_context()) as r:
            return json.loads(r.read())

    def client_context(self):
        """The test's own TLS client (client_b's certificate), or None without TLS."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=self.tls["ca.crt"])
        context.load_cert_chain(self.tls["client_b.crt"], self.tls["client_b.key"])
        return context

    def count_keys(self, prefix):
        import base64
        start = base64.b64encode(prefix.encode()).decode()
        end = base64.b64encode(prefix[:-1].encode() + bytes([ord(prefix[-1]) + 1])).decode()
        out = self.call("/v3/kv/range", {"key": start, "range_end": end, "count_only": True})
        return int(out.get("count", 0))

    def stop(self):
        stop_process(self.proc, 10)
        self.proc = None
        if getattr(self, "log", None):
            self.log.close()
            self.log = None

    def close(self):
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
