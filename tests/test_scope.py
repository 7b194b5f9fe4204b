"""Scoping behind the mesh's authentication (docs/behaviour.md §3.1): Istio's RequestAuthentication (Envoy's
jwt_authn) verifies the token and then removes `Authorization`. Scoping by that header would
put every caller in one scope; the shipped Istio configuration scopes by the verified `sub`,
and `missing_scope` decides what a request without any scope gets."""

import os

import pytest
import yaml

from e2e_util import (assert_replay_of, describe, is_replay, new_key, plugin_counters, post,
                      problem)
from harness import REPO_ROOT, wasm_filter
from jwt_util import ISTIO_ISSUER, istio_jwt_authn_filter, make_jwt

FORWARDS = ["detached", "router"]


def istio_plugin_config(**overrides):
    """The pluginConfig of the shipped WasmPlugin (envoy/istio/wasmplugin.yaml)."""
    with open(os.path.join(REPO_ROOT, "envoy", "istio", "wasmplugin.yaml")) as f:
        config = yaml.safe_load(f)["spec"]["pluginConfig"]
    assert config["scope_jwt_claim"] == {"payload": ISTIO_ISSUER, "claim": "sub"}
    return {**config, **overrides}


def behind_istio_authn(make_envoy, upstream, plugin_config):
    """Envoy with jwt_authn as istiod builds it from a RequestAuthentication, then the plugin."""
    # The manifest's detached_via names the internal listener its EnvoyFilter adds.
    return make_envoy(plugin_config, upstream.port, with_plugin=False, internal_router=True,
                      extra_filters=[istio_jwt_authn_filter(), wasm_filter(plugin_config)])


def as_user(token):
    """What a client sends: its token, and the upstream sets a cookie for the session."""
    return {"authorization": f"Bearer {token}", "x-set-cookie": "session=secret"}


def no_caller():
    """A request without any identity (jwt_authn lets it through: no token is not a bad one)."""
    return {"authorization": None}


@pytest.mark.parametrize("forward", FORWARDS)
def test_users_behind_istio_authn_get_only_their_own_answers(upstream, make_envoy, wasm,
                                                             forward):
    envoy = behind_istio_authn(make_envoy, upstream, istio_plugin_config(forward=forward))
    key = new_key("mesh")
    alice = post(envoy.port, key, extra=as_user(make_jwt("alice")))
    bob = post(envoy.port, key, extra=as_user(make_jwt("bob")))
    # New tokens (another jti): the same users, so their own replays.
    alice_again = post(envoy.port, key, extra=as_user(make_jwt("alice")))
    bob_again = post(envoy.port, key, extra=as_user(make_jwt("bob")))

    assert alice.status == bob.status == 201 and not (is_replay(alice) or is_replay(bob))
    assert alice.header("x-effect") == "1" and bob.header("x-effect") == "2", \
        (describe(alice), describe(bob))
    assert_replay_of(alice_again, alice)
    assert_replay_of(bob_again, bob)
    assert upstream.effects() == {key: 2}
    counters = plugin_counters(envoy)
    assert (counters["claimed"], counters["replayed"], counters["scope_missing"]) == (2, 2, 0)


@pytest.mark.parametrize("forward", FORWARDS)
def test_scoping_by_a_header_the_mesh_removes_is_caught(upstream, make_envoy, wasm, forward):
    """The regression case: the old shipped scoping (`authorization`) behind Istio's authn.
    With `missing_scope: "share"` the leak is there to see: bob replays alice's answer, her
    cookie included. With the default ("pass") nobody shares: each call goes upstream."""
    old = {"forward": forward, "scope_headers": ["authorization"]}
    shared = behind_istio_authn(make_envoy, upstream, {**old, "missing_scope": "share"})
    key = new_key("leak")
    alice = post(shared.port, key, extra=as_user(make_jwt("alice")))
    bob = post(shared.port, key, extra=as_user(make_jwt("bob")))
    assert_replay_of(bob, alice)  # the leak that "share" opts into
    assert bob.header_all("set-cookie") == ["session=secret"]
    assert plugin_counters(shared)["scope_missing"] == 2

    upstream.reset()
    safe = behind_istio_authn(make_envoy, upstream, old)  # missing_scope: "pass" by default
    key = new_key("safe")
    alice = post(safe.port, key, extra=as_user(make_jwt("alice")))
    bob = post(safe.port, key, extra=as_user(make_jwt("bob")))
    assert not is_replay(bob) and bob.header("x-effect") == "2", describe(bob)
    assert alice.header("x-effect") == "1", describe(alice)
    counters = plugin_counters(safe)
    assert (counters["scope_missing"], counters["claimed"], counters["replayed"]) == (2, 0, 0)
    assert upstream.effects() == {key: 2}


@pytest.mark.parametrize("forward", FORWARDS)
def test_missing_scope_pass_reject_share(upstream, make_envoy, wasm, forward):
    envoys = {choice: make_envoy({"forward": forward, "missing_scope": choice}, upstream.port)
              for choice in ("pass", "reject", "share")}
    keys = {choice: new_key(choice) for choice in envoys}
    answers = {choice: [post(envoy.port, keys[choice], extra=no_caller()) for _ in range(2)]
               for choice, envoy in envoys.items()}

    # pass: as if the plugin were not there; two effects, no replay.
    first, second = answers["pass"]
    assert first.status == second.status == 201
    assert not is_replay(second) and second.header("x-effect") == "2", describe(second)
    # reject: 401 problem+json, nothing runs.
    for resp in answers["reject"]:
        body = problem(resp, 401, "scope-missing", False)
        assert "identity" in body["title"]
    # share: one anonymous scope, the second is the replay.
    first, second = answers["share"]
    assert_replay_of(second, first)
    assert upstream.effects() == {keys["pass"]: 2, keys["share"]: 1}
    for choice, envoy in envoys.items():
        counters = plugin_counters(envoy)
        assert counters["scope_missing"] == 2, (choice, counters)
        assert counters["claimed"] == (1 if choice == "share" else 0), (choice, counters)
    # With a scope, nothing of this applies.
    scoped = post(envoys["reject"].port, new_key("scoped"))
    assert scoped.status == 201, describe(scoped)
