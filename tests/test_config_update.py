"""A configuration update while work is in flight (docs/behaviour.md §3.8). The plugin's configuration comes
over ECDS (from a file, as istiod would send it); a new one replaces the old root context.
A detached call still running for a client that already left must still be stored: its
retry is the replay, one effect."""

import json
import os
import time

from e2e_util import key_headers, new_key, plugin_counters, post
from harness import abandon, wait_until, wasm_filter

NAME = "idempotency-ecds"


def ecds_filter(path):
    return {"name": NAME, "config_discovery": {
        "config_source": {"path_config_source": {"path": path}, "resource_api_version": "V3"},
        "type_urls": ["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"]}}


def write_ecds(path, plugin_config, wasm=None):
    """Replaces the ECDS file at once (a rename: Envoy watches for moves into place);
    `wasm`: the plugin's file (this build's by default)."""
    resource = {"@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                "name": NAME, "typed_config": wasm_filter(plugin_config, wasm=wasm)["typed_config"]}
    with open(path + ".new", "w") as f:
        json.dump({"resources": [resource]}, f)
    os.replace(path + ".new", path)


def test_a_detached_call_in_flight_survives_a_configuration_update(upstream, make_envoy, wasm,
                                                                    tmp_path):
    ecds = str(tmp_path / "ecds.json")
    write_ecds(ecds, {"lease_ms": 3000, "retry_after_s": 1})
    envoy = make_envoy(None, upstream.port, with_plugin=False, extra_filters=[ecds_filter(ecds)],
                       node={"id": "gateway", "cluster": "gateway"})
    reloads = f"extension_config_discovery.http_filter.{NAME}.config_reload"
    wait_until(lambda: envoy.stat(reloads) >= 1, timeout=10, message="the first configuration")
    key = new_key("update")
    held = {"x-hold": "update"}
    # The client gives up while its call runs upstream; then the configuration changes.
    abandon(envoy.port, "POST", "/payments", key_headers(key, held), b'{"amount":1}', after_s=0.3)
    wait_until(lambda: upstream.effects(key) == 1, timeout=5, message="the call upstream")
    write_ecds(ecds, {"lease_ms": 3000, "retry_after_s": 2})
    wait_until(lambda: envoy.stat(reloads) >= 2, timeout=10, message="the new configuration")
    time.sleep(0.5)
    upstream.release("update")
    wait_until(lambda: upstream.log()[-1]["outcome"] != "pending", timeout=5,
               message="the upstream's answer")
    # Past the old mark's lease: had the answer been lost, the retry would run again.
    time.sleep(3.5)
    first_answer = upstream.log()[-1]
    retry = post(envoy.port, key, extra=held)
    again = post(envoy.port, key, extra=held)
    assert retry.status == 201 and retry.header("idempotent-replayed") == "true", retry.body
    assert again.header("idempotent-replayed") == "true" and again.body == retry.body
    assert upstream.effects(key) == 1, upstream.log()[-3:]
    assert first_answer["outcome"] == "answered"
    assert plugin_counters(envoy)["completed"] == 1
    envoy.wait_log(r"root replaced; finishing the calls and writes in flight first")
