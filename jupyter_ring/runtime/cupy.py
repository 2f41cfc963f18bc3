"""Horovod's collectives on CuPy arrays: NCCL where available, else staged through pinned host memory.

::

    import cupy as cp
    import jupyter_ring.runtime.cupy as ring

    ring.init()
    cp.cuda.Device(ring.local_rank()).use()
    total = ring.allreduce(cp.ones(1 << 20, cp.float32), op=ring.Sum, name="x")

Two data paths, chosen per process:

* **NCCL** (``cupy.cuda.nccl`` importable, every rank on its own GPU): the buffers never leave the
  GPU. Before every NCCL call the ranks agree over the ring runtime (kind, name, dtype, shape, op,
  root), because NCCL itself hangs on a mismatch; a mismatch raises CollectiveMismatchError on
  every rank instead. The agreement is one small CPU round trip per collective.
* **Staged**: device -> pinned host buffer -> the ring runtime -> device. Used when NCCL is missing,
  for alltoall, or when ``JUPYTER_RING_CUPY_NCCL=0``.

Without a CUDA device every collective raises :class:`RingError` naming what is missing.
"""

import os

try:
    import cupy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the cupy adapter needs cupy: pip install 'jupyter_ring[cupy]'") from exc

import numpy as np

from .. import runtime as _ring
from . import _api  # named helpers: session(), resolve_op()
from ._common import *  # noqa: F403 - init, rank, ops, errors, ...: as in the numpy API
from ._common import __all__ as _COMMON

__all__ = [
    *_COMMON, "gpu_available", "nccl_available", "allreduce", "allreduce_", "allgather",
    "broadcast", "broadcast_", "reducescatter", "alltoall",
]


def gpu_available():
    """Whether CuPy sees a CUDA device (False on CPU-only machines)."""
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        return False


def nccl_available():
    """Whether the NCCL path can be used (``cupy.cuda.nccl`` importable, a GPU, not disabled)."""
    if os.environ.get("JUPYTER_RING_CUPY_NCCL", "1") == "0" or not gpu_available():
        return False
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", True))


def _require_gpu(where):
    if not gpu_available():
        raise RingError(f"{where}: the cupy adapter needs a CUDA GPU, but cupy.cuda.is_available() is False "
                        "(no device or no driver here); run on a GPU machine, or use numpy arrays with "
                        "jupyter_ring.runtime on CPU")


def _check(arr, where):
    if not isinstance(arr, cupy.ndarray):
        raise TypeError(f"{where}: expected a cupy.ndarray, got {type(arr).__name__}; numpy arrays go to "
                        "jupyter_ring.runtime directly")
    _require_gpu(where)


# ------------------------------------------------------------------ NCCL
class _Nccl:
    """The NCCL communicator of one runtime session, made on first use."""

    def __init__(self):
        self.comm = None
        self.session = None   # the runtime object the communicator belongs to

    def get(self):
        from cupy.cuda import nccl

        session = _api.session()
        if self.comm is None or self.session is not session:
            uid = nccl.get_unique_id() if _ring.rank() == 0 else None
            uid = _ring.broadcast_object(uid, 0, name="jupyter_ring.cupy.nccl_id")
            self.comm = nccl.NcclCommunicator(_ring.size(), uid, _ring.rank())
            self.session = session
        return self.comm


_nccl = _Nccl()

_NCCL_OPS = {Sum: 0, Product: 1, Max: 2, Min: 3, Average: 0}  # ncclSum, ncclProd, ncclMax, ncclMin


def _nccl_dtype(dtype):
    from cupy.cuda import nccl

    table = {np.dtype(np.int8): nccl.NCCL_INT8, np.dtype(np.uint8): nccl.NCCL_UINT8,
             np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.uint32): nccl.NCCL_UINT32,
             np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.uint64): nccl.NCCL_UINT64,
             np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
             np.dtype(np.float64): nccl.NCCL_FLOAT64}
    return table.get(np.dtype(dtype))


def _agree(kind, name, arr, op=None, root=None, rows_may_differ=False):
    """Check over the CPU ring that every rank calls the same NCCL collective (NCCL would hang)."""
    shape = tuple(arr.shape[1:]) if rows_may_differ else tuple(arr.shape)
    mine = (kind, name, str(arr.dtype), shape, op, root)
    everyone = _ring.allgather_object(mine, name=f"jupyter_ring.cupy.{kind}.{name}")
    differ = [q for q, other in enumerate(everyone) if other != everyone[0]]
    if differ:
        labels = ("kind", "name", "dtype", "shape", "op", "root_rank")
        field = next(i for i in range(len(mine)) if any(e[i] != everyone[0][i] for e in everyone))
        values = ", ".join(f"{everyone[q][field]!r} on rank {q}" for q in range(len(everyone)))
        raise CollectiveMismatchError(f"{kind} '{name}': ranks disagree on {labels[field]}: {values}")


