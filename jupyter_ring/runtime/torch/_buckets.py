"""The DistributedOptimizer's gradient buckets: how its parameters are cut into buckets, how one
bucket's gradients go in and its allreduce starts, and how the results come back.

``optimizer.py`` keeps the step's bookkeeping (hooks, the canonical order, counts, the stale step
of an interrupted cell); everything here works on buckets, with the options every bucket of one
optimizer shares (``Reduction``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from ... import runtime as _ring
from .. import _api
from .._device import transport as _device
from .._engine.errors import CollectiveMismatchError, RingError
from .._horovod.runtime_names import Average, ProcessSet, Sum
from .compression import Compressor, NoneCompressor
from .mpi_ops import _NUMPY_DTYPES, SparseReduction, sparse_allreduce_async

# Gradient buckets of about this many bytes. Measured on 2 CPU ranks (docs/benchmarks.md): small
# enough that the first buckets of a 10M-parameter MLP are reduced while backward still computes
# the early layers, large enough that each bucket's fixed cost (one engine round, three
# shared-memory syncs) stays small against its copies.
BUCKET_BYTES = 8 << 20


class Reduction(NamedTuple):
    """How one optimizer's gradients are reduced: what every bucket of it shares."""

    compression: Compressor
    op: int
    prescale: float
    postscale: float
    process_set: ProcessSet
    sparse_as_dense: bool


class Bucket:
    """Consecutive gradients (in backward order) reduced by one in-place allreduce of ``flat``.

    Zero copy (``views`` is True): ``flat`` lives in the transport's memory (``bucket_buffer``)
    and each parameter's ``.grad`` is a view of it, so backward accumulates into the bucket and
    the optimizer reads the result where the allreduce wrote it. Otherwise (compression, dtypes
    numpy lacks, a process set with CUDA tensors) gradients are copied in and the results copied
    back.

    A device bucket (``device`` is the parameters' torch device: CUDA tensors with NCCL, or CPU
    tensors with ``JUPYTER_RING_DEVICE_TRANSPORT=gloo``) lives on that device and goes to the
    device transport: ``.grad`` views of it as well, never staged through the host; ``handle``
    is then a ``DeviceWork`` (or a ``LaunchFailed`` holding the launch's error).

    A sparse gradient (``nn.Embedding(sparse=True)``) keeps its slot in ``flat``: with
    ``sparse_as_dense`` its dense form travels there; otherwise the slot carries zeros and the
    gradient goes by Horovod's two allgathers (``sparse``: parameter index -> that wait, or None).
    """

    __slots__ = ("index", "params", "offsets", "flat", "slots", "array", "views", "device", "ready", "handle",
                 "name", "contexts", "sparse")

    def __init__(self, index: int, params: list[int], offsets: list[int], flat: torch.Tensor,
                 array: npt.NDArray[Any] | None, views: bool, device: torch.device | None,
                 shapes: list[torch.Size]) -> None:
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
        self.handle: BucketHandle | None = None
        self.name = f"DistributedOptimizer.bucket{index}"
        self.contexts: dict[int, Any] = {}   # parameter index -> the compressor's context (copied buckets)
        # parameter index -> sparse_allreduce_async's wait, or None (as dense)
        self.sparse: dict[int, SparseReduction | None] = {}


class LaunchFailed:
    """A device bucket whose launch raised (a mismatch, a peer's bad arguments): ``wait()``
    raises it at ``synchronize()``, where a ring bucket's error surfaces too."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def wait(self) -> NoReturn:
        raise self.error


# a bucket's allreduce in flight: a runtime handle (the ring), or the device transport's work
BucketHandle: TypeAlias = "int | _device.DeviceWork[Sequence[torch.Tensor]] | LaunchFailed"

# what a bucket holds: (wire dtype, zero copy, the device of a device-transport bucket)
BucketKey: TypeAlias = "tuple[torch.dtype, bool, torch.device | None]"


def finish_bucket(handle: BucketHandle | None) -> None:
    """Wait for a bucket's allreduce, ring or device."""
    if isinstance(handle, (_device.DeviceWork, LaunchFailed)):
        handle.wait()
    else:
        assert handle is not None  # (synchronize() launches every bucket before it finishes them)
        _ring.synchronize(handle)


