"""What the engine queues: typed entries (``Reduce``, ``Call``), the queue that holds them in call
order (``EntryQueue``), and the batches a round fuses them into (``plan_batches``).

A ``Reduce`` is one allreduce, fusable with neighbours of the same ``ReducePlan``; a ``Call`` is
any other collective, run alone. Names are unique among queued entries: the ranks match their
queues by name (``settling``).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar, final

from . import collectives
from .core import Runtime
from .wire import Prepared

__all__ = ["Reduce", "Call", "Entry", "AnyLane", "LaneKey", "PreparedLane", "Batch", "plan_batches",
           "entry_kind", "EntryQueue"]


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


def entry_kind(entry: Entry) -> str:
    return entry.kind if type(entry) is Call else "allreduce"



class EntryQueue:
    """The entries queued and not yet run, in call order (``entries``), the name each holds, and
    the bytes ever queued (``submitted``) and taken by rounds (``taken``): their difference is
    what waits to fill the fusion buffer."""

    def __init__(self) -> None:
        self.entries: collections.deque[Entry] = collections.deque()
        self.lock = threading.Lock()           # guards snapshots against appends
        self.names: dict[str, int] = {}        # name -> handle of every queued entry (unique)
        self.submitted = 0                     # bytes ever queued (caller) ...
        self.taken = 0                         # ... and ever taken by rounds (executor)
        self.since = 0.0                       # when the oldest queued entry was queued

    def add(self, entry: Entry, nbytes: int) -> bool:
        """Queue ``entry`` last (its name must be free); whether it is the only one queued."""
        with self.lock:
            if entry.name in self.names:
                raise ValueError(
                    f"{entry_kind(entry)} '{entry.name}': a collective of this name is still pending on this "
                    "rank; collectives are matched between ranks by name (as in Horovod), so two "
                    "pending ones cannot share one. synchronize() the first, or pass another name=")
            self.names[entry.name] = entry.handle
            self.entries.append(entry)
            first = len(self.entries) == 1
        if first:
            self.since = time.perf_counter()
        self.submitted += nbytes
        return first

    def add_first(self, entry: Entry) -> None:
        """Queue ``entry`` before the others (it was called before anything queued since)."""
        with self.lock:
            self.names[entry.name] = entry.handle
            self.entries.appendleft(entry)
        if type(entry) is Reduce:
            self.submitted += entry.nbytes

    def backlog(self) -> int:
        """Bytes queued and not yet taken by a round."""
        return self.submitted - self.taken

    def snapshot(self) -> list[Entry]:
        """Every queued entry, in call order (a round's)."""
        with self.lock:
            return list(self.entries)

    def unfinished(self, finished: set[int]) -> list[Entry]:
        """The queued entries not in ``finished``, in call order (a round planned again)."""
        with self.lock:
            return [e for e in self.entries if e.handle not in finished]

    def remove(self, finished: set[int]) -> None:
        """Take the finished entries out of the queue (a prefix of it, unless a round was cut)."""
        with self.lock:
            queue = self.entries
            taken = 0
            names = self.names
            while queue and queue[0].handle in finished:
                entry = queue.popleft()
                names.pop(entry.name, None)
                if type(entry) is Reduce:
                    taken += entry.src.nbytes
            if any(entry.handle in finished for entry in queue):
                kept: list[Entry] = []
                for entry in queue:
                    if entry.handle not in finished:
                        kept.append(entry)
                        continue
                    names.pop(entry.name, None)
                    if type(entry) is Reduce:
                        taken += entry.src.nbytes
                queue.clear()
                queue.extend(kept)
        self.taken += taken

    def drop(self) -> list[Entry]:
        """Empty the queue (shutdown, abandon, interrupt); returns what it held."""
        with self.lock:
            dropped = list(self.entries)
            self.entries.clear()
            self.names.clear()
        self.taken = self.submitted
        return dropped
