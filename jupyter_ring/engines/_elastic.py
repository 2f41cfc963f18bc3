"""A rank replaced while ``elastic.run`` runs: the ranks' side (issue 34, item 2).

Without elastic code, the kernel ends the running cell on the survivors and re-forms the world
through requests of its own (``engines._respawn``). Under ``elastic.run`` the survivors never
leave their cell: they re-form the world from inside ``run``'s reset, and the newcomer runs the
same cell, whose ``run`` syncs the state from them. The kernel and the ranks talk through three
kinds of files in the cluster's folder (``where_dir``, one host):

- ``elastic-rank<R>``: rank R is inside ``elastic.run`` (written when a run starts, removed when
  it ends): the kernel takes this way only when every survivor has one;
- ``respawn-notice``: ``{"gen", "dead", "root"}``, written by the kernel as soon as it sees a
  rank dead. Every survivor's runtime, armed with :func:`lost` (``runtime._engine.lost``), gives
  its collective up with ``RankLostError`` (a ``HorovodInternalError``) at its next wait; ``run``
  restores the last commit and, in its reset, calls :func:`reform`;
- ``respawn-port-<gen>``: the MPI port the first survivor opened in :func:`reform`; the kernel
  hands it to the newcomer (``engines._respawn.join``), the survivors ``accept`` on it.

The same notice, with ``"resize": "grow"|"shrink"``, ``"size"`` and ``"ts"``, is host
discovery's resize while every rank runs ``elastic.run`` (``cluster._elastic_resize``). No
collective is given up for it: at the next ``state.commit()`` the poll of
``elastic_world.on_check_host_updates`` (:func:`_poll`) tells the state
(``notify_hosts_updated``, added or removed), every rank raises ``HostsUpdatedInterrupt`` at that
commit, and ``run``'s reset calls :func:`reform`: a grow is a replacement whose "dead" ranks are
the new numbers beyond the old world (every rank stays, the newcomers join on the port); a shrink
is ``engines._scale.shrink`` (no port), after which a rank beyond the new size raises
:class:`LeftTheWorld` out of ``run`` (its cell ends; the kernel then stops its engine).

``gen`` counts the cluster's changes of world (replacements and resizes, ``cluster._respawn``):
a notice is acted on once per rank (a newcomer joins knowing the generation it was made in, and
never reads its own birth as a loss).
"""

from __future__ import annotations

import os

from . import _respawn

__all__ = ["NOTICE", "LeftTheWorld", "arm", "running_path", "notice_path", "port_path", "lost", "reform",
           "running_ranks"]

NOTICE = "respawn-notice"


class LeftTheWorld(Exception):
    """This rank left the world at a commit: host discovery shrank the cluster below its number.
    Raised out of ``elastic.run`` on the ranks that leave; the notebook stops their engines and
    does not count the error as the cell's failure."""


def running_path(directory: str, rank: int) -> str:
    """The file that says rank ``rank`` is inside ``elastic.run``."""
    return os.path.join(directory, f"elastic-rank{rank}")


def notice_path(directory: str) -> str:
    """The kernel's notice that ranks died (read by every rank's waits)."""
    return os.path.join(directory, NOTICE)


def port_path(directory: str, gen: int) -> str:
    """Where the first survivor leaves the port of replacement ``gen``."""
    return os.path.join(directory, f"respawn-port-{gen}")


def running_ranks(directory: str, ranks: list[int]) -> list[int]:
    """Which of ``ranks`` are inside ``elastic.run`` now (the kernel's question)."""
    return [r for r in ranks if os.path.exists(running_path(directory, r))]


class _Armed:
    """This rank's folder and number, and the last replacement it has acted on."""

    def __init__(self) -> None:
        self.directory: str | None = None
        self.rank = -1
        self.gen = 0


_armed = _Armed()


