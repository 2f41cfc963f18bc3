"""Horovod's API over numpy arrays: argument checks, process sets and join, over one progress
engine (``_engine.progress.Engine``) per process set.

``__all__`` is the user's API (re-exported by ``jupyter_ring.runtime``). The framework adapters
(``torch/``, ``tensorflow/``, ``keras/``, ``cupy``, ``_horovod/``) also call the typed helpers
without an underscore here, and no ``_``-name: ``running_runtime``, ``session``, ``resolve_op``,
``scale_factor``, ``is_global``, ``set_size``, ``set_rank``, ``process_set_by_id``,
``bucket_buffer``, ``bucket_allreduce_async_``, ``discard``, ``epoch``, ``flush``, ``busy``, ``registered``,
``abandon_queued``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import math
import os
import pickle
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, SupportsFloat, TypeAlias, TypeVar, cast

import numpy as np
import numpy.typing as npt

from ._engine import collectives
from ._engine.algorithms import eager_limit
from ._engine.config import Config
from ._engine.waits import WaitPolicy
from ._engine.core import DTYPE_CODE, DTYPES, Average, Runtime, Sum, reducer
from ._engine.errors import NotInitializedError, RingError
from ._engine.progress import AnyLane, Call, Engine, Entry, LaneKey, Reduce
from ._observe.report import reporter
from ._observe.trace import ChromeEvent

if TYPE_CHECKING:
    from mpi4py import MPI
    from numpy._core.multiarray import flagsobj

Array: TypeAlias = collectives.Array  # a tensor: any dtype of DTYPES, checked at run time
Ranks: TypeAlias = Iterable[int | np.integer[Any]]  # global rank numbers
_T = TypeVar("_T")
_Path = TypeVar("_Path", bound="str | os.PathLike[str]")

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "config", "wait_policy",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "allgather", "allgather_async", "broadcast",
    "broadcast_", "broadcast_async", "reducescatter", "alltoall", "barrier", "broadcast_object",
    "allgather_object", "poll", "synchronize", "stats", "timeline", "reset_stats",
    "join", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
]


class ProcessSet:
    """Ranks that run collectives together, as in Horovod: pass it as ``process_set=``.

    Built from a list of (global) ranks, then registered on every rank with
    :func:`add_process_set` (or ``init(process_sets=[...])``); ``process_set_id`` is set then.
    Collectives on a set are called by its members only; ``root_rank`` stays a global rank.
    Horovod's form ``ProcessSet(mpi_comm)`` is accepted and refused by ``add_process_set``.
    """

    def __init__(self, ranks_or_comm: Ranks | MPI.Comm) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: MPI.Comm | None = None
        self.ranks: list[int] | None
        if type(ranks_or_comm).__module__.startswith("mpi4py"):
            self.mpi_comm = cast("MPI.Comm", ranks_or_comm)
            self.ranks = None
            return
        try:
            ranks = sorted(cast("Ranks", ranks_or_comm))
        except TypeError:
            raise TypeError(f"ProcessSet takes a list of ranks, got {type(ranks_or_comm).__name__}") from None
        if any(not isinstance(q, (int, np.integer)) or isinstance(q, bool) for q in ranks):
            raise ValueError(f"ProcessSet takes a list of int ranks, got {ranks_or_comm!r}")
        self.ranks = [int(q) for q in ranks]

    def size(self) -> int | None:
        """Number of ranks in the set (None before it is registered)."""
        # (a registered set always has ranks: add_process_set refuses one without)
        return None if self.process_set_id is None or self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (None before it is registered; ValueError if this
        process is not a member)."""
        if self.process_set_id is None or self.ranks is None:
            return None
        me = rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not in process set {self.ranks}; only its members have a rank in it")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process is a member of the set (None for a set without ranks yet)."""
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __repr__(self) -> str:
        comm = "" if self.mpi_comm is None else f", mpi_comm={self.mpi_comm}"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}{comm})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _Set:
    """A registered process set: its runtime (own communicators) and engine on a member, None
    elsewhere."""

    def __init__(self, ps: ProcessSet, rt: Runtime | None = None, engine: Engine | None = None) -> None:
        self.ps = ps
        self.rt = rt
        self.engine = engine


class _Process:
    """This process's runtime, its engines and the handles they owe results for."""

    def __init__(self) -> None:
        self.rt: Runtime | None = None
        self.engine: Engine | None = None
        self.sets: dict[int, _Set] = {}      # process_set_id -> _Set, on every rank
        self.set_ids = itertools.count(1)
        self.owner: dict[int, Engine] = {}   # handle -> Engine that will hold its result
        self.handles = itertools.count(1)
        self.unnamed: dict[str, int] = {}    # kind -> counter for auto names
        self.atexit = False
        self.epoch = 0           # +1 each time queued work is abandoned (a failed notebook cell)


_proc = _Process()


def init(comm: MPI.Comm | None = None, process_sets: Iterable[ProcessSet | Ranks] | None = None,
         **config: object) -> None:
    """Start the runtime on ``comm`` (default MPI.COMM_WORLD); every rank must call it.

    Calling it again while initialised does nothing; ``shutdown()`` then ``init()`` starts anew.
    ``process_sets`` (a list of :class:`ProcessSet`) are registered as by ``add_process_set``.
    Keyword arguments override :class:`Config` fields (``stall_timeout=...``).
    """
    if _proc.rt is not None:
        return
    from mpi4py import MPI

    if comm is None:
        comm = MPI.COMM_WORLD
    elif isinstance(comm, (list, tuple)):
        raise TypeError("init(comm=...) takes an mpi4py communicator; build a sub-communicator with "
                        "MPI.COMM_WORLD.Create_group(...) for a subset of ranks, or pass "
                        "process_sets=[ProcessSet([...])]")
    elif not isinstance(comm, MPI.Comm):
        raise TypeError(f"init(comm=...) takes an mpi4py communicator, got {type(comm).__name__}")
    rt = Runtime(comm, Config.from_env(**config))
    _proc.rt = rt
    _proc.engine = Engine(rt, _proc.handles)
    global_process_set.ranks = list(range(rt.size))
    reporter.rank = rt.rank
    reporter.trace = rt.trace
    if not _proc.atexit:
        # Cancel our posted receives before mpi4py finalizes MPI (atexit runs last-in first-out).
        atexit.register(_at_exit, rt.config.finalize_timeout)
        _proc.atexit = True
    for ps in process_sets or ():
        add_process_set(ps)


