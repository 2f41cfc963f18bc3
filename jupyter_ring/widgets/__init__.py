"""Notebook widgets: the live training dashboard (one row per rank, loss chart, comm timing)."""

from ._state import DashboardState

__all__ = ["DashboardState"]
