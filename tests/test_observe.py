"""`mode: "observe"` (docs/production.md, rollout): the plugin decides, counts and records as
enforcing would, and changes nothing on the wire. The same requests through an Envoy without
the plugin and through one with it in observe mode, each in front of its own upstream: the same
statuses, headers and bodies byte for byte, and the same upstream effects; the counters and the
access log say what enforcing would have answered."""

import re
import threading

from e2e_util import new_key, plugin_counters, post
from harness import Upstream, wait_until

VOLATILE = {"date", "x-envoy-upstream-service-time", "server"}


def scenario(envoy, upstream, keys):
    """The requests, in order; returns (status, headers, body) of each."""
    k1, k2, k3, k4 = keys
    out = []

    def send(*args, **kwargs):
        resp = post(envoy, *args, **kwargs)
        headers = sorted((n.lower(), v) for n, v in resp.headers if n.lower() not in VOLATILE)
        return resp.status, headers, resp.body

    out.append(send(k1))                                   # a first call
    out.append(send(k1))                                   # would be a replay
    slow = {}
    t = threading.Thread(target=lambda: slow.update(r=send(k2, extra={"x-delay-ms": "800"})))
    t.start()
    wait_until(lambda: upstream.effects(k2) == 1, timeout=5, message="the slow call upstream")
    out.append(send(k2, extra={"x-delay-ms": "800"}))      # would be a 409
    t.join()
    out.append(slow["r"])
    out.append(send(k1, body=b'{"amount":2}'))             # would be a 422
    out.append(send(None))                                 # would be a 400 (require_key)
    out.append(send(k3, body=b"x" * 100))                  # would be a 413
    out.append(send(k4, extra={"x-status": "500"}))        # released
    out.append(send(k4))                                   # a first call again
    return out


def test_observe_mode_changes_nothing_on_the_wire(make_envoy, wasm, tmp_path):
    keys = [new_key(f"k{i}") for i in range(4)]
    log = str(tmp_path / "access.log")
    with Upstream() as plain_up, Upstream() as observed_up:
        plain = make_envoy({}, plain_up.port, with_plugin=False)
        config = {"mode": "observe", "require_key": True, "max_request_body_bytes": 64,
                  "forward": "detached", "on_conflict": "wait", "fencing_header": "x-fence"}
        observed = make_envoy(config, observed_up.port, access_log=log)
        without = scenario(plain, plain_up, keys)
        with_plugin = scenario(observed, observed_up, keys)
        assert with_plugin == without, "\n".join(f"{a}\n{b}" for a, b in zip(without, with_plugin) if a != b)
        effects = (plain_up.effects(), observed_up.effects())
        assert effects[0] == effects[1], effects
    counters = plugin_counters(observed)
    for name, n in {"claimed": 4, "replayed": 1, "conflict": 1, "fingerprint_mismatch": 1,
                    "missing_key": 1, "too_large": 1, "released": 1, "completed": 3}.items():
        assert counters.get(name) == n, (name, counters)
    decisions = [re.search(r'idempotency="decision=([^ "]+)', line)[1] for line in open(log)]
    assert sorted(decisions) == sorted(["claimed", "replayed", "in-progress", "claimed", "key-reused",
                                        "missing-key", "body-too-large", "released", "claimed"]), decisions
    print("observe mode, decisions recorded:", decisions)
