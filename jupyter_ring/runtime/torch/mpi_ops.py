"""Horovod's torch collectives: tensors to the ring runtime (numpy views) or to the device
transport (CUDA tensors), handles, ``poll`` and ``synchronize``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, NoReturn, TypeVar, cast

import numpy as np
import numpy.typing as npt
import torch

from ... import runtime as _ring
from .. import _api
from .._device import transport as _device
from .._engine.pool import Lender
from .._horovod.basics import adasum_combine
from .._horovod.runtime_names import Adasum, Average, ProcessSet, Sum, global_process_set
from .compression import Compression, Compressor

_R = TypeVar("_R")  # what a Handle's synchronize() returns
_R_co = TypeVar("_R_co", covariant=True)
_W = TypeVar("_W")  # what a device collective's work returns

__all__ = ["nccl_built", "cuda_built", "Handle", "poll", "synchronize", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "SparseReduction",
    "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier"]


def nccl_built() -> bool:
    """True when CUDA tensors go through NCCL (torch.distributed has it, the transport is on)."""
    return _device.mode() != "off" and bool(_device._nccl_available())


def cuda_built() -> bool:
    """True when this torch has CUDA and CUDA tensors go to the device transport, unstaged."""
    return torch.version.cuda is not None and nccl_built()


# ------------------------------------------------------------------ tensor <-> numpy
_NUMPY_DTYPES = {
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
}


def _check_tensor(tensor: object, where: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{where}: sparse tensors are not supported; pass tensor.to_dense()")


def _shares_numpy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor.numpy()`` is a C-contiguous view the runtime can write into directly."""
    return (tensor.device.type == "cpu" and tensor.dtype in _NUMPY_DTYPES and tensor.is_contiguous()
            and not tensor.is_conj() and not tensor.is_neg())


def _to_numpy(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A numpy array with ``tensor``'s values: a view where possible, else a host copy."""
    t = tensor.detach()
    if _shares_numpy(t):
        return t.numpy()
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)   # numpy has no bfloat16: transport as float32
    elif t.dtype not in _NUMPY_DTYPES:
        raise TypeError(f"dtype {t.dtype} is not supported by jupyter_ring; cast it to float32 or int64")
    # CUDA tensors are staged through host memory here (one device-to-host copy).
    return t.resolve_conj().resolve_neg().cpu().contiguous().numpy()


def _from_numpy(arr: npt.ArrayLike, like: torch.Tensor) -> torch.Tensor:
    """A torch tensor of ``like``'s dtype and device holding ``arr``."""
    out = torch.from_numpy(np.ascontiguousarray(arr))
    if out.dtype != like.dtype or out.device != like.device:
        out = out.to(device=like.device, dtype=like.dtype)
    return out


def _apply(function: type[torch.autograd.Function], *args: object) -> Any:
    """``function.apply(*args)``, whose result is what ``function.forward`` returns."""
    return function.apply(*args)  # type: ignore[no-untyped-call]  # (torch leaves apply unannotated)


# ------------------------------------------------------------------ tensor -> device transport
def _reduces_on_device(tensors: Sequence[torch.Tensor], op: int, pre: object, post: object, process_set: ProcessSet,
                       where: str) -> bool:
    """Whether an allreduce of ``tensors`` goes to the device transport (all of them or none)."""
    if not tensors or not _api.is_global(process_set) or op == Adasum:
        return False
    if not all(_device.routes(t) and _device.supports(t.dtype, op) for t in tensors):
        return False
    # Horovod's integer arithmetic (scaled in float64, truncated toward zero) and, on CPU, its
    # float16 scaled in float32 are the ring path's (_Reduce); NCCL scales CUDA float16 in place
    return not any(_Reduce(t, op, pre, post, process_set, where).integer
                   and (t.dtype in _INTEGER_DTYPES or t.device.type == "cpu") for t in tensors)


def _copies_on_device(tensor: torch.Tensor, process_set: ProcessSet) -> bool:
    return _api.is_global(process_set) and _device.routes(tensor) and _device.copies(tensor.dtype)


