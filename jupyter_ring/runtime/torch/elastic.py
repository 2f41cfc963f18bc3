"""``horovod.torch.elastic``: ``TorchState``, ``ElasticSampler`` and ``run`` (see ``_horovod.elastic``, ``_horovod.elastic_world``)."""

import copy

import torch

from .._horovod import elastic as _elastic
from .._horovod.elastic import ObjectState, State
from .._horovod.elastic_world import HostsUpdatedInterrupt, sync_root
from .._horovod.runtime_names import rank
from .elastic_sampler import ElasticSampler, SamplerStateHandler
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt", "run"]


class _ModelHandler:
    """A torch module's state_dict: copied at save, loaded at restore, broadcast at sync."""

    def __init__(self, model):
        self.value = model
        self.saved = None
        self.save()

    def save(self):
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self.saved)

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=sync_root())
        self.save()  # restore() before any commit comes back to the synced values

    def set_value(self, value):
        self.value = value
        self.save()


class _OptimizerHandler(_ModelHandler):
    """A torch optimizer's state_dict, broadcast with broadcast_optimizer_state."""

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=sync_root())
        if getattr(self.value, "_order_learned", None) is not None:
            # every rank learns DistributedOptimizer's bucket order again at its next step (an
            # allreduce): a newcomer has not learnt it, and all must call the same collectives
            self.value._order_learned = False
        self.save()


# (type, handler): the first that matches a keyword's value handles it (Horovod's registry)
_HANDLERS = [(torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
             (ElasticSampler, SamplerStateHandler)]


class TorchState(ObjectState):
    """Models, optimizers, ``ElasticSampler``s and picklable attributes (``epoch=0, batch=0``),
    kept alike on every rank (Horovod's TorchState): any keyword whose value is a module, an
    optimizer or a sampler is handled as one (``TorchState(model, opt, sampler=s, critic=m2)``);
    ``commit`` copies their state_dicts, ``restore`` loads them back, ``sync`` broadcasts rank 0's
    (``sync_root()``'s after a replacement) and re-partitions the samplers over the world of now."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)  # last, as Horovod's: the same order on every rank
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = next((cls for kind, cls in _HANDLERS if isinstance(value, kind)), None)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler(value)
        self._handlers = handlers
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=lambda obj, root=0: broadcast_object(obj, root, name="elastic.TorchState"),
                         get_rank=rank, **plain)

    def save(self):
        """Copy the handled objects' state_dicts and the attributes."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        """Load the copies back into the handled objects; the attributes as saved."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        """Rank 0's parameters, optimizer state, sampler position and attributes on every rank, saved."""
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:  # a new model, optimizer or sampler is tracked (and saved) from now on
            handlers[name].set_value(value)
        super().__setattr__(name, value)


def run(func, reset_limit=None):
    """Decorate ``train(state, ...)``: sync, run, and after ``HorovodInternalError`` restore the
    last commit and retry, after ``HostsUpdatedInterrupt`` reset and go on (see _elastic.run_fn;
    the runtime's reset replaces Horovod's ``shutdown(); init()``, ``_horovod.elastic_world``)."""
    return _elastic.run_fn(func, _reset, reset_limit)


def _reset():
    """The torch adapter's part of a reset: nothing beyond the runtime's (reset_world)."""
