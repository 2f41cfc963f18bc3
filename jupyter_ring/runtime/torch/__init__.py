"""Horovod's torch API on jupyter_ring's ring runtime: change only the import line.

::

    import jupyter_ring.runtime.torch as hvd

    hvd.init()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

CPU tensors reach the ring runtime as numpy arrays: a contiguous CPU tensor is shared without a
copy (``tensor.numpy()``); bfloat16 travels as float32 (numpy has no bfloat16); non-contiguous
tensors are copied. CUDA tensors are never staged through host memory: allreduce, broadcast and
allgather on the global process set go to the device transport (:mod:`jupyter_ring.runtime._device.transport`:
NCCL through torch.distributed, agreed over the ring first, completion polled); alltoall,
reducescatter, Adasum, smaller process sets, integer tensors scaled as Horovod scales them and
dtype/op pairs NCCL lacks are staged. ``JUPYTER_RING_DEVICE_TRANSPORT=gloo`` sends CPU tensors
through the same transport over gloo (how it is tested without a GPU); ``off`` stages CUDA tensors.
"""

import contextlib
import math
import warnings
import weakref

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the torch adapter needs torch: pip install 'jupyter_ring[torch]'") from exc

import numpy as np

from ... import runtime as _ring
from .. import _api  # _api: epoch, op; _device: CUDA tensors; _report: steps
from .._device import transport as _device
from .._observe import report as _report
from .._horovod.runtime_names import *  # noqa: F403 - init, rank, ops, errors, ...: as in the numpy API
from .._horovod.runtime_names import __all__ as _COMMON
from .._horovod.basics import *  # noqa: F403 - capability functions, process sets, timeline, join
from .._horovod.basics import __all__ as _HOROVOD
from . import elastic  # Horovod's elastic API for a fixed world
from .._horovod.basics import adasum_combine
from .._engine.pool import Lender
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    *_COMMON, *(name for name in _HOROVOD if name not in _COMMON), "elastic", "Compression", "NoneCompressor", "FP16Compressor", "Handle", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "poll",
    "synchronize", "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
    "SyncBatchNorm",
]


def nccl_built():
    """True when CUDA tensors go through NCCL (torch.distributed has it, the transport is on)."""
    return _device.mode() != "off" and _device._nccl_available()


def cuda_built():
    """True when this torch has CUDA and CUDA tensors go to the device transport, unstaged."""
    return torch.version.cuda is not None and nccl_built()


# ------------------------------------------------------------------ compression
class NoneCompressor:
    """No compression: tensors travel in their own dtype."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 (half the bytes), and come back in their dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Gradient compression for allreduce: ``Compression.none`` or ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


# ------------------------------------------------------------------ tensor <-> numpy
_NUMPY_DTYPES = {
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
}


def _check_tensor(tensor, where):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{where}: sparse tensors are not supported; pass tensor.to_dense()")


def _shares_numpy(tensor):
    """Whether ``tensor.numpy()`` is a C-contiguous view the runtime can write into directly."""
    return (tensor.device.type == "cpu" and tensor.dtype in _NUMPY_DTYPES and tensor.is_contiguous()
            and not tensor.is_conj() and not tensor.is_neg())


def _to_numpy(tensor):
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


def _from_numpy(arr, like):
    """A torch tensor of ``like``'s dtype and device holding ``arr``."""
    out = torch.from_numpy(np.ascontiguousarray(arr))
    if out.dtype != like.dtype or out.device != like.device:
        out = out.to(device=like.device, dtype=like.dtype)
    return out


# ------------------------------------------------------------------ tensor -> device transport
def _reduces_on_device(tensors, op, pre, post, process_set, where):
    """Whether an allreduce of ``tensors`` goes to the device transport (all of them or none)."""
    if not tensors or not _api.is_global(process_set) or op == Adasum:
        return False
    if not all(_device.routes(t) and _device.supports(t.dtype, op) for t in tensors):
        return False
    # Horovod's integer arithmetic (scaled in float64, truncated toward zero) and, on CPU, its
    # float16 scaled in float32 are the ring path's (_Reduce); NCCL scales CUDA float16 in place
    return not any(_Reduce(t, op, pre, post, process_set, where).integer
                   and (t.dtype in _INTEGER_DTYPES or t.device.type == "cpu") for t in tensors)


def _copies_on_device(tensor, process_set):
    return _api.is_global(process_set) and _device.routes(tensor) and _device.copies(tensor.dtype)


def _device_launch(launch, result):
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

        def fail(_res):
            raise error
        return Handle([], fail)
    return Handle([], lambda res: result(work.wait()))


def _device_allreduce(tensors, in_place, op, name, prescale_factor, postscale_factor, one=False):
    """An allreduce of ``tensors`` on the device transport (list in, list out; ``one``: the
    single tensor out)."""
    transport = _device.transport()
    targets = [t.detach() if in_place else t.detach().clone() for t in tensors]
    return _device_launch(
        lambda: transport.allreduce_async_(targets, op, transport.auto_name("allreduce", name),
                                           prescale_factor, postscale_factor),
        lambda _out: (tensors if in_place else targets)[0] if one else list(tensors) if in_place else targets)


def _device_broadcast(target, root_rank, name):
    transport = _device.transport()
    return _device_launch(lambda: transport.broadcast_async_(target, root_rank,
                                                             transport.auto_name("broadcast", name)),
                          lambda out: out)


class Handle:
    """An async collective in flight: pass it to :func:`synchronize` or :func:`poll`."""

    __slots__ = ("_handles", "_finish", "_done", "_result")

    def __init__(self, handles, finish):
        self._handles = handles      # runtime handles, synchronized in order
        self._finish = finish        # results of the runtime handles -> the torch result
        self._done = False
        self._result = None

    def __repr__(self):
        return f"<jupyter_ring.torch.Handle {'done' if self._done else 'pending'}>"


def _check_handle(handle):
    if not isinstance(handle, Handle):
        raise TypeError(f"expected a handle returned by an *_async call, got {type(handle).__name__}")
    if handle._done:
        raise ValueError("this handle was already synchronized; each handle is synchronized once")


def poll(handle):
    """True when ``handle``'s collective has finished; runs nothing (the engine works in the
    background), so a caller may compute while it is False."""
    _check_handle(handle)
    return all(_ring.poll(h) for h in handle._handles)


