"""Horovod's TensorFlow API on jupyter_ring's ring runtime: change only the import line.

::

    import jupyter_ring.runtime.tensorflow as hvd

    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

Tensors cross into the runtime as numpy arrays: eagerly through ``tensor.numpy()``, inside a
``tf.function`` through one ``tf.py_function`` per collective (so XLA-compiled functions,
``jit_compile=True``, cannot contain them). bfloat16 travels as float32. GPU tensors are staged
through host memory. For Keras 3 ``model.fit`` see :mod:`jupyter_ring.runtime.keras`.
"""

try:
    import tensorflow as tf
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the tensorflow adapter needs tensorflow: pip install 'jupyter_ring[tensorflow]'") from exc

import numpy as np

from .. import runtime as _ring
from ._common import *  # noqa: F403 - init, rank, ops, errors, ...: as in the numpy API
from ._common import __all__ as _COMMON

__all__ = [
    *_COMMON, "Compression", "allreduce", "grouped_allreduce", "allgather", "broadcast",
    "alltoall", "reducescatter", "broadcast_variables", "DistributedGradientTape",
]


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


# ------------------------------------------------------------------ tensor <-> numpy
def _dense(tensor, where):
    if isinstance(tensor, tf.IndexedSlices):
        return tf.convert_to_tensor(tensor)  # sparse gradients (embeddings) are densified
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


def _call(fn, tensors, out_dtypes, out_shapes):
    """Run ``fn(list of numpy arrays) -> list of numpy arrays`` eagerly or as one tf.py_function."""
    tensors = list(tensors)
    if tf.executing_eagerly():
        outs = fn([_host(t) for t in tensors])
        return [tf.convert_to_tensor(np.asarray(o).astype(d.as_numpy_dtype) if d != tf.bfloat16 else o, dtype=d)
                for o, d in zip(outs, out_dtypes)]

    def py(*ts):
        outs = fn([_host(t) for t in ts])
        return [tf.cast(tf.convert_to_tensor(o), d) for o, d in zip(outs, out_dtypes)]

    outs = tf.py_function(py, tensors, Tout=list(out_dtypes))
    for o, s in zip(outs, out_shapes):
        if s is not None:
            o.set_shape(s)
    return outs


def _allreduce_list(tensors, op, prescale, postscale, names):
    """One fused allreduce of a list of tensors (the runtime fuses the queued calls)."""
    def fn(arrays):
        handles = [_ring.allreduce_async(a, name=nm, op=op, prescale_factor=prescale,
                                         postscale_factor=postscale) for a, nm in zip(arrays, names)]
        return [_ring.synchronize(h) for h in handles]
    return _call(fn, tensors, [t.dtype for t in tensors], [t.shape for t in tensors])


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none,
              op=None, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Reduce ``tensor`` over all ranks (default: Average); differentiable, works in tf.function."""
    tensor = _dense(tensor, f"allreduce '{name}'")
    op = _ring._api._op(op, average, f"allreduce '{name}'")

    @tf.custom_gradient
    def reduce(t):
        compressed, ctx = compression.compress(t)
        out = _allreduce_list([compressed], op, prescale_factor, postscale_factor, [name])[0]

        def grad(dy):
            return _allreduce_list([dy], op, prescale_factor, postscale_factor,
                                   [None if name is None else f"{name}.grad"])[0]
        return compression.decompress(out, ctx), grad
    return reduce(tensor)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Allreduce a list of tensors in one fused pass; returns a list."""
    op = _ring._api._op(op, average, f"grouped_allreduce '{name}'")
    dense = [_dense(t, f"grouped_allreduce '{name}' tensor {i}") for i, t in enumerate(tensors)]
    pairs = [compression.compress(t) for t in dense]
    names = [None if name is None else f"{name}.{i}" for i in range(len(dense))]
    outs = _allreduce_list([c for c, _ in pairs], op, prescale_factor, postscale_factor, names)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def allgather(tensor, name=None):
    """Every rank's tensor concatenated along dim 0 (which may differ between ranks)."""
    tensor = _dense(tensor, f"allgather '{name}'")
    if tensor.shape.rank == 0:
        raise ValueError(f"allgather '{name}': needs a tensor with at least one dimension; pass tf.reshape(x, [1])")
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
    return _call(lambda a: [_ring.allgather(a[0], name)], [tensor], [tensor.dtype], [shape])[0]


