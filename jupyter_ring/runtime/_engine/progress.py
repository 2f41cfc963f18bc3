"""The progress engine: a queue of typed entries, rounds of fused batches, a background thread.

Every collective call becomes an entry in one ``Engine`` per process set, in call order:

- ``Reduce``: one allreduce; neighbours with the same ``ReducePlan`` (dtype, op, scale factors)
  are fused into one pass of at most ``fusion_threshold`` bytes;
- ``Call``: any other collective (a grouped allreduce, allgather, broadcast, join ...), run alone.

Whoever holds ``Engine.lock`` owns the communicators and runs *rounds*: a round takes every entry
queued at its start, splits it into batches (fusion; grouping depends only on the entries, so
ranks with the same entries build the same batches) and runs them in order. Three threads of
control can hold the lock:

- a blocking call on an idle engine runs its collective at once in the caller's thread (the short
  path: no hand-off, no added latency);
- ``synchronize()`` of a handle nobody is running yet runs the rounds itself;
- the background thread, woken by the first entry queued, waits ``cycle_ms`` for more entries to
  fuse (or less: ``flush()``, or when ``fusion_threshold`` bytes are queued), then runs rounds while
  the caller computes. ``poll()`` reads the results table: it tells the truth and runs nothing.

Ranks may cut rounds at different points (timing). Every header carries the number of entries of
the sender's round from that collective on (``pending``); when those differ, every rank gets
``Recut`` from the same exchange and all rerun it with the shortest round, so fused batches
always match. Errors of a batch fail that batch and the rest of its round (every rank alike) and
surface at ``synchronize()``. Giving up (an interrupt while waiting for the background thread,
``abandon``) sets ``Runtime.abort``: the executor's next poll raises ``Abandoned``, its requests
are abandoned and the runtime resyncs at the next collective, as after an interrupt in the
caller's own thread; everything queued fails with "cancelled". A round's plan (settled names, a
cut) is made with the peers and holds for one communicator generation: a rank that drops its
round resyncs even with nothing in flight, and after a resync every rank plans again from its
queue (``Replan``), so no rank runs a plan that a peer has left.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import itertools
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar, final

import numpy as np

from . import collectives
from .control import Abandoned, Disagree, Recut, Replan, Restart
from .core import Runtime
from .wire import Prepared
from .._observe.debugger import hold
from .errors import RingError, StallError
from .._observe.report import reporter

__all__ = ["Engine", "Reduce", "Call", "Offer", "Verdict", "settle_by_name", "feeding"]

log = logging.getLogger(__name__)

_IDLE = 0.2  # seconds without work after which the background thread sleeps until a doorbell
_NAP = 20e-6  # seconds the background thread sleeps between polls while the caller computes
_SETTLE_GRACE = 0.05  # seconds every rank must have waited, blocked, before no common name is a mismatch
_SETTLE_NAP = 0.02    # longest sleep between two settling exchanges while some rank computes
_FEED_QUIET = 1.0     # seconds a rank's queue must not grow, while a feeder waits, before it is blocked
_BUSY = object()      # run_now found the engine busy: the call is queued behind the others
_QUEUED = object()    # the call was queued first and the ranks settled by name: wait for its handle


class ExecutorLock:
    """The executor lock of an engine (or of engines that take turns): never re-entered, and
    taken so that an interrupt cannot leak it.

    A KeyboardInterrupt is raised in the main thread at the first check after a call returns, so
    one that lands just as a plain lock's ``acquire`` succeeded is raised before the caller's
    ``try`` begins: the lock stays held and every later collective of that rank waits forever. A
    caller therefore takes it *inside* its ``try`` (``take``) and gives it back in ``finally`` with
    ``give_back``, which asks the lock itself whether this thread holds it (an RLock knows its
    owner; ``take`` refuses a thread that holds it already, so it is never re-entered).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._held = False  # read by ``locked`` only: a hint for waiters, exact once a holder runs

    def take(self, timeout: float = 0.0) -> bool:
        """Take the lock, waiting up to ``timeout`` seconds (0: not at all); False when another
        thread holds it, or this one does."""
        if self._lock._is_owned():  # type: ignore[attr-defined]  # the C RLock's own query
            return False
        if not (self._lock.acquire(timeout=timeout) if timeout > 0 else self._lock.acquire(False)):
            return False
        self._held = True
        return True

    def give_back(self) -> None:
        """Release the lock if this thread holds it (call in ``finally`` after ``take``)."""
        if self._lock._is_owned():  # type: ignore[attr-defined]
            self._held = False
            self._lock.release()

    def locked(self) -> bool:
        """Whether some thread holds the lock (for waiters deciding to keep waiting)."""
        return self._held


