"""Horovod's gradient compression for TensorFlow: ``Compression.none`` and ``Compression.fp16``."""

import tensorflow as tf


__all__ = ["NoneCompressor", "FP16Compressor", "Compression"]


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
