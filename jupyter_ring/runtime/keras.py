"""Horovod's Keras API for Keras 3 (TensorFlow backend) on jupyter_ring's ring runtime.

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
"""

import types

try:
    import keras
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the keras adapter needs tensorflow (with Keras 3): "
                      "pip install 'jupyter_ring[tensorflow]'") from exc

from . import _report
from . import tensorflow as _tf_adapter
from ._core import Adasum, Average, Max, Min, Product, Sum
from ._errors import CollectiveMismatchError, NotInitializedError, RingError, StallError
from .tensorflow import (
    Compression,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "Sum", "Average", "Min", "Max", "Product", "Adasum", "Compression",
    "allreduce", "allgather", "broadcast", "barrier", "broadcast_object", "allgather_object",
    "broadcast_variables", "DistributedOptimizer", "callbacks", "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback", "LearningRateWarmupCallback", "ProgressCallback",
    "RingError", "NotInitializedError", "CollectiveMismatchError", "StallError",
]


def _check_backend():
    if keras.backend.backend() != "tensorflow":
        raise ImportError(f"jupyter_ring's keras adapter needs Keras' tensorflow backend, but KERAS_BACKEND is "
                          f"{keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow before importing keras "
                          "(for torch, use jupyter_ring.runtime.torch)")


_check_backend()


class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer: gradients are averaged over the ranks before it applies them.

    A wrapper in the manner of ``keras.optimizers.LossScaleOptimizer``: the inner optimizer keeps
    its variables, learning rate and iteration count; this one only reduces the gradients.
    """

    def __init__(self, optimizer, name=None, compression=Compression.none, op=Average,
                 gradient_predivide_factor=1.0, backward_passes_per_step=1):
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("this optimizer is already a DistributedOptimizer; wrap the plain Keras optimizer once")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
        if op == Adasum:
            raise ValueError("op=Adasum is not supported by jupyter_ring; use op=Average or op=Sum")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step > 1 is not supported by the Keras adapter; set "
                             "gradient_accumulation_steps on the inner Keras optimizer instead")
        super().__init__(learning_rate=0.0, name=name or f"Distributed{optimizer.name}")
        self.inner_optimizer = optimizer
        self._compression = compression
        self._op = op
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = gradient_predivide_factor

    def build(self, var_list):
        """Build the inner optimizer's variables."""
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        """The inner optimizer's variables (this wrapper has none of its own)."""
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self):
        """The inner optimizer's step counter."""
        return self.inner_optimizer.iterations

    def apply_gradients(self, grads_and_vars):
        """Average the gradients over the ranks, then apply them with the inner optimizer."""
        grads, variables = zip(*grads_and_vars)
        self.apply(grads, variables)
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Average ``grads`` over the ranks, then apply them with the inner optimizer."""
        grads = list(grads)
        if not grads:
            return
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        if not self.built:
            self.build(variables)
            self.built = True
        names = [f"gradient.{i}.{v.path if hasattr(v, 'path') else i}" for i, v in enumerate(variables)]
        reduced = _tf_adapter._reduce_gradients(grads, variables, self._op, self._prescale, self._postscale,
                                                self._compression, names)
        self.inner_optimizer.apply(reduced, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """Not available: the ring runs on the TensorFlow backend's stateful path only."""
        raise NotImplementedError("DistributedOptimizer supports Keras' tensorflow backend (stateful apply) only")

    def finalize_variable_values(self, var_list):
        """Delegate to the inner optimizer (EMA weights)."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        """Serialise as the inner optimizer (a reloaded model trains on one rank without wrapping)."""
        return {"name": self.name,
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuild from ``get_config``."""
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, name=config.get("name"))


# ------------------------------------------------------------------ callbacks
class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every rank root's model and optimizer variables.

    The optimizer is built first (its slots exist before the first batch), so training starts
    from identical state everywhere and n ranks match one process exactly.
    """

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        opt = model.optimizer
        if opt is not None and not opt.built:
            opt.build(model.trainable_variables)
        variables = list(model.variables) + (list(opt.variables) if opt is not None else [])
        broadcast_variables(variables, root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replace each metric in ``logs`` by its average over the ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping, LR schedules).
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        import numpy as np

        from .. import runtime as ring

        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and isinstance(float(v), float))
        values = np.array([float(logs[k]) for k in keys], np.float64)
        averaged = ring.allreduce(values, name=f"MetricAverageCallback.epoch{epoch}.{','.join(keys)}")
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``.

    Horovod's gradual warm-up (Goyal et al., 2017): ``lr = initial_lr / size * (1 + t * (size - 1) /
    warmup_epochs)`` for the fractional epoch ``t``, adjusted every batch. ``momentum_correction``
    is accepted for Horovod compatibility but has no effect: Keras 3 compiles the momentum into
    the train step as a constant.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__()
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be > 0, got {warmup_epochs}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def _lr(self, epoch_fraction):
        n = size()
        return self.initial_lr / n * (1 + epoch_fraction * (n - 1) / self.warmup_epochs)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError("LearningRateWarmupCallback needs steps_per_epoch= (fit() did not say how "
                                 "many steps an epoch has)")

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch >= self.warmup_epochs:
            return
        self.model.optimizer.learning_rate = self._lr(self.current_epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate = self.initial_lr
            if self.verbose and rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")


# ------------------------------------------------------------------ dashboard (owner: widgets)
class ProgressCallback(keras.callbacks.Callback):
    """Report ``fit``'s steps and batch metrics (loss, ...) to the notebook's dashboard.

    ``ring.progress(step, total=epochs * steps)`` after every batch, and ``ring.log`` of the
    batch logs (Keras' running means over the epoch). ``metrics``: names to log (default: every
    scalar in the logs). Costs one host sync of the logs per batch.
    """

    def __init__(self, metrics=None):
        super().__init__()
        self.metrics = None if metrics is None else list(metrics)
        self.step = 0
        self.epoch = 0
        self.epochs = None

    def on_train_begin(self, logs=None):
        params = self.params or {}
        steps, self.epochs = params.get("steps"), params.get("epochs")
        total = steps * self.epochs if steps and self.epochs else None
        self.step = 0
        _report.progress(0, total=total, desc="fit")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        desc = f"epoch {self.epoch + 1}/{self.epochs}" if self.epochs else "fit"
        _report.progress(self.step, desc=desc)
        values = {}
        for key, value in (logs or {}).items():
            if self.metrics is not None and key not in self.metrics:
                continue
            try:
                values[key] = float(value)
            except (TypeError, ValueError):
                continue  # not a scalar
        if values:
            _report.log(**values)


callbacks = types.SimpleNamespace(
    BroadcastGlobalVariablesCallback=BroadcastGlobalVariablesCallback,
    MetricAverageCallback=MetricAverageCallback,
    LearningRateWarmupCallback=LearningRateWarmupCallback,
    ProgressCallback=ProgressCallback,
)
"""Horovod's ``hvd.callbacks`` namespace: the callbacks above (and ``ProgressCallback``)."""
