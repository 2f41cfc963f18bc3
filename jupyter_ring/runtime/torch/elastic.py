"""``horovod.torch.elastic``: ``TorchState``, ``ElasticSampler`` and ``run`` (see ``_horovod.elastic``, ``_horovod.elastic_world``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeAlias, TypeVar

import torch

from .._horovod import elastic as _elastic
from .._horovod.elastic import ObjectState, State
from .._horovod.elastic_world import HostsUpdatedInterrupt, sync_root
from .._horovod.runtime_names import rank
from .elastic_sampler import ElasticSampler, SamplerStateHandler
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt", "run"]

_Stateful = TypeVar("_Stateful", torch.nn.Module, torch.optim.Optimizer)  # what has a state_dict here
_S = TypeVar("_S", bound=State)   # the state the training function takes
_P = ParamSpec("_P")              # its other arguments
_R = TypeVar("_R")                # what it returns


class _StateDictHandler(Generic[_Stateful]):
    """A module's or an optimizer's state_dict: copied at save, loaded at restore."""

    def __init__(self, value: _Stateful) -> None:
        self.value: _Stateful = value
        self.saved: dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def set_value(self, value: _Stateful) -> None:
        self.value = value
        self.save()


class _ModelHandler(_StateDictHandler[torch.nn.Module]):
    """A torch module's state_dict, broadcast with broadcast_parameters at sync."""

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=sync_root())
        self.save()  # restore() before any commit comes back to the synced values


class _OptimizerHandler(_StateDictHandler[torch.optim.Optimizer]):
    """A torch optimizer's state_dict, broadcast with broadcast_optimizer_state."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=sync_root())
        if getattr(self.value, "_order_learned", None) is not None:
            # every rank learns DistributedOptimizer's bucket order again at its next step (an
            # allreduce): a newcomer has not learnt it, and all must call the same collectives
            setattr(self.value, "_order_learned", False)  # (an attribute of DistributedOptimizer only)
        self.save()


_Handler: TypeAlias = "_ModelHandler | _OptimizerHandler | SamplerStateHandler"

# (type, handler): the first that matches a keyword's value handles it (Horovod's registry)
_HANDLERS: list[tuple[type[object], Callable[[Any], _Handler]]] = [
    (torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
    (ElasticSampler, SamplerStateHandler)]


class TorchState(ObjectState):
    """Models, optimizers, ``ElasticSampler``s and picklable attributes (``epoch=0, batch=0``),
    kept alike on every rank (Horovod's TorchState): any keyword whose value is a module, an
    optimizer or a sampler is handled as one (``TorchState(model, opt, sampler=s, critic=m2)``);
    ``commit`` copies their state_dicts, ``restore`` loads them back, ``sync`` broadcasts rank 0's
    (``sync_root()``'s after a replacement) and re-partitions the samplers over the world of now."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)  # last, as Horovod's: the same order on every rank
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            make = next((cls for kind, cls in _HANDLERS if isinstance(value, kind)), None)
            if make is None:
                plain[name] = value
            else:
                handlers[name] = make(value)
        self._handlers = handlers
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=lambda obj, root=0: broadcast_object(obj, root, name="elastic.TorchState"),
                         get_rank=rank, **plain)

    def save(self) -> None:
        """Copy the handled objects' state_dicts and the attributes."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        """Load the copies back into the handled objects; the attributes as saved."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Rank 0's parameters, optimizer state, sampler position and attributes on every rank, saved."""
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        """After a reset of ``run``: the samplers partition what is left of their epoch over the
        world of now. The sync does it too, but a shrink (hosts only removed) skips the sync: the
        ranks left would otherwise go on with the old world's shares, and the samples of the
        ranks that left would not be trained on in that epoch."""
        for handler in self._handlers.values():
            if isinstance(handler, SamplerStateHandler):
                handler.value.reset()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers: dict[str, _Handler] = self.__dict__.get("_handlers", {})
        if name in handlers:  # a new model, optimizer or sampler is tracked (and saved) from now on
            handlers[name].set_value(value)
        super().__setattr__(name, value)


def run(func: Callable[Concatenate[_S, _P], _R], reset_limit: int | None = None) -> Callable[Concatenate[_S, _P], _R]:
    """Decorate ``train(state, ...)``: sync, run, and after ``HorovodInternalError`` restore the
    last commit and retry, after ``HostsUpdatedInterrupt`` reset and go on (see _elastic.run_fn;
    the runtime's reset replaces Horovod's ``shutdown(); init()``, ``_horovod.elastic_world``)."""
    return _elastic.run_fn(func, _reset, reset_limit)


def _reset() -> None:
    """The torch adapter's part of a reset: nothing beyond the runtime's (reset_world)."""
