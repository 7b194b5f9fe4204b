"""Fixtures for the end-to-end tests: an effect-counting upstream and Envoys that clean up."""

import os
import re

import pytest

import envoy_versions
from harness import Envoy, Upstream, wasm_path


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "every_envoy: the core set, run on every Envoy the docs claim (tests/README.md)")


def pytest_generate_tests(metafunc):
    """A test marked `every_envoy` runs once per Envoy: the project's own, then each older one
    (envoy_versions.VERSIONS)."""
    if metafunc.definition.get_closest_marker("every_envoy"):
        versions = ["own"] + envoy_versions.VERSIONS
        metafunc.parametrize("envoy_version", versions, indirect=True, ids=[f"envoy-{v}" for v in versions])


@pytest.fixture(autouse=True)
def envoy_version(request, monkeypatch):
    """The Envoy this test runs: harness.Envoy starts $ENVOY_BIN when set."""
    version = getattr(request, "param", "own")
    if version != "own":
        monkeypatch.setenv("ENVOY_BIN", envoy_versions.envoy_venv(version))
    return version


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


@pytest.fixture(scope="session")
def previous_wasm():
    """The previous release's plugin (compat/previous-release), built by `make previous`."""
    path = os.path.join(os.path.dirname(wasm_path()), "idempotency-previous.wasm")
    if not os.path.isfile(path):
        pytest.fail(f"previous release not found at {path}: run make previous", pytrace=False)
    return path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the item, so fixtures can tell a failed test at teardown."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, "rep_" + report.when, report)


@pytest.fixture
def make_envoy(request):
    """make_envoy(plugin_config, upstream_port, **kwargs) -> Envoy, stopped at teardown.

    When the test failed, the tail of each Envoy's log is printed (pytest shows it with the
    failure, under "Captured stdout teardown").
    """
    started = []

    def make(plugin_config, upstream_port, **kwargs):
        envoy = Envoy(plugin_config, upstream_port, **kwargs)
        started.append(envoy)
        return envoy

    yield make
    for envoy in started:
        envoy.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for envoy in started:
            # The plugin's lines and Envoy's warnings, not the start-up banner.
            lines = [line for line in envoy.log_text().splitlines()
                     if re.search(r"\]\[(wasm|warning|error|critical)\]", line)]
            print(f"--- envoy {envoy.port} log (wasm, warnings, errors) ---\n"
                  + "\n".join(lines[-80:]))
