"""Horovod's Keras optimizer wrapper for Keras 3 (the ``keras`` package with TensorFlow's backend)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import keras

from .._horovod.runtime_names import Adasum, Average, ProcessSet, global_process_set
from .compression import Compression, Compressor
from ._gradients import _reduce_except_local

# Keras ships no annotations: optimizers, models, tensors and variables are Any here.


def check_backend() -> None:
    """Raise ImportError unless Keras 3 runs on TensorFlow's backend (the adapter's requirement)."""
    if getattr(keras, "__sphinx_mock__", False):  # the API reference's build (docs/conf.py) mocks Keras
        return
    if keras.backend.backend() != "tensorflow":
        raise ImportError(f"jupyter_ring's keras adapter needs Keras' tensorflow backend, but KERAS_BACKEND is "
                          f"{keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow before importing keras "
                          "(for torch, use jupyter_ring.runtime.torch)")


class DistributedOptimizer(keras.optimizers.Optimizer):  # type: ignore[misc]  # (Keras' base)
    """Wraps a Keras 3 optimizer: gradients are averaged over the ranks before it applies them.

    A wrapper in the manner of ``keras.optimizers.LossScaleOptimizer``: the inner optimizer keeps
    its variables, learning rate and iteration count; this one only reduces the gradients.
    """

    built: bool   # (Keras' own attribute, which apply() sets)

    def __init__(self, optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                 compression: Compressor = Compression.none, sparse_as_dense: bool = False,
                 gradient_predivide_factor: float = 1.0, op: int = Average, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                 process_set: ProcessSet | None = global_process_set, scale_local_gradients: bool = True) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("this optimizer is already a DistributedOptimizer; wrap the plain Keras optimizer once")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
        if op == Adasum:
            raise ValueError("op == Adasum is not supported yet with Keras")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step > 1 is not supported by the Keras adapter; set "
                             "gradient_accumulation_steps on the inner Keras optimizer instead")
        super().__init__(learning_rate=0.0, name=name or f"Distributed{optimizer.name}")
        self.inner_optimizer = optimizer
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = gradient_predivide_factor
        self._process_set = process_set
        self._scale_local_gradients = scale_local_gradients
        self._local_vars: set[int] = set()   # id() of register_local_var's variables

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local (not reduced over the ranks)."""
        self._local_vars.add(id(var))

    def build(self, var_list: Sequence[Any]) -> None:
        """Build the inner optimizer's variables."""
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self) -> Any:
        """The inner optimizer's variables (this wrapper has none of its own)."""
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's learning rate."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self) -> Any:
        """The inner optimizer's step counter."""
        return self.inner_optimizer.iterations

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        """Average the gradients over the ranks, then apply them with the inner optimizer."""
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables)
        return self.iterations

    def apply(self, grads: Iterable[Any], trainable_variables: Iterable[Any] | None = None) -> None:
        """Average ``grads`` over the ranks, then apply them with the inner optimizer."""
        grads = list(grads)
        if not grads:
            return
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        if not self.built:
            self.build(variables)
            self.built = True
        out = _reduce_except_local(
            grads, variables, lambda v: id(v) in self._local_vars,
            [f"gradient.{i}.{getattr(v, 'path', i)}" for i, v in enumerate(variables)], self._op, self._prescale,
            self._postscale, self._compression, self._sparse_as_dense, self._process_set, self._scale_local_gradients)
        self.inner_optimizer.apply(out, trainable_variables)

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """Not available: the ring runs on the TensorFlow backend's stateful path only."""
        raise NotImplementedError("DistributedOptimizer supports Keras' tensorflow backend (stateful apply) only")

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Delegate to the inner optimizer (EMA weights)."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self) -> dict[str, Any]:
        """Serialise as the inner optimizer (a reloaded model trains on one rank without wrapping)."""
        return {"name": self.name,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None) -> DistributedOptimizer:
        """Rebuild from ``get_config`` (the config is read, never changed: it may be used again)."""
        inner = keras.saving.deserialize_keras_object(config["inner_optimizer"], custom_objects=custom_objects)
        return cls(inner, name=config.get("name"))


def load_model(filepath: Any, custom_optimizers: Iterable[type] | None = None,
               custom_objects: dict[str, Any] | None = None, compression: Compressor = Compression.none,
               legacy_opts: bool = False) -> Any:
    """Load a saved Keras model and wrap its optimizer (with its state) in a DistributedOptimizer.

    Models saved with a plain optimizer or with this DistributedOptimizer both load; training
    continues from the saved optimizer state on every rank.
    """
    objects: dict[str, Any] = {"DistributedOptimizer": DistributedOptimizer}
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not isinstance(opt, DistributedOptimizer):
        model.optimizer = DistributedOptimizer(opt, compression=compression)
    elif opt is not None:
        opt._compression = compression
    return model
