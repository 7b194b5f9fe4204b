#!/usr/bin/env python3
"""What loading a configuration costs the plugin: the Wasm fuel (about one unit per Wasm
instruction) of `proxy_on_configure` for configurations of the corpus, and the `.wasm` size,
for one or more builds side by side (wasmtime, the host of bench/abi_count.py).

  .venv/bin/python bench/config_cost.py dist/idempotency.wasm [other.wasm ...]

on_configure also creates the shared-data table (one host call per bucket) and registers the
queue; `{}` shows that floor, the others what their parsing adds to it."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from abi_count import Host  # noqa: E402

CORPUS = os.path.join(os.path.dirname(__file__), "..", "tests", "config_corpus")
CONFIGS = ["002-ddc6423-tests-test-misconfig-py.json",  # {}
           "004-1792fa3-readme-md.json",                 # routes, JWT scope
           "006-fd7ef29-envoy-istio-envoyfilter-stop-iteration-y.json",  # every policy field
           "040-b7f6fdb-envoy-envoy-fleet-yaml.json"]    # etcd, two clusters


def fuel(wasm, config):
    host = Host(wasm, config)
    return host.fuel["proxy_on_configure"]


def main():
    builds = sys.argv[1:] or ["dist/idempotency.wasm"]
    print("| configuration | " + " | ".join(os.path.basename(b) for b in builds) + " |")
    print("|---|" + "---:|" * len(builds))
    print("| `.wasm` bytes | " + " | ".join(f"{os.path.getsize(b):,}" for b in builds) + " |")
    for name in CONFIGS:
        with open(os.path.join(CORPUS, name)) as f:
            config = json.load(f)
        print(f"| fuel of on_configure, {name[:3]} | " + " | ".join(f"{fuel(b, config):,}" for b in builds) + " |")


if __name__ == "__main__":
    main()
