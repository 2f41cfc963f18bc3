"""Horovod's module-level names that every framework adapter shares (torch, tensorflow, keras).

Capability questions answered truthfully for this runtime (MPI through mpi4py, no Gloo, no NCCL
for framework tensors, no CCL/DDL, no CUDA/ROCm kernels), the Horovod-format timeline, ``join``
and ``HorovodInternalError``. Process sets are the runtime's own (``jupyter_ring.runtime``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ... import runtime as _ring
from .. import _api
from .._api import ProcessSet, Ranks
from .._engine.core import Average, Sum
from .._engine.errors import HorovodInternalError

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = [
    "init", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "mpi_threads_supported", "is_homogeneous",
    "start_timeline", "stop_timeline", "join", "HorovodInternalError",
]


def init(comm: MPI.Comm | None = None, process_sets: Iterable[ProcessSet | Ranks] | None = None,
         **config: Any) -> None:
    """Start the runtime on every rank (``comm``: an mpi4py communicator) and register ``process_sets``."""
    _ring.init(comm, process_sets=process_sets, **config)


def mpi_built() -> bool:
    """True: the runtime moves data over MPI (mpi4py)."""
    return True


def mpi_enabled() -> bool:
    """True once initialised: every collective runs over MPI."""
    return _ring.is_initialized()


def gloo_built() -> bool:
    """False: there is no Gloo controller (torch.distributed's gloo is yours to use alongside)."""
    return False


def gloo_enabled() -> bool:
    """False: see gloo_built."""
    return False


def nccl_built() -> bool:
    """False: framework tensors on a GPU are staged through host memory, not reduced by NCCL."""
    return False


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: Intel oneCCL is not supported."""
    return False


def cuda_built() -> bool:
    """False: no CUDA kernels; GPU tensors are staged through host memory."""
    return False


def rocm_built() -> bool:
    """False: no ROCm kernels."""
    return False


def mpi_threads_supported() -> bool:
    """Whether MPI was initialised with MPI_THREAD_MULTIPLE."""
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    hosts = _api.running_runtime().hosts
    return len({hosts.count(h) for h in set(hosts)}) == 1


class _Timeline:
    """The file ``start_timeline`` named and when it started (one per process)."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.since = 0.0
        self.mark_cycles = False


_timeline = _Timeline()


def start_timeline(file_path: str | os.PathLike[str], mark_cycles: bool = False) -> None:
    """Start recording collectives for a Horovod-format timeline written by ``stop_timeline``.

    Every rank calls it. ``mark_cycles`` adds a CYCLE_START mark where each collective begins
    (the engine's rounds are not marked: a collective is its own cycle here).
    """
    if not isinstance(file_path, (str, os.PathLike)):
        raise TypeError(f"start_timeline: file_path must be a path, got {type(file_path).__name__}")
    _api.running_runtime()
    _timeline.path = os.fspath(file_path)
    _timeline.since = time.perf_counter()
    _timeline.mark_cycles = bool(mark_cycles)


def stop_timeline() -> None:
    """Write the collectives since ``start_timeline`` to its file (rank 0 writes; every rank calls).

    Horovod's format: one row per tensor (``allreduce.<name>``), NEGOTIATE_<KIND> and <KIND>
    spans, ``start_time_since_epoch_in_micros`` in the metadata; opens in chrome://tracing or
    Perfetto.
    """
    rt = _api.running_runtime()
    path, since, marks = _timeline.path, _timeline.since, _timeline.mark_cycles
    _timeline.path = None
    records = [rec for rec in rt.trace.records if rec[3] >= since] if path is not None else []
    gathered = _ring.allgather_object((rt.rank, records), name="jupyter_ring.stop_timeline")
    if path is None or rt.rank != 0:
        return
    anchor = rt.trace.anchor
    events: list[dict[str, Any]] = []   # Chrome trace events
    rows: dict[str, int] = {}            # row name -> its pid
    start_us = (anchor + since) * 1e6
    events.append({"name": "process_name", "ph": "M", "pid": 0,
                   "args": {"name": "jupyter_ring", "start_time_since_epoch_in_micros": int(start_us)}})
    for rank, rank_records in gathered:
        for kind, name, nbytes, start, end, phases, _algorithm in rank_records:
            row = f"{kind}.{name}"
            pid = rows.get(row)
            if pid is None:
                pid = rows[row] = len(rows) + 1
                events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": row}})
            negotiate = phases.get("negotiate", (start, start))
            if marks:
                events.append({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": pid, "tid": rank,
                               "ts": (anchor + start) * 1e6 - start_us})
            events.append({"name": f"NEGOTIATE_{kind.upper()}", "ph": "X", "pid": pid, "tid": rank,
                           "ts": (anchor + negotiate[0]) * 1e6 - start_us,
                           "dur": max(0.0, negotiate[1] - negotiate[0]) * 1e6})
            events.append({"name": kind.upper(), "ph": "X", "pid": pid, "tid": rank,
                           "ts": (anchor + negotiate[1]) * 1e6 - start_us,
                           "dur": max(0.0, end - negotiate[1]) * 1e6, "args": {"bytes": nbytes}})
    tmp = f"{path}.tmp{os.getpid()}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        json.dump(events, fh)
    os.replace(tmp, path)


def join(device: int = -1) -> int:
    """This rank is out of data: it takes part in the other ranks' allreduces with zeros until
    every rank has called ``join``; returns the rank that joined last (the runtime's join).

    ``device`` is accepted for Horovod's signature and not used. While a rank is joined, the
    other ranks' allreduces of CUDA tensors (the device transport's) go through the ring with its
    zeros, staged through host memory; other device collectives raise, as the ring's do.
    """
    return _ring.join()


# ------------------------------------------------------------------ numpy helpers for the adapters
class HorovodScaling(NamedTuple):
    """How Horovod's scaling of one numpy reduction is split between the adapter and the runtime.

    Not the engine's ``_engine.collectives.ReducePlan`` (the checked op, reducer and factors the
    runtime caches per dtype): this says what the adapter hands the runtime and how it finishes
    the result. torch's adapter does the same for tensors in ``torch/mpi_ops._Reduce``.
    """

    staged: npt.NDArray[Any]  # what the runtime reduces
    op: int                   # the runtime's op
    pre: float                # the runtime's prescale_factor
    post: float               # the runtime's postscale_factor
    finish: Callable[[npt.NDArray[Any]], npt.NDArray[Any]]  # runtime result -> the caller's result


def _same(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    return arr


def horovod_scaling(arr: npt.NDArray[Any], op: int, pre: float, post: float, n: int,
                    scale_in_numpy: bool = False) -> HorovodScaling:
    """Horovod's scaling, split around the runtime.

    Integer arrays with a scale factor or op=Average are scaled in float64 and truncated toward
    zero, float16 ones in float32, before and after a plain sum (Average is a postscale by
    1/n), as Horovod does on CPU.
    ``scale_in_numpy``: the runtime call takes no factors (reducescatter): apply them here.
    """
    pre, post = float(pre), float(post)
    wide = np.float64 if arr.dtype.kind in "iu" else np.float32 if arr.dtype == np.float16 else None
    if wide is not None and (pre != 1.0 or post != 1.0 or op == Average):
        staged = (arr.astype(wide) * pre).astype(arr.dtype) if pre != 1.0 else arr
        after = post / n if op == Average else post
        finish = (lambda res: (res.astype(wide) * after).astype(res.dtype)) if after != 1.0 else _same
        return HorovodScaling(staged, Sum if op == Average else op, 1.0, 1.0, finish)
    if scale_in_numpy and (pre != 1.0 or post != 1.0):
        staged = (arr * pre).astype(arr.dtype) if pre != 1.0 else arr
        finish = (lambda res: (res * post).astype(res.dtype)) if post != 1.0 else _same
        return HorovodScaling(staged, op, 1.0, 1.0, finish)
    return HorovodScaling(arr, op, pre, post, _same)


def _adasum_pair(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Horovod's Adasum of two vectors (float64): (1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b."""
    dot, anormsq, bnormsq = float(a @ b), float(a @ a), float(b @ b)
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= tiny else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= tiny else 1.0
    return acoeff * a + bcoeff * b


def adasum_combine(rows: Iterable[npt.ArrayLike]) -> npt.NDArray[np.float64]:
    """Adasum of every rank's flat vector (``rows[r]``), in Horovod's pairing: ranks (0,1), (2,3)
    ... first, then neighbouring results, each dot product over the whole tensor (its layer).
    The number of rows must be a power of 2."""
    level = [np.asarray(v, np.float64).reshape(-1) for v in rows]
    while len(level) > 1:
        level = [_adasum_pair(a, b) for a, b in zip(level[0::2], level[1::2])]
    return level[0]