def _use_nccl(arr):
    return nccl_available() and _ring.size() > 1 and _nccl_dtype(arr.dtype) is not None


# ------------------------------------------------------------------ staging
def _to_host(arr):
    """A numpy view of a pinned host copy of ``arr``."""
    arr = cupy.ascontiguousarray(arr)
    mem = cupy.cuda.alloc_pinned_memory(max(arr.nbytes, 1))
    host = np.frombuffer(mem, arr.dtype, arr.size).reshape(arr.shape)
    arr.get(out=host)
    return host


# ------------------------------------------------------------------ collectives
def allreduce(arr, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce a cupy array over the ranks (default: Average) into a new cupy array."""
    where = f"allreduce '{name}'"
    _check(arr, where)
    return allreduce_(arr.copy(), average, name, op, prescale_factor, postscale_factor)


def allreduce_(arr, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """In-place allreduce of a C-contiguous cupy array; returns it."""
    where = f"allreduce_ '{name}'"
    _check(arr, where)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{where}: the in-place form needs a C-contiguous array; pass cupy.ascontiguousarray(x)")
    op = _api.resolve_op(op, average, where)
    if op == Adasum:
        raise ValueError("op=Adasum is not supported by jupyter_ring; use op=Average or op=Sum")
    if _use_nccl(arr) and (op not in (Average,) or arr.dtype.kind == "f"):
        _agree("allreduce", name, arr, op)
        if prescale_factor != 1.0:
            arr *= arr.dtype.type(prescale_factor)
        stream = cupy.cuda.get_current_stream()
        _nccl.get().allReduce(arr.data.ptr, arr.data.ptr, arr.size, _nccl_dtype(arr.dtype), _NCCL_OPS[op],
                              stream.ptr)
        scale = postscale_factor / (_ring.size() if op == Average else 1)
        if scale != 1.0:
            arr *= arr.dtype.type(scale)
        return arr
    host = _to_host(arr)
    _ring.allreduce_(host, name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    arr.set(host)
    return arr


def allgather(arr, name=None):
    """Every rank's array concatenated along dim 0 (which may differ between ranks)."""
    where = f"allgather '{name}'"
    _check(arr, where)
    if arr.ndim == 0:
        raise ValueError(f"{where}: needs an array with at least one dimension; pass x.reshape(1)")
    return cupy.asarray(_ring.allgather(_to_host(arr), name=name))


def broadcast_(arr, root_rank=0, name=None):
    """In-place broadcast of root's array into ``arr``; returns it."""
    where = f"broadcast_ '{name}'"
    _check(arr, where)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{where}: the in-place form needs a C-contiguous array")
    if _use_nccl(arr):
        _agree("broadcast", name, arr, root=root_rank)
        stream = cupy.cuda.get_current_stream()
        _nccl.get().bcast(arr.data.ptr, arr.size, _nccl_dtype(arr.dtype), root_rank, stream.ptr)
        return arr
    host = _to_host(arr)
    _ring.broadcast_(host, root_rank, name=name)
    arr.set(host)
    return arr


def broadcast(arr, root_rank=0, name=None):
    """Root's array, returned as a new cupy array on every rank."""
    _check(arr, f"broadcast '{name}'")
    return broadcast_(cupy.ascontiguousarray(arr).copy(), root_rank, name)


def reducescatter(arr, op=Average, name=None):
    """Reduce over ranks and return this rank's block of dim 0 (staged through host memory)."""
    _check(arr, f"reducescatter '{name}'")
    return cupy.asarray(_ring.reducescatter(_to_host(arr), op=op, name=name))


def alltoall(arr, splits=None, name=None):
    """Send ``splits[q]`` rows to rank q, receive theirs: (output, received_splits); staged."""
    _check(arr, f"alltoall '{name}'")
    if isinstance(splits, cupy.ndarray):
        splits = splits.get()
    out, received = _ring.alltoall(_to_host(arr), splits, name=name)
    return cupy.asarray(out), np.asarray(received)
