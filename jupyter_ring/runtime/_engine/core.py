"""``Runtime``: the communicators, agreement, polled point-to-point waits, resynchronisation.

The collective algorithms (eager, shared memory, the ring) are bodies in ``collectives.py`` that
``Runtime.run`` runs; this module holds what every body stands on.

One ``Runtime`` object per process holds the communicators. Every collective goes through
``Runtime.run``:

1. **Agreement.** Each rank sends every other rank a 48-byte header (kind, dtype, op, root,
   count, a fingerprint of name/shape/scales) and, when the payload is small, the payload itself
   in the same message. Every rank compares all headers, so every rank sees a disagreement and
   raises the same ``CollectiveMismatchError``. Small collectives finish here: one round trip.
2. **Data.** Larger payloads move over point-to-point messages: a pipelined ring reduce-scatter +
   allgather for allreduce, direct sends for the rest. When every rank is on one host, an
   allreduce above ``shm_threshold`` goes through shared-memory slots instead (``shm``), if
   every rank offers its slot in the agreement message.
3. **Waiting.** Every wait is a nonblocking request (or a shared-memory counter) polled from
   Python: poll briefly (spinning, or giving the core away where ranks outnumber cores: ``_waits``),
   then back off. SIGINT therefore raises KeyboardInterrupt within
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
import os
import pickle
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Literal, NamedTuple, NoReturn, TypedDict, TypeVar, cast

import numpy as np
import numpy.typing as npt

from . import shm as _shm, waits as _waits
from .errors import CollectiveMismatchError, PeerError, RankLostError, RingError, StallError
from .lost import lost_ranks
from .pool import ResultPool
from .._observe.report import reporter
from .._observe.trace import Trace
from .._observe.debugger import hold
from .._observe.where import activity

if TYPE_CHECKING:  # mpi4py.MPI is imported when a Runtime is made: importing it initialises MPI
    from mpi4py import MPI

    from .config import Config

__all__ = ["Runtime", "Sum", "Average", "Min", "Max", "Product", "Adasum", "OP_NAMES", "Recut",
           "Disagree", "Replan", "Abandoned", "Restart", "PeerMsg", "JoinNote", "Prepared"]

log = logging.getLogger(__name__)

# Reduce ops (Horovod's names; Adasum is named so that ported code gets a clear error).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

KINDS = ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "barrier",
         "broadcast_object", "allgather_object", "resync", "timeline", "error", "join",
         "process_set")
POISON = 10  # KIND_CODE["error"]: "I failed before I could join; here is why"
JOIN = 11    # KIND_CODE["join"]: "I have called join(): leave me out until every rank has"
KIND_CODE = {kind: code for code, kind in enumerate(KINDS)}

# Requests given up while still active (persistent header sends: see Runtime._discard), kept
# with the buffers they send from until the process exits. A peer may still drain the message,
# or MPI_Finalize flush it, and MPI then reads the buffer; mpi4py frees a request's buffer with
# the request object, so dropping one (at close, or when the cached sends are rebuilt) let MPI
# read freed memory: a rank that had passed every check crashed at exit (SIGSEGV, seen once in
# CI after rt_abandon's abandoned rounds). A handful per abandoned round: never freed.
_HELD: list[MPI.Prequest] = []

DTYPES = [np.dtype(t) for t in (
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128)]
DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}

# kind, dtype, op, pad, root, count, fingerprint: the region every rank must agree on ...
_AGREE = struct.Struct("<BBBxiqQ")
# ... then flags, generation, pending (entries of the sender's round from this collective on:
# the engine's cut, see Recut; a JOIN notice puts its shared-memory tick here), aux (per-rank
# value: rows, bytes, shared-memory offer; a JOIN notice: its collective count) and region (an
# in-place allreduce of registered memory: where the tensor lies, for the peers to map; else 0).
_HEADER = struct.Struct("<BBBxiqQBxxxIqqq")
_TAIL = struct.Struct("<BxxxIqqq")
HEADER_BYTES = _HEADER.size
_AGREE_END = _AGREE.size
FLAG_PAYLOAD = 1

TAG_HEADER, TAG_DATA, TAG_DESC, TAG_RESYNC = 11, 12, 13, 14
# After this long without a collective, the check before the next one tests the notice request
# as many times as a backlog of peers' messages can need (see Runtime.resync_due)
_IDLE_SECONDS = 0.001
_MAIN_THREAD = threading.main_thread().ident
_DESC_BYTES = 1 << 16

# What the ranks agree on, labelled (("name", ...), ("shape", ...)): fingerprinted into the
# header, and compared field by field to explain a mismatch. A collective may pass a function
# that makes it (only read on a mismatch) when it passes the packed agreement too.
Desc = tuple[tuple[str, object], ...]
_T = TypeVar("_T")
# a send buffer kept until its request completes: a header, a pickled description, a notice
_Kept = bytearray | bytes | npt.NDArray[np.int64]


class Restart(Exception):
    """A peer asked for a resync while this rank waited: retry the collective on a fresh comm."""


class Recut(Exception):
    """The ranks' engines proposed rounds of different lengths: every rank runs the first ``count``.

    Raised on every rank by the same exchange (every rank sees every header), after it completed,
    so nothing is in flight; the engine re-plans its round and runs the collective again.
    """

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


class Disagree(Exception):
    """The ranks' headers name different collectives: the engine settles what runs by name.

    Raised on every rank by the same exchange (when headers are not all alike, every rank sees
    one unlike its own), after it completed, so nothing is in flight. Only where the engine
    allows it (``Runtime.negotiable``); elsewhere a disagreement is a mismatch, explained.
    ``gen`` is the communicator's generation: a resync before the settling exchange means a header
    came from a collective a peer abandoned (and announces now), and the round starts over.
    """

    def __init__(self, gen: int) -> None:
        super().__init__(gen)
        self.gen = gen


class Replan(Exception):
    """A resync came between the engine's plan of its round and this collective: stop before sending.

    A round's plan (the names settled, the cut of a ``Recut``) holds for the communicator
    generation it was made in (``Runtime.plan``): a resync means some rank gave up a collective
    of it, or dropped the round, and every rank moves to the next generation before it sends
    anything there. So every rank plans again from its queue (negotiable, every entry pending),
    as at the start of a round, and no rank runs a batch of a plan that a peer has left.
    """


class Abandoned(BaseException):
    """The thread waiting for this collective gave it up (interrupt, abandoned cell): stop now.

    A BaseException, as KeyboardInterrupt is: ``Runtime.run`` abandons the requests in flight and
    marks the runtime for a resync, exactly as after an interrupt in the calling thread.
    """


class PeerMsg(NamedTuple):
    """What a peer sent in the agreement exchange, besides the agreed fields."""

    aux: int                 # per-rank value: rows (allgather), bytes, shared-memory offer
    payload: memoryview | None  # the eager payload, or None
    region: int              # the tensor's registered memory (SharedSlots.locate), or 0


class Prepared(NamedTuple):
    """The header exchange of one eager signature, made once (``Runtime.prepare``): what a
    prepared lane sends and where it finds the peers' headers, valid while ``wiring`` is the
    runtime's (a resync, a join or a change of the header requests makes a new wiring)."""

    wiring: int              # Runtime.wiring when prepared
    header: bytes            # the whole header this rank sends on this signature (pending 1)
    reqs: list[MPI.Prequest]  # the persistent header receives of the active peers, then the sends
    sends: list[MPI.Prequest]  # the persistent sends alone (what an interrupt abandons)
    peer_headers: tuple[memoryview, ...]  # each active peer's received header, a view into its eager buffer
    expected: tuple[bytes, ...]  # the whole header each active peer sends on it (allreduce: ``header``)

    @property
    def agreement(self) -> bytes:
        """The 24 bytes every rank sends alike on this exchange (``Runtime.agreement``)."""
        return self.header[:_AGREE_END]


