"""Horovod's TensorFlow API on jupyter_ring's ring runtime: change only the import line.

::

    import jupyter_ring.runtime.tensorflow as hvd

    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

Works eagerly, inside ``tf.function`` and in TF1 graph mode (``tf.compat.v1`` sessions,
``MonitoredTrainingSession``, ``hvd.DistributedOptimizer`` around a ``tf.compat.v1.train``
optimizer, ``hvd.BroadcastGlobalVariablesHook``). Tensors cross into the runtime as numpy arrays:
eagerly through ``tensor.numpy()``, in a graph through one ``tf.py_function`` per collective (so
XLA-compiled functions, ``jit_compile=True``, cannot contain them). Every collective has
Horovod's gradient. Errors are TensorFlow's: ranks that disagree raise
``tf.errors.FailedPreconditionError`` on every rank (inside a graph op through a failed variable
read, since py_function keeps no error type: see _GraphErrors), bad arguments found while running raise
``tf.errors.InvalidArgumentError``, a stall ``tf.errors.DeadlineExceededError`` (``UnknownError``
inside a graph op). bfloat16 travels
as float32; GPU tensors are staged through host memory. For Keras ``model.fit`` see
:mod:`jupyter_ring.runtime.keras`.

Keras is ``tf.keras``, as in Horovod: Keras 3, or Keras 2 (the ``tf_keras`` package) when
``TF_USE_LEGACY_KERAS=1`` is set before TensorFlow is imported. ``SyncBatchNormalization`` and
``DistributedOptimizer`` around a Keras optimizer follow that choice (see ``_keras2``).
"""

try:
    import tensorflow as tf
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the tensorflow adapter needs tensorflow: pip install 'jupyter_ring[tensorflow]'") from exc

import contextlib
import dataclasses
import os
import sys
import threading
import weakref
import zlib

import keras
import numpy as np

from ... import runtime as _ring
from .. import _api
from .._horovod.runtime_names import *  # noqa: F403 - init, rank, ops, errors, ...: as in the numpy API
from .._horovod.runtime_names import __all__ as _COMMON
from .._engine.core import Abandoned
from .._engine.errors import PeerError
from .._horovod.basics import *  # noqa: F403 - capability functions, process sets, timeline, join
from .._horovod.basics import __all__ as _HOROVOD
from .._horovod.basics import adasum_combine, reduce_plan
from .._horovod.basics import init as _init
from .._engine.progress import feeding as _feeding
from . import elastic  # Horovod's elastic API for a fixed world

__all__ = [
    *_COMMON, *(name for name in _HOROVOD if name not in _COMMON), "elastic", "Compression", "NoneCompressor", "FP16Compressor", "allreduce",
    "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "broadcast_variables", "broadcast_global_variables",
    "broadcast_object_fn", "size_op", "rank_op", "local_size_op", "local_rank_op", "process_set_included_op",
    "BroadcastGlobalVariablesHook", "DistributedOptimizer", "DistributedGradientTape",
    "PartialDistributedGradientTape", "SyncBatchNormalization",
]


def _which_keras():
    """(``tf.keras``'s module, whether it is Keras 2): Keras 2 is the ``tf_keras`` package, which
    TensorFlow >= 2.16 gives as ``tf.keras`` when TF_USE_LEGACY_KERAS=1 was set before its import."""
    try:
        module = tf.keras   # its name is "tensorflow.keras" once a script imported from that path
        legacy = module.layers.Layer.__module__.startswith("tf_keras.")
    except ImportError as exc:  # TF_USE_LEGACY_KERAS is set but tf_keras is missing
        raise ImportError(f"TF_USE_LEGACY_KERAS={os.environ.get('TF_USE_LEGACY_KERAS')!r} asks TensorFlow for "
                          f"Keras 2, which is the tf_keras package: pip install 'tf_keras~={tf.__version__}' "
                          "(or unset TF_USE_LEGACY_KERAS to use Keras 3)") from exc
    return (module if legacy else keras), legacy


def _optimizer_variables(optimizer):
    """A Keras optimizer's variables: a property in Keras 3 and Keras 2, a method of Keras 2's
    legacy optimizers (``tf.keras.optimizers.legacy``)."""
    found = optimizer.variables
    return list(found() if callable(found) and not isinstance(found, list) else found)


# Keras as the user's tf.keras sees it: Keras 3 (the keras package), or Keras 2 (tf_keras)
_K, LEGACY_KERAS = _which_keras()

# TF1 sessions created after init() in graph code get at least this many inter-op threads (see init)
_SESSION_THREADS = 64


def init(comm=None, process_sets=None, **config):
    """Start the runtime on every rank (``comm``: an mpi4py communicator) and register ``process_sets``.

    A TF1 session op waits for the other ranks on a thread of its own by default
    (_SessionWaits), so a session of any size runs any number of them. An op that waits inline
    (``JUPYTER_RING_TF_SESSION_WAIT=inline``, or one built inside a function of the graph, a
    ``tf.cond`` branch say) holds one of the session's inter-op threads while it waits, and
    TensorFlow's default (the CPU count) starves when one ``session.run`` runs more of those than
    that: so in TF1 graph code (eager execution disabled when ``init`` runs) ``init`` sets
    ``TF_NUM_INTEROP_THREADS`` to ``_SESSION_THREADS`` (or the CPU count, if larger) unless it is
    set. That counts only where no session existed yet in the process (TensorFlow sizes its
    shared pool once, at the first) and for sessions whose ConfigProto leaves
    ``inter_op_parallelism_threads`` at 0.
    """
    if not tf.compat.v1.executing_eagerly_outside_functions() and "TF_NUM_INTEROP_THREADS" not in os.environ:
        os.environ["TF_NUM_INTEROP_THREADS"] = str(max(_SESSION_THREADS, os.cpu_count() or 1))
    _init(comm, process_sets, **config)


