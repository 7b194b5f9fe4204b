"""Detached calls that follow the route (docs/deployment.md, "Detached calls through the
route"): with `detached_via` naming a cluster whose endpoint is an internal listener with the
same routes, a detached call gets what a router call on the same route gets. Side by side, the
same requests through router mode and detached mode, on routes with a prefix rewrite, a regex
rewrite, a host rewrite, header rules at route and virtual-host level, response header rules,
weighted clusters, a header-matched route, a route timeout shorter than the call and a retry
policy: the upstream records the same method, path, host and headers (bar the ones listed in
DIFFERENT), and the client gets the same answer. Without `detached_via` the plugin says so
at configure, and the upstream gets the raw request."""

import json
import threading
import uuid

import grpc
import pytest

from e2e_util import describe, is_replay, key_headers, new_key, plugin_counters, post
from grpc_util import GrpcUpstream, pay, with_replay_loopback
from harness import Envoy, abandon, envoy_config, free_port, static_cluster, wait_until

# Each request's own id differs between two requests; nothing else does (measured: the router's
# computed x-envoy-expected-rq-timeout-ms, x-envoy-original-path and -host, x-forwarded-proto
# are the same, and the hop adds no x-envoy-internal or x-forwarded-for).
DIFFERENT = {"x-request-id"}


def header(key, value):
    return {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}


def routes(cluster="upstream"):
    """One virtual host with a route for each behaviour the router applies."""
    added = [header("x-route-added", "route")]
    return [{
        "name": "api", "domains": ["*"],
        "request_headers_to_add": [header("x-vhost-added", "vhost")],
        "request_headers_to_remove": ["x-vhost-strip"],
        "response_headers_to_add": [header("x-vhost-resp", "vhost")],
        "routes": [
            {"match": {"prefix": "/api/"},
             "route": {"cluster": cluster, "prefix_rewrite": "/rewritten/", "timeout": "15s"},
             "request_headers_to_add": added,
             "request_headers_to_remove": ["x-client-secret"],
             "response_headers_to_add": [header("x-route-resp", "route")],
             "response_headers_to_remove": ["set-cookie"]},
            {"match": {"prefix": "/regex/"},
             "route": {"cluster": cluster, "timeout": "15s", "regex_rewrite": {
                 "pattern": {"regex": "^/regex/(\\w+)/(\\w+)$"}, "substitution": "/v2/\\2/\\1"}}},
            {"match": {"prefix": "/host/"},
             "route": {"cluster": cluster, "timeout": "15s", "host_rewrite_literal": "inside.example"}},
            {"match": {"prefix": "/weighted/"},
             "route": {"timeout": "15s", "weighted_clusters": {"clusters": [
                 {"name": cluster, "weight": 50, "request_headers_to_add": [header("x-which", "a")]},
                 {"name": "upstream_b", "weight": 50, "request_headers_to_add": [header("x-which", "b")]},
             ]}}},
            {"match": {"prefix": "/tier/", "headers": [
                {"name": "x-tenant", "string_match": {"exact": "gold"}}]},
             "route": {"cluster": cluster, "timeout": "15s"},
             "request_headers_to_add": [header("x-tier", "gold")]},
            {"match": {"prefix": "/tier/"},
             "route": {"cluster": cluster, "timeout": "15s"},
             "request_headers_to_add": [header("x-tier", "other")]},
            {"match": {"prefix": "/slow/"}, "route": {"cluster": cluster, "timeout": "0.5s"}},
            {"match": {"prefix": "/retry/"},
             "route": {"cluster": cluster, "timeout": "15s",
                       "retry_policy": {"retry_on": "5xx", "num_retries": 1}}},
            {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "15s"}},
        ]}]


def without_response_rules(virtual_hosts):
    """The internal listener's copy of the routes: the outer route adds its response headers
    to the plugin's reply to the client, so the hop must not add them too; its removals stay,
    since the plugin's headers come after the outer route's rules (docs/deployment.md)."""
    def strip(d):
        return {k: v for k, v in d.items() if k != "response_headers_to_add"}
    return [dict(strip(vh), routes=[strip(r) for r in vh["routes"]]) for vh in virtual_hosts]


