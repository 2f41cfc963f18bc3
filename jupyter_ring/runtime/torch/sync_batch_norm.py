"""Horovod's ``SyncBatchNorm`` for torch: batch statistics over every rank's batch.

Forward sums (count, sum, sum of squares) per channel over the ranks in one allreduce, so every
rank normalises with the global batch's mean and variance; backward sums the two per-channel
gradient terms the input gradient needs in a second allreduce. The weight and bias gradients
stay local, as Horovod's (DistributedOptimizer averages them). Works on CPU tensors too (Horovod's
needs a GPU in training mode); CUDA tensors are staged through host memory by the adapter.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ... import runtime as _ring
from .._horovod.runtime_names import Sum
from .mpi_ops import _apply, allreduce

__all__ = ["SyncBatchNorm"]


def _ring_sum(tensor: torch.Tensor, name: str) -> torch.Tensor:
    return allreduce(tensor, op=Sum, name=name)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float, momentum: float,
                name: str) -> torch.Tensor:
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        xd = x.detach().to(torch.float64)
        local = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                           torch.tensor([x.numel() // channels], dtype=torch.float64, device=x.device)])
        total = _ring_sum(local, f"{name}.stats")
        count = total[-1]
        if count <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over all ranks when "
                             f"training, got input size {tuple(x.shape)} ({int(count)} values per channel)")
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean * mean).clamp_min(0)
        if running_mean is not None and running_var is not None:  # (both or neither)
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * count / (count - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        invstd = (var + eps).rsqrt()
        xhat = ((xd - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
        out = xhat
        if weight is not None and bias is not None:  # (affine: both or neither)
            out = out * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(xhat, weight, invstd.to(x.dtype))
        ctx.count, ctx.name, ctx.dims = count, name, dims
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xhat, weight, invstd = ctx.saved_tensors
        dims, channels = ctx.dims, xhat.shape[1]
        shape = [1, channels] + [1] * (xhat.dim() - 2)
        sum_dy = grad_out.sum(dims)
        sum_dy_xhat = (grad_out * xhat).sum(dims)
        grad_weight = sum_dy_xhat if weight is not None else None
        grad_bias = sum_dy if weight is not None else None
        total = _ring_sum(torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64), f"{ctx.name}.grad")
        mean_dy = (total[:channels] / ctx.count).to(grad_out.dtype).view(shape)
        mean_dy_xhat = (total[channels:] / ctx.count).to(grad_out.dtype).view(shape)
        scale = invstd.view(shape) * (weight.view(shape) if weight is not None else 1)
        grad_x = scale * (grad_out - mean_dy - xhat * mean_dy_xhat)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover the whole batch across every rank (Horovod's).

    Use it like ``torch.nn.BatchNorm{1,2,3}d`` with inputs of shape ``(N, C, ...)``; in eval mode
    (or with one rank) it is the ordinary batch norm with the running statistics. Every rank must
    call forward/backward together (each is a collective).
    """

    _instances = 0

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        # collectives are named per layer, in construction order, identically on every rank
        self._ring_name = f"SyncBatchNorm.{SyncBatchNorm._instances}"
        SyncBatchNorm._instances += 1

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input (N, C, ...), got {input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` with statistics over every rank's batch (training) or the running ones."""
        self._check_input_dim(input)
        if not (self.training or not self.track_running_stats) or _ring.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                self.training or not self.track_running_stats,
                                0.0 if self.momentum is None else self.momentum, self.eps)
        momentum = self.momentum
        if self.training and self.track_running_stats:
            tracked = cast(torch.Tensor, self.num_batches_tracked)  # (a tensor with track_running_stats)
            tracked.add_(1)
            if momentum is None:  # cumulative moving average
                momentum = 1.0 / float(tracked)
        running = self.training and self.track_running_stats
        return cast(torch.Tensor, _apply(_SyncBatchNormFunction, input, self.weight, self.bias,
                                         self.running_mean if running else None,
                                         self.running_var if running else None,
                                         self.eps, momentum or 0.0, self._ring_name))
