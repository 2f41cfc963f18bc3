"""Horovod's elastic API: state that commits, restores and syncs, host updates, and ``run``.

``State`` and ``ObjectState`` are Horovod's (``horovod.common.elastic``); the framework states
(``TorchState``, ``TensorFlowState``, ``TensorFlowKerasState``) build on ``ObjectState`` in the
adapters' ``elastic`` modules. ``run_fn`` is Horovod's loop: sync the state from rank 0, run the
training function; on ``HorovodInternalError`` (a collective failed, on every rank) restore the
last commit, reset and retry; on ``HostsUpdatedInterrupt`` (raised by ``commit`` on every rank
when the runtime signalled a host change) reset and go on from the current state. How a world
change plugs in (the signal, the reset hooks) is described in ``_horovod.elastic_world``; on today's
fixed world a reset gives up the queued collectives, calls the reset callbacks and syncs.
"""

from __future__ import annotations

import functools
import queue
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

from .. import _api
from . import elastic_world
from .basics import HorovodInternalError
from .elastic_world import HostUpdateResult, HostsUpdatedInterrupt, notification_manager

__all__ = ["State", "ObjectState", "run_fn", "reset_world", "RESET_LIMIT", "HostsUpdatedInterrupt",
           "HostUpdateResult", "HorovodInternalError"]

RESET_LIMIT = 3  # failed attempts in a row (no commit between them) after which run() gives up

_T = TypeVar("_T")
_S = TypeVar("_S", bound="State")   # the state a training function takes
_P = ParamSpec("_P")                # the training function's other arguments
_R = TypeVar("_R")                  # what it returns


class BroadcastObject(Protocol):
    """A state's ``bcast_object``: root's picklable object on every rank (root 0 unless given)."""

    def __call__(self, obj: _T, root: int = 0, /) -> _T: ...


class State:
    """A training state every rank keeps alike: ``commit`` saves it (and checks for host updates),
    ``restore`` goes back to the last commit, ``sync`` gives every rank rank 0's values
    (``elastic_world.sync_root()``'s after a rank was replaced in place).

    ``bcast_object(obj)`` broadcasts from rank 0, ``get_rank()`` says this rank (Horovod's arguments).
    """

    def __init__(self, bcast_object: BroadcastObject, get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        # (timestamp, HostUpdateResult) from notify_hosts_updated
        self._host_messages: queue.Queue[tuple[float, HostUpdateResult]] = queue.Queue()
        self._last_updated_timestamp: float = 0
        self._reset_callbacks: list[Callable[[], object]] = []
        self._commits = 0  # how many commits this state made (run's reset limit counts failures between them)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], object]]) -> None:
        """Functions called (no arguments) after each reset, e.g. to rescale the learning rate by
        the new ``size()``; ``run`` calls them after the world was reset, before the sync."""
        callbacks = list(callbacks)
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"register_reset_callbacks: {callback!r} is not callable; pass a list of "
                                "functions of no arguments")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``run`` after a reset: forget queued host updates, ``reset()``, then the callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None:
        """Queue a host update (the runtime's ``notify_hosts_updated`` calls it, from any thread)."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (``restore`` comes back here), then ``check_host_updates()``.

        A commit copies the state (from a GPU to host memory too): commit every few batches rather
        than every one to trade the steps a failure loses against the time commits take.
        """
        self.save()
        self._commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank when any rank was told of a host update
        newer than the last one acted on (one allgather of a few bytes, so all ranks raise at
        the same commit; Horovod broadcasts rank 0's view, which misses an update rank 0 was not
        told of)."""
        elastic_world.poll_host_updates()
        prev = self._last_updated_timestamp
        news: list[tuple[float, int]] = []
        while True:
            try:
                timestamp, update = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > prev:
                news.append((timestamp, int(update)))
        gathered = _api.allgather_object((prev, news), name="elastic.check_host_updates")
        prev = max(seen for seen, _ in gathered)  # a newcomer knows of no update yet (0)
        fresh = [(timestamp, update) for _, told in gathered for timestamp, update in told if timestamp > prev]
        if not fresh:
            self._last_updated_timestamp = prev
            return
        self._last_updated_timestamp = max(timestamp for timestamp, _ in fresh)
        update = HostUpdateResult.no_update
        for _, bits in fresh:
            update |= HostUpdateResult(bits)
        raise HostsUpdatedInterrupt(update == HostUpdateResult.removed,
                                    f"hosts updated ({update.name}) at commit {self._commits}: elastic.run resets "
                                    "and goes on from this commit")

    def save(self) -> None:
        """Keep the current values in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the values last saved."""
        raise NotImplementedError

    def sync(self) -> None:
        """Give every rank root's values."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adjust objects to a new world after a reset, before the sync (nothing by default)."""


