"""Gradients reduced as Horovod reduces them: dense ones fused (in buckets that overlap backward),
IndexedSlices by allgather; the core the tape, the optimizers and Keras share."""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from ... import runtime as _ring
from .. import _api
from .._horovod.runtime_names import Adasum, Average, Max, ProcessSet, global_process_set
from ._execution import _call, _dense, _graph_op, _host, _lock, _n, _run, _session_ops, _set_size
from .compression import Compressor
from .mpi_ops import _allreduce_arrays, _allreduce_slices, _check_sparse_op
from .._horovod.runtime_names import local_size

# TensorFlow ships no annotations: tensors, variables and dtypes are Any here.

# a tensor's place in a fused buffer: (index among the tensors, offset, elements)
_Entry: TypeAlias = "tuple[int, int, int]"
# numpy dtype -> (its tensors' entries, elements in all), as _layout makes it
_Layout: TypeAlias = "dict[np.dtype[Any], tuple[list[_Entry], int]]"


# ------------------------------------------------------------------ gradients
def _reduce_gradients(grads: Iterable[Any], sources: Sequence[Any], op: int, prescale: float, postscale: float,
                      compression: Compressor, names: Sequence[str | None], sparse_as_dense: bool = False,
                      process_set: ProcessSet | None = global_process_set) -> list[Any]:
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
    result: list[Any] = [None] * len(grads)
    dense: list[int] = []
    sparse: list[int] = []
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


def _reduce_except_local(grads: Sequence[Any], sources: Sequence[Any], is_local: Callable[[Any], bool],
                         names: Sequence[str | None], op: int, prescale: float, postscale: float,
                         compression: Compressor, sparse_as_dense: bool, process_set: ProcessSet | None,
                         scale_local: bool) -> list[Any]:
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

    def __init__(self) -> None:
        # (dtype, process set id, op key) -> the buffer
        self.roots: dict[tuple[np.dtype[Any], int | None, str | None], npt.NDArray[np.uint8]] = {}
        self.session: object = None   # the runtime the buffers belong to (_api.session())

    def flat(self, dtype: np.dtype[Any], nbytes: int, process_set: ProcessSet | None,
             op_key: str | None = None) -> npt.NDArray[Any]:
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


def _layout(tensors: Sequence[Any]) -> _Layout:
    """dtype -> [(index, offset, size)], total elements: each tensor starts 64-byte aligned, as
    TensorFlow wants its buffers (the padding is reduced too, identically everywhere)."""
    groups: _Layout = {}
    for i, t in enumerate(tensors):
        np_dtype = np.dtype(t.dtype.as_numpy_dtype)
        entries, total = groups.get(np_dtype, ([], 0))
        align = 64 // np_dtype.itemsize
        total = -(-total // align) * align
        size = int(np.prod(t.shape.as_list(), dtype=np.int64))
        entries.append((i, total, size))
        groups[np_dtype] = (entries, total + size)
    return groups


def _view_of(tensor: Any) -> npt.NDArray[Any]:
    """A numpy view of an eager CPU tensor's buffer (DLPack), or a host copy where that fails."""
    try:
        return np.from_dlpack(tensor)
    except (BufferError, TypeError, RuntimeError, ValueError):
        return _host(tensor)


# Inside a tf.function the fused gradients are cut into buckets of about this many bytes, in
# backward order: each bucket's allreduce starts while backward still computes earlier layers
# (the torch DistributedOptimizer's default and reasoning, docs/runtime.md)
_BUCKET_BYTES = 8 << 20


def _overlap() -> bool:
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


def _bucket_bytes() -> int:
    """``JUPYTER_RING_TF_BUCKET_BYTES`` (read when a tf.function is traced), else 8 MiB."""
    value = os.environ.get("JUPYTER_RING_TF_BUCKET_BYTES", "").strip()
    if not value:
        return _BUCKET_BYTES
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"JUPYTER_RING_TF_BUCKET_BYTES={value!r}: give a positive number of bytes per "
                         f"gradient bucket (default {_BUCKET_BYTES})")
    return int(value)