@pytest.fixture
def pair(upstream, make_envoy, wasm):
    """(router, detached): two Envoys with the same routes, the plugin in router mode on one
    and detached through the internal listener on the other."""
    extra = [static_cluster("upstream_b", upstream.port)]
    router = make_envoy({"forward": "router"}, upstream.port, virtual_hosts=routes(), extra_clusters=extra)
    detached = make_envoy({"detached_via": "idem_internal"}, upstream.port, virtual_hosts=routes(),
                          extra_clusters=extra, internal_router=True,
                          internal_virtual_hosts=without_response_rules(routes()))
    return router, detached


def seen(upstream, key):
    """The upstream's record of each effect of `key`: (method, path, host, headers)."""
    out = []
    for e in upstream.log():
        if e["key"] == key:
            headers = {n: v for n, v in e["headers"].items() if n not in DIFFERENT and n != "idempotency-key"}
            out.append((e["method"], e["path"], headers.pop("host", None), headers))
    return out


def answer_of(resp):
    """What the client sees, bar the per-response fields (the upstream echoes the key)."""
    drop = {"date", "x-envoy-upstream-service-time", "content-length", "x-effect", "server"}
    body = json.loads(resp.body)
    body.pop("key", None)
    return resp.status, sorted((n, v) for n, v in resp.headers if n not in drop), body


def side_by_side(upstream, pair, path, **headers):
    """The same request through both; the upstream's records of each, and the answers."""
    records, answers = [], []
    for envoy in pair:
        key = new_key("route")
        resp = post(envoy, key, path=path, extra=headers)
        records.append(seen(upstream, key))
        answers.append(resp)
    return records, answers


@pytest.mark.parametrize("path,headers,want_path,want", [
    ("/api/payments", {"x-client-secret": "spoofed", "x-vhost-strip": "x", "x-set-cookie": "c=1"},
     "/rewritten/payments", {"x-route-added": "route", "x-vhost-added": "vhost"}),
    ("/regex/alpha/beta", {}, "/v2/beta/alpha", {"x-vhost-added": "vhost"}),
    ("/host/x", {}, "/host/x", {}),
    ("/tier/t", {"x-tenant": "gold"}, "/tier/t", {"x-tier": "gold"}),
    ("/tier/t", {"x-tenant": "lead"}, "/tier/t", {"x-tier": "other"}),
])
def test_the_upstream_gets_what_the_router_sends(upstream, pair, path, headers, want_path, want):
    (router, detached), answers = side_by_side(upstream, pair, path, **headers)
    assert len(router) == 1 and len(detached) == 1, (router, detached)
    assert router == detached, f"router {router}\ndetached {detached}"
    method, got_path, host, got = detached[0]
    assert (method, got_path) == ("POST", want_path)
    assert host == ("inside.example" if path.startswith("/host/") else "localhost")
    for name, value in want.items():
        assert got.get(name) == value, (name, got)
    assert "x-client-secret" not in got and "x-vhost-strip" not in got
    assert answer_of(answers[0]) == answer_of(answers[1]), [describe(a) for a in answers]
    if path.startswith("/api/"):
        for a in answers:
            assert a.header_all("x-route-resp") == ["route"] and a.header_all("x-vhost-resp") == ["vhost"]
            assert a.header("set-cookie") is None, describe(a)


def test_replays_through_the_route_carry_the_routes_response_headers_once(upstream, pair):
    """A replay is the plugin's own reply: the outer route's response rules apply to it as to
    the first answer. Detached through the route, the stored answer has none of them, so a
    replay carries each once. In router mode the stored answer already has them (the router
    applied them before the plugin saw it), and a replay carries an added header twice:
    docs/limits.md."""
    router, detached = pair
    key = new_key("replay")
    first = post(detached, key, path="/api/r")
    replay = post(detached, key, path="/api/r")
    assert is_replay(replay)
    assert replay.header_all("x-route-resp") == ["route"], describe(replay)
    status, headers, body = answer_of(replay)
    assert (status, [h for h in headers if h[0] != "idempotent-replayed"], body) == answer_of(first)
    key = new_key("replay")
    post(router, key, path="/api/r")
    replay = post(router, key, path="/api/r")
    assert is_replay(replay)
    assert replay.header_all("x-route-resp") == ["route", "route"], describe(replay)


