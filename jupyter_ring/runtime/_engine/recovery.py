"""Recovery after an abandoned collective: RESYNC notices, the move to a fresh data communicator,
and the requests and communicators a given-up collective leaves behind.

An abandoned collective (interrupt, stall, error) can leave messages in flight. The rank marks
itself dirty; at its next collective it tells every peer (a RESYNC notice on the control
communicator) and all ranks switch to a fresh data communicator made by a polled ``Idup``.
Messages of the abandoned collective stay on the old communicator, which is kept until ``close``
(MPICH hands a freed communicator's context id to the next one made, where they would match), so
they can never match a later receive. A clean rank that receives a notice while waiting joins the
resync (``Restart``: ``Runtime.run`` retries its collective on the fresh communicator).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from .errors import StallError
from .wire import HELD, TAG_RESYNC, Kept

if TYPE_CHECKING:
    from mpi4py import MPI

    from .core import Runtime

__all__ = ["Recovery"]

# After this long without a collective, the check before the next one tests the notice request
# as many times as a backlog of peers' messages can need (see Recovery.due)
_IDLE_SECONDS = 0.001


class Recovery:
    """The resync machinery of one runtime: notices heard, the resync in progress, and what
    abandoned collectives left behind (requests, buffers, retired communicators)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        # Notices are taken by a matched probe (MPI_Improbe, then MPI_Mrecv), never by a posted
        # MPI.ANY_SOURCE receive: across hosts MPICH's posted wildcard receive (ch4: a shared-memory
        # request with a UCX partner) was seen to stop matching after a few resyncs that followed
        # interrupts, with notices waiting that MPI_Iprobe found: no rank then heard a notice, and
        # every resync stalled (tests/multihost/test_resync_hosts.py). A probe posts nothing.
        self._notices: dict[int, set[int]] = {}  # resync target -> set of ranks that announced it
        # resync target -> the fewest collectives an announcing rank had completed on the communicator
        # it leaves (a notice is [target, completed]: see must_restart)
        self._completed: dict[int, int] = {}
        self._notice_buf = np.zeros(2, np.int64)
        self._status = rt.MPI.Status()
        self._highest_notice = 0
        self._checked = 0.0       # when due() last ran (perf_counter)
        self._notice_sends: list[MPI.Request] = []
        self._pending_dup: tuple[MPI.Comm, MPI.Request] | None = None  # (newcomm, request) of a resync in progress
        # (requests, buffers) of collectives given up, freed at resync
        self._abandoned: list[tuple[Sequence[MPI.Request], list[Kept]]] = []
        self.drains: list[MPI.Request] = []  # poison sends and the receives that drain peers' headers
        self._retired: list[MPI.Comm] = []  # data communicators left by resyncs, freed at close (see resync)
        self._stuck: list[MPI.Prequest] = []  # active persistent sends given up, kept until close (see discard)

    def poll_notices(self, tests: int = 1) -> int:
        """Collect RESYNC notices (probing up to ``tests`` times while none is waiting); return
        the highest generation any peer asked for."""
        MPI = self.rt.MPI
        status = self._status
        improbe = self.rt.ctl.Improbe
        for _ in range(tests):
            message = improbe(MPI.ANY_SOURCE, TAG_RESYNC, status)
            if message is not None:
                break
        else:  # the common case, once per collective
            return self._highest_notice
        buf = self._notice_buf
        while message is not None:
            message.Recv([buf, MPI.INT64_T])  # matched: it is this rank's, already arrived
            target = int(buf[0])
            self._notices.setdefault(target, set()).add(status.Get_source())
            self._completed[target] = min(self._completed.get(target, int(buf[1])), int(buf[1]))
            message = improbe(MPI.ANY_SOURCE, TAG_RESYNC, status)
        self._highest_notice = max(self._notices, default=0)
        return self._highest_notice

    def must_restart(self) -> bool:
        """Whether a peer's resync notice ends the collective this rank waits in (``Restart``).

        Not when every rank that announced the next generation had completed this very collective
        before it gave up a later one: then every rank had entered it, and each one still in it
        completes it (none of them gives it up for such a notice), as the multi-step exchanges
        (the relayed agreement, recursive doubling, the ring) need: a rank that completed a
        collective while a peer still waits for the last messages of it, then gave up its next one,
        would otherwise send that peer back to run it alone on the fresh communicator. The resync
        then comes before this rank's next collective (``due``).
        """
        rt = self.rt
        target = rt.gen + 1
        if self.poll_notices() < target:
            return False
        return self._completed.get(target, 0) <= rt.completed

    def discard(self, req: MPI.Request) -> None:
        """Give up ``req``: cancel it, or (a persistent header send) keep it until close."""
        MPI = self.rt.MPI
        if req == MPI.REQUEST_NULL:
            return
        if isinstance(req, MPI.Prequest):
            # A persistent header send (the persistent receives are cancelled by HeaderBuffers.free)
            # is never cancelled: MPICH over UCX crashes cancelling an active one (a message past
            # its eager limit, ~16 KiB: MPI_Cancel -> ucp_request_cancel, SIGSEGV). Its message
            # waits on the retired communicator until close drains it: the request and the
            # buffer it sends from are kept until then.
            if not req.Test():
                self._stuck.append(req)
            return
        try:
            if not req.Test():
                req.Cancel()
                req.Free()
        except MPI.Exception:  # pragma: no cover - a request that completed with an error
            pass

    def abandon(self) -> None:
        """The collective in progress was given up: keep its requests and buffers until the
        resync that its rank is now due."""
        rt = self.rt
        self._abandoned.append((rt.inflight, rt.keep[:]))
        rt.inflight = []
        rt.dirty = True

    def due(self) -> bool:
        """Whether this rank must resync before its next collective: it gave one up, or a peer
        did and announced it (notices are probed: one ``MPI_Improbe``).

        Tested before every collective, prepared lanes' too: a header that a peer sent before it
        gave its collective up still waits on the old communicator, and it may equal the header
        this rank's next collective expects (a rank that skipped a call, a peer that stalled on
        it and then calls it again): a small collective would complete with it, silently wrong.
        Only the notice, which that peer sends before anything else, tells this rank not to take
        it; once this rank has sent nothing, a resync first is safe for every rank. After an idle
        gap (this rank computed: whatever peers sent meanwhile waits unprocessed) one probe is
        not enough: MPICH moves one message of the backlog a call, so it probes up to
        ``4 + 4·peers`` times then (a few µs, once per gap). In a loop of collectives the backlog
        is processed as it comes: one probe.
        """
        rt = self.rt
        if rt.dirty:
            return True
        now = time.perf_counter()
        tests = 4 + 4 * len(rt.peers) if now - self._checked > _IDLE_SECONDS else 1
        self._checked = now
        return self.poll_notices(tests) > rt.gen

    def resync(self) -> None:
        """Move every rank to a fresh data communicator (polled Idup on the control comm)."""
        rt = self.rt
        target = rt.gen + 1
        newcomm = self._announce_and_dup(target)
        if rt.agreement.gather is not None and not rt.dirty:
            # a clean rank resyncs for a peer's notice: a poison left unread is for the collective
            # it is about to run (a dirty rank is done with its own: it raised, or poisoned it too)
            rt.agreement.gather.keep_poison()
        old = rt.comm
        for reqs, _ in self._abandoned + [(self.drains, None)]:
            for r in reqs:
                self.discard(r)
        self._abandoned.clear()
        self.drains = []
        rt.keep.clear()
        rt.comm = newcomm
        rt.gen = target
        rt.dirty = False
        self._notices = {t: s for t, s in self._notices.items() if t > target}
        self._completed = {t: c for t, c in self._completed.items() if t > target}
        rt.completed = 0
        self._highest_notice = max(self._notices, default=0)
        # join notices were messages on the old communicator: a joined rank announces itself anew
        rt.joined = {}
        rt.join_base = rt.seq
        rt.headers.build()
        rt.set_participants()
        # Not freed: MPICH gives a freed communicator's context id to the next one made, and a
        # message of the abandoned collective still queued here (a peer's header, sent before it
        # gave up) would then match a receive of a later collective on the fresh communicator.
        self._retired.append(old)

    def _announce_and_dup(self, target: int) -> MPI.Comm:
        """Tell every peer (once) that this rank moves to generation ``target``, and wait for the
        fresh communicator every rank makes (a stall names the ranks that never announced)."""
        rt = self.rt
        MPI = rt.MPI
        if self._pending_dup is None:
            note = np.array([target, rt.completed], np.int64)
            rt.keep.append(note)
            self._notice_sends = [rt.ctl.Isend([note, MPI.INT64_T], p, TAG_RESYNC) for p in rt.peers]
            self._pending_dup = rt.ctl.Idup()
        newcomm, req = self._pending_dup
        peers = rt.peers

        def not_announced() -> list[int]:
            self.poll_notices()
            return [p for p in peers if p not in self._notices.get(target, set())]

        try:
            rt.waits.wait([req], "resync after an abandoned collective", [], check_notices=False,
                          missing=not_announced)
        except StallError:
            self.poll_notices()
            arrived = self._notices.get(target, set())
            missing = rt.name_of(p for p in peers if p not in arrived)
            raise StallError(
                f"resync: rank {rt.world[rt.rank]} waited for rank(s) {missing} to recover from the "
                "previous failed collective; they have not called a collective since. Call the next "
                "collective on every rank (or restart the cluster with %ring restart).", missing) from None
        self._pending_dup = None
        return newcomm

    def release_requests(self) -> None:
        """At close: give up every request still held (notices, the collective in progress,
        drains, abandoned collectives')."""
        for req in [*self._notice_sends, *self.rt.inflight, *self.drains]:
            self.discard(req)
        for reqs, _ in self._abandoned:
            for req in reqs:
                self.discard(req)
        self._abandoned.clear()

    def release_comms(self, comms: Sequence[MPI.Comm]) -> None:
        """At close: drain and free ``comms`` and every retired communicator."""
        MPI = self.rt.MPI
        for comm in [*self._retired, *comms]:
            if comm != MPI.COMM_NULL:
                _drain(comm, MPI)
                try:
                    comm.Free()
                except MPI.Exception:  # pragma: no cover - freeing is best effort at shutdown
                    pass
        self._retired = []
        HELD.extend(self._stuck)  # still active: their buffers must outlive them (see wire.HELD)
        self._stuck = []


def _drain(comm: MPI.Comm, MPI: ModuleType) -> None:
    """Receive what peers sent on ``comm`` and nobody received (messages of abandoned collectives)
    before it is freed: its context id goes to the next communicator made (a later ``init()``),
    where such a message would match a receive of an unrelated collective.

    Best effort and bounded: only messages already here are received; one that does not arrive in
    full at once (a large one whose sender gave up) is left, cancelled, and so is one that MPI
    cannot read (its sender has exited).
    """
    status = MPI.Status()
    for _ in range(10000):
        try:
            message = comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        except MPI.Exception:  # pragma: no cover - a communicator MPI has given up on
            return
        if message is None:
            return
        req = message.Irecv(bytearray(max(status.Get_count(MPI.BYTE), 1)))
        deadline = time.perf_counter() + 0.05
        try:
            while not req.Test():
                if time.perf_counter() > deadline:
                    req.Cancel()
                    return
                time.sleep(1e-4)
        except MPI.Exception:  # a large message whose sender has exited (MPICH reads it from there)
            return

