"""``horovod.tensorflow.keras.elastic`` (and ``horovod.keras.elastic``) for a fixed world:
``KerasState``, ``run`` and the callbacks that keep the state's epoch and batch (see ``_horovod.elastic``)."""

from .._horovod.elastic import ObjectState, State
from ..tensorflow.elastic import KerasState, TensorFlowKerasState, run
from ..tensorflow.util import keras_api as keras  # tf.keras: Keras 3, or Keras 2 with TF_USE_LEGACY_KERAS=1

__all__ = ["State", "ObjectState", "KerasState", "TensorFlowKerasState", "run", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback"]


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # every rank counts from the same start

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the index of the last finished batch (0 after an epoch). Unlike
    Horovod's it does not shorten the epoch that resumes after a reset (``params['steps']``)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the next epoch to run, counted across resets."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
