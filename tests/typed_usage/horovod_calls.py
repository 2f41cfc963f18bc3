"""Calls users write against jupyter_ring's typed public API, as Horovod's documentation shows
them: type-checked by mypy (``files`` in pyproject.toml, run by scripts/test.sh), never run.

A public annotation that refuses one of these calls is a bug of the annotation (``mypy`` fails).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import jupyter_ring.runtime.torch as hvd
from jupyter_ring.runtime import elastic


def torch_state_is_broadcast(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """hvd.broadcast_parameters takes a state_dict (a dict[str, Tensor]) and named_parameters()."""
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)


def ring_elastic_keeps_the_signature() -> int:
    """ring.elastic.run returns a function of the decorated one's arguments and result; a state's
    attributes are read and set as in Horovod's examples."""
    state = elastic.ObjectState(w=np.zeros(3), epoch=0)

    @elastic.run
    def train(state: elastic.ObjectState, steps: int) -> int:
        for state.epoch in range(state.epoch, steps):  # (its attributes: the keywords it was made with)
            state.commit()
        return steps

    return train(state, 3)


def torch_elastic_keeps_the_signature(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """hvd.elastic.run as ring.elastic.run, with a TorchState."""
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState, lr: float) -> float:
        state.commit()
        return lr

    return train(state, 0.1)


def keras_callbacks_as_horovod_shows(model: Any) -> list[object]:
    """hvd.callbacks and the elastic callbacks of the Keras adapter, as Horovod's examples make them."""
    import jupyter_ring.runtime.keras as khvd

    state = khvd.elastic.KerasState(model, epoch=0, batch=0)
    return [khvd.callbacks.BroadcastGlobalVariablesCallback(0), khvd.callbacks.MetricAverageCallback(),
            khvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=3, verbose=1),
            khvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=lambda epoch: 0.5 ** epoch),
            khvd.elastic.CommitStateCallback(state, batches_per_commit=10),
            khvd.elastic.UpdateEpochStateCallback(state), khvd.elastic.UpdateBatchStateCallback(state)]