def _buckets(tensors: Sequence[Any], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` cut into buckets of one dtype and about ``bucket_bytes``, last tensor
    first (the order backward makes gradients in: the last layer's first)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size, dtype = 0, None
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

    def __init__(self) -> None:
        self.pending: dict[int, tuple[int, npt.NDArray[Any], list[_Entry]]] = {}  # token -> (handle, buffer, entries)
        self.tokens = iter(range(1, 1 << 62))

    def add(self, entry: tuple[int, npt.NDArray[Any], list[_Entry]]) -> int:
        token = next(self.tokens)
        self.pending[token] = entry
        return token

    def take(self, token: int) -> tuple[int, npt.NDArray[Any], list[_Entry]]:
        return self.pending.pop(int(token))

    def forget_all(self) -> None:
        """A wait failed, so the later buckets' waits will not run: drop their handles."""
        for handle, _flat, _entries in self.pending.values():
            _api.discard(handle)
        self.pending.clear()


_in_flight = _InFlight()


def _overlapped_gradients(tensors: Sequence[Any], buckets: list[list[int]], op: int, prescale: float, postscale: float,
                          name: str, process_set: ProcessSet | None) -> list[Any]:
    """Inside a tf.function: per bucket a submit op, which queues the bucket's allreduce as soon as
    its gradients exist (the engine's thread reduces it while backward goes on), then, after every
    submit, a wait op per bucket. A tf.function runs its py_functions in program order (automatic
    control dependencies), so every rank submits and waits in the same order; the wait takes the
    gradients too, which keeps them alive while the engine reads them as sources."""
    shapes = [tuple(t.shape.as_list()) for t in tensors]
    tokens: list[Any] = []
    for k, bucket in enumerate(buckets):
        groups = _layout([tensors[i] for i in bucket])
        bucket_name = f"{name}.bucket{k}"

        def submit(ts: Sequence[Any], groups: _Layout = groups, bucket_name: str = bucket_name,
                   k: int = k) -> list[Any]:
            (np_dtype, (entries, total)), = groups.items()
            handle, flat = _queue_bucket(ts, np_dtype, entries, total, bucket_name, op, prescale, postscale,
                                         process_set, f"bucket{k}")
            return [tf.constant(_in_flight.add((handle, flat, entries)), tf.int64)]

        tokens.append(_graph_op(lambda *ts, submit=submit, bucket_name=bucket_name:
                                _run(submit, ts, process_set, bucket_name, in_graph=True),
                                [tensors[i] for i in bucket], [tf.int64], [tf.TensorShape([])], None)[0])
    outs: list[Any] = [None] * len(tensors)
    for k, (bucket, token) in enumerate(zip(buckets, tokens)):

        def wait(ts: Sequence[Any], bucket: list[int] = bucket) -> list[Any]:
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


def _queue_bucket(ts: Sequence[Any], np_dtype: np.dtype[Any], entries: list[_Entry], total: int, name: str, op: int,
                  prescale: float, postscale: float, process_set: ProcessSet | None,
                  buffer_key: str | None) -> tuple[int, npt.NDArray[Any]]:
    """Queue the in-place allreduce of gradients ``ts`` laid out by ``entries`` (``_layout``'s, one
    dtype, ``total`` elements) in a buffer of their own, whose sources they are. -> (handle, buffer)"""
    flat = _buffers.flat(np_dtype, total * np_dtype.itemsize, process_set, buffer_key)
    sources = [(offset, _view_of(ts[i])) for i, offset, size in entries]
    handle = _api.bucket_allreduce_async_(flat, _n(name), op=op, prescale_factor=prescale,
                                          postscale_factor=postscale, process_set=process_set, sources=sources)
    return handle, flat


def _views(flat: npt.NDArray[Any], entries: list[_Entry], shapes: Sequence[tuple[int, ...]]) -> list[Any]:
    """The reduced gradients of ``entries`` as TensorFlow tensors viewing ``flat`` (DLPack, no copy)."""
    return [tf.experimental.dlpack.from_dlpack(flat[offset:offset + size].reshape(shapes[i]).__dlpack__())
            for i, offset, size in entries]


def _fused_gradients(tensors: Sequence[Any], op: int, prescale: float, postscale: float, name: str,
                     process_set: ProcessSet | None) -> list[Any]:
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

    def body(ts: Sequence[Any]) -> list[Any]:
        outs: list[Any] = [None] * len(ts)
        for np_dtype, (entries, total) in groups.items():
            handle, flat = _queue_bucket(ts, np_dtype, entries, total, f"{name}.{np_dtype}", op, prescale, postscale,
                                         process_set, key)
            _ring.synchronize(handle)
            for (i, _offset, _size), view in zip(entries, _views(flat, entries, shapes)):
                outs[i] = view
        return outs

    def fused(*ts: Any) -> list[Any]:
        return _run(body, ts, process_set, name, in_graph, key)

    if tf.executing_eagerly():
        return fused(*tensors)
    return _graph_op(fused, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], key)


def _reduce_dense(tensors: Sequence[Any], op: int, prescale: float, postscale: float, names: Sequence[str | None],
                  process_set: ProcessSet | None) -> list[Any]:
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


def _check_optimizer_args(op: int, gradient_predivide_factor: float) -> None:
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")


def _scales(op: int, gradient_predivide_factor: float) -> tuple[float, float]:
    if op == Average:
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0