def _at_exit(finalize_timeout: float) -> None:
    """shutdown(), then MPI_Finalize with a bound: it waits on the launcher's PMI barrier, which
    never completes when a peer's host or the launcher is unreachable; SIGALRM's default action
    ends the process then, with no Python code left to run (a thread could not: it needs the
    GIL, which finalization holds).

    MPI is finalized here, not left to mpi4py's own handler, so that the bound covers
    MPI_Finalize alone: armed before the rest of the interpreter's exit (other atexit handlers,
    freeing the frameworks' modules: over 10 s for torch or TensorFlow on a loaded host), it
    ended healthy ranks with exit status 14. mpi4py skips its own finalization once MPI is
    finalized; with ``mpi4py.rc.finalize = False`` finalization is the user's and is left alone.
    """
    import signal
    import sys

    shutdown()
    mpi4py = sys.modules.get("mpi4py")
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or mpi4py is None or mpi4py.rc.finalize is False:
        return
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    armed = False
    if finalize_timeout > 0 and hasattr(signal, "alarm"):
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(max(1, int(math.ceil(finalize_timeout))))
            armed = True
        except ValueError:  # not the main thread
            pass
    try:
        MPI.Finalize()
    finally:
        if armed:
            signal.alarm(0)


def shutdown() -> None:
    """Stop the runtime; pending async handles fail. Safe to call when not initialised."""
    rt, engine = _proc.rt, _proc.engine
    _proc.rt = _proc.engine = None
    error = NotInitializedError("the runtime was shut down before this collective ran")
    # (an engine's runtime is set with it: by init() for the global set, add_process_set for a set)
    stopping = [(s.engine, s.rt) for s in _proc.sets.values() if s.engine is not None and s.rt is not None]
    if engine is not None and rt is not None:
        stopping.append((engine, rt))
    for eng, _rt in stopping:
        eng.fail_queued(error)
        eng.close()
    for _eng, _rt in stopping:
        _rt.close()
    for s in _proc.sets.values():
        s.ps._invalidate()
    _proc.sets = {}
    _proc.set_ids = itertools.count(1)
    global_process_set.ranks = []


def is_initialized() -> bool:
    """Whether ``init()`` has run (and ``shutdown()`` has not)."""
    return _proc.rt is not None


def running_runtime() -> Runtime:
    """This process's initialised Runtime, for the adapters (NotInitializedError before ``init()``)."""
    rt = _proc.rt
    if rt is None:
        raise NotInitializedError("jupyter_ring's runtime is not initialised; call ring.init() on every "
                                  "rank first (%ring start does this for you)")
    return rt


def size() -> int:
    """Number of ranks."""
    return running_runtime().size


def rank() -> int:
    """This process's rank, 0 .. size()-1."""
    return running_runtime().rank


def local_size() -> int:
    """Number of ranks on this host."""
    return running_runtime().local_size


def local_rank() -> int:
    """This rank's index among the ranks on its host (use it to pick a GPU)."""
    return running_runtime().local_rank


def cross_size() -> int:
    """Number of ranks with this rank's local_rank (the number of hosts, when they are alike)."""
    return running_runtime().cross_size


def cross_rank() -> int:
    """This rank's index among the ranks with the same local_rank."""
    return running_runtime().cross_rank


def config() -> Config:
    """The live :class:`Config` (change its fields to tune a running runtime)."""
    return running_runtime().config


def wait_policy() -> WaitPolicy:
    """How this rank waits for its peers (``spin`` or ``yield``) and why: ``.describe()`` says.

    ``config().wait`` (``JUPYTER_RING_WAIT``: auto, spin, yield) chooses; ``auto`` yields the core
    between polls where this host runs more ranks than the process may use cores.
    """
    return running_runtime().waits.policy()


# ------------------------------------------------------------------ process sets
def _global_engine() -> Engine:
    """The engine of every rank (raises NotInitializedError before ``init()``)."""
    engine = _proc.engine
    if engine is None:
        running_runtime()
    return cast(Engine, engine)  # set together with _proc.rt by init()


def _engine(process_set: ProcessSet | None, where: str) -> Engine:
    """The engine of ``process_set`` (None or ``global_process_set``: every rank's)."""
    if process_set is None or process_set is global_process_set:
        return _global_engine()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{where}: process_set= takes a ProcessSet, got {type(process_set).__name__}")
    rt = running_runtime()
    if process_set.process_set_id == 0:
        return cast(Engine, _proc.engine)  # set together with _proc.rt by init()
    set_id = process_set.process_set_id
    entry = None if set_id is None else _proc.sets.get(set_id)
    if entry is None or entry.ps is not process_set:
        raise ValueError(f"{where}: {process_set!r} is not registered; call add_process_set() on every "
                         "rank first (or pass it to init(process_sets=[...]))")
    if entry.engine is None:
        raise ValueError(f"{where}: rank {rt.rank} is not in process set {process_set.ranks}; "
                         "only its members call its collectives")
    return entry.engine


