"""Horovod's Keras API (Keras 3 with the TensorFlow backend, or Keras 2) on jupyter_ring's ring runtime.

::

    import jupyter_ring.runtime.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()])

Inside ``model.fit`` the gradients are averaged by one ``tf.py_function`` in the compiled train
step, so ``fit`` runs in graph mode; ``run_eagerly=True`` works too. XLA (``jit_compile=True``,
Keras' "auto" choice on GPUs) cannot compile a py_function: compile with ``jit_compile=False``.

Keras 2: as Horovod's ``horovod.tensorflow.keras`` this follows ``tf.keras``. With
``TF_USE_LEGACY_KERAS=1`` set before TensorFlow's import and the ``tf_keras`` package installed,
``tf.keras`` is Keras 2; the callbacks then derive from its classes and ``DistributedOptimizer``,
``load_model`` come from ``tensorflow/_keras2.py`` (Horovod's wrapper: a subclass of the optimizer's class).

The package: ``optimizer`` (``DistributedOptimizer`` for the Keras ``tf.keras`` is,
``PartialDistributedOptimizer``, ``load_model``), ``functions`` (helpers on values),
``callbacks``, ``elastic``. Its modules import the TensorFlow adapter's modules
(``jupyter_ring.runtime.tensorflow``: the Keras optimizers live there, below both) and the
runtime's ``_horovod`` and ``_observe``; never this ``__init__``, which only gathers the names.
"""

try:
    import tensorflow as tf  # noqa: F401 - the adapter's requirements, checked before any module needs them
    import keras  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the keras adapter needs tensorflow (with Keras 3): "
                      "pip install 'jupyter_ring[tensorflow]'") from exc

from ..tensorflow import _keras3
from .._horovod.runtime_names import *  # noqa: F403 - init, rank, ops, errors, ...: as in the numpy API
from .._horovod.runtime_names import __all__ as _COMMON
from .._horovod.basics import *  # noqa: F403 - capability functions, process sets, timeline, join
from .._horovod.basics import __all__ as _HOROVOD
from ..tensorflow import Compression, broadcast_variables, init
from ..tensorflow.util import LEGACY_KERAS
from . import callbacks, elastic  # Horovod's hvd.callbacks and hvd.elastic
from .callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
                        LearningRateWarmupCallback, MetricAverageCallback, ProgressCallback)
from .functions import allgather, allreduce, broadcast, broadcast_global_variables, reducescatter
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model

__all__ = [
    *_COMMON, *(name for name in _HOROVOD if name not in _COMMON), "elastic", "Compression", "allreduce", "allgather",
    "broadcast", "reducescatter", "broadcast_variables", "broadcast_global_variables", "load_model",
    "DistributedOptimizer", "PartialDistributedOptimizer", "callbacks", "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback", "LearningRateScheduleCallback", "LearningRateWarmupCallback",
    "BestModelCheckpoint", "ProgressCallback",
]

_keras3.check_backend()  # Keras 3 must run on TensorFlow's backend: ImportError with the fix
