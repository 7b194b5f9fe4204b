"""The reference in docs/ stays true: every metric the plugin defines and every configuration
field it accepts is documented (names read from the source, so a new one without docs fails)."""

import os
import re

from harness import REPO_ROOT


def read(*path):
    with open(os.path.join(REPO_ROOT, *path)) as f:
        return f.read()


def test_every_metric_is_in_operations_md():
    names = re.findall(r'=> "idempotency\.([a-z_]+)"', read("src", "metrics.rs"))
    assert len(names) > 20, names
    doc = read("docs", "operations.md")
    missing = [n for n in names if f"| `{n}` |" not in doc]
    assert not missing, f"metrics not in docs/operations.md: {missing}"


def test_every_configuration_field_is_in_configuration_md():
    source = read("src", "config.rs")
    fields = set(re.findall(r'^\s+"([a-z_]+)" => ', source, re.M))
    fields -= {"kind", "match", "prefix", "path", "route_name", "payload", "claim", "grpc",
               "json", "reject", "pass", "share", "wait", "detached", "router", "etcd", "loopback", "off",
               "shared_data", "enforce", "observe"}
    assert {"lease_ms", "fencing_header", "local_replays", "clusters"} <= fields, fields
    doc = read("docs", "configuration.md")
    missing = sorted(f for f in fields if f"`{f}`" not in doc)
    assert not missing, f"fields not in docs/configuration.md: {missing}"