# ------------------------------------------------------------------ compression
class NoneCompressor:
    """No compression: tensors travel in their own dtype."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Gradient compression for allreduce: ``Compression.none`` or ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


# ------------------------------------------------------------------ tensor <-> numpy, errors
def _executing_eagerly():
    """Whether TensorFlow runs eagerly here (False inside tf.function and TF1 graphs)."""
    return tf.executing_eagerly()


def _dense(tensor, where):
    if isinstance(tensor, tf.IndexedSlices):
        return tf.convert_to_tensor(tensor)
    if isinstance(tensor, tf.SparseTensor):
        raise TypeError(f"{where}: tf.SparseTensor is not supported; pass tf.sparse.to_dense(x)")
    return tf.convert_to_tensor(tensor)


def _host(t):
    """A numpy array of a tf tensor's values (bfloat16 as float32)."""
    arr = t.numpy() if hasattr(t, "numpy") else np.asarray(t)
    if arr.dtype.name == "bfloat16":
        arr = arr.astype(np.float32)
    # (np.ascontiguousarray would turn a 0-d array into shape (1,))
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


class _GraphDisagreementError(tf.errors.FailedPreconditionError, ValueError):
    """Ranks disagree, inside a graph op: returned by the op's py_function, not raised (see
    _GraphErrors); a ValueError too, so that it arrives as InvalidArgumentError if it escapes."""


class _GraphInvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """Bad arguments found inside a graph op: a ValueError too, so that py_function reports
    InvalidArgumentError (see _GraphDisagreementError)."""


def _tf_error(exc, in_graph=False, key=None):
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


def _run(fn, arrays, process_set, where, in_graph=False, key=None):
    """``fn(arrays)`` on ``process_set``'s runtime, errors as TF's.

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

    def __init__(self):
        self.built = weakref.WeakKeyDictionary()  # graph -> collective ops built in it
        self.scope = threading.local()            # the key (and a counter) of the op this thread runs

    def key(self, where):
        """The op's key, or None when it does not run in a TF1 session."""
        if tf.executing_eagerly() or tf.compat.v1.executing_eagerly_outside_functions():
            return None
        graph = tf.compat.v1.get_default_graph()
        count = self.built.get(graph, 0)
        self.built[graph] = count + 1
        return f"graph op {count}"

    @contextlib.contextmanager
    def naming(self, key):
        """Collectives called in this thread meanwhile are named by ``key`` (see ``name``)."""
        scope = self.scope
        scope.key, scope.count = key, 0
        try:
            yield
        finally:
            scope.key = None

    def name(self, name):
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

    def __init__(self):
        self._ok = None  # the handle returned on success (never read)

    def handle(self, message=None):
        """An eager resource handle: named by ``message``, or the one unread handle for success."""
        if message is None:
            if self._ok is None:
                self._ok = self._named("jupyter_ring: no error")
            return self._ok
        return self._named(f"\n{message}\n")

    def _named(self, name):
        return tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=name, container=self.CONTAINER)

    def py(self, body, out_dtypes, out_shapes):
        """``body(*tensors) -> outputs`` as a py_function's function, whose outputs are followed by
        the flag and the handle: a _GraphDisagreementError it raises is returned there."""

        def py(*ts):
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
    def tout(out_dtypes):
        """The py_function's output dtypes: ``out_dtypes``, the flag and the handle."""
        return list(out_dtypes) + [tf.bool, tf.resource]

    def op(self, body, tensors, out_dtypes, out_shapes):
        """``body(*tensors) -> outputs`` as one tf.py_function; a _GraphDisagreementError it raises
        fails the graph with FailedPreconditionError, and no output is used before that check."""
        *outs, failed, handle = tf.py_function(self.py(body, out_dtypes, out_shapes), list(tensors),
                                               Tout=self.tout(out_dtypes))
        check = tf.cond(failed, lambda: tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32),
                        lambda: tf.constant(0, tf.int32))
        return self._after(check, outs, out_shapes)

    def checked(self, outs, failed, handle, out_shapes):
        """``outs`` once the check of ``failed`` and ``handle`` passed, in v1 control flow (Switch and
        Merge: no function added to the graph's library, unlike tf.cond's two); for a TF1 graph,
        not a function's."""
        _, on_failure = tf.raw_ops.Switch(data=handle, pred=failed)
        read = tf.raw_ops.ReadVariableOp(resource=on_failure, dtype=tf.int32)
        passed = tf.raw_ops.Identity(input=tf.raw_ops.Switch(data=tf.constant(0, tf.int32), pred=failed)[0])
        check, _ = tf.raw_ops.Merge(inputs=[read, passed])
        return self._after(check, outs, out_shapes)

    @staticmethod
    def _after(check, outs, out_shapes):
        with tf.control_dependencies([check]):
            outs = [tf.identity(o) for o in outs]
        for o, shape in zip(outs, out_shapes):
            if shape is not None:
                o.set_shape(shape)
        return outs


_graph_errors = _GraphErrors()


def _call(fn, tensors, out_dtypes, out_shapes, process_set=global_process_set, where="collective"):
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

    def py(*ts):
        outs = _run(fn, [_host(t) for t in ts], process_set, where, in_graph=True, key=key)
        return [tf.cast(tf.convert_to_tensor(o), d) for o, d in zip(outs, out_dtypes)]

    return _graph_op(py, tensors, out_dtypes, shapes, key)


def _graph_op(py, tensors, out_dtypes, out_shapes, key):
    """``py(*eager tensors) -> outputs`` as a graph op: one py_function (which holds the thread that
    runs it: a tf.function runs them in program order), or in a TF1 session (``key``), unless
    ``JUPYTER_RING_TF_SESSION_WAIT=inline``, one that waits on a thread of its own (_SessionWaits)."""

    def guarded(*ts):
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


def _session_wait():
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

    bodies: list = dataclasses.field(default_factory=list)     # op number -> its py (eager tensors -> outputs)
    functions: dict = dataclasses.field(default_factory=dict)  # (input dtypes, output dtypes) -> shared function

    def function(self, in_dtypes, out_dtypes):
        """The one function every op of this signature maps its (number, *inputs) element with."""
        signature = (tuple(in_dtypes), tuple(out_dtypes))
        function = self.functions.get(signature)
        if function is None:
            bodies = self.bodies

            def dispatch(number, *ts):
                return bodies[int(number)](*ts)

            def wait(number, *ts):
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

    def __init__(self):
        self.graphs = weakref.WeakKeyDictionary()  # graph -> _GraphWaits

    def op(self, py, tensors, out_dtypes, out_shapes):
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


def _ref(variable):
    """A hashable handle of a variable: TF's ``ref()``, or the object's id (Keras 3 variables)."""
    return variable.ref() if hasattr(variable, "ref") else id(variable)


def _set_size(process_set):
    return _api.set_size(process_set, "process_set")


