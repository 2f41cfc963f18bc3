"""Horovod's Keras optimizer wrapper for Keras 2: ``tf.keras`` as the ``tf_keras`` package.

TensorFlow >= 2.16 ships Keras 3; ``TF_USE_LEGACY_KERAS=1`` (set before TensorFlow's import) and
``pip install tf_keras`` give Keras 2 back as ``tf.keras``, which is what Horovod's examples and
most Horovod scripts were written for (``experimental_run_tf_function=False``, ``lr=``,
``keras.optimizers.legacy``). :mod:`jupyter_ring.runtime.keras` takes its names from here then.

As Horovod does, ``DistributedOptimizer`` returns an optimizer of a new subclass of the given
optimizer's class, made from its config: ``fit``'s ``minimize`` computes the gradients through
it, and they are averaged over the ranks (one fused allreduce) before the optimizer applies them.
The class keeps the optimizer's name, so a saved model reloads without jupyter_ring. Both of
Keras 2's optimizer families are wrapped: ``tf.keras.optimizers.*`` and
``tf.keras.optimizers.legacy.*``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from .._horovod.runtime_names import Adasum, Average, ProcessSet, global_process_set
from ._execution import _ref
from ._gradients import _check_optimizer_args, _reduce_except_local, _scales
from .compression import Compression, Compressor

# TensorFlow and Keras ship no annotations: optimizers, models, tensors and variables are Any here.

keras = tf.keras  # tf_keras: this module is imported only when tf.keras is Keras 2

if TYPE_CHECKING:
    _OptimizerBase = Any  # (_Distributed is mixed in before a Keras 2 optimizer class: super() is that class)
else:
    _OptimizerBase = object


def _optimizer_classes() -> tuple[Any, ...]:
    return (keras.optimizers.Optimizer, keras.optimizers.legacy.Optimizer)


@dataclasses.dataclass
class _Reduction:
    """How a distributed optimizer reduces its gradients (one per optimizer, not trackable)."""

    op: int
    prescale: float
    postscale: float
    compression: Compressor
    sparse_as_dense: bool
    process_set: ProcessSet | None
    scale_local_gradients: bool
    name: str
    local: set[Hashable] = dataclasses.field(default_factory=set)   # refs of register_local_var's variables

    def reduce(self, grads: Iterable[Any], variables: Iterable[Any]) -> list[Any]:
        """Every gradient averaged (``op``) over the ranks, but those of local variables."""
        variables = list(variables)
        return _reduce_except_local(
            list(grads), variables, lambda v: _ref(v) in self.local,
            [f"{self.name}.gradient.{i}.{getattr(v, 'name', i)}" for i, v in enumerate(variables)], self.op,
            self.prescale, self.postscale, self.compression, self.sparse_as_dense, self.process_set,
            self.scale_local_gradients)


class _Aggregation:
    """``backward_passes_per_step`` > 1: gradients are summed on each rank and reduced over the
    ranks every ``passes``-th call, when the optimizer applies them (Horovod's local gradient
    aggregation; ``counter`` counts the passes since the last reduction, as Horovod's does)."""

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool) -> None:
        self.passes = passes
        self.average = average
        self.sparse_as_dense = sparse_as_dense
        self.counter = tf.Variable(0, trainable=False, dtype=tf.int32)
        self.sums: dict[int, Any] = {}   # gradient index -> its running sum (a variable, made at the first pass)

    def gradients(self, grads: Sequence[Any], variables: Sequence[Any],
                  reduce: Callable[[Sequence[Any], Sequence[Any]], list[Any]]) -> list[Any]:
        """This pass's gradients added to the sums; every ``passes``-th pass the sums reduced
        with ``reduce`` (and averaged over the passes with ``average``), then cleared."""
        summed: list[Any] = []
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError("IndexedSlices gradients (embeddings) with backward_passes_per_step > 1 need "
                                     "sparse_as_dense=True in DistributedOptimizer")
                g = tf.convert_to_tensor(g)
            if g is None:
                summed.append(None)
                continue
            if i not in self.sums:
                self.sums[i] = tf.Variable(tf.zeros_like(g), trainable=False)
            self.sums[i].assign_add(g)
            summed.append(self.sums[i].read_value())
        self.counter.assign_add(1)
        present = [i for i, g in enumerate(summed) if g is not None]

        def reduce_and_clear() -> list[Any]:
            reduced = reduce(summed, variables)
            if self.average:
                reduced = [None if g is None else g / self.passes for g in reduced]
            self.counter.assign(0)
            for total in self.sums.values():
                total.assign(tf.zeros_like(total))
            return [tf.constant(True)] + [tf.convert_to_tensor(reduced[i]) for i in present]

        # a flag first: both branches return a non-empty list, whatever the gradients
        out = tf.cond(tf.equal(self.counter, self.passes), reduce_and_clear,
                      lambda: [tf.constant(False)] + [summed[i] for i in present])
        result: list[Any] = [None] * len(summed)
        for i, g in zip(present, list(out)[1:]):
            result[i] = g
        return result

    def apply(self, optimizer: Any, apply: Callable[[], object]) -> Any:
        """``apply()`` after a reduction; on the other passes only the optimizer's step count moves."""
        def applied() -> Any:
            apply()
            return tf.constant(True)

        def skipped() -> Any:
            optimizer.iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(tf.equal(self.counter, 0), applied, skipped)