class _Feeders:
    """How many threads of this process wait on a collective while other threads of it may still
    queue more on their behalf (the ops of a TF1 session: its inter-op threads submit them while
    earlier ones wait). A waiting caller alone cannot queue more, so no common name among blocked
    ranks is a mismatch at once; with feeders, only once the rank's queue stopped growing."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self.lock:
            self.count += 1
        try:
            yield
        finally:
            with self.lock:
                self.count -= 1


feeding = _Feeders()  # ``with feeding():`` around a wait that other threads may feed


@final  # (lets mypy narrow ``type(entry) is not Reduce`` to a Call)
class Reduce(NamedTuple):
    """A queued allreduce of one tensor: fusable with neighbours of the same plan."""

    handle: int
    name: str                 # for messages and the trace (auto-named when not given)
    explicit: str | None      # the name= the caller passed (str) or None: agreed between ranks
    src: collectives.Array              # flat C-contiguous input
    dst: collectives.Array | None       # flat output: ``src`` in place, None for a new array
    result: collectives.Array | None    # in place: what synchronize() returns (the caller's array)
    shape: tuple[int, ...]
    plan: collectives.ReducePlan

    @property
    def nbytes(self) -> int:
        return self.src.nbytes

    def describe(self) -> collectives.Desc:
        """What the ranks agree on (built only to explain a mismatch)."""
        return collectives.allreduce_desc(self.explicit, self.shape, self.plan.prescale, self.plan.postscale)


@final  # (lets mypy narrow ``type(entry) is not Call`` to a Reduce)
class Call(NamedTuple):
    """A queued collective run alone: ``run(rt)`` returns its result."""

    handle: int
    kind: str
    name: str
    run: Callable[[Runtime], object]


Entry: TypeAlias = Reduce | Call  # what the engine queues
AnyLane: TypeAlias = collectives.Lane | collectives.GatherLane | collectives.CastLane
LaneKey: TypeAlias = tuple[object, object]  # (name= as passed, in place), or (kind, name= as passed)
_R = TypeVar("_R")


class PreparedLane(Protocol[_R]):
    """What ``Engine.run_lane`` runs: ``collectives.Lane``, ``GatherLane`` or ``CastLane`` (``_R``: its result)."""

    @property
    def prepared(self) -> Prepared | None: ...

    def run(self, rt: Runtime, *args: Any, **kwargs: Any) -> _R: ...  # (each lane's own arguments)

    def renew(self, rt: Runtime, result: _R) -> None: ...


@dataclasses.dataclass(slots=True, eq=False)
class Batch:
    """Entries run as one collective: fused ``Reduce`` entries of one plan, or one ``Call``."""

    entries: list[Entry]
    nbytes: int


def plan_batches(entries: Iterable[Entry], limit: int) -> list[Batch]:
    """Fuse each plan's allreduces into batches of at most ``limit`` bytes; calls run alone.

    Batches are ordered by their first entry. Depends only on the entries, so every rank that
    queued the same calls builds the same batches.
    """
    batches: list[Batch]
    open_batch: dict[int, Batch]
    batches, open_batch = [], {}
    for entry in entries:
        if type(entry) is Reduce:
            key = entry.plan.serial
            batch = open_batch.get(key)
            nbytes = entry.src.nbytes
            if batch is None or batch.nbytes + nbytes > limit:
                batch = open_batch[key] = Batch([entry], nbytes)
                batches.append(batch)
            else:
                batch.entries.append(entry)
                batch.nbytes += nbytes
        else:
            batches.append(Batch([entry], 0))
    return batches


class Offer(NamedTuple):
    """What one rank tells the others when their queues disagree (the settling exchange)."""

    blocked: bool             # a caller waits on this engine: it cannot queue more by itself
    waited: float             # seconds since this rank's queue first failed to settle (0: it just did)
    entries: tuple[tuple[str, str], ...]  # (kind, name) of every queued collective, in call order


class Verdict(NamedTuple):
    """What every rank runs after settling, computed alike from every rank's ``Offer``."""

    action: str               # "run", "wait", "mismatch" (every rank blocked) or "stall"
    names: tuple[str, ...] = ()  # "run": the common names, in the lowest rank's order
    missing: dict[str, list[int]] | None = None  # "stall": name -> ranks that have not queued it