def synchronize(handle):
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
def _completed(results, error, finish):
    def done(_nothing):
        if error is not None:
            raise error
        return finish(results)
    return Handle([], done)


def _set_size(process_set, where="process_set"):
    return _api.set_size(process_set, where)


def _set_rank(process_set):
    return _api.set_rank(process_set, "process_set")


def _grad_name(name, suffix="grad"):
    return None if name is None else f"{name}.{suffix}"


def _staging_buffer(tensor):
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


_staging = Lender(keep=2)  # pinned host buffers by (dtype, capacity)


def _staged_allreduce(tensor, plan, name, process_set, in_place):
    """Allreduce of a CUDA ``tensor`` through a pinned host buffer (see _staging_buffer)."""
    buf, host = _staging_buffer(tensor)
    pre, post = plan.runtime_scales(tensor)
    handle = _ring.allreduce_async_(host.numpy(), None, name, plan.op, pre, post, process_set)

    def finish(_res):
        out = tensor.detach() if in_place else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        with torch.no_grad():
            out.copy_(host.view(tensor.shape))  # synchronous: the buffer is free after it
        _staging.give_back((buf.dtype, buf.numel()), buf)
        return tensor if in_place else out
    return Handle([handle], finish)


def _stages_pinned(tensor, plan):
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

    def __init__(self, tensor, op, pre, post, process_set, where):
        pre = _api._factor(pre, "prescale_factor", where)
        post = _api._factor(post, "postscale_factor", where)
        wide = (torch.float64 if tensor.dtype in _INTEGER_DTYPES else
                torch.float32 if tensor.dtype == torch.float16 else None)
        self.wide = wide if wide is not None and (pre != 1.0 or post != 1.0 or op == Average) else None
        if self.wide is not None:
            self.op, self.pre, self.post = (Sum if op == Average else op), pre, 1.0
            self.after = post / _set_size(process_set) if op == Average else post
        else:
            self.op, self.pre, self.post, self.after = op, pre, post, 1.0

    @property
    def integer(self):
        """Whether the adapter scales (the runtime only sums)."""
        return self.wide is not None

    def stage(self, tensor):
        """The tensor whose numpy form the runtime reduces (prescaled here when the adapter scales)."""
        if self.wide is not None and self.pre != 1.0:
            return (tensor.detach().to(self.wide) * self.pre).to(tensor.dtype)
        return tensor

    def runtime_scales(self, tensor):
        """(prescale, postscale) for the runtime: none when the adapter applies them."""
        return (1.0, 1.0) if self.wide is not None else (self.pre, self.post)

    def finish(self, out):
        if self.wide is not None and self.after != 1.0:
            return (out.to(self.wide) * self.after).to(out.dtype)
        return out


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
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


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Queue an in-place allreduce; ``synchronize(handle)`` returns ``tensor`` holding the result."""
    where = f"allreduce_ '{name}'"
    _check_tensor(tensor, where)
    op = _api.resolve_op(op, average, where)
    if _reduces_on_device([tensor], op, prescale_factor, postscale_factor, process_set, where):
        return _device_allreduce([tensor], True, op, name, prescale_factor, postscale_factor, one=True)
    t = tensor.detach()
    plan = _Reduce(tensor, op, prescale_factor, postscale_factor, process_set, where) if op != Adasum else None
    if op != Adasum and not plan.integer and _shares_numpy(t):
        # zero-copy: the runtime reduces straight into the tensor's memory
        arr = t.numpy()
        return Handle([_ring.allreduce_async_(arr, None, name, op, prescale_factor, postscale_factor, process_set)],
                      lambda res: tensor)
    if op != Adasum and _stages_pinned(t, plan):
        return _staged_allreduce(tensor, plan, name, process_set, in_place=True)
    handle = allreduce_async(t, None, name, op, prescale_factor, postscale_factor, process_set)
    inner = handle._finish

    def finish(res):
        out = inner(res)
        with torch.no_grad():
            t.copy_(out)
        return tensor
    handle._finish = finish
    return handle


class _Allreduce(torch.autograd.Function):
    """allreduce as a differentiable op: the gradient is allreduced with the same op and scales."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (average, _grad_name(name), op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                           process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output.contiguous(), *ctx.args))
        return grad, None, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over all ranks (default: Average) into a new tensor; differentiable."""
    _check_tensor(tensor, f"allreduce '{name}'")
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = _Allreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    else:
        out = synchronize(allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor,
                                          process_set))
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """In-place allreduce: ``tensor`` receives the result and is returned."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def _group_check(tensors, where):
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{where}: expected a list of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        _check_tensor(t, f"{where} tensor {i}")


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
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


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Queue an in-place grouped allreduce; synchronize returns the list of input tensors."""
    where = f"grouped_allreduce_ '{name}'"
    _group_check(tensors, where)
    op = _api.resolve_op(op, average, where)
    if _reduces_on_device(tensors, op, prescale_factor, postscale_factor, process_set, where):
        return _device_allreduce(tensors, True, op, name, prescale_factor, postscale_factor)
    handle = grouped_allreduce_async(tensors, None, name, op, prescale_factor, postscale_factor, process_set)
    inner = handle._finish

    def finish(res):
        with torch.no_grad():
            for t, out in zip(tensors, inner(res)):
                t.copy_(out)
        return list(tensors)
    handle._finish = finish
    return handle


class _GroupedAllreduce(torch.autograd.Function):
    """grouped_allreduce as a differentiable op: the gradients are grouped-allreduced alike."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (average, _grad_name(name), op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                                         postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grad_output):
        grads = synchronize(grouped_allreduce_async([g.contiguous() for g in grad_output], *ctx.args))
        return (None, None, None, None, None, None, *grads)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Allreduce a list of tensors together; returns a list of new tensors; differentiable."""
    _group_check(tensors, f"grouped_allreduce '{name}'")
    pairs = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in pairs]
    if torch.is_grad_enabled() and any(c.requires_grad for c in compressed):
        outs = _GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                       *compressed)
    else:
        outs = synchronize(grouped_allreduce_async(compressed, average, name, op, prescale_factor,
                                                   postscale_factor, process_set))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """In-place grouped allreduce; returns the list of input tensors."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Reduce a sparse COO tensor by allgathering its indices and values (Horovod's way).

    Returns a function; calling it waits and returns the reduced sparse tensor (duplicate
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

    def handle():
        vals = synchronize(h_values)
        idx = synchronize(h_indices)
        if op == Average:
            vals = vals / _set_size(process_set)
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, t.size())
    handle.handles = (h_values, h_indices)   # for a DistributedOptimizer that drops a stale step
    return handle


