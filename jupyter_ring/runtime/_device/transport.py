"""The device transport: collectives on device buffers over a torch.distributed process group.

CUDA tensors (torch, and cupy through DLPack) are never staged through host memory: they go to
NCCL through torch.distributed's NCCL backend, which launches on its own stream after the
caller's stream. The same code runs over a gloo group on CPU tensors, which is how everything but
NCCL itself is tested without a GPU (``JUPYTER_RING_DEVICE_TRANSPORT=gloo``).

Every collective is::

    agreement (over the ring runtime) -> fusion into one flat device buffer -> launch (async work)
    -> completion polled (Work.is_completed) -> results copied out of the fusion buffer

* **Agreement first.** NCCL and gloo hang when ranks disagree; so every rank first votes, over
  the ring runtime (interruptible, with its stall timeout naming the ranks that never arrived),
  with a fingerprint of what it is about to do (kind, device, name, dtype, shapes, op, root,
  scales), its group's generation and whether its arguments were good: one element-wise Max of
  six int64s (a prepared lane of the ring after the first call; allgather also needs every
  rank's first dimension, so it gathers them). One rank votes with nobody. A mismatch raises
  ``CollectiveMismatchError`` on every rank, bad arguments on one rank ``PeerError`` on the others.
* **Polled completion.** The caller's thread polls ``Work.is_completed()`` (spin briefly, then
  back off), so SIGINT raises ``KeyboardInterrupt`` within milliseconds and a transfer that does
  not end within the stall timeout raises ``StallError``.
* **Abort and rebuild.** A collective given up on this rank (interrupt, stall, an error) aborts
  the group (``_process_groups.ManagedGroup.abort``: NCCL ``abort()``, gloo connections shut
  down), so the peers' pending transfer fails at once instead of hanging; the next agreement
  sees the aborted group on some rank and every rank re-creates it before going on. Buffers
  handed to an abandoned transfer are never reused.
* **One NCCL group.** When the user's default process group (``%ring start --torch-distributed``,
  or ``init_process_group()`` in a cell) has a backend for the device, it is used, not a second
  one: ``allreduce`` of the runtime and the user's DDP share its communicator.

Interface (the runtime engine routes fused device buckets here)::

    t = transport()                                        # this process's transport
    t.allreduce_([g1, g2], op=Average, name="bucket.3")    # in place, fused, blocking
    work = t.allreduce_async_([g1, g2], op=Sum, name="b")  # agreed and launched; work.wait()
    t.broadcast_(x, root=0, name="w");  y = t.allgather(x, name="rows")

Tensors are torch tensors on one device type; ``supports(dtype, op)`` says which pairs go here
(the adapters stage the others through the ring).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from ... import runtime as _ring
from .._engine import waits as _waits
from .._engine.core import OP_NAMES, Adasum, Desc, Average, Max, Min, Product, Sum
from .._engine.errors import CollectiveMismatchError, RingError, StallError
from .agreement import Agreement, agree
from .groups import DeviceGroups
from .._engine.pool import Lender
from .._observe.report import reporter
from .process_groups import ManagedGroup

if TYPE_CHECKING:  # torch is imported where it is used: the runtime runs without it
    import torch
    from torch.distributed import AllreduceOptions, Work

__all__ = ["DeviceTransport", "DeviceWork", "transport", "mode", "routes", "supports", "copies",
           "TRANSPORT_ENV"]

log = logging.getLogger(__name__)

TRANSPORT_ENV = "JUPYTER_RING_DEVICE_TRANSPORT"
_MODES = ("auto", "gloo", "off")
# free fusion buffers kept per (device, dtype) for later grouped collectives
_FUSION_KEPT = 4

_R = TypeVar("_R")  # what a DeviceWork's wait() returns: a tensor, or the list allreduced


def mode() -> str:
    """``auto`` (CUDA tensors over NCCL), ``gloo`` (also CPU torch tensors, over gloo: the CI
    switch that exercises this transport without a GPU) or ``off`` (stage everything)."""
    value = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"{TRANSPORT_ENV}={value!r}: use auto, gloo or off")
    return value


def routes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a torch tensor) goes through the device transport."""
    kind = tensor.device.type
    current = mode()
    if kind == "cuda":
        return current != "off" and _nccl_available()
    return kind == "cpu" and current == "gloo"


def _nccl_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def _dtypes() -> set[torch.dtype]:
    import torch

    return {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
            torch.int32, torch.int64}


