"""The collective algorithms, each one body run by ``Runtime.run``.

Every body first calls ``rt.negotiate`` (agreement + eager payloads) and then moves the rest of
the data over point-to-point messages. Reductions that finish on the eager path reduce in rank
order on every rank, and the ring computes each segment once, so every rank ends bit-identical.
"""

from __future__ import annotations

import bisect
import dataclasses
import pickle
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, final

import numpy as np
import numpy.typing as npt

from . import algorithms
from .core import Runtime
from .wire import TAG_DATA, Average, JoinNote, Max, Min, PeerMsg, Prepared, Product, reducer

from .errors import RingError

if TYPE_CHECKING:  # importing mpi4py.MPI initialises MPI: the runtime does that itself
    from .shm import SharedSlots
    from mpi4py import MPI

    from .entries import Reduce

__all__ = ["Source", "allreduce", "allgather", "broadcast_into", "reducescatter", "alltoall", "barrier",
           "broadcast_object", "allgather_object", "allreduce_desc", "reduce_plan", "ReducePlan", "Member",
           "Flat", "eager_one", "allreduce_one", "Lane", "prepare_lane", "GatherLane", "prepare_gather_lane",
           "CastLane", "prepare_cast_lane", "unpickle_gathered"]

TAG_AG = TAG_DATA + 10
_SHM_TRACED_PIECES = 4  # pieces with their own phases in the trace; the rest share one

Array: TypeAlias = npt.NDArray[Any]  # a tensor: its dtype is a value at run time (ReducePlan.dtype)
Desc: TypeAlias = tuple[tuple[str, object], ...]  # labelled fields the ranks agree on (allreduce_desc)
LazyDesc: TypeAlias = Desc | Callable[[], Desc]   # or what builds them, called only to explain a mismatch
Phases: TypeAlias = dict[str, tuple[float, float]]  # a trace record's phases: name -> (start, end)
Peers: TypeAlias = dict[int, PeerMsg]  # what Agreement.negotiate returns: peer -> what it sent


def _bytes(arr: Array) -> npt.NDArray[np.uint8]:
    return arr.view(np.uint8)


class ReducePlan(NamedTuple):
    """How allreduces of one (dtype, op, scale factors) reduce on one runtime; checked once."""

    dtype: np.dtype[Any]
    op: int
    fn: np.ufunc          # the elementwise numpy ufunc
    prescale: float       # as passed: part of what the ranks agree on
    postscale: float
    scale_pre: float      # applied to the input (1.0: nothing to do)
    scale_post: float     # applied to the result (float Average folds 1/size in)
    divisor: int          # integer Average: floor division of the sum
    serial: int = 0       # the engine's number for this plan: a cheap key (hashing a dtype is not)
    finish: bool = True   # the result is scaled or divided after the reduction (_finish)


class Member(NamedTuple):
    """One tensor of an allreduce pass."""

    src: Array            # flat C-contiguous input
    dst: Array | None     # flat output: ``src`` itself in place, None for a new array


class Source(NamedTuple):
    """A fresh input of a gradient bucket that is not in the bucket yet (see ``allreduce``)."""

    offset: int           # element offset of its slot in the bucket
    array: Array          # flat, of the bucket's dtype


def _fill(buf: Array, sources: Iterable[Source], skip: Iterable[tuple[int, int]] = ()) -> None:
    """Copy every source into its slot of ``buf``, except the element ranges ``skip`` (sorted,
    disjoint): those this rank reduces itself, reading the sources where they lie."""
    for offset, arr in sources:
        a, b = offset, offset + arr.size
        for lo, hi in skip:
            if hi <= a or lo >= b:
                continue
            if lo > a:
                np.copyto(buf[a:lo], arr[a - offset:lo - offset])
            a = max(a, hi)
            if a >= b:
                break
        if a < b:
            np.copyto(buf[a:b], arr[a - offset:b - offset])


def _own_terms(buf: Array, sources: Sequence[Source], starts: Sequence[int], lo: int,
               hi: int) -> list[tuple[int, int, Array]]:
    """``[(a, b, term)]`` covering ``buf[lo:hi]``: this rank's term read from the sources where
    they lie (``starts``: their offsets, sorted), and from ``buf`` between them."""
    out: list[tuple[int, int, Array]] = []
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    a = lo
    while a < hi:
        if i < len(sources) and sources[i].offset + sources[i].array.size <= a:
            i += 1
            continue
        if i < len(sources) and sources[i].offset <= a:
            offset, arr = sources[i]
            b = min(hi, offset + arr.size)
            out.append((a, b, arr[a - offset:b - offset]))
        else:
            b = min(hi, sources[i].offset) if i < len(sources) else hi
            out.append((a, b, buf[a:b]))
        a = b
    return out


def reduce_plan(rt: Runtime, dtype: np.dtype[Any], op: int, prescale: float, postscale: float, where: str,
                serial: int = 0) -> ReducePlan:
    """Check ``op`` and the scale factors for ``dtype`` once; raises TypeError/ValueError."""
    fn = reducer(op, dtype)
    scale_pre, scale_post, divisor = _scale_of(rt, dtype, op, prescale, postscale, where)
    # the scale as a scalar of the tensor's dtype: the hot path multiplies without converting
    return ReducePlan(dtype, op, fn, prescale, postscale, scale_pre, dtype.type(scale_post), divisor, serial,
                      scale_post != 1.0 or divisor != 1)


def _scale_of(rt: Runtime, dtype: np.dtype[Any], op: int, prescale: float, postscale: float,
              where: str) -> tuple[float, float, int]:
    """(prescale, postscale, integer divisor) for ``op`` on ``dtype``; raises TypeError for ints."""
    if dtype.kind in "biu":
        if prescale != 1.0 or postscale != 1.0:
            raise TypeError(f"{where}: prescale_factor/postscale_factor need a floating-point tensor, "
                            f"got {dtype}; cast it to float32 first")
        return 1.0, 1.0, (rt.size if op == Average and rt.size > 1 else 1)
    if op == Average:
        postscale = postscale / rt.size
    return prescale, postscale, 1


def allreduce_desc(name: object, shape: Iterable[int], prescale: float, postscale: float,
                   members: Sequence[tuple[object, tuple[int, ...]]] | None = None) -> Desc:
    """What every rank must agree on, besides kind/dtype/op/count, as labelled fields."""
    desc: Desc = (("name", name), ("shape", tuple(shape)), ("prescale_factor", prescale),
            ("postscale_factor", postscale))
    if members is not None:
        # the count and the members explain a mismatch better than the fused total shape
        desc = (("number of tensors", len(members)), ("tensors (name, shape)", tuple(members))) + desc
    return desc


@final  # (lets mypy narrow ``type(x) is not Flat`` to an array)
class Flat:
    """Consecutive flat arrays read and written as one: a fused pass copies straight between its
    members and the transport's buffers, with no fusion buffer in between."""

    __slots__ = ("arrays", "ends", "size")

    def __init__(self, arrays: list[Array]) -> None:
        self.arrays = arrays
        ends: list[int]
        ends, end = [], 0
        for a in arrays:
            end += a.size
            ends.append(end)
        self.ends = ends
        self.size = end

    def spans(self, lo: int, hi: int) -> Iterator[tuple[Array, int, int, int]]:
        """(array, start in it, start in [lo, hi), count) covering elements [lo, hi)."""
        i = bisect.bisect_right(self.ends, lo)
        ends, arrays = self.ends, self.arrays
        pos = lo
        while pos < hi:
            e = min(hi, ends[i])
            if e > pos:
                base = ends[i] - arrays[i].size
                yield arrays[i], pos - base, pos - lo, e - pos
            pos = e
            i += 1

    def read(self, lo: int, hi: int, out: Array) -> None:
        """Copy elements [lo, hi) into ``out``."""
        for a, at, to, count in self.spans(lo, hi):
            np.copyto(out[to:to + count], a[at:at + count])

    def write(self, lo: int, hi: int, src: Array) -> None:
        """Copy ``src`` into elements [lo, hi)."""
        for a, at, to, count in self.spans(lo, hi):
            np.copyto(a[at:at + count], src[to:to + count])


def _read(flat: Flat | Array, lo: int, hi: int, out: Array) -> None:
    if type(flat) is Flat:
        flat.read(lo, hi, out)
    else:
        np.copyto(out, flat[lo:hi])


def _write(flat: Flat | Array, lo: int, hi: int, src: Array) -> None:
    if type(flat) is Flat:
        flat.write(lo, hi, src)
    else:
        np.copyto(flat[lo:hi], src)


