"""Which ranks of a :class:`RingCluster` are alive: the ranks the controller lost, the wait for the
job to react to a death, and the message for them (from the engine sets' output, read here and
diagnosed by ``_death``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .._ipp import launcher_output
from ._death import RESTART_FIX, describe_death, says_how

if TYPE_CHECKING:
    from ._ring import RingCluster

__all__ = ["dead_ranks", "dead_ranks_settled", "describe", "engines_output"]


def dead_ranks(rc: RingCluster) -> list[int]:
    """Ranks whose engine has unregistered from the controller (died or was killed)."""
    if rc.client is None or rc.ipp_cluster is None:
        return []
    keepers = rc.plan_used is not None and rc.plan_used.keeper
    # mpiexec has exited: every rank is gone. Not so under keepers: a replaced rank's job
    # (mpiexec -n 1) ends with that rank alone, and each dead engine's nanny unregisters it
    if not keepers and any(es.state == "after" for es in rc.ipp_cluster.engines.values()):
        return list(range(rc.size))
    alive = set(rc.client.ids)
    return [rank for rank, eid in enumerate(rc.engine_ids) if eid not in alive]


def dead_ranks_settled(rc: RingCluster, dead: list[int], within: float = 2.0) -> list[int]:
    """``dead`` once the job has reacted to it: MPI ends the other ranks of a job whose rank
    died (MPICH's default), which takes it about a second on one host (measured: the other
    rank's process exits 1.05 s after the SIGKILL). Waits until every rank is gone or
    ``within`` seconds passed, so that a report names every rank that is lost, as
    ``%ring status`` will a moment later."""
    if rc.plan_used is not None and rc.plan_used.keeper:
        return dead  # the ranks' keepers keep the others alive: no one else is lost
    deadline = time.monotonic() + within
    while len(dead) < rc.size and time.monotonic() < deadline:
        time.sleep(0.05)
        dead = dead_ranks(rc)
    return dead


def describe(rc: RingCluster, dead: Iterable[int], fix: str = RESTART_FIX, settle: float = 2.0) -> str:
    """A message for dead ranks: which died first and how (nanny log, mpiexec report, a
    keeper's line), ``fix``. Under keepers the signal comes in the rank's keeper's line,
    which may follow its nanny's by a moment: a message that does not say how yet is read
    again for up to ``settle`` seconds ("died (engine process exited)" where the rank was
    SIGKILLed, or a bare "died")."""
    dead = list(dead)
    deadline = time.monotonic() + settle
    while True:
        text = describe_death(dead, rc.ranks, rc.engine_ids, engines_output(rc), fix)
        keepers = rc.plan_used is not None and rc.plan_used.keeper
        if not keepers or says_how(text) or time.monotonic() >= deadline:
            return text
        time.sleep(0.1)


def engines_output(rc: RingCluster) -> str:
    """What the engine sets wrote (mpiexec's report, the nannies' and keepers' lines), a job
    that has ended included (ipyparallel removes its file then and keeps the text: a rank that
    was the last of its job, a replacement's, died with it); "" where it cannot be read: a
    message built from it is the point, its detail a bonus."""
    try:
        return "".join(launcher_output(engine_set) for engine_set in rc._running_cluster.engines.values())
    except Exception:  # noqa: BLE001
        return ""
