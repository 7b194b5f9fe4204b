#!/usr/bin/env python3
"""`make run`: the sample upstream and an Envoy with the idempotency plugin, in the foreground.

Starts tests/upstream.py on 127.0.0.1:8080, then Envoy with envoy/envoy.yaml (listener
127.0.0.1:10000, admin 127.0.0.1:9901), prints a few curl commands to try, and waits.
Ctrl-C (SIGINT) or SIGTERM stops both children, each by its own PID, and exits 0.
If either child dies on its own, the other is stopped and the exit status is 1.

Environment: ENVOY_BIN (default .venv/bin/envoy), IDEM_DEMO_LOG (Envoy's log level, default
"warning"), IDEM_DEMO_WASM_LOG (the plugin's log level, default "debug": one line per decision).
"""

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"
UPSTREAM_PORT = 8080
LISTENER_PORT = 10000
ADMIN_PORT = 9901
# Envoy's --base-id names its shared-memory region (hot restart). The tests pick ids below
# 65,536,000 and disable hot restart; this one is far from them and from Envoy's default 0,
# so the demo can run beside another Envoy on the machine.
BASE_ID = 80_010_000
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

BANNER = f"""
Idempotency demo: Envoy on http://{HOST}:{LISTENER_PORT}, sample upstream on {HOST}:{UPSTREAM_PORT}
(admin http://{HOST}:{ADMIN_PORT}; plugin config in envoy/envoy.yaml). Try, in another shell:

  # Keys are scoped to the caller (its Authorization header).
  A='Authorization: Bearer alice'

  # 1. First call: the upstream does the work once (201, x-effect: 1).
  curl -si -X POST http://{HOST}:{LISTENER_PORT}/payments -H "$A" \\
       -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{{"amount": 10}}'

  # 2. Same key again: the stored response is replayed (idempotent-replayed: true, x-effect: 1).
  curl -si -X POST http://{HOST}:{LISTENER_PORT}/payments -H "$A" \\
       -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{{"amount": 10}}'

  # 3. A duplicate while the first is still in progress gets 409 (retryable, Retry-After).
  #    The upstream honours x-delay-ms (slow answer) and x-status (its status code).
  curl -s -X POST http://{HOST}:{LISTENER_PORT}/payments -H "$A" -H 'Idempotency-Key: order-2' \\
       -H 'x-delay-ms: 3000' -d '{{"amount": 5}}' &
  sleep 0.5; curl -si -X POST http://{HOST}:{LISTENER_PORT}/payments -H "$A" \\
       -H 'Idempotency-Key: order-2' -H 'x-delay-ms: 3000' -d '{{"amount": 5}}'

  # 4. An upstream failure releases the key: a retry does the work.
  curl -si -X POST http://{HOST}:{LISTENER_PORT}/payments -H "$A" -H 'Idempotency-Key: order-3' \\
       -H 'x-status: 500' -d '{{}}'
  curl -si -X POST http://{HOST}:{LISTENER_PORT}/payments -H "$A" -H 'Idempotency-Key: order-3' -d '{{}}'

  # The plugin's counters:
  curl -s 'http://{HOST}:{ADMIN_PORT}/stats?filter=idem'

Ctrl-C stops Envoy and the upstream.
"""

PR_SET_PDEATHSIG = 1


def die_with_parent():
    """In the child, before exec: get SIGTERM if the demo itself dies (even by SIGKILL)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: Ctrl-C and SIGTERM still stop the children


# (name, Popen) of every child started, so a signal that comes mid-start still stops it.
CHILDREN = []


def spawn(name, cmd, **kwargs):
    # A session of its own: the terminal's Ctrl-C reaches only the demo, which then stops
    # each child in order, instead of all of them racing.
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=die_with_parent, **kwargs)
    CHILDREN.append((name, proc))
    return proc


def start_upstream():
    proc = spawn("upstream", [sys.executable, os.path.join(REPO_ROOT, "tests", "upstream.py"),
                  "--host", HOST, "--port", str(UPSTREAM_PORT), "--verbose"],
                 stdout=subprocess.PIPE)
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
    if not line.startswith("READY"):
        stop(proc, "upstream")
        raise RuntimeError(f"the upstream did not start on {HOST}:{UPSTREAM_PORT} "
                           f"(is the port taken?); it said: {line!r}")
    return proc


def envoy_binary():
    return os.environ.get("ENVOY_BIN") or os.path.join(REPO_ROOT, ".venv", "bin", "envoy")


def start_envoy():
    cmd = [envoy_binary(), "-c", "envoy/envoy.yaml", "--concurrency", "2",
           "--base-id", str(BASE_ID),
           "--log-level", os.environ.get("IDEM_DEMO_LOG", "warning"),
           "--component-log-level", "wasm:" + os.environ.get("IDEM_DEMO_WASM_LOG", "debug")]
    proc = spawn("envoy", cmd)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {proc.returncode} (see its log above)")
        if admin_ready():
            return proc
        time.sleep(0.1)
    stop(proc, "envoy")
    raise RuntimeError(f"envoy not ready after {START_TIMEOUT_S:.0f}s")


def admin_ready(port=ADMIN_PORT):
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/ready", timeout=1) as resp:
            return resp.read().strip() == b"LIVE"
    except OSError:
        return False


def stop(proc, name):
    """SIGTERM to this child's own PID, then SIGKILL if it lingers; always reaped."""
    if proc is None:
        return
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"demo: {name} ignored SIGTERM; killing it", file=sys.stderr)
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
    if proc.stdout:
        proc.stdout.close()


class Stop(Exception):
    pass


def on_signal(signum, _frame):
    raise Stop(signal.Signals(signum).name)


def main():
    os.chdir(REPO_ROOT)  # envoy/envoy.yaml names dist/idempotency.wasm relative to the root
    if not os.path.isfile(os.path.join(REPO_ROOT, "dist", "idempotency.wasm")):
        print("demo: dist/idempotency.wasm is missing: run `make build`", file=sys.stderr)
        return 1
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    try:
        upstream = start_upstream()
        envoy = start_envoy()
        print(BANNER, flush=True)
        while True:
            for proc, name in ((envoy, "envoy"), (upstream, "upstream")):
                if proc.poll() is not None:
                    print(f"demo: {name} exited with {proc.returncode}; stopping",
                          file=sys.stderr)
                    status = 1
                    raise Stop(name)
            time.sleep(0.5)
    except Stop:
        pass
    except RuntimeError as err:
        print(f"demo: {err}", file=sys.stderr)
        status = 1
    finally:
        # A second Ctrl-C must not interrupt the cleanup.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for name, proc in reversed(CHILDREN):  # Envoy first, then the upstream
            stop(proc, name)
    if status == 0:
        print("demo: stopped", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
