#!/usr/bin/env python3
"""`make fleet`: two Envoy replicas sharing one etcd, in front of the sample upstream.

Starts etcd (127.0.0.1:2379, data in a temporary directory), the sample upstream
(127.0.0.1:8080), replica A from envoy/envoy-fleet.yaml (listener 10001, admin 9902) and
replica B from the same file with its ports moved (10002, 9903), then waits. Ctrl-C or SIGTERM
stops them all, each by its own PID. Needs etcd (`apt-get install etcd-server`).
"""

import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402  (process handling shared with `make run`)

REPLICAS = [("A", 10001, 9902), ("B", 10002, 9903)]
ETCD_PORT, ETCD_PEER_PORT = 2379, 2380
BASE_ID = 80_020_000

BANNER = """
Fleet demo: replicas A on http://127.0.0.1:10001 and B on http://127.0.0.1:10002 share the
idempotency store in etcd (127.0.0.1:2379). Send the first call to A and the retry to B:

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


def wait_ready(url, what):
    deadline = time.monotonic() + demo.START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {demo.START_TIMEOUT_S:.0f}s")


def start_etcd(data_dir):
    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    url, peer = f"http://127.0.0.1:{ETCD_PORT}", f"http://127.0.0.1:{ETCD_PEER_PORT}"
    log = open(os.path.join(os.path.dirname(data_dir), "etcd.log"), "ab")
    proc = demo.spawn("etcd", [etcd, "--name", "demo", "--data-dir", data_dir,
                               "--listen-client-urls", url, "--advertise-client-urls", url,
                               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                               "--initial-cluster", f"demo={peer}"], stdout=log, stderr=log)
    wait_ready(f"{url}/health", "etcd")
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
        procs = [start_etcd(os.path.join(tmp, "etcd")), demo.start_upstream()]
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
