"""Every decision in Envoy's access log (docs/operations.md, "Decisions in the access log"): the
plugin hands each covered request's decision to Envoy as filter state `wasm.idempotency`, and
the access log line reads it with %FILTER_STATE(wasm.idempotency:PLAIN)%. A real Envoy's log,
for a first call, a replay, a 409, a 422, a release and a pass."""

import collections
import os
import re
import threading

import pytest

from e2e_util import new_key, post
from harness import wait_until

LINE = re.compile(r'"POST (?P<path>\S+) HTTP/1.1" (?P<status>\d+) \S+ \d+ idempotency="(?P<record>[^"]*)"')
KEYED = r"key=[0-9a-f]{12} store=shared store_ms=\d+"


def records(path):
    """{request path: [(status, record), …]} of the access log's lines, in order."""
    out = collections.defaultdict(list)
    if os.path.exists(path):
        with open(path) as f:
            for m in filter(None, map(LINE.search, f)):
                out[m["path"]].append((int(m["status"]), m["record"]))
    return out


@pytest.mark.parametrize("forward", ["detached", "router"])
def test_each_decision_is_in_the_access_log(upstream, make_envoy, wasm, tmp_path, forward):
    log = str(tmp_path / "access.log")
    config = {"forward": forward, "missing_scope": "pass", "fencing_header": "x-fence"}
    envoy = make_envoy(config, upstream.port, access_log=log)
    first, slow, release = new_key("first"), new_key("slow"), new_key("release")
    post(envoy, first, path="/p/first")
    post(envoy, first, path="/p/first")  # a replay
    held = threading.Thread(target=post, args=(envoy, slow),
                            kwargs={"path": "/p/slow", "extra": {"x-delay-ms": "1500"}})
    held.start()
    wait_until(lambda: upstream.effects(slow) == 1, timeout=5, message="the slow call upstream")
    post(envoy, slow, path="/p/slow", extra={"x-delay-ms": "1500"})  # a 409
    held.join()
    post(envoy, first, path="/p/first", body=b'{"amount":2}')  # a 422
    post(envoy, release, path="/p/release", extra={"x-status": "500"})
    post(envoy, new_key("pass"), path="/p/pass", extra={"authorization": None})

    want = {
        "/p/first": [(201, rf"decision=claimed {KEYED} fence=\d+"), (201, rf"decision=replayed {KEYED}"),
                     (422, rf"decision=key-reused {KEYED}")],
        # The 409 is answered (and logged) while the first call still runs.
        "/p/slow": [(409, rf"decision=in-progress {KEYED}"), (201, rf"decision=claimed {KEYED} fence=\d+")],
        "/p/release": [(500, rf"decision=released {KEYED} fence=\d+")],
        "/p/pass": [(201, r"decision=pass-scope-missing")],
    }
    wait_until(lambda: all(len(records(log)[p]) == len(w) for p, w in want.items()), timeout=10,
               message="every request in the access log")
    got = records(log)
    for path, lines in want.items():
        for (status, pattern), (got_status, record) in zip(lines, got[path]):
            assert got_status == status and re.fullmatch(pattern, record), (path, got[path])
    # One key, one store key: the first call, its replay and the 422 name the same.
    assert len({re.search(r"key=(\w+)", r)[1] for _, r in got["/p/first"]}) == 1, got["/p/first"]
    with open(log) as f:
        print(f.read())


class SpanCollector:
    """A Zipkin collector on a free port: keeps the spans Envoy posts (JSON v2)."""

    def __init__(self):
        import http.server
        import json
        spans = self.spans = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    body = b""
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        body += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                else:
                    body = self.rfile.read(int(self.headers.get("content-length", 0)))
                spans.extend(json.loads(body or b"[]"))
                self.send_response(202)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_the_decision_goes_on_the_span_as_a_custom_tag(upstream, make_envoy, wasm):
    """Envoy 1.37+ takes an access-log format in a tracing custom tag: the span of each request
    carries the decision. A real Envoy, its Zipkin tracer, and a collector that keeps the spans."""
    from harness import static_cluster
    collector = SpanCollector()
    try:
        tracing = {"tracing": {
            "random_sampling": {"value": 100},
            "custom_tags": [{"tag": "idempotency", "value": "%FILTER_STATE(wasm.idempotency:PLAIN)%"}],
            "provider": {"name": "envoy.tracers.zipkin", "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
                "collector_cluster": "zipkin", "collector_endpoint": "/api/v2/spans",
                "collector_endpoint_version": "HTTP_JSON"}}}}
        envoy = make_envoy({}, upstream.port, hcm_extra=tracing,
                           extra_clusters=[static_cluster("zipkin", collector.port)])
        key = new_key("span")
        post(envoy, key, path="/p/span")
        post(envoy, key, path="/p/span")
        # Zipkin spans go out in batches, at the latest every 5 s.
        try:
            wait_until(lambda: len([s for s in collector.spans if "idempotency" in s.get("tags", {})]) >= 2,
                       timeout=15, message="two spans with the tag")
        except TimeoutError:
            print("spans:", collector.spans, envoy.stats_matching("zipkin"))
            raise
        tags = [s["tags"]["idempotency"] for s in collector.spans if "idempotency" in s.get("tags", {})]
        # Spans go out in batches per worker: in any order.
        assert sorted(t.split()[0] for t in tags) == ["decision=claimed", "decision=replayed"], tags
        print("span tags:", tags)
    finally:
        collector.close()
