"""The harness itself, without the plugin: Envoy in front of the effect-counting upstream."""

import functools
import hashlib
import os

import pytest

import e2e_util
from harness import (Envoy, EnvoyStartError, abandon, envoy_yaml, request, run_concurrently,
                     static_cluster, validate_config, wait_until)


@pytest.fixture
def proxy(upstream):
    with Envoy(None, upstream.port) as envoy:
        yield envoy


# The tests' client, with this file's path and body.
post = functools.partial(e2e_util.post, path="/payments?x=1", body=b"{}")


def test_proxies_post_and_counts_effects_per_key(upstream, proxy):
    first = post(proxy.port, "a", body=b'{"amount":1}')
    post(proxy.port, "a")
    post(proxy.port, "b")
    post(proxy.port, None)
    request(proxy.port, "GET", "/payments", {"Idempotency-Key": "a"})  # GETs are no effect

    assert first.status == 201
    assert first.header("x-effect") == "1"
    assert first.header("content-type") == "application/json"
    assert first.json() == {"key": "a", "effect": 1, "method": "POST", "path": "/payments?x=1",
                            "body_sha256": hashlib.sha256(b'{"amount":1}').hexdigest()}
    assert upstream.effects() == {"a": 2, "b": 1, "": 1}
    assert upstream.effects("a") == 2 and upstream.effects("zzz") == 0
    assert [e["effect"] for e in upstream.log() if e["key"] == "a"] == [1, 2]
    upstream.reset()
    assert upstream.effects() == {}


def test_delay_status_cookies_and_body_size(proxy):
    slow = post(proxy.port, "d", **{"x-delay-ms": "300"})
    failed = post(proxy.port, "e", **{"x-status": "500"})
    cookies = post(proxy.port, "c", **{"x-set-cookie": "a=1,b=2"})
    sized = post(proxy.port, "s", **{"x-body-bytes": "100000"})
    chunked = request(proxy.port, "POST", "/p", {"Idempotency-Key": "k"}, [b"ab", b"cd"])

    assert slow.status == 201 and slow.elapsed_s >= 0.3
    assert failed.status == 500
    assert cookies.header_all("set-cookie") == ["a=1", "b=2"]
    assert len(sized.body) == 100000 and b"[s#1]" in sized.body
    assert chunked.json()["body_sha256"] == hashlib.sha256(b"abcd").hexdigest()


def test_upstream_reset_becomes_503_from_envoy(upstream, proxy):
    resp = post(proxy.port, "r", **{"x-reset": "1"})

    assert resp.status == 503
    assert b"reset" in resp.body or b"termination" in resp.body
    assert upstream.effects("r") == 1
    assert upstream.log()[0]["outcome"] == "reset"


def test_abandoned_request_makes_the_upstream_record_a_reset(upstream, proxy):
    # The client leaves at 0.2 s; Envoy's router then closes the upstream connection, so the
    # upstream's answer at 0.6 s finds no one to write to.
    abandon(proxy.port, "POST", "/payments", {"Idempotency-Key": "gone", "x-delay-ms": "600"},
            b"{}", after_s=0.2)

    assert wait_until(lambda: upstream.resets("gone") == 1, timeout=3)
    assert upstream.effects("gone") == 1


def test_concurrent_calls_start_together(upstream, proxy):
    results = run_concurrently(
        lambda i: post(proxy.port, f"c{i}", **{"x-delay-ms": "200"}), 8)

    assert [r.json()["key"] for r in results] == [f"c{i}" for i in range(8)]
    starts = [e["t"] for e in upstream.log()]
    assert max(starts) - min(starts) < 0.15  # together, not one after the other


def test_two_envoys_side_by_side(upstream):
    with Envoy(None, upstream.port) as one, Envoy(None, upstream.port) as two:
        assert one.base_id != two.base_id
        assert post(one.port, "x").status == 201
        assert post(two.port, "x").status == 201
        assert one.stat("http.ingress.downstream_rq_2xx") == 1
        assert one.rss_bytes() > 1_000_000
    assert upstream.effects("x") == 2


def test_stop_leaves_no_process(upstream):
    envoy = Envoy(None, upstream.port)
    pid = envoy.pid
    try:
        envoy.wait_log("starting main dispatch loop")  # the log file is flushed every 100 ms
    finally:
        envoy.stop()

    assert not os.path.exists(f"/proc/{pid}")  # exited and reaped, not a zombie
    assert "starting main dispatch loop" in envoy.log_text()  # kept after the tmp dir went


def test_upstream_process_stops(upstream):
    proc = upstream.proc
    upstream.stop()
    assert proc.poll() is not None


def test_generated_yaml_has_the_field_names_envoy_expects(tmp_path):
    # With a module that is no proxy-wasm plugin, Envoy must get as far as loading it:
    # any misspelt field would have been rejected earlier, while parsing.
    fake = tmp_path / "fake.wasm"
    fake.write_bytes(b"\0asm\1\0\0\0")
    yaml = envoy_yaml(10000, 10001, 10002, {"lease_ms": 1000}, wasm=str(fake),
                      extra_clusters=[static_cluster("etcd", 2379)])

    ok, output = validate_config(yaml)

    assert "allow_on_headers_stop_iteration: true" in yaml
    assert not ok and "unknown fields" not in output
    assert "Unable to create Wasm plugin idempotency" in output


def test_failed_start_raises_with_the_log(upstream, tmp_path):
    fake = tmp_path / "fake.wasm"
    fake.write_bytes(b"\0asm\1\0\0\0")

    with pytest.raises(EnvoyStartError) as failure:
        Envoy({"lease_ms": 1000}, upstream.port, wasm=str(fake))

    assert "Unable to create Wasm plugin idempotency" in failure.value.log
    assert "Unable to create Wasm plugin" in str(failure.value)  # the tail is in the message


def test_kill_and_restart_on_the_same_ports(upstream):
    with Envoy(None, upstream.port) as envoy:
        port, first_pid = envoy.port, envoy.pid
        envoy.kill()  # SIGKILL: a crash, no drain
        assert not envoy.alive()
        envoy.restart()
        assert envoy.pid != first_pid and envoy.port == port
        assert post(envoy.port, "again").status == 201
