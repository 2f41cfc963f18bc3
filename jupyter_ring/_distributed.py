"""The ``%%distributed`` cell path in the kernel: which ranks run the cell, the cell's text as
the ranks number it, rank tabs or tagged text for its output, the run itself
(:class:`~jupyter_ring._cell.CellRun`), and the failure kept for ``%ring debug``.

``RingMagics.distributed`` parses the cell's line and hands it here; the options (``output``,
``auto_banner`` ...) are the magics' traits.
"""

import argparse
import sys
from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from ._cell import CellRun, kernel_stopping
from ._held_cluster import HeldCluster
from .cluster import parse_ranks, rank_ranges
from .errors import CellInterrupted, DistributedError
from .widgets._tabs import RankTabs, TextSink

if TYPE_CHECKING:
    from .magics import RingMagics

__all__ = ["DistributedCells"]


class DistributedCells:
    """Runs the magics' ``%%distributed`` cells on the kernel's cluster (``held``)."""

    def __init__(self, magics: "RingMagics", held: HeldCluster) -> None:
        self.magics = magics
        self.held = held
        self.widgets_ok: bool | None = None  # ipywidgets imports (None: not tried yet)

    def run(self, line: str, cell: str, args: argparse.Namespace) -> None:
        """Run ``cell`` (its ``%%distributed`` ``line`` parsed into ``args``) on the ranks."""
        magics = self.magics
        cluster = self.held.alive()
        if args.ranks is None:
            ranks = list(range(cluster.size))
        else:
            try:
                ranks = parse_ranks(args.ranks, cluster.size)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"--timeout {args.timeout:g}: give a positive number of seconds")
        if args.auto and magics.auto_banner:
            print(f"[ring auto] ranks {rank_ranges(ranks)} of {cluster.size} "
                  "(%%local runs a cell here; %ring auto off)")
        # The ranks number lines and cells as the notebook does. Line 1 is the %%distributed line,
        # a comment there (IPython drops leading blank lines); in auto mode the cell has no such
        # line and its own first line is line 1. The last line, a comment the ranks take off,
        # is the notebook's count: a rank's traceback says Cell In[17] where the notebook does.
        from .engines._setup import CELL_NUMBER  # the ranks' side of this line

        body = (cell if args.auto else f"# %%distributed {line}".rstrip() + "\n" + cell)
        number = self.cell_number()
        body = body.rstrip("\n") + "\n" + CELL_NUMBER.format(number)
        try:
            CellRun(magics, cluster, ranks, body, args, self.sink(ranks, args)).run()
        except (DistributedError, CellInterrupted) as exc:
            magics.post_mortem.note(exc, number, cluster)  # for %ring debug
            raise
        finally:
            self._follow_after_cell()

    def _follow_after_cell(self) -> None:
        """With ``--host-discovery``: a resize the cell waited for, done now (``_follow``); a
        failure is said, never put in place of the cell's own outcome."""
        if self.held.follow is None or kernel_stopping(self.magics.shell) is not None:
            return
        try:
            self.held.follow_discovery()
        except Exception as exc:  # the resize's own ClusterError says what now (%ring restart)
            print(f"(host discovery: the resize after this cell failed: {exc})", file=sys.stderr)

    def cell_number(self) -> int:
        """The notebook's count of the cell running now (IPython has moved on to the next)."""
        shell = self.magics.shell
        if shell is None:  # only a magic registered with a shell runs
            raise UsageError("%%distributed runs in an IPython shell")
        running = getattr(shell.displayhook, "exec_result", None)
        if running is not None and running.execution_count is not None:
            return int(running.execution_count)
        return int(shell.execution_count)

    def sink(self, ranks: list[int], args: argparse.Namespace) -> RankTabs | TextSink:
        """Tabs or tagged text for one cell (see jupyter_ring.widgets._tabs)."""
        mode = args.output or self.magics.output
        if args.rank0_output:
            return TextSink(tag=False)
        if mode == "auto":
            mode = "tabs" if self.widgets_available() else "text"
        if mode == "tabs":
            return RankTabs(ranks)
        return TextSink(ranks=ranks)

    def widgets_available(self) -> bool:
        """A Jupyter kernel (not a terminal) with ipywidgets importable."""
        if getattr(self.magics.shell, "kernel", None) is None:
            return False
        if self.widgets_ok is None:
            self.import_widgets()
        return bool(self.widgets_ok)

    def import_widgets(self) -> None:
        """Import ipywidgets (ahead of the first cell with output: it takes ~0.5 s)."""
        try:
            import ipywidgets  # noqa: F401  (imported ahead of the first cell with output)

            self.widgets_ok = True
        except ImportError:
            self.widgets_ok = False