def test_weighted_clusters_pick_a_cluster_for_detached_calls_too(upstream, pair):
    which = {"router": set(), "detached": set()}
    for _ in range(16):
        (router, detached), _ = side_by_side(upstream, pair, "/weighted/w")
        which["router"].add(router[0][3].get("x-which"))
        which["detached"].add(detached[0][3].get("x-which"))
    assert which["router"] <= {"a", "b"} and which["detached"] <= {"a", "b"}, which
    assert which["detached"] == {"a", "b"}, f"16 detached calls all went to one cluster: {which}"


def test_a_route_timeout_shorter_than_the_call_releases_the_key_in_both_modes(upstream, pair):
    """The route's 0.5 s timeout ends a 1.5 s call: the client gets the 504 in both modes (the
    upstream may still finish: that is the route's doing), the key is released, and the retry
    runs again."""
    for envoy in pair:
        key = new_key("slow")
        first = post(envoy, key, path="/slow/s", x_delay_ms=1500)
        assert first.status == 504, describe(first)
        assert first.elapsed_s < 1.4, first.elapsed_s
        retry = post(envoy, key, path="/slow/s")
        assert retry.status == 201 and not is_replay(retry), describe(retry)
        assert upstream.effects(key) == 2


def test_a_routes_retries_apply_to_detached_calls_as_to_router_calls(upstream, pair):
    """A retry policy on 5xx makes the router send a POST again after a 503: the upstream
    runs it twice in both modes, and the client gets the second answer, stored and replayed.
    The plugin answers for the client's retries, not the route's (docs/deployment.md)."""
    for envoy in pair:
        key = new_key("retry")
        first = post(envoy, key, path="/retry/r", x_status_first=503)
        assert first.status == 201, describe(first)
        assert upstream.effects(key) == 2
        again = post(envoy, key, path="/retry/r")
        assert is_replay(again) and upstream.effects(key) == 2, describe(again)


@pytest.mark.every_envoy
def test_a_client_that_leaves_mid_call_still_gets_the_stored_answer(upstream, pair):
    """Detached through the route: the client leaves while the upstream works; the call
    finishes, its answer is stored, and the retry replays it; the upstream saw the rewritten
    path once."""
    _, detached = pair
    key = new_key("leave")
    headers = key_headers(key, [("x-hold", "leave")], "application/json", "localhost")
    leaver = threading.Thread(target=abandon, args=(detached.port, "POST", "/api/leave", headers,
                                                    b'{"amount":1}', 0.3))
    leaver.start()
    wait_until(lambda: upstream.effects(key) == 1, timeout=10, message="the call at the upstream")
    leaver.join()
    upstream.release("leave")
    wait_until(lambda: is_replay(post(detached, key, path="/api/leave")), timeout=10,
               message="the stored answer replayed")
    assert upstream.effects(key) == 1
    assert [r[1] for r in seen(upstream, key)] == ["/rewritten/leave"]


def test_detached_without_a_route_says_so_and_sends_the_raw_request(upstream, make_envoy, wasm):
    """Without `detached_via`, configure warns and sets `config_detached_unrouted`; the
    upstream gets the client's path and headers, as before."""
    envoy = make_envoy({}, upstream.port, virtual_hosts=routes(),
                       extra_clusters=[static_cluster("upstream_b", upstream.port)])
    key = new_key("raw")
    assert post(envoy, key, path="/api/raw", extra={"x-client-secret": "spoofed"}).status == 201
    [(_, path, _, got)] = seen(upstream, key)
    assert path == "/api/raw" and got.get("x-client-secret") == "spoofed" and "x-route-added" not in got
    gauges = plugin_counters(envoy)
    assert gauges.get("config_detached_unrouted") == 1, gauges
    wait_until(lambda: "send detached calls straight to the route's cluster" in envoy.log_text(),
               timeout=5, message="the configure warning")


def test_a_configuration_with_a_route_reports_none_unrouted(upstream, pair):
    _, detached = pair
    post(detached, new_key("g"))
    assert plugin_counters(detached).get("config_detached_unrouted") == 0
    assert "straight to the route's cluster" not in detached.log_text()


