"""Horovod's TensorFlow API on jupyter_ring's ring runtime: change only the import line.

::

    import jupyter_ring.runtime.tensorflow as hvd

    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

Works eagerly, inside ``tf.function`` and in TF1 graph mode (``tf.compat.v1`` sessions,
``MonitoredTrainingSession``, ``hvd.DistributedOptimizer`` around a ``tf.compat.v1.train``
optimizer, ``hvd.BroadcastGlobalVariablesHook``). Tensors cross into the runtime as numpy arrays:
eagerly through ``tensor.numpy()``, in a graph through one ``tf.py_function`` per collective (so
XLA-compiled functions, ``jit_compile=True``, cannot contain them). Every collective has
Horovod's gradient. Errors are TensorFlow's: ranks that disagree raise
``tf.errors.FailedPreconditionError`` on every rank (inside a graph op through a failed variable
read, since py_function keeps no error type: see _GraphErrors), bad arguments found while running raise
``tf.errors.InvalidArgumentError``, a stall ``tf.errors.DeadlineExceededError`` (``UnknownError``
inside a graph op). bfloat16 travels
as float32; GPU tensors are staged through host memory. For Keras ``model.fit`` see
:mod:`jupyter_ring.runtime.keras`.

Keras is ``tf.keras``, as in Horovod: Keras 3, or Keras 2 (the ``tf_keras`` package) when
``TF_USE_LEGACY_KERAS=1`` is set before TensorFlow is imported. ``SyncBatchNormalization`` and
``DistributedOptimizer`` around a Keras optimizer follow that choice (see ``util``, ``_keras2``).

The package is split as Horovod's ``horovod/tensorflow/``: ``util`` (which Keras ``tf.keras``
is), ``compression``, ``_execution`` (how an op runs: eagerly, as a graph op, in a TF1 session;
TensorFlow's errors), ``mpi_ops`` (the collectives and their gradients), ``functions`` (variables
and objects made equal), ``_gradients`` (the reduction the tape, the optimizers and Keras share),
``_keras3``/``_keras2`` (Keras' ``DistributedOptimizer``), ``optimizer``, ``sync_batch_norm``,
``elastic``. Each module imports only modules before it in that list and the runtime's
``_horovod``, ``_engine`` and ``_api``; never this ``__init__``, which only gathers the names.
"""

try:
    import tensorflow as tf  # noqa: F401 - the adapter's one requirement, checked before any module needs it
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the tensorflow adapter needs tensorflow: pip install 'jupyter_ring[tensorflow]'") from exc

from .._horovod.runtime_names import *  # noqa: F403 - init, rank, ops, errors, ...: as in the numpy API
from .._horovod.runtime_names import __all__ as _COMMON
from .._horovod.basics import *  # noqa: F403 - capability functions, process sets, timeline, join
from .._horovod.basics import __all__ as _HOROVOD
from .util import LEGACY_KERAS, _executing_eagerly  # _executing_eagerly: benchmarks/horovod_suite.py's util
from .compression import Compression, FP16Compressor, NoneCompressor
from ._execution import _session_wait  # tests/mpi/tf_session_ops.py reads the default
from .mpi_ops import (allgather, allreduce, alltoall, barrier, broadcast, broadcast_, grouped_allgather,
                      grouped_allreduce, grouped_reducescatter, init, local_rank_op, local_size_op,
                      process_set_included_op, rank_op, reducescatter, size_op)
# (allgather_object and broadcast_object replace the star import's: TensorFlow's take a session, as Horovod's)
from .functions import (BroadcastGlobalVariablesHook, allgather_object, broadcast_global_variables,  # type: ignore[assignment]
                        broadcast_object, broadcast_object_fn, broadcast_variables)
from .optimizer import DistributedGradientTape, DistributedOptimizer, PartialDistributedGradientTape
from .sync_batch_norm import SyncBatchNormalization
from . import elastic  # Horovod's elastic API for a fixed world

__all__ = [
    *_COMMON, *(name for name in _HOROVOD if name not in _COMMON), "elastic", "Compression", "NoneCompressor", "FP16Compressor", "allreduce",
    "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "broadcast_variables", "broadcast_global_variables",
    "broadcast_object_fn", "size_op", "rank_op", "local_size_op", "local_rank_op", "process_set_included_op",
    "BroadcastGlobalVariablesHook", "DistributedOptimizer", "DistributedGradientTape",
    "PartialDistributedGradientTape", "SyncBatchNormalization",
]
