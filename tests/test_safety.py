"""Safety end to end: fingerprints (docs/behaviour.md §3.6 422), scoping of keys to callers (§3.1: header,
verified JWT claim, mTLS peer), the request body limit (413), per-route rules, RFC 8941 keys,
and the IETF draft's three error examples.

Each test runs a fresh Envoy (exact counters) against a fresh effect-counting upstream.
"""

import contextlib
import hashlib
import http.client
import json
import os
import random
import re
import ssl
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

import harness
from e2e_util import (assert_replay_of, describe, is_replay, new_key, plugin_counters, post,
                      problem)
from harness import request, run_concurrently, wait_until, wasm_filter
from jwt_util import jwt_authn_filter, make_jwt
from pki_util import make_pki

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
BODY = b'{"amount":1}'
FORWARDS = ["router", "detached"]
KEY_REUSED_TITLE = "The Idempotency-Key was used for a different request"


@pytest.fixture
def start(make_envoy, upstream, wasm):
    """start(config=None, forward="detached", **envoy_kwargs) -> a fresh Envoy."""

    def start_envoy(config=None, forward="detached", **kwargs):
        return make_envoy({"forward": forward, **(config or {})}, upstream.port, **kwargs)

    return start_envoy


def upstream_json(key, effect, path="/payments", body=BODY, method="POST"):
    """The body tests/upstream.py answers for a write without x-body-bytes."""
    return {"key": key, "effect": effect, "method": method, "path": path,
            "body_sha256": hashlib.sha256(body).hexdigest()}


def assert_original(resp, key, effect, status=201, path="/payments", body=BODY):
    assert resp.status == status, describe(resp)
    assert not is_replay(resp), describe(resp)
    assert resp.header_all("x-effect") == [str(effect)], describe(resp)
    assert resp.json() == upstream_json(key, effect, path, body), describe(resp)


def assert_key_reused(resp):
    body = problem(resp, 422, "key-reused", False, KEY_REUSED_TITLE)
    assert "retry_after" not in body
    return body


# --- 1. same key, different body -------------------------------------------------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_same_key_other_body_gets_422_in_progress_and_after(upstream, start, forward):
    envoy = start(forward=forward)
    key = new_key("fp")
    other = b'{"amount":2}'

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, envoy.port, key, extra={"x-delay-ms": "1000"}, timeout=30)
        wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the first upstream")
        during = post(envoy.port, key, body=other, extra={"x-delay-ms": "1000"})
        first = pending.result(30)
    after = post(envoy.port, key, body=other)
    again = post(envoy.port, key, extra={"x-delay-ms": "1000"})

    assert during.elapsed_s < 0.5, f"the 422 took {during.elapsed_s:.3f}s"
    assert_key_reused(during)
    assert_original(first, key, 1)
    assert_key_reused(after)
    assert_replay_of(again, first)  # the key still answers its own request
    assert upstream.effects() == {key: 1}
    counters = plugin_counters(envoy)
    assert counters["fingerprint_mismatch"] == 2, counters
    assert counters["claimed"] == 1 and counters["replayed"] == 1, counters


@pytest.mark.parametrize("forward", FORWARDS)
def test_every_part_of_the_fingerprint_gets_422(upstream, start, forward):
    envoy = start(forward=forward)
    key = new_key("fp")

    first = post(envoy.port, key)
    other_body = post(envoy.port, key, body=b'{"amount":2}')
    other_path = post(envoy.port, key, path="/refunds")
    other_query = post(envoy.port, key, path="/payments?x=1")
    other_method = post(envoy.port, key, method="PATCH")
    other_type = post(envoy.port, key, content_type="text/plain")
    again = post(envoy.port, key)

    assert_original(first, key, 1)
    for resp in (other_body, other_path, other_query, other_method, other_type):
        assert_key_reused(resp)
    assert_replay_of(again, first)
    assert upstream.effects() == {key: 1}
    assert plugin_counters(envoy)["fingerprint_mismatch"] == 5


