"""Notebook widgets: the live training dashboard (one row per rank, loss chart, comm timing).

Front-end code: imports ipywidgets (and, in :mod:`.live`, ipyparallel when polling); never a
training framework. The engine-side half of the transport is :mod:`._publish`.
"""

from ._state import DashboardState
from .dashboard import Dashboard

__all__ = ["Dashboard", "DashboardState"]
