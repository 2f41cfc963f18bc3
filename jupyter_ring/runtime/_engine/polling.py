"""The runtime's polled waits: every wait of a collective polls from Python, so that SIGINT, a
peer's resync notice, a lost rank and the stall timeout are seen within milliseconds.

A wait polls back to back at first (spinning, or giving the core away where ranks outnumber
cores: the policy of ``waits``), then backs off. After a quarter of a second it also names the
ranks it waits on (``%ring where``), gives up at once when one of them died, and stops the stall
clock while a rank it waits on is held in a debugger; ``stall_warning`` and ``stall_timeout``
warn and raise ``StallError`` naming the missing ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .control import Abandoned, Restart
from .errors import RankLostError, StallError
from .lost import lost_ranks
from .waits import FIRST_NAP, HELD_NAP, SPIN_SECONDS, WaitPolicy, choose, next_nap, yields_now
from .._observe.debugger import hold
from .._observe.report import reporter
from .._observe.where import activity

if TYPE_CHECKING:
    from mpi4py import MPI

    from .core import Runtime

__all__ = ["Waiter"]

log = logging.getLogger(__name__)

_MAIN_THREAD = threading.main_thread().ident
_LOOK_EVERY = 0.25  # seconds between two looks at lost, missing and held ranks in a long wait


@dataclasses.dataclass(slots=True)
class _StallClock:
    """One wait's account once it backs off: what it told (a stall warning, ranks held in a
    debugger), when it last named the ranks waited on, and since when the stall clock runs."""

    warned: bool = False
    named: float = -1.0        # when the ranks waited on were last told to the activity record
    stall_from: float = 0.0    # seconds waited when a peer was last seen held in a debugger
    held_told: list[int] = dataclasses.field(default_factory=list)
    held_now: bool = False


class Waiter:
    """The waits of one runtime: ``wait`` for requests, ``poll`` for any condition."""

    def __init__(self, rt: Runtime, policy: WaitPolicy) -> None:
        self.rt = rt
        self._policy = policy
        self._testall = rt.MPI.Request.Testall
        self.nap = 0.0            # seconds a background wait sleeps between polls (see poll)

    def yields_now(self, now: float) -> bool:
        """Whether a wait beginning at ``now`` (``perf_counter``) gives its core away between its
        first polls: always under ``yield``, while the host is busy under ``auto``'s spin."""
        return yields_now(self.policy(), now)

    def rechoose(self, ranks_on_host: int) -> None:
        """The hosts are known: choose the wait for this host's ranks."""
        self._policy = choose(self.rt.config.wait, ranks_on_host, self._policy.cores)

    def policy(self) -> WaitPolicy:
        """The wait in force (``config.wait`` resolved for this host's ranks and cores)."""
        if self._policy.requested != self.rt.config.wait:  # the live config was changed
            self.rechoose(self.rt.local_size)
        return self._policy

    def wait(self, reqs: Sequence[MPI.Request], what: str | Callable[[], str], peers_of: Sequence[int],
             check_notices: bool = True, missing: Callable[[], Sequence[int]] | None = None) -> None:
        """Wait for every request, polling from Python so that signals are handled.

        ``peers_of[i]`` is the rank request ``i`` waits on, used to name missing ranks, unless
        ``missing`` (a function returning the ranks) says better.
        """
        Testall = self._testall
        if Testall(reqs):
            return
        if missing is None:
            missing = lambda: self._missing(reqs, peers_of)  # noqa: E731
        self.poll(lambda: Testall(reqs), what() if callable(what) else what, missing, check_notices)

    def poll(self, done: Callable[[], object], what: str, missing: Callable[[], Sequence[int]],
             check_notices: bool = True) -> None:
        """Call ``done()`` until it is true: poll at first, then back off (signals are handled).

        How the first polls share the core is the wait policy's (``waits``). A peer's RESYNC
        notice raises ``Restart``; after ``stall_timeout`` ``StallError`` names the ranks that
        ``missing()`` returns.
        """
        start = time.perf_counter()
        spin_until = start + SPIN_SECONDS
        # The engine's background thread, while the caller computes, naps between polls instead of
        # spinning: a thread spinning in Python keeps the GIL, and the caller (whose torch and
        # numpy calls let go of it) would wait a whole switch interval (5 ms) to get it back.
        nap = self.nap if threading.get_ident() != _MAIN_THREAD else 0.0
        # ranks outnumber cores, or other tasks want them: the peer may need this very core
        yields = self.yields_now(start)
        while time.perf_counter() < spin_until:
            if done():
                return
            if nap:
                time.sleep(nap)
            elif yields:
                os.sched_yield()
        self._back_off(done, what, missing, check_notices, start)

    def _back_off(self, done: Callable[[], object], what: str, missing: Callable[[], Sequence[int]],
                  check_notices: bool, start: float) -> None:
        """``poll`` after its first polls: sleep between polls, longer and longer, and watch for
        interrupts, resyncs, lost ranks, ranks held in a debugger and the stall timeout."""
        rt = self.rt
        config = rt.config
        clock = _StallClock()
        delay = FIRST_NAP
        while True:
            if done():
                self._quiet(clock)
                return
            if rt.abort is not None:
                raise Abandoned(rt.abort)
            if check_notices and rt.recovery.must_restart():
                raise Restart()
            waited = time.perf_counter() - start
            if waited - clock.named >= _LOOK_EVERY:
                self._look_around(clock, what, missing, waited)
            stalled = waited - clock.stall_from
            if stalled > config.stall_warning and not clock.warned:
                clock.warned = True
                absent = rt.name_of(missing())
                log.warning("jupyter_ring: rank %d has waited %.0f s in %s for rank(s) %s",
                            rt.world[rt.rank], stalled, what, absent)
                reporter.stalled(what, absent, stalled)
            if stalled > config.stall_timeout:
                absent = rt.name_of(missing())
                reporter.stalled(None, (), 0.0)
                raise StallError(
                    f"{what}: rank {rt.world[rt.rank]} waited {stalled:.1f} s for rank(s) {absent}, "
                    f"which never arrived (stall timeout {config.stall_timeout:g} s). Every rank must "
                    "call the same collectives in the same order; a rank that raised, skipped a call or "
                    "died leaves the others waiting. Raise JUPYTER_RING_STALL_TIMEOUT if a rank is just "
                    "slow.", absent)
            time.sleep(delay)
            # a rank held in a debugger waits for a person: nap longer (SIGINT still ends a nap)
            delay = HELD_NAP if clock.held_now else next_nap(delay, waited)

    @staticmethod
    def _quiet(clock: _StallClock) -> None:
        """The wait ends: take back what it told (a stall, held ranks, the ranks waited on)."""
        if clock.warned or clock.held_told:
            reporter.stalled(None, (), 0.0)
        activity.waiting(())

    def _look_around(self, clock: _StallClock, what: str, missing: Callable[[], Sequence[int]],
                     waited: float) -> None:
        """Every quarter second of a long wait: give up at once if a peer died, tell the activity
        record whom this rank waits on, and stop the stall clock while a peer is held in a
        debugger (a rank at a breakpoint is not a stall). Checked from 0.25 s on, so a
        collective that completes sooner never lists the debugger's folder."""
        rt = self.rt
        clock.named = waited
        gone = lost_ranks.among(r for r in rt.world if r != rt.world[rt.rank])
        if gone:  # a dead peer never arrives: give the collective up now (issue 34)
            self._quiet(clock)
            raise RankLostError(
                f"{what}: rank(s) {gone} died, and rank {rt.world[rt.rank]} gave the collective "
                "up. Under elastic.run the state goes back to its last commit and training goes on "
                "once the rank is replaced; elsewhere the cell fails.", gone)
        absent_ranks = missing()
        activity.waiting(absent_ranks)
        if waited < _LOOK_EVERY:
            return
        held = hold.peers()
        clock.held_now = bool(held)
        if held:
            clock.stall_from = waited
            # said when the stall warning would have been: a short pause stays quiet
            if held != clock.held_told and waited > rt.config.stall_warning:
                clock.held_told = held
                self._tell_held(what, absent_ranks, held, waited)
        elif clock.held_told:
            clock.held_told = []
            reporter.stalled(None, (), 0.0)

    def _tell_held(self, what: str, missing: Sequence[int], held: Sequence[int], waited: float) -> None:
        """Say, once per change, that this wait is on ranks held in a debugger: not a stall."""
        rt = self.rt
        absent = rt.name_of(missing)
        ranks = ", ".join(map(str, held))
        note = f"rank {ranks} is in the debugger" if len(held) == 1 else f"ranks {ranks} are in the debugger"
        log.warning("jupyter_ring: rank %d has waited %.0f s in %s for rank(s) %s; %s (not a stall: "
                    "the stall timeout counts again once it leaves)", rt.world[rt.rank], waited,
                    what, absent, note)
        reporter.stalled(what, absent, waited, held)

    @staticmethod
    def _missing(reqs: Sequence[MPI.Request], peers_of: Sequence[int]) -> list[int]:
        return sorted({peers_of[i] for i, req in enumerate(reqs) if not req.Test()})
