"""The notebook side of the live dashboard: read rank snapshots from an AsyncResult, draw them.

Wiring into a front end (what ``%ring start`` and ``%%distributed`` do)::

    from jupyter_ring.widgets.live import ENGINE_SETUP, LiveDashboard

    view.execute(ENGINE_SETUP, block=True)           # once per cluster, after ring.init()

    ar = view.execute(cell, block=False)
    live = LiveDashboard(ranks)                      # shows itself on the first snapshot
    while not ar.wait(0.1):                          # %%distributed: also on each data message
        live.poll(ar)                                # cheap; redraws at most 5 times a second
    ar.wait_for_output(2.0)
    live.finish(ar)                                  # last snapshots, then static final HTML

A dashboard shows once a rank reports work in the cell: a step (``ring.progress(n)`` with
n != 0, a ``ring.track`` iteration, an optimizer step), a metric (``ring.log``) or a stall. A
cell that only sets a total, runs collectives or prints shows none. ``ar`` may cover any subset
of the ranks: snapshots name their rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Literal

from ..engines._publish import KEY_PREFIX
from ._state import DashboardState, reports_work
from .dashboard import Dashboard

__all__ = ["ENGINE_SETUP", "LiveDashboard", "take_snapshots", "has_snapshots", "discard_snapshots",
           "set_publishing"]

ENGINE_SETUP = """\
import jupyter_ring.engines._publish as _jr_publish
_jr_publish.install()
del _jr_publish
"""
"""Run once on every engine after ``ring.init()``: installs the datapub publisher of snapshots."""


def take_snapshots(data: dict[Any, Any]) -> list[tuple[int, dict[str, Any]]]:
    """Pop every snapshot from one engine's datapub dict; return ``[(seq, snapshot)]`` in order.

    ipyparallel's IO thread may add keys meanwhile: ``list(data)`` copies the keys in one step
    (under the GIL), and a key added after the copy stays for the next call.
    """
    out: list[tuple[int, dict[str, Any]]] = []
    for key in list(data):
        if isinstance(key, str) and key.startswith(KEY_PREFIX):
            snapshot = data.pop(key, None)
            if isinstance(snapshot, dict):
                try:
                    seq = int(key[len(KEY_PREFIX):])
                except ValueError:
                    continue
                out.append((seq, snapshot))
    out.sort(key=lambda item: item[0])
    return out


def has_snapshots(ar: object, work: bool = False) -> bool:
    """Whether any rank has published a snapshot into ``ar`` not yet taken (``work``: one that
    reports work, see ``_state.reports_work``); safe while ipyparallel's IO thread adds keys:
    each dict's keys are copied in one step."""
    for data in _data_dicts(ar):
        for key in list(data):
            if isinstance(key, str) and key.startswith(KEY_PREFIX):
                snapshot = data.get(key)
                if not work or (isinstance(snapshot, dict) and reports_work(snapshot)):
                    return True
    return False


def discard_snapshots(ar: object) -> int:
    """Drop the snapshots in ``ar`` (a ``--no-dashboard`` cell: they would pile up in the
    client's metadata for the rest of the session). Returns how many."""
    return sum(len(take_snapshots(data)) for data in _data_dicts(ar))


def _data_dicts(ar: Any) -> list[dict[Any, Any]]:
    """Each engine's live datapub dict of an ipyparallel AsyncResult (its public ``data``: the
    dicts themselves, not copies), or of a dict or list of dicts."""
    if isinstance(ar, dict):
        return [ar]
    if isinstance(ar, (list, tuple)):
        return [d for d in ar if isinstance(d, dict)]
    data = ar.data
    return [data] if isinstance(data, dict) else [d for d in data if isinstance(d, dict)]


_cpu_time = time.thread_time  # the CPU the notebook's thread spends on a redraw (tests replace it)


