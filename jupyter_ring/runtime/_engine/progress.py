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

This module holds the ``Engine`` (the caller's side: submit, run now, wait, abandon) and its
executor lock; its parts are the queue (``entries``), the rounds (``rounds``), settling by name
(``settling``) and the background thread (``background``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator

from . import collectives
from .background import Background
from .control import Disagree, Recut, Restart
from .core import Runtime
from .entries import AnyLane, Call, Entry, EntryQueue, LaneKey, PreparedLane, Reduce, _R
from .errors import RingError
from .rounds import Rounds
from .settling import Offer, Settler, Verdict, feeding, settle_by_name
from .._observe.report import reporter

# the engine, and the names its users import from here (the numpy API, the adapters, the tests)
__all__ = ["Engine", "ExecutorLock", "Reduce", "Call", "Entry", "AnyLane", "LaneKey", "PreparedLane",
           "Offer", "Verdict", "settle_by_name", "feeding"]

log = logging.getLogger(__name__)

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


class Engine:
    """The queue, the executor lock and the background thread of one runtime (process set).

    Its parts: ``queue`` (the entries not yet run), ``rounds`` (what the executor runs),
    ``settler`` (settling by name), ``background`` (the background thread). The caches of
    signatures live here: ``plans``, ``agreements`` and the prepared ``lanes``.
    """

    def __init__(self, rt: Runtime, handles: Iterator[int], lock: ExecutorLock | None = None) -> None:
        self.rt = rt
        self.config = rt.config
        self.handles = handles                 # shared handle counter (itertools.count)
        self.queue = EntryQueue()              # entries not yet run, in call order
        self.results: dict[int, object] = {}   # handle -> result, or the exception to raise
        # the executor's: owns the communicators. Engines share one when MPI does not allow
        # calls from several threads at once (MPI_THREAD_MULTIPLE; MPICH and Open MPI give it).
        self.lock = lock if lock is not None else ExecutorLock()
        self.done = threading.Condition()      # notified when a background batch finishes
        self.closed = False
        self.waiting = 0                       # threads waiting in wait_background
        self.callers = 0                       # caller threads blocked on this engine (wait, run_now)
        self.plans: dict[tuple[object, ...], collectives.ReducePlan] = {}  # (dtype, op, average, scales) -> ReducePlan
        # (name, shape, plan serial) -> packed agreement (the cache)
        self.agreements: dict[tuple[str | None, tuple[int, ...], int], bytes] = {}
        self.lanes: dict[LaneKey, AnyLane] = {}  # (name= as passed, in place) -> collectives.Lane of its last signature;
        #                                        (kind, name= as passed) -> GatherLane / CastLane
        self.serials = itertools.count(1)      # numbers the plans
        self.rounds = Rounds(self)
        self.settler = Settler(self)
        self.background = Background(self)

    # ------------------------------------------------------------------ caller side
    def submit(self, entry: Entry, nbytes: int = 0) -> int:
        """Queue ``entry``; the background thread runs it once it has waited ``cycle_ms`` (or at
        ``flush()``, or when ``fusion_threshold`` bytes are queued), unless a caller does first."""
        queue = self.queue
        first = queue.add(entry, nbytes)
        background = self.background
        if background.thread is None:
            background.start()
        # (inline, not Background's method: once per queued collective, the fused path's cost)
        if queue.submitted - queue.taken >= self.config.fusion_threshold:
            background.flush()
        elif first and background.sleeping:  # awake, it looks at the queue every cycle by itself
            background.wake.set()
        return entry.handle

    def flush(self) -> None:
        """Ask the background thread to run what is queued now, without waiting for more."""
        if self.queue.entries:
            self.background.flush()

    def run_now(self, entry: Entry) -> object:
        """Run a blocking call: at once in this thread when the engine is idle, else queued."""
        if not self.queue.entries:
            result: object = _BUSY
            try:  # taken inside the try: an interrupt as it is taken must not leak it
                if self.lock.take():
                    self.callers += 1
                    try:
                        result = _BUSY if self.queue.entries else self._short(entry)
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
            return self.rounds.alone(entry)
        except Disagree as disagree:
            settle = disagree.gen
        # outside the handler, so that an error of the settled round does not chain to Disagree
        # (an internal signal: a user's traceback would show it and the runtime's frames)
        return self._settle_first(entry, settle)

    def _settle_first(self, entry: Entry, gen: int) -> object:
        """The peers run other collectives now (the exchange of generation ``gen`` said so):
        queue ``entry`` first (it was called before anything queued since) and settle by name
        with them at once. Returns ``_QUEUED``: its result waits under its handle."""
        self.queue.add_first(entry)
        self.rounds.run(settle=gen)
        return _QUEUED

    def run_lane(self, lane: PreparedLane[_R], full: Callable[..., Entry], *args: object) -> object:
        """A blocking call on its prepared ``lane`` (``collectives.Lane``, ``GatherLane`` or ``CastLane``):
        ``lane.run(rt, *args)`` at once in this thread, with what ``run_now``, ``Rounds.alone`` and
        ``Runtime.run`` do around a collective, in one frame and without an entry.

        ``full(lane, *args)`` makes the call's entry for every other way: queued when the engine
        is busy; the full way at once when a resync is due or the lane's wiring is stale, or
        after a peer's resync restarted it (``Runtime.run`` resyncs first); queued first and
        settled by name when the peers' headers named other collectives.
        """
        rt = self.rt
        entry = None
        result: object
        if not self.queue.entries:
            result = _BUSY
            try:  # taken inside the try: an interrupt as it is taken must not leak it
                if self.lock.take() and not self.queue.entries:
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
        if self.queue.entries:
            return
        try:  # taken inside the try: an interrupt as it is taken must not leak it
            if not self.lock.take():
                return
            rt = self.rt
            if self.queue.entries or rt.dirty or self.closed:
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
                    while took and handle not in results and self.queue.entries:
                        self.rounds.run()
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
        gave_up = bool(self.queue.entries) or self.lock.locked()
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
        self.notify()

    def close(self) -> None:
        """Stop the background thread, giving up the round it runs (call ``fail_queued`` first)."""
        self.closed = True
        self.background.stop()

    def fail_queued(self, error: BaseException) -> None:
        """Fail every queued entry with ``error`` (shutdown, abandon, interrupt)."""
        dropped = self.queue.drop()
        self.settler.unsettled_since = None
        for entry in dropped:
            self.results.setdefault(entry.handle, error)

    def notify(self) -> None:
        """Wake the callers waiting for the background thread's results."""
        if self.waiting:
            with self.done:
                self.done.notify_all()