def supports(dtype: torch.dtype, op: int) -> bool:
    """Whether an allreduce of ``dtype`` with ``op`` runs on the device transport (else: staged)."""
    import torch

    if dtype in _dtypes():
        return op in (Sum, Average, Min, Max, Product)
    if dtype == torch.bool:
        return op in (Min, Max, Product)   # on a uint8 view: min = and, max = or
    if dtype in (torch.complex64, torch.complex128):
        return op in (Sum, Average)        # as (real, imag) pairs
    return False


def copies(dtype: torch.dtype) -> bool:
    """Whether a broadcast or allgather of ``dtype`` runs on the device transport."""
    import torch

    return dtype in _dtypes() or dtype in (torch.bool, torch.complex64, torch.complex128)


def _check(tensors: Sequence[object], where: str) -> torch.device | None:
    import torch

    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{where}: expected a list of tensors, got {type(tensors).__name__}")
    bad = [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"{where}: expected torch tensors, got {', '.join(bad)}")
    if not tensors:
        return None
    devices: set[torch.device] = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{where}: tensors on several devices ({sorted(map(str, devices))}); "
                         "move them to one device")
    return next(iter(devices))


class DeviceWork(Generic[_R]):
    """A device collective agreed and launched: ``poll()`` tells whether it is done, ``wait()``
    finishes it (copies results out, scales) and returns its result."""

    __slots__ = ("_transport", "_group", "_work", "_what", "_finish", "_buffers", "_start",
                 "_agreed", "_nbytes", "_kind", "_name", "_result", "_done")

    def __init__(self, transport: DeviceTransport, group: ManagedGroup | None, work: Work | None, what: str,
                 finish: Callable[[], _R], buffers: list[torch.Tensor], times: tuple[float, float], nbytes: int,
                 kind: str, name: str) -> None:
        self._transport, self._group, self._work, self._what = transport, group, work, what
        self._finish, self._buffers = finish, buffers
        self._start, self._agreed = times
        self._nbytes, self._kind, self._name = nbytes, kind, name
        self._result: _R | None = None
        self._done = False

    def poll(self) -> bool:
        """True when the transfer has completed (never blocks)."""
        return self._done or self._work is None or self._work.is_completed()

    def wait(self) -> _R:
        """Wait for the transfer (interruptible, bounded by the stall timeout); the result."""
        if self._done:
            return cast(_R, self._result)  # (still None after a finish() that raised, as before typing)
        self._done = True
        if self._work is not None:
            assert self._group is not None  # (a launched transfer always has its group)
            self._transport._wait(self._work, self._what, self._group, self._buffers)
        self._result = self._finish()
        trace = reporter.trace
        if trace is not None:
            end = time.perf_counter()
            trace.record(self._kind, self._name, self._nbytes, self._start, end,
                         {"negotiate": (self._start, self._agreed), "device": (self._agreed, end)})
        return self._result


