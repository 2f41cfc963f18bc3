"""``horovod.tensorflow.elastic`` and ``horovod.tensorflow.keras.elastic``: ``TensorFlowState``,
``TensorFlowKerasState`` (``KerasState``) and ``run`` (see ``_horovod.elastic``, ``_horovod.elastic_world``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import tensorflow as tf

from .._horovod import elastic as _elastic
from .._horovod.basics import HorovodInternalError
from .._horovod.elastic import ObjectState, State
from .._horovod.elastic_world import HostsUpdatedInterrupt, sync_root
from .._horovod.runtime_names import rank
from .functions import broadcast_object, broadcast_variables
from .util import build_optimizer, optimizer_variables

__all__ = ["State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "KerasState",
           "HostsUpdatedInterrupt", "run"]

# TensorFlow ships no annotations: variables, models, optimizers and sessions are Any here.
_S = TypeVar("_S", bound=State)   # the state the training function takes
_P = ParamSpec("_P")              # its other arguments
_R = TypeVar("_R")                # what it returns

class _VariablesState(ObjectState):
    """Variables whose values are copied at ``commit``, assigned back at ``restore`` and
    broadcast from rank 0 at ``sync``, plus picklable attributes. ``_vars()`` is read each time:
    an optimizer creates its slots at its first step."""

    def __init__(self, session: Any = None, **kwargs: Any) -> None:
        self._session = session
        self._saved_values: list[tuple[Any, Any]] = []
        super().__init__(bcast_object=lambda obj, root=0: broadcast_object(obj, root, name="elastic.state"),
                         get_rank=rank, **kwargs)
        self._saved_values = self._read()

    def _vars(self) -> list[Any]:
        raise NotImplementedError

    def _read(self) -> list[tuple[Any, Any]]:
        """[(variable, its value now)] of every variable of the state."""
        variables = self._vars()
        values = [v.numpy() for v in variables] if tf.executing_eagerly() else self._run(variables)
        return list(zip(variables, values))

    def _run(self, fetches: Any) -> Any:
        session = self._session or tf.compat.v1.get_default_session()
        if session is None:
            raise ValueError("elastic state in a TF1 graph: pass session= (or run it under a default session)")
        return session.run(fetches)

    def save(self) -> None:
        """Copy the variables' values and the attributes."""
        self._saved_values = self._read()
        super().save()

    def restore(self) -> None:
        """Assign the copies back; the attributes as saved."""
        for v, value in self._saved_values:
            if tf.executing_eagerly():
                v.assign(value)
            else:
                v.load(value, self._session or tf.compat.v1.get_default_session())
        super().restore()

    def sync(self) -> None:
        """Rank 0's variables and attributes on every rank (one broadcast op, one object), saved."""
        variables = self._vars()
        if variables:
            if tf.executing_eagerly():
                broadcast_variables(variables, root_rank=sync_root())
            else:
                self._run(broadcast_variables(variables, root_rank=sync_root()))
        self._saved_values = self._read()  # restore() before any commit comes back here (as Horovod)
        super().sync()


class TensorFlowState(_VariablesState):
    """TensorFlow variables (all global variables in a TF1 graph when None) and picklable
    attributes, kept alike on every rank (Horovod's TensorFlowState)."""

    def __init__(self, variables: Iterable[Any] | None = None, session: Any = None, **kwargs: Any) -> None:
        self.variables = list(variables) if variables else tf.compat.v1.global_variables()
        self.session = session
        super().__init__(session, **kwargs)

    def _vars(self) -> list[Any]:
        return self.variables


class TensorFlowKerasState(_VariablesState):
    """A Keras model, its optimizer (the model's when None) and picklable attributes, kept alike
    on every rank (Horovod's TensorFlowKerasState; ``backend`` is accepted, Keras 3 needs none)."""

    # (set with object.__setattr__ before ObjectState's own attributes exist)
    model: Any
    optimizer: Any
    backend: Any

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise ValueError(f"TensorFlowKerasState: model {getattr(model, 'name', model)!r} must be built first: "
                             "run model.build(input_shape), or call it once on a batch")
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer if optimizer is not None else getattr(model, "optimizer", None))
        object.__setattr__(self, "backend", backend)
        super().__init__(None, **kwargs)

    def _vars(self) -> list[Any]:
        optimizer = self.optimizer
        if optimizer is None:
            return list(self.model.variables)
        # built before it is read: a rank that never stepped (a newcomer synced from the
        # survivors) holds the same variables as one that did, in the same order
        build_optimizer(optimizer, self.model.trainable_variables)
        return list(self.model.variables) + optimizer_variables(optimizer)


KerasState = TensorFlowKerasState


def run(func: Callable[Concatenate[_S, _P], _R], reset_limit: int | None = None) -> Callable[Concatenate[_S, _P], _R]:
    """Decorate ``train(state, ...)``: sync, run, and after ``HorovodInternalError`` restore the
    last commit and retry, after ``HostsUpdatedInterrupt`` reset and go on (see _elastic.run_fn).

    As Horovod's, a TensorFlow error that a failed collective became (eagerly, in a
    ``tf.function``, in ``model.fit``) counts as ``HorovodInternalError``.
    """
    @functools.wraps(func)
    def wrapper(state: _S, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            if _from_internal_error(exc):
                raise HorovodInternalError(f"{type(exc).__name__}: {exc.message}") from exc
            raise
    # (``state`` may also come by keyword, as in Horovod: Concatenate's first argument is positional)
    return _elastic.run_fn(cast("Callable[Concatenate[_S, _P], _R]", wrapper), lambda: None, reset_limit)


def _from_internal_error(exc: Any) -> bool:  # (a tf.errors.OpError)
    """Whether a TensorFlow error came from a ``HorovodInternalError`` (or a subclass): its cause
    eagerly; inside a graph op (a py_function keeps no type) its message, "<ErrorClass>: ..."."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, HorovodInternalError):
            return True
        seen = seen.__cause__ or seen.__context__
    names: set[str] = set()
    todo: list[type[BaseException]] = [HorovodInternalError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return any(f"{name}: " in (exc.message or "") for name in names)