def arm(directory: str, rank: int, gen: int = 0) -> None:
    """The rank set-up: read the kernel's notices in ``directory`` from now on (``gen``: the
    replacement this rank was made in, 0 for a rank of the first start)."""
    from ..runtime.internal import debugger, elastic_world, lost_ranks

    _armed.directory, _armed.rank = directory, rank
    _armed.gen = max(gen, _armed.gen, _respawn.joined_gen())
    debugger.remove(running_path(directory, rank))  # left by the process this one replaces
    lost_ranks.arm(lost)
    elastic_world.on_world_reset(reform)
    elastic_world.on_check_host_updates(_poll)
    elastic_world.notification_manager.watch_running(_running)


def _running(running: bool) -> None:
    from ..runtime.internal import debugger

    if _armed.directory is None:
        return
    path = running_path(_armed.directory, _armed.rank)
    if running:
        debugger.write_record(path, {"pid": os.getpid()})
    else:
        debugger.remove(path)


def _notice() -> dict[str, object] | None:
    """The kernel's notice of a replacement this rank has not acted on yet, else None."""
    from ..runtime.internal import debugger

    if _armed.directory is None:
        return None
    notice = debugger.read_record(notice_path(_armed.directory))
    if notice is None or not isinstance(notice.get("gen"), int) or int(notice["gen"]) <= _armed.gen:  # type: ignore[call-overload]
        return None
    return notice


def lost() -> list[int]:
    """The ranks the kernel said died, until this rank has re-formed its world without them
    (none for a resize: no collective is given up for it)."""
    notice = _notice()
    dead = notice.get("dead") if notice is not None and "resize" not in notice else None
    return [int(r) for r in dead] if isinstance(dead, list) else []


def _poll() -> None:
    """At a commit: a resize the kernel announced and this rank has not acted on becomes a host
    update of the running states (every rank raises ``HostsUpdatedInterrupt`` at this commit)."""
    from ..runtime.internal import elastic_world

    notice = _notice()
    if notice is None or notice.get("resize") not in ("grow", "shrink"):
        return
    update = (elastic_world.HostUpdateResult.added if notice["resize"] == "grow"
              else elastic_world.HostUpdateResult.removed)
    elastic_world.notify_hosts_updated(update, float(notice.get("ts", 0.0)))  # type: ignore[arg-type]


def reform() -> None:
    """Inside ``elastic.run``'s reset on a survivor: leave the old world, and take the newcomers
    in (``engines._respawn.leave``/``accept``); the first survivor publishes the port. Nothing
    when no notice is pending (a reset for another reason)."""
    from ..runtime.internal import debugger, elastic_world

    notice = _notice()
    if notice is None or _armed.directory is None:
        return
    if notice.get("resize") == "shrink":
        _armed.gen = int(notice["gen"])  # type: ignore[call-overload]
        _shrink(int(notice["size"]))  # type: ignore[call-overload]
        return
    raw = notice.get("dead")
    gen, dead, root = int(notice["gen"]), [int(r) for r in raw] if isinstance(raw, list) else [], int(notice.get("root", 0))  # type: ignore[call-overload]
    _armed.gen = gen  # acted on: the waits of the re-forming itself must not give up on the dead
    port = _respawn.leave(dead)
    if port:
        debugger.write_record(port_path(_armed.directory, gen), {"port": port})
    _respawn.accept(port or "")
    elastic_world.set_sync_root(root)


def _shrink(size: int) -> None:
    """A shrink inside ``run``'s reset: ranks below ``size`` re-form their world
    (``engines._scale.shrink``); a rank beyond it raises :class:`LeftTheWorld`."""
    from ..runtime.internal import elastic_world
    from . import _scale

    me = _respawn.world().Get_rank()
    if _scale.shrink(size):
        elastic_world.set_sync_root(0)
        return
    raise LeftTheWorld(f"rank {me} left the world at this commit: host discovery shrank the cluster to "
                       f"{size} rank(s), and this rank's engine stops now (the cell goes on on the others)")
