"""The lab extension's TypeScript unit tests (jest) and its packaging, run from pytest so that
CI (scripts/test.sh) covers them."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABEXT = os.path.join(ROOT, "labextension")
VENV_BIN = os.path.dirname(sys.executable)


def _jlpm():
    return shutil.which("jlpm", path=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))


@pytest.mark.skipif(not os.path.isdir(os.path.join(LABEXT, "node_modules")),
                    reason="labextension/node_modules missing: run scripts/setup.sh (jlpm install)")
def test_jest():
    jlpm = _jlpm()
    if jlpm is None or shutil.which("node") is None:
        pytest.skip("jlpm or node not found: the TypeScript tests need Node.js")
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""), CI="1")
    proc = subprocess.run([jlpm, "test", "--silent"], cwd=LABEXT, capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, f"jest failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"


def test_extension_is_installed_and_enabled():
    """`jupyter labextension list` shows jupyter-ring enabled and OK; the server extension too."""
    pytest.importorskip("jupyterlab")
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    # The user-level config dirs of the tests are empty temp dirs, so this sees the install itself.
    out = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"], env=env,
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    line = next((ln for ln in text.splitlines() if "jupyter-ring" in ln), None)
    assert line is not None, f"jupyter-ring not listed:\n{text}"
    assert "enabled" in line and "OK" in line, line
    out = subprocess.run([sys.executable, "-m", "jupyter", "server", "extension", "list"], env=env,
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert "jupyter_ring.server enabled" in " ".join(text.replace("\x1b[32m", "").replace(
        "\x1b[0m", "").split()), text


def test_built_package_matches_source():
    built = os.path.join(LABEXT, "prebuilt", "package.json")
    if not os.path.exists(built):
        pytest.skip("labextension/prebuilt missing: run scripts/setup.sh")
    with open(built) as f:
        meta = json.load(f)
    assert meta["name"] == "jupyter-ring"
    assert meta["jupyterlab"]["_build"]["load"].startswith("static/remoteEntry.")