# ------------------------------------------------------------------ Adasum
def _adasum_async(tensor, name, process_set, where):
    n = _set_size(process_set)
    if n & (n - 1):
        raise NotImplementedError(f"{where}: Running Adasum with non-power of 2 ranks is not supported yet "
                                  f"({n} ranks; Horovod's algorithm pairs ranks recursively)")
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"{where}: Adasum needs a floating-point tensor, got {tensor.dtype}")
    flat = tensor.detach().reshape(1, -1)
    gathered = allgather_async(flat, name=name, process_set=process_set)

    def finish(_res):
        rows = synchronize(gathered).to(torch.float64).numpy()
        out = torch.from_numpy(adasum_combine(rows))
        return out.to(tensor.dtype).reshape(tensor.shape)
    return _completed([], None, finish)


# ------------------------------------------------------------------ allgather
def allgather_async(tensor, name=None, process_set=global_process_set):
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


def _row_offset(rows, process_set, name):
    """This rank's first row in a concatenation of every member's ``rows`` rows."""
    counts = synchronize(allgather_async(torch.tensor([rows], dtype=torch.int64), name=name,
                                         process_set=process_set))
    return int(counts[:_set_rank(process_set)].sum())


class _Allgather(torch.autograd.Function):
    """allgather as a differentiable op: each rank's gradient is its rows of the averaged gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.name, ctx.process_set = tensor.shape[0], name, process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average, name=_grad_name(ctx.name),
                                           process_set=ctx.process_set))
        offset = _row_offset(ctx.rows, ctx.process_set, _grad_name(ctx.name, "grad.rows"))
        return grad.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's tensor concatenated along dim 0 (dim 0 may differ); differentiable."""
    _check_tensor(tensor, f"allgather '{name}'")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Queue an allgather of each tensor of a list; synchronize returns the list of results."""
    where = f"grouped_allgather '{name}'"
    _group_check(tensors, where)
    handles = [allgather_async(t, _grad_name(name, str(i)), process_set) for i, t in enumerate(tensors)]
    return _completed([], None, lambda _res: [synchronize(h) for h in handles])


class _GroupedAllgather(torch.autograd.Function):
    """grouped_allgather as a differentiable op (each tensor as allgather's gradient)."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.name, ctx.process_set = [t.shape[0] for t in tensors], name, process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grad_output):
        grads = synchronize(grouped_allreduce_async([g.contiguous() for g in grad_output], op=Average,
                                                    name=_grad_name(ctx.name), process_set=ctx.process_set))
        out = []
        for i, (grad, rows) in enumerate(zip(grads, ctx.rows)):
            offset = _row_offset(rows, ctx.process_set, _grad_name(ctx.name, f"grad.rows.{i}"))
            out.append(grad.narrow(0, offset, rows))
        return (None, None, *out)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """allgather of each tensor of a list; returns a list; differentiable."""
    _group_check(tensors, f"grouped_allgather '{name}'")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# ------------------------------------------------------------------ broadcast
def broadcast_async(tensor, root_rank=0, name=None, process_set=global_process_set):
    """Queue a broadcast of root's tensor (root_rank: a global rank); synchronize returns a new tensor."""
    where = f"broadcast '{name}'"
    _check_tensor(tensor, where)
    if _copies_on_device(tensor, process_set):   # the global set only: root_rank is its rank
        return _device_broadcast(tensor.detach().clone(), root_rank, name)
    arr = _to_numpy(tensor)
    # reshape: the runtime returns 0-d arrays as shape (1,) (np.ascontiguousarray promotes them)
    return Handle([_ring.broadcast_async(arr, root_rank, name, process_set)],
                  lambda res: _from_numpy(res[0], tensor).reshape(tensor.shape))


def broadcast_async_(tensor, root_rank=0, name=None, process_set=global_process_set):
    """Queue an in-place broadcast into ``tensor``; synchronize returns ``tensor``."""
    where = f"broadcast_ '{name}'"
    _check_tensor(tensor, where)
    if _copies_on_device(tensor, process_set):
        handle = _device_broadcast(tensor.detach(), root_rank, name)  # global set: its rank
        handle._finish = lambda res, inner=handle._finish: (inner(res), tensor)[1]
        return handle
    handle = broadcast_async(tensor, root_rank, name, process_set)
    inner = handle._finish

    def finish(res):
        with torch.no_grad():
            tensor.copy_(inner(res))
        return tensor
    handle._finish = finish
    return handle


class _Broadcast(torch.autograd.Function):
    """broadcast as a differentiable op: root gets the averaged gradient, the others zero."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.name, ctx.process_set = root_rank, name, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average, name=_grad_name(ctx.name),
                                           process_set=ctx.process_set))
        if _ring.rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None, None


def broadcast(tensor, root_rank=0, name=None, process_set=global_process_set):
    """Root's tensor, returned as a new tensor on every rank; differentiable."""
    _check_tensor(tensor, f"broadcast '{name}'")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank=0, name=None, process_set=global_process_set):
    """In-place broadcast: ``tensor`` receives root's values and is returned."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ------------------------------------------------------------------ alltoall
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
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
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.name, ctx.process_set = received, name, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *_dead):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received, _grad_name(ctx.name),
                                             ctx.process_set))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[q]`` rows to rank q, receive theirs: returns (output, received_splits).

    Without ``splits`` dim 0 must be divisible by the number of ranks and only the output is
    returned (Horovod's rules). Differentiable.
    """
    _check_tensor(tensor, f"alltoall '{name}'")
    if tensor.requires_grad and torch.is_grad_enabled():
        output, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


# ------------------------------------------------------------------ reducescatter
def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
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

    def finish(res):
        out = _from_numpy(res[0], tensor)
        if post != 1.0:
            out = out * post
        return plan.finish(out)
    return Handle([_ring.reducescatter_async(arr, op=plan.op, name=name, process_set=process_set)], finish)