def _device_launch(launch: Callable[[], _device.DeviceWork[_W]], result: Callable[[_W], _R]) -> "Handle[_R]":
    """A Handle for a device collective launched now (agreed, transfer started); its finish
    waits for it. As for queued ring collectives, a failure of the collective itself (mismatch,
    a peer's error, a stall in the agreement) is raised by synchronize(); this rank's own bad
    arguments (TypeError, ValueError) are raised here."""
    try:
        work = launch()
    except (TypeError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - raised by synchronize()
        error = exc

        def fail(_res: list[Any]) -> NoReturn:
            raise error
        return Handle([], fail)
    return Handle([], lambda res: result(work.wait()))


def _device_allreduce(tensors: Sequence[torch.Tensor], in_place: bool, op: int, name: str | None,
                      prescale_factor: float, postscale_factor: float, one: bool = False) -> "Handle[Any]":
    """An allreduce of ``tensors`` on the device transport (list in, list out; ``one``: the
    single tensor out)."""
    transport = _device.transport()
    targets = [t.detach() if in_place else t.detach().clone() for t in tensors]
    return _device_launch(
        lambda: transport.allreduce_async_(targets, op, transport.auto_name("allreduce", name),
                                           prescale_factor, postscale_factor),
        lambda _out: (tensors if in_place else targets)[0] if one else list(tensors) if in_place else targets)


def _device_broadcast(target: torch.Tensor, root_rank: int, name: str | None) -> "Handle[torch.Tensor]":
    transport = _device.transport()
    return _device_launch(lambda: transport.broadcast_async_(target, root_rank,
                                                             transport.auto_name("broadcast", name)),
                          lambda out: out)


class Handle(Generic[_R_co]):
    """An async collective in flight: pass it to :func:`synchronize` or :func:`poll`."""

    __slots__ = ("_handles", "_finish", "_done", "_result")

    def __init__(self, handles: list[int], finish: Callable[[list[Any]], _R_co]) -> None:
        self._handles = handles      # runtime handles, synchronized in order
        self._finish = finish        # results of the runtime handles -> the torch result
        self._done = False
        self._result: _R_co | None = None

    def __repr__(self) -> str:
        return f"<jupyter_ring.torch.Handle {'done' if self._done else 'pending'}>"


def _check_handle(handle: object) -> None:
    if not isinstance(handle, Handle):
        raise TypeError(f"expected a handle returned by an *_async call, got {type(handle).__name__}")
    if handle._done:
        raise ValueError("this handle was already synchronized; each handle is synchronized once")


def poll(handle: Handle[Any]) -> bool:
    """True when ``handle``'s collective has finished; runs nothing (the engine works in the
    background), so a caller may compute while it is False."""
    _check_handle(handle)
    return all(_ring.poll(h) for h in handle._handles)


def synchronize(handle: Handle[_R]) -> _R:
    """Wait for an async collective and return its result (raises the collective's error)."""
    _check_handle(handle)
    handle._done = True
    results, error = [], None
    for h in handle._handles:
        # synchronize every runtime handle, even after an error, so none is left behind
        try:
            results.append(_ring.synchronize(h))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            error = error or exc
    if error is not None:
        raise error
    return handle._finish(results)


# ------------------------------------------------------------------ process sets, handles made here
def _completed(results: list[Any], error: BaseException | None, finish: Callable[[list[Any]], _R]) -> Handle[_R]:
    def done(_nothing: list[Any]) -> _R:
        if error is not None:
            raise error
        return finish(results)
    return Handle([], done)


def _set_size(process_set: ProcessSet, where: str = "process_set") -> int:
    return _api.set_size(process_set, where)


def _set_rank(process_set: ProcessSet) -> int:
    return _api.set_rank(process_set, "process_set")


def _grad_name(name: str | None, suffix: str = "grad") -> str | None:
    return None if name is None else f"{name}.{suffix}"


def _staging_buffer(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, host view holding ``tensor``'s values, flat): a page-locked buffer of the next
    power-of-two capacity, lent by ``_staging`` for one collective.

    For CUDA tensors that the ring reduces on the host (two ranks sharing a GPU,
    ``JUPYTER_RING_DEVICE_TRANSPORT=off``, a process set, a dtype/op pair NCCL lacks): one
    device-to-host copy into a buffer kept between calls, the ring's reduction in place there,
    one host-to-device copy back. Against a fresh pageable ``.cpu()`` copy, an out-of-place
    reduction and a pageable upload, this saves two allocations (page faults on every large call)
    and one host pass, and the copies run at pinned speed.
    """
    numel = tensor.numel()
    capacity = 1 << max(numel - 1, 0).bit_length()
    buf = _staging.lend((tensor.dtype, capacity), capacity,
                        lambda: torch.empty(capacity, dtype=tensor.dtype, pin_memory=True))
    host = buf[:numel]
    host.copy_(tensor.detach().resolve_conj().resolve_neg().reshape(-1))
    return buf, host


_staging: Lender[tuple[torch.dtype, int], torch.Tensor] = Lender(keep=2)  # pinned host buffers by (dtype, capacity)


def _staged_allreduce(tensor: torch.Tensor, plan: "_Reduce", name: str | None, process_set: ProcessSet,
                      in_place: bool) -> Handle[torch.Tensor]:
    """Allreduce of a CUDA ``tensor`` through a pinned host buffer (see _staging_buffer)."""
    buf, host = _staging_buffer(tensor)
    pre, post = plan.runtime_scales(tensor)
    handle = _ring.allreduce_async_(host.numpy(), None, name, plan.op, pre, post, process_set)

    def finish(_res: list[Any]) -> torch.Tensor:
        out = tensor.detach() if in_place else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        with torch.no_grad():
            out.copy_(host.view(tensor.shape))  # synchronous: the buffer is free after it
        _staging.give_back((buf.dtype, buf.numel()), buf)
        return tensor if in_place else out
    return Handle([handle], finish)


def _stages_pinned(tensor: torch.Tensor, plan: "_Reduce") -> bool:
    """Whether a CUDA allreduce goes through a pinned buffer: numpy has the dtype, and the
    runtime applies the op and factors (not Horovod's widened integer/float16 scaling)."""
    return tensor.is_cuda and tensor.dtype in _NUMPY_DTYPES and not plan.integer


# ------------------------------------------------------------------ allreduce
_INTEGER_DTYPES = {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}


class _Reduce:
    """How one allreduce is split between the runtime and the adapter.

    Horovod scales integer tensors in float64 (truncating toward zero) and float16 tensors in
    float32 on CPU, Average being a postscale by 1/size: for those the adapter scales before
    and after, and the runtime only sums. Every other tensor's op and factors go to the runtime.
    """

    __slots__ = ("op", "pre", "post", "after", "wide")

    def __init__(self, tensor: torch.Tensor, op: int, pre: object, post: object, process_set: ProcessSet,
                 where: str) -> None:
        pre = _api.scale_factor(pre, "prescale_factor", where)
        post = _api.scale_factor(post, "postscale_factor", where)
        wide = (torch.float64 if tensor.dtype in _INTEGER_DTYPES else
                torch.float32 if tensor.dtype == torch.float16 else None)
        self.wide = wide if wide is not None and (pre != 1.0 or post != 1.0 or op == Average) else None
        if self.wide is not None:
            self.op, self.pre, self.post = (Sum if op == Average else op), pre, 1.0
            self.after = post / _set_size(process_set) if op == Average else post
        else:
            self.op, self.pre, self.post, self.after = op, pre, post, 1.0

    @property
    def integer(self) -> bool:
        """Whether the adapter scales (the runtime only sums)."""
        return self.wide is not None

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor whose numpy form the runtime reduces (prescaled here when the adapter scales)."""
        if self.wide is not None and self.pre != 1.0:
            return (tensor.detach().to(self.wide) * self.pre).to(tensor.dtype)
        return tensor

    def runtime_scales(self, tensor: torch.Tensor) -> tuple[float, float]:
        """(prescale, postscale) for the runtime: none when the adapter applies them."""
        return (1.0, 1.0) if self.wide is not None else (self.pre, self.post)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and self.after != 1.0:
            return (out.to(self.wide) * self.after).to(out.dtype)
        return out


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle[torch.Tensor]:
    """Queue an allreduce of ``tensor``; ``synchronize(handle)`` returns a new tensor."""
    where = f"allreduce '{name}'"
    _check_tensor(tensor, where)
    op = _api.resolve_op(op, average, where)
    if op == Adasum:
        return _adasum_async(tensor, name, process_set, where)
    if _reduces_on_device([tensor], op, prescale_factor, postscale_factor, process_set, where):
        return _device_allreduce([tensor], False, op, name, prescale_factor, postscale_factor, one=True)
    plan = _Reduce(tensor, op, prescale_factor, postscale_factor, process_set, where)
    if _stages_pinned(tensor, plan):
        return _staged_allreduce(tensor, plan, name, process_set, in_place=False)
    arr = _to_numpy(plan.stage(tensor))
    pre, post = plan.runtime_scales(tensor)
    return Handle([_ring.allreduce_async(arr, None, name, plan.op, pre, post, process_set)],
                  lambda res: plan.finish(_from_numpy(res[0], tensor)))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle[torch.Tensor]:
    """Queue an in-place allreduce; ``synchronize(handle)`` returns ``tensor`` holding the result."""
    where = f"allreduce_ '{name}'"
    _check_tensor(tensor, where)
    op = _api.resolve_op(op, average, where)
    if _reduces_on_device([tensor], op, prescale_factor, postscale_factor, process_set, where):
        return _device_allreduce([tensor], True, op, name, prescale_factor, postscale_factor, one=True)
    t = tensor.detach()
    plan = _Reduce(tensor, op, prescale_factor, postscale_factor, process_set, where) if op != Adasum else None
    if plan is not None and not plan.integer and _shares_numpy(t):
        # zero-copy: the runtime reduces straight into the tensor's memory
        arr = t.numpy()
        return Handle([_ring.allreduce_async_(arr, None, name, op, prescale_factor, postscale_factor, process_set)],
                      lambda res: tensor)
    if plan is not None and _stages_pinned(t, plan):
        return _staged_allreduce(tensor, plan, name, process_set, in_place=True)
    handle = allreduce_async(t, None, name, op, prescale_factor, postscale_factor, process_set)
    inner = handle._finish

    def finish(res: list[Any]) -> torch.Tensor:
        out = inner(res)
        with torch.no_grad():
            t.copy_(out)
        return tensor
    handle._finish = finish
    return handle


class _Allreduce(torch.autograd.Function):
    """allreduce as a differentiable op: the gradient is allreduced with the same op and scales."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: bool | None, name: str | None, op: int | None,
                prescale_factor: float, postscale_factor: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (average, _grad_name(name), op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                           process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = synchronize(allreduce_async(grad_output.contiguous(), *ctx.args))
        return grad, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Compressor = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (default: Average) into a new tensor; differentiable."""
    _check_tensor(tensor, f"allreduce '{name}'")
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = cast(torch.Tensor, _apply(_Allreduce, compressed, average, name, op, prescale_factor,
                                        postscale_factor, process_set))
    else:
        out = synchronize(allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor,
                                          process_set))
    return compression.decompress(out, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce: ``tensor`` receives the result and is returned."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def _group_check(tensors: object, where: str) -> None:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{where}: expected a list of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        _check_tensor(t, f"{where} tensor {i}")


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle[list[torch.Tensor]]:
    """Queue an allreduce of a list of tensors (one fused pass); synchronize returns a list."""
    where = f"grouped_allreduce '{name}'"
    _group_check(tensors, where)
    op = _api.resolve_op(op, average, where)
    if op == Adasum:
        handles = [_adasum_async(t, _grad_name(name, str(i)), process_set, where) for i, t in enumerate(tensors)]
        return _completed([], None, lambda _res: [synchronize(h) for h in handles])
    if _reduces_on_device(tensors, op, prescale_factor, postscale_factor, process_set, where):
        return _device_allreduce(tensors, False, op, name, prescale_factor, postscale_factor)
    plans = [_Reduce(t, op, prescale_factor, postscale_factor, process_set, where) for t in tensors]
    if any(p.after != 1.0 or p.op != op for p in plans):
        # integer tensors scaled as Horovod does: one allreduce each, fused by the runtime's queue
        handles = [allreduce_async(t, None, _grad_name(name, str(i)), op, prescale_factor, postscale_factor,
                                   process_set) for i, t in enumerate(tensors)]
        return _completed([], None, lambda _res: [synchronize(h) for h in handles])
    arrays = [_to_numpy(t) for t in tensors]
    return Handle([_ring.grouped_allreduce_async(arrays, None, name, op, prescale_factor, postscale_factor,
                                                 process_set)],
                  lambda res: [_from_numpy(a, t) for a, t in zip(res[0], tensors)])


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle[list[torch.Tensor]]:
    """Queue an in-place grouped allreduce; synchronize returns the list of input tensors."""
    where = f"grouped_allreduce_ '{name}'"
    _group_check(tensors, where)
    op = _api.resolve_op(op, average, where)
    if _reduces_on_device(tensors, op, prescale_factor, postscale_factor, process_set, where):
        return _device_allreduce(tensors, True, op, name, prescale_factor, postscale_factor)
    handle = grouped_allreduce_async(tensors, None, name, op, prescale_factor, postscale_factor, process_set)
    inner = handle._finish

    def finish(res: list[Any]) -> list[torch.Tensor]:
        with torch.no_grad():
            for t, out in zip(tensors, inner(res)):
                t.copy_(out)
        return list(tensors)
    handle._finish = finish
    return handle


class _GroupedAllreduce(torch.autograd.Function):
    """grouped_allreduce as a differentiable op: the gradients are grouped-allreduced alike."""

    @staticmethod
    def forward(ctx: Any, average: bool | None, name: str | None, op: int | None, prescale_factor: float,
                postscale_factor: float, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (average, _grad_name(name), op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                                         postscale_factor, process_set)))

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = synchronize(grouped_allreduce_async([g.contiguous() for g in grad_output], *ctx.args))
        return (None, None, None, None, None, None, *grads)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Compressor = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors together; returns a list of new tensors; differentiable."""
    _group_check(tensors, f"grouped_allreduce '{name}'")
    pairs = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in pairs]
    outs: Sequence[torch.Tensor]
    if torch.is_grad_enabled() and any(c.requires_grad for c in compressed):
        outs = cast(tuple[torch.Tensor, ...], _apply(_GroupedAllreduce, average, name, op, prescale_factor,
                                                     postscale_factor, process_set, *compressed))
    else:
        outs = synchronize(grouped_allreduce_async(compressed, average, name, op, prescale_factor,
                                                   postscale_factor, process_set))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place grouped allreduce; returns the list of input tensors."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: int,
                           process_set: ProcessSet = global_process_set) -> "SparseReduction":
    """Reduce a sparse COO tensor by allgathering its indices and values (Horovod's way).

    Returns a SparseReduction; calling it waits and returns the reduced sparse tensor (duplicate
    indices stay uncoalesced, as in Horovod). ``op``: Average or Sum.
    """
    where = f"sparse_allreduce '{name}'"
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(f"{where}: expects a sparse COO tensor (tensor.to_sparse()), got "
                        f"{type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else 'a dense tensor'}")
    if op not in (Average, Sum):
        raise ValueError(f"{where}: only op=Average or op=Sum are defined for sparse tensors")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = t._indices().transpose(0, 1).contiguous()
    values = t._values().contiguous()
    h_values = allgather_async(values, name=_grad_name(name, "values"), process_set=process_set)
    h_indices = allgather_async(indices, name=_grad_name(name, "indices"), process_set=process_set)
    return SparseReduction(h_values, h_indices, op == Average, process_set, t.size())


class SparseReduction:
    """``sparse_allreduce_async``'s result: calling it waits and returns the reduced sparse tensor;
    ``handles`` are its two allgathers (for a DistributedOptimizer that drops a stale step)."""

    def __init__(self, values: Handle[torch.Tensor], indices: Handle[torch.Tensor], average: bool,
                 process_set: ProcessSet, size: torch.Size) -> None:
        self.handles = (values, indices)
        self._average, self._process_set, self._size = average, process_set, size

    def __call__(self) -> torch.Tensor:
        h_values, h_indices = self.handles
        vals = synchronize(h_values)
        idx = synchronize(h_indices)
        if self._average:
            vals = vals / _set_size(self._process_set)
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, self._size)


# ------------------------------------------------------------------ Adasum
def _adasum_async(tensor: torch.Tensor, name: str | None, process_set: ProcessSet, where: str) -> Handle[torch.Tensor]:
    n = _set_size(process_set)
    if n & (n - 1):
        raise NotImplementedError(f"{where}: Running Adasum with non-power of 2 ranks is not supported yet "
                                  f"({n} ranks; Horovod's algorithm pairs ranks recursively)")
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"{where}: Adasum needs a floating-point tensor, got {tensor.dtype}")
    flat = tensor.detach().reshape(1, -1)
    gathered = allgather_async(flat, name=name, process_set=process_set)

    def finish(_res: list[Any]) -> torch.Tensor:
        rows = synchronize(gathered).to(torch.float64).numpy()
        out = torch.from_numpy(adasum_combine(rows))
        return out.to(tensor.dtype).reshape(tensor.shape)
    return _completed([], None, finish)


