"""Horovod's ``DistributedOptimizer`` (TF1 optimizers, Keras optimizers) and ``DistributedGradientTape``."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import tensorflow as tf

from .._horovod.runtime_names import Adasum, Average, ProcessSet, global_process_set
from . import _keras3
from .compression import Compression, Compressor
from ._execution import _ref
from ._gradients import _check_optimizer_args, _reduce_except_local, _reduce_gradients, _scales
from .util import LEGACY_KERAS, local_weights

if LEGACY_KERAS:  # Keras 2 (tf_keras): Horovod's wrapper, a subclass of the optimizer's own class
    from ._keras2 import DistributedOptimizer as _keras_optimizer
else:
    from ._keras3 import DistributedOptimizer as _keras_optimizer

__all__ = ["DistributedOptimizer", "DistributedGradientTape", "PartialDistributedGradientTape"]

# TensorFlow ships no annotations: optimizers, tapes, tensors and variables are Any here.


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):  # type: ignore[misc]  # (TF's base)
    """A TF1 ``tf.compat.v1.train`` optimizer whose compute_gradients averages over the ranks."""

    def __init__(self, optimizer: Any, name: str | None = None, use_locking: bool = False,
                 compression: Compressor = Compression.none, sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0, backward_passes_per_step: int = 1,
                 process_set: ProcessSet | None = global_process_set) -> None:
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step > 1 is not supported with a tf.compat.v1.train optimizer "
                             "by jupyter_ring; accumulate gradients yourself or use a Keras optimizer's "
                             "gradient_accumulation_steps")
        self._optimizer = optimizer
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._prescale, self._postscale = _scales(op, gradient_predivide_factor)
        self.process_set = process_set
        self._local_vars: set[Hashable] = set()

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local (not reduced over the ranks)."""
        self._local_vars.add(_ref(var))

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's gradients, reduced over the ranks (one fused collective op)."""
        gradients = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = zip(*gradients) if gradients else ((), ())
        shared = [i for i, v in enumerate(variables) if _ref(v) not in self._local_vars]
        names = [f"{self._name}.{getattr(variables[i], 'name', i)}" for i in shared]
        reduced = _reduce_gradients([grads[i] for i in shared], [variables[i] for i in shared], self._op,
                                    self._prescale, self._postscale, self._compression, names,
                                    self._sparse_as_dense, self.process_set)
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        return list(zip(out, variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: str | None = None) -> Any:
        """The wrapped optimizer's apply_gradients."""
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's slot."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's variables."""
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression: Compressor = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: ProcessSet | None = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a ``tf.compat.v1.train`` optimizer (TF1 graphs) or a Keras optimizer: gradients are
    averaged over the ranks before they are applied (Horovod's DistributedOptimizer)."""
    _check_optimizer_args(op, gradient_predivide_factor)
    if op == Adasum:
        raise ValueError("op=Adasum in DistributedOptimizer is not supported by jupyter_ring (Horovod's delta "
                         "optimizer); use op=Average, or hvd.allreduce(..., op=hvd.Adasum) yourself")
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _DistributedOptimizer(optimizer, name, use_locking, compression, sparse_as_dense, op,
                                     gradient_predivide_factor, backward_passes_per_step, process_set)
    _keras3.check_backend()  # as importing jupyter_ring.runtime.keras does
    return _keras_optimizer(optimizer, name=name, compression=compression, op=op,
                             gradient_predivide_factor=gradient_predivide_factor,
                             backward_passes_per_step=backward_passes_per_step,
                             sparse_as_dense=sparse_as_dense, process_set=process_set)


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients reduced over the ranks.

    Dense gradients of a call go in one fused allreduce, ``tf.IndexedSlices`` (embeddings) by
    allgather unless ``sparse_as_dense``; a gradient that is None on some ranks is sent as zeros
    there (Horovod's behaviour). Sources registered with ``register_local_source`` keep their
    local gradient (divided by the size, with ``scale_local_gradients``).
    """

    def __init__(self, gradtape: Any, device_dense: str = "", device_sparse: str = "",
                 compression: Compressor = Compression.none, sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 process_set: ProcessSet | None = global_process_set, scale_local_gradients: bool = True) -> None:
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        if op == Adasum:
            raise ValueError("op=Adasum is not supported by DistributedGradientTape; use op=Average or op=Sum")
        _check_optimizer_args(op, gradient_predivide_factor)
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._prescale, self._postscale = _scales(op, gradient_predivide_factor)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources: set[Hashable] = set()

    @property
    def tape(self) -> Any:
        """The wrapped tf.GradientTape."""
        return self._tape

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def watch(self, tensor: Any) -> Any:
        """Watch a tensor (as tf.GradientTape.watch)."""
        return self._tape.watch(tensor)

    def watched_variables(self) -> Any:
        """The wrapped tape's watched variables."""
        return self._tape.watched_variables()

    def stop_recording(self) -> Any:
        """Context manager pausing the recording (as tf.GradientTape.stop_recording)."""
        return self._tape.stop_recording()

    def reset(self) -> Any:
        """Clear the recorded operations."""
        return self._tape.reset()

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local: not reduced over the ranks."""
        self._local_sources.add(_ref(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE, use_generic_names: bool = False) -> Any:
        """The wrapped tape's gradients, averaged (or ``op``-reduced) over every rank."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat, flat_sources = tf.nest.flatten(grads), tf.nest.flatten(sources)
        out = _reduce_except_local(flat, flat_sources, lambda s: _ref(s) in self._local_sources,
                                   [f"gradient.{i}" for i in range(len(flat))], self._op, self._prescale,
                                   self._postscale, self._compression, self._sparse_as_dense, self.process_set,
                                   self.scale_local_gradients)
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target: Any, sources: Any, output_gradients: Any = None,
                                       use_generic_names: bool = False
                                       ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """(local [(source, grad)], global [(source, grad)]) split by register_local_source."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        local: list[tuple[Any, Any]] = []
        shared: list[tuple[Any, Any]] = []
        for s, g in zip(sources, grads):
            (local if _ref(s) in self._local_sources else shared).append((s, g))
        return local, shared


def PartialDistributedGradientTape(gradtape: Any, device_dense: str = "", device_sparse: str = "",
                                   compression: Compressor = Compression.none, sparse_as_dense: bool = False,
                                   op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, process_set: ProcessSet | None = global_process_set,
                                   local_layers: Any = None, scale_local_gradients: bool = True
                                   ) -> DistributedGradientTape:
    """A DistributedGradientTape whose ``local_layers``' gradients stay local (model parallelism)."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for var in local_weights(local_layers):
        tape.register_local_source(var)
    return tape