class DeviceTransport:
    """Device collectives of this process over one managed process group per device type."""

    def __init__(self) -> None:
        self._groups = DeviceGroups()
        # flat fusion buffers by (device, dtype), each lent to one collective
        self._fusion: Lender[tuple[torch.device, torch.dtype], torch.Tensor] = Lender(_FUSION_KEPT)
        self._unnamed: dict[str, int] = {}   # kind -> counter for names of unnamed collectives (same on every rank)
        # tests: called with (kind, name) after the agreement, before the transfer is launched
        self.before_launch: Callable[[str, str], object] | None = None

    def auto_name(self, kind: str, name: str | None) -> str:
        """``name``, or ``<kind>.device.<n>`` for the n-th unnamed ``kind`` of this process."""
        if name is not None:
            return name
        count = self._unnamed.get(kind, 0)
        self._unnamed[kind] = count + 1
        return f"{kind}.device.{count}"

    # ------------------------------------------------------------------ groups and agreement
    def group(self, device_type: str) -> ManagedGroup:
        """The managed group for ``device_type`` (``DeviceGroups.group``; collective on first use)."""
        return self._groups.group(device_type)

    def _agree(self, kind: str, name: str, device_type: str, desc: Desc, aux: int | None = None,
               error: Exception | None = None) -> Agreement:
        """Agree with every rank on ``desc`` before a collective (``agreement.agree``)."""
        return agree(self._groups, self._rebuild, kind, name, device_type, desc, aux, error)

    def _rebuild(self, device_type: str, abandoned_on: list[int]) -> None:
        group = self.group(device_type)
        group.rebuild()
        # a fresh group, fresh buffers (those of abandoned transfers were never given back)
        self._fusion.drop(lambda key: key[0].type != device_type)
        log.warning("jupyter_ring: %s re-created on every rank after a collective was abandoned "
                    "on rank(s) %s", group.label, abandoned_on)

    # ------------------------------------------------------------------ waiting
    def _wait(self, work: Work, what: str, group: ManagedGroup, buffers: list[torch.Tensor]) -> None:
        """Poll ``work`` until it completes: interruptible, bounded by the stall timeout."""
        config = _ring.config()
        start = time.perf_counter()
        try:
            if not work.is_completed():
                spin_until = start + _waits.SPIN_SECONDS
                # ranks outnumber cores, or other tasks want them: the peer may need this one
                yields = _waits.yields_now(_ring.wait_policy(), start)
                while time.perf_counter() < spin_until and not work.is_completed():
                    if yields:
                        os.sched_yield()
                delay = _waits.FIRST_NAP
                while not work.is_completed():
                    waited = time.perf_counter() - start
                    if waited > config.stall_timeout:
                        raise StallError(
                            f"{what}: rank {_ring.rank()} waited {waited:.1f} s for the transfer after every "
                            f"rank had agreed to it (stall timeout {config.stall_timeout:g} s): a rank died or "
                            "is stuck inside the backend. The group is re-created before the next collective.",
                            ())
                    time.sleep(delay)
                    delay = _waits.next_nap(delay, waited)
            work.wait()  # raises the backend's error; on NCCL, orders the caller's stream after it
        except RuntimeError as exc:
            if isinstance(exc, RingError):
                self._abandon(group, what, buffers, type(exc).__name__)
                raise
            self._abandon(group, what, buffers, "the backend failed")
            raise RingError(f"{what}: the transfer failed ({_first_line(exc)}): a peer rank gave it up "
                            "(interrupted, failed or timed out). The group is re-created before the next "
                            "collective; tensors passed in place may hold partial results.") from exc
        except BaseException as exc:
            self._abandon(group, what, buffers, type(exc).__name__)
            raise

    def _abandon(self, group: ManagedGroup, what: str, buffers: list[torch.Tensor], why: str) -> None:
        device_type = next(iter(group.backends))
        group.abort(f"{what} abandoned on rank {_ring.rank()} ({why})")
        # ``buffers`` are never given back: the abandoned transfer may still write into them
        log.info("jupyter_ring: %s abandoned (%s) on %s", what, why, device_type)

    # ------------------------------------------------------------------ collectives
    def _launching(self, kind: str, name: str) -> None:
        if self.before_launch is not None:
            self.before_launch(kind, name)

    def _fusion_buffer(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements, lent to one collective until its finish
        gives it back: two collectives in flight never share one."""
        import torch

        return self._fusion.lend((device, dtype), numel,
                                 lambda: torch.empty(max(numel, 1), dtype=dtype, device=device))

    def allreduce_async_(self, tensors: Sequence[torch.Tensor], op: int = Average, name: str = "allreduce",
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0
                         ) -> DeviceWork[Sequence[torch.Tensor]]:
        """Agree, fuse and launch an in-place allreduce of ``tensors``; returns a DeviceWork."""
        import torch

        where = f"allreduce '{name}'"
        error, device = None, None
        try:
            device = _check(tensors, where)
            if op not in OP_NAMES or op == Adasum:
                raise ValueError(f"{where}: op {OP_NAMES.get(op, op)!r} is not supported here; use Sum, Average, "
                                 "Min, Max or Product")
            dtypes = {t.dtype for t in tensors}
            if len(dtypes) > 1:
                raise TypeError(f"{where}: all tensors of a group must share one dtype, got {sorted(map(str, dtypes))}")
            dtype = next(iter(dtypes)) if dtypes else torch.float32
            if tensors and not supports(dtype, op):
                raise TypeError(f"{where}: op={OP_NAMES[op]} on {dtype} is not supported by the device transport")
            integer = not (dtype.is_floating_point or dtype.is_complex)
            if integer and (prescale_factor != 1.0 or postscale_factor != 1.0):
                raise TypeError(f"{where}: prescale_factor/postscale_factor need a floating-point tensor, got "
                                f"{dtype}; cast it to float32 first")
        except (TypeError, ValueError) as exc:
            error = exc
        device_type = device.type if device is not None else _default_device_type()
        desc: Desc
        if error is None:
            desc = (("device", device_type), ("name", name), ("op", op), ("dtype", str(dtype)),
                    ("tensors (shape)", tuple(tuple(t.shape) for t in tensors)),
                    ("prescale_factor", float(prescale_factor)), ("postscale_factor", float(postscale_factor)))
        else:
            desc = (("device", device_type), ("name", name), ("op", op))
        start = time.perf_counter()
        joined = self._agree("allreduce", name, device_type, desc, error=error).joined
        if joined:
            return self._allreduce_with_joined(tensors, op, name, prescale_factor, postscale_factor, start)
        return self._launch_allreduce(tensors, op, name, prescale_factor, postscale_factor, device_type, start)

    def _launch_allreduce(self, tensors: Sequence[torch.Tensor], op: int, name: str, prescale_factor: float,
                          postscale_factor: float, device_type: str, start: float
                          ) -> DeviceWork[Sequence[torch.Tensor]]:
        """The agreed allreduce of ``tensors``: fused into one flat buffer (unless one contiguous
        tensor), scaled, launched on the group; its DeviceWork copies the results back."""
        import torch

        group = self.group(device_type)
        size = _ring.size()
        total = sum(t.numel() for t in tensors)
        what = f"allreduce '{name}' ({device_type}, {group.kinds[device_type]})"
        if total == 0:
            return DeviceWork(self, group, None, what, lambda: tensors, [], (start, time.perf_counter()), 0,
                              "allreduce", name)
        dtype, device = tensors[0].dtype, tensors[0].device  # (the one device _check found)
        fused = None
        if len(tensors) == 1 and tensors[0].is_contiguous():
            flat = tensors[0].view(-1)
        else:
            fused = self._fusion_buffer(device, dtype, total)
            flat = fused[:total]
            torch.cat([t.reshape(-1) for t in tensors], out=flat)
        wire = flat
        if dtype == torch.bool:
            wire = flat.view(torch.uint8)
        elif dtype.is_complex:
            wire = torch.view_as_real(flat)
        if prescale_factor != 1.0:
            wire.mul_(prescale_factor)
        scale = postscale_factor / (size if op == Average and not _integer(dtype) else 1)
        divisor = size if op == Average and _integer(dtype) else 1
        work = None
        self._launching("allreduce", name)
        if size > 1:
            work = group.backend(device_type).allreduce([wire], _allreduce_options(op))
        agreed = time.perf_counter()

        def finish() -> Sequence[torch.Tensor]:
            if scale != 1.0:
                wire.mul_(scale)
            if divisor != 1:
                wire.floor_divide_(divisor)
            if fused is not None:
                offset = 0
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
                self._fusion.give_back((device, dtype), fused)  # the copies come before any later use
            return tensors

        return DeviceWork(self, group, work, what, finish, [flat], (start, agreed),
                          total * dtype.itemsize, "allreduce", name)

    def _allreduce_with_joined(self, tensors: Sequence[torch.Tensor], op: int, name: str, prescale_factor: float,
                               postscale_factor: float, start: float) -> DeviceWork[Sequence[torch.Tensor]]:
        """Some rank has called ``join()``: it takes part in the ring's allreduces with zeros (as
        in Horovod), never in the group's transfers, so the tensors go through the ring, staged
        through host memory, on every rank that voted (all of them saw the join in the vote)."""
        import torch

        for index, t in enumerate(tensors):
            host = t.detach().to(device="cpu", dtype=torch.float32 if t.dtype == torch.bfloat16 else t.dtype,
                                 copy=True)
            _ring.allreduce_(host.numpy(), op=op, name=f"{name}.joined.{index}", prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor)
            t.copy_(host)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return DeviceWork(self, None, None, f"allreduce '{name}' (a rank joined: through the ring)",
                          lambda: tensors, [], (start, time.perf_counter()), nbytes, "allreduce", name)

    def allreduce_(self, tensors: Sequence[torch.Tensor], op: int = Average, name: str = "allreduce",
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Sequence[torch.Tensor]:
        """In-place allreduce of a list of tensors (one fused transfer); blocking."""
        return self.allreduce_async_(tensors, op, name, prescale_factor, postscale_factor).wait()

    def broadcast_async_(self, tensor: torch.Tensor, root: int = 0, name: str = "broadcast"
                         ) -> DeviceWork[torch.Tensor]:
        """Agree and launch an in-place broadcast of root's ``tensor``; returns a DeviceWork."""
        import torch

        where = f"broadcast '{name}'"
        error = None
        try:
            _check([tensor], where)
            if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < _ring.size():
                raise ValueError(f"{where}: root_rank {root!r} is not a rank of this world (0..{_ring.size() - 1})")
        except (TypeError, ValueError) as exc:
            error = exc
        device_type = tensor.device.type if isinstance(tensor, torch.Tensor) else _default_device_type()
        desc = (("device", device_type), ("name", name), ("root", root),
                ("dtype", str(getattr(tensor, "dtype", None))), ("shape", tuple(getattr(tensor, "shape", ()))))
        start = time.perf_counter()
        if self._agree("broadcast", name, device_type, desc, error=error).joined:
            raise CollectiveMismatchError(
                f"broadcast '{name}': a rank called join() and waits for the others to join; only "
                "allreduce can run until every rank has joined (as in Horovod). Call join() on this "
                "rank too, or run this collective before any rank joins.")
        group = self.group(device_type)
        what = f"broadcast '{name}' ({device_type}, {group.kinds[device_type]})"
        contiguous = tensor.is_contiguous()
        flat = tensor.view(-1) if contiguous else tensor.contiguous().view(-1)
        wire = _wire(flat)
        work = None
        self._launching("broadcast", name)
        if _ring.size() > 1 and tensor.numel():
            import torch.distributed as dist

            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
            work = group.backend(device_type).broadcast([wire], opts)
        agreed = time.perf_counter()

        def finish() -> torch.Tensor:
            if not contiguous:
                tensor.copy_(flat.view_as(tensor))
            return tensor

        return DeviceWork(self, group, work, what, finish, [flat], (start, agreed),
                          tensor.numel() * tensor.element_size(), "broadcast", name)

    def broadcast_(self, tensor: torch.Tensor, root: int = 0, name: str = "broadcast") -> torch.Tensor:
        """In-place broadcast of root's ``tensor``; blocking; returns ``tensor``."""
        return self.broadcast_async_(tensor, root, name).wait()

    def allgather_async(self, tensor: torch.Tensor, name: str = "allgather") -> DeviceWork[torch.Tensor]:
        """Agree and launch an allgather along dim 0 (which may differ between ranks)."""
        import torch

        where = f"allgather '{name}'"
        error = None
        try:
            _check([tensor], where)
            if tensor.dim() == 0:
                raise ValueError(f"{where}: needs a tensor with at least one dimension; pass tensor.reshape(1)")
        except (TypeError, ValueError) as exc:
            error = exc
        ok = error is None
        device_type = tensor.device.type if isinstance(tensor, torch.Tensor) else _default_device_type()
        desc = (("device", device_type), ("name", name), ("dtype", str(getattr(tensor, "dtype", None))),
                ("trailing shape", tuple(tensor.shape[1:]) if ok else None))
        start = time.perf_counter()
        rows = self._agree("allgather", name, device_type, desc, aux=tensor.shape[0] if ok else 0, error=error).rows
        assert rows is not None  # (an agreement with aux: every rank's first dimension)
        group = self.group(device_type)
        what = f"allgather '{name}' ({device_type}, {group.kinds[device_type]})"
        most = int(rows.max())
        trail = tuple(tensor.shape[1:])
        padded = torch.zeros((most,) + trail, dtype=tensor.dtype, device=tensor.device)
        padded[:tensor.shape[0]] = tensor
        outs = [torch.empty_like(padded) for _ in range(len(rows))]
        work = None
        self._launching("allgather", name)
        if len(rows) > 1 and padded.numel():
            work = group.backend(device_type).allgather([[_wire(o) for o in outs]], [_wire(padded)])
        else:
            outs[0].copy_(padded)
        agreed = time.perf_counter()

        def finish() -> torch.Tensor:
            return torch.cat([o[:int(r)] for o, r in zip(outs, rows)])

        return DeviceWork(self, group, work, what, finish, [padded, *outs], (start, agreed),
                          padded.numel() * padded.element_size() * len(rows), "allgather", name)

    def allgather(self, tensor: torch.Tensor, name: str = "allgather") -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0; blocking."""
        return self.allgather_async(tensor, name).wait()


def _integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The view a backend reduces: bool as uint8, complex as (real, imag) pairs."""
    import torch

    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.dtype.is_complex:
        return torch.view_as_real(tensor)
    return tensor


def _allreduce_options(op: int) -> AllreduceOptions:
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    # (torch's stub types reduceOp as ReduceOp; the binding converts the RedOpType given here)
    opts.reduceOp = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,  # type: ignore[assignment]
                     Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}[op]
    return opts


def _default_device_type() -> str:
    return "cuda" if mode() != "gloo" else "cpu"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Holder:
    """This process's transport, made on first use."""

    def __init__(self) -> None:
        self.transport: DeviceTransport | None = None


_holder = _Holder()


def transport() -> DeviceTransport:
    """This process's :class:`DeviceTransport` (one per process, made on first use)."""
    if _holder.transport is None:
        _holder.transport = DeviceTransport()
    return _holder.transport
