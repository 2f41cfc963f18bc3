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
``load_model`` come from :mod:`._keras2` (Horovod's wrapper: a subclass of the optimizer's class).
"""

import types

try:
    import tensorflow as tf
    import keras
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the keras adapter needs tensorflow (with Keras 3): "
                      "pip install 'jupyter_ring[tensorflow]'") from exc

import numpy as np

from .._observe import report as _report
from .. import tensorflow as _tf_adapter
from .._horovod.runtime_names import *  # noqa: F403 - init, rank, ops, errors, ...: as in the numpy API
from .._horovod.runtime_names import __all__ as _COMMON
from .._horovod.basics import *  # noqa: F403 - capability functions, process sets, timeline, join
from .._horovod.basics import __all__ as _HOROVOD
from . import elastic  # Horovod's elastic API for a fixed world
from ..tensorflow import LEGACY_KERAS, Compression, broadcast_variables, init
from ..tensorflow import _K  # tf.keras: Keras 3 (the keras package), or Keras 2 (tf_keras)

__all__ = [
    *_COMMON, *(name for name in _HOROVOD if name not in _COMMON), "elastic", "Compression", "allreduce", "allgather",
    "broadcast", "reducescatter", "broadcast_variables", "broadcast_global_variables", "load_model",
    "DistributedOptimizer", "PartialDistributedOptimizer", "callbacks", "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback", "LearningRateScheduleCallback", "LearningRateWarmupCallback",
    "BestModelCheckpoint", "ProgressCallback",
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

    def __init__(self, optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                 average_aggregated_gradients=False, num_groups=0, groups=None, process_set=global_process_set,
                 scale_local_gradients=True):
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
        self._local_vars = set()

    def register_local_var(self, var):
        """Keep ``var``'s gradient local (not reduced over the ranks)."""
        self._local_vars.add(id(var))

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
        out = _tf_adapter._reduce_except_local(
            grads, variables, lambda v: id(v) in self._local_vars,
            [f"gradient.{i}.{getattr(v, 'path', i)}" for i, v in enumerate(variables)], self._op, self._prescale,
            self._postscale, self._compression, self._sparse_as_dense, self._process_set, self._scale_local_gradients)
        self.inner_optimizer.apply(out, trainable_variables)

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
        """Rebuild from ``get_config`` (the config is read, never changed: it may be used again)."""
        inner = keras.saving.deserialize_keras_object(config["inner_optimizer"], custom_objects=custom_objects)
        return cls(inner, name=config.get("name"))


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                                sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False, groups=None,
                                process_set=global_process_set, local_layers=None, scale_local_gradients=True):
    """A DistributedOptimizer whose ``local_layers``' gradients stay local (model parallelism)."""
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, backward_passes_per_step,
                               average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    for var in _tf_adapter._local_weights(local_layers):
        opt.register_local_var(var)
    return opt


# ------------------------------------------------------------------ values (Horovod's Keras helpers)
def _value(tensor):
    return tensor.numpy() if hasattr(tensor, "numpy") else tensor


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none, process_set=global_process_set):
    """Reduce a value (array or tensor) over the ranks and return it as a numpy array (default: Average)."""
    return _value(_tf_adapter.allreduce(tf.constant(value), average=average, name=name, op=op,
                                        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                        compression=compression, process_set=process_set))


def allgather(value, name=None, process_set=global_process_set):
    """Every rank's value concatenated along dim 0, as a numpy array."""
    return _value(_tf_adapter.allgather(tf.constant(value), name=name, process_set=process_set))


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """Root's value on every rank, as a numpy array."""
    return _value(_tf_adapter.broadcast(tf.constant(value), root_rank, name=name, process_set=process_set))


def reducescatter(value, name=None, op=Average, process_set=global_process_set):
    """This rank's block of dim 0 of the reduced value, as a numpy array."""
    return _value(_tf_adapter.reducescatter(tf.constant(value), name=name, op=op, process_set=process_set))


def broadcast_global_variables(root_rank):
    """TF1 graph mode only (as Horovod on TF 2): run ``hvd.broadcast_global_variables``' op.

    In eager Keras 3 there are no global variables: use BroadcastGlobalVariablesCallback(root_rank)
    in ``fit``, or ``broadcast_variables(model.variables, root_rank)``.
    """
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() does not support eager execution (Keras 3 has no global "
                           "variables); use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit(), or "
                           "hvd.broadcast_variables(model.variables, root_rank)")
    return _tf_adapter.broadcast_global_variables(root_rank)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """Load a saved Keras model and wrap its optimizer (with its state) in a DistributedOptimizer.

    Models saved with a plain optimizer or with this DistributedOptimizer both load; training
    continues from the saved optimizer state on every rank.
    """
    objects = {"DistributedOptimizer": DistributedOptimizer}
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


