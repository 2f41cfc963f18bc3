"""How a collective runs from TensorFlow: eagerly, as a graph op (one ``tf.py_function``) inside
``tf.function`` and TF1 sessions with their waits, and its errors as TensorFlow's."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from .. import _api
from .._engine.core import Abandoned
from .._engine.errors import CollectiveMismatchError, PeerError, RingError, StallError
from .._engine.progress import feeding as _feeding
from .._horovod.runtime_names import ProcessSet, global_process_set

# TensorFlow ships no annotations: its tensors, dtypes, shapes, graphs and ops are Any here.
_T = TypeVar("_T")
_A = TypeVar("_A")  # what _run hands its function: numpy arrays, or a graph op's eager tensors


def _dense(tensor: Any, where: str) -> Any:
    if isinstance(tensor, tf.IndexedSlices):
        return tf.convert_to_tensor(tensor)
    if isinstance(tensor, tf.SparseTensor):
        raise TypeError(f"{where}: tf.SparseTensor is not supported; pass tf.sparse.to_dense(x)")
    return tf.convert_to_tensor(tensor)


def _host(t: Any) -> npt.NDArray[Any]:
    """A numpy array of a tf tensor's values (bfloat16 as float32)."""
    arr = t.numpy() if hasattr(t, "numpy") else np.asarray(t)
    if arr.dtype.name == "bfloat16":
        arr = arr.astype(np.float32)
    # (np.ascontiguousarray would turn a 0-d array into shape (1,))
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


class _GraphDisagreementError(tf.errors.FailedPreconditionError, ValueError):  # type: ignore[misc]  # (TF's base)
    """Ranks disagree, inside a graph op: returned by the op's py_function, not raised (see
    _GraphErrors); a ValueError too, so that it arrives as InvalidArgumentError if it escapes."""

class _GraphInvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):  # type: ignore[misc]  # (TF's base)
    """Bad arguments found inside a graph op: a ValueError too, so that py_function reports
    InvalidArgumentError (see _GraphDisagreementError)."""


def _tf_error(exc: Exception, in_graph: bool = False, key: str | None = None) -> Any:  # (a tf.errors.OpError)
    """The TensorFlow exception Horovod raises for a runtime error (the message kept).

    A disagreement is FailedPreconditionError as in Horovod, eagerly and inside a graph op (a
    tf.function or a TF1 session: see _GraphErrors); in a TF1 session op (``key``) it also says
    how ops are matched between ranks, and how a session's threads can starve (_SessionOps).
    """
    message = f"{type(exc).__name__}: {exc}"
    if key is not None and isinstance(exc, CollectiveMismatchError) and str(exc).count("[graph op ") >= 2:
        # two session ops met: every rank waits, and no op is queued on every rank
        message += (
            f" (in the TF1 session op {key}.) A session op is matched by the place of its collective in the "
            "graph ([graph op N], counted as the ops are built), so every rank must build the same collectives "
            "in the same order and fetch the same ones in each session.run. If they do and the ops wait inline "
            "(JUPYTER_RING_TF_SESSION_WAIT=inline, or ops built inside a tf.cond branch), each rank's inter-op "
            "threads all waited for collectives the other ranks had not started yet: unset "
            "JUPYTER_RING_TF_SESSION_WAIT or set it to thread before building the graph (each op then "
            "waits on a thread of its own), or give the session more threads than the collective "
            "ops one session.run runs at once (tf.compat.v1.ConfigProto(inter_op_parallelism_threads=...), or "
            "TF_NUM_INTEROP_THREADS before the first session), or order the ops with tf.control_dependencies.")
    if isinstance(exc, (CollectiveMismatchError, PeerError)):
        cls = _GraphDisagreementError if in_graph else tf.errors.FailedPreconditionError
        return cls(None, None, message)
    if isinstance(exc, StallError):
        return tf.errors.DeadlineExceededError(None, None, message)
    if isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, RingError):
        cls = _GraphInvalidArgumentError if in_graph else tf.errors.InvalidArgumentError
        return cls(None, None, message)
    return tf.errors.UnknownError(None, None, message)