def abandon(bucket: Bucket) -> None:
    """Drop a bucket's allreduce whose step was abandoned (a cell failed or was interrupted
    between backward() and step(): the runtime dropped its queued work on every rank)."""
    if isinstance(bucket.handle, _device.DeviceWork):
        # agreed and launched on every rank, so it ends; its buffer is this bucket
        try:
            bucket.handle.wait()
        except Exception:  # noqa: BLE001 - the half step is dropped either way
            pass
    elif bucket.handle is not None and not isinstance(bucket.handle, LaunchFailed):
        _api.discard(bucket.handle)
    for gathered in bucket.sparse.values():
        for handle in gathered.handles if gathered is not None else ():
            handle._done = True
            for h in handle._handles:
                _api.discard(h)


# ------------------------------------------------------------------ layout
def wire_dtype(p: torch.Tensor, reduction: Reduction) -> torch.dtype:
    """The dtype a parameter's gradient travels in (compression decides; bfloat16 as float32
    through the ring, which reduces numpy arrays)."""
    probe = torch.empty(0, dtype=p.dtype, device="cpu")
    dtype = reduction.compression.compress(probe)[0].dtype
    if on_device(p, dtype, reduction):
        return dtype
    return torch.float32 if dtype == torch.bfloat16 else dtype


def on_device(p: torch.Tensor, dtype: torch.dtype, reduction: Reduction) -> bool:
    """Whether ``p``'s gradient goes to the device transport (NCCL for CUDA), in a bucket on
    its device: the same rule as ``allreduce`` of a tensor (global set, a floating dtype the
    transport reduces with this op)."""
    return (_api.is_global(reduction.process_set) and dtype.is_floating_point and _device.routes(p)
            and _device.supports(dtype, reduction.op))


def zero_copy(p: torch.Tensor, dtype: torch.dtype, reduction: Reduction) -> bool:
    """Whether ``p``'s gradient can be a view of a ring bucket in the transport's memory."""
    return (reduction.compression is NoneCompressor and p.device.type == "cpu" and dtype == p.dtype
            and dtype in _NUMPY_DTYPES)


def bucket_groups(params: Sequence[torch.Tensor], order: Sequence[int], reduction: Reduction,
                  bucket_bytes: int) -> list[tuple[list[int], BucketKey]]:
    """``order`` cut into runs of about ``bucket_bytes`` of one wire dtype (and device) each."""
    groups: list[tuple[list[int], BucketKey]] = []
    current: list[int] = []
    current_bytes = 0
    current_key: BucketKey = (torch.float32, False, None)  # (set with the first parameter)
    for i in order:
        p = params[i]
        dtype = wire_dtype(p, reduction)
        device = p.device if on_device(p, dtype, reduction) else None
        views = ((reduction.compression is NoneCompressor and dtype == p.dtype) if device
                 else zero_copy(p, dtype, reduction))
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
        if current_bytes >= bucket_bytes:
            groups.append((current, current_key))
            current, current_bytes = [], 0
    if current:
        groups.append((current, current_key))
    return groups


def new_bucket(index: int, members: list[int], key: BucketKey, params: Sequence[torch.Tensor],
               process_set: ProcessSet) -> Bucket:
    """The bucket of ``members`` (parameter indices), its memory on the device, in the
    transport's shared memory (zero copy) or in ordinary memory."""
    dtype, views, device = key
    offsets, total = [], 0
    for i in members:
        offsets.append(total)
        total += params[i].numel()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    array: npt.NDArray[Any] | None
    if device is not None:
        flat, array = torch.zeros(total, dtype=dtype, device=device), None
    else:
        if not total:  # only empty parameters
            flat = torch.empty(0, dtype=dtype)
        else:
            raw = (_api.bucket_buffer(total * itemsize, process_set) if views
                   else np.zeros(total * itemsize, np.uint8))
            flat = torch.from_numpy(raw).view(dtype)
        array = flat.numpy()
    return Bucket(index, members, offsets, flat, array, views, device, [params[i].shape for i in members])


# ------------------------------------------------------------------ one bucket's step
def launch(bucket: Bucket, params: Sequence[torch.Tensor], names: Sequence[str], reduction: Reduction) -> None:
    """Put the bucket's gradients in place and start its allreduce in the background.

    Zero copy: a gradient autograd made afresh is moved into its slot by the engine's executor
    during the reduction (``sources``), not here: backward goes on at once. On one host only
    the blocks the peers read are copied; this rank's own block is reduced from it in place.
    """
    moves = _fill(bucket, params, names, reduction)
    if bucket.device is not None:
        transport = _device.transport()
        try:
            # agreed over the ring now, launched on the transport's stream; waited in synchronize()
            bucket.handle = transport.allreduce_async_([bucket.flat], reduction.op, bucket.name, reduction.prescale,
                                                       reduction.postscale)
        except Exception as exc:  # noqa: BLE001 - raised by synchronize(), as a ring bucket's
            bucket.handle = LaunchFailed(exc)
        return
    assert bucket.array is not None  # (a ring bucket's memory: device buckets returned above)
    bucket.handle = _api.bucket_allreduce_async_(bucket.array, bucket.name, op=reduction.op,
                                                 prescale_factor=reduction.prescale,
                                                 postscale_factor=reduction.postscale,
                                                 process_set=reduction.process_set, sources=moves or None)
    _api.flush(reduction.process_set)