def add_process_set(process_set: ProcessSet | Ranks) -> ProcessSet:
    """Register a process set (a :class:`ProcessSet` or a list of ranks) on every rank; returns it.

    Collective over every rank: all pass the same ranks (checked). Members get their own
    communicators (a sub-communicator, shared-memory slots, a background thread), so collectives
    on different sets run independently; errors and stalls inside a set name global ranks.
    """
    rt = running_runtime()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None:
        raise NotImplementedError("add_process_set: a process set made from an mpi4py communicator is not "
                                  "supported; build it from a list of global ranks: ProcessSet([0, 2])")
    where = f"add_process_set({ps.ranks})"
    bad = [q for q in ps.ranks if not 0 <= q < rt.size]
    problem = None
    if bad:
        problem = ValueError(f"{where}: rank(s) {bad} out of range for {rt.size} ranks (0..{rt.size - 1})")
    elif not ps.ranks or len(set(ps.ranks)) != len(ps.ranks):
        problem = ValueError(f"{where}: a process set needs distinct ranks, at least one")
    elif ps.process_set_id is not None:
        problem = ValueError(f"{where}: this ProcessSet is registered already ({ps!r})")
    elif any(s.ps.ranks == ps.ranks for s in _proc.sets.values()) or ps.ranks == list(range(rt.size)):
        problem = ValueError(f"Attempted to add a duplicate process set: {ps!r}; the ranks of a process "
                             "set must differ from every other's (the global set holds all ranks)")
    member = rt.rank in ps.ranks
    ranks = None if problem else ps.ranks

    def split(rt: Runtime) -> list[object] | MPI.Comm:
        everyone = collectives.allgather_object(rt, _pickle(ranks, where), "jupyter_ring.add_process_set", None)
        if problem is not None or any(other != ranks for other in everyone):
            return everyone
        # Split is a blocking collective: every rank is known to be here (the exchange above), so
        # it returns at once; the new set's own set-up is polled like init's.
        return rt.ctl.Split(0 if member else rt.MPI.UNDEFINED, rt.rank)

    engine = _global_engine()  # (initialised: running_runtime() above)
    sub = engine.run_now(Call(next(_proc.handles), "process_set", "add_process_set", split))
    if problem is not None:
        raise problem
    if isinstance(sub, list):
        differ = [q for q, other in enumerate(sub) if other != ps.ranks]
        raise ValueError(f"{where}: every rank must pass the same ranks; rank(s) {differ} passed "
                         f"{[sub[q] for q in differ]}. Call add_process_set with the same list everywhere.")
    set_id = next(_proc.set_ids)
    if member:
        set_rt = Runtime(cast("MPI.Comm", sub), rt.config, world=ps.ranks)
        # without MPI_THREAD_MULTIPLE the sets' engines take turns with the global one
        shared = None if rt.MPI.Query_thread() == rt.MPI.THREAD_MULTIPLE else engine.lock
        _proc.sets[set_id] = _Set(ps, set_rt, Engine(set_rt, _proc.handles, shared))
    else:
        _proc.sets[set_id] = _Set(ps)
    ps.process_set_id = set_id
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (collective); returns whether it was registered."""
    running_runtime()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"remove_process_set takes a ProcessSet, got {type(process_set).__name__}")
    set_id = process_set.process_set_id
    everyone = allgather_object(set_id, name="jupyter_ring.remove_process_set")
    if any(other != set_id for other in everyone):
        raise ValueError(f"remove_process_set: every rank must remove the same set; ids {everyone}")
    if set_id is None or set_id == 0 or set_id not in _proc.sets:
        return False
    entry = _proc.sets.pop(set_id)
    if entry.engine is not None and entry.rt is not None:  # (a member's set has both)
        entry.engine.fail_queued(RingError(f"cancelled: process set {process_set.ranks} was removed"))
        entry.engine.close()
        entry.rt.close()
    process_set._invalidate()
    return True


def is_global(process_set: ProcessSet | None) -> bool:
    """Whether ``process_set`` means every rank (None, ``global_process_set`` or id 0)."""
    return process_set is None or process_set is global_process_set or process_set.process_set_id == 0


def set_size(process_set: ProcessSet | None, where: str) -> int:
    """Number of ranks of ``process_set``; raises as a collective on it would (not registered,
    not a member)."""
    return _engine(process_set, where).rt.size


def set_rank(process_set: ProcessSet | None, where: str) -> int:
    """This rank's number within ``process_set`` (checked as :func:`set_size`)."""
    return _engine(process_set, where).rt.rank


def process_set_by_id(process_set_id: int) -> ProcessSet | None:
    """The registered :class:`ProcessSet` with this id (0: the global set), or None."""
    running_runtime()
    if process_set_id == 0:
        return global_process_set
    entry = _proc.sets.get(process_set_id)
    return None if entry is None else entry.ps


def _set_root(process_set: ProcessSet | None, engine: Engine, root_rank: object, where: str) -> int:
    """A global root rank as the set's own rank number (checked)."""
    rt = engine.rt
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise TypeError(f"{where}: root_rank must be an int, got {type(root_rank).__name__}")
    root = int(root_rank)
    if engine is _proc.engine:
        if not 0 <= root < rt.size:
            raise ValueError(f"{where}: root_rank {root} is out of range for {rt.size} ranks (0..{rt.size - 1})")
        return root
    if root not in rt.world:
        raise ValueError(f"{where}: root_rank {root} is not in process set {rt.world}; pass the global "
                         "rank of one of its members")
    return rt.world.index(root)


# ------------------------------------------------------------------ argument checks
def _auto_name(kind: str, name: object) -> tuple[str, str | None]:
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"{kind}: name= must be a str, got {type(name).__name__}")
        return name, name
    count = _proc.unnamed.get(kind, 0)
    _proc.unnamed[kind] = count + 1
    return f"{kind}.noname.{count}", None


def _array(tensor: object, where: str) -> Array:
    try:
        arr = np.asarray(tensor)
    except Exception as exc:
        raise TypeError(f"{where}: expected a numpy array (or array-like), got {type(tensor).__name__}") from exc
    if arr.dtype not in DTYPE_CODE:
        supported = ", ".join(str(d) for d in DTYPES)
        raise TypeError(f"{where}: dtype {arr.dtype} is not supported; use one of {supported}")
    return arr


def _inplace(tensor: object, where: str) -> Array:
    if not isinstance(tensor, np.ndarray):
        raise TypeError(f"{where}: the in-place form needs a numpy array, got {type(tensor).__name__}; "
                        "use the out-of-place form (without the trailing _)")
    arr = _array(tensor, where)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{where}: the in-place form needs a C-contiguous array; pass "
                         "np.ascontiguousarray(x) or use the out-of-place form")
    if not arr.flags.writeable:
        raise ValueError(f"{where}: the array is read-only; pass a writable copy (x.copy()) or use the "
                         "out-of-place form")
    return arr


