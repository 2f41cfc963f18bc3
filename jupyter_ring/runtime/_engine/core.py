"""``Runtime``: the communicators and the state of one runtime, and ``Runtime.run``, the try and
retry of one collective.

The collective algorithms (eager, shared memory, the ring) are bodies in ``collectives.py`` that
``Runtime.run`` runs; the runtime and its parts hold what every body stands on: the agreement
exchange (``agreement``, its buffers and requests in ``headers``, the message layout in ``wire``,
a mismatch explained by ``mismatch``), the polled waits (``polling``) and recovery (``recovery``).

One ``Runtime`` object per process holds the communicators. Every collective goes through
``Runtime.run``:

1. **Agreement.** Each rank sends every other rank a 56-byte header (kind, dtype, op, root,
   count, a fingerprint of name/shape/scales) and, when the payload is small, the payload itself
   in the same message. Every rank compares all headers, so every rank sees a disagreement and
   raises the same ``CollectiveMismatchError``. Small collectives finish here: one round trip.
2. **Data.** Larger payloads move over point-to-point messages: a pipelined ring reduce-scatter +
   allgather for allreduce, direct sends for the rest. When every rank is on one host, an
   allreduce above ``shm_threshold`` goes through shared-memory slots instead (``shm``), if
   every rank offers its slot in the agreement message.
3. **Waiting.** Every wait is a nonblocking request (or a shared-memory counter) polled from
   Python (``polling``): poll briefly (spinning, or giving the core away where ranks outnumber
   cores: ``waits``), then back off. SIGINT therefore raises KeyboardInterrupt within
   milliseconds, a rank that never arrives raises ``StallError`` after ``stall_timeout``.
4. **Recovery.** An abandoned collective (interrupt, stall, error) can leave messages in flight.
   The rank marks itself dirty; at its next collective it tells every peer (a RESYNC notice on a
   control communicator) and all ranks switch to a fresh data communicator made by a polled
   ``Idup``. Messages of the abandoned collective stay on the old communicator, which is kept
   until ``close`` (MPICH hands a freed communicator's context id to the next one made, where
   they would match), so they can never match a later receive. A clean rank that receives a
   notice while waiting joins the resync and retries its collective on the fresh communicator,
   unless the engine planned it before the resync: then ``Replan`` (the engine plans its round
   again, as every rank does after a resync).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import numpy.typing as npt

from . import shm as _shm, waits as _waits
from .agreement import Agreement
from .algorithm_choice import Chosen
from .control import Abandoned, Disagree, Recut, Replan, Restart
from .errors import CollectiveMismatchError, PeerError, RingError
from .headers import HeaderBuffers
from .mismatch import Description, collective_title, describe_mismatch
from .polling import Waiter
from .pool import ResultPool
from .recovery import Recovery
from .wire import (DTYPE_CODE, DTYPES, OP_NAMES, TAG_DATA, Adasum, Average, Desc, JoinNote, Kept, Max, Min,
                   PeerMsg, Prepared, Product, Sum, reducer)
from .._observe.trace import Trace
from .._observe.where import activity

if TYPE_CHECKING:  # mpi4py.MPI is imported when a Runtime is made: importing it initialises MPI
    from mpi4py import MPI

    from .config import Config

# the names the runtime's users import from here (the engine, the numpy API, the adapters)
__all__ = ["Runtime", "Sum", "Average", "Min", "Max", "Product", "Adasum", "OP_NAMES", "DTYPES", "DTYPE_CODE",
           "TAG_DATA", "Recut", "Disagree", "Replan", "Abandoned", "Restart", "PeerMsg", "JoinNote", "Prepared",
           "Desc", "Description", "describe_mismatch", "collective_title", "reducer"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Runtime:
    """The communicators, topology, trace and pending work of one initialised runtime.

    Its parts: ``agreement`` (the header exchange: ``negotiate``, joins, poison), ``headers``
    (the eager buffers and header requests), ``waits`` (the polled waits), ``recovery``
    (resync after an abandoned collective). They share the state held here.
    """

    def __init__(self, comm: MPI.Comm, config: Config, world: Iterable[int] | None = None) -> None:
        from mpi4py import MPI

        self.MPI: ModuleType = MPI
        self.config = config
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.peers = [p for p in range(self.size) if p != self.rank]
        # Messages name ranks as the user knows them: a process set's rank q is global rank world[q].
        self.world = list(world) if world is not None else list(range(self.size))
        # Set by another thread to give up the collective in progress (its next poll raises).
        self.abort: str | None = None
        self.joined: dict[int, JoinNote] = {}  # peer -> its notice: peers that called join(), left out of allreduces
        self.active = self.peers  # peers not joined: the ones headers are exchanged with
        self.participants = list(range(self.size))  # ranks whose data an allreduce reduces
        self.pending = 1          # entries of the engine's round from the running collective on
        # the engine may settle a disagreement of the next exchange by name (Disagree); cleared by
        # every exchange, so a collective's own later exchanges never raise it
        self.negotiable = False
        # the generation in which the engine planned the round running now (-1: a collective run
        # alone, retried as it is after a resync); a resync since raises Replan (see run)
        self.plan = -1
        self.pool = ResultPool()  # memory for out-of-place results, recycled
        self.trace = Trace(self.rank, self.size, config.trace_records)
        self.seq = 0
        # seq when the last join (or resync) completed: ranks compare collectives run since then
        self.join_base = 0
        self.gen = 0
        self.dirty = False
        # collectives completed on the present data communicator (a resync's notice says how many
        # the announcing rank completed: Recovery.must_restart)
        self.completed = 0
        self.partial = False      # the collective in progress has written into its caller's input
        self.inflight: Sequence[MPI.Request] = []  # requests of the collective in progress
        self.keep: list[Kept] = []  # send buffers that must outlive their requests
        self._scratch: npt.NDArray[np.uint8] | None = None
        # until the hosts are known (init's own waits), as if every rank were on this one
        self.waits = Waiter(self, _waits.choose(config.wait, self.size, _waits.cores_available()))
        self.headers = HeaderBuffers(self)
        self.agreement = Agreement(self)
        # The control communicator carries only RESYNC notices and Idup, so its collective order
        # can never be disturbed by an abandoned data collective.
        self.ctl = self._poll_dup(comm, "init")
        self.recovery = Recovery(self)
        self.comm = self._poll_dup(self.ctl, "init")
        self.hosts = self._exchange_hostnames()
        self._set_topology()
        self.waits.rechoose(self.local_size)
        self.headers.build()
        self.shm = self._shared_slots()
        # the allreduce's eager limit and algorithm by size, kept while their inputs stay: made
        # after the slots, which are one of them and change only at close (algorithms.eager_limit)
        self.chosen = Chosen()

    # ------------------------------------------------------------------ set-up
    def _poll_dup(self, comm: MPI.Comm, what: str) -> MPI.Comm:
        newcomm, req = comm.Idup()
        self.waits.wait([req], what, self.peers, check_notices=False)
        return newcomm

    def _exchange_hostnames(self) -> list[str]:
        MPI = self.MPI
        name = socket.gethostname().encode()[:255].ljust(256, b"\0")
        out = bytearray(256 * self.size)
        req = self.ctl.Iallgather([name, MPI.BYTE], [out, MPI.BYTE])
        self.waits.wait([req], "init", self.peers, check_notices=False)
        return [bytes(out[i * 256:(i + 1) * 256]).rstrip(b"\0").decode() for i in range(self.size)]

    def _shared_slots(self) -> _shm.SharedSlots | None:
        """``SharedSlots`` when every rank is on this host and sees the others' /dev/shm files.

        Every rank makes a probe file and checks the peers'; one more exchange of the verdicts
        makes every rank decide alike (a "host" name shared by separate containers fails here).
        """
        MPI = self.MPI
        if self.size == 1 or self.local_size != self.size:
            return None
        slots = None
        if _shm.supported():
            if self.local_rank == 0:  # files of ranks SIGKILLed earlier (tmpfs is memory)
                removed = _shm.sweep_stale()
                if removed:
                    log.info("jupyter_ring: removed %d file(s) of dead runtimes from %s", len(removed), _shm.SHM_DIR)
            try:
                slots = _shm.SharedSlots(self.rank, self.size)
            except OSError as exc:
                log.info("jupyter_ring: no shared-memory allreduce on rank %d: %s", self.rank, exc)
        tokens = np.zeros(self.size, np.int64)
        mine = np.array([slots.token if slots else 0], np.int64)
        req = self.ctl.Iallgather([mine, MPI.INT64_T], [tokens, MPI.INT64_T])
        self.waits.wait([req], "init", self.peers, check_notices=False)
        ok = np.array([bool(slots and all(tokens) and slots.sees(tokens.tolist()))], np.int8)
        verdicts = np.zeros(self.size, np.int8)
        req = self.ctl.Iallgather([ok, MPI.INT8_T], [verdicts, MPI.INT8_T])
        self.waits.wait([req], "init", self.peers, check_notices=False)
        if slots is not None:
            slots.remove_probe()  # every rank has looked at it
            if not verdicts.all():
                slots.close()
                slots = None
        return slots

    def _set_topology(self) -> None:
        hosts = self.hosts
        me = hosts[self.rank]
        self.local_rank = sum(1 for r in range(self.rank) if hosts[r] == me)
        self.local_size = hosts.count(me)
        local_ranks = [sum(1 for q in range(r) if hosts[q] == hosts[r]) for r in range(self.size)]
        same_local = [r for r in range(self.size) if local_ranks[r] == self.local_rank]
        self.cross_rank = same_local.index(self.rank)
        self.cross_size = len(same_local)
        # The ring visits each host's ranks together (hosts in order of their first rank, ranks
        # in order within a host), so it crosses the network once per host whatever the
        # launcher's placement (Hydra's -hosts a,b deals ranks round-robin: 0,2 on a, 1,3 on b).
        first: dict[str, int] = {}
        for r, host in enumerate(hosts):
            first.setdefault(host, r)
        self.ring_order = sorted(range(self.size), key=lambda r: (first[hosts[r]], r))
        self.ring_pos = self.ring_order.index(self.rank)

    def set_participants(self) -> None:
        """Peers that joined are left out of headers' replies and of allreduces' data."""
        self.active = [p for p in self.peers if p not in self.joined]
        self.participants = sorted(self.active + [self.rank])
        self.headers.follow(self.active, list(self.joined))

    def name_of(self, ranks: Iterable[int]) -> list[int]:
        """Ranks of this communicator as the user knows them (global ranks in a process set)."""
        return [self.world[q] for q in ranks]

    def close(self) -> None:
        """Release the communicators (local in MPICH and Open MPI: it does not wait for peers)."""
        self.recovery.release_requests()
        self.headers.free()
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        self.chosen = Chosen()  # the slots were one of its inputs: nothing kept outlives them
        self.recovery.release_comms([self.comm, self.ctl])

    def scratch(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A byte buffer of ``nbytes`` for a body's temporary data, reused (grown when too small)."""
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 1), np.uint8)
        return self._scratch[:nbytes]

    # ------------------------------------------------------------------ one collective
    def run(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run one collective with agreement, recovery and retries after a peer's resync."""
        try:
            for _attempt in range(5):
                if self.recovery.due():
                    self.recovery.resync()
                if self.plan >= 0 and self.plan != self.gen:
                    raise Replan()  # before this rank sends anything on the new communicator
                self.partial = False
                try:
                    return self.attempt(fn, *args)
                except Restart:
                    if self.partial:
                        raise RingError(
                            "a peer gave up this collective (interrupted, failed or timed out) after this "
                            "rank had written part of the result into its input tensor (in place), so it "
                            "cannot be retried: the tensor now holds partial results. Recompute it and "
                            "call the collective again on every rank.") from None
            raise RingError("a collective was restarted 5 times by peers' resyncs; the ranks are not "
                            "calling the same collectives. Restart the cluster (%ring restart).")
        finally:
            activity.end()  # also after a resync that failed

    def attempt(self, fn: Callable[..., _T], *args: object) -> _T:
        """One try of a collective, ``fn(*args)``, on a runtime that needs no resync first: what it
        raises leaves the runtime ready for the next one (its requests abandoned and a resync
        due, or nothing in flight after an exchange every rank completed). A peer's resync met
        while waiting raises ``Restart`` (``run`` resyncs and tries again)."""
        try:
            result = fn(*args)
        except BaseException as exc:
            self.gave_up(exc)
            raise
        self.finished()
        return result

    def finished(self) -> None:
        """A collective's try completed: nothing of it is in flight, it is no longer in progress."""
        self.inflight = []
        self.completed += 1
        activity.end()

    def gave_up(self, exc: BaseException) -> None:
        """A collective's try raised ``exc``: leave the runtime ready for the next one."""
        activity.end()
        if isinstance(exc, (CollectiveMismatchError, PeerError, Recut, Disagree)):
            self.inflight = []  # every header and description was consumed: nothing in flight
        else:  # Restart too: what this try sent stays on the old communicator until the resync
            self.recovery.abandon()