# --- 2. header order and non-fingerprinted headers ---------------------------------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_header_order_and_other_headers_do_not_change_the_fingerprint(upstream, start,
                                                                      forward):
    envoy = start(forward=forward)
    key = new_key("order")
    first_headers = [("Content-Type", "application/json"), ("Idempotency-Key", key),
                     ("X-Trace", "trace-a"), ("Accept", "*/*"), harness.CALLER]
    retry_headers = [harness.CALLER, ("Accept", "application/json"), ("X-Trace", "trace-b"),
                     ("X-Extra", "1"), ("Idempotency-Key", key),
                     ("content-type", "application/json")]

    first = request(envoy.port, "POST", "/payments", first_headers, BODY)
    retry = request(envoy.port, "POST", "/payments", retry_headers, BODY)
    # Control: a fingerprinted header (content-type) that differs is another request.
    other_type = request(envoy.port, "POST", "/payments",
                         [("Idempotency-Key", key), ("Content-Type", "text/plain"), harness.CALLER],
                         BODY)

    assert_original(first, key, 1)
    assert_replay_of(retry, first)
    assert_key_reused(other_type)
    assert upstream.effects() == {key: 1}


# --- 3. two callers, one key -----------------------------------------------------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_two_callers_same_key_never_see_each_others_answer(upstream, start, forward):
    envoy = start({"on_conflict": "wait"}, forward)
    key = new_key("shared")
    callers = {"alice": "Bearer token-of-alice", "bob": "Bearer token-of-bob"}
    rng = random.Random(20261129)
    plan = [rng.choice(sorted(callers)) for _ in range(200)]
    assert set(plan) == set(callers)

    def call(i):
        return post(envoy.port, key, extra={"authorization": callers[plan[i]],
                                            "x-delay-ms": "300"}, timeout=30)

    results = run_concurrently(call, len(plan), max_workers=16, timeout=120,
                               return_exceptions=True)

    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    effect_of = {}
    for caller in callers:
        mine = [r for r, c in zip(results, plan) if c == caller]
        originals = [r for r in mine if not is_replay(r)]
        assert len(originals) == 1, (caller, [describe(r) for r in originals])
        first = originals[0]
        effect_of[caller] = first.json()["effect"]
        assert_original(first, key, effect_of[caller])
        for r in mine:
            if r is not first:
                # Never the other caller's answer: same effect number, same bytes.
                assert r.json()["effect"] == effect_of[caller], (caller, describe(r))
                assert_replay_of(r, first)
    assert sorted(effect_of.values()) == [1, 2], effect_of
    print(f"[{forward}] effects per caller: {effect_of}; requests per caller: "
          f"{ {c: plan.count(c) for c in callers} }")
    assert upstream.effects() == {key: 2}
    counters = plugin_counters(envoy)
    assert counters["claimed"] == 2 and counters["completed"] == 2, counters
    assert counters["conflict"] == 0, counters


# --- 4. a body over the limit --------------------------------------------------------------------


MIB = 1 << 20


@pytest.mark.parametrize("buffer_limit", [None, 4 * MIB], ids=["default_buffer", "buffer_4MiB"])
@pytest.mark.parametrize("forward", FORWARDS)
def test_2mib_body_over_1mib_limit_gets_413_problem(upstream, start, forward, buffer_limit):
    envoy = start({"max_request_body_bytes": MIB}, forward,
                  **({} if buffer_limit is None else {"buffer_limit_bytes": buffer_limit}))
    key = new_key("big")
    big_body = b"x" * (2 * MIB)

    big = post(envoy.port, key, body=big_body, timeout=30)
    effects_after_big = upstream.effects()
    small = post(envoy.port, key)
    print(f"[{forward}, buffer {buffer_limit}] 2 MiB body -> {big.status} "
          f"{big.header('content-type')} {big.body[:200]!r}; then small -> {small.status}")

    assert effects_after_big == {}, "the upstream was called"
    assert_original(small, key, 1)  # the key was never taken
    assert upstream.effects() == {key: 1}
    assert plugin_counters(envoy)["too_large"] == 1
    if buffer_limit is None:
        # Envoy's default 1 MiB listener buffer equals the limit: Envoy's own text/plain
        # "413 Payload Too Large" wins over the plugin's reply (docs/limits.md). Still a 413,
        # still no effect; the shipped configs set the buffer to 4 MiB.
        assert big.status == 413
    else:
        problem(big, 413, "body-too-large", False)