def _set_rank(process_set):
    return _api.set_rank(process_set, "process_set")


def _suffix(name, suffix):
    return None if name is None else f"{name}.{suffix}"


# ------------------------------------------------------------------ allreduce
def _allreduce_arrays(arrays, op, prescale, postscale, names, n, process_set):
    """Allreduce numpy arrays, queued together so that the runtime fuses them (Horovod's scaling
    of integer tensors: in float64, truncated, done around the runtime's sum)."""
    if op == Adasum:
        if n & (n - 1):
            raise NotImplementedError(f"Running Adasum with non-power of 2 ranks is not supported yet ({n} ranks)")
        return [adasum_combine(_ring.allgather(a.reshape(1, -1), name=_n(nm), process_set=process_set))
                .astype(a.dtype).reshape(a.shape)
                for a, nm in zip(arrays, names)]
    plans = [reduce_plan(a, op, prescale, postscale, n) for a in arrays]
    handles = [_ring.allreduce_async(p.staged, op=p.op, name=_n(nm), prescale_factor=p.pre, postscale_factor=p.post,
                                     process_set=process_set)
               for p, nm in zip(plans, names)]
    return [p.finish(_ring.synchronize(h)) for p, h in zip(plans, handles)]


def _allreduce_list(tensors, op, prescale, postscale, names, process_set=global_process_set):
    """One fused allreduce of a list of dense tensors; differentiable (the gradient is reduced alike)."""
    n = _set_size(process_set)
    where = f"allreduce '{names[0] if names else None}'"

    @tf.custom_gradient
    def reduce(*ts):
        outs = _call(lambda arrays: _allreduce_arrays(arrays, op, prescale, postscale, names, n, process_set), ts,
                     [t.dtype for t in ts], [t.shape for t in ts], process_set, where)

        def grad(*dys):
            dys = [tf.convert_to_tensor(d) for d in dys]
            return _call(lambda arrays: _allreduce_arrays(arrays, op, prescale, postscale,
                                                          [_suffix(nm, "grad") for nm in names], n, process_set),
                         dys, [d.dtype for d in dys], [d.shape for d in dys], process_set, where)
        return list(outs), grad
    if not tensors:
        return []
    return list(reduce(*tensors))


def _check_sparse_op(op, prescale, postscale, where):
    if op == Adasum:
        raise NotImplementedError(f"{where}: The Adasum reduction does not currently support sparse tensors. As a "
                                  "workaround please pass sparse_as_dense=True to DistributedOptimizer")
    if op not in (Sum, Average):
        raise NotImplementedError(f"{where}: Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError(f"{where}: Pre/postscale_factor are not supported with tf.IndexedSlices")


def _allreduce_slices(slices, op, names, process_set, dense=(), prescale=1.0, postscale=1.0):
    """tf.IndexedSlices reduced as Horovod does: allgather the values and the indices; ``dense``
    tensors (with ``op`` and the factors) are allreduced in the same graph op, so that a TF1
    session cannot run the parts in a different order on each rank. Returns (slices, dense)."""
    n = _set_size(process_set)
    base = names[0] or "indexed_slices"
    parts = [t for s in slices for t in (s.values, tf.cast(s.indices, tf.int64))]
    part_names = [f"{base}.{i}.{'values' if i % 2 == 0 else 'indices'}" for i in range(len(parts))]
    dense = list(dense)
    dense_names = [f"{base}.dense.{i}" for i in range(len(dense))]

    def fn(arrays):
        handles = [_ring.allgather_async(a, _n(nm), process_set) for a, nm in zip(arrays, part_names)]
        reduced = _allreduce_arrays(arrays[len(parts):], op, prescale, postscale, dense_names, n, process_set)
        return [_ring.synchronize(h) for h in handles] + reduced
    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in parts] + [t.shape for t in dense]
    outs = _call(fn, parts + dense, [t.dtype for t in parts + dense], shapes, process_set, "allgather")
    gathered, reduced = outs[:len(parts)], outs[len(parts):]
    result = []
    for k, s in enumerate(slices):
        values, indices = gathered[2 * k], gathered[2 * k + 1]
        if op == Average:
            values = values / tf.cast(n, values.dtype)
        result.append(tf.IndexedSlices(values, tf.cast(indices, s.indices.dtype), dense_shape=s.dense_shape))
    return result, list(reduced)


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none,
              op=None, prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce ``tensor`` over all ranks (default: Average); differentiable, works in graphs.

    A ``tf.IndexedSlices`` is reduced by allgathering its values and indices (Sum or Average).
    """
    where = f"allreduce '{name}'"
    op = _api.resolve_op(op, average, where)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse_op(op, prescale_factor, postscale_factor, where)
        return _allreduce_slices([tensor], op, [name], process_set)[0][0]
    tensor = _dense(tensor, where)
    compressed, ctx = compression.compress(tensor)
    out = _allreduce_list([compressed], op, prescale_factor, postscale_factor, [name], process_set)[0]
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Allreduce a list of tensors in one fused pass; returns a list (IndexedSlices allgathered)."""
    if not tensors:
        return tensors
    where = f"grouped_allreduce '{name}'"
    op = _api.resolve_op(op, average, where)
    slices = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out = [None] * len(tensors)
    if slices:
        # slices and dense tensors in one op (not differentiable: sparse reductions have no gradient)
        _check_sparse_op(op, prescale_factor, postscale_factor, where)
        pairs = [compression.compress(_dense(tensors[i], f"{where} tensor {i}")) for i in dense]
        reduced, reduced_dense = _allreduce_slices([tensors[i] for i in slices], op, [_suffix(name, "slices")],
                                                   process_set, [c for c, _ in pairs], prescale_factor,
                                                   postscale_factor)
        for i, r in zip(slices, reduced):
            out[i] = r
        for i, r, (_, ctx) in zip(dense, reduced_dense, pairs):
            out[i] = compression.decompress(r, ctx)
        return out
    if dense:
        pairs = [compression.compress(_dense(tensors[i], f"{where} tensor {i}")) for i in dense]
        names = [_suffix(name, str(i)) for i in dense]
        reduced = _allreduce_list([c for c, _ in pairs], op, prescale_factor, postscale_factor, names, process_set)
        for i, r, (_, ctx) in zip(dense, reduced, pairs):
            out[i] = compression.decompress(r, ctx)
    return out


