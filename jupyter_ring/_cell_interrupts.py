"""Interrupting a ``%%distributed`` cell: SIGINT in the kernel deferred to where the cell's loop
checks (:class:`DeferredInterrupt`), and the cell's interrupts of its ranks (:class:`CellInterrupts`:
after a peer failed, on ``--timeout``, on Ctrl-C), with what the user is told about ranks that
had not begun, did not stop, or went idle without a reply, and where the ranks are when stuck.
"""

import contextlib
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from ._cell_output import TICK
from ._ipp import REPLY_GRACE, CellExecution
from .errors import _ename, _rank_list

if TYPE_CHECKING:  # the front end's modules import this one
    from .cluster import RingCluster
    from .engines._interrupts import CellId

__all__ = ["CellInterrupts", "DeferredInterrupt"]

# Seconds an interrupted rank may keep running before the cell shows where every rank is.
_WHERE_AFTER = 1.0

# StallError's message names the ranks that never arrived: "... waited 2.0 s for rank(s) [1, 3]"
_STALL_RANKS = re.compile(r"for rank\(s\) \[([0-9, ]*)\]")


class CellInterrupts:
    """The interrupts of one cell on ``ranks`` of ``cluster``: which ranks were interrupted and
    why (``interrupted``), when, and their answers. ``execution`` and ``cell_id`` are set once
    the cell's requests are sent; ``deliver(final)`` shows the output that came meanwhile."""

    def __init__(self, cluster: "RingCluster", ranks: list[int], deliver: Callable[[bool], None]) -> None:
        self.cluster = cluster
        self.ranks = ranks
        self.deliver = deliver
        self.execution: CellExecution | None = None
        self.cell_id: "CellId | None" = None  # the id the cell's requests carry, which its interrupts name
        self.interrupted: dict[int, str] = {}          # rank -> why it was interrupted
        self.interrupted_at: dict[int, float] = {}     # rank -> time.monotonic() of its interrupt
        self.answers: dict[int, Any] = {}  # rank -> the future of its answer to the cell's interrupt
        self.waiting_noted: set[int] = set()  # ranks named as not begun yet (once each)
        self.where_shown = False  # the ranks' stacks are shown once per cell, unasked
        self.lost_noted = False   # ranks that went idle without a reply are named once

    def _execution(self) -> CellExecution:
        if self.execution is None:
            raise RuntimeError("the cell's ranks were asked about before its requests were sent")
        return self.execution

    def interrupt(self, ranks: list[int], why: str) -> None:
        """Interrupt the cell on those of ``ranks`` not interrupted yet, noting ``why``."""
        todo = [r for r in ranks if r not in self.interrupted]
        if not todo:
            return
        now = time.monotonic()
        for r in todo:
            self.interrupted[r] = why
            self.interrupted_at[r] = now
        self._signal(todo)

    def _signal(self, ranks: list[int]) -> None:
        """Interrupt this cell on ``ranks``: each rank stops it if it runs, or as it begins, and
        never the cell after it (``engines/_interrupts``; ``RingCluster.interrupt_cell``).

        Not a bare SIGINT: an engine ignores SIGINT between requests, and one still busy with an
        earlier request (a completion, a pull, or only slow to start on a loaded host) took it
        there. Signalled again once it began, a rank that had already ended the cell took that
        second signal in the next cell (a CI rehearsal across two hosts saw it).
        """
        if self.cell_id is not None:  # None: no request has left yet
            self.answers.update(self.cluster.interrupt_cell(self.cell_id, ranks))

    def note_waiting(self) -> None:
        """Name, once, the interrupted ranks that had not begun the cell yet: they stop as they
        begin it, once the earlier request that holds them ends."""
        pending = set(self._execution().pending())
        waiting = []
        for rank, answer in self.answers.items():
            if rank in self.waiting_noted or rank not in pending or not answer.done():
                continue
            try:
                state = answer.result()["content"].get("state")
            except Exception:  # the client closed under the cell: its own error says so
                continue
            if state == "waiting":
                self.waiting_noted.add(rank)
                waiting.append(rank)
        if waiting:
            print(f"(rank(s) {_join(waiting)} had not begun the cell when interrupted (busy with "
                  "an earlier request, or slow to start): they stop as they begin it, running "
                  "none of its code)", file=sys.stderr)

    def note_lost(self) -> None:
        """Name, once, the ranks whose cell ended without a reply (their engine went idle)."""
        lost = self._execution().lost()
        if lost and not self.lost_noted:
            self.lost_noted = True
            print(f"(rank(s) {_join(lost)} finished the cell but never sent its reply, which an "
                  "interrupt outside the cell's code can cost an engine; what they raised, if "
                  "anything, is read from their output. The ranks are fine.)", file=sys.stderr)

    def where_if_stuck(self, pending: list[int], now: float) -> None:
        """Show where the ranks are, once, when a collective stalled (the missing ranks first)
        or an interrupted rank still runs a second later: which line each one is on. A rank
        whose engine went idle is not running, only its reply is late (see ``note_lost``)."""
        if self.where_shown or not pending:
            return
        execution = self._execution()
        missing: list[int] = []
        for rank in self.ranks:
            error = execution.error(rank)
            if error is not None and _ename(error) == "StallError":
                missing += [r for r in _stall_ranks(error) if r not in missing]
        running = set(execution.running())
        late = [r for r in pending
                if r in running and now - self.interrupted_at.get(r, now) >= _WHERE_AFTER]
        if missing:
            why = (f"a collective stalled waiting for rank(s) {_join(missing)}; where the ranks "
                   "are (innermost frame first):")
        elif late:
            why = (f"rank(s) {_join(late)} still running {_WHERE_AFTER:g} s after the interrupt; "
                   "where the ranks are (innermost frame first):")
        else:
            return
        self._show_where(missing or late, why)

    def _show_where(self, first: list[int], why: str) -> None:
        self.where_shown = True
        from .cluster import format_where

        order = list(first) + [r for r in self.ranks if r not in first]
        try:
            text = format_where(self.cluster.where(order, timeout=2.0))
        except Exception as exc:  # never hide the cell's own outcome
            text = f"(the ranks' stacks could not be read: {type(exc).__name__}: {exc})"
        print(f"{why}\n{text}", file=sys.stderr)

    def interrupt_all(self, grace: float) -> list[int]:
        """Ctrl-C in the notebook: interrupt the cell on every rank, give them ``grace`` seconds
        (``RingMagics.interrupt_grace``), show what they said.
        The ranks that did not stop, in a list: a rank that went idle without a reply stopped."""
        execution = self._execution()
        self._signal(list(range(self.cluster.size)))
        finished = self._await_ranks(min(_WHERE_AFTER, grace))
        if not finished:
            late = execution.running()
            if late and not self.where_shown:
                self._show_where(late, f"rank(s) {_join(late)} still running {_WHERE_AFTER:g} s "
                                       "after the interrupt; where the ranks are (innermost frame "
                                       "first):")
            finished = self._await_ranks(max(0.0, grace - _WHERE_AFTER))
            if not finished and not execution.running():
                # every rank left went idle: its reply is late or lost (lost REPLY_GRACE s later)
                finished = self._await_ranks(REPLY_GRACE)
        try:
            execution.ar.wait_for_output(1.0)
        except Exception:
            pass
        self.deliver(True)
        self.note_lost()
        pending = [] if finished else execution.pending()  # some may have just stopped
        if pending:
            print(f"rank(s) {_join(pending)} did not stop within "
                  f"{grace:g} s of SIGINT; they may be stuck outside Python. "
                  "%ring status shows them; %ring restart replaces the cluster.", file=sys.stderr)
        return pending

    def _await_ranks(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every rank's reply, naming those that had not begun the
        cell; True if all came."""
        execution = self._execution()
        deadline = time.monotonic() + seconds
        while not execution.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            execution.wait(min(TICK, left))
            self.note_waiting()
        return True


class DeferredInterrupt:
    """While a cell runs: SIGINT (the toolbar's interrupt) is noted, and raised as
    KeyboardInterrupt where the loop checks (``raise_pending``), not at whatever line it lands.

    Raised anywhere, it can leave a lock that ipyparallel's IO thread needs held for ever:
    ``threading.Condition.__enter__`` is Python code, and an exception between its acquire and
    the ``with`` body skips the release (CPython's bpo-29988). A Future's condition left held
    while this thread polled ``done()`` stopped the client's IO thread in its next
    ``set_result``: no reply, output or signal got through again, the ranks never heard the
    interrupt or Where?, and the cell said they "did not stop". One still pending when the cell
    ends is raised then. Off the main thread (no signal handler can be set) nothing changes.
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None
        self._installed = False

    def __enter__(self) -> "DeferredInterrupt":
        try:
            self._previous = signal.signal(signal.SIGINT, self._note)
            self._installed = True
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, kind: type | None, *_rest: object) -> None:
        if self._installed:
            previous = self._previous
            signal.signal(signal.SIGINT, signal.default_int_handler if previous is None
                          else previous)
            self._installed = False
        if kind is None:
            self.raise_pending()

    def _note(self, _signum: int, _frame: FrameType | None) -> None:
        self.pending = True

    def raise_pending(self) -> None:
        """Raise KeyboardInterrupt if SIGINT came since the last call."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def immediate(self) -> Iterator[None]:
        """Within the block SIGINT raises at once, as it usually does: a prompt the user answers
        (the kernel's ``input()`` for a rank's debugger) must end on an interrupt, and no
        ipyparallel future is polled there."""
        if not self._installed:
            yield
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.raise_pending()
            yield
        finally:
            signal.signal(signal.SIGINT, self._note)


def _stall_ranks(error: object) -> list[int]:
    match = _STALL_RANKS.search(str(getattr(error, "evalue", "") or error))
    return [int(r) for r in match.group(1).split(",") if r.strip()] if match else []


def _join(ranks: Iterable[int]) -> str:
    return _rank_list(ranks)  # "0-62, 64": 64 ranks in a few characters
