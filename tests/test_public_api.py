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