# ------------------------------------------------------------------ allgather, broadcast, ...
def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's tensors concatenated along dim 0, for each tensor of a list; differentiable."""
    if not tensors:
        return []
    where = f"grouped_allgather '{name}'"
    tensors = [_dense(t, f"{where} tensor {i}") for i, t in enumerate(tensors)]
    for i, t in enumerate(tensors):
        if t.shape.rank == 0:
            raise ValueError(f"{where} tensor {i}: needs at least one dimension; pass tf.reshape(x, [1])")
    names = [name if len(tensors) == 1 else _suffix(name, str(i)) for i in range(len(tensors))]

    def fn(arrays):
        handles = [_ring.allgather_async(a, _n(nm), process_set) for a, nm in zip(arrays, names)]
        return [_ring.synchronize(h) for h in handles]

    @tf.custom_gradient
    def gather(*ts):
        shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in ts]
        outs = _call(fn, ts, [t.dtype for t in ts], shapes, process_set, where)

        def grad(*dys):
            # one op: average the gradients, learn every rank's rows, keep this rank's
            dys = [tf.convert_to_tensor(d) for d in dys]
            rows = tf.stack([tf.shape(t, out_type=tf.int64)[0] for t in ts])
            grad_names = [_suffix(nm, "grad") for nm in names]
            rank = _set_rank(process_set)

            def grad_fn(arrays):
                *grads, mine = arrays
                handles = [_ring.allreduce_async(g, name=_n(nm), process_set=process_set)
                           for g, nm in zip(grads, grad_names)]
                counts = _ring.allgather(mine.reshape(1, -1), name=_n(_suffix(names[0], "grad.rows")),
                                         process_set=process_set)
                starts = counts[:rank].sum(axis=0)
                return [_ring.synchronize(h)[starts[i]:starts[i] + mine[i]] for i, h in enumerate(handles)]
            shapes = [t.shape for t in ts]
            return _call(grad_fn, dys + [rows], [d.dtype for d in dys], shapes, process_set, "allgather")
        return list(outs), grad
    return list(gather(*tensors))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's tensor concatenated along dim 0 (which may differ between ranks); differentiable."""
    return grouped_allgather([tensor], name=name, process_set=process_set)[0]


def broadcast(tensor, root_rank=0, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Root's tensor (``root_rank``: a global rank), returned on every rank; differentiable
    (the root's gradient is the average of every rank's, the others' zero)."""
    where = f"broadcast '{name}'"
    tensor = _dense(tensor, where)

    @tf.custom_gradient
    def bcast(t):
        out = _call(lambda a: [_ring.broadcast(a[0], root_rank, _n(name), process_set).reshape(a[0].shape)], [t],
                    [t.dtype], [t.shape], process_set, where)[0]

        def grad(dy):
            g = _allreduce_list([tf.convert_to_tensor(dy)], Average, 1.0, 1.0, [_suffix(name, "grad")],
                                process_set)[0]
            if _ring.rank() == root_rank:
                return g
            # zeros that still depend on g: every rank runs the gradient's allreduce (a plain
            # zeros_like of a known shape is a constant, and the root would wait alone)
            with tf.control_dependencies([g]):
                return tf.zeros_like(g)
        return out, grad
    return bcast(tensor)


def _read(variable):
    return variable.read_value() if hasattr(variable, "read_value") else tf.convert_to_tensor(variable)


def _broadcast_values(values, root_rank, name, process_set):
    """Root's values of a list of tensors, in one collective op (queued broadcasts, fused order)."""
    where = f"broadcast '{name}'"
    names = [_suffix(name, str(i)) for i in range(len(values))]

    def fn(arrays):
        handles = [_ring.broadcast_async(a, root_rank, _n(nm), process_set) for a, nm in zip(arrays, names)]
        return [_ring.synchronize(h).reshape(a.shape) for a, h in zip(arrays, handles)]
    return _call(fn, values, [v.dtype for v in values], [v.shape for v in values], process_set, where)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast: every rank's variables take root's values; returns their new values."""
    variables = list(variables)
    if not variables:
        return []
    values = _broadcast_values([_read(v) for v in variables], root_rank, name or "broadcast_", process_set)
    if tf.executing_eagerly():
        for v, x in zip(variables, values):
            v.assign(x)
        return variables
    return [tf.compat.v1.assign(v, x) for v, x in zip(variables, values)]


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send ``splits[q]`` rows to rank q and receive theirs; differentiable.

    Returns ``(output, received_splits)`` when ``splits`` is given, else ``output`` (dim 0 must
    then be divisible by the number of ranks), as Horovod.
    """
    where = f"alltoall '{name}'"
    tensor = _dense(tensor, where)
    if tensor.shape.rank == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension, got a scalar")
    split_tensor = tf.zeros([0], tf.int32) if splits is None else tf.cast(splits, tf.int32)

    def fn(arrays):
        out, received = _ring.alltoall(arrays[0], None if splits is None else arrays[1], _n(name), process_set)
        return [out, np.asarray(received, np.int32)]

    @tf.custom_gradient
    def a2a(t, s):
        shape = tf.TensorShape([None]).concatenate(t.shape[1:])
        out, received = _call(fn, [t, s], [t.dtype, tf.int32], [shape, tf.TensorShape([None])], process_set, where)

        def grad(dy, _dsplits):
            g, _ = alltoall(tf.convert_to_tensor(dy), splits=received, name=_suffix(name, "grad"),
                            process_set=process_set)
            return g, None
        return (out, received), grad
    out, received = a2a(tensor, split_tensor)
    return out if splits is None else (out, received)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Reduce each tensor over ranks and return this rank's block of dim 0 of each; differentiable."""
    if not tensors:
        return tensors
    where = f"reducescatter '{name}'"
    if op not in (Average, Sum):
        raise NotImplementedError(f"{where}: reducescatter supports op=Average or op=Sum, got {op!r}")
    pairs = [compression.compress(_dense(t, where)) for t in tensors]
    ts = [c for c, _ in pairs]
    for t in ts:
        if t.shape.rank == 0:
            raise ValueError(f"{where}: needs a tensor with at least one dimension, got a scalar")
    n = _set_size(process_set)
    names = [name if len(ts) == 1 else _suffix(name, str(i)) for i in range(len(ts))]

    def fn(arrays):
        out = []
        for a, nm in zip(arrays, names):
            plan = reduce_plan(a, op, prescale_factor, postscale_factor, n, scale_in_numpy=True)
            out.append(plan.finish(_ring.reducescatter(plan.staged, op=plan.op, name=_n(nm), process_set=process_set)))
        return out

    @tf.custom_gradient
    def rs(*xs):
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) for x in xs]
        outs = _call(fn, xs, [x.dtype for x in xs], shapes, process_set, where)

        def grad(*dys):
            scale = prescale_factor * postscale_factor * (n if op == Sum else 1)
            return grouped_allgather([tf.convert_to_tensor(d) * tf.cast(scale, d.dtype) for d in dys],
                                     name=_suffix(name, "grad"), process_set=process_set)
        return list(outs), grad
    outs = rs(*ts)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce over ranks and return this rank's block of dim 0 (the first ranks get the extra rows)."""
    return grouped_reducescatter([tensor], compression=compression, op=op, process_set=process_set,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                 name=name)[0]