def resolve_op(op: int | None, average: bool | None, where: str) -> int:
    """The reduce op from Horovod's ``op=`` / deprecated ``average=`` pair (default Average)."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{where}: pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    return Average if op is None else op


def scale_factor(value: object, label: str, where: str) -> float:
    """A ``prescale_factor``/``postscale_factor`` as a float (TypeError naming ``label`` otherwise)."""
    try:
        return float(cast(SupportsFloat, value))  # (anything else raises TypeError: caught)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {label} must be a number, got {value!r}") from None


def _plan(engine: Engine, dtype: np.dtype[Any], op: int | None, average: bool | None, prescale: float,
          postscale: float, where: str) -> collectives.ReducePlan:
    """The checked ``ReducePlan`` for these arguments, cached per engine (the hot path's lookup)."""
    if type(prescale) is not float or type(postscale) is not float:
        prescale = scale_factor(prescale, "prescale_factor", where)
        postscale = scale_factor(postscale, "postscale_factor", where)
    key = (dtype, op, average, prescale, postscale)
    plans = engine.plans
    plan = plans.get(key)
    if plan is None:
        if len(plans) > 1024:
            plans.clear()
            engine.agreements.clear()
            # lanes hold plans: a lane's plan is always the cached one (the same serial, so a
            # rank with a lane fuses like a rank without)
            engine.lanes.clear()
        # equal arguments give the same plan object and serial on every rank that made the same
        # calls (the cache clears at the same call everywhere): batches are keyed by the serial
        plan = collectives.reduce_plan(engine.rt, dtype, resolve_op(op, average, where), prescale, postscale, where,
                             next(engine.serials))
        plans[key] = plan
    return plan


# ------------------------------------------------------------------ allreduce
def allreduce(tensor: npt.ArrayLike, average: bool | None = None, name: str | None = None, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet | None = None) -> Array:
    """Reduce ``tensor`` over all ranks (default op: Average) and return a new array."""
    return _blocking(tensor, False, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: Array, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet | None = None) -> Array:
    """In-place allreduce: ``tensor`` (a C-contiguous writable array) receives the result."""
    return _blocking(tensor, True, average, name, op, prescale_factor, postscale_factor, process_set)


def _blocking(tensor: npt.ArrayLike, in_place: bool, average: bool | None, name: str | None, op: int | None,
              prescale: float, postscale: float, process_set: ProcessSet | None) -> Array:
    """A blocking allreduce: on its signature's prepared lane when the engine has one (the same
    name, in place or not, dtype, shape, op and scale factors as an earlier call), else the full
    way, which leaves a lane behind for the next call when the payload rides in the agreement
    message. The lane skips the checks and lookups only: the ranks still exchange and compare
    headers, so a rank whose call differs still fails every rank with the difference named."""
    if type(tensor) is np.ndarray and (name is None or type(name) is str):
        engine = _proc.engine if process_set is None else _member_engine(process_set)
        # (no cast() calls here: the lane's call is the runtime's hottest path; the key (name,
        # in place) holds an allreduce lane only, and a lane's run returns its result array)
        lane: collectives.Lane | None = None if engine is None else engine.lanes.get((name, in_place))  # type: ignore[assignment]
        if (lane is not None and lane.prepared is not None and lane.fits(tensor, op, average, prescale, postscale)
                and (not in_place or _flat_ok(tensor.flags, True)) and lane.revision == engine.config.revision):  # type: ignore[union-attr]
            if name is None:
                name, explicit = _auto_name("allreduce", None)
            else:
                explicit = name
            return engine.run_lane(lane, _lane_entry, tensor, in_place, name, explicit)  # type: ignore[union-attr, return-value]
    engine, entry = _reduce(tensor, in_place, average, name, op, prescale, postscale, process_set)
    result = cast(Array, engine.run_now(entry))
    if entry.src.nbytes <= eager_limit(engine.rt) and _lane_worthy(tensor, in_place, prescale, postscale):
        engine.prepare_lane((name, in_place), collectives.prepare_lane, entry, op, average, prescale, postscale)
    return result


def _lane_entry(lane: collectives.Lane, tensor: Array, in_place: bool, name: str, explicit: str | None) -> Reduce:
    """The ``Reduce`` entry of a call whose arguments are ``lane``'s signature (no checks): for
    the ways ``Engine.run_lane`` takes when the call cannot run on the lane."""
    src = tensor.reshape(-1)  # a contiguous copy of a non-contiguous input (out of place only)
    return Reduce(next(_proc.handles), name, explicit, src, src if in_place else None,
                  tensor if in_place else None, lane.shape, lane.plan)


def _entry(tensor: npt.ArrayLike, in_place: bool, average: bool | None, name: str | None, op: int | None,
           prescale: float, postscale: float,
           process_set: ProcessSet | None) -> tuple[Engine, collectives.Lane | None, Reduce]:
    """(engine, lane, entry) of an async allreduce: the entry built from the lane of its
    signature when the engine has one (no checks, no plan lookup), else checked the full way
    (lane None)."""
    if type(tensor) is np.ndarray and (name is None or type(name) is str):
        engine = _proc.engine if process_set is None else _member_engine(process_set)
        lane = None if engine is None else cast("collectives.Lane | None", engine.lanes.get((name, in_place)))
        if engine is not None and lane is not None and lane.fits(tensor, op, average, prescale, postscale) and _flat_ok(
                tensor.flags, in_place):
            if name is None:
                name, explicit = _auto_name("allreduce", None)
            else:
                explicit = name
            return engine, lane, _lane_entry(lane, tensor, in_place, name, explicit)
    engine, entry = _reduce(tensor, in_place, average, name, op, prescale, postscale, process_set)
    return engine, None, entry


def _lane_worthy(tensor: npt.ArrayLike, in_place: bool, prescale: float, postscale: float) -> bool:
    """Whether later calls with these arguments could take a lane (``Lane.fits`` them)."""
    return (type(tensor) is np.ndarray and type(prescale) is float and type(postscale) is float
            and _flat_ok(tensor.flags, in_place))


def _flat_ok(flags: flagsobj, in_place: bool) -> bool:
    """Whether an array with these flags goes on a lane as it is (contiguous; writable in place)."""
    return flags.c_contiguous and (flags.writeable or not in_place)


def _lane_of(key: LaneKey, process_set: ProcessSet | None) -> tuple[Engine | None, AnyLane | None]:
    """(engine, its lane under ``key``) for a blocking call on ``process_set``, lane None when the
    engine has none (engine None when this rank has no engine there: the full way says why)."""
    engine = _proc.engine if process_set is None else _member_engine(process_set)
    return engine, (None if engine is None else engine.lanes.get(key))


def _member_engine(process_set: ProcessSet) -> Engine | None:
    """The engine of a registered ``process_set`` this rank belongs to, else None (the full path
    then raises what is wrong)."""
    if process_set is global_process_set:
        return _proc.engine
    set_id = getattr(process_set, "process_set_id", None)
    entry = None if set_id is None else _proc.sets.get(set_id)
    return entry.engine if entry is not None and entry.ps is process_set else None


def allreduce_async(tensor: npt.ArrayLike, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = None) -> int:
    """Queue an allreduce; returns a handle for ``synchronize()``/``poll()``. Small ones are fused."""
    return _queued(tensor, False, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor: Array, average: bool | None = None, name: str | None = None, op: int | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet | None = None) -> int:
    """Queue an in-place allreduce; returns a handle."""
    return _queued(tensor, True, average, name, op, prescale_factor, postscale_factor, process_set)


def _queued(tensor: npt.ArrayLike, in_place: bool, average: bool | None, name: str | None, op: int | None,
            prescale: float, postscale: float, process_set: ProcessSet | None) -> int:
    """An async allreduce: its entry from the lane of its signature (no checks) when the engine
    has one, else checked the full way, which leaves a signature-only lane for the next call."""
    engine, lane, entry = _entry(tensor, in_place, average, name, op, prescale, postscale, process_set)
    if lane is None and _lane_worthy(tensor, in_place, prescale, postscale):
        engine.keep_lane((name, in_place), collectives.prepare_lane(None, entry, op, average, prescale, postscale))
    return _submit(engine, entry, entry.src.nbytes)


def _reduce(tensor: npt.ArrayLike, in_place: bool, average: bool | None, name: str | None, op: int | None,
            prescale: float, postscale: float, process_set: ProcessSet | None) -> tuple[Engine, Reduce]:
    """Check the arguments once, on the caller's line; the engine and the transport trust the entry.

    The hot path of every gradient: a numpy array of a known dtype and a cached plan cost a few
    attribute reads; messages (with the tensor's name) are built only when something is wrong.
    """
    given = name
    engine = None
    try:  # a plain try, not a context manager: this runs for every tensor
        engine = _proc.engine if process_set is None else _engine(process_set, "allreduce")
        if engine is None:
            engine = _global_engine()  # raises NotInitializedError
        if name is None:
            name, explicit = _auto_name("allreduce", None)
        elif type(name) is str:
            explicit = name
        else:
            name, explicit = _auto_name("allreduce", name)
        if type(tensor) is np.ndarray and tensor.dtype in DTYPE_CODE and (
                not in_place or (tensor.flags.c_contiguous and tensor.flags.writeable)):
            arr = tensor
        else:
            where = f"{'allreduce_' if in_place else 'allreduce'} '{name}'"
            arr = _inplace(tensor, where) if in_place else _array(tensor, where)
        plan = _plan(engine, arr.dtype, op, average, prescale, postscale,
                     f"{'allreduce_' if in_place else 'allreduce'} '{name}'")
    except (TypeError, ValueError) as exc:
        _poison(engine, "allreduce", given, exc)
        raise
    src = arr.reshape(-1) if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(-1)
    if in_place:
        return engine, Reduce(next(_proc.handles), name, explicit, src, src, arr, arr.shape, plan)
    return engine, Reduce(next(_proc.handles), name, explicit, src, None, None, arr.shape, plan)


def bucket_allreduce_async_(array: Array, name: str | None, op: int | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: ProcessSet | None = None,
                            sources: Iterable[tuple[int, Array]] | None = None) -> int:
    """Queue an in-place allreduce of a gradient bucket, with the fresh gradients it still lacks.

    ``sources``: ``(element offset, flat array)`` pairs of ``array``'s dtype, fresh gradients
    that the reduction itself puts in their slots, in the engine's executor (not the caller's
    thread: torch's backward, which queues the bucket from a gradient hook, goes on with the next
    layer while the copy runs beside it): on one host only the blocks the peers read are copied,
    the rest is read where it lies (the arrays must not change until the handle completes). Run
    alone, never fused with a neighbour, so every rank runs every bucket as its own collective
    whatever its neighbours are.
    """
    engine, entry = _reduce(array, True, None, name, op, prescale_factor, postscale_factor, process_set)
    members = [collectives.Member(entry.src, entry.src)]
    desc = entry.describe()
    fresh: list[collectives.Source] | None = None
    if sources is not None:
        fresh = sorted((collectives.Source(int(offset), arr.reshape(-1)) for offset, arr in sources),
                       key=lambda s: s.offset)
        for src in fresh:
            if src.array.dtype != entry.src.dtype or src.offset < 0 or src.offset + src.array.size > entry.src.size:
                raise ValueError(f"allreduce '{name}': a source of {src.array.size} {src.array.dtype} at offset "
                                 f"{src.offset} does not fit the bucket ({entry.src.size} {entry.src.dtype}); "
                                 "give flat arrays of the bucket's dtype inside it")

    def run(rt: Runtime) -> Array:
        collectives.allreduce(rt, members, entry.plan, entry.name, desc, sources=fresh)
        if fresh:
            fresh.clear()  # the fresh gradients are in the bucket now: let them go
        return array
    return _submit(engine, Call(entry.handle, "allreduce", entry.name, run), entry.src.nbytes)


def grouped_allreduce(tensors: Sequence[npt.ArrayLike], average: bool | None = None, name: str | None = None,
                      op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = None) -> list[Array]:
    """Allreduce a list of arrays together (one fused pass); returns a list."""
    return cast("list[Array]", synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                                                   postscale_factor, process_set)))


