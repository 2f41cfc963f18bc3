"""Ranks known to be dead, so that a wait on one of them ends at once (issue 34, item 2).

MPI cannot tell a dead peer from a slow one here (MPICH's ch4 has no failure detection, see
docs/architecture.md), so a collective with a dead peer would wait for the stall timeout. Whoever
does know arms :data:`lost_ranks` with a function that returns the dead ranks' numbers: on a
notebook's cluster, the rank's respawn (``engines._respawn``), which reads the kernel's notice
that a rank died. ``Waiter.poll`` asks it every 0.25 s of a wait, as it asks the debugger's
hold, and raises ``RankLostError`` (a ``HorovodInternalError``) when a rank it waits with is
among them: ``elastic.run`` then restores its last commit and re-forms the world.

Unarmed (a plain ``mpiexec`` run), nothing is ever lost and a wait costs nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable

__all__ = ["LostRanks", "lost_ranks"]

log = logging.getLogger(__name__)


class LostRanks:
    """The source of the dead ranks' numbers, asked by the runtime's waits."""

    def __init__(self) -> None:
        self._source: Callable[[], Collection[int]] | None = None

    def arm(self, source: Callable[[], Collection[int]]) -> None:
        """From now on, ``source()`` says which ranks are dead (cheap: called every 0.25 s of a wait)."""
        if not callable(source):
            raise TypeError(f"lost_ranks.arm: expected a function returning rank numbers, got {source!r}")
        self._source = source

    def disarm(self) -> None:
        """Forget the source: no rank is lost any more."""
        self._source = None

    def among(self, ranks: Iterable[int]) -> list[int]:
        """Which of ``ranks`` are dead (``[]`` unarmed, or when the source fails: a wait never
        fails because the check did)."""
        source = self._source
        if source is None:
            return []
        try:
            lost = set(source())
        except Exception as exc:  # noqa: BLE001 - the wait goes on as if nothing were known
            log.debug("jupyter_ring: the lost-ranks check failed: %s", exc)
            return []
        return sorted(lost.intersection(ranks)) if lost else []


# One per process, like ``_observe.debugger.hold``: the engine's setup arms it, the waits read it.
lost_ranks = LostRanks()
