"""Variables and objects made equal on every rank: ``broadcast_variables``, ``broadcast_object``,
``BroadcastGlobalVariablesHook`` ..."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import tensorflow as tf

from ... import runtime as _ring
from .._horovod.runtime_names import ProcessSet, global_process_set
from ._execution import _lock
from .mpi_ops import _broadcast_values, _read

__all__ = ["broadcast_variables", "broadcast_global_variables", "broadcast_object_fn",
           "broadcast_object", "allgather_object", "BroadcastGlobalVariablesHook"]

# TensorFlow ships no annotations: variables, ops and sessions are Any here.
_T = TypeVar("_T")


# ------------------------------------------------------------------ variables, objects
def broadcast_variables(variables: Iterable[Any], root_rank: int = 0,
                        process_set: ProcessSet | None = global_process_set, inplace: bool = False) -> Any:
    """Give every rank root's values of ``variables``; in a graph, returns the op that does it."""
    variables = list(variables)
    if not variables:
        return tf.no_op() if not tf.executing_eagerly() else None
    values = _broadcast_values([_read(v) for v in variables], root_rank, "broadcast_variables", process_set)
    if tf.executing_eagerly():
        for v, x in zip(variables, values):
            v.assign(x)
        return None
    return tf.group(*[tf.compat.v1.assign(v, x) for v, x in zip(variables, values)])


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graph mode: the op that gives every rank root's values of every global variable."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet | None = global_process_set) -> Callable[[_T], _T]:
    """A function ``f(obj)`` returning root's ``obj`` on every rank (``session`` is not needed)."""
    def bcast(obj: _T) -> _T:
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)
    return bcast


def broadcast_object(obj: _T, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet | None = global_process_set) -> _T:
    """Root's picklable object, returned on every rank of ``process_set``."""
    with _lock:
        return _ring.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: _T, session: Any = None, name: str | None = None,
                     process_set: ProcessSet | None = global_process_set) -> list[_T]:
    """Every rank's picklable object, as a list in rank order."""
    with _lock:
        return _ring.allgather_object(obj, name, process_set)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):  # type: ignore[misc]  # (TF's base)
    """SessionRunHook giving every rank root's global variables once the session exists.

    For ``MonitoredTrainingSession`` in TF1 graph mode: random initial weights, or a checkpoint
    restored on rank 0, become everyone's.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None
        self.device = device

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