def grouped_allreduce_(tensors: Sequence[Array], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet | None = None) -> list[Array]:
    """In-place grouped allreduce."""
    return cast("list[Array]", synchronize(_group(tensors, True, average, name, op, prescale_factor, postscale_factor,
                                                  process_set)))


def grouped_allreduce_async(tensors: Sequence[npt.ArrayLike], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None) -> int:
    """Queue a grouped allreduce; ``synchronize`` returns the list of results."""
    return _group(tensors, False, average, name, op, prescale_factor, postscale_factor, process_set)


def _group(tensors: Sequence[npt.ArrayLike], in_place: bool, average: bool | None, name: str | None, op: int | None,
           prescale: float, postscale: float, process_set: ProcessSet | None) -> int:
    with _joining("allreduce", name, process_set) as engine:
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"grouped_allreduce: expected a list of arrays, got {type(tensors).__name__}")
        name, explicit = _auto_name("grouped_allreduce", name)
        where = f"grouped_allreduce '{name}'"
        arrays = [(_inplace if in_place else _array)(t, f"{where} tensor {i}") for i, t in enumerate(tensors)]
        dtypes = {a.dtype for a in arrays}
        if len(dtypes) > 1:
            raise TypeError(f"{where}: all tensors of a group must share one dtype, got {sorted(map(str, dtypes))}")
        dtype = arrays[0].dtype if arrays else np.dtype(np.float32)
        plan = _plan(engine, dtype, op, average, prescale, postscale, where)
    members = [collectives.Member(a.reshape(-1) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1), None)
               for a in arrays]
    if in_place:
        members = [collectives.Member(m.src, m.src) for m in members]
    desc = collectives.allreduce_desc(None, (sum(m.src.size for m in members),), plan.prescale, plan.postscale,
                            tuple((explicit, a.shape) for a in arrays))

    def run(rt: Runtime) -> list[Array]:
        outs = collectives.allreduce(rt, members, plan, name, desc)
        return list(arrays) if in_place else [out.reshape(a.shape) for out, a in zip(outs, arrays)]
    return _submit(engine, Call(next(_proc.handles), "allreduce", name, run), sum(a.nbytes for a in arrays))


