"""Every plugin configuration the project shipped or documented (tests/config_corpus/) starts
in a real Envoy with this build and serves a claim and a replay (docs/upgrading.md). Those
written to be refused (REFUSED) are refused naming their field. etcd configurations run on a
real etcd, on the clusters they name (HTTP/1.1 for the JSON gateway); JWT-scoped ones behind
jwt_authn with a token."""

import json
import os

import pytest

from e2e_util import new_key, post
from etcd_util import Etcd, cluster as etcd_cluster
from harness import EnvoyStartError, wasm_filter
from jwt_util import ISTIO_ISSUER, jwt_authn_filter, make_jwt

CORPUS = os.path.join(os.path.dirname(__file__), "config_corpus")


def corpus():
    with open(os.path.join(CORPUS, "REFUSED")) as f:
        refused = dict(line.split() for line in f if line.strip() and not line.startswith("#"))
    names = sorted(n for n in os.listdir(CORPUS) if n.endswith(".json"))
    return [(n, refused.get(n)) for n in names]


@pytest.fixture(scope="module")
def etcd():
    server = Etcd()
    yield server
    server.close()


def policies(config):
    return [config] + [rule for rule in config.get("routes", [])]


def etcd_clusters(config, port):
    store = config.get("store", {})
    if store.get("kind") != "etcd":
        return []
    names = store.get("clusters") or [store["cluster"]]
    api = "json" if store.get("api") == "json" or "authority" in store else "grpc"
    return [etcd_cluster(port, name=name, api=api) for name in names]


def request_headers(config):
    """What a caller of this configuration sends: its scope headers, a JWT when a claim
    scopes it, the fingerprinted headers."""
    extra = {}
    for p in policies(config):
        for name in p.get("scope_headers", []) + p.get("fingerprint_headers", []):
            if name.lower() not in ("authorization", "content-type"):
                extra[name] = "corpus"
    if any("scope_jwt_claim" in p for p in policies(config)):
        extra["authorization"] = f"Bearer {make_jwt('corpus-caller')}"
    return extra


@pytest.mark.parametrize("name, refused_field", corpus(), ids=[n for n, _ in corpus()])
def test_each_configuration_starts_and_serves_a_claim_and_a_replay(wasm, upstream, make_envoy, name,
                                                                   refused_field, request):
    with open(os.path.join(CORPUS, name)) as f:
        config = json.load(f)
    if refused_field:
        with pytest.raises(EnvoyStartError) as failure:
            make_envoy(config, upstream.port)
        assert f"invalid configuration: field `{refused_field}`" in failure.value.log
        return
    clusters = []
    if config.get("store", {}).get("kind") == "etcd":
        clusters = etcd_clusters(config, request.getfixturevalue("etcd").port)
    jwt = [p["scope_jwt_claim"]["payload"] for p in policies(config) if "scope_jwt_claim" in p]
    if jwt:
        filters = [jwt_authn_filter(ISTIO_ISSUER, payload_name=jwt[0], require=False), wasm_filter(config)]
        envoy = make_envoy(config, upstream.port, with_plugin=False, extra_filters=filters,
                           extra_clusters=clusters)
    else:
        envoy = make_envoy(config, upstream.port, extra_clusters=clusters)
    key_header = config.get("key_header", "idempotency-key")
    key = new_key(name[:3])
    extra = {**request_headers(config)}
    if key_header != "idempotency-key":
        extra[key_header] = key
    first = post(envoy, key, extra=extra)
    replay = post(envoy, key, extra=extra)
    assert first.status == 201, (first.status, first.body)
    assert replay.status == 201 and replay.header("idempotent-replayed") == "true", (replay.status, replay.body)
    assert replay.body == first.body
    assert upstream.effects(key) == 1
