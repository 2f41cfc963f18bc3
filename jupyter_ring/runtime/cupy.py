"""Horovod's collectives on CuPy arrays: NCCL where available, else staged through pinned host memory.

::

    import cupy as cp
    import jupyter_ring.runtime.cupy as ring

    ring.init()
    cp.cuda.Device(ring.local_rank()).use()
    total = ring.allreduce(cp.ones(1 << 20, cp.float32), op=ring.Sum, name="x")

Data paths, chosen per process:

* **The device transport** (torch installed): the array is handed to torch without a copy
  (DLPack) and reduced by :mod:`jupyter_ring.runtime._device.transport` over NCCL, the same transport as
  torch CUDA tensors (agreement over the ring, completion polled, abort and rebuild; one NCCL
  communicator shared with torch.distributed).
* **cupy's NCCL** (no torch, ``cupy.cuda.nccl`` importable, every rank on its own GPU): the buffers
  never leave the GPU either. Before every NCCL call the ranks agree over the ring runtime (kind,
  name, dtype, shape, op, root, the communicator's generation), because NCCL itself hangs on a
  mismatch; a mismatch raises CollectiveMismatchError on every rank instead. Completion is polled
  through a CUDA event, so SIGINT and the stall timeout work; a collective given up aborts the
  communicator and every rank makes a new one at the next agreement.
* **Staged**: device -> pinned host buffer -> the ring runtime -> device. Used when NCCL is missing,
  for alltoall and reducescatter, for a ``process_set`` other than the global one (as the torch
  adapter does), or when ``JUPYTER_RING_CUPY_NCCL=0``.

Every collective takes Horovod's ``process_set=`` (a rank outside the set gets a clear error).

Without a CUDA device every collective raises :class:`RingError` naming what is missing.
"""

import os
import time
from typing import TYPE_CHECKING, Any

try:
    import cupy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the cupy adapter needs cupy: pip install 'jupyter_ring[cupy]'") from exc

import numpy as np
import numpy.typing as npt

from .. import runtime as _ring
from . import _api  # named helpers: session(), resolve_op()
from ._device import transport as _device
from ._horovod.runtime_names import *  # noqa: F403 - init, rank, ops, errors, ...: as in the numpy API
from ._horovod.runtime_names import __all__ as _COMMON

if TYPE_CHECKING:
    import torch

__all__ = [
    *_COMMON, "gpu_available", "nccl_available", "allreduce", "allreduce_", "allgather",
    "broadcast", "broadcast_", "reducescatter", "alltoall",
]


def gpu_available() -> bool:
    """Whether CuPy sees a CUDA device (False on CPU-only machines)."""
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        return False


def nccl_available() -> bool:
    """Whether the NCCL path can be used (``cupy.cuda.nccl`` importable, a GPU, not disabled)."""
    if os.environ.get("JUPYTER_RING_CUPY_NCCL", "1") == "0" or not gpu_available():
        return False
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", True))


def _require_gpu(where: str) -> None:
    if not gpu_available():
        raise RingError(f"{where}: the cupy adapter needs a CUDA GPU, but cupy.cuda.is_available() is False "
                        "(no device or no driver here); run on a GPU machine, or use numpy arrays with "
                        "jupyter_ring.runtime on CPU")


def _check(arr: object, where: str) -> None:
    if not isinstance(arr, cupy.ndarray):
        raise TypeError(f"{where}: expected a cupy.ndarray, got {type(arr).__name__}; numpy arrays go to "
                        "jupyter_ring.runtime directly")
    _require_gpu(where)


