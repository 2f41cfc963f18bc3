"""Every name a benchmark imports from jupyter_ring exists: a refactor that moves a module must
move the benchmarks with it (overlap.py and hotpath.py still imported ``jupyter_ring._launch``
for a session after it became ``jupyter_ring.launch``, and failed at once when re-run)."""

import ast
import importlib
import pathlib

import pytest

BENCHMARKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def _imports(path):
    """``(module, name or None, line)`` for every import of jupyter_ring in ``path``, at any depth
    (benchmarks import inside functions, after parsing their arguments)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jupyter_ring"):
            for alias in node.names:
                yield node.module, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jupyter_ring"):
                    yield alias.name, None, node.lineno


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports_resolve(path):
    missing = []
    for module, name, line in _imports(path):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"line {line}: import {module}: {exc}")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"line {line}: from {module} import {name}: no such name")
    assert not missing, f"benchmarks/{path.name} imports what does not exist:\n" + "\n".join(missing)


def test_hotpath_measures_the_tree_it_is_in(tmp_path):
    """hotpath.py's "this tree" is the source tree holding the script, not whatever jupyter_ring
    is installed (the editable install is the main checkout's: a worktree's run measured main),
    and a run that imports jupyter_ring from elsewhere stops the benchmark."""
    import os
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "hotpath.py"), "--runs", "1"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"trees: this tree {root}\n" in proc.stdout, proc.stdout
    assert "| allreduce_ 4 KiB |" in proc.stdout, proc.stdout