def allreduce(rt: Runtime, members: Sequence[Member], plan: ReducePlan, name: str, desc: LazyDesc,
              pending: int | None = None, own: bytes | None = None,
              sources: list[Source] | None = None) -> list[Array]:
    """Reduce every member over the ranks (one pass, fused); returns the flat outputs.

    ``plan`` comes from ``reduce_plan``; ``desc`` (or its packed agreement ``own``) is what the
    ranks agree on. An in-place member's output is its input; a member whose ``dst`` is None gets
    a new array. Every path reduces each element once, in rank order or on one rank, so every rank
    ends bit-identical. ``sources`` (one in-place member only, a list of ``Source``) are inputs
    still to be copied into their slots of the member: on the registered path only the blocks the
    peers read are copied, this rank's own block is reduced from the sources where they lie;
    every other path copies them all first.
    """
    start = time.perf_counter()
    dtype = plan.dtype
    single = len(members) == 1
    if sources is not None and (not single or rt.headers.fits_eager(members[0].src.nbytes)):
        _fill(members[0].src, sources)
        sources = None
    src: Flat | Array
    dst: Flat | Array | None
    outs: list[Array]
    if single:
        src = members[0].src
        total = src.size
        dst = members[0].dst
        if dst is None:
            fresh: Array = rt.pool.empty(total, dtype)  # (typed: dst is then an array, not the union)
            dst = fresh
        outs = [dst]
    else:
        src = Flat([m.src for m in members])
        total = src.size
        outs = [rt.pool.empty(m.src.size, dtype) if m.dst is None else m.dst for m in members]
        dst = Flat(outs)
    nbytes = total * dtype.itemsize
    phases: Phases = {}
    if nbytes <= algorithms.eager_limit(rt):
        _eager(rt, src, dst, total, plan, name, desc, pending, own, start, phases)
        algorithm = "eager"
    else:
        algorithm = _large(rt, src, dst, total, plan, name, desc, pending, own, start, phases, single, sources)
    rt.trace.record("allreduce", name, nbytes, start, time.perf_counter(), phases, algorithm)
    return outs


def allreduce_one(rt: Runtime, member: Member, plan: ReducePlan, name: str, desc: LazyDesc,
                  own: bytes | None) -> Array:
    """``allreduce`` of one member, returning its flat output (the short path above eager)."""
    return allreduce(rt, [member], plan, name, desc, None, own)[0]


def eager_one(rt: Runtime, src: Array, dst: Array | None, plan: ReducePlan, name: str, desc: LazyDesc,
              own: bytes | None) -> Array:

    """One tensor whose payload fits the agreement message, on the short path (a blocking call on
    an idle engine): ``allreduce`` + ``_eager`` for a single member, without the fused pass's
    generality. Returns the flat output: ``dst``, or a new array when it is None."""
    nbytes = src.nbytes
    if nbytes > algorithms.eager_limit(rt):  # another algorithm, or the capacity changed at a resync
        return allreduce(rt, [Member(src, dst)], plan, name, desc, None, own)[0]
    start = time.perf_counter()
    dtype = plan.dtype
    total = src.size
    payload = rt.headers.payload_view(dtype, total)
    if plan.scale_pre != 1.0:
        np.multiply(src, dtype.type(plan.scale_pre), out=payload)
    else:
        np.copyto(payload, src)
    rt.agreement.negotiate("allreduce", name, dtype, plan.op, -1, total, desc, preset=nbytes, own=own)
    agreed = time.perf_counter()
    if dst is None:
        dst = np.empty(total, dtype)
    me = rt.rank
    _reduce_into(dst, [payload if q == me else rt.headers.peer_payload(q, dtype, total) for q in rt.participants],
                 plan, rt.joined)
    rt.trace.record("allreduce", name, nbytes, start, time.perf_counter(), {"negotiate": (start, agreed)}, "eager")
    return dst


@dataclasses.dataclass(slots=True, eq=False)
class Lane:
    """An allreduce signature seen before, and for a blocking eager one its prepared exchange:
    what a later call with the same arguments reuses instead of checking, planning, packing and
    building views again.

    Made by ``prepare_lane`` after a call of the signature was checked the full way; the engine
    keeps one per (name, in place) and takes it only when the call's arguments equal the key
    fields; a blocking call runs on it (``Engine.run_lane``) only while the runtime's wiring and
    its config's revision are the ones it was prepared under: its exchange is prepared only when
    the algorithm chosen for its size is the eager path then (``algorithms.eager_limit``), and
    both count every change of what that choice depends on. Holds no caller array: every call
    copies its own input in.
    """

    # the signature, as the caller passes it (compared on every call)
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    op: object
    average: object
    prescale: object
    postscale: object
    # what the lane reuses
    plan: ReducePlan
    desc: Desc            # what the ranks agree on (explains a mismatch)
    prepared: Prepared | None  # the header exchange (Agreement.prepare), or None: signature only
    # typed as run() reads them: set with ``prepared`` by _wire, read only once it is (None before)
    payload: Array        # the send buffer's payload region, shaped as the input (None: signature only)
    terms: list[Array]    # every participant's payload in rank order, shaped (ours is ``payload``)
    nbytes: int
    pre: np.generic | None  # the prescale factor as a scalar of the dtype, None when it is 1
    revision: int = -1    # the config's revision the exchange was prepared under (Config.revision)

    def fits(self, arr: Array, op: object, average: object, prescale: object, postscale: object) -> bool:
        """Whether a call with these arguments is this lane's signature (``arr`` a numpy array).

        Identity for the op and average (ints and None: cached objects), floats compared as
        floats only: an argument of another type goes the full way, where it is checked."""
        return (arr.dtype is self.dtype and arr.shape == self.shape and op is self.op
                and average is self.average and type(prescale) is float and prescale == self.prescale
                and type(postscale) is float and postscale == self.postscale)

    def run(self, rt: Runtime, tensor: Array, in_place: bool, name: str, _explicit: str | None) -> Array:
        """One blocking allreduce of ``tensor`` (executor lock held, wiring checked): copy in,
        the prepared exchange, reduce in rank order into ``tensor`` (in place) or a new array,
        one trace record: ``eager_one``'s work without its lookups, views or reshapes."""
        start = time.perf_counter()
        plan = self.plan
        if self.pre is None:
            self.payload[...] = tensor
        else:
            np.multiply(tensor, self.pre, out=self.payload)
        peers = rt.agreement.run_prepared(self.prepared, "allreduce", name, plan.dtype, plan.op, -1, self.desc)  # type: ignore[arg-type]  # a lane is run with its exchange
        agreed = time.perf_counter()
        out = tensor if in_place else np.empty(self.shape, plan.dtype)
        if peers is None:
            terms = self.terms
        else:  # a peer's join notice came instead of its header: it is left out from now on
            me, dtype, count, shape = rt.rank, plan.dtype, self.payload.size, self.shape
            terms = [self.payload if q == me else rt.headers.peer_payload(q, dtype, count).reshape(shape)
                     for q in rt.participants]
        _reduce_into(out, terms, plan, rt.joined)
        rt.trace.record("allreduce", name, self.nbytes, start, time.perf_counter(), {"negotiate": (start, agreed)},
                        "eager")
        return out

    def renew(self, rt: Runtime, _result: object) -> None:
        """Prepare the exchange anew on the runtime's wiring (a call went the full way after a
        resync or a join; executor lock held); it stays stale where none applies."""
        # (Engine.run_lane takes prepared lanes only: prepared is not None here)
        self._wire(rt, self.prepared.agreement)  # type: ignore[union-attr]

    def _wire(self, rt: Runtime, own: bytes) -> None:
        revision = rt.config.revision  # (read before the choice that it stamps)
        if self.nbytes > algorithms.eager_limit(rt):
            return  # another algorithm runs this size now: no exchange to prepare
        prepared = rt.agreement.prepare(own, self.nbytes)
        if prepared is not None:
            self.revision = revision
            dtype, count, shape = self.plan.dtype, int(np.prod(self.shape, dtype=np.int64)), self.shape
            self.payload = rt.headers.payload_view(dtype, count).reshape(shape)
            self.terms = [self.payload if q == rt.rank else rt.headers.peer_payload(q, dtype, count).reshape(shape)
                          for q in rt.participants]
            self.prepared = prepared


