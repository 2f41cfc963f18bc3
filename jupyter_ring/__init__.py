"""jupyter_ring: interactive data-parallel training in Jupyter notebooks.

``%load_ext jupyter_ring`` adds the ``%ring`` and ``%%distributed`` magics. Importing this package
has no side effects: the magics, the cluster and the widgets are imported when first used.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__version__ = "0.1.0"

__all__ = ["__version__", "load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython: "InteractiveShell") -> None:
    """Register the magics (called by ``%load_ext jupyter_ring``)."""
    from .magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: "InteractiveShell") -> None:
    """Stop clusters started from this shell and remove the magics."""
    from .magics import unload_ipython_extension as unload

    unload(ipython)