class _Reducescatter(torch.autograd.Function):
    """reducescatter as a differentiable op: the gradient is allgathered (times size for Sum)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (name, op, process_set, prescale_factor * postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        name, op, process_set, factor = ctx.args
        grad = grad_output * (factor * (_set_size(process_set) if op == Sum else 1))
        return allgather(grad.contiguous(), _grad_name(name), process_set), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over ranks and return this rank's block of dim 0 (the first ranks get the extra rows)."""
    _check_tensor(tensor, f"reducescatter '{name}'")
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    else:
        out = synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                              postscale_factor))
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Queue a reducescatter of each tensor of a list; synchronize returns the list of blocks."""
    where = f"grouped_reducescatter '{name}'"
    _group_check(tensors, where)
    handles = [reducescatter_async(t, _grad_name(name, str(i)), op, process_set, prescale_factor,
                                   postscale_factor) for i, t in enumerate(tensors)]
    return _completed([], None, lambda _res: [synchronize(h) for h in handles])


class _GroupedReducescatter(torch.autograd.Function):
    """grouped_reducescatter as a differentiable op (each tensor as reducescatter's gradient)."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (name, op, process_set, prescale_factor * postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                             prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_output):
        name, op, process_set, factor = ctx.args
        scale = factor * (_set_size(process_set) if op == Sum else 1)
        grads = grouped_allgather([(g * scale).contiguous() for g in grad_output], _grad_name(name), process_set)
        return (None, None, None, None, None, *grads)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """reducescatter of each tensor of a list; returns a list; differentiable."""
    _group_check(tensors, f"grouped_reducescatter '{name}'")
    pairs = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in pairs]
    if torch.is_grad_enabled() and any(c.requires_grad for c in compressed):
        outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor, *compressed)
    else:
        outs = synchronize(grouped_reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                                       postscale_factor))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# ------------------------------------------------------------------ barrier, objects
def barrier(process_set=global_process_set):
    """Wait until every rank of ``process_set`` arrives (interruptible, with the stall timeout)."""
    _ring.barrier(process_set)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Root's picklable object, returned on every rank of ``process_set``."""
    return _ring.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's picklable object, as a list in rank order."""
    return _ring.allgather_object(obj, name, process_set)


# ------------------------------------------------------------------ model and optimizer state
def _named_tensors(params, where):
    if isinstance(params, dict):
        return sorted(params.items(), key=lambda kv: str(kv[0]))
    try:
        items = list(params)
    except TypeError:
        raise TypeError(f"{where}: expected a state_dict, named_parameters() or a list of tensors, "
                        f"got {type(params).__name__}") from None
    return [p if isinstance(p, tuple) else (f"{i}", p) for i, p in enumerate(items)]


def broadcast_parameters(params, root_rank=0):
    """Overwrite every rank's tensors with root's: ``model.state_dict()`` or ``named_parameters()``."""
    handles = []
    for name, p in _named_tensors(params, "broadcast_parameters"):
        if p is None:
            continue
        _check_tensor(p, f"broadcast_parameters '{name}'")
        handles.append(broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                                        name=f"broadcast_parameters.{name}"))
    for h in handles:
        synchronize(h)