class JoinNote(NamedTuple):
    """A peer's join notice: how many collectives it had run since the last join, and its shared-memory tick."""

    collectives: int
    tick: int


class Description(TypedDict):
    """One rank's full description of a collective, exchanged to explain a mismatch."""

    kind: str
    name: str
    op: str | int            # the op's name (OP_NAMES), or the unknown value itself
    root: int
    dtype: str | None
    desc: Desc


def _fingerprint(*parts: object) -> int:
    text = repr(parts).encode()
    return (zlib.crc32(text) << 32) | zlib.adler32(text)


def _reducer(op: int, dtype: np.dtype) -> np.ufunc:
    """The elementwise numpy function for ``op`` on ``dtype`` (checked, with a clear error)."""
    if op == Adasum:
        raise ValueError("op=Adasum is not supported by jupyter_ring; use op=Average or op=Sum")
    if op not in OP_NAMES:
        raise ValueError(f"unknown reduce op {op!r}; use one of ring.Sum, Average, Min, Max, Product")
    if dtype.kind == "b":
        if op in (Min, Product):
            return np.logical_and
        if op == Max:
            return np.logical_or
        raise TypeError(f"op={OP_NAMES[op]} is not defined for bool arrays; cast to uint8 or use op=Max (any) / Min (all)")
    if dtype.kind == "c" and op in (Min, Max):
        raise TypeError(f"op={OP_NAMES[op]} is not defined for complex arrays ({dtype}); use Sum, Average or Product")
    if op in (Sum, Average):
        return np.add
    return {Min: np.minimum, Max: np.maximum, Product: np.multiply}[op]


