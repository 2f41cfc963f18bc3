"""``ring.elastic``: Horovod's elastic loop for code without a framework (numpy arrays, plain values).

::

    state = ring.elastic.ObjectState(w=np.zeros(10), epoch=0, batch=0)

    @ring.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, 5):
            ...  # state.w -= lr * ring.allreduce(grad, name="g")
            state.commit()

    train(state)

``run`` syncs the state from rank 0 (from the first survivor after a rank was replaced in
place), calls ``train``, and when a collective fails on every rank (``HorovodInternalError``,
also ``RankLostError`` when a rank died in a notebook cluster) restores the last commit, resets
the world and retries; see the torch, tensorflow and keras adapters' ``elastic`` modules for
their framework states. Unlike Horovod's ``ObjectState``, ``commit`` keeps a deep copy of each
value, so an array changed in place (``state.w -= ...``) is rolled back by ``restore`` as well.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from . import _api
from ._engine.errors import HorovodInternalError, RankLostError
from ._horovod import elastic as _elastic
from ._horovod.elastic import State
from ._horovod.elastic_world import HostsUpdatedInterrupt

__all__ = ["State", "ObjectState", "run", "HorovodInternalError", "RankLostError", "HostsUpdatedInterrupt"]

_T = TypeVar("_T")
_S = TypeVar("_S", bound=State)   # the state the training function takes
_P = ParamSpec("_P")              # its other arguments
_R = TypeVar("_R")                # what it returns


class ObjectState(_elastic.ObjectState):
    """Picklable values kept alike on every rank as attributes (``state.w``, ``state.epoch``).

    ``commit()`` saves a deep copy of every value, ``restore()`` puts the copies back, ``sync()``
    gives every rank the sync root's saved values (one ``broadcast_object``).
    """

    def __init__(self, **values: Any) -> None:
        super().__init__(bcast_object=_broadcast, get_rank=_api.rank, **values)
        self.save()

    def save(self) -> None:
        """Keep a deep copy of every attribute's current value."""
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        """Set every attribute back to a copy of its value at the last commit."""
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


def _broadcast(obj: _T, root: int = 0) -> _T:
    return _api.broadcast_object(obj, root, name="elastic.ObjectState")


def run(func: Callable[Concatenate[_S, _P], _R], reset_limit: int | None = None) -> Callable[Concatenate[_S, _P], _R]:
    """Decorate ``train(state, ...)``: sync the state, run, and after ``HorovodInternalError``
    restore the last commit and retry (after ``HostsUpdatedInterrupt``: reset and go on).
    More than ``reset_limit`` failures in a row with no commit between them raise the last."""
    return _elastic.run_fn(func, _reset, reset_limit)


def _reset() -> None:
    """Nothing beyond the runtime's own reset (``_horovod.elastic.reset_world``)."""
