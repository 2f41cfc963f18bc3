"""``horovod.tensorflow.keras.elastic`` (and ``horovod.keras.elastic``): ``KerasState``, ``run``
and the callbacks that commit the state and keep its epoch and batch (see _elastic)."""

from __future__ import annotations

from typing import Any

from .._horovod.elastic import ObjectState, State
from .._horovod.elastic_world import HostsUpdatedInterrupt
from ..tensorflow.elastic import KerasState, TensorFlowKerasState, run
from ..tensorflow.util import keras_api as keras  # tf.keras: Keras 3, or Keras 2 with TF_USE_LEGACY_KERAS=1

__all__ = ["State", "ObjectState", "KerasState", "TensorFlowKerasState", "HostsUpdatedInterrupt", "run",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"]

# Keras ships no annotations: its callbacks' logs and params are Any here.


class CommitStateCallback(keras.callbacks.Callback):  # type: ignore[misc]  # (Keras' base)
    """Commit ``state`` every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit  # every rank counts from the same start

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):  # type: ignore[misc]  # (Keras' base)
    """Keep ``state.batch`` at the index of the last finished batch (0 after an epoch).

    As Horovod's, when ``fit`` knows its steps per epoch, the first epoch after a reset is given
    ``params['steps']`` less the batches already done (``state.batch``); Keras 3's and tf_keras's
    fit loops count their own steps, so there (as under Horovod) only the callbacks see it.
    """

    def __init__(self, state: ObjectState) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None  # every rank counts from the same start after a sync

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        params = getattr(self, "params", None) or {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params["steps"]
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):  # type: ignore[misc]  # (Keras' base)
    """Keep ``state.epoch`` at the next epoch to run, counted across resets."""

    def __init__(self, state: ObjectState) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch: int = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