@pytest.mark.parametrize("forward", FORWARDS)
def test_body_over_the_limit_gets_413_and_a_keyless_one_passes(upstream, start, forward):
    envoy = start({"max_request_body_bytes": 1024}, forward)
    key = new_key("big")

    big = post(envoy.port, key, body=b"x" * 2048)
    small = post(envoy.port, key, body=b"x" * 1024)
    keyless = post(envoy.port, None, body=b"x" * 2048)

    problem(big, 413, "body-too-large", False)
    assert small.status == 201 and not is_replay(small), describe(small)  # nothing was held
    assert keyless.status == 201, describe(keyless)  # not covered: no limit
    assert upstream.effects() == {key: 1, "": 1}
    assert plugin_counters(envoy)["too_large"] == 1


# --- 5. per-route rules -------------------------------------------------------------------------


ROUTE_RULES = {"routes": [{"match": {"prefix": "/payments"}, "require_key": True},
                          {"match": {"prefix": "/search"}, "enabled": False}]}


@pytest.mark.parametrize("forward", FORWARDS)
def test_per_route_rules(upstream, start, forward):
    envoy = start(ROUTE_RULES, forward)
    skey, okey, pkey = new_key("search"), new_key("other"), new_key("pay")

    # /payments requires a key.
    missing = post(envoy.port, None, path="/payments")
    problem(missing, 400, "missing-key", False)
    paid = post(envoy.port, pkey, path="/payments")
    assert_original(paid, pkey, 1)
    assert_replay_of(post(envoy.port, pkey, path="/payments"), paid)
    # /search: the filter is off; every copy reaches the upstream, even concurrent ones.
    s1 = post(envoy.port, skey, path="/search")
    s2 = post(envoy.port, skey, path="/search")
    concurrent = run_concurrently(
        lambda: post(envoy.port, skey, path="/search", extra={"x-delay-ms": "300"}), 2)
    for r in [s1, s2, *concurrent]:
        assert r.status == 201 and not is_replay(r), describe(r)
        assert r.header("retry-after") is None
    assert sorted(r.json()["effect"] for r in [s1, s2, *concurrent]) == [1, 2, 3, 4]
    # /other: the base config (key optional; a key makes it idempotent).
    keyless = post(envoy.port, None, path="/other")
    assert keyless.status == 201 and not is_replay(keyless), describe(keyless)
    o1 = post(envoy.port, okey, path="/other")
    o2 = post(envoy.port, okey, path="/other")
    assert_original(o1, okey, 1, path="/other")
    assert_replay_of(o2, o1)

    assert upstream.effects() == {pkey: 1, skey: 4, okey: 1, "": 1}
    counters = plugin_counters(envoy)
    assert counters["missing_key"] == 1, counters
    assert counters["claimed"] == 2 and counters["replayed"] == 2, counters
    assert counters["conflict"] == 0, counters


# --- 6. the IETF draft's error examples ------------------------------------------------------------


STATUS_LINE = re.compile(r"^HTTP/1\.1 (\d{3})", re.M)


