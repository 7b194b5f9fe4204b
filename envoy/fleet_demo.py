#!/usr/bin/env python3
"""`make fleet`: two Envoy replicas sharing one etcd, in front of the sample upstream.

Makes a test CA and certificates in .fleet-pki/ (openssl), starts two etcd servers, the two
shards of envoy/envoy-fleet.yaml (127.0.0.1:2379 and :2479, TLS with client certificates, data
in a temporary directory), the sample upstream (127.0.0.1:8080), replica A from
envoy/envoy-fleet.yaml (listener 10001, admin 9902) and replica B from the same file with its
ports moved (10002, 9903), then waits. Ctrl-C or SIGTERM stops them all, each by its own PID.
Needs etcd and openssl (`apt-get install etcd-server openssl`).
"""

import os
import shutil
import signal
import ssl
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402  (process handling shared with `make run`)

sys.path.insert(0, os.path.join(demo.REPO_ROOT, "tests"))
import pki_util  # noqa: E402  (the tests' certificates: a CA, etcd's, clients')

REPLICAS = [("A", 10001, 9902), ("B", 10002, 9903)]
# The two shards: (name, client port, peer port), as in envoy-fleet.yaml.
ETCDS = [("etcd_a", 2379, 2380), ("etcd_b", 2479, 2480)]
PKI_DIR = os.path.join(demo.REPO_ROOT, ".fleet-pki")
BASE_ID = 80_020_000

BANNER = """
Fleet demo: replicas A on http://127.0.0.1:10001 and B on http://127.0.0.1:10002 share the
idempotency store in two etcd shards (127.0.0.1:2379 and :2479, over TLS). Send the first
call to A and the retry to B:

  H='Host: api.example'   # one API, one name: the store key includes the host
  A='Authorization: Bearer alice'   # and the caller
  curl -s -X POST http://127.0.0.1:10001/payments -H "$H" -H "$A" -H 'Idempotency-Key: fleet-1' \\
       -H 'x-delay-ms: 3000' -d '{"amount": 7}' &
  sleep 0.5; curl -si -X POST http://127.0.0.1:10002/payments -H "$H" -H "$A" \\
       -H 'Idempotency-Key: fleet-1' -H 'x-delay-ms: 3000' -d '{"amount": 7}'   # 409 on B
  sleep 3;   curl -si -X POST http://127.0.0.1:10002/payments -H "$H" -H "$A" \\
       -H 'Idempotency-Key: fleet-1' -H 'x-delay-ms: 3000' -d '{"amount": 7}'   # B replays A's answer

Ctrl-C stops everything.
"""


def wait_ready(url, what, context=None):
    deadline = time.monotonic() + demo.START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1, context=context) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {demo.START_TIMEOUT_S:.0f}s")


def make_pki():
    """The certificates envoy-fleet.yaml names, made once (a test CA: not for production)."""
    os.makedirs(PKI_DIR, exist_ok=True)
    if not os.path.exists(os.path.join(PKI_DIR, "client_a.key")):
        pki_util.make_pki(PKI_DIR)
    return {name: os.path.join(PKI_DIR, name) for name in
            ("ca.crt", "server.crt", "server.key", "client_b.crt", "client_b.key")}


def start_etcd(name, port, peer_port, data_dir, pki):
    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    url, peer = f"https://127.0.0.1:{port}", f"http://127.0.0.1:{peer_port}"
    log = open(os.path.join(os.path.dirname(data_dir), f"{name}.log"), "ab")
    proc = demo.spawn(name, [etcd, "--name", name, "--data-dir", data_dir,
                             "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                             "--initial-cluster", f"{name}={peer}",
                             "--cert-file", pki["server.crt"], "--key-file", pki["server.key"],
                             "--client-cert-auth", "--trusted-ca-file", pki["ca.crt"]],
                      stdout=log, stderr=log)
    context = ssl.create_default_context(cafile=pki["ca.crt"])
    context.load_cert_chain(pki["client_b.crt"], pki["client_b.key"])
    wait_ready(f"{url}/health", name, context)
    return proc


def start_replica(name, port, admin, config_dir):
    text = open(os.path.join(demo.REPO_ROOT, "envoy", "envoy-fleet.yaml")).read()
    text = text.replace("port_value: 10001", f"port_value: {port}")
    text = text.replace("port_value: 9902", f"port_value: {admin}")
    path = os.path.join(config_dir, f"envoy-{name}.yaml")
    with open(path, "w") as f:
        f.write(text)
    cmd = [demo.envoy_binary(), "-c", path, "--concurrency", "2", "--base-id",
           str(BASE_ID + port), "--log-level", os.environ.get("IDEM_DEMO_LOG", "warning")]
    proc = demo.spawn(f"envoy {name}", cmd)
    wait_ready(f"http://127.0.0.1:{admin}/ready", f"envoy {name}")
    return proc


def main():
    os.chdir(demo.REPO_ROOT)
    signal.signal(signal.SIGINT, demo.on_signal)
    signal.signal(signal.SIGTERM, demo.on_signal)
    tmp = tempfile.mkdtemp(prefix="idem-fleet-")
    status = 0
    try:
        pki = make_pki()
        procs = [start_etcd(n, p, pp, os.path.join(tmp, n), pki) for n, p, pp in ETCDS]
        procs.append(demo.start_upstream())
        procs += [start_replica(n, p, a, tmp) for n, p, a in REPLICAS]
        print(BANNER, flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("fleet: a child exited; stopping", file=sys.stderr)
        status = 1
    except demo.Stop:
        pass
    except RuntimeError as err:
        print(f"fleet: {err}", file=sys.stderr)
        status = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for name, proc in reversed(demo.CHILDREN):
            demo.stop(proc, name)
        shutil.rmtree(tmp, ignore_errors=True)
    if status == 0:
        print("fleet: stopped", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