class _TensorSlot:
    """Placeholder for a tensor in the optimizer-state skeleton sent by broadcast_optimizer_state."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index, shape, dtype):
        self.index, self.shape, self.dtype = index, shape, dtype


def _split_tensors(obj, tensors):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _split_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split_tensors(v, tensors) for v in obj)
    return obj


def _fill_tensors(obj, tensors):
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill_tensors(v, tensors) for v in obj)
    return obj


def _zero_missing_grads(optimizer, model):
    """Horovod's visible side effect on an optimizer without state: zero gradients (sparse for
    SparseAdam and for ``model``'s sparse embeddings) where there are none. Horovod then steps
    once on them to create the state, which advances Adam's step count; we do not step, so n
    ranks stay equal to one process (the state comes from root, if root has any)."""
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                    p.grad = p.grad.to_sparse()


def broadcast_optimizer_state(optimizer, root_rank=0, model=None):
    """Make every rank's optimizer state (moments, step counts, hyper-parameters) equal to root's.

    Root's ``state_dict()`` structure travels as one small object; its tensors travel as
    broadcasts, so large states (Adam moments) do not go through pickle. Ranks without state
    receive root's; parameters without a gradient get zeros, as in Horovod (``model`` names sparse
    embeddings). Every optimizer in torch.optim but LBFGS works.
    """
    if isinstance(optimizer, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError("broadcast_optimizer_state takes the optimizer, not its LR scheduler; "
                        "use broadcast_object(scheduler.state_dict()) for the scheduler")
    if not hasattr(optimizer, "state_dict"):
        raise TypeError(f"broadcast_optimizer_state: expected a torch optimizer, got {type(optimizer).__name__}")
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if isinstance(inner, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (its state holds closures' history); "
                         "re-create it on every rank instead")
    if not inner.state_dict()["state"]:
        _zero_missing_grads(inner, model)
    me = _ring.rank()
    tensors = []
    skeleton = _split_tensors(optimizer.state_dict(), tensors) if me == root_rank else None
    skeleton = _ring.broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state.structure")
    if me != root_rank:
        tensors = []
        _collect_slots(skeleton, tensors)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in sorted(tensors, key=lambda s: s.index)]
    handles = [broadcast_async_(t.detach(), root_rank, name=f"broadcast_optimizer_state.{i}")
               for i, t in enumerate(tensors)]
    for h in handles:
        synchronize(h)
    if me != root_rank:
        optimizer.load_state_dict(_fill_tensors(skeleton, tensors))


def _collect_slots(obj, out):
    if isinstance(obj, _TensorSlot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, out)


# ------------------------------------------------------------------ DistributedOptimizer
# Gradient buckets of about this many bytes. Measured on 2 CPU ranks (docs/benchmarks.md): small
# enough that the first buckets of a 10M-parameter MLP are reduced while backward still computes
# the early layers, large enough that each bucket's fixed cost (one engine round, three
# shared-memory syncs) stays small against its copies.
_BUCKET_BYTES = 8 << 20


class _Bucket:
    """Consecutive gradients (in backward order) reduced by one in-place allreduce of ``flat``.

    Zero copy (``views`` is True): ``flat`` lives in the transport's memory (``bucket_buffer``)
    and each parameter's ``.grad`` is a view of it, so backward accumulates into the bucket and
    the optimizer reads the result where the allreduce wrote it. Otherwise (compression, dtypes
    numpy lacks, a process set with CUDA tensors) gradients are copied in and the results copied
    back.

    A device bucket (``device`` is the parameters' torch device: CUDA tensors with NCCL, or CPU
    tensors with ``JUPYTER_RING_DEVICE_TRANSPORT=gloo``) lives on that device and goes to the
    device transport: ``.grad`` views of it as well, never staged through the host; ``handle``
    is then a ``DeviceWork`` (or a ``_LaunchFailed`` holding the launch's error).

    A sparse gradient (``nn.Embedding(sparse=True)``) keeps its slot in ``flat``: with
    ``sparse_as_dense`` its dense form travels there; otherwise the slot carries zeros and the
    gradient goes by Horovod's two allgathers (``sparse``: parameter index -> that wait, or None).
    """

    __slots__ = ("index", "params", "offsets", "flat", "slots", "array", "views", "device", "ready", "handle",
                 "name", "contexts", "sparse")

    def __init__(self, index, params, offsets, flat, array, views, device, shapes):
        self.index = index
        self.params = params       # parameter indices
        self.offsets = offsets     # element offset of each parameter in flat
        self.flat = flat           # 1-D torch tensor (the wire dtype)
        # each parameter's slot of flat in its shape, made once (a step reuses them)
        self.slots = [flat[o:o + math.prod(shape)].view(shape) for o, shape in zip(offsets, shapes)]
        self.array = array         # the same memory as a numpy array, for the runtime (None on a device)
        self.views = views
        self.device = device       # torch device of a device-transport bucket, else None
        self.ready = 0
        self.handle = None
        self.name = f"DistributedOptimizer.bucket{index}"
        self.contexts = {}         # parameter index -> the compressor's context (copied buckets)
        self.sparse = {}           # parameter index -> sparse_allreduce_async's wait, or None (as dense)


class _LaunchFailed:
    """A device bucket whose launch raised (a mismatch, a peer's bad arguments): ``wait()``
    raises it at ``synchronize()``, where a ring bucket's error surfaces too."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error

    def wait(self):
        raise self.error


def _finish_bucket(handle):
    """Wait for a bucket's allreduce, ring or device."""
    if isinstance(handle, (_device.DeviceWork, _LaunchFailed)):
        handle.wait()
    else:
        _ring.synchronize(handle)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer: gradients are allreduced (averaged) over the ranks before ``step()``.

    Gradients are grouped into buckets of about ``bucket_bytes`` (default
    8 MiB) in the order backward produces them. As soon as a bucket's last gradient is ready
    (a gradient hook), its in-place allreduce starts on the runtime's background engine, so
    communication overlaps the rest of ``backward()``; ``step()`` starts the last bucket and waits
    only for that tail. Holding the last bucket until ``step()`` keeps the ranks in step: no rank
    updates its parameters before every rank has called ``step()``. On one
    host each bucket lives in the transport's shared memory and each parameter's ``.grad`` is a
    view of it (as DDP's ``gradient_as_bucket_view``): the allreduce reads every rank's bucket
    where it lies and writes the result there, with no copy in or out (a gradient autograd
    produced afresh, after ``zero_grad()`` set it to None, is copied into its bucket once).

    Every rank launches buckets in one canonical order (learned from rank 0's first backward
    pass), so ranks whose hooks fire in a different order, or that leave some parameters without
    a gradient (zeros are sent for those, as Horovod does), still agree and never hang.

    Horovod's options: ``sparse_as_dense`` (sparse gradients travel dense and come back sparse),
    ``process_set`` (ranks outside it train locally), ``backward_passes_per_step``,
    ``compression``, ``gradient_predivide_factor``; ``num_groups``/``groups`` are accepted and
    change nothing (buckets of ``bucket_bytes`` take the place of Horovod's fusion groups).

    The class subclasses ``torch.optim.Optimizer`` statically so LR schedulers accept it; the
    wrapped optimizer's ``param_groups``, ``state`` and ``defaults`` are shared, not copied.
    """

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                 groups=None, sparse_as_dense=False, process_set=global_process_set, bucket_bytes=None):
        # Optimizer.__init__ is not called: it would build new param_groups; we share the wrapped
        # optimizer's. These are the attributes the base class methods (hooks) rely on.
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("this optimizer is already a DistributedOptimizer; wrap the plain torch "
                            "optimizer once (re-running a cell? wrap the original optimizer again)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
        if op == Adasum:
            raise ValueError("op=Adasum is not supported by jupyter_ring; use op=Average or op=Sum")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op=Average (it splits the averaging "
                             "into a division before and after the sum)")
        if not hasattr(compression, "compress") or not hasattr(compression, "decompress"):
            raise TypeError("compression must be Compression.none, Compression.fp16 or an object with "
                            "compress(tensor) and decompress(tensor, ctx)")
        if not _api.is_global(process_set) and not isinstance(process_set, ProcessSet):
            raise TypeError(f"process_set= takes a ProcessSet, got {type(process_set).__name__}")
        if bucket_bytes is None:
            bucket_bytes = _BUCKET_BYTES
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int (bytes per gradient bucket), got {bucket_bytes!r}")
        self._opt = optimizer
        self._sparse_as_dense = bool(sparse_as_dense)
        self._process_set = process_set
        # a rank outside the optimizer's process set trains locally (Horovod): no hooks, no reduction
        self._local_only = not _api.is_global(process_set) and not process_set.included()
        # num_groups/groups split Horovod's fusion into fixed groups; here buckets of bucket_bytes
        # do that work, so they are accepted and change nothing
        self._groups = groups if groups is not None else num_groups
        self._compression = compression
        self._bpps = backward_passes_per_step
        self._op = op
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = gradient_predivide_factor
        self._bucket_bytes = bucket_bytes
        self._should_synchronize = True
        self._synchronized = False
        self._params = []          # parameters that need a gradient, in param_groups order
        self._names = []
        self._index = {}           # id(param) -> position in self._params
        self._hooks = []
        self._given_names = self._check_names(named_parameters)
        for group in optimizer.param_groups:
            self._register(group["params"])
        self._order = list(range(len(self._params)))[::-1]  # backward runs roughly last-to-first
        self._order_learned = False
        self._buckets = []
        self._bucket_of = []
        self._make_buckets()
        self._reset_step()

    # -- the wrapped optimizer's state, shared
    @property
    def param_groups(self):
        return self._opt.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._opt.param_groups = value

    @property
    def state(self):
        return self._opt.state

    @state.setter
    def state(self, value):
        self._opt.state = value

    @property
    def defaults(self):
        return self._opt.defaults

    @defaults.setter
    def defaults(self, value):
        self._opt.defaults = value

    @property
    def _parameter_names(self):
        """Horovod's {parameter: name} of every parameter that gets an allreduced gradient."""
        return {p: name for p, name in zip(self._params, self._names)}

    @property
    def optimizer(self):
        """The wrapped torch optimizer."""
        return self._opt

    def __repr__(self):
        return f"DistributedOptimizer({self._opt!r})"

    def __getstate__(self):
        raise TypeError("a DistributedOptimizer cannot be pickled; save optimizer.state_dict() instead")

    def state_dict(self):
        """The wrapped optimizer's state_dict (identical on every rank after step())."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict):
        """Load into the wrapped optimizer."""
        return self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        """Add a parameter group to the wrapped optimizer; its parameters get gradient hooks too."""
        self._drop_stale_step()
        if any(self._counts):
            raise RingError("add_param_group() between loss.backward() and optimizer.step(): call it "
                            "before backward() or after step()")
        self._opt.add_param_group(param_group)
        self._register(self._opt.param_groups[-1]["params"])
        new = list(range(len(self._order), len(self._params)))
        self._order = new[::-1] + self._order
        self._make_buckets()
        self._reset_step()

    # -- set-up
    def _check_names(self, named_parameters):
        if named_parameters is None:
            return None
        pairs = list(named_parameters)
        if any(not (isinstance(p, tuple) and len(p) == 2) for p in pairs):
            raise TypeError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
        counts = {}
        for name, _p in pairs:
            counts[name] = counts.get(name, 0) + 1
        dups = sorted(n for n, c in counts.items() if c > 1)
        if dups:
            raise ValueError(f"named_parameters has duplicate names: {', '.join(repr(d) for d in dups)}; "
                             "each parameter needs a unique name. With several models, prefix each "
                             "model's names: [(f'enc.{n}', p) for n, p in enc.named_parameters()]")
        given = {id(p): name for name, p in pairs}
        missing = [tuple(p.shape) for group in self._opt.param_groups for p in group["params"]
                   if id(p) not in given]
        if missing:
            raise ValueError(f"named_parameters was given, but {len(missing)} of the optimizer's parameters "
                             f"are not in it (shapes {missing[:5]}{' ...' if len(missing) > 5 else ''}); pass "
                             "the named_parameters() of the model whose parameters the optimizer holds")
        return given

    def _register(self, params):
        if self._local_only:
            return
        for p in params:
            if not p.requires_grad or id(p) in self._index:
                continue
            old = _hook_of(p)
            if old is not None:
                # a previous DistributedOptimizer over this parameter (a re-run notebook cell):
                # its hook would queue allreduces nobody synchronizes
                old.remove()
            i = len(self._params)
            self._index[id(p)] = i
            self._params.append(p)
            if self._given_names is not None:
                self._names.append(self._given_names[id(p)])
            else:
                self._names.append(f"param.{i}")
            handle = p.register_post_accumulate_grad_hook(_GradHook(self, i))
            _HOOKS[id(p)] = (weakref.ref(p), handle)
            self._hooks.append(handle)

    def _wire_dtype(self, p):
        """The dtype a parameter's gradient travels in (compression decides; bfloat16 as float32
        through the ring, which reduces numpy arrays)."""
        probe = torch.empty(0, dtype=p.dtype, device="cpu")
        dtype = self._compression.compress(probe)[0].dtype
        if self._on_device(p, dtype):
            return dtype
        return torch.float32 if dtype == torch.bfloat16 else dtype

    def _on_device(self, p, dtype):
        """Whether ``p``'s gradient goes to the device transport (NCCL for CUDA), in a bucket on
        its device: the same rule as ``allreduce`` of a tensor (global set, a floating dtype the
        transport reduces with this op)."""
        return (_api.is_global(self._process_set) and dtype.is_floating_point and _device.routes(p)
                and _device.supports(dtype, self._op))

    def _zero_copy(self, p, dtype):
        return (self._compression is NoneCompressor and p.device.type == "cpu" and dtype == p.dtype
                and dtype in _NUMPY_DTYPES)

    def _make_buckets(self):
        """Cut ``self._order`` into buckets of about ``bucket_bytes`` of one wire dtype each."""
        groups, current, current_bytes, current_key = [], [], 0, None
        for i in self._order:
            p = self._params[i]
            dtype = self._wire_dtype(p)
            device = p.device if self._on_device(p, dtype) else None
            views = (self._compression is NoneCompressor and dtype == p.dtype) if device else self._zero_copy(p, dtype)
            key = (dtype, views, device)
            nbytes = p.numel() * torch.empty(0, dtype=dtype).element_size()
            if current and key != current_key:
                groups.append((current, current_key))
                current, current_bytes = [], 0
            current.append(i)
            current_bytes += nbytes
            current_key = key
            # a bucket closes once it holds bucket_bytes (DDP's rule), never before a gradient
            # that would overflow it: a bias then rides with its layer's weight instead of
            # making a round of its own between two weights larger than a bucket
            if current_bytes >= self._bucket_bytes:
                groups.append((current, current_key))
                current, current_bytes = [], 0
        if current:
            groups.append((current, current_key))
        self._buckets = []
        self._bucket_of = [0] * len(self._params)
        for index, (members, (dtype, views, device)) in enumerate(groups):
            offsets, total = [], 0
            for i in members:
                offsets.append(total)
                total += self._params[i].numel()
            itemsize = torch.empty(0, dtype=dtype).element_size()
            if device is not None:
                flat, array = torch.zeros(total, dtype=dtype, device=device), None
            else:
                if not total:  # only empty parameters
                    flat = torch.empty(0, dtype=dtype)
                else:
                    raw = (_api.bucket_buffer(total * itemsize, self._process_set) if views
                           else np.zeros(total * itemsize, np.uint8))
                    flat = torch.from_numpy(raw).view(dtype)
                array = flat.numpy()
            self._buckets.append(_Bucket(index, members, offsets, flat, array, views, device,
                                         [self._params[i].shape for i in members]))
            for i in members:
                self._bucket_of[i] = index

    def _reset_step(self):
        self._epoch = _api.epoch()
        self._counts = [0] * len(self._params)
        self._next = 0             # index of the next bucket to launch
        self._fired = []           # hook order of this step (rank 0's becomes the canonical order)
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.handle = None
            bucket.sparse = {}

    def _drop_stale_step(self):
        # A notebook cell failed or was interrupted on this rank after backward() and before
        # step(): its queued allreduces were abandoned (every rank drops its own), so the half
        # step is dropped too and the next cell starts a clean one.
        if self._epoch != _api.epoch():
            for bucket in self._buckets:
                if isinstance(bucket.handle, _device.DeviceWork):
                    # agreed and launched on every rank, so it ends; its buffer is this bucket
                    try:
                        bucket.handle.wait()
                    except Exception:  # noqa: BLE001 - the half step is dropped either way
                        pass
                elif bucket.handle is not None and not isinstance(bucket.handle, _LaunchFailed):
                    _api.discard(bucket.handle)
                for gathered in bucket.sparse.values():
                    for handle in getattr(gathered, "handles", ()):
                        handle._done = True
                        for h in handle._handles:
                            _api.discard(h)
            self._reset_step()

    # -- hooks
    def _on_grad(self, i):
        self._drop_stale_step()
        self._synchronized = False
        self._counts[i] += 1
        if self._counts[i] > self._bpps:
            raise RingError(
                f"parameter '{self._names[i]}' received {self._counts[i]} gradients before step(), but "
                f"backward_passes_per_step={self._bpps}; raise backward_passes_per_step, or call "
                "optimizer.step() (or synchronize()) after every backward_passes_per_step backward passes")
        if self._counts[i] == self._bpps:
            self._fired.append(i)
            bucket = self._buckets[self._bucket_of[i]]
            bucket.ready += 1
            # launch in the canonical order only: a bucket waits for those before it, so every
            # rank's queue is the same sequence and every rank's engine runs the same batches.
            # The last bucket waits for step(): no rank can finish a step (and update its
            # parameters) before every rank has called step(), so an interrupt, a rank that
            # raises or sleeps before step() leaves every rank's parameters alike.
            buckets = self._buckets
            while self._next < len(buckets) - 1 and buckets[self._next].ready == len(buckets[self._next].params):
                self._launch(buckets[self._next])
                self._next += 1

    def _launch(self, bucket):
        """Put the bucket's gradients in place and start its allreduce in the background.

        Zero copy: a gradient autograd made afresh is moved into its slot by the engine's executor
        during the reduction (``sources``), not here: backward goes on at once. On one host only
        the blocks the peers read are copied; this rank's own block is reduced from it in place.
        """
        flat = bucket.flat
        moves = []  # (element offset, fresh gradient as a flat numpy array)
        with torch.no_grad():
            for i, offset, view in zip(bucket.params, bucket.offsets, bucket.slots):
                p = self._params[i]
                grad = p.grad
                if grad is not None and grad.is_sparse:
                    if not self._sparse_as_dense:
                        bucket.sparse[i] = self._sparse_allreduce(p, i)
                        view.zero_()   # the slot carries nothing; the allgathers carry the gradient
                        continue
                    bucket.sparse[i] = None
                    grad = grad.to_dense()
                if grad is None:
                    # no gradient on this rank (unused branch): contribute zeros, as Horovod does
                    view.zero_()
                    p.grad = view if bucket.views else torch.zeros_like(p)
                elif bucket.views:
                    if grad.data_ptr() != view.data_ptr():  # autograd made it afresh: move it in
                        if bucket.device is not None:
                            view.copy_(grad)  # on the device, ordered on the current stream
                        else:
                            moves.append((offset, grad.detach().reshape(-1).numpy()))
                        if i not in bucket.sparse:
                            p.grad = view
                else:
                    compressed, bucket.contexts[i] = self._compression.compress(grad)
                    view.copy_(compressed)
        if bucket.device is not None:
            transport = _device.transport()
            try:
                # agreed over the ring now, launched on the transport's stream; waited in synchronize()
                bucket.handle = transport.allreduce_async_([flat], self._op, bucket.name, self._prescale,
                                                           self._postscale)
            except Exception as exc:  # noqa: BLE001 - raised by synchronize(), as a ring bucket's
                bucket.handle = _LaunchFailed(exc)
            return
        bucket.handle = _api.bucket_allreduce_async_(bucket.array, bucket.name, op=self._op,
                                                     prescale_factor=self._prescale, postscale_factor=self._postscale,
                                                     process_set=self._process_set, sources=moves or None)
        _api.flush(self._process_set)

    def _sparse_allreduce(self, p, i):
        """A sparse gradient without sparse_as_dense: Horovod's two allgathers (Average or Sum)."""
        if self._op not in (Average, Sum):
            raise ValueError(f"parameter '{self._names[i]}' has a sparse gradient, which op={self._op} cannot "
                             "reduce; use op=Average/Sum or sparse_as_dense=True")
        return sparse_allreduce_async(p.grad, name=self._names[i], op=self._op, process_set=self._process_set)

    # -- public
    def synchronize(self):
        """Finish the allreduce of every gradient (parameters without one get averaged zeros)."""
        if self._local_only:
            self._synchronized = True
            return
        try:
            buckets = self._buckets
            while self._next < len(buckets):
                self._launch(buckets[self._next])
                self._next += 1
            error = None
            for bucket in buckets:
                try:
                    _finish_bucket(bucket.handle)
                except CollectiveMismatchError as exc:
                    error = error or self._explain(bucket, exc)
                    continue
                except BaseException as exc:  # noqa: BLE001 - first error re-raised below
                    error = error or exc
                    continue
                try:
                    self._unpack(bucket)
                except BaseException as exc:  # noqa: BLE001 - first error re-raised below
                    error = error or exc
            if error is not None:
                raise error
            if not self._order_learned:
                self._learn_order()
        finally:
            self._reset_step()
        self._synchronized = True

    def _unpack(self, bucket):
        """Results into ``.grad`` where they are not there already (copied buckets, sparse gradients)."""
        with torch.no_grad():
            for i, out in zip(bucket.params, bucket.slots):
                p = self._params[i]
                if i in bucket.sparse:
                    continue
                if not bucket.views:
                    p.grad.copy_(self._compression.decompress(out, bucket.contexts.pop(i, None)))
            for i, gathered in bucket.sparse.items():
                p = self._params[i]
                if gathered is not None:
                    p.grad = gathered()
                    continue
                # sparse_as_dense: the reduced dense form goes back to the sparse .grad the
                # optimizer (SparseAdam) expects, as Horovod does
                out = bucket.slots[bucket.params.index(i)]
                if not bucket.views:
                    out = self._compression.decompress(out, bucket.contexts.pop(i, None))
                p.grad = out.to(p.dtype).to_sparse()

    def _explain(self, bucket, exc):
        """A bucket's mismatch names the parameter whose shape or dtype differs between ranks."""
        mine = [(self._names[i], tuple(self._params[i].shape), str(self._params[i].dtype)) for i in bucket.params]
        try:
            everyone = _ring.allgather_object(mine, name=f"{bucket.name}.explain", process_set=self._process_set)
        except RingError:
            return exc
        ranks = list(range(len(everyone))) if _api.is_global(self._process_set) else self._process_set.ranks
        for pos in range(max(len(e) for e in everyone)):
            values = {ranks[q]: e[pos] if pos < len(e) else None for q, e in enumerate(everyone)}
            if len(set(values.values())) > 1:
                parts = "; ".join(f"rank {q}: {v[0]} {v[1]} {v[2]}" if v else f"rank {q}: (none)"
                                  for q, v in values.items())
                return CollectiveMismatchError(
                    f"DistributedOptimizer: the ranks' parameters differ ({parts}); every rank must "
                    "wrap the same model (same parameter names, shapes and dtypes)")
        return exc

    def _learn_order(self):
        # Rank 0's hook order of its first step becomes everyone's bucket order, so that later
        # steps launch each bucket as soon as it is ready (overlap with the rest of backward).
        # An allreduce, not a broadcast: a rank that called join() before this step answers it
        # with zeros, as Horovod's join does for every allreduce. Rank 0's order + 1 in a Sum
        # with everyone else's zeros; all zeros (rank 0 itself joined) keeps the present order.
        root = 0 if _api.is_global(self._process_set) else self._process_set.ranks[0]
        code = np.zeros(len(self._params), np.int64)
        if _ring.rank() == root:
            code[:len(self._fired)] = np.asarray(self._fired, np.int64) + 1
        _ring.allreduce_(code, op=_ring.Sum, name="DistributedOptimizer.order", process_set=self._process_set)
        fired = [int(i) - 1 for i in code if i > 0]
        seen = set(fired)
        order = fired + [i for i in self._order if i not in seen]
        self._order_learned = True
        if order != self._order:
            # grads of the old buckets stay valid views until their next launch moves them in
            self._order = order
            self._make_buckets()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, ``step()`` does not synchronize (after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize the gradients (unless already done) and step the wrapped optimizer."""
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
        elif self._should_synchronize and not self._local_only:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                          "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                          "your code.")
        self._synchronized = False
        result = self._opt.step(closure) if closure is not None else self._opt.step()
        _report_step(self)
        return result

    def zero_grad(self, set_to_none=True):
        """Zero the gradients; an error between backward() and step(), where it would lose them."""
        self._drop_stale_step()
        waiting = sum(1 for c in self._counts if c)
        if waiting:
            raise RingError(
                f"optimizer.zero_grad() was called after loss.backward() and before optimizer.step(): "
                f"{waiting} gradients are still to be allreduced. Call zero_grad() before backward() "
                "or after step(); to drop this step's gradients call optimizer.synchronize() first")
        return self._opt.zero_grad(set_to_none=set_to_none)

    def remove_hooks(self):
        """Detach the gradient hooks (the wrapper stops allreducing); for re-wrapping in a notebook."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self._params:
            if _hook_of(p) is not None:
                del _HOOKS[id(p)]


# Each parameter's current gradient hook, so that re-wrapping (a re-run cell) replaces it. Kept
# here, not on the parameter, so that pickling a model (%ring pull model) stays possible.
# Keyed by id(): tensors compare elementwise, so they cannot be dictionary keys themselves.
_HOOKS: dict[int, object] = {}


def _hook_of(param):
    entry = _HOOKS.get(id(param))
    if entry is None or entry[0]() is not param:  # gone, or an id reused by another tensor
        _HOOKS.pop(id(param), None)
        return None
    return entry[1]


class _GradHook:
    """Queues parameter ``i``'s gradient allreduce; pickles to a no-op (a pulled model is local)."""

    __slots__ = ("optimizer", "index")

    def __init__(self, optimizer, index):
        self.optimizer = optimizer
        self.index = index

    def __call__(self, _param):
        self.optimizer._on_grad(self.index)

    def __reduce__(self):
        return (_detached_hook, ())


def _no_allreduce(_param):
    """The hook of a model unpickled away from its DistributedOptimizer: nothing to do."""


def _detached_hook():
    return _no_allreduce


# ------------------------------------------------------------------ dashboard (owner: widgets)
def _report_step(optimizer):
    """Count optimizer steps for the notebook's dashboard, unless the user reports progress.

    The optimizer advances ``ring.progress`` by one per ``step()`` as long as the reporter's step
    is the one it set last (or 0: a count restarted with ``ring.progress(0, total=N)``). A user
    who reports other steps (epochs, a global step of their own) takes over for this optimizer.
    """
    last = getattr(optimizer, "_ring_reported_step", None)
    if last is False:
        return
    step = _report.reporter.step
    if last is None or step == last or step == 0:
        _report.reporter.progress(step + 1)
        optimizer._ring_reported_step = step + 1
    else:
        optimizer._ring_reported_step = False
