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
