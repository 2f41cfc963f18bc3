"""Horovod's Keras helpers on values (arrays or tensors in, numpy arrays out)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from .. import tensorflow as _tf_adapter
from .._horovod.runtime_names import Average, ProcessSet, global_process_set
from ..tensorflow.compression import Compression, Compressor

__all__ = ["allreduce", "allgather", "broadcast", "reducescatter", "broadcast_global_variables"]

# TensorFlow ships no annotations: values (arrays, tensors) are Any here; results are numpy arrays.


def _value(tensor: Any) -> Any:
    return tensor.numpy() if hasattr(tensor, "numpy") else tensor


def allreduce(value: Any, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: int | None = None, compression: Compressor = Compression.none,
              process_set: ProcessSet | None = global_process_set) -> Any:
    """Reduce a value (array or tensor) over the ranks and return it as a numpy array (default: Average)."""
    return _value(_tf_adapter.allreduce(tf.constant(value), average=average, name=name, op=op,
                                        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                        compression=compression, process_set=process_set))


def allgather(value: Any, name: str | None = None, process_set: ProcessSet | None = global_process_set) -> Any:
    """Every rank's value concatenated along dim 0, as a numpy array."""
    return _value(_tf_adapter.allgather(tf.constant(value), name=name, process_set=process_set))


def broadcast(value: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = global_process_set) -> Any:
    """Root's value on every rank, as a numpy array."""
    return _value(_tf_adapter.broadcast(tf.constant(value), root_rank, name=name, process_set=process_set))


def reducescatter(value: Any, name: str | None = None, op: int = Average,
                  process_set: ProcessSet | None = global_process_set) -> Any:
    """This rank's block of dim 0 of the reduced value, as a numpy array."""
    return _value(_tf_adapter.reducescatter(tf.constant(value), name=name, op=op, process_set=process_set))


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graph mode only (as Horovod on TF 2): run ``hvd.broadcast_global_variables``' op.

    In eager Keras 3 there are no global variables: use BroadcastGlobalVariablesCallback(root_rank)
    in ``fit``, or ``broadcast_variables(model.variables, root_rank)``.
    """
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() does not support eager execution (Keras 3 has no global "
                           "variables); use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit(), or "
                           "hvd.broadcast_variables(model.variables, root_rank)")
    return _tf_adapter.broadcast_global_variables(root_rank)
