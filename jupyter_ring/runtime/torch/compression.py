"""Horovod's gradient compression for torch: ``Compression.none`` and ``Compression.fp16``."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor(Protocol):
    """What ``compression=`` takes: a class (or object) whose ``compress`` returns the tensor to
    send and a context that ``decompress`` receives back with the result."""

    # the context is the compressor's own (a dtype here, anything for a user's compressor): Any
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class NoneCompressor:
    """No compression: tensors travel in their own dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 (half the bytes), and come back in their dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype | None) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Gradient compression for allreduce: ``Compression.none`` or ``Compression.fp16``."""

    none: Compressor = NoneCompressor
    fp16: Compressor = FP16Compressor