# ------------------------------------------------------------------ callbacks
class BroadcastGlobalVariablesCallback(_K.callbacks.Callback):
    """At the start of training, give every rank root's model and optimizer variables.

    The optimizer is built first (its slots exist before the first batch), so training starts
    from identical state everywhere and n ranks match one process exactly. ``local_variables``
    are left alone (each rank keeps its own).
    """

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.local_variables = {id(v) for v in (local_variables or [])}
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        opt = model.optimizer
        if opt is not None and LEGACY_KERAS:
            from ._keras2 import build_optimizer

            build_optimizer(opt, model.trainable_variables)
        elif opt is not None and not opt.built:
            opt.build(model.trainable_variables)
        variables = list(model.variables) + (_tf_adapter._optimizer_variables(opt) if opt is not None else [])
        broadcast_variables([v for v in variables if id(v) not in self.local_variables], root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(_K.callbacks.Callback):
    """At the end of every epoch, replace each metric in ``logs`` by its average over the ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping, LR schedules).
    """

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        from ... import runtime as ring

        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and isinstance(float(v), float))
        values = np.array([float(logs[k]) for k in keys], np.float64)
        averaged = ring.allreduce(values, name=f"MetricAverageCallback.epoch{epoch}.{','.join(keys)}")
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


def _get_lr(optimizer):
    if LEGACY_KERAS:
        return float(_K.backend.get_value(optimizer.learning_rate))
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(_K.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``.

    ``multiplier``: a number (exponential decay, ``multiplier ** (epoch - start_epoch)``) or a
    function of the (fractional, with ``staircase=False``) epoch; with ``staircase`` the rate
    changes at the first batch of each epoch, otherwise at every batch. ``momentum_correction``
    (Goyal et al.: the momentum scaled by new / old rate for the batch where the rate changes)
    works where the momentum is a variable, as in Keras 2's legacy optimizers; elsewhere it has no
    effect (Keras 3 and Keras 2's newer optimizers compile the momentum in as a constant).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))

    def _autodetect_steps_per_epoch(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError(f"Could not autodetect the number of steps per epoch; pass steps_per_epoch= to "
                         f"{type(self).__name__}()")

    def _adjust_learning_rate(self, epoch):
        opt = self.model.optimizer
        new_lr = self.initial_lr * self.multiplier(epoch)
        momentum = getattr(opt, "momentum", None) if self.momentum_correction else None
        if isinstance(momentum, tf.Variable):
            old_lr = _get_lr(opt)
            self.restore_momentum = float(momentum.numpy())
            if old_lr:
                momentum.assign(self.restore_momentum * new_lr / old_lr)
        opt.learning_rate = new_lr

    def on_train_batch_end(self, batch, logs=None):
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``.

    Horovod's gradual warm-up (Goyal et al., 2017), adjusted every batch:
    ``lr = initial_lr / size * (t * (size - 1) / warmup_epochs + 1)`` at the fractional epoch
    ``t`` (plus one batch). ``momentum_correction`` has no effect (see LearningRateScheduleCallback).
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be > 0, got {warmup_epochs}")

        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(_K.callbacks.ModelCheckpoint):
    """Keep only the best model seen (``save_best_only``) at ``filepath``, which may be set later.

    Horovod's: a ModelCheckpoint whose file path the training harness sets (``cb.filepath =
    ...``) before ``fit``; the path must end in ``.keras`` (``.weights.h5`` with
    ``save_weights_only``), as Keras 3 requires.
    """

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 filepath=None):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs=None):
        if not self.filepath:
            raise ValueError("BestModelCheckpoint has no filepath; set callback.filepath = 'best.keras' (or pass "
                             "filepath=) before fit()")
        super().on_train_begin(logs)


# ------------------------------------------------------------------ dashboard (owner: widgets)
class ProgressCallback(_K.callbacks.Callback):
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


if LEGACY_KERAS:  # Keras 2 (tf_keras): Horovod's wrapper, a subclass of the optimizer's own class
    from ._keras2 import DistributedOptimizer, load_model  # noqa: E402,F811

callbacks = types.SimpleNamespace(
    BroadcastGlobalVariablesCallback=BroadcastGlobalVariablesCallback,
    MetricAverageCallback=MetricAverageCallback,
    LearningRateScheduleCallback=LearningRateScheduleCallback,
    LearningRateWarmupCallback=LearningRateWarmupCallback,
    BestModelCheckpoint=BestModelCheckpoint,
    ProgressCallback=ProgressCallback,
)
"""Horovod's ``hvd.callbacks`` namespace: the callbacks above (and ``ProgressCallback``)."""