# ------------------------------------------------------------------ topology as graph ops
def _scalar_op(value_fn, name):
    """A graph op returning ``value_fn()`` when it runs (eagerly: the value now)."""
    if tf.executing_eagerly():
        return tf.constant(value_fn(), tf.int32, name=name)
    return tf.py_function(lambda: np.int32(value_fn()), [], tf.int32, name=name)


def size_op(process_set_id=0, name=None):
    """An op returning the number of ranks (of the process set ``process_set_id``) when it runs."""
    return _scalar_op(lambda: _process_set_of(process_set_id).size(), name)


def rank_op(name=None):
    """An op returning this process's rank when it runs."""
    return _scalar_op(_ring.rank, name)


def local_size_op(name=None):
    """An op returning the number of ranks on this host when it runs."""
    return _scalar_op(_ring.local_size, name)


def local_rank_op(name=None):
    """An op returning this rank's index on its host when it runs."""
    return _scalar_op(_ring.local_rank, name)


def process_set_included_op(process_set_id=0, name=None):
    """An op returning 1 if this rank belongs to process set ``process_set_id``, else 0."""
    return _scalar_op(lambda: int(bool(_process_set_of(process_set_id).included())), name)


def _process_set_of(process_set_id):
    found = _api.process_set_by_id(process_set_id)
    if found is None:
        raise ValueError(f"process set {process_set_id} is not registered; call hvd.add_process_set([...]) first")
    return found


# ------------------------------------------------------------------ variables, objects
def broadcast_variables(variables, root_rank=0, process_set=global_process_set, inplace=False):
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


def broadcast_global_variables(root_rank):
    """TF1 graph mode: the op that gives every rank root's values of every global variable."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function ``f(obj)`` returning root's ``obj`` on every rank (``session`` is not needed)."""
    def bcast(obj):
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)
    return bcast


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Root's picklable object, returned on every rank of ``process_set``."""
    with _lock:
        return _ring.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's picklable object, as a list in rank order."""
    with _lock:
        return _ring.allgather_object(obj, name, process_set)


def barrier(process_set=global_process_set):
    """Wait until every rank of ``process_set`` arrives (interruptible, with the stall timeout)."""
    with _lock:
        _ring.barrier(process_set)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """SessionRunHook giving every rank root's global variables once the session exists.

    For ``MonitoredTrainingSession`` in TF1 graph mode: random initial weights, or a checkpoint
    restored on rank 0, become everyone's.
    """

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)


# ------------------------------------------------------------------ gradients
def _reduce_gradients(grads, sources, op, prescale, postscale, compression, names, sparse_as_dense=False,
                      process_set=global_process_set):
    """Reduce gradients as Horovod: dense ones in one fused allreduce, IndexedSlices by allgather
    (or densified with ``sparse_as_dense``); the shared core of the tape and the optimizers.

    Eagerly, a gradient that is None on this rank is sent as zeros so ranks that differ in which
    gradients exist still agree; it stays None only where no rank had one (a flag per gradient
    is reduced too). In a graph the structure is static: None stays None, as in Horovod.
    """
    grads = list(grads)
    if not grads:
        return grads
    eager = tf.executing_eagerly()
    if sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    present = [g is not None for g in grads]
    result = [None] * len(grads)
    dense, sparse = [], []
    for i, (g, s) in enumerate(zip(grads, sources)):
        if isinstance(g, tf.IndexedSlices):
            sparse.append(i)
        elif g is not None:
            dense.append(i)
        elif eager:
            dense.append(i)
            grads[i] = tf.zeros(tuple(s.shape), s.dtype)
    if sparse:
        # sparse and dense gradients in one op (see _allreduce_slices)
        _check_sparse_op(op, prescale, postscale, "gradient")
        pairs = [compression.compress(_dense(grads[i], f"gradient '{names[i]}'")) for i in dense]
        reduced, reduced_dense = _allreduce_slices([grads[i] for i in sparse], op, [names[sparse[0]]], process_set,
                                                   [c for c, _ in pairs], prescale, postscale)
        for i, r in zip(sparse, reduced):
            result[i] = r
        for i, r, (_, ctx) in zip(dense, reduced_dense, pairs):
            result[i] = compression.decompress(r, ctx)
    elif dense:
        pairs = [compression.compress(_dense(grads[i], f"gradient '{names[i]}'")) for i in dense]
        reduced = _reduce_dense([c for c, _ in pairs], op, prescale, postscale, [names[i] for i in dense],
                                process_set)
        for i, r, (_, ctx) in zip(dense, reduced, pairs):
            result[i] = compression.decompress(r, ctx)
    if eager and not all(present):
        # every rank runs this when any gradient is missing anywhere: the flags say which
        flags = np.array([float(p) for p in present], np.float32)
        with _lock:
            seen = _ring.allreduce(flags, None, "gradient.present", Max, process_set=process_set)
        result = [r if seen[i] > 0 else None for i, r in enumerate(result)]
    elif eager:
        flags = np.ones(len(present), np.float32)
        with _lock:
            _ring.allreduce(flags, None, "gradient.present", Max, process_set=process_set)
    return result


