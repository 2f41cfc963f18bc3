"""Notebook widgets: the live training dashboard (one row per rank, loss chart, comm timing) and
the rank tabs of a ``%%distributed`` cell's output (``_tabs``).

Front-end code, in the notebook kernel: imports ipywidgets, never a training framework. The
engine-side half of the dashboard's transport is :mod:`jupyter_ring.engines._publish`.
"""

__all__ = ["Dashboard", "DashboardState"]


def __getattr__(name: str) -> type:
    # Lazy: the magics import the rank tabs and .live when the extension loads, and ipywidgets
    # (~0.5 s) is imported only when a widget is shown (or in a thread during %ring start).
    if name == "Dashboard":
        from .dashboard import Dashboard

        return Dashboard
    if name == "DashboardState":
        from ._state import DashboardState

        return DashboardState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