# ------------------------------------------------------------------ other collectives
def allgather(tensor: npt.ArrayLike, name: str | None = None, process_set: ProcessSet | None = None) -> Array:
    """Concatenate every rank's array along dim 0; dim 0 may differ between ranks."""
    if type(tensor) is np.ndarray and (name is None or type(name) is str):
        engine, lane = _lane_of(("allgather", name), process_set)
        if engine is not None and isinstance(lane, collectives.GatherLane) and lane.fits(tensor):
            name, explicit = _auto_name("allgather", name)
            return cast("tuple[Array, list[int]]", engine.run_lane(lane, _gather_entry, tensor, name, explicit))[0]
    given = name
    with _joining("allgather", name, process_set) as engine:
        name, explicit = _auto_name("allgather", name)
        arr = _array(tensor, f"allgather '{name}'")
    out, rows = cast("tuple[Array, list[int]]", engine.run_now(_gather_call("allgather", arr, name, explicit)))
    if arr is tensor:  # a numpy array: later calls of its signature may take a lane
        engine.prepare_lane(("allgather", given), collectives.prepare_gather_lane, "allgather", arr, rows, explicit)
    return out


def _gather_call(kind: str, arr: Array, name: str, explicit: str | None) -> Call:
    """The entry of an allgather (``kind``: or allgather_object) the full way: its result is
    (output, every rank's dim 0)."""
    return Call(next(_proc.handles), kind, name, lambda rt: collectives.allgather(rt, arr, name, explicit, kind))


def _gather_entry(lane: collectives.GatherLane, arr: Array, name: str, explicit: str | None) -> Call:
    """The entry of a call whose arguments are gather ``lane``'s signature (``Engine.run_lane``)."""
    return _gather_call(lane.kind, arr, name, explicit)


def allgather_async(tensor: npt.ArrayLike, name: str | None = None, process_set: ProcessSet | None = None) -> int:
    """Queue an allgather; returns a handle."""
    with _joining("allgather", name, process_set) as engine:
        name, explicit = _auto_name("allgather", name)
        arr = _array(tensor, f"allgather '{name}'")
    return _submit(engine, Call(next(_proc.handles), "allgather", name,
                                lambda rt: collectives.allgather(rt, arr, name, explicit)[0]))


def broadcast(tensor: npt.ArrayLike, root_rank: int = 0, name: str | None = None,
              process_set: ProcessSet | None = None) -> Array:
    """Return root's array on every rank (every rank passes an array of the same shape)."""
    return _broadcast(tensor, False, root_rank, name, process_set)


def broadcast_(tensor: Array, root_rank: int = 0, name: str | None = None,
               process_set: ProcessSet | None = None) -> Array:
    """In-place broadcast into ``tensor``."""
    return _broadcast(tensor, True, root_rank, name, process_set)


def _broadcast(tensor: npt.ArrayLike, in_place: bool, root_rank: int, name: str | None,
               process_set: ProcessSet | None) -> Array:
    """A blocking broadcast: on its signature's prepared lane (dtype, shape, root, name, in place
    or not) when the engine has one, else the full way, which leaves one behind."""
    key = "broadcast_" if in_place else "broadcast"
    if type(tensor) is np.ndarray and (name is None or type(name) is str):
        engine, lane = _lane_of((key, name), process_set)
        if (engine is not None and isinstance(lane, collectives.CastLane) and lane.fits(tensor, root_rank)
                and (not in_place or _flat_ok(tensor.flags, True))):
            name, explicit = _auto_name("broadcast", name)
            return cast(Array, engine.run_lane(lane, _broadcast_entry, tensor, in_place, name, explicit))
    given = name
    with _joining("broadcast", name, process_set) as engine:
        name, explicit = _auto_name("broadcast", name)
        where = f"{key} '{name}'"
        if in_place:
            arr = _inplace(tensor, where)
        else:
            arr = np.require(_array(tensor, where), requirements="C")  # keeps 0-d
        root = _set_root(process_set, engine, root_rank, where)
    result = cast(Array, engine.run_now(_broadcast_call(arr, arr if in_place else np.empty_like(arr), root, name,
                                                        explicit)))
    if type(tensor) is np.ndarray and type(root_rank) is int:
        engine.prepare_lane((key, given), collectives.prepare_cast_lane, arr, root_rank, root, explicit)
    return result


def _broadcast_entry(lane: collectives.CastLane, tensor: Array, in_place: bool, name: str,
                     explicit: str | None) -> Call:
    """The entry of a call whose arguments are broadcast ``lane``'s signature (``Engine.run_lane``)."""
    arr = tensor if in_place else np.require(tensor, requirements="C")
    return _broadcast_call(arr, arr if in_place else np.empty_like(arr), lane.root, name, explicit)


def _broadcast_call(arr: Array, out: Array, root: int, name: str, explicit: str | None) -> Call:
    """The entry of a broadcast of ``arr`` from ``root`` (this set's rank) into ``out``."""
    return Call(next(_proc.handles), "broadcast", name, lambda rt: collectives.broadcast_into(rt, arr, out, root, name, explicit))


def broadcast_async(tensor: npt.ArrayLike, root_rank: int = 0, name: str | None = None,
                    process_set: ProcessSet | None = None) -> int:
    """Queue a broadcast; returns a handle."""
    with _joining("broadcast", name, process_set) as engine:
        name, explicit = _auto_name("broadcast", name)
        arr = np.require(_array(tensor, f"broadcast '{name}'"), requirements="C")  # keeps 0-d
        root = _set_root(process_set, engine, root_rank, f"broadcast '{name}'")
    return _submit(engine, _broadcast_call(arr, np.empty_like(arr), root, name, explicit))


def reducescatter(tensor: npt.ArrayLike, op: int = Average, name: str | None = None,
                  process_set: ProcessSet | None = None) -> Array:
    """Reduce over ranks and return this rank's block of dim 0 (first ranks get the extra rows)."""
    engine, entry = _reducescatter(tensor, op, name, process_set)
    return cast(Array, engine.run_now(entry))


def reducescatter_async(tensor: npt.ArrayLike, op: int = Average, name: str | None = None,
                        process_set: ProcessSet | None = None) -> int:
    """Queue a reducescatter; returns a handle (``synchronize`` gives this rank's block)."""
    engine, entry = _reducescatter(tensor, op, name, process_set)
    return _submit(engine, entry)


