"""Horovod's Keras ``DistributedOptimizer`` (Keras 3's, or Keras 2's wrapper), ``PartialDistributedOptimizer``
and ``load_model``."""

from __future__ import annotations

from typing import Any

from .._horovod.runtime_names import Average, ProcessSet, global_process_set
from ..tensorflow.compression import Compression, Compressor
from ..tensorflow.util import LEGACY_KERAS, local_weights

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "load_model"]

# Keras ships no annotations: optimizers and layers are Any here.


if LEGACY_KERAS:  # Keras 2 (tf_keras): Horovod's wrapper, a subclass of the optimizer's own class
    from ..tensorflow._keras2 import DistributedOptimizer, load_model
else:
    from ..tensorflow._keras3 import DistributedOptimizer, load_model


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                                device_sparse: str = "", compression: Compressor = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: int = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: ProcessSet | None = global_process_set, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A DistributedOptimizer whose ``local_layers``' gradients stay local (model parallelism)."""
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, backward_passes_per_step,
                               average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    for var in local_weights(local_layers):
        opt.register_local_var(var)
    return opt
