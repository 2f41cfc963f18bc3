"""What a ``%%distributed`` cell shows while it runs: the ranks' text, rich outputs and results
(:class:`CellOutput`), and the live dashboard (:class:`CellDashboard`).

Each rank's iopub messages reach :class:`jupyter_ring._ipp.CellExecution` on ipyparallel's IO
thread; the cell's loop (:class:`jupyter_ring._cell.CellRun`) hands them here in order. Stream
text is cut into whole lines (each rank's and stream's last partial line held back until its
newline or the end) and given to the sink (rank tabs or tagged text), rich outputs as they come,
results at the end.
"""

import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from . import _live
from ._ipp import CellExecution
from .errors import _ename
from .runtime.internal import MARK

if TYPE_CHECKING:  # the front end's modules import this one
    from .cluster import RingCluster
    from .widgets._tabs import RankTabs, TextSink
    from .widgets.live import LiveDashboard

__all__ = ["CellOutput", "CellDashboard", "TICK"]

# Seconds between the loop's wake-ups when nothing arrives: output wakes it at once; this is for
# redraws that were throttled (rank tabs every 0.1 s) and for the clock's deadlines.
TICK = 0.1

# Before a rank's debugger prompt is asked, the seconds its output may take to come (it is
# waited for only until the prompt's mark comes behind it: milliseconds).
_SETTLE_MAX = 1.0

# Seconds between two looks for a reopened notebook's request for the cell's live view (_live).
_ATTACH_EVERY = 0.25

# A carriage return not followed by a newline rewrites the line (progress bars): keep what comes
# after the last one, as a terminal (and ipyparallel's own output buffer) does.
_CR = re.compile(r".*\r(?=[^\n])")


class CellOutput:
    """The output of one cell on ``ranks``, shown through ``sink``; with ``only_rank`` only that
    rank's printed text (errors still come from every rank). ``execution`` is set once the
    cell's requests are sent."""

    def __init__(self, ranks: list[int], sink: "RankTabs | TextSink", only_rank: int | None) -> None:
        self.ranks = ranks
        self.sink = sink
        self.only_rank = only_rank
        self.execution: CellExecution | None = None
        self.partial: dict[tuple[int, str], str] = {}  # (rank, stream) -> text after the last newline, not shown yet
        self.results: dict[int, dict[str, Any]] = {}   # rank -> execute_result content (shown after the output)
        self.marks: dict[int, int] = {}  # rank -> seq of the last debugger prompt mark that came

    def _execution(self) -> CellExecution:
        if self.execution is None:
            raise RuntimeError("the cell's output was read before its requests were sent")
        return self.execution

    def deliver(self, final: bool = False) -> None:
        """Hand what arrived to the sink; ``final``: the partial last lines too."""
        for rank, kind, content in self._execution().take():
            if kind == "stream":
                if self.only_rank is None or rank == self.only_rank:
                    self._stream_text(rank, content["name"], content["text"])
            elif kind == "display_data":
                mark = (content.get("data") or {}).get(MARK)
                if mark is not None:  # not output: a debugger prompt's mark (before_prompt)
                    self.marks[rank] = max(self.marks.get(rank, 0), int(mark.get("seq", 0)))
                    continue
                metadata = dict(content.get("metadata") or {})
                metadata["jupyter_ring_rank"] = rank
                self.sink.display(rank, content.get("data") or {}, metadata)
            elif kind == "execute_result":
                self.results[rank] = content
        if final:
            partial, self.partial = self.partial, {}
            for (rank, name), rest in partial.items():
                if rest:
                    self.sink.text(rank, name, [_CR.sub("", rest)])

    def _stream_text(self, rank: int, name: str, text: str) -> None:
        key = (rank, name)
        lines = (self.partial.get(key, "") + text).split("\n")
        # after the last newline: held back until the line is complete (or the cell ends)
        self.partial[key] = lines.pop()
        if lines:
            self.sink.text(rank, name, [_CR.sub("", line) if "\r" in line else line
                                        for line in lines])

    def show_results(self) -> None:
        """Each rank's result (its last expression's value), after all the output."""
        for rank in self.ranks:
            result = self.results.get(rank)
            if result:
                self.sink.result(rank, result.get("data") or {}, result.get("metadata") or {})

    def before_prompt(self, rank: int, seq: int) -> None:
        """Show the ranks' output before ``rank``'s debugger prompt ``seq``, at once (the kernel
        shows nothing more while the prompt waits): what the rank printed before it stopped is
        there once the prompt's mark (``runtime/_debugger.MARK``) has come behind it; the output
        travels through the controller while the prompt is a file. At most ``_SETTLE_MAX`` s."""
        deadline = time.monotonic() + _SETTLE_MAX
        self.deliver()
        while self.marks.get(rank, 0) < seq and time.monotonic() < deadline:
            self._execution().wait(0.01)
            self.deliver()
        self.sink.flush(force=True)

    def wait_for_end(self, grace: float, check_interrupt: Callable[[], None]) -> None:
        """Wait for the ranks' last output (their IOPub idle), showing it as it comes;
        ``check_interrupt`` raises a KeyboardInterrupt that came meanwhile.

        The replies can arrive well before the output (10,000 printed lines take seconds to
        travel): wait as long as output keeps arriving, and give up only after ``grace``
        seconds (``RingMagics.output_grace``) without any, saying that the output may be cut short.
        """
        execution = self._execution()
        started = time.monotonic()
        while not execution.output_done():
            execution.wait(min(TICK, grace))
            check_interrupt()
            self.deliver()
            self.sink.flush()
            if time.monotonic() - max(started, execution.last_arrival) >= grace:
                late = [str(r) for r in self.ranks if not execution.output_done(r)]
                print(f"(no end of output from rank(s) {', '.join(late) or '?'} {grace:g} s after "
                      "the cell finished; what they printed last may be missing)", file=sys.stderr)
                return


