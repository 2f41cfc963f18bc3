"""The lab extension's TypeScript unit tests (jest) and its packaging, run from pytest so that
CI (scripts/test.sh) covers them."""

import glob
import json
import os
import re
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


def _ui_strings(ts_source):
    """The quoted strings of a TypeScript file that read as text (a word, a space, more words):
    labels, messages, tooltips. Comments and template literals are left out."""
    text = re.sub(r"/\*.*?\*/", "", ts_source, flags=re.S)
    text = re.sub(r"`(?:[^`\\]|\\.)*`", "``", text, flags=re.S)
    found = set()
    for line in text.splitlines():
        for match in re.finditer(r"'([^'\\\n]*)'|\"([^\"\\\n]*)\"|//.*$", line):
            literal = match.group(1) if match.group(1) is not None else match.group(2)
            if literal and len(literal) >= 12 and re.fullmatch(r"[A-Za-z][\w .,:;!?()%/+-]* [\w .,:;!?()%/+-]+", literal):
                found.add(literal)
    return found


def test_built_package_matches_source():
    """The prebuilt extension the wheel ships is built from this source: the same package
    (name, version, its jupyterlab section), and every text the source shows users is in the
    bundle (a source change without a rebuild fails here; scripts/setup.sh rebuilds a stale one)."""
    built = os.path.join(LABEXT, "prebuilt", "package.json")
    if not os.path.exists(built):
        pytest.skip("labextension/prebuilt missing: run scripts/setup.sh")
    with open(built) as f:
        meta = json.load(f)
    with open(os.path.join(LABEXT, "package.json")) as f:
        source = json.load(f)
    assert (meta["name"], meta["version"]) == (source["name"], source["version"]) == ("jupyter-ring", meta["version"])
    assert {k: v for k, v in meta["jupyterlab"].items() if k != "_build"} == source["jupyterlab"]
    load = meta["jupyterlab"]["_build"]["load"]
    assert load.startswith("static/remoteEntry.") and os.path.exists(os.path.join(LABEXT, "prebuilt", load))
    bundle = "".join(open(path).read() for path in glob.glob(os.path.join(LABEXT, "prebuilt", "static", "*.js")))
    texts = set()
    for path in glob.glob(os.path.join(LABEXT, "src", "*.ts")):
        with open(path) as f:
            texts |= _ui_strings(f.read())
    assert len(texts) >= 10, f"too few texts found in labextension/src to compare: {sorted(texts)}"
    missing = sorted(t for t in texts if t not in bundle)
    assert not missing, f"in labextension/src but not in the prebuilt bundle (rebuild: scripts/setup.sh): {missing}"
