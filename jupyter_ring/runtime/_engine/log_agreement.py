"""The agreement in ⌈log2 n⌉ steps: Bruck's allgather of the headers (issue 33, item 2).

The direct agreement (``Agreement.negotiate``) sends every peer this rank's header and receives
theirs: n-1 messages a rank, every collective. Here the same headers travel by Bruck's
allgather: at step ``s`` (``d = 2**s``) a rank sends the first ``min(d, n-d)`` headers it holds to
rank ``r-d`` and receives as many from rank ``r+d``, appended to its table, so after ⌈log2 n⌉
steps row ``i`` of the table holds rank ``(r+i) % n``'s header, for any ``n`` (no folding as
recursive doubling needs where ``n`` is not a power of two). Every rank ends with every peer's
header, as with the direct exchange, so ``Agreement``'s checks (joins, recuts, disagreements,
mismatches) read the table instead and raise alike on every rank.

Only headers travel (no eager payload: at these worlds small data goes by recursive doubling,
``algorithm_choice``). Every rank of the communicator takes part, joined ones too (they send their
JOIN notice as their header until every rank has joined), so a join never changes who relays.

A poison cannot travel this way (the rank that raised takes no part, and every exchange needs
every rank's row): it goes to every peer directly on ``TAG_POISON``, and a waiting rank probes for
it between polls. Such an exchange cannot complete, so the rank gives it up (its requests stay on
the old communicator: ``Recovery.abandon``) and every rank resyncs before its next collective.

A rank that waits knows only that its partner's rows have not come, not which rank never arrived
(the partner may wait on another). Once a wait is long enough to name ranks (a quarter second:
``polling``), each waiting rank tells every peer directly that it is in this exchange (a presence
note: the exchange's number on this communicator, the same on every rank as every rank takes part
in every exchange); the ranks named are those whose header has not come and whose note has not
either: the ones that never arrived, as the direct agreement names them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .control import Restart
from .wire import HEADER_BYTES, TAG_AGREE_LOG, TAG_POISON, TAG_PRESENT

if TYPE_CHECKING:
    from mpi4py import MPI

    from .core import Runtime

__all__ = ["HeaderAllgather", "bruck_steps"]


def bruck_steps(rank: int, size: int) -> list[tuple[int, int, int]]:
    """The steps of Bruck's allgather on ``rank`` of ``size``: (to, from, rows), ⌈log2 size⌉ of them.

    At step ``s`` (``d = 2**s``) the rank sends its first ``min(d, size-d)`` rows to ``rank-d``
    and receives as many from ``rank+d`` into rows ``d ...``.
    """
    steps = []
    d = 1
    while d < size:
        steps.append(((rank - d) % size, (rank + d) % size, min(d, size - d)))
        d *= 2
    return steps


class HeaderAllgather:
    """Bruck's allgather of every rank's header on the runtime's data communicator: the table,
    each peer's row in it, and the poison probe of a waiting rank."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        size = rt.size
        self.steps = bruck_steps(rt.rank, size)
        self.table = bytearray(size * HEADER_BYTES)
        view = memoryview(self.table)
        # rank p's header lies in row (p - rank) % size
        self.rows: dict[int, memoryview] = {
            p: view[((p - rt.rank) % size) * HEADER_BYTES:((p - rt.rank) % size + 1) * HEADER_BYTES]
            for p in range(size)}
        self.poisoned = -1   # the peer whose poison the last exchange met (-1: none)
        # exchanges run on this communicator (reset at every resync: ``restart``), this one's number
        self.count = 0
        self.present: dict[int, int] = {}  # peer -> the latest exchange it said it waits in
        self._told = -1       # the exchange whose presence notes this rank has sent
        self._note = np.zeros(1, np.int64)
        self._inflight: list[MPI.Request] = []  # the exchange's requests (its presence notes join them)
        # a poison found on the communicator a resync leaves (``keep_poison``): (peer, its message)
        self.pending: tuple[int, bytes] | None = None

    def restart(self) -> None:
        """A fresh communicator (init, resync): exchanges are counted from 0 there on every rank."""
        self.count = 0
        self.present = {}
        self._told = -1

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends in one exchange, in ⌈log2 n⌉ messages: n-1 headers, as directly."""
        return sum(count for _to, _src, count in self.steps) * HEADER_BYTES

    def run(self, header: bytes | memoryview, what: Callable[[], str]) -> bool:
        """Exchange ``header`` (this rank's, ``HEADER_BYTES``) for every peer's, into ``rows``.

        Returns True when every header arrived; False when a peer's poison arrived instead
        (``poisoned`` names it, its message is in that peer's eager buffer): the exchange is given
        up, its requests abandoned, and a resync is due. A peer's resync notice raises
        ``Restart`` as in every wait, unless a poison came first.
        """
        rt = self.rt
        comm = rt.comm
        table = memoryview(self.table)
        table[:HEADER_BYTES] = header
        self.poisoned = -1
        self.count += 1
        # every receive posted at once: step s fills rows [2**s, 2**s + rows), disjoint rows
        recvs = [comm.Irecv(table[d * HEADER_BYTES:(d + count) * HEADER_BYTES], src, TAG_AGREE_LOG)
                 for d, (_to, src, count) in zip(_offsets(len(self.steps)), self.steps)]
        inflight: list[MPI.Request] = list(recvs)
        rt.inflight = self._inflight = inflight
        for (to, src, count), recv in zip(self.steps, recvs):
            # rows [0, count) are this rank's and what earlier steps brought: all present now
            inflight.append(comm.Isend(table[:count * HEADER_BYTES], to, TAG_AGREE_LOG))
            if recv.Test():
                continue
            if not self._wait(recv, src, what):
                return False
        sends = inflight[len(recvs):]
        rt.waits.wait(sends, what, [to for to, _src, _count in self.steps])
        return True

    def _wait(self, recv: MPI.Request, src: int, what: Callable[[], str]) -> bool:
        """Wait for one step's receive, probing for a peer's poison between polls."""
        rt = self.rt

        def done() -> bool:
            return bool(recv.Test()) or self._poison_arrived()

        try:
            rt.waits.poll(done, what(), lambda: self.missing(src))
        except Restart:
            # a poisoner that moved on resyncs at its next collective: its poison came first
            if not self._poison_arrived():
                raise
        if self.poisoned >= 0:
            rt.recovery.abandon()
            return False
        return True

    def keep_poison(self) -> None:
        """Before a resync leaves this communicator: keep a peer's poison that waits on it unread.

        The poisoner resyncs at its next collective, and its notice may reach this rank before this
        rank has entered the collective the poison was for (``Runtime.run`` resyncs before it
        starts): that collective raises the poison's ``PeerError`` on the fresh communicator then
        (``Agreement``), as it does on every rank that met the poison while waiting.
        """
        if self.pending is None and self._poison_arrived():
            peer = self.poisoned
            self.pending = (peer, bytes(self.rt.headers.eager[peer]))

    def _poison_arrived(self) -> bool:
        """Receive a peer's poison when one waits (into its eager buffer; ``poisoned`` names it)."""
        rt = self.rt
        MPI = rt.MPI
        status = MPI.Status()
        message = rt.comm.Improbe(MPI.ANY_SOURCE, TAG_POISON, status)
        if message is None:
            return False
        peer = status.Get_source()
        message.Recv(rt.headers.eager[peer])
        self.poisoned = peer
        return True

    def missing(self, src: int) -> list[int]:
        """The ranks that have not arrived in this exchange, as far as this rank can tell (called
        in a long wait for step partner ``src``): those whose header has not reached it and who
        sent no presence note for it (this rank sends its own notes on the first call); ``src``
        where every one of those says it waits too."""
        rt = self.rt
        MPI = rt.MPI
        comm = rt.comm
        if self._told != self.count:
            self._told = self.count
            note = np.array([self.count], np.int64)  # (each request holds its buffer)
            self._inflight.extend(comm.Isend([note, MPI.INT64_T], p, TAG_PRESENT) for p in rt.peers)
        status = MPI.Status()
        buf = self._note
        message = comm.Improbe(MPI.ANY_SOURCE, TAG_PRESENT, status)
        while message is not None:
            message.Recv([buf, MPI.INT64_T])
            peer = status.Get_source()
            self.present[peer] = max(self.present.get(peer, 0), int(buf[0]))
            message = comm.Improbe(MPI.ANY_SOURCE, TAG_PRESENT, status)
        held = 1
        for d, (_to, from_, count) in zip(_offsets(len(self.steps)), self.steps):
            if from_ == src:
                break
            held = d + count
        unheard = [(rt.rank + i) % rt.size for i in range(held, rt.size)]
        absent = sorted(p for p in unheard if self.present.get(p, 0) < self.count)
        return absent or [src]


def _offsets(steps: int) -> list[int]:
    return [1 << s for s in range(steps)]