class LiveDashboard:
    """A :class:`Dashboard` fed from the ranks' snapshots in an AsyncResult's ``data``.

    ``ranks``: the number of ranks or the list of ranks the cell runs on. ``display``: show the
    dashboard in the notebook when the first snapshot arrives (False: only keep the state, e.g.
    for a benchmark). ``min_interval``: least seconds between two redraws of the rows;
    ``chart_interval``: of the chart. By default (None) the chart is redrawn with the rows as long
    as its redraws take at most ``CHART_CPU_SHARE`` of a core (measured on each redraw), and less
    often when they would take more, at least once a second: on a machine whose cores all run
    ranks, the notebook's CPU time is taken from the ranks, and the chart is most of it. So the
    chart keeps up with the progress bar where it is cheap, and trails it by at most a second
    where it is not.
    """

    CHART_CPU_SHARE = 0.01
    CHART_MAX_INTERVAL = 1.0

    def __init__(self, ranks: int | Iterable[int], display: bool = True, min_interval: float = 0.2,
                 chart_interval: float | None = None, title: str = "jupyter_ring training") -> None:
        self.dashboard = Dashboard(ranks=ranks, title=title)
        self.state = self.dashboard.state
        self.display = display
        self.min_interval = min_interval
        self.chart_interval = chart_interval
        self._last_chart = -float("inf")
        self._chart_cost = 0.0     # CPU seconds of the last redraw with the chart
        self.shown = False
        self.received = 0          # snapshots ingested
        self._last_draw = -float("inf")
        self._stale = False        # ingested since the last redraw
        self.views: list[Dashboard] = [self.dashboard]  # and more, shown again for a reopened page (attach)

    def poll(self, ar: object, force: bool = False) -> int:
        """Ingest new snapshots from ``ar``; redraw if due. Returns how many were ingested."""
        n = 0
        for data in _data_dicts(ar):
            for seq, snapshot in take_snapshots(data):
                rank = snapshot.get("rank")
                if isinstance(rank, int):
                    self.state.ingest(rank, snapshot, seq=seq)
                    n += 1
        self.received += n
        self._stale = self._stale or n > 0
        now = time.monotonic()
        if self._stale and (force or now - self._last_draw >= self.min_interval):
            self._draw(now)
        return n

    def new_engines(self, ranks: Iterable[int], how: Literal["replaced", "joined"]) -> None:
        """New engines took ``ranks`` while the cell runs (``how``: "replaced", a dead engine's
        place; "joined", host discovery grew the world): their rows say so, and their snapshots,
        numbered afresh, are taken from now on (see ``DashboardState.replaced``/``joined``).
        Poll the old engines' last snapshots first: the AsyncResult made for the new ones has
        none of the dead one's."""
        if how not in ("replaced", "joined"):
            raise ValueError(f"new engines took ranks as 'replaced' or 'joined', got {how!r}")
        for rank in ranks:
            if how == "replaced":
                self.state.replaced(rank)
            else:
                self.state.joined(rank)
        self._stale = True

    def _draw(self, now: float, final: bool = False) -> None:
        self._stale = False
        self._last_draw = now
        chart = final or now - self._last_chart >= self.current_chart_interval()
        if chart:
            self._last_chart = now
            cpu = _cpu_time()
            for view in self.views:
                view.refresh(chart=True)
            self._chart_cost = _cpu_time() - cpu
        else:
            for view in self.views:
                view.refresh(chart=False)
        if self.display and not self.shown and self.state.reported_work():
            self.shown = True
            self.dashboard.display()

    def attach(self) -> None:
        """Show the dashboard again, as a new widget drawn from the same state (a notebook
        reopened while the cell runs asked for its live view: see ``jupyter_ring._live``);
        nothing before it is first shown, which then reaches the page as it comes."""
        if not self.shown or self.state.frozen:
            return
        view = Dashboard(state=self.state, title=self.dashboard.title)
        self.views.append(view)
        view.display()

    def current_chart_interval(self) -> float:
        """Least seconds between two redraws of the chart now: ``chart_interval`` if set, else
        what keeps the chart's redraws within ``CHART_CPU_SHARE`` of a core (never below the
        rows' ``min_interval``, never above ``CHART_MAX_INTERVAL``)."""
        if self.chart_interval is not None:
            return self.chart_interval
        return min(self.CHART_MAX_INTERVAL,
                   max(self.min_interval, self._chart_cost / self.CHART_CPU_SHARE))

    def finish(self, ar: object = None, outcomes: dict[int, str] | None = None) -> DashboardState:
        """Read the last snapshots, then freeze: the output becomes the final static HTML.

        ``outcomes`` {rank: "interrupted" | "stalled" | "failed" | "died" | "no reply"}: ranks
        where the cell did not end well, shown so at their last step (the others are "done")."""
        if ar is not None:
            done = getattr(ar, "done", None)
            if done is not None and done() and hasattr(ar, "wait_for_output"):
                try:
                    ar.wait_for_output(1.0)
                except Exception:  # output already complete, or the client is closing
                    pass
            self.poll(ar, force=True)
        self._draw(time.monotonic(), final=True)
        for view in self.views:
            view.freeze(outcomes)
        return self.state

    def to_html(self) -> str:
        """The dashboard's current static HTML."""
        return self.dashboard.to_html()


def set_publishing(view: Any, enabled: bool) -> Any:
    """Pause or resume the ranks' snapshots (``--no-dashboard``): a quick apply on ``view``."""
    from ..engines._publish import enable

    return view.apply_sync(enable, bool(enabled))