def _run(fn: Callable[[_A], _T], arrays: _A, process_set: ProcessSet | None,
         where: str, in_graph: bool = False, key: str | None = None) -> _T:
    """``fn(arrays)`` (numpy arrays, or a graph op's eager tensors) on ``process_set``'s runtime, errors as TF's.

    Eagerly and in a tf.function one op at a time (``_lock``); an op of a TF1 session (``key``)
    runs beside the session's other ops, its collectives named by ``key`` (see _SessionOps).
    """
    try:
        if key is None:
            with _lock:
                return fn(arrays)
        # other inter-op threads of the session may still queue collectives while this op waits
        with _session_ops.naming(key), _feeding():
            return fn(arrays)
    except tf.errors.OpError:
        raise
    except (RingError, ValueError, TypeError) as exc:
        raise _tf_error(exc, in_graph, key and f"{key}, {where}") from exc


class _SessionOps:
    """Names the collective ops built in TF1 session graphs, so that ranks may run them in any order.

    A session runs independent ops on its inter-op threads in any order, differently on each
    rank. Each collective op gets a key when it is built (graphs are built alike on every rank),
    and while it runs its collectives are queued under names made of that key
    (``name(...)``); the engine matches pending collectives between ranks by name (as Horovod
    does), so the ranks' orders need not agree. The danger: a py_function holds its inter-op
    thread while it waits, so a rank whose threads all wait for collectives the peers have not
    started cannot start theirs; the engine then fails those collectives on every rank (every
    rank blocked, and the queues no longer growing) and the error says so (_tf_error). By default
    (``JUPYTER_RING_TF_SESSION_WAIT`` unset or ``thread``) an op waits on a thread of its own
    instead (_SessionWaits): no starvation, at a higher cost per run; ``inline`` opts out.
    tf.function needs none of this: it runs py_functions in program order.
    """

    def __init__(self) -> None:
        self.built: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # graph -> collective ops built in it
        self.scope = threading.local()            # the key (and a counter) of the op this thread runs

    def key(self, where: str) -> str | None:
        """The op's key, or None when it does not run in a TF1 session."""
        if tf.executing_eagerly() or tf.compat.v1.executing_eagerly_outside_functions():
            return None
        graph = tf.compat.v1.get_default_graph()
        count = self.built.get(graph, 0)
        self.built[graph] = count + 1
        return f"graph op {count}"

    @contextlib.contextmanager
    def naming(self, key: str) -> Iterator[None]:
        """Collectives called in this thread meanwhile are named by ``key`` (see ``name``)."""
        scope = self.scope
        scope.key, scope.count = key, 0
        try:
            yield
        finally:
            scope.key = None

    def name(self, name: str | None) -> str | None:
        """``name`` as queued: unchanged outside a session op; inside one, unique to the op and
        the same on every rank (the op's key, and the call's place within the op)."""
        scope = self.scope
        key = getattr(scope, "key", None)
        if key is None:
            return name
        count = scope.count
        scope.count = count + 1
        return f"{name or 'unnamed'} [{key} #{count}]"


_session_ops = _SessionOps()
_n = _session_ops.name

# Eagerly and in tf.function, each op's collectives go to the runtime as one unit, one op at a
# time (TensorFlow may call eager ops from several threads); TF1 session ops do not take it.
_lock = threading.RLock()