def prepare_lane(rt: Runtime | None, entry: Reduce, op: object, average: object, prescale: object,
                 postscale: object) -> Lane:
    """The ``Lane`` of ``entry``'s signature (a ``Reduce`` whose arguments were checked).

    With ``rt`` (a blocking call that just ran, executor lock held) its exchange is prepared too,
    where one applies (the payload fits the agreement message, no peer has joined); without, or
    where none applies, the lane holds the signature and plan only: an async call of it skips the
    checks, a blocking one goes the full way (and prepares the exchange then).
    """
    plan = entry.plan
    dtype = plan.dtype
    desc = entry.describe()
    pre = None if plan.scale_pre == 1.0 else dtype.type(plan.scale_pre)
    lane = Lane(entry.src.dtype, entry.shape, op, average, prescale, postscale, plan, desc, None,
                None, None,  # type: ignore[arg-type]  # (payload, terms: set by _wire with prepared)
                entry.src.nbytes, pre)
    if rt is not None:
        lane._wire(rt, rt.agreement.own("allreduce", dtype, plan.op, -1, entry.src.size, desc))
    return lane


@dataclasses.dataclass(slots=True, eq=False)
class GatherLane:
    """A blocking allgather (or allgather_object) signature seen before, its exchange prepared.

    This rank's signature is its input's dtype and shape; every rank's dim 0 rides in its
    header (``aux``), so the lane expects of each peer the header with the rows it sent last
    time. When every peer sends that, the output's layout is the one computed when the lane was
    made: one concatenation of the payloads where they lie. A peer whose rows changed sends
    another header: its rows come from it as on the full way (the lane expects them from then
    on); another dtype or trailing shape is a mismatch on every rank, as on the full way.
    """

    kind: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]  # this rank's input as passed (compared on every call)
    desc: Desc
    prepared: Prepared
    payload: Array        # the send buffer's payload region, shaped (rows, *trailing)
    rows: list[int]       # every rank's dim 0, as last exchanged
    terms: list[Array | None]  # every rank's payload in rank order, shaped (its rows, *trailing);
    #                            None: a peer's rows do not fit the agreement message (see _expect)
    out_shape: tuple[int, ...]

    def fits(self, arr: Array) -> bool:
        """Whether ``arr`` (a numpy array) is this lane's signature."""
        return arr.dtype is self.dtype and arr.shape == self.shape

    def run(self, rt: Runtime, arr: Array, name: str, _explicit: str | None) -> tuple[Array, list[int]]:
        """One blocking allgather of ``arr`` (executor lock held, wiring checked): copy in, the
        prepared exchange, one concatenation. Returns (output, every rank's dim 0)."""
        start = time.perf_counter()
        self.payload[...] = arr
        peers = rt.agreement.run_prepared(self.prepared, self.kind, name, self.dtype, 0, -1, self.desc)
        if peers is None:
            out = np.empty(self.out_shape, self.dtype)
            np.concatenate(self.terms, out=out)  # type: ignore[arg-type]  # (none is None: expected headers came)
            rows = self.rows
        else:  # another row count on some peer: as the full way, then expected from now on
            out, rows = _gathered(rt, self.payload, peers, True, self.kind, name)
            self._expect(rt, rows)
        rt.trace.record(self.kind, name, out.nbytes, start, time.perf_counter(), {})
        return out, rows

    def renew(self, rt: Runtime, result: tuple[Array, list[int]]) -> None:
        """Prepare the exchange anew on the runtime's wiring after a full call that returned
        ``result`` (output, rows); it stays stale where none applies."""
        self._wire(rt, self.prepared.agreement, result[1])

    def _wire(self, rt: Runtime, own: bytes, rows: Sequence[int]) -> None:
        """Prepare the exchange (this rank sends its rows and payload) and expect ``rows``."""
        prepared = rt.agreement.prepare(own, self.payload.nbytes, aux=self.payload.shape[0])
        if prepared is not None and len(rows) == rt.size:
            self.prepared = prepared
            self.payload = rt.headers.payload_view(self.dtype, self.payload.size).reshape(self.payload.shape)
            self._expect(rt, rows)

    def _expect(self, rt: Runtime, rows: Sequence[int]) -> None:
        """Expect every rank's dim 0 to be ``rows``: the peers' headers and payload views, the
        output's shape. When some peer's rows do not fit the agreement message (they come in a
        message of their own) no header is expected: every call takes the full layout."""
        rest = self.payload.shape[1:]
        row_bytes = self.payload.itemsize * int(np.prod(rest, dtype=np.int64))
        header = self.prepared.header
        sizes = {p: (rows[p], rows[p] * row_bytes) for p in rt.active}
        expected: tuple[bytes, ...] | None
        expected = tuple(rt.agreement.peer_header(header, *sizes[p]) for p in rt.active)
        if any(size > rt.headers.eager_limit for _rows, size in sizes.values()):
            expected = None  # never equal: the views below would not hold those rows
        # (Prepared.expected holds None too: its declaration in _core says tuple)
        self.prepared = self.prepared._replace(expected=expected)  # type: ignore[arg-type]
        self.rows = list(rows)
        self.terms = [self.payload if q == rt.rank else
                      rt.headers.peer_payload(q, self.dtype, rows[q] * row_bytes // self.payload.itemsize).reshape(
                          (rows[q],) + rest) if rows[q] * row_bytes <= rt.headers.eager_limit else None
                      for q in range(rt.size)]
        self.out_shape = (sum(rows),) + rest


def prepare_gather_lane(rt: Runtime, kind: str, arr: Array, rows: Sequence[int],
                        explicit_name: str | None) -> GatherLane | None:
    """The ``GatherLane`` of ``arr``'s signature after a full allgather that returned ``rows``
    (executor lock held), or None where none applies (a peer has joined, ``arr`` does not fit
    the agreement message)."""
    flat = arr.reshape(1) if arr.ndim == 0 else arr
    rest = flat.shape[1:]
    row_elems = int(np.prod(rest, dtype=np.int64))
    desc = (("name", explicit_name), ("trailing shape", rest))
    # the input's own memory stands in for the payload view until _wire makes that
    lane = GatherLane(kind, arr.dtype, arr.shape, desc,
                      None,  # type: ignore[arg-type]  # (set by _wire, or the lane is not returned)
                      np.ascontiguousarray(flat), [], [], ())
    lane._wire(rt, rt.agreement.own(kind, arr.dtype, 0, -1, row_elems, desc), rows)
    return lane if lane.prepared is not None else None


@dataclasses.dataclass(slots=True, eq=False)
class CastLane:
    """A blocking broadcast signature seen before (dtype, shape, root), its exchange prepared:
    the root's payload rides in its header's message, the other ranks send the header alone."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    root_rank: int        # as passed (a global rank), compared on every call
    root: int             # the root in this runtime's ranks
    desc: Desc
    prepared: Prepared
    payload: Array        # the root's payload, shaped as the input: the send buffer's on the root,
    nbytes: int           # its eager buffer's elsewhere

    def fits(self, arr: Array, root_rank: object) -> bool:
        """Whether ``arr`` (a numpy array) and ``root_rank`` are this lane's signature."""
        return (arr.dtype is self.dtype and arr.shape == self.shape and type(root_rank) is int
                and root_rank == self.root_rank)

    def run(self, rt: Runtime, arr: Array, in_place: bool, name: str, _explicit: str | None) -> Array:
        """One blocking broadcast (executor lock held, wiring checked): the root copies in, every
        rank runs the prepared exchange, the others copy the root's payload out."""
        start = time.perf_counter()
        is_root = rt.rank == self.root
        if is_root:
            self.payload[...] = arr
        peers = rt.agreement.run_prepared(self.prepared, "broadcast", name, self.dtype, 0, self.root, self.desc)
        out = arr if in_place else np.empty(self.shape, self.dtype)
        if is_root:
            if not in_place:
                out[...] = arr
        elif peers is None:
            out[...] = self.payload
        else:  # every check passed on headers unlike the expected ones (defensive: none is known)
            out.reshape(-1)[...] = np.frombuffer(peers[self.root].payload, self.dtype, out.size)  # type: ignore[arg-type]  # an eager payload
        rt.trace.record("broadcast", name, self.nbytes, start, time.perf_counter(), {})
        return out

    def renew(self, rt: Runtime, _result: object) -> None:
        """Prepare the exchange anew on the runtime's wiring (see ``Lane.renew``)."""
        self._wire(rt, self.prepared.agreement)

    def _wire(self, rt: Runtime, own: bytes) -> None:
        root, nbytes = self.root, self.nbytes
        if nbytes > rt.headers.eager_limit:
            return
        peers = {p: (0, nbytes if p == root else -1) for p in rt.active}
        prepared = rt.agreement.prepare(own, nbytes if rt.rank == root else -1, peers=peers)
        if prepared is not None:
            count = int(np.prod(self.shape, dtype=np.int64))
            if rt.rank == root:
                self.payload = rt.headers.payload_view(self.dtype, count).reshape(self.shape)
            else:
                self.payload = rt.headers.peer_payload(root, self.dtype, count).reshape(self.shape)
            self.prepared = prepared