# ------------------------------------------------------------------ NCCL
class _Nccl:
    """The NCCL communicator of one runtime session, made on first use, re-made after an abort."""

    def __init__(self) -> None:
        self.comm: Any = None  # cupy.cuda.nccl.NcclCommunicator (cupy ships no types)
        self.session: object = None  # the runtime object the communicator belongs to
        self.generation = 0   # communicators made so far: the same on every rank
        self.aborted = ""     # why this rank gave a collective up; every rank re-makes it then

    def get(self) -> Any:
        """The communicator (collective when it has to be made: the agreement lines ranks up)."""
        from cupy.cuda import nccl

        session = _api.session()
        if self.comm is None or self.session is not session:
            uid = nccl.get_unique_id() if _ring.rank() == 0 else None
            uid = _ring.broadcast_object(uid, 0, name="jupyter_ring.cupy.nccl_id")
            self.comm = nccl.NcclCommunicator(_ring.size(), uid, _ring.rank())
            self.session = session
            self.generation += 1
            self.aborted = ""
        return self.comm

    def abort(self, why: str) -> None:
        """Give up the collective in flight: ncclCommAbort, and a new communicator next time."""
        if self.comm is not None:
            try:
                self.comm.abort()
            except Exception:  # noqa: BLE001 - already broken; a new one is made either way
                pass
        self.comm = None
        self.aborted = why

    def wait(self, stream: Any, what: str) -> None:  # stream: a cupy.cuda.Stream
        """Poll the end of ``stream``'s work (a CUDA event): interruptible, with the stall timeout."""
        event = stream.record()
        config = _ring.config()
        start = time.perf_counter()
        delay = 1e-5
        try:
            while not event.done:
                waited = time.perf_counter() - start
                if waited > config.stall_timeout:
                    raise StallError(f"{what}: rank {_ring.rank()} waited {waited:.1f} s for NCCL after every rank "
                                     f"had agreed to it (stall timeout {config.stall_timeout:g} s): a rank died or "
                                     "hangs; the communicator is re-made before the next collective.", ())
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
        except BaseException as exc:
            self.abort(f"{what}: {type(exc).__name__}")
            raise


_nccl = _Nccl()

_NCCL_OPS = {Sum: 0, Product: 1, Max: 2, Min: 3, Average: 0}  # ncclSum, ncclProd, ncclMax, ncclMin


def _nccl_dtype(dtype: npt.DTypeLike) -> int | None:
    from cupy.cuda import nccl

    table = {np.dtype(np.int8): nccl.NCCL_INT8, np.dtype(np.uint8): nccl.NCCL_UINT8,
             np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.uint32): nccl.NCCL_UINT32,
             np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.uint64): nccl.NCCL_UINT64,
             np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
             np.dtype(np.float64): nccl.NCCL_FLOAT64}
    found: int | None = table.get(np.dtype(dtype))
    return found


def _agree(kind: str, name: str | None, arr: cupy.ndarray, op: int | None = None, root: int | None = None,
           rows_may_differ: bool = False) -> None:
    """Check over the CPU ring that every rank calls the same NCCL collective (NCCL would hang);
    re-make the communicator on every rank when one rank gave a collective up."""
    shape = tuple(arr.shape[1:]) if rows_may_differ else tuple(arr.shape)
    mine = (kind, name, str(arr.dtype), shape, op, root, _nccl.generation)
    everyone = _ring.allgather_object((mine, _nccl.aborted), name="jupyter_ring.cupy.agree")
    described = [e[0] for e in everyone]
    differ = [q for q, other in enumerate(described) if other != described[0]]
    if differ:
        labels = ("kind", "name", "dtype", "shape", "op", "root_rank", "communicator generation")
        field = next(i for i in range(len(mine)) if any(e[i] != described[0][i] for e in described))
        values = ", ".join(f"{described[q][field]!r} on rank {q}" for q in range(len(described)))
        raise CollectiveMismatchError(f"{kind} '{name}': ranks disagree on {labels[field]}: {values}")
    if any(aborted for _, aborted in everyone) and _nccl.comm is not None:
        _nccl.abort("a peer rank gave a collective up")


def _use_nccl(arr: cupy.ndarray, process_set: ProcessSet) -> bool:
    return (nccl_available() and _ring.size() > 1 and _nccl_dtype(arr.dtype) is not None
            and _api.is_global(process_set))


def _tensor(arr: cupy.ndarray, process_set: ProcessSet, op: int | None = None) -> "torch.Tensor | None":
    """A torch view of ``arr`` (DLPack, no copy) when it goes to the device transport, else None."""
    if not nccl_available() or _device.mode() == "off" or not _api.is_global(process_set):
        return None
    try:
        import torch
    except ImportError:
        return None
    if not _device._nccl_available():
        return None
    tensor = torch.from_dlpack(arr)
    ok = _device.copies(tensor.dtype) if op is None else _device.supports(tensor.dtype, op)
    return tensor if ok else None


# ------------------------------------------------------------------ staging
def _to_host(arr: cupy.ndarray) -> npt.NDArray[Any]:
    """A numpy view of a pinned host copy of ``arr``."""
    arr = cupy.ascontiguousarray(arr)
    mem = cupy.cuda.alloc_pinned_memory(max(arr.nbytes, 1))
    host: npt.NDArray[Any] = np.frombuffer(mem, arr.dtype, arr.size).reshape(arr.shape)
    arr.get(out=host)
    return host


