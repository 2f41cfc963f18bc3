"""The front end's exceptions: one root, :class:`JupyterRingError`, and a few subclasses.

Everything the notebook side raises on purpose (the magics, the cluster, the Ring panel's
server routes) is a :class:`JupyterRingError`; the runtime on the ranks has its own root,
``jupyter_ring.runtime.RingError``, because it never imports the front end. Arguments that are
wrong in themselves are still ``ValueError``/``TypeError`` (and ``%ring`` usage errors IPython's
``UsageError``). The builtin second bases keep ``except RuntimeError`` / ``except LookupError``
code written against earlier releases working.

::

    JupyterRingError
    ├── ClusterError          the cluster could not start, or cannot do what was asked
    │   └── DeadRankError     ranks' engines died; ``%ring restart`` brings the cluster back
    ├── ClusterNotFound       the Ring panel asked for a cluster that has no cluster file
    ├── DistributedError      a ``%%distributed`` cell failed on one or more ranks
    └── CellInterrupted       the user interrupted a ``%%distributed`` cell (a KeyboardInterrupt)
"""

import re
from collections.abc import Iterable, Mapping, Sequence

from .engines._interrupts import BEFORE_IT_BEGAN

__all__ = ["JupyterRingError", "ClusterError", "DeadRankError", "ClusterNotFound",
           "DistributedError", "CellInterrupted", "trim_traceback", "where_stopped"]


class JupyterRingError(Exception):
    """Root of every error the jupyter_ring front end raises on purpose."""


class ClusterError(JupyterRingError, RuntimeError):
    """The cluster could not start, or is not in a state to do what was asked."""


class DeadRankError(ClusterError):
    """One or more ranks' engines have died; ``%ring restart`` brings the cluster back.

    ``ranks`` lists the dead ranks.
    """

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = ranks

    def _render_traceback_(self) -> list[str]:
        return [f"DeadRankError: {self}"]


class ClusterNotFound(JupyterRingError, LookupError):
    """No cluster file for this id in any IPython profile (or it went away meanwhile)."""


class DistributedError(JupyterRingError):
    """A ``%%distributed`` cell failed on one or more ranks.

    Shows the first failing rank's traceback (label ``[rank r @ host]``, original exception type
    kept in ``ename``), then one line per other failed rank. An error every failed rank raised
    alike (a collective's mismatch) is everybody's: one headline names them all
    (``[ranks 0, 1 @ host]``). ``errors`` maps rank -> the remote error; ``rank`` is the
    headline rank. ``full_traceback`` False hides the runtime's own frames below the user's call.
    """

    def __init__(self, rank: int, host: str, error: BaseException,
                 others: Sequence[tuple[int, str, BaseException]], note: str = "",
                 reasons: Mapping[int, str] | None = None, full_traceback: bool = True) -> None:
        self.reasons = dict(reasons or {})  # rank -> why the front end interrupted it
        self.rank = rank
        self.host = host
        self.error = error
        self.note = note
        self.full_traceback = full_traceback
        self.ename = _ename(error)
        self.evalue = getattr(error, "evalue", str(error))
        self.errors = {rank: error, **{r: e for r, _, e in others}}
        # the ranks that raised the headline's very error themselves (an interrupt that came
        # too late to stop that does not make it theirs any less)
        alike = [(r, h) for r, h, e in others
                 if (_ename(e), str(getattr(e, "evalue", e))) == (self.ename, str(self.evalue))]
        self.same = sorted([(rank, host)] + alike)
        self.others = [item for item in others if (item[0], item[1]) not in alike]
        super().__init__(self._summary())

    def _where(self) -> str:
        ranks = [r for r, _ in self.same]
        hosts = sorted({h for _, h in self.same})
        if len(ranks) == 1:
            return f"[rank {self.rank} @ {self.host}]"
        return f"[ranks {_rank_list(ranks)} @ {', '.join(hosts)}]"

    def _summary(self) -> str:
        text = f"{self._where()} {self.ename}: {self.evalue}"
        if self.others:
            # 63 ranks interrupted after one raised: one entry, not 63
            by_kind: dict[str, list[int]] = {}
            for r, _, e in self.others:
                by_kind.setdefault(_ename(e), []).append(r)
            text += "; also " + ", ".join(f"{_ranks_word(rs)}: {kind}" for kind, rs in by_kind.items())
        return text

    def _render_traceback_(self) -> list[str]:
        lines = [f"{self._where()} {self.ename}: {_first_line(self.evalue)}"]
        remote_tb = getattr(self.error, "traceback", None)
        if remote_tb:
            lines.extend(trim_traceback(str(remote_tb), self.full_traceback))
        if self.others:
            lines.append("")
            lines.append(f"other ranks ({len(self.others)}), probably as a consequence:")
            # ranks that say the same thing share a line (at 64 ranks, one line instead of 63)
            alike: dict[tuple[str, str], list[int]] = {}
            for rank, host, error in self.others:
                line = _ename(error)
                evalue = _first_line(getattr(error, "evalue", str(error)))
                if evalue:
                    line += f": {evalue}"
                if rank in self.reasons:
                    line += f" (interrupted: {self.reasons[rank]})"
                alike.setdefault((host, line), []).append(rank)
            for (host, line), ranks in alike.items():
                lines.append(f"  [{_ranks_word(ranks)} @ {host}] {line}")
        if self.note:
            lines.append(self.note)
        return lines