def test_the_fencing_header_and_the_key_reach_the_upstream_through_the_route(upstream, make_envoy, wasm):
    envoy = make_envoy({"detached_via": "idem_internal", "fencing_header": "idempotency-fence"},
                       upstream.port, virtual_hosts=routes(), internal_router=True,
                       extra_clusters=[static_cluster("upstream_b", upstream.port)])
    key = new_key("fence")
    resp = post(envoy, key, path="/api/f", extra={"idempotency-fence": "999999"})
    assert resp.status == 201, describe(resp)
    [(_, path, _, got)] = [r for r in seen(upstream, key)]
    assert path == "/rewritten/f"
    assert got.get("idempotency-fence", "").isdigit() and got["idempotency-fence"] != "999999", got


def test_grpc_calls_follow_the_route_too(wasm, make_envoy):
    """gRPC through the route: the route's request header rules reach the service as metadata
    in both modes, and a retry of a finished call replays with its trailers."""
    service = GrpcUpstream()
    try:
        route = {"match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": "15s"},
                 "request_headers_to_add": [header("x-route-added", "route")],
                 "request_headers_to_remove": ["x-client-secret"]}
        hosts = [{"name": "grpc", "domains": ["*"], "routes": [route]}]
        seen_by = {}
        for mode, config, internal in [("router", {"forward": "router"}, False),
                                       ("detached", {"detached_via": "idem_internal"}, True)]:
            port, admin = free_port(), free_port()
            bootstrap = envoy_config(port, admin, service.port, {**config, "grpc_replays": "loopback"},
                                     upstream_http2=True, virtual_hosts=json.loads(json.dumps(hosts)),
                                     internal_router=internal)
            envoy = make_envoy(None, service.port, bootstrap=with_replay_loopback(bootstrap))
            key = uuid.uuid4().hex
            code, message, _, trailing = pay(envoy.port, key, x_client_secret="spoofed")
            assert code == grpc.StatusCode.OK and trailing.get("x-cost") == "7", (code, message)
            code, again, initial, trailing = pay(envoy.port, key, x_client_secret="spoofed")
            assert code == grpc.StatusCode.OK and again == message, (code, again)
            assert initial.get("idempotent-replayed") == "true" and trailing.get("x-cost") == "7"
            assert service.effects_of(key) == 1
            [meta] = service.metadata_of(key)
            assert meta.get("x-route-added") == "route" and "x-client-secret" not in meta, (mode, meta)
            seen_by[mode] = {n: v for n, v in meta.items() if n not in DIFFERENT | {"idempotency-key"}}
        # A detached call's body is whole, and Envoy sends it with its content-length (a
        # streamed gRPC call has none): the one difference.
        assert seen_by["detached"].pop("content-length") == "14"
        assert seen_by["router"] == seen_by["detached"], seen_by
    finally:
        service.stop()


def test_the_filter_on_the_internal_listener_too_is_told_and_stores_nothing(upstream, wasm):
    """A misconfiguration the plugin cannot see at configure: the idempotency filter on the
    internal listener as well. It meets the outer claim and answers the hop 409 in progress;
    the outer plugin releases the key instead of storing that 409, and says why in its log."""
    from harness import Envoy, free_port, wasm_filter
    port, admin = free_port(), free_port()
    config = {"detached_via": "idem_internal"}
    bootstrap = envoy_config(port, admin, upstream.port, config, internal_router=True,
                             extra_clusters=[static_cluster("upstream_b", upstream.port)],
                             virtual_hosts=routes())
    internal = bootstrap["static_resources"]["listeners"][1]
    hcm = internal["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, wasm_filter(config))
    envoy = Envoy(None, upstream.port, bootstrap=bootstrap)
    try:
        key = new_key("loop")
        first = post(envoy, key, path="/api/loop")
        assert first.status == 409, describe(first)
        assert upstream.effects(key) == 0
        wait_until(lambda: "answered 409 in-progress by an idempotency filter" in envoy.log_text(),
                   timeout=5, message="the warning")
        assert plugin_counters(envoy).get("released", 0) >= 1
        again = post(envoy, key, path="/api/loop")
        assert not is_replay(again), "the 409 was stored and replayed"
    finally:
        envoy.stop()
