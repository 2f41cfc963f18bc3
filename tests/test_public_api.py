"""Every public module says what it exports, exactly (after httpx's ``test_exported_members``).

A public module is one whose dotted name has no part starting with ``_``. Its ``__all__`` must
name only what exists, and every public name the module's own source defines must be in it: a
helper that is not meant for users starts with ``_``.
"""

import ast
import importlib
import inspect
import logging
import pkgutil

import pytest

import jupyter_ring


def _public_modules():
    names = ["jupyter_ring"]
    for info in pkgutil.walk_packages(jupyter_ring.__path__, "jupyter_ring."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


PUBLIC = _public_modules()


def _defined_here(module):
    """Public names the module's own source binds at top level (def, class, assignment), but not
    its logger. Names it imports are not required: a package's ``__all__`` lists its re-exports,
    and the check that every listed name exists covers them."""
    tree = ast.parse(inspect.getsource(module))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")
            and not isinstance(getattr(module, n, None), logging.Logger)}


def test_the_public_modules_are_the_ones_meant():
    assert {"jupyter_ring", "jupyter_ring.errors", "jupyter_ring.launch", "jupyter_ring.magics",
            "jupyter_ring.cluster", "jupyter_ring.engines", "jupyter_ring.widgets",
            "jupyter_ring.widgets.live", "jupyter_ring.server", "jupyter_ring.runtime"} <= set(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_all_is_exactly_what_the_module_exports(name):
    framework = next((part for part in name.split(".")[2:3] if part in ("tensorflow", "keras", "cupy")), None)
    if name.startswith("jupyter_ring.runtime.") and framework:  # the package and its modules
        pytest.importorskip({"cupy": "cupy"}.get(framework, "tensorflow"))
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert len(exported) == len(set(exported)), f"{name}.__all__ names something twice"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what the module does not have: {missing}"
    unlisted = sorted(_defined_here(module) - set(exported))
    assert not unlisted, (f"{name} defines public names missing from __all__: {unlisted} "
                          "(export them, or start their names with _)")


def _imported_modules(path, package):
    """Every ``jupyter_ring...`` name imported by the file at ``path`` (relative imports resolved
    against ``package``, its dotted package), with each ``from X import Y`` also as ``X.Y``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found += [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [name for name in found if name.startswith("jupyter_ring.")]


@pytest.mark.parametrize("room", ["engines", "server", "runtime"])
def test_a_room_reaches_no_private_module_of_another(room):
    """The ranks' side (engines/), the Jupyter server's routes (server/) and the runtime use another
    package only through what its ``__init__`` exports (docs/architecture.md, "The runtime's
    rooms"): no ``jupyter_ring.<other>._module``."""
    import pathlib

    top = pathlib.Path(jupyter_ring.__file__).parent
    reaching = []
    for path in sorted((top / room).rglob("*.py")):
        parts = path.relative_to(top.parent).with_suffix("").parts
        package = ".".join(parts if parts[-1] == "__init__" else parts[:-1])
        for name in _imported_modules(path, package):
            other = name.split(".")
            if other[1] != room and any(p.startswith("_") and not p.startswith("__") for p in other[2:]):
                reaching.append(f"{path.relative_to(top)}: {name}")
    assert not reaching, "\n".join(reaching)