class CellInterrupted(JupyterRingError, KeyboardInterrupt):
    """A ``%%distributed`` cell interrupted by the user (the notebook's Interrupt, or the Ring
    panel's): every rank stopped, and the message says where each one was. Still a
    ``KeyboardInterrupt``, so that code interrupting a loop of cells stops as it did.

    ``errors`` maps rank -> the rank's remote error (or None when it had finished).
    """

    def __init__(self, by: str, errors: Mapping[int, BaseException | None],
                 unstopped: Iterable[int] = ()) -> None:
        self.by = by
        self.errors = dict(errors)
        self.unstopped = list(unstopped)
        # ranks stopped at the same place share an entry ("ranks 0-63 at line 2: ...")
        alike: dict[str, list[int]] = {}
        for r, e in sorted(self.errors.items()):
            alike.setdefault(where_stopped(e), []).append(r)
        places = [f"{_ranks_word(rs)} {place}" for place, rs in alike.items()]
        text = f"interrupted by {by}; "
        text += "every rank stopped" if not self.unstopped else (
            f"rank(s) {_rank_list(self.unstopped)} did not stop")
        super().__init__(text + (": " + ", ".join(places) if places else ""))

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


def _rank_list(ranks: Iterable[int]) -> str:
    """``0, 1`` for two ranks, else as ``cluster.rank_ranges``: ``0-15``, ``0-5, 7, 9-63``."""
    from .cluster._where import rank_ranges  # here: the cluster's modules import this one

    ranks = sorted(ranks)
    return ", ".join(map(str, ranks)) if len(ranks) <= 2 else rank_ranges(ranks)


def _ranks_word(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 4``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_rank_list(ranks)}"


def where_stopped(error: object) -> str:
    """Where a rank was when an interrupt stopped it, from its traceback: ``at line 5:
    time.sleep(1)``, ``in allreduce, line 3: ring.allreduce(x, name='x')``; ``before the cell
    began`` for a rank interrupted while busy with an earlier request; ``had finished`` for a rank
    without an error."""
    if error is None:
        return "had finished"
    if str(getattr(error, "evalue", "")).startswith(BEFORE_IT_BEGAN):
        return "before the cell began (none of its code ran)"
    text = _ANSI.sub("", str(getattr(error, "traceback", "") or ""))
    frames = re.split(r"\n\s*\n", text)
    cell = None
    call = None
    for index, frame in enumerate(frames):
        head = re.search(r"(?:Cell In\[\d+\]|<string>|Input In \[\d+\]), line (\d+)", frame)
        if head:
            arrow = re.search(r"^-+>\s*\d+\s?(.*)$", frame, re.M)
            cell = (head.group(1), arrow.group(1).strip() if arrow else "")
            call = None
            library = frames[index + 1] if index + 1 < len(frames) else ""
            match = re.match(r"\s*File .*[/\\]jupyter_ring[/\\]\w+[/\\]\w+\.py:\d+, in (\w+)",
                             library)
            call = match.group(1) if match else None
    if cell is None:
        return "(where: unknown)"
    line, code = cell
    where = f"in {call}, line {line}" if call else f"at line {line}"
    return f"{where}: {code}" if code else where


# Frames of these packages below the user's last frame are the library's own (as numpy and
# torch users expect, a traceback ends at the user's call); JUPYTER_RING_FULL_TRACEBACK=1 or
# %config RingMagics.full_traceback = True shows them.
_LIBRARY_FRAME = re.compile(r"^File .*[/\\]jupyter_ring[/\\](runtime|engines)[/\\]")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def trim_traceback(text: str, full: bool = False) -> list[str]:
    """A remote traceback's lines, without the trailing run of jupyter_ring's own frames below
    the user's last frame (one line says how many were hidden and how to see them)."""
    lines = text.splitlines()
    if full:
        return lines
    # IPython's frames are blocks separated by blank lines; the last block is "Ename: value"
    blocks: list[list[str]] = []
    block: list[str] = []
    for line in lines:
        if _ANSI.sub("", line).strip():
            block.append(line)
        elif block:
            blocks.append(block)
            block = []
    if block:
        blocks.append(block)
    hidden = 0
    while len(blocks) > 2 and _LIBRARY_FRAME.match(_ANSI.sub("", blocks[-2][0]).strip()):
        blocks.pop(-2)
        hidden += 1
    if not hidden:
        return lines
    out: list[str] = []
    for index, block in enumerate(blocks):
        if index == len(blocks) - 1:
            out.append("")
            out.append(f"({hidden} frame{'s' * (hidden > 1)} inside jupyter_ring hidden; "
                       "JUPYTER_RING_FULL_TRACEBACK=1 shows them)")
            out.append("")
        out.extend(block)
        if index < len(blocks) - 2:
            out.append("")
    return out


def _ename(error: object) -> str:
    """The exception type's name of a local or remote error (ipyparallel's ``ename``)."""
    return str(getattr(error, "ename", None) or type(error).__name__)


def _first_line(text: object) -> str:
    text = str(text).strip()
    return text.splitlines()[0] if text else ""