def settle_by_name(offers: Sequence[Offer], stall_timeout: float, grace: float = _SETTLE_GRACE) -> Verdict:
    """Horovod's matching: a collective runs once every rank has queued its name.

    ``offers`` is every rank's ``Offer`` in rank order. The names queued on every rank run, in the
    lowest rank's order (their signatures are then checked as always: the same name with another
    shape is a mismatch). With no common name: every rank waits while some rank's caller still
    computes (it may queue the missing ones); once every rank's caller is blocked (and has been for
    ``grace`` seconds, so that another thread of it could have queued more) nobody can, and the
    ranks' first collectives run against each other, which raises the mismatch on every rank; after
    ``stall_timeout`` the ranks stall, naming for each name the ranks that never queued it.
    """
    sets = [{name for _kind, name in offer.entries} for offer in offers]
    common = set.intersection(*sets) if sets else set()
    if common:
        first = next(offer for offer in offers if offer.entries)
        return Verdict("run", tuple(name for _kind, name in first.entries if name in common))
    waited = max(offer.waited for offer in offers)
    if all(offer.blocked for offer in offers) and waited >= grace:
        return Verdict("mismatch")
    if waited > stall_timeout:
        names = {name for names in sets for name in names}
        return Verdict("stall", missing={name: [q for q, names in enumerate(sets) if name not in names]
                                         for name in names})
    return Verdict("wait")


def _kind(entry: Entry) -> str:
    return entry.kind if type(entry) is Call else "allreduce"


def _cancelled(exc: BaseException) -> RingError:
    """The error of entries given up because of ``exc`` (an interrupt, ``Abandoned``, a failure of
    the engine itself: then the entries say so rather than wait forever)."""
    if isinstance(exc, Abandoned):
        return RingError(f"cancelled: {exc}")
    if isinstance(exc, KeyboardInterrupt):
        return RingError("cancelled: the collective was interrupted")
    error = RingError(f"cancelled: the engine failed ({type(exc).__name__}: {exc})")
    error.__cause__ = exc
    return error