# ------------------------------------------------------------------ allgather
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle[torch.Tensor]:
    """Queue an allgather (concatenation along dim 0, which may differ between ranks)."""
    where = f"allgather '{name}'"
    _check_tensor(tensor, where)
    if tensor.dim() == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension; pass tensor.reshape(1)")
    if _copies_on_device(tensor, process_set):
        transport = _device.transport()
        return _device_launch(lambda: transport.allgather_async(tensor.detach(),
                                                                transport.auto_name("allgather", name)),
                              lambda out: out)
    arr = _to_numpy(tensor)
    return Handle([_ring.allgather_async(arr, name, process_set)], lambda res: _from_numpy(res[0], tensor))


def _row_offset(rows: int, process_set: ProcessSet, name: str | None) -> int:
    """This rank's first row in a concatenation of every member's ``rows`` rows."""
    counts = synchronize(allgather_async(torch.tensor([rows], dtype=torch.int64), name=name,
                                         process_set=process_set))
    return int(counts[:_set_rank(process_set)].sum())


class _Allgather(torch.autograd.Function):
    """allgather as a differentiable op: each rank's gradient is its rows of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.name, ctx.process_set = tensor.shape[0], name, process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average, name=_grad_name(ctx.name),
                                           process_set=ctx.process_set))
        offset = _row_offset(ctx.rows, ctx.process_set, _grad_name(ctx.name, "grad.rows"))
        return grad.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 (dim 0 may differ); differentiable."""
    _check_tensor(tensor, f"allgather '{name}'")
    if tensor.requires_grad and torch.is_grad_enabled():
        return cast(torch.Tensor, _apply(_Allgather, tensor, name, process_set))
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> Handle[list[torch.Tensor]]:
    """Queue an allgather of each tensor of a list; synchronize returns the list of results."""
    where = f"grouped_allgather '{name}'"
    _group_check(tensors, where)
    handles = [allgather_async(t, _grad_name(name, str(i)), process_set) for i, t in enumerate(tensors)]
    return _completed([], None, lambda _res: [synchronize(h) for h in handles])


