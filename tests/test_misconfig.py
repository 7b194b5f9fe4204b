"""Envoy set up without allow_on_headers_stop_iteration: bodies never reach the plugin.

The plugin must not hang covered requests nor silently skip the body (issue: fingerprints):
it answers 500 problem+json naming the setting, and logs it.
"""

import uuid

from harness import CALLER, request


def test_missing_stop_iteration_setting_is_detected(wasm, upstream, make_envoy):
    envoy = make_envoy({}, upstream.port, allow_on_headers_stop_iteration=False)
    key = uuid.uuid4().hex
    r = request(envoy.port, "POST", "/pay", {"Idempotency-Key": key, CALLER[0]: CALLER[1]}, b'{"amount":1}', timeout=15)
    assert r.status == 500
    assert r.header("content-type") == "application/problem+json"
    body = r.json()
    assert "allow_on_headers_stop_iteration" in body["detail"]
    assert body["retryable"] is False
    assert 2.5 <= r.elapsed_s <= 8, r.elapsed_s
    assert upstream.effects(key) == 0
    envoy.wait_log(r"allow_on_headers_stop_iteration", timeout=5)
    # Requests without a body are unaffected.
    r = request(envoy.port, "POST", "/pay", {"Idempotency-Key": uuid.uuid4().hex, CALLER[0]: CALLER[1]})
    assert r.status == 201