class ObjectState(State):
    """Picklable values kept as attributes (``state.epoch``, ``state.batch``): saved by reference
    at ``commit``, broadcast from rank 0 (``elastic_world.sync_root()``) by ``sync`` (Horovod's ObjectState)."""

    def __init__(self, bcast_object: BroadcastObject, get_rank: Callable[[], int], **kwargs: Any) -> None:
        self._bcast_object = bcast_object
        self._saved_state: dict[str, Any] = kwargs
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    if TYPE_CHECKING:  # (for a type checker only) its attributes are the keywords it was made with
        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def save(self) -> None:
        """Keep the attributes' current values."""
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        """Set the attributes back to the values last saved."""
        self._set_attrs()

    def sync(self) -> None:
        """Every rank takes the sync root's saved values (one broadcast_object; see State)."""
        if self._saved_state:
            root = elastic_world.sync_root()
            # Horovod's bcast_object takes one argument (rank 0); ours and hvd.broadcast_object
            # take the root next, which a replacement of rank 0 needs
            self._saved_state = (self._bcast_object(self._saved_state) if root == 0
                                 else self._bcast_object(self._saved_state, root))
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


def reset_world(reason: str) -> None:
    """The runtime's part of a reset in ``run``: give up every queued collective (what the failed
    step queued must not meet the next attempt's), then run the hooks of
    ``elastic_world.on_world_reset`` (the respawn's new communicators)."""
    _api.abandon_queued(reason)
    for hook in elastic_world.world_reset_hooks():
        hook()


def run_fn(func: Callable[Concatenate[_S, _P], _R], reset: Callable[[], object],
           reset_limit: int | None = None) -> Callable[Concatenate[_S, _P], _R]:
    """``func(state, ...)`` run by Horovod's elastic loop (``horovod.common.elastic.run_fn``).

    Registers ``state`` for host updates, syncs it and calls ``func``. On ``HorovodInternalError``
    restores the last commit; on ``HostsUpdatedInterrupt`` keeps the state as it is (and skips
    the next sync when hosts were only removed). Either way then ``reset_world``, the framework's
    ``reset()``, ``state.on_reset()`` (reset callbacks), and again from the sync. More than
    ``reset_limit`` (``RESET_LIMIT``) failures in a row, with no commit between them, raise the
    last error with what happened (an addition: Horovod's driver counts resets instead).
    """
    limit = RESET_LIMIT if reset_limit is None else reset_limit
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"elastic.run: reset_limit must be an int >= 0, got {reset_limit!r}")

    def wrapper(state: _S, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not isinstance(state, State):
            raise TypeError(f"elastic run of {getattr(func, '__name__', func)!r}: the first argument must be an "
                            f"elastic State (ObjectState, TorchState, TensorFlowKerasState ...), got "
                            f"{type(state).__name__}")
        notification_manager.register_listener(state)
        skip_sync = False
        failures, commits_at_failure = 0, None
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                        elastic_world.set_sync_root(0)  # every rank holds the same state again
                    return func(state, *args, **kwargs)
                except HorovodInternalError as exc:
                    failures = failures + 1 if state._commits == commits_at_failure else 1
                    commits_at_failure = state._commits
                    if failures > limit:
                        raise HorovodInternalError(
                            f"elastic run of {getattr(func, '__name__', func)!r}: {failures} attempts in a row "
                            f"failed with no commit between them (the last: {exc}); it stops after "
                            f"reset_limit={limit} resets. Fix the cause, or pass a larger reset_limit") from exc
                    state.restore()
                    skip_sync = False
                    reason = f"elastic reset after: {exc}"
                except HostsUpdatedInterrupt as exc:
                    skip_sync = exc.skip_sync
                    reason = f"elastic reset: {exc}"
                reset_world(reason)
                reset()
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)
    functools.update_wrapper(wrapper, func)
    # (``state`` may also come by keyword, as in Horovod: Concatenate's first argument is positional)
    return cast("Callable[Concatenate[_S, _P], _R]", wrapper)
