"""Horovod's ``SyncBatchNormalization``: batch statistics over every rank's batch (Keras 3 or Keras 2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from ... import runtime as _ring
from .._horovod.runtime_names import Sum
from .mpi_ops import allreduce
from .util import keras_api, LEGACY_KERAS

__all__ = ["SyncBatchNormalization"]

# TensorFlow and Keras ship no annotations: layers and tensors are Any here.


# ------------------------------------------------------------------ SyncBatchNormalization
def _synced_moments(layer: Any, inputs: Any, mean: Any, variance: Any, axes: Sequence[int]) -> tuple[Any, Any]:
    """This rank's batch ``mean`` and ``variance`` over ``axes`` -> every rank's, weighted by count."""
    if _ring.size() == 1:
        return mean, variance
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), mean.dtype)
    stack = tf.stack([mean * count, (variance + tf.square(mean)) * count, tf.ones_like(mean) * count])
    total = allreduce(stack, op=Sum, name=f"{layer.name}.moments")
    group_mean = total[0] / total[2]
    return group_mean, total[1] / total[2] - tf.square(group_mean)


def _refuse_fused(fused: bool | None) -> None:
    if fused in (True, None):
        raise ValueError("SyncBatchNormalization does not support fused=True.")


if LEGACY_KERAS:
    class SyncBatchNormalization(keras_api.layers.BatchNormalization):  # type: ignore[misc]  # (Keras' base)
        """BatchNormalization whose training statistics cover every rank's batch (Horovod's).

        Mean and variance are combined over the ranks weighted by each rank's count (one allreduce
        per call); in inference it is the ordinary layer. Keras 2 (tf_keras) here.
        """

        def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
            _refuse_fused(fused)
            kwargs.setdefault("name", "sync_batch_normalization")
            super().__init__(fused=False, **kwargs)

        def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Sequence[int], keep_dims: bool,
                                    mask: Any = None) -> tuple[Any, Any]:
            mean, variance = super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
            return _synced_moments(self, inputs, mean, variance, list(reduction_axes))
else:
    # (one class of this name, for Keras 3 or for Keras 2: Keras saves a layer by its class name)
    class SyncBatchNormalization(keras.layers.BatchNormalization):  # type: ignore[misc, no-redef]  # (Keras' base)
        """BatchNormalization whose training statistics cover every rank's batch (Horovod's).

        Mean and variance are combined over the ranks weighted by each rank's count (one allreduce
        per call); in inference it is the ordinary layer.
        """

        def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
            _refuse_fused(fused)
            super().__init__(**kwargs)

        def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
            mean, variance = super()._moments(inputs, mask)
            rank = len(inputs.shape)
            kept = [ax % rank for ax in (self.axis if isinstance(self.axis, (list, tuple)) else [self.axis])]
            return _synced_moments(self, inputs, mean, variance, [a for a in range(rank) if a not in kept])
