"""Fixtures for the end-to-end tests: an effect-counting upstream and Envoys that clean up."""

import os

import pytest

from harness import Envoy, Upstream, wasm_path


@pytest.fixture
def upstream():
    with Upstream() as up:
        yield up


@pytest.fixture(scope="session")
def wasm():
    """The plugin's path; tests that load the plugin request this fixture.

    Not autouse: the harness's own tests run without the plugin, before it is built.
    """
    path = wasm_path()
    if not os.path.isfile(path):
        pytest.fail(f"plugin not found at {path}: run make build first "
                    f"(or set IDEM_WASM to the .wasm file)", pytrace=False)
    return path


@pytest.fixture
def make_envoy():
    """make_envoy(plugin_config, upstream_port, **kwargs) -> Envoy, stopped at teardown."""
    started = []

    def make(plugin_config, upstream_port, **kwargs):
        envoy = Envoy(plugin_config, upstream_port, **kwargs)
        started.append(envoy)
        return envoy

    yield make
    for envoy in started:
        envoy.stop()
