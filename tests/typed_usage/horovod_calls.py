"""Calls users write against jupyter_ring's typed public API, as Horovod's documentation shows
them: type-checked by mypy (``files`` in pyproject.toml, run by scripts/test.sh), never run.

A public annotation that refuses one of these calls is a bug of the annotation (``mypy`` fails).
"""

from __future__ import annotations

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
