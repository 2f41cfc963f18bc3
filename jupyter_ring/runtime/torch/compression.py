"""Horovod's gradient compression for torch: ``Compression.none`` and ``Compression.fp16``."""

import torch

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
    """Floating-point tensors travel as float16 (half the bytes), and come back in their dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Gradient compression for allreduce: ``Compression.none`` or ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