def _reducescatter(tensor: npt.ArrayLike, op: int, name: str | None,
                   process_set: ProcessSet | None) -> tuple[Engine, Call]:
    with _joining("reducescatter", name, process_set) as engine:
        name, explicit = _auto_name("reducescatter", name)
        where = f"reducescatter '{name}'"
        arr = np.ascontiguousarray(_array(tensor, where))
        if arr.ndim == 0:
            raise ValueError(f"{where}: needs a tensor with at least one dimension, got a scalar")
        reducer(op, arr.dtype)
    return engine, Call(next(_proc.handles), "reducescatter", name,
                        lambda rt: collectives.reducescatter(rt, arr, op, name, explicit))


def alltoall(tensor: npt.ArrayLike, splits: npt.ArrayLike | None = None, name: str | None = None,
             process_set: ProcessSet | None = None) -> tuple[Array, npt.NDArray[np.int32]]:
    """Scatter rows to every rank and gather theirs: returns (output, received_splits)."""
    engine, entry = _alltoall(tensor, splits, name, process_set)
    return cast("tuple[Array, npt.NDArray[np.int32]]", engine.run_now(entry))


def alltoall_async(tensor: npt.ArrayLike, splits: npt.ArrayLike | None = None, name: str | None = None,
                   process_set: ProcessSet | None = None) -> int:
    """Queue an alltoall; returns a handle (``synchronize`` gives (output, received_splits))."""
    engine, entry = _alltoall(tensor, splits, name, process_set)
    return _submit(engine, entry)


def _alltoall(tensor: npt.ArrayLike, splits: npt.ArrayLike | None, name: str | None,
              process_set: ProcessSet | None) -> tuple[Engine, Call]:
    with _joining("alltoall", name, process_set) as engine:
        name, explicit = _auto_name("alltoall", name)
        where = f"alltoall '{name}'"
        arr = np.ascontiguousarray(_array(tensor, where))
        counts = _splits(arr, splits, engine.rt.size, where)
    return engine, Call(next(_proc.handles), "alltoall", name,
                        lambda rt: collectives.alltoall(rt, arr, counts, name, explicit))


