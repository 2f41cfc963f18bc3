"""Notebook widgets: the live training dashboard (one row per rank, loss chart, comm timing).

Front-end code: imports ipywidgets (and, in :mod:`.live`, ipyparallel when polling); never a
training framework. The engine-side half of the transport is :mod:`._publish`.
"""

__all__ = ["Dashboard", "DashboardState"]


def __getattr__(name):
    # Lazy: every rank imports ._publish at %ring start, and importing .dashboard (ipywidgets)
    # there cost each rank ~0.1-0.2 s of CPU for nothing.
    if name == "Dashboard":
        from .dashboard import Dashboard

        return Dashboard
    if name == "DashboardState":
        from ._state import DashboardState

        return DashboardState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