def prepare_cast_lane(rt: Runtime, arr: Array, root_rank: int, root: int,
                      explicit_name: str | None) -> CastLane | None:
    """The ``CastLane`` of a broadcast of ``arr`` from ``root`` (this runtime's rank; passed as
    the global ``root_rank``), executor lock held; None where none applies."""
    desc = (("name", explicit_name), ("shape", tuple(arr.shape)))
    lane = CastLane(arr.dtype, arr.shape, root_rank, root, desc,
                    None, None,  # type: ignore[arg-type]  # (set by _wire, or the lane is not returned)
                    arr.nbytes)
    lane._wire(rt, rt.agreement.own("broadcast", arr.dtype, 0, root, arr.size, desc))
    return lane if lane.prepared is not None else None


def _eager(rt: Runtime, src: Flat | Array, dst: Flat | Array, total: int, plan: ReducePlan, name: str,
           desc: LazyDesc, pending: int | None, own: bytes | None, start: float, phases: Phases) -> None:
    """Payloads inside the agreement message; every rank reduces them in rank order."""
    dtype = plan.dtype
    payload = rt.headers.payload_view(dtype, total)
    if type(src) is Flat:
        if total:
            np.concatenate(src.arrays, out=payload)  # one C loop over the members
        if plan.scale_pre != 1.0:
            np.multiply(payload, dtype.type(plan.scale_pre), out=payload)
    elif plan.scale_pre != 1.0:
        np.multiply(src, dtype.type(plan.scale_pre), out=payload)
    else:
        np.copyto(payload, src)
    rt.agreement.negotiate("allreduce", name, dtype, plan.op, -1, total, desc, preset=total * dtype.itemsize,
                 pending=pending, own=own)
    phases["negotiate"] = (start, time.perf_counter())
    # Reduce in rank order so every rank gets the same bits; our own input is read from the copy
    # that went out in the agreement message (in place, the input is also the output).
    parts = rt.participants
    me = rt.rank
    out = dst if type(dst) is not Flat else rt.scratch(total * dtype.itemsize).view(dtype)
    terms = [payload if q == me else rt.headers.peer_payload(q, dtype, total) for q in parts]
    _reduce_into(out, terms, plan, rt.joined)
    if out is not dst:
        dst.write(0, total, out)  # type: ignore[union-attr]  # (out is a scratch copy when dst is a Flat)


def _reduce_into(out: Array, terms: Sequence[Array], plan: ReducePlan, joined: Mapping[int, JoinNote]) -> None:
    """Reduce every participant's term, in rank order, into ``out``; then scale it."""
    fn = plan.fn
    if len(terms) == 1:
        out[...] = terms[0]  # a C-level copy: np.copyto's dispatch costs a Python call
    else:
        fn(terms[0], terms[1], out=out)
        for term in terms[2:]:
            fn(out, term, out=out)
    if plan.finish:
        _finish(out, plan.scale_post, plan.divisor)
    if joined:
        _joined_zeros(out, plan)


def _joined_zeros(out: Array, plan: ReducePlan) -> None:
    """Ranks that called join() contribute zeros (Horovod): Sum/Average need nothing, the rest do."""
    if plan.op in (Min, Max, Product):
        plan.fn(out, plan.dtype.type(0), out=out)


def _large(rt: Runtime, src: Flat | Array, dst: Flat | Array, total: int, plan: ReducePlan, name: str,
           desc: LazyDesc, pending: int | None, own: bytes | None, start: float, phases: Phases, single: bool,
           sources: list[Source] | None = None) -> str:
    """Above the eager path: shared memory on one host, else the pipelined ring, recursive
    doubling or the hierarchy (``algorithms.algorithm``). Returns the algorithm that ran."""
    # (``single``: src and dst are arrays, else both are Flats, and ``sources`` is None: mypy does
    # not tie the types to the flag, hence the ignores below)
    dtype = plan.dtype
    nbytes = total * dtype.itemsize
    # in place: once dst is written, a retry would read results (Runtime.run refuses to retry)
    aliased = single and (src is dst or np.shares_memory(src, dst))
    # Shared memory when every rank is on this host and the payload is above the threshold:
    # each rank offers its slot in the agreement message (aux), 0 meaning "ring, please", and
    # takes that path only if every rank offered one, so all ranks choose alike. An in-place
    # tensor in registered memory (a gradient bucket) also names its region: when every rank's
    # is, the peers reduce straight out of each other's buffers (no copy in).
    algorithm = algorithms.algorithm(rt, nbytes)
    shm = algorithm == "shm"
    region = rt.shm.locate(src) if shm and src is dst else 0  # type: ignore[union-attr, arg-type]  # shm: slots; in place: an array
    if sources is not None and (not region or plan.scale_pre != 1.0):
        _fill(src, sources)  # type: ignore[arg-type]  # only the registered path reads them where they lie
        sources = None
    if single and plan.scale_pre != 1.0 and not region:
        src = src * dtype.type(plan.scale_pre)
        prescaled = True
    else:  # a Flat, or an array in registered memory reduced where it lies: not scaled yet
        prescaled = plan.scale_pre == 1.0
    offer = rt.shm.advertise(0 if region else nbytes, rt.config.shm_window_bytes) if shm else 0  # type: ignore[union-attr]  # shm: slots
    peers = rt.agreement.negotiate("allreduce", name, dtype, plan.op, -1, total, desc, aux=offer, pending=pending,
                         own=own, region=region)
    phases["negotiate"] = (start, time.perf_counter())
    registered = (region and len(rt.participants) > 1 and total and offer and all(peers[p].aux for p in peers)
                  and all(peers[p].region for p in peers))
    if sources is not None and not registered:
        _fill(src, sources)  # type: ignore[arg-type]
        sources = None
    if len(rt.participants) == 1 or total == 0:
        algorithm = "local"
        _local(rt, src, dst, plan, single, prescaled)
    elif offer and all(peers[p].aux for p in peers):
        algorithm = "shm"
        if registered:
            _registered(rt, src, plan, offer, peers, name, phases, sources)  # type: ignore[arg-type]
        else:
            if region and plan.scale_pre != 1.0:  # a peer's tensor is not registered after all
                src, prescaled = src * dtype.type(plan.scale_pre), True
            _shared(rt, src, dst, plan, offer, {p: peers[p].aux for p in peers}, name, phases, aliased,
                    prescaled)
    else:
        if algorithm not in algorithms.BODIES:  # (shm that a peer could not offer: the ring)
            algorithm = "ring"
        _staged_p2p(rt, algorithm, src, dst, plan, total, name, phases, aliased, prescaled)
    return algorithm


def _local(rt: Runtime, src: Flat | Array, dst: Flat | Array, plan: ReducePlan, single: bool, prescaled: bool) -> None:
    """The allreduce of a rank alone (every peer joined) or of nothing: its own input, finished."""
    dtype = plan.dtype
    if single:
        if src is not dst:
            np.copyto(dst, src)  # type: ignore[arg-type]
        if not prescaled:  # registered, and every peer joined: no path below scaled it
            np.multiply(dst, dtype.type(plan.scale_pre), out=dst)  # type: ignore[arg-type]
    else:
        for m, out in zip(src.arrays, dst.arrays):  # type: ignore[union-attr]
            if out is not m:
                np.copyto(out, m)
            if not prescaled:
                np.multiply(out, dtype.type(plan.scale_pre), out=out)
    for out in (dst.arrays if type(dst) is Flat else [dst]):
        _finish(out, plan.scale_post, plan.divisor)
        if rt.joined:
            _joined_zeros(out, plan)


def _staged_p2p(rt: Runtime, algorithm: str, src: Flat | Array, dst: Flat | Array, plan: ReducePlan, total: int,
                name: str, phases: Phases, aliased: bool, prescaled: bool) -> None:
    """``_p2p`` on one array: ``src`` itself, or a staged copy of a fused pass (or of an input
    still to be prescaled), written back into ``dst`` after."""
    if type(src) is Flat or not prescaled:
        staged = np.empty(total, plan.dtype)
        _read(src, 0, total, staged)
        if not prescaled:
            np.multiply(staged, plan.dtype.type(plan.scale_pre), out=staged)
        _p2p(rt, algorithm, staged, staged, plan, total, name, phases, False)
        if rt.joined:
            _joined_zeros(staged, plan)
        _write(dst, 0, total, staged)
    else:
        _p2p(rt, algorithm, src, dst, plan, total, name, phases, aliased)  # type: ignore[arg-type]
        if rt.joined:
            _joined_zeros(dst, plan)  # type: ignore[arg-type]