class _GraphErrors:
    """Makes a graph op raise ranks' disagreement as FailedPreconditionError, as Horovod's does.

    TensorFlow's py_function kernel turns a Python exception into InvalidArgumentError (ValueError,
    TypeError), OutOfRangeError, ResourceExhaustedError, UnimplementedError or UnknownError; it
    never keeps an OpError's type. So a collective's py_function returns a disagreement instead of
    raising it: a flag, and a resource handle named by the message that no variable has. The
    graph reads that handle only when the flag is set, and TensorFlow's ReadVariableOp raises
    FailedPreconditionError "Could not find variable <the message>" on every rank that disagreed.
    """

    CONTAINER = "jupyter_ring"

    def __init__(self) -> None:
        self._ok: Any = None  # the handle returned on success (never read)

    def handle(self, message: str | None = None) -> Any:
        """An eager resource handle: named by ``message``, or the one unread handle for success."""
        if message is None:
            if self._ok is None:
                self._ok = self._named("jupyter_ring: no error")
            return self._ok
        return self._named(f"\n{message}\n")

    def _named(self, name: str) -> Any:
        return tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=name, container=self.CONTAINER)

    def py(self, body: Callable[..., Iterable[Any]], out_dtypes: Sequence[Any], out_shapes: Sequence[Any]) -> Callable[..., list[Any]]:
        """``body(*tensors) -> outputs`` as a py_function's function, whose outputs are followed by
        the flag and the handle: a _GraphDisagreementError it raises is returned there."""

        def py(*ts: Any) -> list[Any]:
            try:
                outs = list(body(*ts))
            except _GraphDisagreementError as exc:
                # placeholders of the declared shapes (unknown dimensions empty): never read, the
                # outputs wait for the check, which fails
                outs = [tf.zeros([d or 0 for d in s] if s is not None and s.rank is not None else [0], d)
                        for d, s in zip(out_dtypes, out_shapes)]
                return outs + [tf.constant(True), self.handle(str(exc))]
            return outs + [tf.constant(False), self.handle()]

        return py

    @staticmethod
    def tout(out_dtypes: Sequence[Any]) -> list[Any]:
        """The py_function's output dtypes: ``out_dtypes``, the flag and the handle."""
        return list(out_dtypes) + [tf.bool, tf.resource]

    def op(self, body: Callable[..., Iterable[Any]], tensors: Iterable[Any], out_dtypes: Sequence[Any],
           out_shapes: Sequence[Any]) -> list[Any]:
        """``body(*tensors) -> outputs`` as one tf.py_function; a _GraphDisagreementError it raises
        fails the graph with FailedPreconditionError, and no output is used before that check."""
        *outs, failed, handle = tf.py_function(self.py(body, out_dtypes, out_shapes), list(tensors),
                                               Tout=self.tout(out_dtypes))
        check = tf.cond(failed, lambda: tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32),
                        lambda: tf.constant(0, tf.int32))
        return self._after(check, outs, out_shapes)

    def checked(self, outs: list[Any], failed: Any, handle: Any, out_shapes: Sequence[Any]) -> list[Any]:
        """``outs`` once the check of ``failed`` and ``handle`` passed, in v1 control flow (Switch and
        Merge: no function added to the graph's library, unlike tf.cond's two); for a TF1 graph,
        not a function's."""
        _, on_failure = tf.raw_ops.Switch(data=handle, pred=failed)
        read = tf.raw_ops.ReadVariableOp(resource=on_failure, dtype=tf.int32)
        passed = tf.raw_ops.Identity(input=tf.raw_ops.Switch(data=tf.constant(0, tf.int32), pred=failed)[0])
        check, _ = tf.raw_ops.Merge(inputs=[read, passed])
        return self._after(check, outs, out_shapes)

    @staticmethod
    def _after(check: Any, outs: list[Any], out_shapes: Sequence[Any]) -> list[Any]:
        with tf.control_dependencies([check]):
            outs = [tf.identity(o) for o in outs]
        for o, shape in zip(outs, out_shapes):
            if shape is not None:
                o.set_shape(shape)
        return outs


_graph_errors = _GraphErrors()


def _call(fn: Callable[[list[npt.NDArray[Any]]], Sequence[Any]], tensors: Iterable[Any], out_dtypes: Sequence[Any],
          out_shapes: Sequence[Any], process_set: ProcessSet | None = global_process_set,
          where: str = "collective") -> list[Any]:
    """Run ``fn(list of numpy arrays) -> list of numpy arrays`` eagerly or as one tf.py_function.

    In a graph the op runs when the session (or function) runs it; ``tf.function`` orders
    py_functions as written, so every rank runs its collectives in the same order; in a TF1
    session the ranks may run independent ops in any order: their collectives are named by the
    op (_SessionOps).
    """
    tensors = list(tensors)
    if tf.executing_eagerly():
        outs = _run(fn, [_host(t) for t in tensors], process_set, where)
        return [tf.convert_to_tensor(np.asarray(o).astype(d.as_numpy_dtype) if d != tf.bfloat16 else o, dtype=d)
                for o, d in zip(outs, out_dtypes)]
    key = _session_ops.key(where)
    shapes = [tf.TensorShape(s) if s is not None else None for s in out_shapes]

    def py(*ts: Any) -> list[Any]:
        outs = _run(fn, [_host(t) for t in ts], process_set, where, in_graph=True, key=key)
        return [tf.cast(tf.convert_to_tensor(o), d) for o, d in zip(outs, out_dtypes)]

    return _graph_op(py, tensors, out_dtypes, shapes, key)


