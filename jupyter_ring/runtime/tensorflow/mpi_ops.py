"""Horovod's TensorFlow collectives (eager, ``tf.function``, TF1 graphs), each with its gradient,
the topology as graph ops, ``init`` and ``barrier``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from ... import runtime as _ring
from .. import _api
from .._api import Ranks
from .._horovod.basics import adasum_combine, horovod_scaling
from .._horovod.basics import init as _init
from .._horovod.runtime_names import Adasum, Average, ProcessSet, Sum, global_process_set
from .compression import Compression, Compressor
from ._execution import _call, _dense, _lock, _n, _set_rank, _set_size, _suffix

if TYPE_CHECKING:  # importing mpi4py.MPI initialises MPI: init() does that itself
    from mpi4py import MPI

__all__ = ["init", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "size_op",
           "rank_op", "local_size_op", "local_rank_op", "process_set_included_op", "barrier"]


# TensorFlow ships no annotations: tensors, variables, dtypes and shapes are Any here.

# TF1 sessions created after init() in graph code get at least this many inter-op threads (see init)
_SESSION_THREADS = 64


def init(comm: MPI.Comm | None = None, process_sets: Iterable[ProcessSet | Ranks] | None = None, **config: Any) -> None:
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


# ------------------------------------------------------------------ allreduce
def _allreduce_arrays(arrays: Sequence[npt.NDArray[Any]], op: int, prescale: float, postscale: float,
                      names: Sequence[str | None], n: int, process_set: ProcessSet | None) -> list[npt.NDArray[Any]]:
    """Allreduce numpy arrays, queued together so that the runtime fuses them (Horovod's scaling
    of integer tensors: in float64, truncated, done around the runtime's sum)."""
    if op == Adasum:
        if n & (n - 1):
            raise NotImplementedError(f"Running Adasum with non-power of 2 ranks is not supported yet ({n} ranks)")
        return [adasum_combine(_ring.allgather(a.reshape(1, -1), name=_n(nm), process_set=process_set))
                .astype(a.dtype).reshape(a.shape)
                for a, nm in zip(arrays, names)]
    plans = [horovod_scaling(a, op, prescale, postscale, n) for a in arrays]
    handles = [_ring.allreduce_async(p.staged, op=p.op, name=_n(nm), prescale_factor=p.pre, postscale_factor=p.post,
                                     process_set=process_set)
               for p, nm in zip(plans, names)]
    return [p.finish(_ring.synchronize(h)) for p, h in zip(plans, handles)]


def _allreduce_list(tensors: Sequence[Any], op: int, prescale: float, postscale: float, names: Sequence[str | None],
                    process_set: ProcessSet | None = global_process_set) -> list[Any]:
    """One fused allreduce of a list of dense tensors; differentiable (the gradient is reduced alike)."""
    n = _set_size(process_set)
    where = f"allreduce '{names[0] if names else None}'"

    @tf.custom_gradient  # type: ignore[untyped-decorator]  # (TensorFlow's, unannotated)
    def reduce(*ts: Any) -> tuple[list[Any], Callable[..., list[Any]]]:
        outs = _call(lambda arrays: _allreduce_arrays(arrays, op, prescale, postscale, names, n, process_set), ts,
                     [t.dtype for t in ts], [t.shape for t in ts], process_set, where)

        def grad(*upstream: Any) -> list[Any]:
            dys = [tf.convert_to_tensor(d) for d in upstream]
            return _call(lambda arrays: _allreduce_arrays(arrays, op, prescale, postscale,
                                                          [_suffix(nm, "grad") for nm in names], n, process_set),
                         dys, [d.dtype for d in dys], [d.shape for d in dys], process_set, where)
        return list(outs), grad
    if not tensors:
        return []
    return list(reduce(*tensors))


def _check_sparse_op(op: int, prescale: float, postscale: float, where: str) -> None:
    if op == Adasum:
        raise NotImplementedError(f"{where}: The Adasum reduction does not currently support sparse tensors. As a "
                                  "workaround please pass sparse_as_dense=True to DistributedOptimizer")
    if op not in (Sum, Average):
        raise NotImplementedError(f"{where}: Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError(f"{where}: Pre/postscale_factor are not supported with tf.IndexedSlices")


def _allreduce_slices(slices: Sequence[Any], op: int, names: Sequence[str | None], process_set: ProcessSet | None,
                      dense: Iterable[Any] = (), prescale: float = 1.0, postscale: float = 1.0
                      ) -> tuple[list[Any], list[Any]]:
    """tf.IndexedSlices reduced as Horovod does: allgather the values and the indices; ``dense``
    tensors (with ``op`` and the factors) are allreduced in the same graph op, so that a TF1
    session cannot run the parts in a different order on each rank. Returns (slices, dense)."""
    n = _set_size(process_set)
    base = names[0] or "indexed_slices"
    parts = [t for s in slices for t in (s.values, tf.cast(s.indices, tf.int64))]
    part_names = [f"{base}.{i}.{'values' if i % 2 == 0 else 'indices'}" for i in range(len(parts))]
    dense = list(dense)
    dense_names = [f"{base}.dense.{i}" for i in range(len(dense))]

    def fn(arrays: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
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


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: Compressor = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet | None = global_process_set, ignore_name_scope: bool = False) -> Any:
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


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: Compressor = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = global_process_set, ignore_name_scope: bool = False,
                      name: str | None = None) -> Sequence[Any]:
    """Allreduce a list of tensors in one fused pass; returns a list (IndexedSlices allgathered)."""
    if not tensors:
        return tensors
    where = f"grouped_allreduce '{name}'"
    op = _api.resolve_op(op, average, where)
    slices = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out: list[Any] = [None] * len(tensors)
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
def grouped_allgather(tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet | None = global_process_set) -> list[Any]:
    """Every rank's tensors concatenated along dim 0, for each tensor of a list; differentiable."""
    if not tensors:
        return []
    where = f"grouped_allgather '{name}'"
    tensors = [_dense(t, f"{where} tensor {i}") for i, t in enumerate(tensors)]
    for i, t in enumerate(tensors):
        if t.shape.rank == 0:
            raise ValueError(f"{where} tensor {i}: needs at least one dimension; pass tf.reshape(x, [1])")
    names = [name if len(tensors) == 1 else _suffix(name, str(i)) for i in range(len(tensors))]

    def fn(arrays: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        handles = [_ring.allgather_async(a, _n(nm), process_set) for a, nm in zip(arrays, names)]
        return [_ring.synchronize(h) for h in handles]

    @tf.custom_gradient  # type: ignore[untyped-decorator]  # (TensorFlow's, unannotated)
    def gather(*ts: Any) -> tuple[list[Any], Callable[..., list[Any]]]:
        shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in ts]
        outs = _call(fn, ts, [t.dtype for t in ts], shapes, process_set, where)

        def grad(*upstream: Any) -> list[Any]:
            # one op: average the gradients, learn every rank's rows, keep this rank's
            dys = [tf.convert_to_tensor(d) for d in upstream]
            rows = tf.stack([tf.shape(t, out_type=tf.int64)[0] for t in ts])
            grad_names = [_suffix(nm, "grad") for nm in names]
            rank = _set_rank(process_set)

            def grad_fn(arrays: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
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


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet | None = global_process_set) -> Any:
    """Every rank's tensor concatenated along dim 0 (which may differ between ranks); differentiable."""
    return grouped_allgather([tensor], name=name, process_set=process_set)[0]


def broadcast(tensor: Any, root_rank: int = 0, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet | None = global_process_set) -> Any:
    """Root's tensor (``root_rank``: a global rank), returned on every rank; differentiable
    (the root's gradient is the average of every rank's, the others' zero)."""
    where = f"broadcast '{name}'"
    tensor = _dense(tensor, where)

    @tf.custom_gradient  # type: ignore[untyped-decorator]  # (TensorFlow's, unannotated)
    def bcast(t: Any) -> tuple[Any, Callable[[Any], Any]]:
        out = _call(lambda a: [_ring.broadcast(a[0], root_rank, _n(name), process_set).reshape(a[0].shape)], [t],
                    [t.dtype], [t.shape], process_set, where)[0]

        def grad(dy: Any) -> Any:
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


def _read(variable: Any) -> Any:
    return variable.read_value() if hasattr(variable, "read_value") else tf.convert_to_tensor(variable)


def _broadcast_values(values: Sequence[Any], root_rank: int, name: str, process_set: ProcessSet | None) -> list[Any]:
    """Root's values of a list of tensors, in one collective op (queued broadcasts, fused order)."""
    where = f"broadcast '{name}'"
    names = [_suffix(name, str(i)) for i in range(len(values))]

    def fn(arrays: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        handles = [_ring.broadcast_async(a, root_rank, _n(nm), process_set) for a, nm in zip(arrays, names)]
        return [_ring.synchronize(h).reshape(a.shape) for a, h in zip(arrays, handles)]
    return _call(fn, values, [v.dtype for v in values], [v.shape for v in values], process_set, where)


def broadcast_(variables: Iterable[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = global_process_set) -> list[Any]:
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


def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet | None = global_process_set) -> Any:
    """Send ``splits[q]`` rows to rank q and receive theirs; differentiable.

    Returns ``(output, received_splits)`` when ``splits`` is given, else ``output`` (dim 0 must
    then be divisible by the number of ranks), as Horovod.
    """
    where = f"alltoall '{name}'"
    tensor = _dense(tensor, where)
    if tensor.shape.rank == 0:
        raise ValueError(f"{where}: needs a tensor with at least one dimension, got a scalar")
    split_tensor = tf.zeros([0], tf.int32) if splits is None else tf.cast(splits, tf.int32)

    def fn(arrays: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        out, received = _ring.alltoall(arrays[0], None if splits is None else arrays[1], _n(name), process_set)
        return [out, np.asarray(received, np.int32)]

    @tf.custom_gradient  # type: ignore[untyped-decorator]  # (TensorFlow's, unannotated)
    def a2a(t: Any, s: Any) -> tuple[tuple[Any, Any], Callable[[Any, Any], tuple[Any, None]]]:
        shape = tf.TensorShape([None]).concatenate(t.shape[1:])
        out, received = _call(fn, [t, s], [t.dtype, tf.int32], [shape, tf.TensorShape([None])], process_set, where)

        def grad(dy: Any, _dsplits: Any) -> tuple[Any, None]:
            g, _ = alltoall(tf.convert_to_tensor(dy), splits=received, name=_suffix(name, "grad"),
                            process_set=process_set)
            return g, None
        return (out, received), grad
    out, received = a2a(tensor, split_tensor)
    return out if splits is None else (out, received)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: Compressor = Compression.none,
                          op: int = Average, process_set: ProcessSet | None = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: str | None = None) -> Sequence[Any]:
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

    def fn(arrays: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
        out = []
        for a, nm in zip(arrays, names):
            plan = horovod_scaling(a, op, prescale_factor, postscale_factor, n, scale_in_numpy=True)
            out.append(plan.finish(_ring.reducescatter(plan.staged, op=plan.op, name=_n(nm), process_set=process_set)))
        return out

    @tf.custom_gradient  # type: ignore[untyped-decorator]  # (TensorFlow's, unannotated)
    def rs(*xs: Any) -> tuple[list[Any], Callable[..., list[Any]]]:
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) for x in xs]
        outs = _call(fn, xs, [x.dtype for x in xs], shapes, process_set, where)

        def grad(*dys: Any) -> list[Any]:
            scale = prescale_factor * postscale_factor * (n if op == Sum else 1)
            return grouped_allgather([tf.convert_to_tensor(d) * tf.cast(scale, d.dtype) for d in dys],
                                     name=_suffix(name, "grad"), process_set=process_set)
        return list(outs), grad
    outs = rs(*ts)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def reducescatter(tensor: Any, device_dense: str = "", compression: Compressor = Compression.none, op: int = Average,
                  name: str | None = None, process_set: ProcessSet | None = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Reduce over ranks and return this rank's block of dim 0 (the first ranks get the extra rows)."""
    return grouped_reducescatter([tensor], compression=compression, op=op, process_set=process_set,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                 name=name)[0]


# ------------------------------------------------------------------ topology as graph ops
def _scalar_op(value_fn: Callable[[], int], name: str | None) -> Any:
    """A graph op returning ``value_fn()`` when it runs (eagerly: the value now)."""
    if tf.executing_eagerly():
        return tf.constant(value_fn(), tf.int32, name=name)
    return tf.py_function(lambda: np.int32(value_fn()), [], tf.int32, name=name)


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """An op returning the number of ranks (of the process set ``process_set_id``) when it runs."""
    return _scalar_op(lambda: cast(int, _process_set_of(process_set_id).size()), name)  # (registered: sized)


def rank_op(name: str | None = None) -> Any:
    """An op returning this process's rank when it runs."""
    return _scalar_op(_ring.rank, name)


def local_size_op(name: str | None = None) -> Any:
    """An op returning the number of ranks on this host when it runs."""
    return _scalar_op(_ring.local_size, name)


def local_rank_op(name: str | None = None) -> Any:
    """An op returning this rank's index on its host when it runs."""
    return _scalar_op(_ring.local_rank, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """An op returning 1 if this rank belongs to process set ``process_set_id``, else 0."""
    return _scalar_op(lambda: int(bool(_process_set_of(process_set_id).included())), name)


def _process_set_of(process_set_id: int) -> ProcessSet:
    found = _api.process_set_by_id(process_set_id)
    if found is None:
        raise ValueError(f"process set {process_set_id} is not registered; call hvd.add_process_set([...]) first")
    return found


def barrier(process_set: ProcessSet | None = global_process_set) -> None:
    """Wait until every rank of ``process_set`` arrives (interruptible, with the stall timeout)."""
    with _lock:
        _ring.barrier(process_set)
