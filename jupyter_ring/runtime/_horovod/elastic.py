"""Horovod's elastic API for a fixed world: state that commits, restores and syncs, and ``run``.

In a jupyter_ring cluster no rank joins or leaves while a cell runs, so there is no host
discovery and no resize: ``run`` syncs the state from rank 0, runs the training function, and when
a collective fails with ``HorovodInternalError`` (on every rank, as a failed collective does)
gives up what was queued, restores the last commit and tries again after a new sync, at most
``reset_limit`` times. ``check_host_updates`` never finds an update. The framework states
(``TorchState``, ``TensorFlowState``, ``TensorFlowKerasState``) build on ``ObjectState`` in the
adapters' ``elastic`` modules.
"""

import functools

from .. import _api
from .basics import HorovodInternalError

__all__ = ["State", "ObjectState", "run_fn", "RESET_LIMIT"]

RESET_LIMIT = 3  # consecutive failed attempts after which run() gives up (horovodrun's --reset-limit)


class State:
    """A training state every rank keeps alike: ``commit`` saves it, ``restore`` goes back to the
    last commit, ``sync`` gives every rank root's (rank 0's) values."""

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called (no arguments) after each reset, e.g. to rescale the learning rate."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Called by ``run`` after a reset: ``reset()``, then the registered callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        """Horovod's driver calls this when hosts change; a fixed world never does (kept for the API)."""

    def commit(self):
        """Save the state (``restore`` comes back here) and check for host updates (never any)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Horovod raises HostsUpdatedInterrupt here when hosts were added or removed; in a fixed
        world none are, so this returns at once (and, unlike Horovod's, runs no collective)."""

    def save(self):
        """Keep the current values in memory."""
        raise NotImplementedError

    def restore(self):
        """Go back to the values last saved."""
        raise NotImplementedError

    def sync(self):
        """Give every rank root's values."""
        raise NotImplementedError

    def reset(self):
        """Adjust the state to a new world size (here the size never changes)."""


class ObjectState(State):
    """Picklable values kept as attributes (``state.epoch``, ``state.batch``): saved by reference
    at ``commit``, broadcast from rank 0 by ``sync`` (Horovod's ObjectState)."""

    def __init__(self, bcast_object, get_rank, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def save(self):
        """Keep the attributes' current values."""
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self):
        """Set the attributes back to the values last saved."""
        self._set_attrs()

    def sync(self):
        """Every rank takes rank 0's saved values (one broadcast_object)."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


def run_fn(func, reset, reset_limit=None):
    """``func(state, ...)`` run by Horovod's elastic loop, for a fixed world.

    Syncs ``state`` from rank 0 and calls ``func``; on ``HorovodInternalError`` gives up the
    queued collectives, restores the last commit, calls ``reset()`` and ``state.on_reset()`` and
    tries again (syncing first), at most ``reset_limit`` times in a row (``RESET_LIMIT``).
    """
    limit = RESET_LIMIT if reset_limit is None else reset_limit

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        failures = 0
        while True:
            state.sync()
            try:
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                failures += 1
                if failures > limit:
                    raise HorovodInternalError(
                        f"elastic run of {getattr(func, '__name__', func)!r}: {failures} attempts in a row failed "
                        f"(the last: {exc}); a fixed world cannot replace a failing rank, so it stops after "
                        f"reset_limit={limit} resets. Fix the cause, or pass a larger reset_limit") from exc
                _api.abandon_queued(f"elastic reset after: {exc}")
                state.restore()
            reset()
            state.on_reset()
    return wrapper
