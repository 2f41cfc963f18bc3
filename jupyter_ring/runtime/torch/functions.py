"""Model and optimizer state made equal on every rank: ``broadcast_parameters``,
``broadcast_optimizer_state``, ``broadcast_object``, ``allgather_object``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias, TypeVar, cast

import torch

from ... import runtime as _ring
from .._horovod.runtime_names import ProcessSet, global_process_set
from .mpi_ops import _check_tensor, broadcast_async_, synchronize
from .optimizer import DistributedOptimizer

__all__ = ["broadcast_object", "allgather_object", "broadcast_parameters",
    "broadcast_optimizer_state"]

_T = TypeVar("_T")
# a state_dict, named_parameters() or a list of tensors (None entries are skipped); a Mapping's
# key type is invariant, so Any (not object) lets a dict[str, Tensor] (a state_dict) in
_NamedTensors: TypeAlias = ("Mapping[Any, torch.Tensor | None] | Iterable[tuple[object, torch.Tensor | None]] | "
                           "Iterable[torch.Tensor | None]")


def broadcast_object(obj: _T, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = global_process_set) -> _T:
    """Root's picklable object, returned on every rank of ``process_set``."""
    return _ring.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: _T, name: str | None = None, process_set: ProcessSet | None = global_process_set) -> list[_T]:
    """Every rank's picklable object, as a list in rank order."""
    return _ring.allgather_object(obj, name, process_set)


# ------------------------------------------------------------------ model and optimizer state
def _named_tensors(params: _NamedTensors, where: str) -> list[tuple[object, torch.Tensor | None]]:
    if isinstance(params, dict):
        return sorted(cast("dict[object, torch.Tensor | None]", params).items(), key=lambda kv: str(kv[0]))
    try:
        items = list(params)
    except TypeError:
        raise TypeError(f"{where}: expected a state_dict, named_parameters() or a list of tensors, "
                        f"got {type(params).__name__}") from None
    return [p if isinstance(p, tuple) else (f"{i}", p) for i, p in enumerate(items)]


def broadcast_parameters(params: _NamedTensors, root_rank: int = 0) -> None:
    """Overwrite every rank's tensors with root's: ``model.state_dict()`` or ``named_parameters()``."""
    handles = []
    for name, p in _named_tensors(params, "broadcast_parameters"):
        if p is None:
            continue
        _check_tensor(p, f"broadcast_parameters '{name}'")
        handles.append(broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                                        name=f"broadcast_parameters.{name}"))
    for h in handles:
        synchronize(h)


class _TensorSlot:
    """Placeholder for a tensor in the optimizer-state skeleton sent by broadcast_optimizer_state."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def _split_tensors(obj: object, tensors: list[torch.Tensor]) -> object:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _split_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split_tensors(v, tensors) for v in obj)
    return obj


def _fill_tensors(obj: object, tensors: list[torch.Tensor]) -> object:
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill_tensors(v, tensors) for v in obj)
    return obj


def _zero_missing_grads(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Horovod's visible side effect on an optimizer without state: zero gradients (sparse for
    SparseAdam and for ``model``'s sparse embeddings) where there are none. Horovod then steps
    once on them to create the state, which advances Adam's step count; we do not step, so n
    ranks stay equal to one process (the state comes from root, if root has any)."""
    sparse: set[int] = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                    p.grad = p.grad.to_sparse()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: torch.nn.Module | None = None) -> None:
    """Make every rank's optimizer state (moments, step counts, hyper-parameters) equal to root's.

    Root's ``state_dict()`` structure travels as one small object; its tensors travel as
    broadcasts, so large states (Adam moments) do not go through pickle. Ranks without state
    receive root's; parameters without a gradient get zeros, as in Horovod (``model`` names sparse
    embeddings). Every optimizer in torch.optim but LBFGS works.
    """
    if isinstance(optimizer, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError("broadcast_optimizer_state takes the optimizer, not its LR scheduler; "
                        "use broadcast_object(scheduler.state_dict()) for the scheduler")
    if not hasattr(optimizer, "state_dict"):
        raise TypeError(f"broadcast_optimizer_state: expected a torch optimizer, got {type(optimizer).__name__}")
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if isinstance(inner, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (its state holds closures' history); "
                         "re-create it on every rank instead")
    if not inner.state_dict()["state"]:
        _zero_missing_grads(inner, model)
    me = _ring.rank()
    tensors: list[torch.Tensor] = []
    skeleton = _split_tensors(optimizer.state_dict(), tensors) if me == root_rank else None
    skeleton = _ring.broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state.structure")
    if me != root_rank:
        slots: list[_TensorSlot] = []
        _collect_slots(skeleton, slots)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in sorted(slots, key=lambda s: s.index)]
    handles = [broadcast_async_(t.detach(), root_rank, name=f"broadcast_optimizer_state.{i}")
               for i, t in enumerate(tensors)]
    for h in handles:
        synchronize(h)
    if me != root_rank:
        optimizer.load_state_dict(cast("dict[str, Any]", _fill_tensors(skeleton, tensors)))


def _collect_slots(obj: object, out: list[_TensorSlot]) -> None:
    if isinstance(obj, _TensorSlot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, out)
