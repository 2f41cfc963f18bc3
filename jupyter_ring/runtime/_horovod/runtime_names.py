"""The names every framework adapter shares with the numpy runtime, unchanged.

Horovod's framework modules (``horovod.torch``, ``horovod.tensorflow``) each offer the topology
calls, the reduce ops, ``barrier``, the object collectives, process sets and the errors; ours re-export them
from here with ``from ._common import *`` and add their own tensor collectives.
"""

from ... import runtime as _ring
from .._engine.core import Adasum, Average, Max, Min, Product, Sum
from .._engine.errors import CollectiveMismatchError, NotInitializedError, RingError, StallError

init = _ring.init
shutdown = _ring.shutdown
is_initialized = _ring.is_initialized
size = _ring.size
rank = _ring.rank
local_size = _ring.local_size
local_rank = _ring.local_rank
cross_size = _ring.cross_size
cross_rank = _ring.cross_rank
barrier = _ring.barrier
broadcast_object = _ring.broadcast_object
allgather_object = _ring.allgather_object
ProcessSet = _ring.ProcessSet
global_process_set = _ring.global_process_set
add_process_set = _ring.add_process_set
remove_process_set = _ring.remove_process_set
stats = _ring.stats
timeline = _ring.timeline

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "Sum", "Average", "Min", "Max", "Product", "Adasum", "barrier",
    "broadcast_object", "allgather_object", "stats", "timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "RingError", "NotInitializedError", "CollectiveMismatchError", "StallError",
]