def test_ietf_draft_error_examples(upstream, make_envoy, wasm):
    """draft-ietf-httpapi-idempotency-key-header, "Error Scenarios": 400 (key missing), 409
    (a request is outstanding), 422 (key reused for another payload), by tests/ietf_examples.sh."""
    envoy = make_envoy({"require_key": True, "on_conflict": "reject"}, upstream.port)
    script = os.path.join(TESTS_DIR, "ietf_examples.sh")
    env = {**os.environ, "PORT": str(envoy.port), "KEY_SUFFIX": uuid.uuid4().hex[:8]}
    proc = subprocess.run(["bash", script], capture_output=True, env=env, timeout=60,
                          stdin=subprocess.DEVNULL)
    out = proc.stdout.decode("utf-8", "replace")
    print(out)
    assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")

    sections = re.split(r"^### ", out, flags=re.M)[1:]
    assert [s.split(".", 1)[0] for s in sections] == ["1", "2", "3"], out
    statuses = [[int(s) for s in STATUS_LINE.findall(section)] for section in sections]
    assert statuses == [[400], [409], [422]], statuses
    bodies = [json.loads(section.strip().splitlines()[-1]) for section in sections]
    assert [b["status"] for b in bodies] == [400, 409, 422]
    assert [b["type"].rsplit(":", 1)[1] for b in bodies] == ["missing-key", "in-progress",
                                                           "key-reused"]
    assert bodies[1]["title"] == "A request is outstanding for this Idempotency-Key"
    assert "content-type: application/problem+json" in out.lower()
    counters = plugin_counters(envoy)
    assert (counters["missing_key"], counters["conflict"], counters["fingerprint_mismatch"]) \
        == (1, 1, 1), counters
    assert sum(upstream.effects().values()) == 1  # only the slow first call of example 2


# --- 7. keys as RFC 8941 strings -------------------------------------------------------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_rfc8941_string_keys(upstream, start, forward):
    envoy = start(forward=forward)
    tag = uuid.uuid4().hex
    pairs = [  # (sent first, sent again): the same key in two forms
        (f'"k-{tag}"', f"k-{tag}"),
        (f'"q-{tag}\\"b"', f'q-{tag}"b'),      # "q-…\"b"  ==  q-…"b
        (f'"s-{tag}\\\\b"', f"s-{tag}\\b"),    # "s-…\\b"  ==  s-…\b
        (f"u-{tag}", f'"u-{tag}"'),            # bare first, quoted later
    ]
    for first_form, second_form in pairs:
        first = post(envoy.port, first_form)
        again = post(envoy.port, second_form)
        assert_original(first, first_form, 1)
        assert_replay_of(again, first)
        assert upstream.effects(second_form) == 0, second_form
    # A different key that only looks close: the escape is not dropped.
    near = post(envoy.port, f'"q-{tag}b"')
    assert_original(near, f'"q-{tag}b"', 1)

    invalid = [f'"x-{tag}', f'"x-{tag}\\qb"', f'"x-{tag}"x', '""', f'"x-{tag}\\"']
    for form in invalid:
        resp = post(envoy.port, form)
        problem(resp, 400, "invalid-key", False)
    assert upstream.effects() == {first: 1 for first, _ in pairs} | {f'"q-{tag}b"': 1}
    counters = plugin_counters(envoy)
    assert counters["invalid_key"] == len(invalid), counters
    assert counters["replayed"] == len(pairs), counters


# --- 8. JWT claim scope -----------------------------------------------------------------------------


JWT_ISSUER = "https://issuer.test"


@pytest.mark.parametrize("forward", FORWARDS)
def test_jwt_claim_scope(upstream, make_envoy, wasm, forward):
    plugin_config = {"forward": forward, "scope_headers": [],
                     "scope_jwt_claim": {"payload": "jwt_payload", "claim": "sub"}}
    # jwt_authn must run before the plugin: with_plugin=False and both as "extra" filters
    # (placed, in order, before the router).
    envoy = make_envoy(plugin_config, upstream.port, with_plugin=False,
                       extra_filters=[jwt_authn_filter(JWT_ISSUER), wasm_filter(plugin_config)])
    key = new_key("jwt")

    def send(token):
        return post(envoy.port, key, extra={"authorization": f"Bearer {token}"})

    alice1, bob1 = make_jwt("alice", JWT_ISSUER), make_jwt("bob", JWT_ISSUER)
    a1 = send(alice1)
    b1 = send(bob1)
    time.sleep(1.1)  # a refreshed token: another iat (seconds) and jti
    alice2, bob2 = make_jwt("alice", JWT_ISSUER), make_jwt("bob", JWT_ISSUER)
    assert alice2 != alice1 and bob2 != bob1
    a2 = send(alice2)
    b2 = send(bob2)
    unsigned = send(make_jwt("alice", JWT_ISSUER, secret=b"wrong-secret-wrong-secret-wrong!!"))
    anonymous = post(envoy.port, key)

    assert_original(a1, key, 1)
    assert_original(b1, key, 2)  # another subject: its own effect, not alice's replay
    assert_replay_of(a2, a1)     # same subject, new token: the replay survives the refresh
    assert_replay_of(b2, b1)
    assert unsigned.status == 401, describe(unsigned)  # jwt_authn refuses a bad signature
    assert anonymous.status == 401, describe(anonymous)  # the requirement covers all routes
    assert upstream.effects() == {key: 2}
    counters = plugin_counters(envoy)
    assert counters["claimed"] == 2 and counters["replayed"] == 2, counters


