"""``horovod.torch.elastic`` for a fixed world: ``TorchState`` and ``run`` (see ``_horovod.elastic``)."""

import copy

from .._horovod import elastic as _elastic
from .._horovod.elastic import ObjectState, State
from .._horovod.runtime_names import rank
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["State", "ObjectState", "TorchState", "run"]


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
        broadcast_parameters(self.value.state_dict(), root_rank=0)
        self.save()  # restore() before any commit comes back to the synced values


class _OptimizerHandler(_ModelHandler):
    """A torch optimizer's state_dict, broadcast with broadcast_optimizer_state."""

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)
        self.save()


class TorchState(ObjectState):
    """A model, an optimizer and any picklable attributes (``epoch=0, batch=0``), kept alike on
    every rank: ``commit`` copies their state_dicts, ``restore`` loads them back, ``sync``
    broadcasts rank 0's (Horovod's TorchState)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        handlers = {}
        for name, value in (("model", model), ("optimizer", optimizer)):
            if value is not None:
                handlers[name] = _ModelHandler(value) if name == "model" else _OptimizerHandler(value)
        self._handlers = handlers
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=lambda obj: broadcast_object(obj, 0, name="elastic.TorchState"),
                         get_rank=rank, **kwargs)

    def save(self):
        """Copy the model's and optimizer's state_dicts and the attributes."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        """Load the copies back into the model and optimizer; the attributes as saved."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        """Rank 0's parameters, optimizer state and attributes on every rank, saved (as Horovod)."""
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:  # a new model or optimizer object is tracked from now on
            handlers[name].value = value
        super().__setattr__(name, value)


def run(func, reset_limit=None):
    """Decorate ``train(state, ...)``: sync, run, and after ``HorovodInternalError`` restore the
    last commit and retry (a fixed world: nothing to re-initialise; see ``_horovod.elastic.run_fn``)."""
    return _elastic.run_fn(func, lambda: None, reset_limit)
