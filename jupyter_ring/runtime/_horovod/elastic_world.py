"""Where Horovod's elastic API meets a world that changes: the host-update signal and the reset hooks.

Horovod's elastic workers learn of a world change in two ways, and ``elastic.run`` handles both
(``_elastic.run_fn``); this module is the runtime's side of each, framework-free and collective-free:

1. **A rank was lost while the others worked.** A collective that cannot complete because a peer
   is gone raises ``HorovodInternalError`` (or a subclass) on every survivor. ``run`` gives the
   failed step up: it restores the last commit, calls :func:`reset_world` (which abandons what the
   failed step queued, then runs the hooks registered with :func:`on_world_reset`), calls the
   state's reset callbacks and syncs the state from rank 0 of the world that is left before it
   calls the training function again.
2. **Hosts were added or removed between steps** (Horovod's driver notifies each worker).
   :func:`notify_hosts_updated` is that notification here: it queues ``(timestamp, update)`` on
   every state that ``run`` is running. At the next ``state.commit()`` (or
   ``state.check_host_updates()``) the ranks agree on what any of them was told (one small
   allgather) and all raise ``HostsUpdatedInterrupt`` at the same commit; ``run`` then resets as
   above without a restore (the commit is current) and syncs unless hosts were only removed
   (``skip_sync``: every survivor already holds the committed state).

On a fixed world (outside a notebook cluster) nobody calls :func:`notify_hosts_updated` and no
hook is registered: a reset only abandons the queued collectives. **The respawn and host
discovery (issue 34, items 1-3)** plug in here and nowhere else (``engines._elastic``; a resize
reaches the ranks as a notice that the poll of :func:`on_check_host_updates` turns into
:func:`notify_hosts_updated` at the next commit):

- when a rank dies under a running collective, fail the survivors' collective with a subclass of
  ``HorovodInternalError`` (say ``RankLostError``, naming the rank) rather than waiting for the
  stall timeout: ``run`` catches it on every survivor;
- when the cluster replaced a rank, or will grow or shrink the world, call
  ``notify_hosts_updated(update, timestamp)`` on every surviving rank, from any thread, with one
  ``timestamp`` per event (the kernel's clock), so that a rank told late does not raise twice;
  ``update`` is ``HostUpdateResult.removed`` when ranks only went away, ``added`` or ``mixed``
  otherwise (then the state is synced to the newcomers);
- ``on_world_reset(hook)``: ``hook()`` runs on every rank inside ``run``'s reset, after the queued
  collectives were abandoned and before the state's reset callbacks and its sync. That is where
  the communicators are re-formed over the new world (Horovod: ``shutdown(); init()``): when it
  returns, ``size()`` and ``rank()`` must be the new world's, since the reset callbacks (a
  learning rate scaled by ``size()``) and ``ElasticSampler`` (re-partitioned by ``sync``) read them;
- a newcomer must enter the same ``run``-decorated function with a state of the same structure:
  its first act is ``state.sync()``, which matches the survivors' sync after their reset
  collective for collective (model, optimizer, sampler, attributes, in that order).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["HostUpdateResult", "HostsUpdatedInterrupt", "HostsListener", "NotificationManager",
           "notification_manager", "notify_hosts_updated", "on_world_reset", "remove_world_reset",
           "world_reset_hooks", "on_check_host_updates", "poll_host_updates", "sync_root", "set_sync_root"]


class HostUpdateResult(enum.IntFlag):
    """What changed in a host update (Horovod's ``horovod.runner.elastic.worker.HostUpdateResult``)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts (ranks) changed: ``elastic.run`` resets and goes on without a restore.

    Horovod's exception: ``skip_sync`` is True when hosts were only removed, so every survivor
    already holds the committed state and ``run`` need not sync it.
    """

    def __init__(self, skip_sync: bool, message: str | None = None) -> None:
        super().__init__(message or f"the hosts of the job changed (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


class HostsListener(Protocol):
    """Anything told of host updates: an elastic ``State`` while ``run`` runs it."""

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None: ...


class NotificationManager:
    """The states ``run`` is running on this rank, told of every host update (Horovod's
    ``WorkerNotificationManager`` without its network service: the runtime calls it in-process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[HostsListener] = []
        self._watchers: list[Callable[[bool], None]] = []

    def register_listener(self, listener: HostsListener) -> None:
        """Tell ``listener`` of host updates from now on (``run`` does, for its state)."""
        with self._lock:
            if not any(known is listener for known in self._listeners):
                self._listeners.append(listener)
            count = len(self._listeners)
        if count == 1:
            self._tell_watchers(True)

    def remove_listener(self, listener: HostsListener) -> None:
        """Stop telling ``listener`` (``run`` does when its function returns or raises)."""
        with self._lock:
            before = len(self._listeners)
            self._listeners = [known for known in self._listeners if known is not listener]
            emptied = before > 0 and not self._listeners
        if emptied:
            self._tell_watchers(False)

    def watch_running(self, watcher: Callable[[bool], None]) -> None:
        """Call ``watcher(True)`` when an ``elastic.run`` starts on this rank (none ran) and
        ``watcher(False)`` when the last one ends: the notebook's respawn tells the kernel so
        (a rank that died while the others run elastic code is replaced without ending the cell)."""
        if not callable(watcher):
            raise TypeError(f"watch_running: expected a function of one bool, got {watcher!r}")
        with self._lock:
            if watcher not in self._watchers:
                self._watchers.append(watcher)

    def _tell_watchers(self, running: bool) -> None:
        for watcher in list(self._watchers):
            try:
                watcher(running)
            except Exception:  # noqa: BLE001 - a watcher never fails the training
                pass

    def handle_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None:
        """Queue the update on every listener (thread-safe; they act on it at their next commit)."""
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_hosts_updated(timestamp, update_res)

    def listeners(self) -> int:
        """How many states are listening now."""
        with self._lock:
            return len(self._listeners)


notification_manager = NotificationManager()  # one per process, as Horovod's


def notify_hosts_updated(update_res: HostUpdateResult = HostUpdateResult.mixed,
                         timestamp: float | None = None) -> float:
    """The runtime's host-update signal: every elastic state ``run`` is running on this rank
    raises ``HostsUpdatedInterrupt`` at its next commit (on every rank at once).

    Call it on each rank that should know, from any thread; pass one ``timestamp`` for one event on
    every rank (``None``: this rank's clock now). Returns the timestamp used. Without a running
    ``elastic.run`` the update is dropped, as Horovod's worker drops it: a ``run`` started later
    begins with a sync anyway.
    """
    if not isinstance(update_res, HostUpdateResult):
        if not isinstance(update_res, int) or isinstance(update_res, bool) or not 0 <= update_res <= 3:
            raise ValueError(f"notify_hosts_updated: update_res must be a HostUpdateResult (removed, added, "
                             f"mixed), got {update_res!r}")
        update_res = HostUpdateResult(update_res)
    stamp = time.time() if timestamp is None else float(timestamp)
    notification_manager.handle_hosts_updated(stamp, update_res)
    return stamp


_world_reset_hooks: list[Callable[[], None]] = []


def on_world_reset(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook()`` in every reset of ``elastic.run`` on this rank, after the queued collectives
    were abandoned, before the state's reset callbacks and sync (where the respawn re-forms the
    communicators over the new world). Returns ``hook``, so it can decorate."""
    if not callable(hook):
        raise TypeError(f"on_world_reset: expected a function of no arguments, got {hook!r}")
    if hook not in _world_reset_hooks:
        _world_reset_hooks.append(hook)
    return hook


def remove_world_reset(hook: Callable[[], None]) -> None:
    """Stop running ``hook`` in resets (nothing happens if it was not registered)."""
    if hook in _world_reset_hooks:
        _world_reset_hooks.remove(hook)


def world_reset_hooks() -> list[Callable[[], None]]:
    """The hooks a reset runs, in the order registered."""
    return list(_world_reset_hooks)


_host_update_polls: list[Callable[[], None]] = []


def on_check_host_updates(poll: Callable[[], None]) -> Callable[[], None]:
    """Call ``poll()`` on this rank at every ``state.check_host_updates()`` (every commit), before
    the updates are read: where a notice that comes from outside the process (the notebook's
    host discovery writes a file) is turned into :func:`notify_hosts_updated`, with no thread
    of its own. Returns ``poll``."""
    if not callable(poll):
        raise TypeError(f"on_check_host_updates: expected a function of no arguments, got {poll!r}")
    if poll not in _host_update_polls:
        _host_update_polls.append(poll)
    return poll


def poll_host_updates() -> None:
    """Run the polls of :func:`on_check_host_updates` (``State.check_host_updates`` does)."""
    for poll in list(_host_update_polls):
        poll()


_sync_root = 0


def sync_root() -> int:
    """The rank whose state the next ``state.sync()`` gives every rank: 0 (Horovod's), except
    after a rank was replaced in place, where it is the first survivor (rank 0 itself may be the
    newcomer, whose state is fresh) until that sync is done (``run`` sets it back to 0)."""
    return _sync_root


def set_sync_root(rank: int) -> None:
    """Sync the next state from ``rank`` (the respawn calls it on every rank of the new world)."""
    global _sync_root
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"set_sync_root: rank must be an int >= 0, got {rank!r}")
    _sync_root = rank