class CellDashboard:
    """The live dashboard of one cell on ``ranks`` of ``cluster``, made only once a rank has
    reported work (a step, a metric, a stall): trivial cells stay light. ``ready``: the ranks
    publish snapshots (a Jupyter kernel); ``wanted``: not ``--no-dashboard``."""

    def __init__(self, cluster: "RingCluster", ranks: list[int], sink: "RankTabs | TextSink",
                 ready: bool, wanted: bool) -> None:
        self.cluster = cluster
        self.ranks = ranks
        self.sink = sink
        self.ready = ready
        self.wanted = ready and wanted
        self.dashboard: "LiveDashboard | None" = None
        self._steps_noted = -float("inf")
        self._next_attach_look = 0.0  # when to look for a request for the live view again
        # new engines that took ranks during the cell, [(ranks, how)], until the dashboard is
        # made (and applied to it then); and the cluster's replacements when the cell began,
        # to tell the ranks replaced after the cell failed there (the dead rank's DeadRankError)
        self._new_engines: list[tuple[list[int], Literal["replaced", "joined"]]] = []
        self._replaced_before = dict(cluster.replaced)
        self._replaced_during: dict[int, int] = {}

    def serve_attach(self, now: float) -> None:
        """A notebook reopened while this cell runs asked (the Ring panel's "Show live view",
        through the server: see ``_live``) for the cell's live view: show the dashboard and the
        rank tabs again, as new widgets fed from the same state. The page knows no widget of
        this cell (the kernel announced them to the page that was closed), and puts whatever
        this cell shows from now on into its cell."""
        if now < self._next_attach_look:
            return
        self._next_attach_look = now + _ATTACH_EVERY
        if not _live.take_attach_request(self.cluster.where_dir):
            return
        if self.dashboard is not None:
            self.dashboard.attach()
        self.sink.attach()

    def poll(self, execution: CellExecution) -> None:
        """Feed the dashboard the ranks' new snapshots (making it on the first report of work)."""
        ar = execution.ar
        if self.dashboard is None:
            if not self.ready:  # no publisher on the ranks (e.g. a terminal)
                return
            from .widgets import live

            if not self.wanted:
                # --no-dashboard: drop the ranks' snapshots, which would otherwise pile up in
                # the client's metadata for the rest of the session
                live.discard_snapshots(ar)
                return
            # made once a rank reports work (a step, a metric, a stall): a cell that only sets a
            # total, or only runs collectives, gets no widgets at all (copies keys: safe
            # against the IO thread)
            if not live.has_snapshots(ar, work=True):
                return
            self.dashboard = live.LiveDashboard(self.ranks)
            for ranks, how in self._new_engines:
                self.dashboard.new_engines(ranks, how)
        self.dashboard.poll(ar)
        now = time.monotonic()
        if now - self._steps_noted >= 1.0:  # the Ring panel's step column, at most once a second
            self._steps_noted = now
            self._note_steps(self.dashboard)

    def new_engines(self, execution: CellExecution, ranks: list[int], how: Literal["replaced", "joined"]) -> None:
        """New engines take ``ranks`` while the cell runs (``how``: "replaced": a dead rank's
        replacement under ``elastic.run``; "joined": host discovery grew the world): call before
        ``execution`` sends them the cell, while its AsyncResult still holds the old engines'
        last snapshots, which are taken first. The rows say so (``LiveDashboard.new_engines``)."""
        self.poll(execution)
        if how == "replaced":
            for rank in ranks:
                self._replaced_during[rank] = self._replaced_during.get(rank, 0) + 1
        if self.dashboard is not None:
            self.dashboard.new_engines(ranks, how)
        else:
            self._new_engines.append((list(ranks), how))

    def _replaced_after(self) -> list[int]:
        """Ranks replaced in place since the cell began other than while it ran (the cell failed
        with the dead rank, which was replaced for the next cell)."""
        try:
            now = dict(self.cluster.replaced)
        except Exception:  # the cluster is going away
            return []
        return sorted(r for r, times in now.items()
                      if times > self._replaced_before.get(r, 0) + self._replaced_during.get(r, 0))

    def finish(self, execution: CellExecution | None) -> None:
        """The cell has ended (or failed, or was interrupted): the dashboard becomes static; with
        none made, the ranks' snapshots that reported no work are dropped."""
        if self.dashboard is None and execution is not None and self.ready:
            # snapshots that reported no work would pile up in the client's metadata
            from .widgets import live

            live.discard_snapshots(execution.ar)
        if self.dashboard is not None:
            try:
                for rank in self._replaced_after():
                    self.dashboard.state.replaced(rank, during=False)
                self.dashboard.finish(execution and execution.ar, self._outcomes(execution))
                self._note_steps(self.dashboard)
            except Exception as exc:  # never hide the cell's own outcome
                print(f"(the dashboard could not finish: {exc})", file=sys.stderr)

    def _outcomes(self, execution: CellExecution | None) -> dict[int, str]:
        """How the cell ended on each rank where it did not end well, for the frozen dashboard:
        its row shows that at the rank's last step, never "done" with a full bar."""
        if execution is None:
            return {}
        try:
            dead = set(self.cluster.dead_ranks())
        except Exception:  # the cluster is going away: the ranks' own replies still tell
            dead = set()
        pending = set(execution.pending())
        outcomes = {}
        for rank in self.ranks:
            error = execution.error(rank)
            if rank in dead:
                outcomes[rank] = "died"
            elif rank in pending:
                outcomes[rank] = "no reply"
            elif error is None:
                continue
            elif _ename(error) == "KeyboardInterrupt":
                outcomes[rank] = "interrupted"
            elif _ename(error) == "StallError":
                outcomes[rank] = "stalled"
            elif _ename(error) == "EngineError":
                outcomes[rank] = "died"
            elif _ename(error) == "LeftTheWorld":  # host discovery shrank the world at a commit
                outcomes[rank] = "left"
            else:
                outcomes[rank] = "failed"
        return outcomes

    def _note_steps(self, dashboard: "LiveDashboard") -> None:
        state = dashboard.state
        self.cluster.record_steps({r: {"step": s.step, "total": s.total}
                                   for r, s in state.ranks.items() if s.seen})