class _GroupedAllgather(torch.autograd.Function):
    """grouped_allgather as a differentiable op (each tensor as allgather's gradient)."""

    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows, ctx.name, ctx.process_set = [t.shape[0] for t in tensors], name, process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = synchronize(grouped_allreduce_async([g.contiguous() for g in grad_output], op=Average,
                                                    name=_grad_name(ctx.name), process_set=ctx.process_set))
        out = []
        for i, (grad, rows) in enumerate(zip(grads, ctx.rows)):
            offset = _row_offset(rows, ctx.process_set, _grad_name(ctx.name, f"grad.rows.{i}"))
            out.append(grad.narrow(0, offset, rows))
        return (None, None, *out)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """allgather of each tensor of a list; returns a list; differentiable."""
    _group_check(tensors, f"grouped_allgather '{name}'")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(cast(tuple[torch.Tensor, ...], _apply(_GroupedAllgather, name, process_set, *tensors)))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# ------------------------------------------------------------------ broadcast
def broadcast_async(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle[torch.Tensor]:
    """Queue a broadcast of root's tensor (root_rank: a global rank); synchronize returns a new tensor."""
    where = f"broadcast '{name}'"
    _check_tensor(tensor, where)
    if _copies_on_device(tensor, process_set):   # the global set only: root_rank is its rank
        return _device_broadcast(tensor.detach().clone(), root_rank, name)
    arr = _to_numpy(tensor)
    # reshape: the runtime returns 0-d arrays as shape (1,) (np.ascontiguousarray promotes them)
    return Handle([_ring.broadcast_async(arr, root_rank, name, process_set)],
                  lambda res: _from_numpy(res[0], tensor).reshape(tensor.shape))


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle[torch.Tensor]:
    """Queue an in-place broadcast into ``tensor``; synchronize returns ``tensor``."""
    where = f"broadcast_ '{name}'"
    _check_tensor(tensor, where)
    if _copies_on_device(tensor, process_set):
        handle = _device_broadcast(tensor.detach(), root_rank, name)  # global set: its rank
        inner_device = handle._finish

        def finish_device(res: list[Any]) -> torch.Tensor:
            inner_device(res)
            return tensor
        handle._finish = finish_device
        return handle
    handle = broadcast_async(tensor, root_rank, name, process_set)
    inner = handle._finish

    def finish(res: list[Any]) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(inner(res))
        return tensor
    handle._finish = finish
    return handle


class _Broadcast(torch.autograd.Function):
    """broadcast as a differentiable op: root gets the averaged gradient, the others zero."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.name, ctx.process_set = root_rank, name, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average, name=_grad_name(ctx.name),
                                           process_set=ctx.process_set))
        if _ring.rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Root's tensor, returned as a new tensor on every rank; differentiable."""
    _check_tensor(tensor, f"broadcast '{name}'")
    if tensor.requires_grad and torch.is_grad_enabled():
        return cast(torch.Tensor, _apply(_Broadcast, tensor, root_rank, name, process_set))
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast: ``tensor`` receives root's values and is returned."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ------------------------------------------------------------------ alltoall
def alltoall_async(tensor: torch.Tensor, splits: torch.Tensor | npt.ArrayLike | None = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle[tuple[torch.Tensor, torch.Tensor]]:
    """Queue an alltoall; synchronize returns (output, received_splits)."""
    where = f"alltoall '{name}'"
    _check_tensor(tensor, where)
    if tensor.dim() == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension, got a scalar")
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{where}: splits must be an int32 or int64 tensor, got {splits.dtype}")
        splits = splits.detach().cpu().numpy()
    arr = _to_numpy(tensor)
    # without splits, dim 0 must divide evenly (ValueError here otherwise, as Horovod)
    return Handle([_ring.alltoall_async(arr, splits, name, process_set)],
                  lambda res: (_from_numpy(res[0][0], tensor), torch.from_numpy(np.asarray(res[0][1], np.int32))))


class _Alltoall(torch.autograd.Function):
    """alltoall as a differentiable op: the gradient goes back with the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: torch.Tensor | npt.ArrayLike | None, name: str | None,
                process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.name, ctx.process_set = received, name, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *_dead: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received, _grad_name(ctx.name),
                                             ctx.process_set))
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits: torch.Tensor | npt.ArrayLike | None = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[q]`` rows to rank q, receive theirs: returns (output, received_splits).

    Without ``splits`` dim 0 must be divisible by the number of ranks and only the output is
    returned (Horovod's rules). Differentiable.
    """
    _check_tensor(tensor, f"alltoall '{name}'")
    if tensor.requires_grad and torch.is_grad_enabled():
        output, received = cast(tuple[torch.Tensor, torch.Tensor],
                                _apply(_Alltoall, tensor, splits, name, process_set))
    else:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


# ------------------------------------------------------------------ reducescatter
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle[torch.Tensor]:
    """Queue a reducescatter; synchronize returns this rank's block of dim 0."""
    where = f"reducescatter '{name}'"
    _check_tensor(tensor, where)
    if tensor.dim() == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension, got a scalar")
    if op not in (Average, Sum):
        # NotImplementedError, a RuntimeError as Horovod's
        raise NotImplementedError(f"{where}: reducescatter supports op=Average or op=Sum, got {op!r}")
    # the runtime's reducescatter has no scale factors: the adapter applies them (integers in
    # float64, truncated, as Horovod does)
    plan = _Reduce(tensor, op, prescale_factor, postscale_factor, process_set, where)
    staged = plan.stage(tensor)
    if not plan.integer and plan.pre != 1.0:
        staged = tensor.detach() * plan.pre
    arr = _to_numpy(staged)
    post = 1.0 if plan.integer else plan.post

    def finish(res: list[Any]) -> torch.Tensor:
        out = _from_numpy(res[0], tensor)
        if post != 1.0:
            out = out * post
        return plan.finish(out)
    return Handle([_ring.reducescatter_async(arr, op=plan.op, name=name, process_set=process_set)], finish)


class _Reducescatter(torch.autograd.Function):
    """reducescatter as a differentiable op: the gradient is allgathered (times size for Sum)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet, prescale_factor: float,
                postscale_factor: float) -> torch.Tensor:
        ctx.args = (name, op, process_set, prescale_factor * postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        name, op, process_set, factor = ctx.args
        grad = grad_output * (factor * (_set_size(process_set) if op == Sum else 1))
        return allgather(grad.contiguous(), _grad_name(name), process_set), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Compressor = Compression.none,
                  op: int = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over ranks and return this rank's block of dim 0 (the first ranks get the extra rows)."""
    _check_tensor(tensor, f"reducescatter '{name}'")
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = cast(torch.Tensor, _apply(_Reducescatter, compressed, name, op, process_set, prescale_factor,
                                        postscale_factor))
    else:
        out = synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                              postscale_factor))
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle[list[torch.Tensor]]:
    """Queue a reducescatter of each tensor of a list; synchronize returns the list of blocks."""
    where = f"grouped_reducescatter '{name}'"
    _group_check(tensors, where)
    handles = [reducescatter_async(t, _grad_name(name, str(i)), op, process_set, prescale_factor,
                                   postscale_factor) for i, t in enumerate(tensors)]
    return _completed([], None, lambda _res: [synchronize(h) for h in handles])


