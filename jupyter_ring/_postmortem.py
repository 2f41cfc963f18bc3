"""Post-mortem of a failed ``%%distributed`` cell: ``%ring debug [RANKS]`` and ``%ring pdb on|off``.

IPython's ``%debug`` opens pdb where the last exception was raised, in this process; a failed
distributed cell's exception in the notebook kernel is the ``DistributedError`` raised by
``_cell.py``, and the frames that matter are on the ranks. Each rank keeps the exception of its
last failed cell (``engines/_postmortem.py``); ``%ring debug`` runs a one-line cell on the ranks
asked for that opens the ranks' notebook pdb on it, served by the same prompt machinery as
``breakpoint()`` (``_debug.Debuggers`` in ``CellRun``). IPython's own ``%debug`` and ``%pdb on``
after a failed distributed cell are routed here (``shell.debugger`` is wrapped), so neither opens
pdb inside ``_cell.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from .errors import CellInterrupted, DistributedError, _ename, where_stopped

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from .cluster import RingCluster
    from .magics import RingMagics

__all__ = ["Failure", "PostMortem"]


class Failure:
    """The last failed ``%%distributed`` cell: its number, its cluster, how each rank failed."""

    def __init__(self, cell: int, cluster: RingCluster,
                 error: DistributedError | CellInterrupted) -> None:
        self.cell = cell
        self.cluster = cluster
        self.error = error
        remote: dict[int, Any] = dict(error.errors)
        self.errors = {rank: _ename(e) for rank, e in sorted(remote.items()) if e is not None}
        if isinstance(error, DistributedError):
            self.first = error.rank  # the headline: the first failing rank
        else:  # interrupted: the rank that was running its own code, as the tabs select
            mine = [r for r in self.errors if where_stopped(remote[r]).startswith("at line")]
            self.first = (mine or list(self.errors) or [0])[0]

    def failed(self) -> str:
        """``1 (ValueError), 3 (KeyboardInterrupt)``"""
        return ", ".join(f"{rank} ({ename})" for rank, ename in self.errors.items())


class PostMortem:
    """The notebook's end of the ranks' post-mortem, one per ``RingMagics``."""

    def __init__(self, magics: RingMagics) -> None:
        self.magics = magics
        self.last: Failure | None = None
        self.auto = False  # %ring pdb on: every failed cell drops into %ring debug
        self._shell: InteractiveShell | None = None
        self._debugger: Callable[..., Any] | None = None

    # ------------------------------------------------------------------ hooks into IPython
    def install(self, shell: InteractiveShell) -> None:
        """Route IPython's ``%debug``/``%pdb`` for a failed distributed cell to the ranks, and
        run ``%ring pdb on``'s post-mortem after a failed cell (its error shown first)."""
        self._shell = shell
        self._debugger = shell.debugger
        shell.debugger = self._ipython_debugger  # type: ignore[method-assign]
        shell.events.register("post_run_cell", self._after_cell)

    def remove(self) -> None:
        shell = self._shell
        if shell is None:
            return
        if shell.__dict__.get("debugger") == self._ipython_debugger:
            del shell.debugger
        try:
            shell.events.unregister("post_run_cell", self._after_cell)
        except ValueError:
            pass
        self._shell = None

    def note(self, error: DistributedError | CellInterrupted, cell: int,
             cluster: RingCluster) -> None:
        """``%%distributed`` cell ``cell`` failed with ``error``: the failure ``%ring debug`` opens."""
        self.last = Failure(cell, cluster, error)

    def _ours(self) -> bool:
        """Whether IPython's last exception is the last failed distributed cell's."""
        return self.last is not None and getattr(sys, "last_value", None) is self.last.error

    def _ipython_debugger(self, force: bool = False) -> None:
        shell = self._shell
        if not (force or (shell is not None and shell.call_pdb)) or not self._ours():
            if self._debugger is not None:
                self._debugger(force)
            return
        print("(the error came from the ranks: %debug opens rank "
              f"{self.last.first if self.last else '?'}'s frame, as %ring debug does)")
        self._safely(None)

    def _after_cell(self, result: Any) -> None:
        shell = self._shell
        if (self.auto and self.last is not None and result.error_in_exec is self.last.error
                and not (shell is not None and shell.call_pdb)):  # %pdb on already did it
            self._safely(None)

    def _safely(self, ranks: str | None) -> None:
        """``debug`` from inside IPython's error handling: its own errors as one line."""
        try:
            self.debug(ranks)
        except (Exception, KeyboardInterrupt) as exc:
            print(f"{_ename(exc)}: {exc}", file=sys.stderr)

    # ------------------------------------------------------------------ %ring debug
    def debug(self, ranks: str | None) -> None:
        """``%ring debug [RANKS]``: pdb on each rank of ``ranks`` (the first failing rank by
        default; ``all``: every rank that raised) in the frame where it raised."""
        from ._cell import CellRun
        from .engines._postmortem import CALL
        from .widgets._tabs import TextSink

        failure = self.last
        if failure is None:
            raise UsageError("%ring debug: no %%distributed cell has failed in this session yet; "
                             "after one fails, %ring debug opens pdb where its rank raised")
        if self.magics.cluster is not failure.cluster or not failure.cluster.running:
            raise UsageError(f"%ring debug: the cluster was stopped or restarted since "
                             f"In[{failure.cell}] failed, and the ranks' tracebacks went with its "
                             "ranks; run the cell again, then %ring debug")
        cluster = self.magics.held.alive()  # a dead rank: DeadRankError says so
        chosen = self._ranks(ranks, failure, cluster.size)
        args = argparse.Namespace(timeout=None, rank0_output=False, no_dashboard=True)
        sink = TextSink(tag=len(chosen) > 1)
        CellRun(self.magics, cluster, chosen, CALL.format(cell=failure.cell), args, sink).run()

    @staticmethod
    def _ranks(spec: str | None, failure: Failure, size: int) -> list[int]:
        if spec is None:
            return [failure.first]
        if spec.strip() == "all":
            return list(failure.errors)
        try:
            ranks = sorted({int(part) for part in spec.split(",") if part.strip()})
        except ValueError:
            raise UsageError(f"%ring debug {spec}: give a rank, ranks as 0,2, or all") from None
        wrong = [r for r in ranks if not 0 <= r < size]
        if wrong or not ranks:
            raise UsageError(f"%ring debug {spec}: the cluster has ranks 0..{size - 1}")
        fine = [r for r in ranks if r not in failure.errors]
        if fine:
            raise UsageError(
                f"%ring debug {spec}: rank(s) {', '.join(map(str, fine))} did not fail in "
                f"In[{failure.cell}]; the rank(s) that did: {failure.failed()}")
        return ranks
