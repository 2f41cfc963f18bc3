"""Horovod's Keras callbacks (``hvd.callbacks``), and ``ProgressCallback`` for the notebook's dashboard."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import keras
import numpy as np
import tensorflow as tf

from ... import runtime as _ring
from .._horovod.runtime_names import rank, size
from .._observe import report as _report
from ..tensorflow.functions import broadcast_variables
from ..tensorflow.util import LEGACY_KERAS, build_optimizer, keras_api, optimizer_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint",
           "ProgressCallback"]

# Keras ships no annotations: models, optimizers, variables, logs and params are Any here.


class BroadcastGlobalVariablesCallback(keras_api.callbacks.Callback):  # type: ignore[misc]  # (Keras' base)
    """At the start of training, give every rank root's model and optimizer variables.

    The optimizer is built first (its slots exist before the first batch), so training starts
    from identical state everywhere and n ranks match one process exactly. ``local_variables``
    are left alone (each rank keeps its own).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Iterable[Any] | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.local_variables = {id(v) for v in (local_variables or [])}
        self.broadcast_done = False

    def on_train_begin(self, logs: Any = None) -> None:
        if self.broadcast_done:
            return
        model = self.model
        opt = model.optimizer
        if opt is not None:
            build_optimizer(opt, model.trainable_variables)
        variables = list(model.variables) + (optimizer_variables(opt) if opt is not None else [])
        broadcast_variables([v for v in variables if id(v) not in self.local_variables], root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras_api.callbacks.Callback):  # type: ignore[misc]  # (Keras' base)
    """At the end of every epoch, replace each metric in ``logs`` by its average over the ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping, LR schedules).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and isinstance(float(v), float))
        values = np.array([float(logs[k]) for k in keys], np.float64)
        averaged = _ring.allreduce(values, name=f"MetricAverageCallback.epoch{epoch}.{','.join(keys)}")
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


def _get_lr(optimizer: Any) -> float:
    if LEGACY_KERAS:
        return float(keras_api.backend.get_value(optimizer.learning_rate))
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(keras_api.callbacks.Callback):  # type: ignore[misc]  # (Keras' base)
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``.

    ``multiplier``: a number (exponential decay, ``multiplier ** (epoch - start_epoch)``) or a
    function of the (fractional, with ``staircase=False``) epoch; with ``staircase`` the rate
    changes at the first batch of each epoch, otherwise at every batch. ``momentum_correction``
    (Goyal et al.: the momentum scaled by new / old rate for the batch where the rate changes)
    works where the momentum is a variable, as in Keras 2's legacy optimizers; elsewhere it has no
    effect (Keras 3 and Keras 2's newer optimizers compile the momentum in as a constant).
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        self.restore_momentum: float | None = None
        self.multiplier: Callable[[float], float] = (
            multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch)))

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            steps: int = params["steps"]
            return steps
        if params.get("samples") and params.get("batch_size"):
            steps = params["samples"] // params["batch_size"]
            return steps
        raise ValueError(f"Could not autodetect the number of steps per epoch; pass steps_per_epoch= to "
                         f"{type(self).__name__}()")

    def _adjust_learning_rate(self, epoch: float) -> None:
        opt = self.model.optimizer
        new_lr = self.initial_lr * self.multiplier(epoch)
        momentum = getattr(opt, "momentum", None) if self.momentum_correction else None
        if isinstance(momentum, tf.Variable):
            old_lr = _get_lr(opt)
            self.restore_momentum = float(momentum.numpy())
            if old_lr:
                momentum.assign(self.restore_momentum * new_lr / old_lr)
        opt.learning_rate = new_lr

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = cast(int, self.current_epoch)  # (on_epoch_begin set it)
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(epoch)
        elif not self.staircase:
            self._adjust_learning_rate(epoch + float(batch) / cast(int, self.steps_per_epoch))  # (on_train_begin)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``.

    Horovod's gradual warm-up (Goyal et al., 2017), adjusted every batch:
    ``lr = initial_lr / size * (t * (size - 1) / warmup_epochs + 1)`` at the fractional epoch
    ``t`` (plus one batch). ``momentum_correction`` has no effect (see LearningRateScheduleCallback).
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be > 0, got {warmup_epochs}")

        def multiplier(epoch: float) -> float:
            epoch += 1.0 / cast(int, self.steps_per_epoch)  # (on_train_begin set it)
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == cast(int, self.end_epoch) - 1 and self.verbose > 0 and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras_api.callbacks.ModelCheckpoint):  # type: ignore[misc]  # (Keras' base)
    """Keep only the best model seen (``save_best_only``) at ``filepath``, which may be set later.

    Horovod's: a ModelCheckpoint whose file path the training harness sets (``cb.filepath =
    ...``) before ``fit``; the path must end in ``.keras`` (``.weights.h5`` with
    ``save_weights_only``), as Keras 3 requires.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.filepath:
            raise ValueError("BestModelCheckpoint has no filepath; set callback.filepath = 'best.keras' (or pass "
                             "filepath=) before fit()")
        super().on_train_begin(logs)


# ------------------------------------------------------------------ dashboard (owner: widgets)
class ProgressCallback(keras_api.callbacks.Callback):  # type: ignore[misc]  # (Keras' base)
    """Report ``fit``'s steps and batch metrics (loss, ...) to the notebook's dashboard.

    ``ring.progress(step, total=epochs * steps)`` after every batch, and ``ring.log`` of the
    batch logs (Keras' running means over the epoch). ``metrics``: names to log (default: every
    scalar in the logs). Costs one host sync of the logs per batch.
    """

    def __init__(self, metrics: Iterable[str] | None = None) -> None:
        super().__init__()
        self.metrics = None if metrics is None else list(metrics)
        self.step = 0
        self.epoch = 0
        self.epochs: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        params = self.params or {}
        steps, self.epochs = params.get("steps"), params.get("epochs")
        total = steps * self.epochs if steps and self.epochs else None
        self.step = 0
        _report.progress(0, total=total, desc="fit")

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.step += 1
        desc = f"epoch {self.epoch + 1}/{self.epochs}" if self.epochs else "fit"
        _report.progress(self.step, desc=desc)
        values: dict[str, float] = {}
        for key, value in (logs or {}).items():
            if self.metrics is not None and key not in self.metrics:
                continue
            try:
                values[key] = float(value)
            except (TypeError, ValueError):
                continue  # not a scalar
        if values:
            _report.log(**values)