class _GroupedReducescatter(torch.autograd.Function):
    """grouped_reducescatter as a differentiable op (each tensor as reducescatter's gradient)."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, process_set: ProcessSet, prescale_factor: float,
                postscale_factor: float, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (name, op, process_set, prescale_factor * postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                             prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        name, op, process_set, factor = ctx.args
        scale = factor * (_set_size(process_set) if op == Sum else 1)
        grads = grouped_allgather([(g * scale).contiguous() for g in grad_output], _grad_name(name), process_set)
        return (None, None, None, None, None, *grads)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Compressor = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """reducescatter of each tensor of a list; returns a list; differentiable."""
    _group_check(tensors, f"grouped_reducescatter '{name}'")
    pairs = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in pairs]
    outs: Sequence[torch.Tensor]
    if torch.is_grad_enabled() and any(c.requires_grad for c in compressed):
        outs = cast(tuple[torch.Tensor, ...], _apply(_GroupedReducescatter, name, op, process_set, prescale_factor,
                                                     postscale_factor, *compressed))
    else:
        outs = synchronize(grouped_reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                                       postscale_factor))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# ------------------------------------------------------------------ barrier, objects
def barrier(process_set: ProcessSet | None = global_process_set) -> None:
    """Wait until every rank of ``process_set`` arrives (interruptible, with the stall timeout)."""
    _ring.barrier(process_set)