# ------------------------------------------------------------------ collectives
def allreduce(arr: cupy.ndarray, average: bool | None = None, name: str | None = None, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Reduce a cupy array over the ranks (default: Average) into a new cupy array."""
    where = f"allreduce '{name}'"
    _check(arr, where)
    return allreduce_(arr.copy(), average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(arr: cupy.ndarray, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """In-place allreduce of a C-contiguous cupy array; returns it."""
    where = f"allreduce_ '{name}'"
    _check(arr, where)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{where}: the in-place form needs a C-contiguous array; pass cupy.ascontiguousarray(x)")
    op = _api.resolve_op(op, average, where)
    if op == Adasum:
        raise ValueError("op=Adasum is not supported by jupyter_ring; use op=Average or op=Sum")
    tensor = _tensor(arr, process_set, op)
    if tensor is not None:
        transport = _device.transport()
        transport.allreduce_([tensor], op, transport.auto_name("allreduce", name), prescale_factor,
                             postscale_factor)
        return arr
    if _use_nccl(arr, process_set) and (op not in (Average,) or arr.dtype.kind == "f"):
        _agree("allreduce", name, arr, op)
        if prescale_factor != 1.0:
            arr *= arr.dtype.type(prescale_factor)
        stream = cupy.cuda.get_current_stream()
        _nccl.get().allReduce(arr.data.ptr, arr.data.ptr, arr.size, _nccl_dtype(arr.dtype), _NCCL_OPS[op],
                              stream.ptr)
        _nccl.wait(stream, where)
        scale = postscale_factor / (_ring.size() if op == Average else 1)
        if scale != 1.0:
            arr *= arr.dtype.type(scale)
        return arr
    host = _to_host(arr)
    _ring.allreduce_(host, name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                     process_set=process_set)
    arr.set(host)
    return arr


def allgather(arr: cupy.ndarray, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Every rank's array concatenated along dim 0 (which may differ between ranks)."""
    where = f"allgather '{name}'"
    _check(arr, where)
    if arr.ndim == 0:
        raise ValueError(f"{where}: needs an array with at least one dimension; pass x.reshape(1)")
    tensor = _tensor(arr, process_set)
    if tensor is not None:
        transport = _device.transport()
        return cupy.from_dlpack(transport.allgather(tensor, transport.auto_name("allgather", name)))
    return cupy.asarray(_ring.allgather(_to_host(arr), name=name, process_set=process_set))


def broadcast_(arr: cupy.ndarray, root_rank: int = 0, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """In-place broadcast of root's array into ``arr``; returns it."""
    where = f"broadcast_ '{name}'"
    _check(arr, where)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{where}: the in-place form needs a C-contiguous array")
    tensor = _tensor(arr, process_set)
    if tensor is not None:
        transport = _device.transport()
        transport.broadcast_(tensor, root_rank, transport.auto_name("broadcast", name))
        return arr
    if _use_nccl(arr, process_set):
        _agree("broadcast", name, arr, root=root_rank)
        stream = cupy.cuda.get_current_stream()
        _nccl.get().bcast(arr.data.ptr, arr.size, _nccl_dtype(arr.dtype), root_rank, stream.ptr)
        _nccl.wait(stream, where)
        return arr
    host = _to_host(arr)
    _ring.broadcast_(host, root_rank, name=name, process_set=process_set)
    arr.set(host)
    return arr


def broadcast(arr: cupy.ndarray, root_rank: int = 0, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Root's array, returned as a new cupy array on every rank."""
    _check(arr, f"broadcast '{name}'")
    return broadcast_(cupy.ascontiguousarray(arr).copy(), root_rank, name, process_set)


def reducescatter(arr: cupy.ndarray, op: int = Average, name: str | None = None,
                  process_set: ProcessSet = global_process_set) -> cupy.ndarray:
    """Reduce over ranks and return this rank's block of dim 0 (staged through host memory)."""
    _check(arr, f"reducescatter '{name}'")
    return cupy.asarray(_ring.reducescatter(_to_host(arr), op=op, name=name, process_set=process_set))


def alltoall(arr: cupy.ndarray, splits: "npt.ArrayLike | cupy.ndarray | None" = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> tuple[cupy.ndarray, npt.NDArray[np.int32]]:
    """Send ``splits[q]`` rows to rank q of the set, receive theirs: (output, received_splits); staged."""
    _check(arr, f"alltoall '{name}'")
    if isinstance(splits, cupy.ndarray):
        splits = splits.get()
    out, received = _ring.alltoall(_to_host(arr), splits, name=name, process_set=process_set)
    return cupy.asarray(out), np.asarray(received)
