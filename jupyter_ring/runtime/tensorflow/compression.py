"""Horovod's gradient compression for TensorFlow: ``Compression.none`` and ``Compression.fp16``."""

from __future__ import annotations

from typing import Any, Protocol

import tensorflow as tf

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]

# TensorFlow ships no annotations: tensors and dtypes are Any here.


class Compressor(Protocol):
    """What ``compression=`` takes: a class (or object) whose ``compress`` returns the tensor to
    send and a context that ``decompress`` receives back with the result."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]: ...

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any: ...


class NoneCompressor:
    """No compression: tensors travel in their own dtype."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: object) -> Any:
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Gradient compression for allreduce: ``Compression.none`` or ``Compression.fp16``."""

    none: Compressor = NoneCompressor
    fp16: Compressor = FP16Compressor