class Runtime:
    """The communicators, topology, trace and pending work of one initialised runtime."""

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
        # until the hosts are known (init's own waits), as if every rank were on this one
        self._wait_policy = _waits.choose(config.wait, self.size, _waits.cores_available())
        self.joined: dict[int, JoinNote] = {}  # peer -> its notice: peers that called join(), left out of allreduces
        self.active = self.peers  # peers not joined: the ones headers are exchanged with
        self._waits_on = self.peers + self.peers
        self.participants = list(range(self.size))  # ranks whose data an allreduce reduces
        self.pending = 1          # entries of the engine's round from the running collective on
        # the engine may settle a disagreement of the next exchange by name (Disagree); cleared by
        # every exchange, so a collective's own later exchanges never raise it
        self.negotiable = False
        # the generation in which the engine planned the round running now (-1: a collective run
        # alone, retried as it is after a resync); a resync since raises Replan (see run)
        self.plan = -1
        self.nap = 0.0            # seconds a background wait sleeps between polls (see poll)
        self.pool = ResultPool()  # memory for out-of-place results, recycled
        self.trace = Trace(self.rank, self.size, config.trace_records)
        self.seq = 0
        # seq when the last join (or resync) completed: ranks compare collectives run since then
        self.join_base = 0
        self.gen = 0
        self.dirty = False
        self.partial = False      # the collective in progress has written into its caller's input
        self._inflight: Sequence[MPI.Request] = []  # requests of the collective in progress
        # (requests, buffers) of collectives given up, freed at resync
        self._abandoned: list[tuple[Sequence[MPI.Request], list[_Kept]]] = []
        self._keep: list[_Kept] = []  # send buffers that must outlive their requests
        self._pending_dup: tuple[MPI.Comm, MPI.Request] | None = None  # (newcomm, request) of a resync in progress
        self._notices: dict[int, set[int]] = {}  # resync target -> set of ranks that announced it
        self._notice_sends: list[MPI.Request] = []
        self._drains: list[MPI.Request] = []  # poison sends and the receives that drain peers' headers
        self._scratch: npt.NDArray[np.uint8] | None = None
        # the eager buffers, made by _eager_buffers (below) before any use: empty until then
        self._eager: dict[int, bytearray] = {}
        self._sendbuf = bytearray()
        self._header_recvs: list[MPI.Prequest] = []
        self._header_recv: dict[int, MPI.Prequest] = {}
        # message length -> persistent sends of the header buffer, per active peer
        self._header_sends: dict[int, list[MPI.Prequest]] = {}
        self._agree_cache: dict[tuple[str, np.dtype | None, int, int, int, Desc], bytes] = {}
        self.wiring = 0           # +1 whenever header buffers, requests or active peers change (Prepared)
        self._retired: list[MPI.Comm] = []  # data communicators left by resyncs, freed at close (see resync)
        self._stuck: list[MPI.Prequest] = []  # active persistent sends given up, kept until close (see _discard)

        # The control communicator carries only RESYNC notices and Idup, so its collective order
        # can never be disturbed by an abandoned data collective.
        self.ctl = self._poll_dup(comm, "init")
        # Notices are taken by a matched probe (MPI_Improbe, then MPI_Mrecv), never by a posted
        # MPI.ANY_SOURCE receive: across hosts MPICH's posted wildcard receive (ch4: a shared-memory
        # request with a UCX partner) was seen to stop matching after a few resyncs that followed
        # interrupts, with notices waiting that MPI_Iprobe found: no rank then heard a notice, and
        # every resync stalled (tests/multihost/test_resync_hosts.py). A probe posts nothing.
        self._notice_buf = np.zeros(1, np.int64)
        self._status = MPI.Status()
        self._highest_notice = 0
        self._checked = 0.0       # when resync_due last ran (perf_counter)
        self.comm = self._poll_dup(self.ctl, "init")
        self.hosts = self._exchange_hostnames()
        self._set_topology()
        self._wait_policy = _waits.choose(config.wait, self.local_size, self._wait_policy.cores)
        self._eager_buffers()
        self.shm = self._shared_slots()

    # ------------------------------------------------------------------ set-up
    def _poll_dup(self, comm: MPI.Comm, what: str) -> MPI.Comm:
        newcomm, req = comm.Idup()
        self._wait([req], what, self.peers, check_notices=False)
        return newcomm

    def _exchange_hostnames(self) -> list[str]:
        MPI = self.MPI
        name = socket.gethostname().encode()[:255].ljust(256, b"\0")
        out = bytearray(256 * self.size)
        req = self.ctl.Iallgather([name, MPI.BYTE], [out, MPI.BYTE])
        self._wait([req], "init", self.peers, check_notices=False)
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
        self._wait([req], "init", self.peers, check_notices=False)
        ok = np.array([bool(slots and all(tokens) and slots.sees(tokens.tolist()))], np.int8)
        verdicts = np.zeros(self.size, np.int8)
        req = self.ctl.Iallgather([ok, MPI.INT8_T], [verdicts, MPI.INT8_T])
        self._wait([req], "init", self.peers, check_notices=False)
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

    def _eager_buffers(self) -> None:
        # Receive buffers (one per peer) and the send buffer of the agreement message. Reused by
        # every collective: negotiate() returns only after its sends completed, and callers
        # consume the received payloads before the next collective.
        capacity = HEADER_BYTES + self.config.eager_bytes
        self._eager = {p: bytearray(capacity) for p in self.peers}
        self._sendbuf = bytearray(capacity)
        self.eager_limit = self.config.eager_bytes
        # numpy views of these buffers: (dtype, count) -> payload_view, (peer, dtype, count) -> peer_payload
        self._views: dict[tuple[np.dtype, int] | tuple[int, np.dtype, int], np.ndarray] = {}
        # Persistent receives for the headers: started by every collective, rebuilt at resync.
        self._free_persistent()
        self._header_recv = {p: self.comm.Recv_init(self._eager[p], p, TAG_HEADER) for p in self.peers}
        self._header_recvs = [self._header_recv[p] for p in self.active]

    def _persistent_sends(self, message: memoryview) -> list[MPI.Prequest]:
        """Persistent sends of the header buffer's first ``len(message)`` bytes to every active
        peer, made once per message length (a loop's collectives reuse theirs: no request is
        built per call) and freed when the buffers or the active peers change."""
        if len(self._header_sends) >= 64:
            self._free_sends()
        sends = self._header_sends[len(message)] = [self.comm.Send_init(message, p, TAG_HEADER)
                                                    for p in self.active]
        return sends

    def _free_sends(self) -> None:
        # every prepared exchange holds these requests (or the buffers and peers they follow)
        self.wiring += 1
        for sends in self._header_sends.values():
            for req in sends:
                try:
                    if req.Test():
                        req.Free()
                    else:  # an abandoned round's, still active: its buffer must outlive it
                        _HELD.append(req)
                except self.MPI.Exception:  # pragma: no cover - freed with its communicator
                    pass
        self._header_sends = {}

    def _set_participants(self) -> None:
        """Peers that joined are left out of headers' replies and of allreduces' data."""
        self.active = [p for p in self.peers if p not in self.joined]
        self._waits_on = self.active + self.active + list(self.joined)  # negotiate's requests' peers
        self.participants = sorted(self.active + [self.rank])
        self._header_recvs = [self._header_recv[p] for p in self.active]
        self._free_sends()

    def name_of(self, ranks: Iterable[int]) -> list[int]:
        """Ranks of this communicator as the user knows them (global ranks in a process set)."""
        return [self.world[q] for q in ranks]

    def _free_persistent(self) -> None:
        for req in getattr(self, "_header_recv", {}).values():
            try:
                if not req.Test():
                    req.Cancel()
                    req.Wait()
                req.Free()
            except self.MPI.Exception:  # pragma: no cover - already freed with its communicator
                pass
        self._header_recvs = []
        self._header_recv = {}
        self._free_sends()

    def close(self) -> None:
        """Release the communicators (local in MPICH and Open MPI: it does not wait for peers)."""
        MPI = self.MPI
        for req in [*self._notice_sends, *self._inflight, *self._drains]:
            self._discard(req)
        for reqs, _ in self._abandoned:
            for req in reqs:
                self._discard(req)
        self._abandoned.clear()
        self._free_persistent()
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        for comm in self._retired + [self.comm, self.ctl]:
            if comm != MPI.COMM_NULL:
                _drain(comm, MPI)
                try:
                    comm.Free()
                except MPI.Exception:  # pragma: no cover - freeing is best effort at shutdown
                    pass
        self._retired = []
        _HELD.extend(self._stuck)  # still active: their buffers must outlive them (see _HELD)
        self._stuck = []

    # ------------------------------------------------------------------ waiting
    def _wait(self, reqs: Sequence[MPI.Request], what: str | Callable[[], str], peers_of: Sequence[int],
              check_notices: bool = True, missing: Callable[[], Sequence[int]] | None = None) -> None:
        """Wait for every request, polling from Python so that signals are handled.

        ``peers_of[i]`` is the rank request ``i`` waits on, used to name missing ranks, unless
        ``missing`` (a function returning the ranks) says better.
        """
        Testall = self.MPI.Request.Testall
        if Testall(reqs):
            return
        if missing is None:
            missing = lambda: self._missing(reqs, peers_of)  # noqa: E731
        self.poll(lambda: Testall(reqs), what() if callable(what) else what, missing, check_notices)

    def wait_policy(self) -> _waits.WaitPolicy:
        """The wait in force (``config.wait`` resolved for this host's ranks and cores)."""
        if self._wait_policy.requested != self.config.wait:  # the live config was changed
            self._wait_policy = _waits.choose(self.config.wait, self.local_size, self._wait_policy.cores)
        return self._wait_policy

    def poll(self, done: Callable[[], object], what: str, missing: Callable[[], Sequence[int]],
             check_notices: bool = True) -> None:
        """Call ``done()`` until it is true: poll at first, then back off (signals are handled).

        How the first polls share the core is the wait policy's (``_waits``). A peer's RESYNC
        notice raises ``Restart``; after ``stall_timeout`` ``StallError`` names the ranks that
        ``missing()`` returns.
        """
        start = time.perf_counter()
        spin_until = start + _waits.SPIN_SECONDS
        # The engine's background thread, while the caller computes, naps between polls instead of
        # spinning: a thread spinning in Python keeps the GIL, and the caller (whose torch and
        # numpy calls let go of it) would wait a whole switch interval (5 ms) to get it back.
        nap = self.nap if threading.get_ident() != _MAIN_THREAD else 0.0
        # ranks outnumber cores: the peer this rank waits for may need this very core
        yields = self.wait_policy().yields
        while time.perf_counter() < spin_until:
            if done():
                return
            if nap:
                time.sleep(nap)
            elif yields:
                os.sched_yield()
        config = self.config
        warned = False
        delay = _waits.FIRST_NAP
        named = -1.0  # when the ranks waited on were last told to the activity record (%ring where)
        # The stall clock: seconds waited since a peer was last seen held in a debugger (a rank
        # at a breakpoint is not a stall). Checked at the same 0.25 s cadence, from 0.25 s on,
        # so a collective that completes sooner never lists the folder.
        stall_from = 0.0
        held_told: list[int] = []
        held_now = False
        while True:
            if done():
                if warned or held_told:
                    reporter.stalled(None, (), 0.0)
                activity.waiting(())
                return
            if self.abort is not None:
                raise Abandoned(self.abort)
            if check_notices and self._poll_notices() > self.gen:
                raise Restart()
            waited = time.perf_counter() - start
            if waited - named >= 0.25:
                named = waited
                gone = lost_ranks.among(r for r in self.world if r != self.world[self.rank])
                if gone:  # a dead peer never arrives: give the collective up now (issue 34)
                    if warned or held_told:
                        reporter.stalled(None, (), 0.0)
                    activity.waiting(())
                    raise RankLostError(
                        f"{what}: rank(s) {gone} died, and rank {self.world[self.rank]} gave the collective "
                        "up. Under elastic.run the state goes back to its last commit and training goes on "
                        "once the rank is replaced; elsewhere the cell fails.", gone)
                absent_ranks = missing()
                activity.waiting(absent_ranks)
                if waited >= 0.25:
                    held = hold.peers()
                    held_now = bool(held)
                    if held:
                        stall_from = waited
                        # said when the stall warning would have been: a short pause stays quiet
                        if held != held_told and waited > config.stall_warning:
                            held_told = held
                            self._tell_held(what, absent_ranks, held, waited)
                    elif held_told:
                        held_told = []
                        reporter.stalled(None, (), 0.0)
            stalled = waited - stall_from
            if stalled > config.stall_warning and not warned:
                warned = True
                absent = self.name_of(missing())
                log.warning("jupyter_ring: rank %d has waited %.0f s in %s for rank(s) %s",
                            self.world[self.rank], stalled, what, absent)
                reporter.stalled(what, absent, stalled)
            if stalled > config.stall_timeout:
                absent = self.name_of(missing())
                reporter.stalled(None, (), 0.0)
                raise StallError(
                    f"{what}: rank {self.world[self.rank]} waited {stalled:.1f} s for rank(s) {absent}, "
                    f"which never arrived (stall timeout {config.stall_timeout:g} s). Every rank must "
                    "call the same collectives in the same order; a rank that raised, skipped a call or "
                    "died leaves the others waiting. Raise JUPYTER_RING_STALL_TIMEOUT if a rank is just "
                    "slow.", absent)
            time.sleep(delay)
            # a rank held in a debugger waits for a person: nap longer (SIGINT still ends a nap)
            delay = _waits.HELD_NAP if held_now else _waits.next_nap(delay, waited)

    def _tell_held(self, what: str, missing: Sequence[int], held: Sequence[int], waited: float) -> None:
        """Say, once per change, that this wait is on ranks held in a debugger: not a stall."""
        absent = self.name_of(missing)
        ranks = ", ".join(map(str, held))
        note = f"rank {ranks} is in the debugger" if len(held) == 1 else f"ranks {ranks} are in the debugger"
        log.warning("jupyter_ring: rank %d has waited %.0f s in %s for rank(s) %s; %s (not a stall: "
                    "the stall timeout counts again once it leaves)", self.world[self.rank], waited,
                    what, absent, note)
        reporter.stalled(what, absent, waited, held)

    @staticmethod
    def _missing(reqs: Sequence[MPI.Request], peers_of: Sequence[int]) -> list[int]:
        return sorted({peers_of[i] for i, req in enumerate(reqs) if not req.Test()})

    def _poll_notices(self, tests: int = 1) -> int:
        """Collect RESYNC notices (probing up to ``tests`` times while none is waiting); return
        the highest generation any peer asked for."""
        MPI = self.MPI
        status = self._status
        improbe = self.ctl.Improbe
        for _ in range(tests):
            message = improbe(MPI.ANY_SOURCE, TAG_RESYNC, status)
            if message is not None:
                break
        else:  # the common case, once per collective
            return self._highest_notice
        buf = self._notice_buf
        while message is not None:
            message.Recv([buf, MPI.INT64_T])  # matched: it is this rank's, already arrived
            self._notices.setdefault(int(buf[0]), set()).add(status.Get_source())
            message = improbe(MPI.ANY_SOURCE, TAG_RESYNC, status)
        self._highest_notice = max(self._notices, default=0)
        return self._highest_notice

    def _discard(self, req: MPI.Request) -> None:
        MPI = self.MPI
        if req == MPI.REQUEST_NULL:
            return
        if isinstance(req, MPI.Prequest):
            # A persistent header send (the persistent receives are cancelled by _free_persistent)
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

    # ------------------------------------------------------------------ resync
    def resync(self) -> None:
        """Move every rank to a fresh data communicator (polled Idup on the control comm)."""
        MPI = self.MPI
        target = self.gen + 1
        if self._pending_dup is None:
            note = np.array([target], np.int64)
            self._keep.append(note)
            self._notice_sends = [self.ctl.Isend([note, MPI.INT64_T], p, TAG_RESYNC) for p in self.peers]
            self._pending_dup = self.ctl.Idup()
        newcomm, req = self._pending_dup
        peers = self.peers
        def not_announced() -> list[int]:
            self._poll_notices()
            return [p for p in peers if p not in self._notices.get(target, set())]

        try:
            self._wait([req], "resync after an abandoned collective", [], check_notices=False,
                       missing=not_announced)
        except StallError:
            self._poll_notices()
            arrived = self._notices.get(target, set())
            missing = self.name_of(p for p in peers if p not in arrived)
            raise StallError(
                f"resync: rank {self.world[self.rank]} waited for rank(s) {missing} to recover from the "
                "previous failed collective; they have not called a collective since. Call the next "
                "collective on every rank (or restart the cluster with %ring restart).", missing) from None
        self._pending_dup = None
        old = self.comm
        for reqs, _ in self._abandoned + [(self._drains, None)]:
            for r in reqs:
                self._discard(r)
        self._abandoned.clear()
        self._drains = []
        self._keep.clear()
        self.comm = newcomm
        self.gen = target
        self.dirty = False
        self._notices = {t: s for t, s in self._notices.items() if t > target}
        self._highest_notice = max(self._notices, default=0)
        # join notices were messages on the old communicator: a joined rank announces itself anew
        self.joined = {}
        self.join_base = self.seq
        self._eager_buffers()
        self._set_participants()
        # Not freed: MPICH gives a freed communicator's context id to the next one made, and a
        # message of the abandoned collective still queued here (a peer's header, sent before it
        # gave up) would then match a receive of a later collective on the fresh communicator.
        self._retired.append(old)

    def _abandon(self) -> None:
        self._abandoned.append((self._inflight, self._keep[:]))
        self._inflight = []
        self.dirty = True

    def resync_due(self) -> bool:
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
        if self.dirty:
            return True
        now = time.perf_counter()
        tests = 4 + 4 * len(self.peers) if now - self._checked > _IDLE_SECONDS else 1
        self._checked = now
        return self._poll_notices(tests) > self.gen

    def run(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run one collective with agreement, recovery and retries after a peer's resync."""
        try:
            for _attempt in range(5):
                if self.resync_due():
                    self.resync()
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
        self._inflight = []
        activity.end()

    def gave_up(self, exc: BaseException) -> None:
        """A collective's try raised ``exc``: leave the runtime ready for the next one."""
        activity.end()
        if isinstance(exc, (CollectiveMismatchError, PeerError, Recut, Disagree)):
            self._inflight = []  # every header and description was consumed: nothing in flight
        else:  # Restart too: what this try sent stays on the old communicator until the resync
            self._abandon()

    # ------------------------------------------------------------------ agreement
    def agreement(self, kind: str, dtype: np.dtype | None, op: int, root: int, count: int, desc: Desc) -> bytes:
        """The 24 bytes every rank must send alike for this collective (cached per signature)."""
        key = (kind, dtype, op, root, count, desc)
        own = self._agree_cache.get(key)
        if own is None:
            if len(self._agree_cache) > 4096:
                self._agree_cache.clear()
            dtype_code = DTYPE_CODE.get(dtype, 255) if dtype is not None else 255
            own = self._agree_cache[key] = _AGREE.pack(KIND_CODE[kind], dtype_code, op, root, count,
                                                       _fingerprint(*desc))
        return own

    def prepare(self, own: bytes, nbytes: int, aux: int = 0,
                peers: Mapping[int, tuple[int, int]] | None = None) -> Prepared | None:
        """The header exchange of an eager collective whose agreement is ``own``, made once for a
        prepared lane: this rank sends ``aux`` and a payload of ``nbytes`` (-1: none), and
        ``peers`` maps each active peer to the (aux, payload bytes) it sends (None: what this rank
        sends). None when it cannot be made (a peer has joined, the payload does not fit
        ``eager_bytes``)."""
        if self.joined or nbytes > self.eager_limit:
            return None
        message = self._message(self._sendbuf, own, aux, None, 1, 0, preset=nbytes)
        header = bytes(message[:HEADER_BYTES])
        sends = self._header_sends.get(len(message))
        if sends is None:
            sends = self._persistent_sends(message)
        recvs = list(self._header_recvs)
        views = tuple(memoryview(self._eager[p])[:HEADER_BYTES] for p in self.active)
        if peers is None:
            expected = (header,) * len(self.active)
        else:
            expected = tuple(self.peer_header(header, *peers[p]) for p in self.active)
        return Prepared(self.wiring, header, recvs + sends, sends, views, expected)

    def peer_header(self, header: bytes, aux: int, nbytes: int) -> bytes:
        """The whole header a peer sends on the prepared exchange whose own header is ``header``
        when its ``aux`` and payload size (-1: none) are these (``prepare``'s ``peers``)."""
        flags = FLAG_PAYLOAD if 0 <= nbytes <= self.eager_limit else 0
        return header[:_AGREE_END] + _TAIL.pack(flags, self.gen, 1, aux, 0)

    def run_prepared(self, prep: Prepared, kind: str, name: str, dtype: np.dtype | None, op: int, root: int,
                     desc: Desc | Callable[[], Desc]) -> dict[int, PeerMsg] | None:
        """``negotiate`` for a prepared exchange (the caller wrote the payload into
        ``payload_view()``): the same messages, the same waits, the same checks.

        Returns None when every peer sent the header the lane expects of it (the lane's case);
        else the peers' headers went through every check of ``negotiate`` (which raise as
        there) and the peer -> ``PeerMsg`` dict says what they sent instead (another allgather
        row count, a peer's join notice: reduce over ``participants`` then).
        """
        activity.begin(kind, name)
        header = prep.header
        self._sendbuf[:HEADER_BYTES] = header
        self.seq += 1
        reqs = prep.reqs
        if reqs:
            MPI = self.MPI
            MPI.Prequest.Startall(reqs)
            self._inflight = prep.sends  # the persistent receives are cancelled by resync, not _abandon
            if not MPI.Request.Testall(reqs):
                self._wait(reqs, lambda: f"{kind} '{name}'", self._waits_on)
        if prep.peer_headers == prep.expected:  # views against bytes: compared byte for byte
            self.negotiable = False
            return None
        return self._check_headers(kind, name, dtype, op, root, desc, header[:_AGREE_END], 1)

    def negotiate(self, kind: str, name: str, dtype: np.dtype | None, op: int, root: int, count: int,
                  desc: Desc | Callable[[], Desc], aux: int = 0, payload: npt.NDArray[np.uint8] | None = None,
                  per_peer: Mapping[int, tuple[int, npt.NDArray[np.uint8] | None]] | None = None,
                  pending: int | None = None, own: bytes | None = None, region: int = 0,
                  preset: int | None = None) -> dict[int, PeerMsg]:
        """Exchange headers (and eager payloads) with every peer and check agreement.

        ``desc`` is the tuple fingerprinted for agreement (shape, scales, explicit name ...), or
        ``own`` its packed agreement when the caller cached it. ``payload`` is a byte view sent
        along when it fits ``eager_bytes`` (or ``preset`` the size of one the caller wrote into
        ``payload_view()`` already); ``per_peer`` maps a peer to its own ``(aux, payload)``
        (alltoall). ``pending`` is the number of entries of the engine's round from this one on:
        ranks whose rounds differ raise ``Recut`` with the shortest (every rank sees every
        header, so every rank raises it). Returns a dict peer -> ``PeerMsg`` for every peer
        taking part (peers that called ``join()`` are left out once their notice arrives).
        """
        activity.begin(kind, name)
        comm = self.comm
        if own is None:  # a caller that passes a function for desc passes own too
            own = self.agreement(kind, dtype, op, root, count, cast(Desc, desc))
        if pending is None:
            pending = self.pending
        self.seq += 1
        peers = self.active
        recvs = self._header_recvs
        self.MPI.Prequest.Startall(recvs)
        # the cached persistent sends (Prequest), or this call's own Isends
        sends: Sequence[MPI.Request] | None
        message: memoryview | None
        if per_peer is None:
            message = self._message(self._sendbuf, own, aux, payload, pending, region, preset)
            sends = self._header_sends.get(len(message))
            if sends is None:
                sends = self._persistent_sends(message)
            self.MPI.Prequest.Startall(sends)
        else:
            sends = []
            for p in peers:
                peer_aux, data = per_peer[p]
                buf = bytearray(HEADER_BYTES + (data.nbytes if data is not None else 0))
                self._keep.append(buf)
                sends.append(comm.Isend(self._message(buf, own, peer_aux, data, pending), p, TAG_HEADER))
            # (a bytearray here; numpy's stubs give ndarray, also _Kept, __buffer__ on Python 3.12+ only)
            message = memoryview(self._keep[-1])[:HEADER_BYTES] if self._keep else None  # type: ignore[arg-type]
        if self.joined:
            # joined ranks reply to nothing, but see that this rank still runs collectives
            header = memoryview(self._sendbuf)[:HEADER_BYTES] if per_peer is None else message
            sends = sends + [comm.Isend(header, p, TAG_HEADER) for p in self.joined]  # not the cached list
        reqs = recvs + sends
        self._inflight = sends  # the persistent receives are cancelled by resync, not _abandon
        self._wait(reqs, lambda: f"{kind} '{name}'", self._waits_on)
        if self._keep:
            self._keep.clear()
        return self._check_headers(kind, name, dtype, op, root, desc, own, pending)

    def _check_headers(self, kind: str, name: str, dtype: np.dtype | None, op: int, root: int,
                       desc: Desc | Callable[[], Desc], own: bytes, pending: int) -> dict[int, PeerMsg]:
        """Read every active peer's header of the exchange just completed: joins, poison, a
        mismatch (``Disagree`` where negotiable, else explained), rounds of other lengths
        (``Recut``). Returns peer -> ``PeerMsg``."""
        peers = self.active
        result: dict[int, PeerMsg] = {}
        mismatch = False
        cut = pending            # every rank runs the shortest round proposed
        recut = False
        newly_joined = False
        for p in peers:
            buf = self._eager[p]
            code = buf[0]
            if code == JOIN:
                flags, _gen, tick, collectives, _region = _TAIL.unpack_from(buf, _AGREE_END)
                self.joined[p] = JoinNote(collectives, tick)
                newly_joined = True
                continue
            view = memoryview(buf)
            if view[:_AGREE_END] != own:
                mismatch = True
            flags, _gen, peer_pending, peer_aux, peer_region = _TAIL.unpack_from(buf, _AGREE_END)
            if code != POISON and peer_pending != pending:
                recut = True
                cut = min(cut, peer_pending)
            result[p] = PeerMsg(peer_aux, view[HEADER_BYTES:] if flags & FLAG_PAYLOAD else None, peer_region)
        if newly_joined:
            self._set_participants()
        negotiable, self.negotiable = self.negotiable, False
        if mismatch:
            self._raise_poison(kind, name)
            if negotiable and not self.joined:
                # different collectives at this place: the engines match their queues by name
                raise Disagree(self.gen)
        if recut:
            # rounds of different lengths fuse different batches: not a mismatch; every rank
            # (the one with the shortest round too) runs the exchange again for the shortest
            raise Recut(cut)
        if mismatch:
            self._explain_mismatch(kind, name, dtype, op, root, desc() if callable(desc) else desc)
        if self.joined and kind != "allreduce":
            # a mismatch (join against another collective), raised on every active rank after every
            # header was consumed: no resync, so the collective still counts for join's last rank
            joined = self.name_of(sorted(self.joined))
            raise CollectiveMismatchError(
                f"{kind} '{name}': rank(s) {joined} called join() and wait for the others to join; "
                "only allreduce can run until every rank has joined (as in Horovod). Call join() on "
                "this rank too, or run this collective before any rank joins.")
        return result

    def join(self, name: str) -> int:
        """This rank has no more data: serve as a left-out peer until every rank has joined.

        Sends a JOIN notice (its collective count and shared-memory tick) to every peer: peers in a
        collective take it as this rank's header and leave it out of the data; joined peers wait for
        it. Then receives the headers of the peers still running collectives (ignored: they reduce
        without this rank) until every peer's JOIN has arrived. Returns the last rank to join
        (most collectives run since the previous join; the highest rank among equals), the same
        on every rank.
        """
        MPI = self.MPI
        comm = self.comm
        tick = self.shm.ticks(self.gen) if self.shm is not None else 0
        self.seq += 1
        # collectives since the last join completed, the same starting point on every rank (seq
        # itself differs by the collectives some ranks ran while others had joined)
        count = self.seq - self.join_base
        own = _AGREE.pack(JOIN, 255, 0, -1, 0, 0)
        message = self._message(self._sendbuf, own, count, None, tick)
        sends = [comm.Isend(message, p, TAG_HEADER) for p in self.peers]
        waiting = [p for p in self.peers if p not in self.joined]
        reqs = {p: self._header_recv[p] for p in waiting}
        MPI.Prequest.Startall(list(reqs.values()))
        self._inflight = sends
        progress = [False]

        def arrived() -> bool:
            for p in list(reqs):
                if not reqs[p].Test():
                    continue
                progress[0] = True
                buf = self._eager[p]
                if buf[0] == JOIN:
                    _flags, _gen, peer_tick, collectives, _region = _TAIL.unpack_from(buf, _AGREE_END)
                    self.joined[p] = JoinNote(collectives, peer_tick)
                    del reqs[p]
                else:  # a peer still running collectives: its header, sent to a joined rank
                    reqs[p].Start()
            return not reqs or progress[0]

        while reqs:
            progress[0] = False
            self.poll(arrived, f"join '{name}' (waiting for every rank to join)", lambda: sorted(reqs))
        self._wait(sends, f"join '{name}'", self.peers)
        notes = dict(self.joined)
        notes[self.rank] = JoinNote(count, tick)
        last = max(notes, key=lambda q: (notes[q].collectives, q))
        if self.shm is not None:
            self.shm.align(self.gen, max(note.tick for note in notes.values()) + 1)
        self.joined = {}
        self.join_base = self.seq
        self._set_participants()
        return self.world[last]

    def poison(self, kind: str, name: str, exc: BaseException) -> None:
        """This rank cannot join ``kind`` (bad arguments): tell every peer why, without waiting.

        Peers waiting in the collective raise ``PeerError`` at once instead of stalling. Their
        headers for it are drained by receives posted now: MPI matches a source's messages to
        receives in posting order, so the next collective's receives get the next headers and
        the communicator stays clean without a resync.
        """
        if self.size == 1:
            return
        self._drains = [req for req in self._drains if not req.Test()]
        text = f"{type(exc).__name__}: {exc}".encode()[:len(self._sendbuf) - HEADER_BYTES]
        own = _AGREE.pack(POISON, 255, 0, -1, 0, _fingerprint(kind, name))
        self.seq += 1
        buf = bytearray(HEADER_BYTES + len(text))
        message = self._message(buf, own, len(text), np.frombuffer(text, np.uint8), -1)
        capacity = len(self._sendbuf)
        for p in self.active:
            self._drains.append(self.comm.Isend(message, p, TAG_HEADER))
            self._drains.append(self.comm.Irecv(bytearray(capacity), p, TAG_HEADER))

    def _raise_poison(self, kind: str, name: str) -> None:
        for p in self.active:
            buf = self._eager[p]
            if buf[0] == POISON:
                _flags, _gen, _pending, nbytes, _region = _TAIL.unpack_from(buf, _AGREE_END)
                reason = bytes(buf[HEADER_BYTES:HEADER_BYTES + nbytes]).decode(errors="replace")
                q = self.world[p]
                raise PeerError(
                    f"{collective_title(kind, name)}: rank {q} could not join this collective and "
                    f"raised {reason}. Fix the call on rank {q}; every rank raises here so that none "
                    "is left waiting.", q, reason)

    def fits_eager(self, nbytes: int) -> bool:
        """Whether a payload travels inside the agreement message (capacity fixed at init/resync)."""
        return nbytes <= self.eager_limit

    def _message(self, buf: bytearray, own: bytes, aux: int, data: npt.NDArray[np.uint8] | None,
                 pending: int = 1, region: int = 0, preset: int | None = None) -> memoryview:
        """Header (+ payload when it fits ``eager_bytes``) packed into ``buf``; a view to send.

        ``data`` is a byte array copied in; or ``preset`` is the size of a payload the caller wrote
        into ``payload_view()`` already (a fused batch gathers its members there, no extra copy).
        """
        nbytes = preset if preset is not None else (data.nbytes if data is not None else -1)
        # capacity was fixed at init/resync, the same on every rank
        flags = FLAG_PAYLOAD if 0 <= nbytes <= self.eager_limit else 0
        buf[:_AGREE_END] = own
        _TAIL.pack_into(buf, _AGREE_END, flags, self.gen, pending, aux, region)
        if not flags:
            return memoryview(buf)[:HEADER_BYTES]
        if preset is None:
            assert data is not None  # nbytes is data's (a payload is flagged)
            np.frombuffer(buf, np.uint8, nbytes, HEADER_BYTES)[:] = data
        return memoryview(buf)[:HEADER_BYTES + nbytes]

    def payload_view(self, dtype: np.dtype, count: int) -> np.ndarray:
        """The send buffer's payload region as ``count`` items of ``dtype`` (for ``preset``).

        Views are kept per (dtype, count) until the buffers change (resync): an allreduce made in
        a loop does not build its views again.
        """
        key = (dtype, count)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 256:
                self._views.clear()
            view = self._views[key] = np.frombuffer(self._sendbuf, dtype, count, HEADER_BYTES)
        return view

    def peer_payload(self, peer: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Peer ``peer``'s eager payload as ``count`` items of ``dtype`` (kept like payload_view)."""
        key = (peer, dtype, count)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 256:
                self._views.clear()
            view = self._views[key] = np.frombuffer(self._eager[peer], dtype, count, HEADER_BYTES)
        return view

    def _explain_mismatch(self, kind: str, name: str, dtype: np.dtype | None, op: int, root: int,
                          desc: Desc) -> NoReturn:
        """Slow path: exchange full descriptions so every rank raises the same precise error."""
        mine: Description = {"kind": kind, "name": name, "op": OP_NAMES.get(op, op), "root": root,
                             "dtype": str(dtype) if dtype is not None else None, "desc": desc}
        comm = self.comm
        data = pickle.dumps(mine)
        if len(data) > _DESC_BYTES:  # a huge group: describe its first tensors only
            # the members' label is "tensors (name, shape)" (allreduce_desc): cut their list
            mine["desc"] = tuple((label, value if not label.startswith("tensors")
                                  else cast("tuple[object, ...]", value)[:100]) for label, value in desc)
            data = pickle.dumps(mine)[:_DESC_BYTES]
        peers = self.active
        bufs = {p: bytearray(_DESC_BYTES) for p in peers}
        recvs = [comm.Irecv(bufs[p], p, TAG_DESC) for p in peers]
        sends = [comm.Isend(data, p, TAG_DESC) for p in peers]
        self._inflight = recvs + sends
        self._keep.append(data)
        self._wait(recvs + sends, f"{kind} '{name}' (comparing descriptions)", peers + peers)
        descs = {self.world[self.rank]: mine}
        for p in peers:
            descs[self.world[p]] = pickle.loads(bufs[p])  # pickle stops at its STOP opcode: padding is ignored
        raise CollectiveMismatchError(describe_mismatch(descs))

    # ------------------------------------------------------------------ waits on data
    def _wait_data(self, reqs: Sequence[MPI.Request], what: str, peer: int) -> None:
        self._wait(reqs, what, [peer] * len(reqs))

    def scratch(self, nbytes: int) -> npt.NDArray[np.uint8]:
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 1), np.uint8)
        return self._scratch[:nbytes]


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