def _low_timer_slack() -> None:
    """Let this thread's short sleeps be short (Linux rounds them up by 50 µs by default)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns: this thread only
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


class Engine:
    """The queue, the executor lock and the background thread of one runtime (process set)."""

    def __init__(self, rt: Runtime, handles: Iterator[int], lock: ExecutorLock | None = None) -> None:
        self.rt = rt
        self.config = rt.config
        self.handles = handles                 # shared handle counter (itertools.count)
        self.queue: collections.deque[Entry] = collections.deque()  # entries not yet run, in call order
        self.qlock = threading.Lock()          # guards queue snapshots against appends
        self.results: dict[int, object] = {}   # handle -> result, or the exception to raise
        # the executor's: owns the communicators. Engines share one when MPI does not allow
        # calls from several threads at once (MPI_THREAD_MULTIPLE; MPICH and Open MPI give it).
        self.lock = lock if lock is not None else ExecutorLock()
        self.wake = threading.Event()          # the background thread's doorbell
        self.done = threading.Condition()      # notified when a background batch finishes
        self.submitted = 0                     # bytes ever queued (caller) ...
        self.taken = 0                         # ... and ever taken by rounds (executor)
        self.flush_now = False
        self.thread: threading.Thread | None = None
        self.closed = False
        self.waiting = 0                       # threads waiting in wait_background
        self.plans: dict[tuple[object, ...], collectives.ReducePlan] = {}  # (dtype, op, average, scales) -> ReducePlan
        # (name, shape, plan serial) -> packed agreement (the cache)
        self.agreements: dict[tuple[str | None, tuple[int, ...], int], bytes] = {}
        self.lanes: dict[LaneKey, AnyLane] = {}  # (name= as passed, in place) -> collectives.Lane of its last signature;
        #                                        (kind, name= as passed) -> GatherLane / CastLane
        self.serials = itertools.count(1)      # numbers the plans
        self.since = 0.0                       # when the oldest queued entry was queued
        self.sleeping = True                   # the background thread waits for a doorbell
        self.names: dict[str, int] = {}        # name -> handle of every queued entry (unique)
        self.callers = 0                       # caller threads blocked on this engine (wait, run_now)
        self.unsettled_since: float | None = None  # when settling by name first found no common name
        self.held_checked = 0.0                # when settling last looked for ranks held in a debugger
        # the entries of this rank's last offer, and since when
        self.offered: tuple[tuple[tuple[str, str], ...], float] | None = None

    # ------------------------------------------------------------------ caller side
    def submit(self, entry: Entry, nbytes: int = 0) -> int:
        """Queue ``entry``; the background thread runs it once it has waited ``cycle_ms`` (or at
        ``flush()``, or when ``fusion_threshold`` bytes are queued), unless a caller does first."""
        with self.qlock:
            if entry.name in self.names:
                raise ValueError(
                    f"{_kind(entry)} '{entry.name}': a collective of this name is still pending on this "
                    "rank; collectives are matched between ranks by name (as in Horovod), so two "
                    "pending ones cannot share one. synchronize() the first, or pass another name=")
            self.names[entry.name] = entry.handle
            self.queue.append(entry)
            first = len(self.queue) == 1
        if first:
            self.since = time.perf_counter()
        self.submitted += nbytes
        if self.thread is None:
            self._start()
        if self.submitted - self.taken >= self.config.fusion_threshold:
            self.flush_now = True
            self.wake.set()
        elif first and self.sleeping:  # awake, it looks at the queue every cycle by itself
            self.wake.set()
        return entry.handle

    def flush(self) -> None:
        """Ask the background thread to run what is queued now, without waiting for more."""
        if self.queue:
            self.flush_now = True
            self.wake.set()

    def run_now(self, entry: Entry) -> object:
        """Run a blocking call: at once in this thread when the engine is idle, else queued."""
        if not self.queue:
            result: object = _BUSY
            try:  # taken inside the try: an interrupt as it is taken must not leak it
                if self.lock.take():
                    self.callers += 1
                    try:
                        result = _BUSY if self.queue else self._short(entry)
                    finally:
                        self.callers -= 1
            finally:
                self.lock.give_back()
            if result is _QUEUED:
                return self.wait(entry.handle)
            if result is not _BUSY:
                return result
        self.submit(entry, entry.nbytes if type(entry) is Reduce else 0)
        return self.wait(entry.handle)

    def _short(self, entry: Entry) -> object:
        """``entry`` at once in this thread (executor lock held, nothing queued); ``_QUEUED`` when
        the peers' headers named other collectives and it was settled by name instead."""
        try:
            return self._alone(entry)
        except Disagree as disagree:
            settle = disagree.gen
        # outside the handler, so that an error of the settled round does not chain to Disagree
        # (an internal signal: a user's traceback would show it and the runtime's frames)
        return self._settle_first(entry, settle)

    def _settle_first(self, entry: Entry, gen: int) -> object:
        """The peers run other collectives now (the exchange of generation ``gen`` said so):
        queue ``entry`` first (it was called before anything queued since) and settle by name
        with them at once. Returns ``_QUEUED``: its result waits under its handle."""
        self._queue_first(entry)
        self._round(settle=gen)
        return _QUEUED

    def run_lane(self, lane: PreparedLane[_R], full: Callable[..., Entry], *args: object) -> object:
        """A blocking call on its prepared ``lane`` (``collectives.Lane``, ``GatherLane`` or ``CastLane``):
        ``lane.run(rt, *args)`` at once in this thread, with what ``run_now``, ``_alone`` and
        ``Runtime.run`` do around a collective, in one frame and without an entry.

        ``full(lane, *args)`` makes the call's entry for every other way: queued when the engine
        is busy; the full way at once when a resync is due or the lane's wiring is stale, or
        after a peer's resync restarted it (``Runtime.run`` resyncs first); queued first and
        settled by name when the peers' headers named other collectives.
        """
        rt = self.rt
        entry = None
        result: object
        if not self.queue:
            result = _BUSY
            try:  # taken inside the try: an interrupt as it is taken must not leak it
                if self.lock.take() and not self.queue:
                    redo: BaseException | None = None
                    if lane.prepared is not None and lane.prepared.wiring == rt.headers.wiring and not rt.recovery.due():
                        rt.pending = 1
                        while True:
                            rt.negotiable = True
                            try:
                                result = lane.run(rt, *args)
                            except BaseException as exc:  # Runtime.attempt's handling, one frame less
                                rt.gave_up(exc)
                                if type(exc) is Recut:
                                    continue  # a peer proposed a longer round; it reruns with this one alone
                                if type(exc) is not Disagree and type(exc) is not Restart:
                                    raise
                                redo = exc
                                break
                            rt.finished()
                            return result
                    # a resync is due, the lane's exchange was prepared before the last one, a
                    # peer's resync restarted it (its requests were abandoned), or the peers'
                    # headers named other collectives (Disagree)
                    self.callers += 1  # a caller blocked on the engine (what settling asks)
                    try:
                        entry = full(lane, *args)
                        if type(redo) is Disagree:
                            result = self._settle_first(entry, redo.gen)
                        else:
                            result = self._short(entry)
                            if result is not _QUEUED and not rt.dirty:
                                # on the present wiring, for the next call (the full way's result is what
                                # lane.run returns, which no type ties to the entry: the ignore)
                                lane.renew(rt, result)  # type: ignore[arg-type]
                    finally:
                        self.callers -= 1
            finally:
                self.lock.give_back()
            if result is _QUEUED:
                return self.wait(entry.handle)  # type: ignore[union-attr]  # (made above: it was queued)
            if result is not _BUSY:
                return result
        if entry is None:
            entry = full(lane, *args)
        self.submit(entry, entry.nbytes if type(entry) is Reduce else 0)
        return self.wait(entry.handle)

    def prepare_lane(self, key: LaneKey, make: Callable[..., AnyLane | None], *args: object) -> None:
        """Leave a prepared lane behind under ``key``: ``make(rt, *args)`` (a lane, or None where
        none applies) with the executor lock held; skipped while the engine is busy (a later
        call prepares it)."""
        if self.queue:
            return
        try:  # taken inside the try: an interrupt as it is taken must not leak it
            if not self.lock.take():
                return
            rt = self.rt
            if self.queue or rt.dirty or self.closed:
                return
            lane = make(rt, *args)
            if lane is not None:
                self.keep_lane(key, lane)
        finally:
            self.lock.give_back()

    def keep_lane(self, key: LaneKey, lane: AnyLane) -> None:
        """Keep ``lane`` under ``key`` (name= as passed, in place), in place of any other."""
        if len(self.lanes) > 1024:
            self.lanes.clear()
        self.lanes[key] = lane

    def _queue_first(self, entry: Entry) -> None:
        with self.qlock:
            self.names[entry.name] = entry.handle
            self.queue.appendleft(entry)
        if type(entry) is Reduce:
            self.submitted += entry.nbytes

    def poll(self, handle: int) -> bool:
        """Whether ``handle`` has finished (its result or error is waiting for synchronize)."""
        return handle in self.results

    def wait(self, handle: int) -> object:
        """Wait for ``handle`` (running queued rounds in this thread if nobody is) and return its
        result, or raise its error."""
        results = self.results
        self.callers += 1
        try:
            while handle not in results:
                took = False
                try:  # taken inside the try: an interrupt as it is taken must not leak it
                    took = self.lock.take()
                    while took and handle not in results and self.queue:
                        self._round()
                finally:
                    self.lock.give_back()
                if took:
                    if handle not in results:  # pragma: no cover - a handle of no queued entry
                        raise ValueError(f"handle {handle!r} is not queued on this engine")
                else:
                    self._wait_background(handle)
        finally:
            self.callers -= 1
        result = results.pop(handle)
        if isinstance(result, BaseException):
            raise result
        return result

    def _wait_background(self, handle: int) -> None:
        """The background thread runs a round: wait for it, interruptibly.

        An interrupt here gives up the round (and everything queued) before it propagates: the
        background thread must not go on with tensors the caller is about to reuse.
        """
        self.waiting += 1
        self.rt.waits.nap = 0.0  # the caller only waits now: the background thread may spin
        try:
            with self.done:
                while handle not in self.results and self.lock.locked():
                    self.done.wait(0.05)
                    if reporter.stall_unsent:
                        reporter.flush_stall()  # the background thread may not publish itself
        except KeyboardInterrupt:
            self.abandon("the collective was interrupted")
            raise
        finally:
            self.waiting -= 1

    def discard(self, handle: int) -> None:
        """Forget ``handle``'s result (if any) without raising it."""
        self.results.pop(handle, None)

    def abandon(self, reason: str) -> None:
        """Fail every queued entry with ``RingError("cancelled: ...")`` and stop the running round.

        Called from the caller's thread, never while it holds the executor lock. The executor's
        next poll raises ``Abandoned``; its requests are abandoned and the next collective
        resyncs every rank (also when nothing of the round was in flight here: the peers may be
        running its plan, see ``Replan``), so nothing of the abandoned round reaches a later one.
        """
        rt = self.rt
        gave_up = bool(self.queue) or self.lock.locked()
        rt.abort = reason
        self.fail_queued(RingError(f"cancelled: {reason}"))
        # The executor notices within a poll interval (or when its numpy call returns).
        try:  # taken inside the try: an interrupt as it is taken must not leak it
            while not self.lock.take(timeout=0.5):
                log.info("jupyter_ring: waiting for the background collective to stop (%s)", reason)
            rt.abort = None
            if gave_up:
                # peers may have sent headers of the round given up, or be in it: resync at the
                # next collective, so that every rank drops it alike (Replan)
                rt.dirty = True
        finally:
            self.lock.give_back()
        self._notify()

    def close(self) -> None:
        """Stop the background thread, giving up the round it runs (call ``fail_queued`` first)."""
        self.closed = True
        self.wake.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            self.rt.abort = "the runtime is shutting down"
            thread.join(10.0)
            self.rt.abort = None
        self.thread = None

    def fail_queued(self, error: BaseException) -> None:
        """Fail every queued entry with ``error`` (shutdown, abandon, interrupt)."""
        with self.qlock:
            dropped = list(self.queue)
            self.queue.clear()
            self.names.clear()
        self.unsettled_since = None
        for entry in dropped:
            self.results.setdefault(entry.handle, error)
        self.taken = self.submitted

    # ------------------------------------------------------------------ background thread
    def _start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="jupyter_ring-engine", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        """Every cycle while there is work, run what has waited a cycle; sleep when idle.

        An entry runs here once it is ``cycle_ms`` old (a caller that synchronizes at once runs it
        itself, without a hand-off), or at once after ``flush()`` or a full fusion buffer. After
        ``_IDLE`` seconds without work the thread blocks until the next ``submit`` rings.
        """
        _low_timer_slack()
        wake = self.wake
        idle_since = time.perf_counter()
        while not self.closed:
            if self.sleeping:
                wake.wait()
            else:  # at most _IDLE: a cycle_ms changed meanwhile takes effect by then
                wake.wait(min(self.config.cycle_ms / 1000.0, _IDLE))
            wake.clear()
            self.sleeping = False
            if self.closed:
                break
            cycle = self.config.cycle_ms / 1000.0  # read after the wait: the value set now counts
            now = time.perf_counter()
            if not self.queue:
                if now - idle_since > _IDLE:
                    self.sleeping = True
                    if self.queue:  # queued before it could see sleeping: do not block
                        self.sleeping = False
                continue
            idle_since = now
            if not (self.flush_now or now - self.since >= cycle
                    or self.submitted - self.taken >= self.config.fusion_threshold):
                continue
            self.flush_now = False
            if not self.lock.take():  # a caller runs the rounds itself
                continue
            self.rt.waits.nap = 0.0 if self.waiting else _NAP
            try:
                while self.queue and not self.closed:
                    try:
                        self._round()
                    except BaseException:  # noqa: BLE001 - recorded in the results by _round
                        pass
            finally:
                self.lock.give_back()
            self._notify()

    def _notify(self) -> None:
        if self.waiting:
            with self.done:
                self.done.notify_all()

    # ------------------------------------------------------------------ executor (lock held)
    def _alone(self, entry: Entry) -> object:
        """One entry as a round of its own: a blocking call on an idle engine runs it at once in
        the caller's thread (the short path), and so does a round of one entry."""
        rt = self.rt
        rt.pending = 1
        if type(entry) is not Reduce:
            while True:
                rt.negotiable = True
                try:
                    return rt.run(entry.run, rt)
                except Recut:
                    continue  # a peer proposed a longer round; it reruns with this one alone
        src = entry.src
        plan = entry.plan
        key = (entry.explicit, entry.shape, plan.serial)
        own = self.agreements.get(key)
        if own is None:  # the response cache: a signature's agreement is packed once
            if len(self.agreements) > 4096:
                self.agreements.clear()
            own = self.agreements[key] = rt.agreement.own("allreduce", plan.dtype, plan.op, -1, src.size,
                                                      entry.describe())
        body: Callable[..., collectives.Array]
        args: tuple[object, ...]
        if src.nbytes <= rt.headers.eager_limit:  # the payload rides in the agreement message
            body, args = collectives.eager_one, (rt, src, entry.dst, plan, entry.name, entry.describe, own)
        else:
            body, args = collectives.allreduce_one, (rt, collectives.Member(src, entry.dst), plan, entry.name, entry.describe, own)
        while True:
            rt.negotiable = True
            try:
                out = rt.run(body, *args)
            except Recut:
                continue
            return entry.result if entry.result is not None else out.reshape(entry.shape)

    def _round(self, settle: int | None = None) -> None:
        """Run every entry queued now, fused into batches; their results land in ``results``.

        When the ranks' headers disagree (``Disagree``, every rank alike), or ``settle`` (the
        generation of the exchange that disagreed) says they did, the ranks first settle by name
        what runs (``_settle``); that round runs as agreed.
        """
        todo: list[Entry] | None
        with self.qlock:
            todo = list(self.queue)
        if not todo:
            return

        if len(todo) == 1 and settle is None:
            return self._round_of_one(todo[0])
        rt = self.rt
        finished: set[int] = set()
        limit = self.config.fusion_threshold
        settled = False
        plan = rt.gen  # the generation this round's plan holds in (see Replan)
        try:
            while todo or settle is not None:
                if settle is not None:
                    todo = self._settle(finished, settle)
                    settle, settled = None, todo is not None
                    if todo is None:  # a resync came first: start over, on the new generation
                        todo, plan = self._unfinished(finished), rt.gen
                    if not todo:
                        break
                batches = plan_batches(todo, limit)
                try:
                    left = len(todo)
                    for index, batch in enumerate(batches):
                        if rt.abort is not None:
                            raise Abandoned(rt.abort)
                        rt.pending = left  # entries of this round from this batch on
                        rt.negotiable = not settled
                        rt.plan = plan
                        try:
                            self._run_batch(batch)
                        except (Recut, Disagree, Replan, Abandoned, KeyboardInterrupt):
                            raise
                        except Exception as exc:  # noqa: BLE001 - surfaces at synchronize()
                            # the batch and the rest of the round fail alike on every rank
                            for rest in batches[index:]:
                                for entry in rest.entries:
                                    self.results.setdefault(entry.handle, exc)
                                    finished.add(entry.handle)
                            todo = []
                            break
                        for entry in batch.entries:
                            finished.add(entry.handle)
                        left -= len(batch.entries)
                    else:
                        todo = []
                except Recut as recut:
                    # every rank runs the shortest round proposed; the rest waits for the next
                    todo = [e for e in todo if e.handle not in finished][:recut.count]
                except Disagree as disagree:
                    settle = disagree.gen
                except Replan:
                    # a rank gave up a collective of this plan (or dropped the round) and every
                    # rank resynced: every rank plans again from its queue, as a new round
                    todo, plan, settled = self._unfinished(finished), rt.gen, False
        except BaseException as exc:
            for entry in todo:  # type: ignore[union-attr]  # (a list: None from _settle is replaced at once)
                self.results.setdefault(entry.handle, _cancelled(exc))
            self._drop_queue(exc)
            raise
        finally:
            rt.plan = -1
            if finished:
                self._remove(finished)
            self._notify()

    def _unfinished(self, finished: set[int]) -> list[Entry]:
        """The queued entries not in ``finished``, in call order (a round planned again)."""
        with self.qlock:
            return [e for e in self.queue if e.handle not in finished]

    def _settle(self, finished: set[int], gen: int) -> list[Entry] | None:
        """The ranks' queues disagree: agree by name on what runs now (one exchange, every rank).

        Returns the entries to run as the round, in the agreed order; none while the ranks wait
        for each other (after a nap: the executor then starts a new round, which every rank does
        alike), or after failing the queued entries with a stall. None when a resync came first
        (``gen`` is the disagreeing exchange's generation): the disagreeing header was a message
        of a collective a peer abandoned, not what the peer runs now; the round starts over.
        """
        rt = self.rt
        with self.qlock:
            mine = [entry for entry in self.queue if entry.handle not in finished]
        since = self.unsettled_since
        now = time.perf_counter()
        waited = 0.0 if since is None else now - since
        if waited >= 0.25 and now - self.held_checked >= 0.25:
            # a rank held in a debugger (this one included) is not a stall: the clock starts over
            self.held_checked = now
            if hold.anyone():
                self.unsettled_since, waited = now, 0.0
        entries = tuple((_kind(e), e.name) for e in mine)
        if self.offered is None or self.offered[0] != entries:
            self.offered = (entries, now)
        # with feeders (see _Feeders) a waiting caller is blocked only once the queue stopped growing
        blocked = self.callers > 0 and (feeding.count == 0 or now - self.offered[1] >= _FEED_QUIET)
        offer = Offer(blocked, waited, entries)
        rt.pending = 1
        rt.negotiable = False
        data = np.frombuffer(pickle.dumps(offer), np.uint8)

        def exchange(rt: Runtime) -> list[Offer]:
            # every rank sends its Offer
            return collectives.allgather_object(rt, data, "jupyter_ring.settle", None)  # type: ignore[return-value]

        rt.plan = gen  # a resync since the disagreement: it was with a round a peer gave up
        try:
            offers = rt.run(exchange, rt)
        except Replan:
            return None
        except Recut:
            # A header of another round met this exchange. Every rank that saw the disagreement
            # settles now, so it was sent before its sender gave that round up: its sender
            # resyncs at its next collective. This rank resyncs too, at once: every rank then
            # plans again on the new generation (Replan), none acts on what it read here.
            rt.dirty = True
            return None
        verdict = settle_by_name(offers, self.config.stall_timeout)
        if verdict.action == "run":
            self.unsettled_since = None
            by_name = {entry.name: entry for entry in mine}
            return [by_name[name] for name in verdict.names]
        if verdict.action == "mismatch":
            # nobody can queue more: the first collectives meet; their exchange explains how
            # they differ, on every rank (a rank with nothing queued has no blocked caller)
            self.unsettled_since = None
            return mine[:1]
        if verdict.action == "stall":
            self._stall(mine, offers, verdict.missing, waited)  # type: ignore[arg-type]  # (set on a stall)
            return []
        if since is None:
            self.unsettled_since = time.perf_counter()
        self._nap(min(_SETTLE_NAP, max(1e-3, waited / 4)))
        return []

    def _nap(self, seconds: float) -> None:
        """Sleep between settling exchanges; the caller's thread stays interruptible, the
        background thread stops when its round is given up."""
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            if self.rt.abort is not None:
                raise Abandoned(self.rt.abort)
            time.sleep(min(1e-3, seconds))

    def _stall(self, mine: list[Entry], offers: Sequence[Offer], missing: dict[str, list[int]], waited: float) -> None:
        """No name was queued on every rank for ``stall_timeout``: fail this rank's queued entries,
        each naming the ranks that never queued it and what they queued instead."""
        rt = self.rt
        timeout = self.config.stall_timeout
        for entry in mine:
            absent = rt.name_of(missing.get(entry.name, ()))
            instead = "; ".join(f"rank {rt.world[q]}: " + (", ".join(f"{k} '{n}'" for k, n in offers[q].entries[:5])
                                                          or "nothing")
                                for q in missing.get(entry.name, ()))
            error = StallError(
                f"{_kind(entry)} '{entry.name}': rank {rt.world[rt.rank]} waited {waited:.1f} s for rank(s) "
                f"{absent} to call it, which never did (stall timeout {timeout:g} s); they queued other "
                f"collectives ({instead}). Collectives are matched between ranks by name: every rank must "
                "call the same ones, with the same names. Raise JUPYTER_RING_STALL_TIMEOUT if a rank is "
                "just slow.", absent)
            self.results.setdefault(entry.handle, error)
        self._remove({entry.handle for entry in mine})
        self.unsettled_since = None

    def _round_of_one(self, entry: Entry) -> None:
        handle = entry.handle
        try:
            if self.rt.abort is not None:
                raise Abandoned(self.rt.abort)
            result = self._alone(entry)
        except Disagree as disagree:
            result = disagree
        except Exception as exc:  # noqa: BLE001 - surfaces at synchronize()
            result = exc
        except BaseException as exc:
            self.results.setdefault(handle, _cancelled(exc))
            self._drop_queue(exc)
            raise
        if type(result) is Disagree:  # settled outside the handler: no chain to Disagree
            return self._round(settle=result.gen)
        self.results.setdefault(handle, result)
        self._remove({handle})
        self._notify()

    def _drop_queue(self, exc: BaseException) -> None:
        """Interrupted (this thread) or abandoned (another): the queue is gone, the rest cancelled.

        The peers may be in the round this rank drops (they settled it with this rank, or cut it
        with it): the runtime resyncs at its next collective, which makes them plan again
        (``Replan``) instead of waiting in a round that this rank left.
        """
        self.fail_queued(_cancelled(exc))
        self.rt.dirty = True
        if isinstance(exc, Abandoned):
            self.rt.abort = None
        self._notify()

    def _remove(self, finished: set[int]) -> None:
        """Take the finished entries out of the queue (a prefix of it, unless a round was cut)."""
        with self.qlock:
            queue = self.queue
            taken = 0
            names = self.names
            while queue and queue[0].handle in finished:
                entry = queue.popleft()
                names.pop(entry.name, None)
                if type(entry) is Reduce:
                    taken += entry.src.nbytes
            if any(entry.handle in finished for entry in queue):
                kept: collections.deque[Entry] = collections.deque()
                for entry in queue:
                    if entry.handle not in finished:
                        kept.append(entry)
                        continue
                    names.pop(entry.name, None)
                    if type(entry) is Reduce:
                        taken += entry.src.nbytes
                self.queue = kept
        self.taken += taken

    def _run_batch(self, batch: Batch) -> None:

        rt = self.rt
        entries = batch.entries
        results = self.results
        first = entries[0]
        if type(first) is Call:
            results.setdefault(first.handle, rt.run(first.run, rt))
            return
        plan = first.plan
        # (a batch whose first entry is a Reduce holds Reduces only (plan_batches): the ignores below)
        if len(entries) == 1:
            desc = collectives.allreduce_desc(first.explicit, first.shape, plan.prescale, plan.postscale)
            name = first.name
        else:

            members = tuple((e.explicit, e.shape) for e in entries)  # type: ignore[union-attr]
            desc = collectives.allreduce_desc(None, (sum(e.src.size for e in entries),),  # type: ignore[union-attr, misc]
                                    plan.prescale, plan.postscale, members)
            name = f"fused[{first.name} +{len(entries) - 1}]"
        outs = rt.run(collectives.allreduce, rt, [collectives.Member(e.src, e.dst) for e in entries],  # type: ignore[union-attr]
                      plan, name, desc)
        for entry, out in zip(entries, outs):
            results.setdefault(entry.handle,
                               entry.result if entry.result is not None  # type: ignore[union-attr]
                               else out.reshape(entry.shape))  # type: ignore[union-attr]
