"""The live training dashboard: a row per rank, a loss chart of all ranks, communication timing.

Plain ipywidgets (HTML, y-axis buttons) holding the HTML and SVG of the static view
(``_render``): no JavaScript of its own, so it shows in JupyterLab 4, Notebook 7 and VS Code
without a build step; and it looks as its static view does (rows, bars, colours, heights), so
the output does not move when the cell ends and the widget is replaced by that view::

    from jupyter_ring.widgets import Dashboard

    dash = Dashboard(ranks=2)
    dash.display()                      # live
    dash.state.ingest(0, snapshot)      # snapshots from the ranks (see LiveDashboard)
    dash.refresh()
    dash.freeze()                       # final: the output becomes static HTML

The widget's mime bundle also carries ``text/html`` and ``text/plain`` renderings, and
``freeze()`` replaces the displayed widget by its final HTML, so a saved notebook reopened
without a kernel still shows the dashboard.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ipywidgets as widgets

from ._render import (STYLE, chart_series, log_possible, render_banner, render_chart, render_comm,
                      render_html, render_rows, render_title)
from ._state import DashboardState

__all__ = ["Dashboard", "DashboardState"]


# ipywidgets ships no annotations: its widgets are Any here, so is what they hold or return
class Dashboard(widgets.VBox):  # type: ignore[misc]  # (subclassing an unannotated class)
    """Live per-rank progress, metrics, a loss chart and comm timing, drawn from a DashboardState.

    ``ranks`` (a count or a list) sizes a new state; pass ``state`` to draw an existing one.
    Call :meth:`refresh` after ingesting snapshots and :meth:`freeze` when the run is over.
    """

    def __init__(self, ranks: int | Iterable[int] = (), state: DashboardState | None = None,
                 title: str = "jupyter_ring training", **kwargs: Any) -> None:
        self.state = state if state is not None else DashboardState(ranks)
        self.title = title
        self._header = widgets.HTML(STYLE + render_title(title))
        self._banner = widgets.HTML("")
        # the rows are the static view's own table (render_rows): bars, colours and heights
        # stay as they are when the cell ends and the widget becomes that static view
        self._rows = widgets.HTML("")
        # The chart at both scales, one shown: the buttons switch them in the browser (jslink),
        # because a click reaches the kernel only after the running cell (the shell is busy).
        self._chart_linear = widgets.HTML("")
        self._chart_log = widgets.HTML("")
        self._chart = widgets.Stack([self._chart_linear, self._chart_log], selected_index=0)
        self._scale = widgets.ToggleButtons(
            options=[("linear", "linear"), ("log", "log")], value="linear", description="y-axis",
            tooltips=["linear y-axis", "logarithmic y-axis (values > 0)"],
            style={"button_width": "64px", "description_width": "48px"},
            layout=widgets.Layout(display="none", margin="4px 0 0 0"))
        self._scale.add_class("jr-scale")
        self._link = widgets.jslink((self._scale, "index"), (self._chart, "selected_index"))
        self._scale_shown: str | None = None  # the scale last set from here (the data's, or a known pick)
        self._scale_syncing = False
        self._scale.observe(self._scale_picked, names="value")
        self._comm = widgets.HTML("")
        self._drawn: int | None = None
        self._chart_drawn: int | None = None
        self._handle: Any = None  # IPython's DisplayHandle
        super().__init__([self._header, self._banner, self._rows, self._scale, self._chart,
                          self._comm], **kwargs)
        self.add_class("jr-dash")
        self.add_class("jr-dashboard")
        self.refresh()

    def refresh(self, chart: bool = True) -> None:
        """Redraw from the state (nothing when it has not changed); ``chart=False`` keeps the
        chart as drawn (it is the costly part: the live dashboard redraws it less often)."""
        state = self.state
        if self._drawn == state.version and (not chart or self._chart_drawn == state.version):
            return
        self._drawn = state.version
        self._rows.value = render_rows(state)
        self._banner.value = render_banner(state)
        if chart and self._chart_drawn != state.version:
            self._chart_drawn = state.version
            drawn = chart_series(state)
            self._chart_linear.value = render_chart(state, drawn=drawn, scale="linear")
            log = log_possible(drawn)
            self._chart_log.value = render_chart(state, drawn=drawn, scale="log") if log else ""
            self._sync_scale(drawn.scale if drawn is not None and log else None)
        self._comm.value = render_comm(state)

    def _sync_scale(self, scale: str | None) -> None:
        """Show the buttons while both scales can be drawn; set them only when the scale the data
        asks for changes (a loss that comes to span decades), not over a pick the kernel has
        not heard of yet."""
        self._scale.layout.display = "flex" if scale else "none"
        wanted = scale or "linear"
        if wanted != self._scale_shown:
            self._scale_shown = wanted
            self._scale_syncing = True
            try:
                self._scale.value = wanted
                self._chart.selected_index = self._scale.index
            finally:
                self._scale_syncing = False

    def _scale_picked(self, change: dict[str, Any]) -> None:
        """A pick heard by the kernel (after the cell, or between its polls): it holds from now on."""
        if self._scale_syncing or self.state.frozen:
            return
        self.state.set_y_scale(change["new"])
        self._scale_shown = change["new"]
        self._chart.selected_index = self._scale.index

    def to_html(self) -> str:
        """The dashboard as static HTML (what a notebook reopened without a kernel shows)."""
        return render_html(self.state, self.title)

    def display(self) -> Any:
        """Show the dashboard in the notebook; ``freeze()`` later replaces it by static HTML."""
        from IPython.display import display

        self._handle = display(self, display_id=True)
        return self._handle

    def freeze(self, outcomes: dict[int, str] | None = None) -> None:
        """Final state: no more snapshots; a displayed dashboard becomes its static HTML.
        ``outcomes``: how the cell ended on ranks where it did not end well (see
        ``DashboardState.freeze``)."""
        if not self.state.frozen:  # another view of the state may have frozen it
            self.state.freeze(outcomes)
        self.refresh()
        if self._handle is not None:
            self._handle.update(self._static_bundle(), raw=True)
            self._handle = None
            _close_tree(self)  # the widget models are no longer shown anywhere
            self._link.close()

    def _static_bundle(self) -> dict[str, str]:
        return {"text/html": self.to_html(), "text/plain": self.state.summary()}

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle: dict[str, Any] = super()._repr_mimebundle_(**kwargs) or {}
        # Frontends without the widget model (saved notebook, nbconvert) fall back to these.
        bundle.update(self._static_bundle())
        return bundle


def _close_tree(widget: Any) -> None:
    for child in getattr(widget, "children", ()):
        _close_tree(child)
    widget.close()