def _graph_op(py: Callable[..., list[Any]], tensors: Sequence[Any], out_dtypes: Sequence[Any],
              out_shapes: Sequence[Any],
              key: str | None) -> list[Any]:
    """``py(*eager tensors) -> outputs`` as a graph op: one py_function (which holds the thread that
    runs it: a tf.function runs them in program order), or in a TF1 session (``key``), unless
    ``JUPYTER_RING_TF_SESSION_WAIT=inline``, one that waits on a thread of its own (_SessionWaits)."""

    def guarded(*ts: Any) -> list[Any]:
        try:
            return py(*ts)
        except Abandoned as exc:  # the wait given up from another thread (engines._torch); a
            # KeyboardInterrupt (a tf.function's py_function runs in the caller's thread) stays one
            raise tf.errors.CancelledError(None, None, f"cancelled: {exc}") from None

    # (inside a function of a TF1 graph, a tf.cond branch say, ops wait inline: _GraphErrors.checked
    # is for the session's own graph)
    if (key is not None and out_dtypes and _session_wait() == "thread"
            and not tf.compat.v1.get_default_graph().building_function):
        return _session_waits.op(guarded, tensors, out_dtypes, out_shapes)
    return _graph_errors.op(guarded, tensors, out_dtypes, out_shapes)


_SESSION_WAITS = ("inline", "thread")


def _session_wait() -> str:
    """How a TF1 session op waits: ``thread`` (default: on a thread of its own, _SessionWaits) or
    ``inline`` (its py_function holds an inter-op thread), from ``JUPYTER_RING_TF_SESSION_WAIT``
    when the op is built. The thread wait cannot starve a session of any size; it costs ~0.2-0.5
    ms more an op than the inline wait (1.2-1.5x, docs/benchmarks.md), which may opt in where
    the session has threads enough."""
    wait = os.environ.get("JUPYTER_RING_TF_SESSION_WAIT", "").strip().lower() or "thread"
    if wait not in _SESSION_WAITS:
        raise ValueError(f"JUPYTER_RING_TF_SESSION_WAIT={wait!r}: expected one of {', '.join(_SESSION_WAITS)}; "
                         "'thread' makes every TF1 session op wait on a thread of its own")
    return wait


@dataclasses.dataclass(eq=False)
class _GraphWaits:
    """The session ops of one graph that wait on their own threads (_SessionWaits)."""

    # op number -> its py (eager tensors -> outputs)
    bodies: list[Callable[..., list[Any]]] = dataclasses.field(default_factory=list)
    # (input dtypes, output dtypes) -> the shared (concrete) function
    functions: dict[tuple[tuple[Any, ...], tuple[Any, ...]], Any] = dataclasses.field(default_factory=dict)

    def function(self, in_dtypes: Sequence[Any], out_dtypes: Sequence[Any]) -> Any:
        """The one function every op of this signature maps its (number, *inputs) element with."""
        signature = (tuple(in_dtypes), tuple(out_dtypes))
        function = self.functions.get(signature)
        if function is None:
            bodies = self.bodies

            def dispatch(number: Any, *ts: Any) -> list[Any]:
                return bodies[int(number)](*ts)

            def wait(number: Any, *ts: Any) -> Any:
                # the check comes after the dataset: the single-threaded executor that runs this
                # function runs no control flow (tf.cond's Switch)
                py = _graph_errors.py(dispatch, out_dtypes, [None] * len(out_dtypes))
                return tf.py_function(py, [number, *ts], Tout=_graph_errors.tout(out_dtypes))

            specs = [tf.TensorSpec([], tf.int64), *(tf.TensorSpec(None, d) for d in in_dtypes)]
            function = tf.function(wait, input_signature=specs, autograph=False).get_concrete_function()
            self.functions[signature] = function
        return function


