"""Horovod's process sets for the framework adapters: collectives among a subset of the ranks.

``add_process_set([0, 2])`` is called by every rank (as in Horovod); the member ranks get their
own runtime over an MPI sub-communicator, with the same agreement, interrupt and stall handling
as the global one, and its own queue of async work. Non-members keep an object whose
``included()`` is False. Collectives on a set run at once on its runtime (their handles are
complete when returned); the global set is the ordinary runtime with its queue and fusion.

Until the runtime's engine takes ``process_set=`` itself, this module is the one place that
knows how: adapters call :func:`run_on` and never look at the sub-runtimes.
"""

import contextlib
import threading

from .. import runtime as _ring
from . import _api

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "run_on", "on",
           "lock", "init_process_sets", "registered", "is_global", "set_rank"]

# Collectives of one process go through the runtime one at a time: TF runs independent graph ops
# on several threads, and the runtime is not re-entrant.
lock = threading.RLock()


class ProcessSet:
    """A set of ranks that run collectives together: pass it as ``process_set=`` to a collective.

    ``ProcessSet([0, 2])`` then ``add_process_set(ps)`` (every rank calls it), or
    ``add_process_set([0, 2])`` directly. ``size()``, ``rank()`` (relative to the set) and
    ``included()`` answer once it is registered; roots (``root_rank=``) stay global ranks.
    """

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        try:
            from mpi4py import MPI

            is_comm = isinstance(ranks_or_comm, MPI.Comm)
        except ImportError:  # pragma: no cover - mpi4py is a dependency
            is_comm = False
        if is_comm:
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError(f"ProcessSet takes a list of ranks or an mpi4py communicator, got "
                             f"{type(ranks_or_comm).__name__}") from None
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of int ranks, got {ranks_or_comm!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks {ranks_or_comm!r} repeat a rank; list each rank once")
        self.ranks = ranks

    def _invalidate(self):
        self.process_set_id = None

    def size(self):
        """Number of ranks in the set (None until registered)."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return _ring.size()
        return len(self.ranks)

    def rank(self):
        """This rank's index in the set (None until registered; ValueError if not a member)."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return _ring.rank()
        me = _ring.rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not part of {self}; only ranks {self.ranks} have a rank in it")
        return self.ranks.index(me)

    def included(self):
        """Whether this rank belongs to the set (None when the set has no ranks yet)."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return _ring.rank() in self.ranks

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _Member:
    """A registered set on one rank: its ranks and, on members, the runtime over its communicator."""

    __slots__ = ("ranks", "process")

    def __init__(self, ranks, process):
        self.ranks = ranks
        self.process = process   # an _api process state over the set's Runtime; None on non-members


class _Registry:
    """The process sets of the current ``init()``: dropped when the runtime is started anew."""

    def __init__(self):
        self.world = None        # the global Runtime these sets belong to
        self.sets = {}           # process_set_id -> _Member
        self.next_id = 1

    def current(self):
        rt = _api._rt()
        if rt is not self.world:
            self.close()
            self.world = rt
            global_process_set.ranks = list(range(rt.size))
        return self

    def close(self):
        for member in self.sets.values():
            if member.process is not None and member.process.rt is not None:
                member.process.rt.close()
        self.sets = {}
        self.next_id = 1
        self.world = None


_registry = _Registry()


def _ranks_of(process_set, where):
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError(f"{where}: a process set made from an MPI communicator is not supported; "
                                  "build it from a list of ranks: ProcessSet([0, 2])")
    return process_set


def add_process_set(process_set):
    """Register a set of ranks (every rank calls it, with the same ranks); returns the ProcessSet."""
    with lock:
        registry = _registry.current()
        process_set = _ranks_of(process_set, "add_process_set")
        n = _ring.size()
        ranks = process_set.ranks
        bad = [r for r in ranks if not 0 <= r < n]
        if bad or not ranks:
            raise ValueError(f"add_process_set: ranks {ranks} must be a non-empty list of ranks in 0..{n - 1}")
        if ranks == list(range(n)) or any(m.ranks == ranks for m in registry.sets.values()):
            raise ValueError(f"Attempted to add a duplicate process set: {process_set} (a set with ranks "
                             f"{ranks} exists already; reuse it, or remove_process_set() it first)")
        # every rank is here before the blocking communicator split (the barrier is polled, so a
        # rank that never calls add_process_set gives a StallError instead of a hang)
        _ring.barrier()
        rt = registry.world
        member = rt.rank in ranks
        sub = rt.comm.Split(0 if member else rt.MPI.UNDEFINED, rt.rank)
        process = None
        if member:
            from ._core import Runtime

            process = _api._new_process(Runtime(sub, rt.config))
        process_set.process_set_id = registry.next_id
        registry.sets[registry.next_id] = _Member(list(ranks), process)
        registry.next_id += 1
        return process_set


def remove_process_set(process_set):
    """Unregister a set (every rank calls it); False for the global set or an unknown one."""
    with lock:
        registry = _registry.current()
        if not isinstance(process_set, ProcessSet) or process_set.process_set_id in (None, 0):
            return False
        member = registry.sets.pop(process_set.process_set_id, None)
        process_set._invalidate()
        if member is None:
            return False
        if member.process is not None:
            member.process.rt.close()
        return True


def registered(process_set_id):
    """The registered ProcessSet with this id, or None (for Horovod's ``*_op(process_set_id)``)."""
    member = _registry.current().sets.get(process_set_id)
    if member is None:
        return None
    found = ProcessSet(member.ranks)
    found.process_set_id = process_set_id
    return found


def init_process_sets(process_sets):
    """``init(process_sets=[...])``: register each (Horovod's static process sets)."""
    for ps in process_sets or ():
        add_process_set(ps)


def _member(process_set, where):
    registry = _registry.current()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{where}: process_set= takes a ProcessSet (hvd.add_process_set([...])), got "
                        f"{type(process_set).__name__}")
    member = registry.sets.get(process_set.process_set_id)
    if member is None or process_set.process_set_id is None:
        raise ValueError(f"{where}: {process_set} is not registered; call hvd.add_process_set(...) on every "
                         "rank first (or it was removed)")
    if member.process is None:
        raise ValueError(f"{where}: rank {_ring.rank()} is not part of {process_set}; only ranks "
                         f"{member.ranks} may call collectives on it")
    return member


def is_global(process_set):
    """Whether ``process_set`` means every rank (the default)."""
    return process_set is None or process_set is global_process_set or process_set.process_set_id == 0


@contextlib.contextmanager
def on(process_set, where):
    """Inside, the numpy API (``jupyter_ring.runtime``) runs on ``process_set``'s ranks."""
    with lock:
        if is_global(process_set):
            yield
            return
        member = _member(process_set, where)
        with _api._using(member.process):
            yield


def run_on(process_set, where, fn, *args):
    """``fn(*args)`` with the numpy API bound to ``process_set`` (the global set: unchanged)."""
    with on(process_set, where):
        return fn(*args)


def set_rank(process_set, rank, where):
    """A global root rank as the set's own rank (the sub-runtime counts from 0)."""
    if is_global(process_set):
        return rank
    member = _member(process_set, where)
    if rank not in member.ranks:
        raise ValueError(f"{where}: root rank {rank} is not part of {process_set}; pass one of {member.ranks}")
    return member.ranks.index(rank)
