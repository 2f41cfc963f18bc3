"""jupyter_ring's ring-allreduce runtime: Horovod's API for numpy arrays over MPI.

Runs on every rank, in an ipyparallel engine or under a plain ``mpiexec -n 4 python train.py``::

    import numpy as np
    import jupyter_ring.runtime as ring

    ring.init()
    grad = ring.allreduce(np.ones(10, np.float32) * ring.rank(), op=ring.Sum, name="grad")

Framework adapters with the same names live in ``jupyter_ring.runtime.torch``,
``jupyter_ring.runtime.tensorflow``, ``jupyter_ring.runtime.keras`` and ``jupyter_ring.runtime.cupy``.
This package never imports IPython, ipyparallel or ipywidgets, and imports MPI only in ``init()``.
"""

from ._api import (
    ProcessSet,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_object,
    config,
    cross_rank,
    cross_size,
    global_process_set,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    init,
    join,
    is_initialized,
    local_rank,
    local_size,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    reset_stats,
    shutdown,
    size,
    stats,
    synchronize,
    timeline,
    wait_policy,
)
from ._engine.config import Config
from ._engine.waits import WaitPolicy
from ._engine.core import Adasum, Average, Max, Min, Product, Sum
from ._observe.report import log, progress, track
from ._observe.where import Doing, doing
from ._engine.errors import CollectiveMismatchError, NotInitializedError, PeerError, RingError, StallError
from . import elastic  # Horovod's elastic loop for numpy code (ring.elastic.run, ObjectState)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "config", "Config", "wait_policy", "WaitPolicy",
    "Sum", "Average", "Min", "Max", "Product", "Adasum",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "allgather", "allgather_async", "broadcast",
    "broadcast_", "broadcast_async", "reducescatter", "reducescatter_async", "alltoall", "alltoall_async",
    "barrier", "broadcast_object",
    "allgather_object", "poll", "synchronize", "stats", "reset_stats", "timeline",
    "join", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "RingError", "NotInitializedError", "CollectiveMismatchError", "StallError", "PeerError",
    "progress", "log", "track", "doing", "Doing", "elastic",
]