class _SessionWaits:
    """Collective ops of TF1 session graphs that give their inter-op thread back while they wait
    (the default; ``JUPYTER_RING_TF_SESSION_WAIT=inline`` opts out).

    A py_function holds the inter-op thread that runs it until it returns, and a session's pool
    has one thread per CPU by default: a rank whose threads all waited for collectives the peers
    had not started could not start theirs (the peers' threads waiting likewise), so a
    ``session.run`` of more collective ops than threads could starve. Here an op is
    ``DatasetToSingleElement`` over ``MapDataset(TensorDataset((number, *inputs)), f)``:
    DatasetToSingleElement is an asynchronous kernel, which makes the dataset's one element on a
    thread of its own (one per op running) and gives the inter-op thread back meanwhile;
    ``use_inter_op_parallelism=False`` runs ``f`` on that thread too (else its py_function would
    take an inter-op thread again). ``f`` is one function per graph and dtype signature, shared by
    every op: a py_function that runs the op's body, found by the op's number, and returns a
    disagreement as _GraphErrors' ops do; the check follows the dataset, in Switch and Merge
    (_GraphErrors.checked). So an op adds a dozen nodes and no function to the graph's library, and a
    session's first run of a new op, which prepares executors over the whole library, costs no
    more with 100 ops built than with one. Each run makes the dataset anew: nothing of a failed or
    abandoned run reaches the next one. The cost, against the inline wait: TensorFlow's graph
    optimizer works longer on a new op's dataset nodes (its first run ~1.3-2x) and each run makes
    the dataset and hands over to a thread (~1.2-1.5x per op, +0.2-0.5 ms; docs/benchmarks.md).
    """

    def __init__(self) -> None:
        self.graphs: weakref.WeakKeyDictionary[Any, _GraphWaits] = weakref.WeakKeyDictionary()  # graph -> _GraphWaits

    def op(self, py: Callable[..., list[Any]], tensors: Iterable[Any], out_dtypes: Sequence[Any],
           out_shapes: Sequence[Any]) -> list[Any]:
        """``py(*eager tensors) -> outputs`` as this op, built in the default graph."""
        graph = tf.compat.v1.get_default_graph()
        waits = self.graphs.get(graph)
        if waits is None:
            waits = self.graphs[graph] = _GraphWaits()
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        function = waits.function([t.dtype for t in tensors], out_dtypes)
        # the dataset kernels are CPU-only, whatever device the user's scope names
        with tf.device("/device:CPU:0"):
            number = tf.constant(len(waits.bodies), tf.int64)
            waits.bodies.append(py)
            element = [number, *tensors]
            dataset = tf.raw_ops.TensorDataset(components=element, output_shapes=[t.shape for t in element])
            dataset = tf.raw_ops.MapDataset(
                input_dataset=dataset, other_arguments=[], f=function, output_types=_graph_errors.tout(out_dtypes),
                output_shapes=[tf.TensorShape(None)] * len(out_dtypes) + [[], []], use_inter_op_parallelism=False)
            # shapes unknown here (a failed op's placeholders are empty), set once checked
            *outs, failed, handle = tf.raw_ops.DatasetToSingleElement(
                dataset=dataset, output_types=_graph_errors.tout(out_dtypes),
                output_shapes=[tf.TensorShape(None)] * len(out_dtypes) + [[], []])
            return _graph_errors.checked(outs, failed, handle, out_shapes)


_session_waits = _SessionWaits()


def _ref(variable: Any) -> Hashable:
    """A hashable handle of a variable: TF's ``ref()``, or the object's id (Keras 3 variables)."""
    return variable.ref() if hasattr(variable, "ref") else id(variable)


def _set_size(process_set: ProcessSet | None) -> int:
    return _api.set_size(process_set, "process_set")


def _set_rank(process_set: ProcessSet | None) -> int:
    return _api.set_rank(process_set, "process_set")


def _suffix(name: str | None, suffix: str) -> str | None:
    return None if name is None else f"{name}.{suffix}"
