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

The package is split as Horovod's ``horovod/torch/``: ``compression``, ``mpi_ops`` (the
collectives, handles, ``poll``/``synchronize``), ``_buckets`` (the optimizer's gradient buckets:
layout, launch, results), ``optimizer`` (``DistributedOptimizer``),
``functions`` (state made equal on every rank), ``sync_batch_norm``, ``elastic``. Each module
imports only modules before it in that list and the runtime's ``_horovod``, ``_device``,
``_engine``, ``_observe`` and ``_api`` below them; never this ``__init__``, which only gathers
the names.
"""

try:
    import torch  # noqa: F401 - the adapter's one requirement, checked before any module needs it
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the torch adapter needs torch: pip install 'jupyter_ring[torch]'") from exc

from .._horovod.runtime_names import *  # noqa: F403 - init, rank, ops, errors, ...: as in the numpy API
from .._horovod.runtime_names import __all__ as _COMMON
from .._horovod.basics import *  # noqa: F403 - capability functions, process sets, timeline, join
from .._horovod.basics import __all__ as _HOROVOD
from .compression import Compression, FP16Compressor, NoneCompressor
from .mpi_ops import (Handle, allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_,
                      alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                      cuda_built, grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                      grouped_reducescatter_async, nccl_built, poll, reducescatter, reducescatter_async,
                      sparse_allreduce_async, synchronize)
from .optimizer import DistributedOptimizer
from .optimizer import _detached_hook  # noqa: F401 - named by pickles of hooked models made before the split
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .sync_batch_norm import SyncBatchNorm
from . import elastic  # Horovod's elastic API for a fixed world

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