class _Distributed(_OptimizerBase):  # type: ignore[misc]  # (object at run time: see _OptimizerBase)
    """The methods every wrapped optimizer class gets (mixed in before the optimizer's class).

    Keras 2 has two optimizer families: ``minimize`` of the newer one computes gradients with
    ``compute_gradients``, that of the legacy one with ``_compute_gradients``; each override asks
    the optimizer's own class for the gradients through the method it has, so they are reduced once.
    """

    # the _Reduction, set by DistributedOptimizer on every optimizer it makes
    _jupyter_ring: _Reduction = None  # type: ignore[assignment]
    _agg_helper: _Aggregation | None = None     # the _Aggregation with backward_passes_per_step > 1 (Horovod's name)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local (not reduced over the ranks)."""
        self._jupyter_ring.local.add(_ref(var))

    def _own_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None) -> Any:
        if hasattr(super(), "_compute_gradients"):
            return super()._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
        return super().compute_gradients(loss, var_list, tape=tape)

    def _reduce_pairs(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        pairs = list(grads_and_vars)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        if self._agg_helper is not None:
            reduced = self._agg_helper.gradients(grads, variables, self._jupyter_ring.reduce)
        else:
            reduced = self._jupyter_ring.reduce(grads, variables)
        return list(zip(reduced, variables))

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[tuple[Any, Any]]:
        """The optimizer's gradients, averaged over the ranks."""
        return self._reduce_pairs(self._own_gradients(loss, var_list, tape=tape))

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list[tuple[Any, Any]]:
        """The optimizer's gradients, averaged over the ranks (the legacy optimizers' name)."""
        return self._reduce_pairs(self._own_gradients(loss, var_list, grad_loss=grad_loss, tape=tape))

    def get_gradients(self, loss: Any, params: Sequence[Any]) -> list[Any]:
        """The gradients of a TF1-style graph (legacy optimizers), averaged over the ranks."""
        grads = super().get_gradients(loss, params)
        return [g for g, _ in self._reduce_pairs(zip(grads, params))]

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], *args: Any, **kwargs: Any) -> Any:
        """Apply the (reduced) gradients; with backward_passes_per_step > 1 only on reducing passes."""
        if self._agg_helper is None:
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        self._agg_helper.apply(self, lambda: super(_Distributed, self).apply_gradients(pairs, *args, **kwargs))
        return self.iterations


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression: Compressor = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: int = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet | None = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras 2 optimizer: gradients are averaged over the ranks before it applies them.

    Returns a new optimizer of a subclass of ``type(optimizer)``, made from its config (Horovod's
    way): pass a fresh optimizer, its state is not carried over. ``backward_passes_per_step=k``
    sums k passes' gradients on each rank and reduces them at every k-th ``apply_gradients`` (the
    others only count the step); ``average_aggregated_gradients`` divides the sums by k.
    """
    if not isinstance(optimizer, _optimizer_classes()):
        raise TypeError(f"DistributedOptimizer wraps a tf.keras optimizer (Keras 2, tf_keras), got "
                        f"{type(optimizer).__name__}; a tf.compat.v1.train optimizer goes to "
                        "jupyter_ring.runtime.tensorflow.DistributedOptimizer")
    if isinstance(optimizer, _Distributed):
        raise TypeError("this optimizer is already a DistributedOptimizer; wrap the plain Keras optimizer once")
    if op == Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    _check_optimizer_args(op, gradient_predivide_factor)
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    base = type(optimizer)
    cls: Any = type(base.__name__, (_Distributed, base), {"__module__": base.__module__, "__doc__": base.__doc__})
    wrapped = cls.from_config(optimizer.get_config())
    prescale, postscale = _scales(op, gradient_predivide_factor)
    # object.__setattr__: a trackable's __setattr__ would wrap the dataclass' set for checkpoints
    object.__setattr__(wrapped, "_jupyter_ring", _Reduction(
        op, prescale, postscale, compression, sparse_as_dense, process_set, scale_local_gradients,
        name or f"Distributed{base.__name__}"))
    if backward_passes_per_step > 1:
        object.__setattr__(wrapped, "_agg_helper", _Aggregation(backward_passes_per_step, average_aggregated_gradients,
                                                                sparse_as_dense))
    return wrapped


def load_model(filepath: Any, custom_optimizers: Iterable[type] | None = None,
               custom_objects: dict[str, Any] | None = None, compression: Compressor = Compression.none,
               legacy_opts: bool = False) -> Any:
    """Load a saved Keras 2 model; its optimizer, with its saved state, comes back distributed.

    Every optimizer class of ``tf.keras.optimizers`` and ``tf.keras.optimizers.legacy`` (and
    ``custom_optimizers``) is given to Keras as a wrapping constructor of the same name, so the
    optimizer Keras builds is distributed before the saved slots are restored into it. Both
    families are registered, so ``legacy_opts`` (Horovod's choice between them) changes nothing.
    """
    def wrapping(cls: type) -> Callable[..., Any]:
        return lambda **config: DistributedOptimizer(cls(**config), compression=compression)

    classes = [getattr(namespace, attr) for namespace in (keras.optimizers, keras.optimizers.legacy)
               for attr in dir(namespace)]
    classes = [c for c in classes if isinstance(c, type) and issubclass(c, _optimizer_classes())]
    objects: dict[str, Any] = {}
    for cls in classes + list(custom_optimizers or ()):
        objects[cls.__name__] = objects[cls.__name__.lower()] = wrapping(cls)
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)


def build_optimizer(optimizer: Any, variables: Sequence[Any]) -> None:
    """Create ``optimizer``'s slots for ``variables`` now (Keras 2 makes them at the first step)."""
    if hasattr(optimizer, "_create_all_weights"):       # legacy optimizers
        optimizer._create_all_weights(variables)
    elif not getattr(optimizer, "_built", False):
        optimizer.build(variables)