def _splits(arr: Array, splits: npt.ArrayLike | None, n: int, where: str) -> list[int]:
    if arr.ndim == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension, got a scalar")
    rows = arr.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"{where}: dim 0 ({rows}) is not divisible by the world size ({n}); "
                             "pass splits=[rows for rank 0, rows for rank 1, ...]")
        return [rows // n] * n
    try:
        counts = [int(s) for s in np.asarray(splits).reshape(-1)]
    except (TypeError, ValueError):
        raise TypeError(f"{where}: splits must be a list of {n} integers, got {splits!r}") from None
    if len(counts) != n or any(s < 0 for s in counts) or sum(counts) != rows:
        raise ValueError(f"{where}: splits {counts} must be {n} non-negative row counts summing to dim 0 ({rows})")
    return counts


def barrier(process_set: ProcessSet | None = None) -> None:
    """Wait until every rank arrives (interruptible, with the stall timeout)."""
    engine = _engine(process_set, "barrier")
    engine.run_now(Call(next(_proc.handles), "barrier", "barrier", lambda rt: collectives.barrier(rt, "barrier")))


def broadcast_object(obj: _T, root_rank: int = 0, name: str | None = None, process_set: ProcessSet | None = None) -> _T:
    """Root's picklable object, returned on every rank."""
    with _joining("broadcast_object", name, process_set) as engine:
        name, explicit = _auto_name("broadcast_object", name)
        root = _set_root(process_set, engine, root_rank, f"broadcast_object '{name}'")
        me = engine.rt.rank
        data = _pickle(obj, f"broadcast_object '{name}'") if me == root else None
    result = engine.run_now(Call(next(_proc.handles), "broadcast_object", name,
                                 # (data: None on a rank other than the root, which reads it alone)
                                 lambda rt: collectives.broadcast_object(rt, cast("npt.NDArray[np.uint8]", data), root,
                                                                         name, explicit)))
    return obj if me == root else cast(_T, result)


def _pickle(obj: object, where: str) -> npt.NDArray[np.uint8]:
    try:
        return np.frombuffer(pickle.dumps(obj), np.uint8)
    except Exception as exc:
        raise TypeError(f"{where}: the object cannot be pickled ({type(exc).__name__}: {exc}); send "
                        "plain data (numbers, lists, dicts, arrays, a model's state_dict())") from exc


def allgather_object(obj: _T, name: str | None = None, process_set: ProcessSet | None = None) -> list[_T]:
    """Every rank's picklable object, as a list in rank order."""
    given = name
    with _joining("allgather_object", name, process_set) as engine:
        name, explicit = _auto_name("allgather_object", name)
        data = _pickle(obj, f"allgather_object '{name}'")
    # the pickles' sizes ride in the headers: a lane of this rank's size (the peers' may change)
    lane = engine.lanes.get(("allgather_object", given)) if given is None or type(given) is str else None
    if isinstance(lane, collectives.GatherLane) and lane.fits(data):
        gathered, sizes = cast("tuple[Array, list[int]]", engine.run_lane(lane, _gather_entry, data, name, explicit))
    else:
        gathered, sizes = cast("tuple[Array, list[int]]",
                               engine.run_now(_gather_call("allgather_object", data, name, explicit)))
        if given is None or type(given) is str:
            engine.prepare_lane(("allgather_object", given), collectives.prepare_gather_lane, "allgather_object", data, sizes,
                                explicit)
    return cast("list[_T]", collectives.unpickle_gathered(gathered, sizes))


def join() -> int:
    """This rank is out of data: take part in the others' allreduces with zeros until every rank
    has called ``join()``; returns the rank that joined last (the same on every rank).

    As in Horovod: a joined rank contributes zeros (``Average`` still divides by the number of
    ranks); only allreduces may run while some rank has joined, other collectives raise.
    Blocks (interruptibly) until every rank has joined.
    """
    engine = _engine(None, "join")
    return cast(int, engine.run_now(Call(next(_proc.handles), "join", "join", lambda rt: rt.agreement.join("join"))))


@contextlib.contextmanager
def _joining(kind: str, name: object, process_set: ProcessSet | None = None) -> Iterator[Engine]:
    """Bad arguments on this rank: tell the peers waiting in ``kind`` before raising here.

    Without this the other ranks would wait for the stall timeout not knowing why. Yields the
    engine of ``process_set``.
    """
    engine: Engine | None = None
    try:
        engine = _engine(process_set, kind)
        yield engine
    except (TypeError, ValueError, pickle.PicklingError, AttributeError) as exc:
        _poison(engine, kind, name, exc)
        raise


def _poison(engine: Engine | None, kind: str, name: object, exc: Exception) -> None:
    """Send ``exc`` to the peers at this call's place in the order of collectives."""
    if engine is not None and not isinstance(exc, RingError):
        label = name if isinstance(name, str) else "?"
        engine.run_now(Call(next(_proc.handles), "error", label,
                            lambda rt: rt.agreement.poison(kind, label, exc)))


# ------------------------------------------------------------------ handles
def _submit(engine: Engine, entry: Entry, nbytes: int = 0) -> int:
    handle = engine.submit(entry, nbytes)
    _proc.owner[handle] = engine
    return handle


def poll(handle: int) -> bool:
    """True when ``handle``'s collective has finished (its result or error waits for synchronize).

    Runs nothing: the engine's background thread makes progress while the caller computes.
    """
    return _owner(handle).poll(handle)


def synchronize(handle: int) -> Any:  # (what the handle's collective returns: an array, a list, ...)
    """Wait for ``handle`` and return its result (raises the collective's error, if any)."""
    engine = _owner(handle)
    try:
        return engine.wait(handle)
    finally:
        if handle not in engine.results:  # interrupted before it finished: synchronize it later
            _proc.owner.pop(handle, None)


def _owner(handle: object) -> Engine:
    engine = _proc.owner.get(handle) if isinstance(handle, int) else None
    if engine is None:
        raise ValueError(f"unknown or already synchronized handle {handle!r}; each handle is synchronized once")
    return engine


# ------------------------------------------------------------------ for the framework adapters
def abandon_queued(reason: str) -> None:
    """Fail every queued collective with ``RingError("cancelled: reason")``, stop the one running,
    and start a new epoch.

    Called on a rank whose notebook cell failed or was interrupted: what that cell queued must
    not run at the start of the next cell (the peers, interrupted elsewhere, did not queue the
    same calls). Stateful wrappers (DistributedOptimizer) compare :func:`epoch` to drop a step
    that began before.
    """
    for engine in _engines():
        engine.abandon(reason)
    _proc.epoch += 1


def busy() -> bool:
    """Whether a collective of this process is queued, running or waited on, in any thread.

    The notebook's guard asks after an interrupt that found the main thread blocked in C++: a
    collective then waits on another thread (autograd's device thread running gradient hooks, a
    TF1 session's ops), which no KeyboardInterrupt reaches, and ``abandon_queued`` gives it up.
    """
    return any(e.queue.entries or e.callers or e.lock.locked() for e in _engines())


def _engines() -> list[Engine]:
    """Every engine of this process: the process sets' and the global one."""
    engines = [s.engine for s in _proc.sets.values() if s.engine is not None]
    if _proc.engine is not None:
        engines.append(_proc.engine)
    return engines


def epoch() -> int:
    """How many times queued work has been abandoned in this process (see abandon_queued)."""
    return _proc.epoch


def discard(handle: int) -> None:
    """Forget ``handle`` without waiting for it (its result, if any, is dropped)."""
    engine = _proc.owner.pop(handle, None)
    if engine is not None:
        engine.discard(handle)


def flush(process_set: ProcessSet | None = None) -> None:
    """Start what is queued now in the background, without waiting for more to fuse with it."""
    _engine(process_set, "flush").flush()


def bucket_buffer(nbytes: int, process_set: ProcessSet | None = None) -> npt.NDArray[np.uint8]:
    """A zeroed uint8 buffer of ``nbytes`` for a fused gradient bucket, in the transport's memory.

    When every rank of the set is on this host the buffer lives in registered shared memory: an
    in-place allreduce of it (or of a contiguous view of it) is reduced straight out of every
    rank's buffer, with no copy in or out. Elsewhere it is ordinary memory. Views of the array
    (``.view(dtype)``, ``torch.from_numpy``) keep it alive; its memory is reused once the last
    one is gone.
    """
    engine = _engine(process_set, "bucket_buffer")
    rt = engine.rt
    nbytes = int(nbytes)
    if nbytes > 0 and rt.shm is not None and rt.config.shm_threshold > 0:
        view, region = rt.shm.register(nbytes)
        if view is not None:
            # a view of a memoryview: every numpy view of it keeps this array (its base) alive
            arr = np.frombuffer(memoryview(view)[:nbytes], np.uint8)  # type: ignore[arg-type]  # (a buffer)
            arr[...] = 0
            weakref.finalize(arr, rt.shm.unregister, region, nbytes)
            return arr
    return np.zeros(nbytes, np.uint8)


def registered(array: npt.ArrayLike, process_set: ProcessSet | None = None) -> bool:
    """Whether ``array`` lies in the registered memory of ``bucket_buffer`` (zero copy)."""
    rt = _engine(process_set, "registered").rt
    return bool(rt.shm is not None and rt.shm.locate(np.asarray(array).reshape(-1)))


def session() -> Runtime | None:
    """An object that identifies the running runtime (a new one after shutdown/init), or None."""
    return _proc.rt


# ------------------------------------------------------------------ trace
def stats() -> dict[str, dict[str, float]]:
    """Per collective kind: count, bytes, time_s, algbw and busbw (bytes/s) since init/reset;
    allreduces also per algorithm that ran, as ``allreduce[rd]`` (``JUPYTER_RING_ALLREDUCE``); and
    the header exchanges every collective starts with, as ``agreement[all]`` (to every peer) or
    ``agreement[log]`` (relayed in log2(n) steps; ``JUPYTER_RING_AGREEMENT``): count, header bytes
    this rank sent, time_s (the relayed one's only)."""
    rt = running_runtime()
    out = rt.trace.stats(algorithms=True)
    counts = rt.agreement.counts()
    if counts["count"]:
        out[f"agreement[{rt.agreement.mode}]"] = counts
    return out


def reset_stats() -> None:
    """Clear the trace and the running totals."""
    rt = running_runtime()
    rt.trace.reset()
    rt.agreement.reset_counts()


def timeline(path: _Path) -> _Path:
    """Write every rank's recent collectives as a Chrome-trace JSON (open it in Perfetto).

    Collective: every rank calls it; rank 0 writes ``path``, one track per rank. Returns the path.
    """
    rt = running_runtime()
    events: list[list[ChromeEvent]] = allgather_object(rt.trace.chrome_events(), name="jupyter_ring.timeline")
    if rt.rank == 0:
        merged = [e for rank_events in events for e in rank_events]
        tmp = f"{path}.tmp{os.getpid()}"
        # owner-only from creation: tensor names and timings are the user's business alone
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, fh)
        os.replace(tmp, path)
    return path