def _reduce_except_local(grads, sources, is_local, names, op, prescale, postscale, compression, sparse_as_dense,
                         process_set, scale_local):
    """:func:`_reduce_gradients` of the gradients whose source is not local (``is_local(source)``);
    a local one stays this rank's, divided by the set's size with ``scale_local`` (Horovod's
    ``register_local_var`` / ``register_local_source``). ``names``: one per gradient."""
    shared = [i for i, s in enumerate(sources) if not is_local(s)]
    reduced = _reduce_gradients([grads[i] for i in shared], [sources[i] for i in shared], op, prescale, postscale,
                                compression, [names[i] for i in shared], sparse_as_dense, process_set)
    out = list(grads)
    for i, g in zip(shared, reduced):
        out[i] = g
    if scale_local and len(shared) < len(out):
        n = float(_set_size(process_set))
        kept = set(shared)
        for i, g in enumerate(out):
            if i not in kept and g is not None:
                out[i] = (tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                          if isinstance(g, tf.IndexedSlices) else g / n)
    return out


_FUSED_DTYPES = (tf.float16, tf.float32, tf.float64)


class _GradientBuffers:
    """64-byte aligned flat buffers, one per dtype and process set, that the fused gradient
    allreduce works in.

    They come from the runtime's ``bucket_buffer``: on one host registered shared memory, which the
    in-place allreduce reduces straight out of every rank's buffer, so the gradients are copied
    once (into the buffer) and not again into the transport and back. The reduced gradients handed
    back to TensorFlow are views of the buffer (DLPack, no copy), so a buffer is reused only while
    no view of it is alive: every view holds a reference to it. A new runtime (shutdown, init)
    gets new buffers.
    """

    def __init__(self):
        self.roots = {}
        self.session = None

    def flat(self, dtype, nbytes, process_set, op_key=None):
        """A buffer of ``nbytes``; ``op_key`` (a TF1 session op's key) gives the op its own, since
        session ops run at once on several threads."""
        session = _api.session()
        if session is not self.session:
            self.roots, self.session = {}, session
        key = (dtype, None if process_set is None else process_set.process_set_id, op_key)
        root = self.roots.get(key)
        # 3 references: the dict, ``root`` and getrefcount's argument; more: a view is still alive
        if root is None or root.nbytes < nbytes + 64 or sys.getrefcount(root) > 3:
            self.roots.pop(key, None)  # its registered memory goes back once no view holds it
            root = self.roots[key] = _api.bucket_buffer(nbytes + 64, process_set)
        start = (-root.ctypes.data) % 64
        return root[start:start + nbytes].view(dtype)


_buffers = _GradientBuffers()


def _layout(tensors):
    """dtype -> [(index, offset, size)], total elements: each tensor starts 64-byte aligned, as
    TensorFlow wants its buffers (the padding is reduced too, identically everywhere)."""
    groups = {}
    for i, t in enumerate(tensors):
        np_dtype = np.dtype(t.dtype.as_numpy_dtype)
        entries, total = groups.get(np_dtype, ([], 0))
        align = 64 // np_dtype.itemsize
        total = -(-total // align) * align
        size = int(np.prod(t.shape.as_list(), dtype=np.int64))
        entries.append((i, total, size))
        groups[np_dtype] = (entries, total + size)
    return groups


def _view_of(tensor):
    """A numpy view of an eager CPU tensor's buffer (DLPack), or a host copy where that fails."""
    try:
        return np.from_dlpack(tensor)
    except (BufferError, TypeError, RuntimeError, ValueError):
        return _host(tensor)


# Inside a tf.function the fused gradients are cut into buckets of about this many bytes, in
# backward order: each bucket's allreduce starts while backward still computes earlier layers
# (the torch DistributedOptimizer's default and reasoning, docs/runtime.md)
_BUCKET_BYTES = 8 << 20


def _overlap():
    """Whether gradients inside a tf.function go in buckets that start during backward, read when
    the function is traced: ``JUPYTER_RING_TF_OVERLAP`` 1 or 0, else where it can pay.

    The engine's thread reduces a bucket while backward goes on: that needs a core the backward
    does not use, so a second core per rank. With one core per rank (2 ranks on 2 cores) the
    reduction only takes turns with the backward on it, and the buckets' extra ops and rounds
    make the step slower (measured: docs/benchmarks.md), so there the gradients stay one op after
    backward. (GPU gradients never come here: they are staged through host memory in one op.)
    """
    value = os.environ.get("JUPYTER_RING_TF_OVERLAP", "").strip().lower()
    if value not in ("", "0", "1", "off", "on", "false", "true"):
        raise ValueError(f"JUPYTER_RING_TF_OVERLAP={value!r}: use 1 (buckets during backward), 0 (one op after "
                         "backward), or leave it unset (buckets where a rank has a second core)")
    if value:
        return value in ("1", "on", "true")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= 2 * max(1, local_size())


def _bucket_bytes():
    """``JUPYTER_RING_TF_BUCKET_BYTES`` (read when a tf.function is traced), else 8 MiB."""
    value = os.environ.get("JUPYTER_RING_TF_BUCKET_BYTES", "").strip()
    if not value:
        return _BUCKET_BYTES
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"JUPYTER_RING_TF_BUCKET_BYTES={value!r}: give a positive number of bytes per "
                         f"gradient bucket (default {_BUCKET_BYTES})")
    return int(value)