def _p2p(rt: Runtime, algorithm: str, src: Array, dst: Array, plan: ReducePlan, total: int, name: str,
         phases: Phases, aliased: bool) -> None:
    """The allreduce's data over messages: the pipelined ring, or a body of ``_algorithms``."""
    if algorithm == "ring":
        _ring(rt, src, dst, plan.fn, plan.scale_post, plan.divisor, _even_bounds(total, len(rt.participants)),
              name, phases, aliased=aliased)
    else:
        algorithms.BODIES[algorithm](rt, src, dst, plan.fn, plan.scale_post, plan.divisor, name, phases, aliased)


def _finish(arr: Array, postscale: float, divisor: int) -> None:
    if postscale != 1.0:
        np.multiply(arr, postscale if type(postscale) is arr.dtype.type else arr.dtype.type(postscale), out=arr)
    if divisor != 1:
        np.floor_divide(arr, divisor, out=arr)


def _even_bounds(length: int, n: int) -> list[int]:
    return [length * j // n for j in range(n + 1)]


def _row_bounds(rows: int, row_elems: int, n: int) -> list[int]:
    """Horovod's split of dim 0: the first ``rows % n`` ranks get one extra row."""
    bounds = [0]
    for j in range(n):
        bounds.append(bounds[-1] + (rows // n + (1 if j < rows % n else 0)) * row_elems)
    return bounds


def _ring(rt: Runtime, src: Array, dst: Array, fn: np.ufunc, postscale: float, divisor: int, bounds: Sequence[int],
          name: str, phases: Phases, allgather: bool = True, aliased: bool = False) -> None:
    """Pipelined ring: reduce-scatter then (optionally) allgather, in pieces of ``chunk_bytes``.

    Reduce-scatter step s: rank r sends segment (r-s-1) and receives segment (r-s-2) from the
    left, reducing it with its own input; the segment reduced at step s is the one it sends at
    step s+1, piece by piece, so a piece travels on while the next one is reduced. After n-1
    steps rank r owns the finished segment r, which the allgather passes around the ring.

    Here r is the rank's place in ``rt.ring_order`` (host-contiguous) and segment j there is
    rank ``ring_order[j]``'s block of ``bounds``, so every rank still finishes its own block.
    Each step's phase names the rank it received from and, when that hop crosses hosts, says so.
    """
    _RingPass(rt, src, dst, bounds, name, phases).run(fn, postscale, divisor, allgather, aliased)


class _RingPass:
    """One pass of the pipelined ring (``_ring``): the ring's order, this rank's neighbours, the
    segments and their pieces, and the requests in flight."""

    def __init__(self, rt: Runtime, src: Array, dst: Array, bounds: Sequence[int], name: str,
                 phases: Phases) -> None:
        order = rt.ring_order
        block = {q: q for q in order}  # rank -> its block of bounds
        if rt.joined:  # ranks that called join() are left out of the ring; bounds has a block a participant
            order = [q for q in order if q not in rt.joined]
            block = {q: i for i, q in enumerate(rt.participants)}
        self.rt, self.src, self.dst, self.phases = rt, src, dst, phases
        self.comm, n, r = rt.comm, len(order), order.index(rt.rank)
        self.n, self.r = n, r
        left, right = order[(r - 1) % n], order[(r + 1) % n]
        self.left, self.right = left, right
        self.seg = seg = [(bounds[block[q]], bounds[block[q] + 1]) for q in order]
        self.hop = f"from {left}" + (f" @ {rt.hosts[left]} (network)"
                                     if rt.hosts[left] != rt.hosts[rt.rank] else "")
        self.step_elems = max(1, rt.config.chunk_bytes // src.itemsize)
        self.what = f"allreduce '{name}' (ring, waiting on rank {left})"
        self.sending = f"allreduce '{name}' (ring, sending to rank {right})"
        self.inflight: list[MPI.Request] = []
        rt.inflight = self.inflight
        maxseg = max(hi - lo for lo, hi in seg)
        scratch = rt.scratch(2 * maxseg * src.itemsize).view(src.dtype)
        self.halves = (scratch[:maxseg], scratch[maxseg:])
        self.sends: list[MPI.Request] = []
        self.seg_sends: dict[int, list[MPI.Request]] = {}

    def pieces(self, j: int) -> list[tuple[int, int]]:
        """Segment ``j``'s pieces, ``chunk_bytes`` each."""
        lo, hi = self.seg[j]
        step_elems = self.step_elems
        return [(a, min(a + step_elems, hi)) for a in range(lo, hi, step_elems)]

    def post_rs(self, step: int) -> tuple[int, list[tuple[MPI.Request, int, int]]]:
        """Post the receives of reduce-scatter step ``step`` (into a half of the scratch)."""
        j = (self.r - step - 2) % self.n
        buf, base = self.halves[step % 2], self.seg[j][0]
        reqs = []
        for a, b in self.pieces(j):
            req = self.comm.Irecv(_bytes(buf[a - base:b - base]), self.left, TAG_DATA)
            self.inflight.append(req)
            reqs.append((req, a, b))
        return j, reqs

    def post_ag(self, j: int) -> tuple[int, list[tuple[MPI.Request, int, int]]]:
        """Post the receives of segment ``j``'s allgather step (straight into ``dst``)."""
        reqs = []
        for a, b in self.pieces(j):
            req = self.comm.Irecv(_bytes(self.dst[a:b]), self.left, TAG_AG)
            self.inflight.append(req)
            reqs.append((req, a, b))
        return j, reqs

    def send(self, arr: Array, a: int, b: int, tag: int, j: int) -> None:
        """Send ``arr[a:b]`` (a piece of segment ``j``) to the right."""
        req = self.comm.Isend(_bytes(arr[a:b]), self.right, tag)
        self.inflight.append(req)
        self.sends.append(req)
        self.seg_sends.setdefault(j, []).append(req)

    def run(self, fn: np.ufunc, postscale: float, divisor: int, allgather: bool, aliased: bool) -> None:
        """The reduce-scatter, then the allgather (when asked), then the last sends' completion."""
        src, dst, r, n = self.src, self.dst, self.r, self.n
        t0 = time.perf_counter()
        j0 = (r - 1) % n
        in_place = np.shares_memory(src, dst)
        # Allgather step 0 lands in segment r-1 of dst, which the reduce-scatter never writes: out of
        # place, post it now under its own tag so the first allgather pieces never wait in MPI's
        # queues. In place, that memory is what step 0 sends, so it waits until those sends are done.
        ag_next = self.post_ag(j0) if allgather and not in_place else None
        for a, b in self.pieces(j0):
            self.send(src, a, b, TAG_DATA, j0)
        step_start = self.reduce_scatter(fn, postscale, divisor, allgather, aliased, t0)
        t1 = time.perf_counter()
        self.phases["reduce_scatter"] = (t0, t1)
        if allgather and in_place:
            sent = self.seg_sends.get(j0, [])
            self.rt.waits.wait(sent, self.what, [self.right] * len(sent))
            ag_next = self.post_ag(j0)
        if allgather:
            self.allgather(ag_next, step_start)  # type: ignore[arg-type]  # (posted above by now)
            self.phases["allgather"] = (t1, time.perf_counter())
        self.rt.waits.wait(self.sends, self.sending, [self.right] * len(self.sends))

    def reduce_scatter(self, fn: np.ufunc, postscale: float, divisor: int, allgather: bool, aliased: bool,
                       step_start: float) -> float:
        """n-1 steps: reduce each piece received into ``dst`` and send it on; returns when the
        last step ended."""
        rt, src, dst, n, left = self.rt, self.src, self.dst, self.n, self.left
        wait, what, send = rt.waits.wait, self.what, self.send
        pending = self.post_rs(0)
        for s in range(n - 1):
            j, reqs = pending
            if s + 1 < n - 1:
                pending = self.post_rs(s + 1)
            buf, base = self.halves[s % 2], self.seg[j][0]
            last = s == n - 2
            for req, a, b in reqs:
                wait([req], what, [left])
                rt.partial = aliased  # dst is written from here on: no retry (Runtime.run)
                out = dst[a:b]
                fn(src[a:b], buf[a - base:b - base], out=out)
                if last:
                    _finish(out, postscale, divisor)
                    if allgather:
                        send(dst, a, b, TAG_AG, j)
                else:
                    send(dst, a, b, TAG_DATA, j)
            step_end = time.perf_counter()
            self.phases[f"reduce_scatter[{s}] seg {j} {self.hop}"] = (step_start, step_end)
            step_start = step_end
        return step_start

    def allgather(self, ag_next: tuple[int, list[tuple[MPI.Request, int, int]]], step_start: float) -> None:
        """n-1 steps: receive each finished segment from the left and pass it on to the right."""
        rt, dst, n, r, left, right = self.rt, self.dst, self.n, self.r, self.left, self.right
        wait, what, seg_sends = rt.waits.wait, self.what, self.seg_sends
        for s in range(n - 1):
            j, reqs = ag_next
            if s + 1 < n - 1:
                nj = (r - s - 2) % n
                if seg_sends.get(nj):
                    wait(seg_sends[nj], what, [right] * len(seg_sends[nj]))
                ag_next = self.post_ag(nj)
            for req, a, b in reqs:
                wait([req], what, [left])
                if s < n - 2:
                    self.send(dst, a, b, TAG_AG, j)
            step_end = time.perf_counter()
            self.phases[f"allgather[{s}] seg {j} {self.hop}"] = (step_start, step_end)
            step_start = step_end


def _shared(rt: Runtime, src: Flat | Array, dst: Flat | Array, plan: ReducePlan, offer: int, offers: dict[int, int],
            name: str, phases: Phases, aliased: bool, prescaled: bool) -> None:
    """Allreduce through the ranks' shared-memory slots, in pieces, one sync per piece.

    Each half of a slot holds one piece as n regions of a fixed size, region i for block i of
    the piece (rank ``participants[i]``'s). Per piece k: every rank copies the blocks of its
    input that the peers own into regions q != r of its slot (copy in); sync; rank r reduces
    block r over the inputs of ranks 0, 1, .., n-1 in that order (the eager path's order; its
    own term straight from its input) into region r of its slot and copies it at once, still in
    the cache, into its output (reduce); after the next sync every rank copies block q out of
    region q of slot q, for the peers q only (copy out). Each element is computed once, so every
    rank gets the same bits, and only rank q ever writes slot q (no cache line is written by two
    cores). Per rank that moves each byte of the input out and of the result in once, plus the
    own block's copy: against the scheme with two syncs per piece, no copy of the own block out
    of the slot, and half the syncs.
    Pipelined, one sync a piece: copy in k+1; sync; copy out k; reduce k+1. The sync after copy
    in k+1 also says every rank reduced k. Pieces alternate between the slots' two halves, and a
    region keeps one writer and one kind of reader: a rank writes regions q != r of half k % 2
    again (copy in k+2) after the sync that says every peer reduced k (their last read of them),
    and region r (reduce k+2) after the sync that says every peer copied k out. After the last
    piece: sync, copy out; the next collective's agreement exchange (or resync) is the fence.
    Pieces of half the slot (``shm_window_bytes`` caps it) are small enough to stay in the
    cache between the copy in, the reduction and the copy out.
    A fused pass (``src`` a ``Flat``) copies its members straight into the slot (applying the
    prescale there), reduces its own block member by member where they lie (with a prescale: a
    scaled copy in scratch), and copies its results straight out into the members.
    Ranks that called join() take no part: blocks are split among the participants.
    """
    _SharedPass(rt, src, dst, plan, offer, offers, name, aliased, prescaled).run(phases)


class _SharedPass:
    """One allreduce through the shared-memory slots (``_shared``): the slots mapped, the pieces
    and their blocks, and the copies and reductions of one piece."""

    def __init__(self, rt: Runtime, src: Flat | Array, dst: Flat | Array, plan: ReducePlan, offer: int,
                 offers: dict[int, int], name: str, aliased: bool, prescaled: bool) -> None:
        self.slots: SharedSlots = rt.shm  # type: ignore[assignment]  # this path runs only with slots
        self.rt, self.src, self.dst, self.plan, self.aliased = rt, src, dst, plan, aliased
        self.parts = parts = rt.participants
        self.n, self.me = n, me = len(parts), rt.rank
        self.index = parts.index(me)
        self.others = [q for q in parts if q != me]
        self.what = what = f"allreduce '{name}' (shared memory)"
        try:
            half = self.slots.attach(offer, offers) // 2
        except OSError as exc:
            raise RingError(f"{what}: rank {rt.world[me]} cannot map a peer's shared-memory slot ({exc}); set "
                            "JUPYTER_RING_SHM_THRESHOLD=off on every rank to use the ring") from exc
        dtype = plan.dtype
        self.total = src.size
        self.cap = cap = max(1, half // dtype.itemsize // n)  # elements of one region: a block of a piece
        self.step = step = cap * n
        self.slot: dict[int, Array] = {q: self.slots.slot(q)[:2 * step * dtype.itemsize].view(dtype) for q in parts}
        self.count = -(-self.total // step)
        self.pre = None if prescaled else dtype.type(plan.scale_pre)
        # own block read straight from the input: one array, or the fused members where they lie
        self.direct = type(src) is not Flat or self.pre is None
        self.own_copy = None if self.direct else rt.scratch(cap * dtype.itemsize).view(dtype)

    def blocks(self, k: int) -> tuple[int, list[int]]:
        """Piece k's start and its blocks' bounds inside it (block i: [c[i], c[i + 1]))."""
        a = k * self.step
        length = min(self.step, self.total - a)
        n = self.n
        return a, [length * i // n for i in range(n + 1)]

    def region(self, q: int, k: int, i: int, length: int) -> Array:
        """Region ``i`` of piece ``k``'s half of rank ``q``'s slot, ``length`` elements."""
        base = (k % 2) * self.step + i * self.cap
        return self.slot[q][base:base + length]

    def copy_in(self, k: int) -> None:
        """Copy the blocks of piece ``k`` that the peers own into this rank's slot (prescaled)."""
        a, c = self.blocks(k)
        index, direct, pre, src, me = self.index, self.direct, self.pre, self.src, self.me
        for i in range(self.n):
            if i == index and direct:
                continue
            # (i == index here only when not direct: own_copy is an array then)
            out = self.own_copy[:c[i + 1] - c[i]] if i == index else self.region(me, k, i, c[i + 1] - c[i])  # type: ignore[index]
            _read(src, a + c[i], a + c[i + 1], out)
            if pre is not None:
                np.multiply(out, pre, out=out)

    def reduce(self, k: int) -> None:
        """Reduce this rank's block of piece ``k`` over every rank's input, into its slot and out."""
        a, c = self.blocks(k)
        index, me, parts, src, plan = self.index, self.me, self.parts, self.src, self.plan
        joined = self.rt.joined
        lo, hi = c[index], c[index + 1]
        out = self.region(me, k, index, hi - lo)
        if type(src) is Flat and self.direct:  # member by member, each term read where it lies
            theirs = [None if q == me else self.region(q, k, index, hi - lo) for q in parts]
            for arr, at, to, length in src.spans(a + lo, a + hi):
                _reduce_into(out[to:to + length], [arr[at:at + length] if t is None else t[to:to + length]
                                                   for t in theirs], plan, joined)
        else:
            # (src is an array when direct here, own_copy one when not)
            own = src[a + lo:a + hi] if self.direct else self.own_copy[:hi - lo]  # type: ignore[index]
            _reduce_into(out, [own if q == me else self.region(q, k, index, hi - lo) for q in parts], plan, joined)
        self.rt.partial = self.aliased  # dst is written from here on: no retry (Runtime.run)
        _write(self.dst, a + lo, a + hi, out)

    def copy_out(self, k: int) -> None:
        """Copy the peers' finished blocks of piece ``k`` out of their slots into ``dst``."""
        a, c = self.blocks(k)
        for i, q in enumerate(self.parts):
            if q != self.me:
                _write(self.dst, a + c[i], a + c[i + 1], self.region(q, k, i, c[i + 1] - c[i]))

    def run(self, phases: Phases) -> None:
        """The pieces, pipelined: copy in k+1; sync; copy out k; reduce k+1 (see ``_shared``)."""
        rt, others, what, count = self.rt, self.others, self.what, self.count

        def traced(k: int, label: str, t0: float, t1: float) -> None:
            if k < _SHM_TRACED_PIECES:
                phases[f"{label} piece {k}" if count > 1 else label] = (t0, t1)

        first = time.perf_counter()
        self.copy_in(0)
        _sync(rt, others, what)
        self.slots.synced()  # every peer has mapped this rank's slot by now
        t1 = time.perf_counter()
        traced(0, "shm-copy-in", first, t1)  # each sync's wait ends the phase before it
        self.reduce(0)
        t2 = time.perf_counter()
        traced(0, "shm-reduce", t1, t2)
        for k in range(1, count):
            self.copy_in(k)
            _sync(rt, others, what)
            t3 = time.perf_counter()
            traced(k, "shm-copy-in", t2, t3)
            self.copy_out(k - 1)
            t4 = time.perf_counter()
            traced(k - 1, "shm-copy-out", t3, t4)
            self.reduce(k)
            t2 = time.perf_counter()
            traced(k, "shm-reduce", t4, t2)
            if k == _SHM_TRACED_PIECES:
                rest = t3
        _sync(rt, others, what)
        t3 = time.perf_counter()
        self.copy_out(count - 1)
        end = time.perf_counter()
        traced(count - 1, "shm-copy-out", t3, end)
        if count > _SHM_TRACED_PIECES:
            phases[f"shm pieces {_SHM_TRACED_PIECES}..{count - 1}"] = (rest, end)
        phases[f"shm ({count} x {self.step * self.plan.dtype.itemsize // 1024} KiB)"] = (first, end)


def _sync(rt: Runtime, others: list[int], what: str) -> None:
    """Announce this rank's next shared-memory sync point and wait until ``others`` reach it."""
    slots: SharedSlots = rt.shm  # type: ignore[assignment]  # this path runs only with slots
    value = slots.arrive(rt.gen)
    rt.waits.poll(lambda: slots.arrived(value, others), what, lambda: slots.missing(value, others))


def _registered(rt: Runtime, buf: Array, plan: ReducePlan, offer: int, peers: Peers, name: str, phases: Phases,
                sources: list[Source] | None = None) -> None:
    """In-place allreduce of tensors that live in registered memory, read where they lie.

    Every rank's tensor is in a file every peer maps (``SharedSlots.register``: gradient buckets),
    so nothing is copied in. Sync (every input is complete); then per piece: rank r reduces block
    r over every rank's tensor, in rank order, into its own tensor; sync; copies block q of
    every peer's tensor (its result) into its own. A last sync fences the caller's next writes
    into its tensor from peers still copying out of it. Each element is computed once: every
    rank ends bit-identical, with no extra copy of the tensor in or out. ``sources`` (fresh
    gradients not in the bucket yet): only the blocks the peers read are copied in before the
    first sync; block r, which only rank r reads, is reduced from them where they lie.
    """
    slots: SharedSlots = rt.shm  # type: ignore[assignment]  # this path runs only with slots
    dtype = plan.dtype
    parts = rt.participants
    n, me = len(parts), rt.rank
    index = parts.index(me)
    others = [q for q in parts if q != me]
    what = f"allreduce '{name}' (shared memory, registered)"
    views = _map_registered(rt, slots, buf, offer, peers, what)
    total = buf.size
    step = max(1, rt.config.shm_window_bytes // dtype.itemsize)

    t0 = time.perf_counter()
    pieces = range(0, total, step)
    starts: list[int] | None = None
    if sources is not None:  # (no prescale here: _large filled them all first)
        own = [(a + (min(a + step, total) - a) * index // n, a + (min(a + step, total) - a) * (index + 1) // n)
               for a in pieces]
        _fill(buf, sources, own)
        starts = [src.offset for src in sources]
    if plan.scale_pre != 1.0:
        rt.partial = True  # the input is scaled in place: a retry would scale it twice
        np.multiply(buf, dtype.type(plan.scale_pre), out=buf)
    _sync(rt, others, what)  # every rank's input is complete, and every peer has mapped this rank's files
    slots.synced()
    if not rt.joined:  # a rank that called join() has not mapped it yet
        slots.mapped_by_every_peer(slots.locate(buf))
    phases["shm-inputs-ready"] = (t0, time.perf_counter())
    for k, a in enumerate(pieces):
        b = min(a + step, total)
        t1 = time.perf_counter()
        lo, hi = a + (b - a) * index // n, a + (b - a) * (index + 1) // n
        rt.partial = True  # this rank's tensor is written from here on: no retry (Runtime.run)
        _reduce_registered(rt, buf, views, plan, index, lo, hi, sources, starts)
        _sync(rt, others, what)
        t2 = time.perf_counter()
        for i, q in enumerate(parts):
            if q != me:
                c, d = a + (b - a) * i // n, a + (b - a) * (i + 1) // n
                np.copyto(buf[c:d], views[q][c:d])
        t3 = time.perf_counter()
        if k < _SHM_TRACED_PIECES:
            suffix = f" piece {k}" if len(pieces) > 1 else ""
            phases[f"shm-reduce{suffix}"] = (t1, t2)
            phases[f"shm-copy-out{suffix}"] = (t2, t3)
    _sync(rt, others, what)  # no peer reads this rank's tensor any more: the caller may write into it
    phases[f"shm registered ({len(pieces)} x {step * dtype.itemsize // 1024} KiB)"] = (t0, time.perf_counter())


def _map_registered(rt: Runtime, slots: SharedSlots, buf: Array, offer: int, peers: Peers, what: str) -> dict[int, Array]:
    """Map every peer's registered tensor: rank -> the tensor it reduces (this rank's: ``buf``)."""
    me = rt.rank
    try:
        slots.attach(offer, {p: peers[p].aux for p in peers})
        return {q: buf if q == me else
                slots.region(q, peers[q].aux >> 12, peers[q].region, buf.nbytes).view(buf.dtype)
                for q in rt.participants}
    except OSError as exc:
        raise RingError(f"{what}: rank {rt.world[me]} cannot map a peer's registered buffer ({exc}); set "
                        "JUPYTER_RING_SHM_THRESHOLD=off on every rank to use the ring") from exc


def _reduce_registered(rt: Runtime, buf: Array, views: dict[int, Array], plan: ReducePlan, index: int, lo: int,
                       hi: int, sources: list[Source] | None, starts: list[int] | None) -> None:
    """This rank's block [lo, hi) of a piece, reduced over every rank's tensor into its own (its
    own terms read from ``sources`` where they lie, when given)."""
    me, dtype = rt.rank, plan.dtype
    for c, d, mine in ([(lo, hi, buf[lo:hi])] if starts is None
                       else _own_terms(buf, sources, starts, lo, hi)):  # type: ignore[arg-type]  # (sources too)
        terms = [mine if q == me else views[q][c:d] for q in rt.participants]
        if index >= 2 and np.may_share_memory(mine, buf):
            # its own term is read after the first terms are reduced into it
            terms[index] = rt.scratch((d - c) * dtype.itemsize).view(dtype)
            np.copyto(terms[index], mine)
        _reduce_into(buf[c:d], terms, plan, rt.joined)


def reducescatter(rt: Runtime, arr: Array, op: int, name: str, explicit_name: str | None) -> Array:
    """Reduce over the ranks and keep this rank's block of dim 0 (Horovod's split)."""
    start = time.perf_counter()
    fn = reducer(op, arr.dtype)
    _pre, postscale, divisor = _scale_of(rt, arr.dtype, op, 1.0, 1.0, f"reducescatter '{name}'")
    n, r = rt.size, rt.rank
    rows = arr.shape[0] if arr.ndim else 1
    rest = arr.shape[1:]
    row_elems = int(np.prod(rest, dtype=np.int64))
    flat = arr.reshape(-1)
    bounds = _row_bounds(rows, row_elems, n)
    eager = rt.headers.fits_eager(flat.nbytes)
    desc = (("name", explicit_name), ("shape", tuple(arr.shape)))
    peers = rt.agreement.negotiate("reducescatter", name, flat.dtype, op, -1, flat.size, desc,
                         payload=_bytes(flat) if eager else None)
    lo, hi = bounds[r], bounds[r + 1]
    phases = {"negotiate": (start, time.perf_counter())}
    out: Array
    if n == 1:
        out = flat.copy()
        _finish(out, postscale, divisor)
    elif eager:
        bufs = [flat if q == r else np.frombuffer(peers[q].payload, flat.dtype, flat.size) for q in range(n)]  # type: ignore[arg-type]  # eager: payloads
        out = np.empty(hi - lo, flat.dtype)
        fn(bufs[0][lo:hi], bufs[1][lo:hi], out=out)
        for buf in bufs[2:]:
            fn(out, buf[lo:hi], out=out)
        _finish(out, postscale, divisor)
    else:
        work = np.empty_like(flat)
        _ring(rt, flat, work, fn, postscale, divisor, bounds, name, phases, allgather=False)
        out = work[lo:hi].copy()
    rt.trace.record("reducescatter", name, flat.nbytes, start, time.perf_counter(), phases)
    my_rows = rows // n + (1 if r < rows % n else 0)
    return out.reshape((my_rows,) + rest)


def allgather(rt: Runtime, arr: Array, name: str, explicit_name: str | None,
              kind: str = "allgather") -> tuple[Array, list[int]]:
    """Concatenate every rank's ``arr`` along dim 0 (dim 0 may differ per rank).

    Returns the result and the list of every rank's dim 0.
    """
    start = time.perf_counter()
    if arr.ndim == 0:
        arr = arr.reshape(1)
    arr = np.ascontiguousarray(arr)
    rest = arr.shape[1:]
    row_elems = int(np.prod(rest, dtype=np.int64))
    eager = rt.headers.fits_eager(arr.nbytes)
    desc = (("name", explicit_name), ("trailing shape", rest))
    peers = rt.agreement.negotiate(kind, name, arr.dtype, 0, -1, row_elems, desc, aux=arr.shape[0],
                         payload=_bytes(arr.reshape(-1)) if eager else None)
    out, rows = _gathered(rt, arr, peers, eager, kind, name)
    rt.trace.record(kind, name, out.nbytes, start, time.perf_counter(), {})
    return out, rows


def _gathered(rt: Runtime, arr: Array, peers: Peers, eager: bool, kind: str, name: str) -> tuple[Array, list[int]]:
    """The allgather's output from the exchange just made: ``arr`` (this rank's rows, sent in
    the agreement message when ``eager``, else sent here), every peer's rows from its header
    (``aux``) and its payload, or received here. Returns (output, every rank's dim 0)."""
    rest = arr.shape[1:]
    row_elems = int(np.prod(rest, dtype=np.int64))
    rows = {q: (arr.shape[0] if q == rt.rank else peers[q].aux) for q in range(rt.size)}
    offsets = np.cumsum([0] + [rows[q] for q in range(rt.size)])
    out = np.empty((int(offsets[-1]),) + rest, arr.dtype)
    flat = out.reshape(-1)
    reqs: list[MPI.Request]
    peer_of: list[int]
    reqs, peer_of = [], []
    for q in range(rt.size):
        lo, hi = int(offsets[q]) * row_elems, int(offsets[q + 1]) * row_elems
        if q == rt.rank:
            flat[lo:hi] = arr.reshape(-1)
        elif peers[q].payload is not None:
            flat[lo:hi] = np.frombuffer(peers[q].payload, arr.dtype, hi - lo)  # type: ignore[arg-type]  # tested above
        else:
            reqs.append(rt.comm.Irecv(_bytes(flat[lo:hi]), q, TAG_DATA))
            peer_of.append(q)
    if not eager:
        for q in rt.peers:
            reqs.append(rt.comm.Isend(_bytes(arr.reshape(-1)), q, TAG_DATA))
            peer_of.append(q)
    rt.inflight = reqs
    rt.waits.wait(reqs, f"{kind} '{name}'", peer_of)
    return out, [rows[q] for q in range(rt.size)]


def broadcast_into(rt: Runtime, arr: Array, out: Array, root: int, name: str, explicit_name: str | None) -> Array:
    """Copy root's ``arr`` into ``out`` on every rank (``out`` may be ``arr``)."""
    start = time.perf_counter()
    flat = arr.reshape(-1)
    is_root = rt.rank == root
    eager = rt.headers.fits_eager(flat.nbytes)
    desc = (("name", explicit_name), ("shape", tuple(arr.shape)))
    peers = rt.agreement.negotiate("broadcast", name, flat.dtype, 0, root, flat.size, desc,
                         payload=_bytes(flat) if (is_root and eager) else None)
    oflat = out.reshape(-1)
    if is_root:
        if out is not arr:
            oflat[...] = flat
        if not eager:
            reqs = [rt.comm.Isend(_bytes(flat), q, TAG_DATA) for q in rt.peers]
            rt.inflight = reqs
            rt.waits.wait(reqs, f"broadcast '{name}' (root sending)", rt.peers)
    elif eager:
        oflat[...] = np.frombuffer(peers[root].payload, flat.dtype, flat.size)  # type: ignore[arg-type]  # eager: the root's payload
    else:
        req = rt.comm.Irecv(_bytes(oflat), root, TAG_DATA)
        rt.inflight = [req]
        rt.waits.wait([req], f"broadcast '{name}' (waiting for root {root})", [root])
    rt.trace.record("broadcast", name, flat.nbytes, start, time.perf_counter(), {})
    return out


def alltoall(rt: Runtime, arr: Array, splits: list[int], name: str,
             explicit_name: str | None) -> tuple[Array, npt.NDArray[np.int32]]:
    """Send rows ``splits[q]`` of contiguous ``arr`` to rank q (splits checked by the caller).

    Returns (received rows, received splits).
    """
    start = time.perf_counter()
    n = rt.size
    rest = arr.shape[1:]
    row_elems = int(np.prod(rest, dtype=np.int64))
    flat = arr.reshape(-1)
    starts = np.cumsum([0] + splits) * row_elems
    blocks = {q: flat[int(starts[q]):int(starts[q + 1])] for q in range(n)}
    per_peer = {q: (splits[q], _bytes(blocks[q]) if rt.headers.fits_eager(blocks[q].nbytes) else None) for q in rt.peers}
    desc = (("name", explicit_name), ("trailing shape", rest))
    peers = rt.agreement.negotiate("alltoall", name, arr.dtype, 0, -1, row_elems, desc, per_peer=per_peer)
    received = [splits[q] if q == rt.rank else peers[q].aux for q in range(n)]
    offs = np.cumsum([0] + received) * row_elems
    out = np.empty((sum(received),) + rest, arr.dtype)
    oflat = out.reshape(-1)
    reqs: list[MPI.Request]
    peer_of: list[int]
    reqs, peer_of = [], []
    for q in range(n):
        dst = oflat[int(offs[q]):int(offs[q + 1])]
        if q == rt.rank:
            dst[...] = blocks[q]
        elif peers[q].payload is not None:
            dst[...] = np.frombuffer(peers[q].payload, arr.dtype, dst.size)  # type: ignore[arg-type]  # not None, tested above
        else:
            reqs.append(rt.comm.Irecv(_bytes(dst), q, TAG_DATA))
            peer_of.append(q)
    for q in rt.peers:
        if per_peer[q][1] is None:
            reqs.append(rt.comm.Isend(_bytes(blocks[q]), q, TAG_DATA))
            peer_of.append(q)
    rt.inflight = reqs
    rt.waits.wait(reqs, f"alltoall '{name}'", peer_of)
    rt.trace.record("alltoall", name, flat.nbytes, start, time.perf_counter(), {})
    return out, np.asarray(received, np.int32)


def barrier(rt: Runtime, name: str) -> None:
    """Return once every rank has arrived (interruptible)."""
    start = time.perf_counter()
    rt.agreement.negotiate("barrier", name, None, 0, -1, 0, (("name", name),))
    rt.trace.record("barrier", name, 0, start, time.perf_counter(), {})


def broadcast_object(rt: Runtime, data: npt.NDArray[np.uint8], root: int, name: str,
                     explicit_name: str | None) -> object:
    """Root's pickled ``data`` (uint8 array) unpickled on every other rank (root gets None)."""
    start = time.perf_counter()
    is_root = rt.rank == root
    eager = is_root and rt.headers.fits_eager(data.nbytes)
    peers = rt.agreement.negotiate("broadcast_object", name, None, 0, root, 0, (("name", explicit_name),),
                         aux=data.nbytes if is_root else 0, payload=data if eager else None)
    result = None
    if is_root:
        nbytes = data.nbytes
        if not eager:
            reqs = [rt.comm.Isend(data, q, TAG_DATA) for q in rt.peers]
            rt.inflight = reqs
            rt.waits.wait(reqs, f"broadcast_object '{name}' (root sending)", rt.peers)
    else:
        nbytes, payload = peers[root].aux, peers[root].payload
        if payload is not None:
            raw = bytes(payload[:nbytes])
        else:
            buf = np.empty(nbytes, np.uint8)
            req = rt.comm.Irecv(buf, root, TAG_DATA)
            rt.inflight = [req]
            rt.waits.wait([req], f"broadcast_object '{name}' (waiting for root {root})", [root])
            raw = buf.tobytes()
        result = pickle.loads(raw)
    rt.trace.record("broadcast_object", name, nbytes, start, time.perf_counter(), {})
    return result


def allgather_object(rt: Runtime, data: npt.NDArray[np.uint8], name: str, explicit_name: str | None) -> list[object]:
    """Every rank's pickled ``data`` (uint8 array), unpickled, as a list in rank order."""
    return unpickle_gathered(*allgather(rt, data, name, explicit_name, kind="allgather_object"))


def unpickle_gathered(gathered: Array, sizes: Sequence[int]) -> list[object]:
    """The objects of an allgather of pickles (``sizes``: every rank's bytes), in rank order."""
    out: list[object]
    out, offset = [], 0
    for nbytes in sizes:
        out.append(pickle.loads(gathered[offset:offset + nbytes].tobytes()))
        offset += nbytes
    return out