def broadcast(tensor, root_rank=0, name=None):
    """Root's tensor, returned on every rank."""
    tensor = _dense(tensor, f"broadcast '{name}'")
    return _call(lambda a: [_ring.broadcast(a[0], root_rank, name).reshape(a[0].shape)],
                 [tensor], [tensor.dtype], [tensor.shape])[0]


def alltoall(tensor, splits=None, name=None):
    """Send ``splits[q]`` rows to rank q, receive theirs: returns (output, received_splits)."""
    tensor = _dense(tensor, f"alltoall '{name}'")
    inputs = [tensor] if splits is None else [tensor, tf.cast(splits, tf.int32)]

    def fn(arrays):
        out, received = _ring.alltoall(arrays[0], None if splits is None else arrays[1], name)
        return [out, np.asarray(received, np.int32)]
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
    out, received = _call(fn, inputs, [tensor.dtype, tf.int32], [shape, tf.TensorShape([None])])
    return out, received


def reducescatter(tensor, op=Average, name=None):
    """Reduce over ranks and return this rank's block of dim 0 (the first ranks get the extra rows)."""
    tensor = _dense(tensor, f"reducescatter '{name}'")
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
    return _call(lambda a: [_ring.reducescatter(a[0], op=op, name=name)], [tensor], [tensor.dtype], [shape])[0]


def broadcast_variables(variables, root_rank=0):
    """Assign root's values to every rank's variables (model and optimizer variables)."""
    variables = list(variables)
    names = [f"broadcast_variables.{i}" for i in range(len(variables))]
    handles = [_ring.broadcast_async(_host(v.value() if hasattr(v, "value") and callable(v.value) else v),
                                     root_rank, name=nm) for v, nm in zip(variables, names)]
    for v, h in zip(variables, handles):
        value = _ring.synchronize(h)
        v.assign(tf.cast(value.reshape(tuple(v.shape)), v.dtype))


# ------------------------------------------------------------------ gradient tape
def _reduce_gradients(grads, sources, op, prescale, postscale, compression, names):
    """Allreduce gradients in one fused pass; the shared core of the tape and the Keras optimizer.

    A gradient that is None on this rank is sent as zeros of its variable's shape, so ranks that
    differ in which gradients exist still queue the same allreduces (no mismatch, no hang). It
    stays None here when no rank had one (known eagerly from a flag per gradient) or, inside a
    tf.function where the structure is static, when this rank had none (as Horovod does).
    """
    grads = list(grads)
    if not grads:
        return grads
    present = [g is not None for g in grads]
    dense = [_dense(g, f"gradient '{nm}'") if g is not None else tf.zeros(tuple(s.shape), s.dtype)
             for g, s, nm in zip(grads, sources, names)]
    pairs = [compression.compress(g) for g in dense]
    tensors = [c for c, _ in pairs]
    eager = tf.executing_eagerly()
    outs = _allreduce_list(tensors, op, prescale, postscale, list(names))
    seen = None
    if eager:
        # every rank runs this (even with every gradient present), or the ranks' calls differ
        flags = tf.constant([float(p) for p in present], tf.float32)
        seen = _allreduce_list([flags], Max, 1.0, 1.0, ["gradient.present"])[0].numpy()
    result = []
    for i, (o, (_, ctx)) in enumerate(zip(outs, pairs)):
        if present[i] or (eager and seen is not None and seen[i] > 0):
            result.append(compression.decompress(o, ctx))
        else:
            result.append(None)
    return result


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients averaged over the ranks.

    Gradients of a call are fused into one allreduce; a gradient that is None on some ranks is
    sent as zeros there, so the ranks never disagree (Horovod's behaviour).
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=True, op=Average, gradient_predivide_factor=1.0):
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        if op == Adasum:
            raise ValueError("op=Adasum is not supported by jupyter_ring; use op=Average or op=Sum")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        self._tape = gradtape
        self._compression = compression
        self._op = op
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = gradient_predivide_factor

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

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The wrapped tape's gradients, averaged (or ``op``-reduced) over every rank."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat, flat_sources = tf.nest.flatten(grads), tf.nest.flatten(sources)
        names = [f"gradient.{i}" for i in range(len(flat))]
        reduced = _reduce_gradients(flat, flat_sources, self._op, self._prescale, self._postscale,
                                    self._compression, names)
        return tf.nest.pack_sequence_as(grads, reduced)