def _buckets(tensors, bucket_bytes):
    """Indices of ``tensors`` cut into buckets of one dtype and about ``bucket_bytes``, last tensor
    first (the order backward makes gradients in: the last layer's first)."""
    buckets, current, size, dtype = [], [], 0, None
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        nbytes = t.shape.num_elements() * t.dtype.size
        if current and (t.dtype != dtype or size >= bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        dtype = t.dtype
    if current:
        buckets.append(current)
    return buckets


class _InFlight:
    """Buckets queued by their submit op and not yet waited for, by token (ints travel in graphs)."""

    def __init__(self):
        self.pending = {}
        self.tokens = iter(range(1, 1 << 62))

    def add(self, entry):
        token = next(self.tokens)
        self.pending[token] = entry
        return token

    def take(self, token):
        return self.pending.pop(int(token))

    def forget_all(self):
        """A wait failed, so the later buckets' waits will not run: drop their handles."""
        for handle, _flat, _entries in self.pending.values():
            _api.discard(handle)
        self.pending.clear()


_in_flight = _InFlight()


def _overlapped_gradients(tensors, buckets, op, prescale, postscale, name, process_set):
    """Inside a tf.function: per bucket a submit op, which queues the bucket's allreduce as soon as
    its gradients exist (the engine's thread reduces it while backward goes on), then, after every
    submit, a wait op per bucket. A tf.function runs its py_functions in program order (automatic
    control dependencies), so every rank submits and waits in the same order; the wait takes the
    gradients too, which keeps them alive while the engine reads them as sources."""
    shapes = [tuple(t.shape.as_list()) for t in tensors]
    tokens = []
    for k, bucket in enumerate(buckets):
        groups = _layout([tensors[i] for i in bucket])
        bucket_name = f"{name}.bucket{k}"

        def submit(ts, groups=groups, bucket_name=bucket_name, k=k):
            (np_dtype, (entries, total)), = groups.items()
            handle, flat = _queue_bucket(ts, np_dtype, entries, total, bucket_name, op, prescale, postscale,
                                         process_set, f"bucket{k}")
            return [tf.constant(_in_flight.add((handle, flat, entries)), tf.int64)]

        tokens.append(_graph_op(lambda *ts, submit=submit, bucket_name=bucket_name:
                                _run(submit, ts, process_set, bucket_name, in_graph=True),
                                [tensors[i] for i in bucket], [tf.int64], [tf.TensorShape([])], None)[0])
    outs = [None] * len(tensors)
    for k, (bucket, token) in enumerate(zip(buckets, tokens)):

        def wait(ts, bucket=bucket):
            handle, flat, entries = _in_flight.take(ts[0].numpy())
            try:
                _ring.synchronize(handle)
            except BaseException:
                _in_flight.forget_all()
                raise
            return _views(flat, entries, [shapes[i] for i in bucket])

        reduced = _graph_op(lambda *ts, wait=wait, k=k: _run(wait, ts, process_set, f"{name}.bucket{k}", in_graph=True),
                            [token] + [tensors[i] for i in bucket], [tensors[i].dtype for i in bucket],
                            [tensors[i].shape for i in bucket], None)
        for i, r in zip(bucket, reduced):
            outs[i] = r
    return outs


def _queue_bucket(ts, np_dtype, entries, total, name, op, prescale, postscale, process_set, buffer_key):
    """Queue the in-place allreduce of gradients ``ts`` laid out by ``entries`` (``_layout``'s, one
    dtype, ``total`` elements) in a buffer of their own, whose sources they are. -> (handle, buffer)"""
    flat = _buffers.flat(np_dtype, total * np_dtype.itemsize, process_set, buffer_key)
    sources = [(offset, _view_of(ts[i])) for i, offset, size in entries]
    handle = _api.bucket_allreduce_async_(flat, _n(name), op=op, prescale_factor=prescale,
                                          postscale_factor=postscale, process_set=process_set, sources=sources)
    return handle, flat


def _views(flat, entries, shapes):
    """The reduced gradients of ``entries`` as TensorFlow tensors viewing ``flat`` (DLPack, no copy)."""
    return [tf.experimental.dlpack.from_dlpack(flat[offset:offset + size].reshape(shapes[i]).__dlpack__())
            for i, offset, size in entries]


def _fused_gradients(tensors, op, prescale, postscale, name, process_set):
    """Allreduce gradients in place in one aligned buffer per dtype: at most one copy in, none out.

    The gradients go to the reduction as sources of the buffer: on one host only the blocks the
    peers read are copied into it, this rank's own block is reduced from the tensors where they
    lie (half the copy on 2 ranks). Inside a tf.function, gradients of more than one bucket start
    in buckets during backward (_overlapped_gradients)."""
    if not tf.executing_eagerly() and tf.compat.v1.executing_eagerly_outside_functions() and _overlap():
        buckets = _buckets(tensors, _bucket_bytes())
        if len(buckets) > 1:
            return _overlapped_gradients(tensors, buckets, op, prescale, postscale, name, process_set)
    groups = _layout(tensors)
    shapes = [tuple(t.shape.as_list()) for t in tensors]
    in_graph = not tf.executing_eagerly()
    key = _session_ops.key(name)

    def body(ts):
        outs = [None] * len(ts)
        for np_dtype, (entries, total) in groups.items():
            handle, flat = _queue_bucket(ts, np_dtype, entries, total, f"{name}.{np_dtype}", op, prescale, postscale,
                                         process_set, key)
            _ring.synchronize(handle)
            for (i, _offset, _size), view in zip(entries, _views(flat, entries, shapes)):
                outs[i] = view
        return outs

    def fused(*ts):
        return _run(body, ts, process_set, name, in_graph, key)

    if tf.executing_eagerly():
        return fused(*tensors)
    return _graph_op(fused, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], key)


def _reduce_dense(tensors, op, prescale, postscale, names, process_set):
    """Gradients need no gradient of their own: one fused collective op, no custom_gradient.

    Float gradients of known shapes take the zero-copy path (the name carries a digest of every
    shape, so ranks that differ in shapes raise a mismatch); the rest the generic one.
    """
    if (op != Adasum and all(t.dtype in _FUSED_DTYPES and t.shape.is_fully_defined() for t in tensors)
            and all("GPU" not in (t.device or "") for t in tensors)):
        digest = zlib.crc32(repr([(t.dtype.name, tuple(t.shape.as_list())) for t in tensors]).encode())
        name = f"gradients[{len(tensors)} tensors, shapes #{digest:08x}]"
        return _fused_gradients(tensors, op, prescale, postscale, name, process_set)
    n = _set_size(process_set)
    return _call(lambda arrays: _allreduce_arrays(arrays, op, prescale, postscale, names, n, process_set), tensors,
                 [t.dtype for t in tensors], [t.shape for t in tensors], process_set, "gradients")


def _check_optimizer_args(op, gradient_predivide_factor):
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")


