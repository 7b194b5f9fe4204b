"""A gRPC upstream (grpcio) that counts effects per idempotency key, and a raw-bytes client.

The service is `idem.Test/Pay`, messages are raw bytes (no protobuf schema needed). Request
metadata drives the answer, as tests/upstream.py's headers do:
  x-delay-ms: N        sleep N ms before answering (the effect is counted at arrival)
  x-grpc-status: N     fail with status N (`x-grpc-message` its text)
Every answer carries the trailing metadata x-cost: 7.
"""

import collections
import threading
import time
from concurrent import futures

import grpc

SERVICE, METHOD = "idem.Test", "Pay"


class GrpcUpstream:
    def __init__(self, port=0):
        self.lock = threading.Lock()
        self.effects = collections.Counter()
        self.metadata = collections.defaultdict(list)  # per key, each call's metadata
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        handler = grpc.unary_unary_rpc_method_handler(self._pay)
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler})])
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def _pay(self, request, context):
        meta = dict(context.invocation_metadata())
        key = meta.get("idempotency-key", "")
        with self.lock:
            self.effects[key] += 1
            n = self.effects[key]
            self.metadata[key].append(meta)
        time.sleep(int(meta.get("x-delay-ms", "0")) / 1000)
        context.set_trailing_metadata([("x-cost", "7")])
        status = meta.get("x-grpc-status")
        if status:
            code = next(c for c in grpc.StatusCode if c.value[0] == int(status))
            context.abort(code, meta.get("x-grpc-message", "failed"))
        return f"paid {key} #{n} for {request!r}".encode()

    def effects_of(self, key):
        with self.lock:
            return self.effects[key]

    def metadata_of(self, key):
        with self.lock:
            return [dict(m) for m in self.metadata[key]]

    def stop(self):
        self.server.stop(0)


def pay(port, key, body=b"amount=10", timeout=10, authority=None, **metadata):
    """One call through `port` (with `authority`, e.g. a fleet's one name for its API);
    returns (code, message or details, initial, trailing)."""
    options = [("grpc.default_authority", authority)] if authority else []
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        call = channel.unary_unary(f"/{SERVICE}/{METHOD}")
        md = [("idempotency-key", key), ("authorization", "Bearer alice")]
        md += [(k.replace("_", "-"), str(v)) for k, v in metadata.items()]
        try:
            response, c = call.with_call(body, metadata=md, timeout=timeout)
            return grpc.StatusCode.OK, response, dict(c.initial_metadata()), dict(c.trailing_metadata())
        except grpc.RpcError as e:
            return e.code(), e.details(), dict(e.initial_metadata() or ()), dict(e.trailing_metadata() or ())


def with_replay_loopback(bootstrap):
    """Adds the gRPC replay loopback to a bootstrap (docs/configuration.md, `grpc_replays`):
    a listener that answers every request by itself, a cluster to it, and the route for the
    replay path before the others."""
    from harness import free_port, static_cluster
    port = free_port()
    resources = bootstrap["static_resources"]
    resources["listeners"].append({
        "name": "idempotency_replay",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network."
                         "http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "idempotency_replay",
                "route_config": {"virtual_hosts": [{"name": "replay", "domains": ["*"], "routes": [
                    {"match": {"prefix": "/"},
                     "direct_response": {"status": 200, "body": {"inline_string": "x"}}}]}]},
                "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
            }}]}]})
    resources["clusters"].append(static_cluster("idempotency_replay", port))
    hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routes.insert(0, {"match": {"path": "/__idempotency/replay"},
                      "route": {"cluster": "idempotency_replay"}})
    return bootstrap