# --- 9. mTLS peer scope ------------------------------------------------------------------------------


@contextlib.contextmanager
def envoy_config_patch(mutate):
    """While active, harness.Envoy builds its YAML from envoy_config() passed through mutate()."""
    original = harness.envoy_yaml

    def patched(listener_port, admin_port, upstream_port, plugin_config, **kwargs):
        config = harness.envoy_config(listener_port, admin_port, upstream_port, plugin_config,
                                      **kwargs)
        return harness.to_yaml(mutate(config))

    harness.envoy_yaml = patched
    try:
        yield
    finally:
        harness.envoy_yaml = original


def require_client_certs(pki):
    def mutate(config):
        chain = config["static_resources"]["listeners"][0]["filter_chains"][0]
        chain["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
                         "DownstreamTlsContext",
                "require_client_certificate": True,
                "common_tls_context": {
                    "tls_certificates": [{
                        "certificate_chain": {"filename": pki["server.crt"]},
                        "private_key": {"filename": pki["server.key"]}}],
                    "validation_context": {"trusted_ca": {"filename": pki["ca.crt"]}},
                },
            },
        }
        return config
    return mutate


def tls_post(port, pki, client, key, body=BODY):
    ctx = ssl.create_default_context(cafile=pki["ca.crt"])
    ctx.load_cert_chain(pki[f"{client}.crt"], pki[f"{client}.key"])
    conn = http.client.HTTPSConnection(harness.LOCALHOST, port, context=ctx, timeout=15)
    try:
        return request(port, "POST", "/payments",
                       [("content-type", "application/json"), ("Idempotency-Key", key)],
                       body, conn=conn)
    finally:
        conn.close()


@pytest.mark.parametrize("forward", FORWARDS)
def test_mtls_peer_scope(upstream, make_envoy, wasm, forward, tmp_path):
    pki = make_pki(str(tmp_path))
    plugin_config = {"forward": forward, "scope_headers": [], "scope_peer": True}
    with envoy_config_patch(require_client_certs(pki)):
        envoy = make_envoy(plugin_config, upstream.port)
    key = new_key("peer")

    a1 = tls_post(envoy.port, pki, "client_a", key)
    b1 = tls_post(envoy.port, pki, "client_b", key)
    a2 = tls_post(envoy.port, pki, "client_a", key)
    b2 = tls_post(envoy.port, pki, "client_b", key)

    assert_original(a1, key, 1)
    assert_original(b1, key, 2)  # another peer: its own effect
    assert_replay_of(a2, a1)
    assert_replay_of(b2, b1)
    assert upstream.effects() == {key: 2}
    # Without a client certificate the handshake fails: nothing reaches the plugin.
    ctx = ssl.create_default_context(cafile=pki["ca.crt"])
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        conn = http.client.HTTPSConnection(harness.LOCALHOST, envoy.port, context=ctx,
                                           timeout=5)
        try:
            request(envoy.port, "POST", "/payments", [("Idempotency-Key", key)], BODY,
                    conn=conn)
        finally:
            conn.close()
    assert upstream.effects() == {key: 2}