def _scales(op, gradient_predivide_factor):
    if op == Average:
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A TF1 ``tf.compat.v1.train`` optimizer whose compute_gradients averages over the ranks."""

    def __init__(self, optimizer, name=None, use_locking=False, compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, backward_passes_per_step=1,
                 process_set=global_process_set):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step > 1 is not supported with a tf.compat.v1.train optimizer "
                             "by jupyter_ring; accumulate gradients yourself or use a Keras optimizer's "
                             "gradient_accumulation_steps")
        self._optimizer = optimizer
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._prescale, self._postscale = _scales(op, gradient_predivide_factor)
        self.process_set = process_set
        self._local_vars = set()

    def register_local_var(self, var):
        """Keep ``var``'s gradient local (not reduced over the ranks)."""
        self._local_vars.add(_ref(var))

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, reduced over the ranks (one fused collective op)."""
        gradients = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = zip(*gradients) if gradients else ((), ())
        shared = [i for i, v in enumerate(variables) if _ref(v) not in self._local_vars]
        names = [f"{self._name}.{getattr(variables[i], 'name', i)}" for i in shared]
        reduced = _reduce_gradients([grads[i] for i in shared], [variables[i] for i in shared], self._op,
                                    self._prescale, self._postscale, self._compression, names,
                                    self._sparse_as_dense, self.process_set)
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        return list(zip(out, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's apply_gradients."""
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, *args, **kwargs):
        """The wrapped optimizer's slot."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        """The wrapped optimizer's variables."""
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap a ``tf.compat.v1.train`` optimizer (TF1 graphs) or a Keras optimizer: gradients are
    averaged over the ranks before they are applied (Horovod's DistributedOptimizer)."""
    _check_optimizer_args(op, gradient_predivide_factor)
    if op == Adasum:
        raise ValueError("op=Adasum in DistributedOptimizer is not supported by jupyter_ring (Horovod's delta "
                         "optimizer); use op=Average, or hvd.allreduce(..., op=hvd.Adasum) yourself")
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _DistributedOptimizer(optimizer, name, use_locking, compression, sparse_as_dense, op,
                                     gradient_predivide_factor, backward_passes_per_step, process_set)
    from .. import keras as _keras

    return _keras.DistributedOptimizer(optimizer, name=name, compression=compression, op=op,
                                       gradient_predivide_factor=gradient_predivide_factor,
                                       backward_passes_per_step=backward_passes_per_step,
                                       sparse_as_dense=sparse_as_dense, process_set=process_set)


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients reduced over the ranks.

    Dense gradients of a call go in one fused allreduce, ``tf.IndexedSlices`` (embeddings) by
    allgather unless ``sparse_as_dense``; a gradient that is None on some ranks is sent as zeros
    there (Horovod's behaviour). Sources registered with ``register_local_source`` keep their
    local gradient (divided by the size, with ``scale_local_gradients``).
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=global_process_set, scale_local_gradients=True):
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        if op == Adasum:
            raise ValueError("op=Adasum is not supported by DistributedGradientTape; use op=Average or op=Sum")
        _check_optimizer_args(op, gradient_predivide_factor)
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._prescale, self._postscale = _scales(op, gradient_predivide_factor)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources = set()

    @property
    def tape(self):
        """The wrapped tf.GradientTape."""
        return self._tape

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def watch(self, tensor):
        """Watch a tensor (as tf.GradientTape.watch)."""
        return self._tape.watch(tensor)

    def watched_variables(self):
        """The wrapped tape's watched variables."""
        return self._tape.watched_variables()

    def stop_recording(self):
        """Context manager pausing the recording (as tf.GradientTape.stop_recording)."""
        return self._tape.stop_recording()

    def reset(self):
        """Clear the recorded operations."""
        return self._tape.reset()

    def register_local_source(self, source):
        """Keep ``source``'s gradient local: not reduced over the ranks."""
        self._local_sources.add(_ref(source))

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE, use_generic_names=False):
        """The wrapped tape's gradients, averaged (or ``op``-reduced) over every rank."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat, flat_sources = tf.nest.flatten(grads), tf.nest.flatten(sources)
        out = _reduce_except_local(flat, flat_sources, lambda s: _ref(s) in self._local_sources,
                                   [f"gradient.{i}" for i in range(len(flat))], self._op, self._prescale,
                                   self._postscale, self._compression, self._sparse_as_dense, self.process_set,
                                   self.scale_local_gradients)
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """(local [(source, grad)], global [(source, grad)]) split by register_local_source."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if _ref(s) in self._local_sources else shared).append((s, g))
        return local, shared


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """A DistributedGradientTape whose ``local_layers``' gradients stay local (model parallelism)."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for var in _local_weights(local_layers):
        tape.register_local_source(var)
    return tape


def _local_weights(local_layers):
    """The trainable weights of ``local_layers`` (a Keras layer, a list of them, or None)."""
    if local_layers is None:
        return []
    if isinstance(local_layers, _K.layers.Layer):
        local_layers = [local_layers]
    if not all(isinstance(layer, _K.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    return [var for layer in local_layers for var in layer.trainable_weights]


# ------------------------------------------------------------------ SyncBatchNormalization
def _synced_moments(layer, inputs, mean, variance, axes):
    """This rank's batch ``mean`` and ``variance`` over ``axes`` -> every rank's, weighted by count."""
    if _ring.size() == 1:
        return mean, variance
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), mean.dtype)
    stack = tf.stack([mean * count, (variance + tf.square(mean)) * count, tf.ones_like(mean) * count])
    total = allreduce(stack, op=Sum, name=f"{layer.name}.moments")
    group_mean = total[0] / total[2]
    return group_mean, total[1] / total[2] - tf.square(group_mean)


def _refuse_fused(fused):
    if fused in (True, None):
        raise ValueError("SyncBatchNormalization does not support fused=True.")


if LEGACY_KERAS:
    class SyncBatchNormalization(_K.layers.BatchNormalization):
        """BatchNormalization whose training statistics cover every rank's batch (Horovod's).

        Mean and variance are combined over the ranks weighted by each rank's count (one allreduce
        per call); in inference it is the ordinary layer. Keras 2 (tf_keras) here.
        """

        def __init__(self, fused=False, **kwargs):
            _refuse_fused(fused)
            kwargs.setdefault("name", "sync_batch_normalization")
            super().__init__(fused=False, **kwargs)

        def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
            mean, variance = super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
            return _synced_moments(self, inputs, mean, variance, list(reduction_axes))
else:
    class SyncBatchNormalization(keras.layers.BatchNormalization):
        """BatchNormalization whose training statistics cover every rank's batch (Horovod's).

        Mean and variance are combined over the ranks weighted by each rank's count (one allreduce
        per call); in inference it is the ordinary layer.
        """

        def __init__(self, fused=False, **kwargs):
            _refuse_fused(fused)
            super().__init__(**kwargs)

        def _moments(self, inputs, mask):
            mean, variance = super()._moments(inputs, mask)
            rank = len(inputs.shape)
            kept = [ax % rank for ax in (self.axis if isinstance(self.axis, (list, tuple)) else [self.axis])]
            return _synced_moments(self, inputs, mean, variance, [a for a in range(rank) if a not in kept])
