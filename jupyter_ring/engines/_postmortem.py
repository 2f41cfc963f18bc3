"""A rank's post-mortem (``%ring debug``): pdb in the frame where this rank's failed cell raised.

``keep_failures`` (``%ring start``'s setup) keeps, on each rank, the exception of the last cell
that raised there, with the notebook's number of that cell (``number_cells`` gives the rank the
notebook's count). Its traceback holds the frames, and so their locals, as IPython's
``sys.last_traceback`` does for ``%debug``. ``%ring debug`` (``jupyter_ring/_postmortem.py``)
then runs :func:`post_mortem` as a cell on the rank: a :class:`PostMortemPdb`, the ranks' own
notebook pdb (``engines/_debugger.py``), opens on that traceback and talks through the same
prompt records as ``breakpoint()``.
"""

from __future__ import annotations

import os
import sys
from types import FrameType, TracebackType
from typing import Any

from ..runtime.internal import hold
from ._debugger import RankDebugger, RankPdb

__all__ = ["keep_failures", "post_mortem", "PostMortemPdb", "CALL", "last_failure"]

# The cell the notebook sends to a rank for ``%ring debug`` (its own failure is not kept).
CALL = "__import__('jupyter_ring.engines._postmortem', fromlist=['_']).post_mortem({cell})"
_MARK = "jupyter_ring.engines._postmortem"

# the library's own frames (as in the ranks' tracebacks, errors.trim_traceback)
_LIBRARY = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), part) + os.sep
                 for part in ("runtime", "engines"))

# (the notebook's cell number, the exception it raised on this rank), or None
_last: tuple[int, BaseException] | None = None


def last_failure() -> tuple[int, BaseException] | None:
    """The notebook's number of the last cell that raised on this rank, and its exception."""
    return _last


def keep_failures() -> None:
    """Keep the exception of each cell that raises on this rank (a post_run_cell callback),
    replacing the one before. Registered once per engine."""
    from IPython import get_ipython

    events = get_ipython().events
    if _note not in events.callbacks["post_run_cell"]:
        events.register("post_run_cell", _note)


def _note(result: Any) -> None:
    global _last
    error = result.error_in_exec
    if error is None or _MARK in (getattr(result.info, "raw_cell", "") or ""):
        return
    _last = (int(result.execution_count or 0), error)


def post_mortem(cell: int) -> None:
    """Open the notebook's pdb on this rank in the frame where its cell ``In[cell]`` raised.

    Says on stderr (and opens nothing) when this rank kept no such failure: the notebook checks
    first, so this is a rank restarted alone or a failure replaced meanwhile."""
    rank = hold.rank
    if hold.directory is None:
        print(f"rank {rank}: no notebook debugger on this rank (it was started without one)",
              file=sys.stderr)
        return
    kept = _last
    if kept is None or kept[0] != cell:
        have = f"its last failure is In[{kept[0]}]" if kept else "no cell has failed on it"
        print(f"rank {rank} kept no traceback of In[{cell}] ({have})", file=sys.stderr)
        return
    error = kept[1]
    traceback = _from_the_cell(error.__traceback__)
    if traceback is None:
        print(f"rank {rank}: the error of In[{cell}] has no traceback to debug", file=sys.stderr)
        return
    debugger = RankDebugger(hold.directory, rank)
    if not debugger.listened():  # the notebook cannot see this rank's records: nobody would answer
        print(f"rank {rank}: the notebook's debugger cannot reach this rank (its where folder, "
              f"{hold.directory}, is not on a file system the notebook's host shares)",
              file=sys.stderr)
        return
    debugger.clear()  # a reply left over from an earlier stop must not answer this one
    pdb = PostMortemPdb(debugger)
    pdb.reset()
    pdb.message(f"post-mortem of In[{cell}] on rank {rank}: "
                f"{type(error).__name__}: {_first_line(error)}")
    pdb.interaction(None, traceback)


class PostMortemPdb(RankPdb):
    """The notebook's pdb on a failed cell's traceback: it opens in the innermost frame of the
    user's code (an error raised inside jupyter_ring, a ``StallError`` or a mismatch, opens at
    the user's call; ``d`` goes down into the library's frames)."""

    def setup(self, frame: FrameType | None, traceback: TracebackType | None) -> Any:
        answer = super().setup(frame, traceback)
        below = 0
        index = self.curindex
        while index > 0 and _inside_jupyter_ring(self.stack[index][0]):
            index -= 1
            below += 1
        if below and index != self.curindex:
            self.curindex = index
            self.curframe = self.stack[index][0]
            self.curframe_locals = self.curframe.f_locals
            self.message(f"(raised {below} frame{'s' * (below > 1)} down, inside jupyter_ring: "
                         "`d` goes there)")
        return answer


def _from_the_cell(traceback: TracebackType | None) -> TracebackType | None:
    """``traceback`` without IPython's own frames above the cell (``run_code``)."""
    import IPython

    ipython = os.path.dirname(os.path.abspath(IPython.__file__ or "")) + os.sep
    while (traceback is not None and traceback.tb_next is not None
           and traceback.tb_frame.f_code.co_filename.startswith(ipython)):
        traceback = traceback.tb_next
    return traceback


def _inside_jupyter_ring(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_LIBRARY)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