def collective_title(kind: str, name: str) -> str:
    """``allreduce 'fc1.weight'`` for a user's name; ``allreduce (unnamed)`` for the name the
    runtime made up (``allreduce.noname.3``), which only adds noise to a message."""
    if name.startswith(f"{kind}.noname."):
        return f"{kind} (unnamed)"
    return f"{kind} '{name}'"


def describe_mismatch(descs: Mapping[int, Description]) -> str:
    """One message naming the op, the ranks and the values that differ."""
    ranks = sorted(descs)
    ref = descs[ranks[0]]
    title = collective_title(ref["kind"], ref["name"])
    field: Literal["kind", "name", "dtype", "op", "root"]
    values: dict[int, object]
    for field, label in (("kind", "called"), ("name", "name"), ("dtype", "dtype"), ("op", "reduce op"),
                         ("root", "root rank")):
        values = {r: descs[r][field] for r in ranks}
        if len(set(map(repr, values.values()))) > 1:
            return _differ(title, label, values, _hint(label))
    # desc tuples: first element is a tuple of labelled fields
    for index, (label, _value) in enumerate(ref["desc"]):
        values = {}
        for r in ranks:
            entries = descs[r]["desc"]
            values[r] = entries[index][1] if index < len(entries) else None
        if len(set(map(repr, values.values()))) > 1:
            return _differ(title, label, values, _hint(label))
    lengths = {r: len(descs[r]["desc"]) for r in ranks}
    return _differ(title, "description length", lengths, _hint(""))


def _fmt(value: object) -> str:
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return "(" + ", ".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, str):
        return value
    return repr(value)


def _differ(title: str, label: str, values: Mapping[int, object], hint: str) -> str:
    groups: dict[str, list[int]] = {}
    for r, value in values.items():
        groups.setdefault(_fmt(value), []).append(r)
    parts = [f"{value} on {_ranks(rs)}" for value, rs in groups.items()]
    text = f"{title}: {label} {parts[0]} but " + ", ".join(parts[1:])
    return text + ". " + hint


def _ranks(rs: Sequence[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _hint(field: str) -> str:
    return {
        "called": "Every rank must call the same collectives in the same order.",
        "name": "Every rank must pass the same name= to the same collective.",
        "dtype": "Cast the tensor to one dtype on every rank before the collective.",
        "shape": "Every rank must pass a tensor of the same shape (allgather: same trailing dims).",
        "number of tensors": "Every rank must pass the same number of tensors.",
        "root rank": "Pass the same root_rank on every rank.",
        "reduce op": "Pass the same op= on every rank.",
        "trailing shape": "allgather/alltoall tensors may differ in dim 0 only; the other dims must match.",
    }.get(field, "Every rank must call the collective with the same arguments.")