def _fill(bucket: Bucket, params: Sequence[torch.Tensor], names: Sequence[str],
          reduction: Reduction) -> list[tuple[int, npt.NDArray[Any]]]:
    """Each gradient into its slot (or zeros, or Horovod's allgathers for a sparse one); the
    fresh gradients of a zero-copy ring bucket the engine moves in: (element offset, flat array)."""
    moves = []
    with torch.no_grad():
        for i, offset, view in zip(bucket.params, bucket.offsets, bucket.slots):
            p = params[i]
            grad = p.grad
            if grad is not None and grad.is_sparse:
                if not reduction.sparse_as_dense:
                    bucket.sparse[i] = _sparse_allreduce(grad, names[i], reduction)
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
                compressed, bucket.contexts[i] = reduction.compression.compress(grad)
                view.copy_(compressed)
    return moves


def _sparse_allreduce(grad: torch.Tensor, name: str, reduction: Reduction) -> SparseReduction:
    """A sparse gradient without sparse_as_dense: Horovod's two allgathers (Average or Sum)."""
    if reduction.op not in (Average, Sum):
        raise ValueError(f"parameter '{name}' has a sparse gradient, which op={reduction.op} cannot "
                         "reduce; use op=Average/Sum or sparse_as_dense=True")
    return sparse_allreduce_async(grad, name=name, op=reduction.op, process_set=reduction.process_set)


def unpack(bucket: Bucket, params: Sequence[torch.Tensor], compression: Compressor) -> None:
    """Results into ``.grad`` where they are not there already (copied buckets, sparse gradients)."""
    with torch.no_grad():
        for i, out in zip(bucket.params, bucket.slots):
            p = params[i]
            if i in bucket.sparse:
                continue
            if not bucket.views:
                assert p.grad is not None  # (launch gave every parameter of a copied bucket one)
                p.grad.copy_(compression.decompress(out, bucket.contexts.pop(i, None)))
        for i, gathered in bucket.sparse.items():
            p = params[i]
            if gathered is not None:
                p.grad = gathered()
                continue
            # sparse_as_dense: the reduced dense form goes back to the sparse .grad the
            # optimizer (SparseAdam) expects, as Horovod does
            out = bucket.slots[bucket.params.index(i)]
            if not bucket.views:
                out = compression.decompress(out, bucket.contexts.pop(i, None))
            p.grad = out.to(p.dtype).to_sparse()


def explain(bucket: Bucket, exc: CollectiveMismatchError, params: Sequence[torch.Tensor], names: Sequence[str],
            process_set: ProcessSet) -> BaseException:
    """A bucket's mismatch names the parameter whose shape or dtype differs between ranks."""
    mine = [(names[i], tuple(params[i].shape), str(params[i].dtype)) for i in bucket.params]
    try:
        everyone = _ring.allgather_object(mine, name=f"{bucket.name}.explain", process_set=process_set)
    except RingError:
        return exc
    ranks = list(range(len(everyone))) if _api.is_global(process_set) else set_ranks(process_set)
    for pos in range(max(len(e) for e in everyone)):
        values = {ranks[q]: e[pos] if pos < len(e) else None for q, e in enumerate(everyone)}
        if len(set(values.values())) > 1:
            parts = "; ".join(f"rank {q}: {v[0]} {v[1]} {v[2]}" if v else f"rank {q}: (none)"
                              for q, v in values.items())
            return CollectiveMismatchError(
                f"DistributedOptimizer: the ranks' parameters differ ({parts}); every rank must "
                "wrap the same model (same parameter names, shapes and dtypes)")
    return exc


def set_ranks(process_set: ProcessSet) -> list[int]:
    """A registered process set's ranks."""
    ranks = process_set.ranks
    assert ranks is not None  # (a registered set has its ranks)
    return ranks
