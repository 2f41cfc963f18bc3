"""Settling by name: when the ranks' queues disagree, every rank tells the others what it queued
(an ``Offer``) and all run what every rank queued (``settle_by_name``), as Horovod matches
collectives by name.

With no common name the ranks wait while some rank's caller still computes; once every caller is
blocked (``feeding`` says when other threads may still queue on a waiting caller's behalf) the
first collectives run against each other and raise the mismatch; after ``stall_timeout`` each
entry fails naming the ranks that never queued it. ``Settler`` is one engine's side of it.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from . import collectives
from .control import Abandoned, Recut, Replan
from .core import Runtime
from .entries import Entry, entry_kind
from .errors import StallError
from .._observe.debugger import hold

if TYPE_CHECKING:
    from .progress import Engine

__all__ = ["Offer", "Verdict", "settle_by_name", "feeding", "Settler"]

_SETTLE_GRACE = 0.05  # seconds every rank must have waited, blocked, before no common name is a mismatch
_SETTLE_NAP = 0.02    # longest sleep between two settling exchanges while some rank computes
_FEED_QUIET = 1.0     # seconds a rank's queue must not grow, while a feeder waits, before it is blocked


class _Feeders:
    """How many threads of this process wait on a collective while other threads of it may still
    queue more on their behalf (the ops of a TF1 session: its inter-op threads submit them while
    earlier ones wait). A waiting caller alone cannot queue more, so no common name among blocked
    ranks is a mismatch at once; with feeders, only once the rank's queue stopped growing."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self.lock:
            self.count += 1
        try:
            yield
        finally:
            with self.lock:
                self.count -= 1


feeding = _Feeders()  # ``with feeding():`` around a wait that other threads may feed

class Offer(NamedTuple):
    """What one rank tells the others when their queues disagree (the settling exchange)."""

    blocked: bool             # a caller waits on this engine: it cannot queue more by itself
    waited: float             # seconds since this rank's queue first failed to settle (0: it just did)
    entries: tuple[tuple[str, str], ...]  # (kind, name) of every queued collective, in call order


class Verdict(NamedTuple):
    """What every rank runs after settling, computed alike from every rank's ``Offer``."""

    action: str               # "run", "wait", "mismatch" (every rank blocked) or "stall"
    names: tuple[str, ...] = ()  # "run": the common names, in the lowest rank's order
    missing: dict[str, list[int]] | None = None  # "stall": name -> ranks that have not queued it


def settle_by_name(offers: Sequence[Offer], stall_timeout: float, grace: float = _SETTLE_GRACE) -> Verdict:
    """Horovod's matching: a collective runs once every rank has queued its name.

    ``offers`` is every rank's ``Offer`` in rank order. The names queued on every rank run, in the
    lowest rank's order (their signatures are then checked as always: the same name with another
    shape is a mismatch). With no common name: every rank waits while some rank's caller still
    computes (it may queue the missing ones); once every rank's caller is blocked (and has been for
    ``grace`` seconds, so that another thread of it could have queued more) nobody can, and the
    ranks' first collectives run against each other, which raises the mismatch on every rank; after
    ``stall_timeout`` the ranks stall, naming for each name the ranks that never queued it.
    """
    sets = [{name for _kind, name in offer.entries} for offer in offers]
    common = set.intersection(*sets) if sets else set()
    if common:
        first = next(offer for offer in offers if offer.entries)
        return Verdict("run", tuple(name for _kind, name in first.entries if name in common))
    waited = max(offer.waited for offer in offers)
    if all(offer.blocked for offer in offers) and waited >= grace:
        return Verdict("mismatch")
    if waited > stall_timeout:
        names = {name for names in sets for name in names}
        return Verdict("stall", missing={name: [q for q, names in enumerate(sets) if name not in names]
                                         for name in names})
    return Verdict("wait")



class Settler:
    """One engine's side of settling by name: since when its queue has failed to settle, and what
    it last offered (a waiting caller counts as blocked once a fed queue stopped growing)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.unsettled_since: float | None = None  # when settling by name first found no common name
        self.held_checked = 0.0                # when settling last looked for ranks held in a debugger
        # the entries of this rank's last offer, and since when
        self.offered: tuple[tuple[tuple[str, str], ...], float] | None = None

    def settle(self, finished: set[int], gen: int) -> list[Entry] | None:
        """The ranks' queues disagree: agree by name on what runs now (one exchange, every rank).

        Returns the entries to run as the round, in the agreed order; none while the ranks wait
        for each other (after a nap: the executor then starts a new round, which every rank does
        alike), or after failing the queued entries with a stall. None when a resync came first
        (``gen`` is the disagreeing exchange's generation): the disagreeing header was a message
        of a collective a peer abandoned, not what the peer runs now; the round starts over.
        """
        mine = self.engine.queue.unfinished(finished)
        since = self.unsettled_since
        offer = self._offer(mine)
        offers = self._exchange(offer, gen)
        if offers is None:
            return None
        verdict = settle_by_name(offers, self.engine.config.stall_timeout)
        if verdict.action == "run":
            self.unsettled_since = None
            by_name = {entry.name: entry for entry in mine}
            return [by_name[name] for name in verdict.names]
        if verdict.action == "mismatch":
            # nobody can queue more: the first collectives meet; their exchange explains how
            # they differ, on every rank (a rank with nothing queued has no blocked caller)
            self.unsettled_since = None
            return mine[:1]
        if verdict.action == "stall":
            self._stall(mine, offers, verdict.missing, offer.waited)  # type: ignore[arg-type]  # (set on a stall)
            return []
        if since is None:
            self.unsettled_since = time.perf_counter()
        self._nap(min(_SETTLE_NAP, max(1e-3, offer.waited / 4)))
        return []

    def _offer(self, mine: list[Entry]) -> Offer:
        """What this rank tells the others: its queued entries, how long it has failed to settle,
        and whether a caller is blocked on it."""
        since = self.unsettled_since
        now = time.perf_counter()
        waited = 0.0 if since is None else now - since
        if waited >= 0.25 and now - self.held_checked >= 0.25:
            # a rank held in a debugger (this one included) is not a stall: the clock starts over
            self.held_checked = now
            if hold.anyone():
                self.unsettled_since, waited = now, 0.0
        entries = tuple((entry_kind(e), e.name) for e in mine)
        if self.offered is None or self.offered[0] != entries:
            self.offered = (entries, now)
        # with feeders (see _Feeders) a waiting caller is blocked only once the queue stopped growing
        blocked = self.engine.callers > 0 and (feeding.count == 0 or now - self.offered[1] >= _FEED_QUIET)
        return Offer(blocked, waited, entries)

    def _exchange(self, offer: Offer, gen: int) -> list[Offer] | None:
        """Every rank's ``Offer`` (one allgather); None when a resync came first."""
        rt = self.engine.rt
        rt.pending = 1
        rt.negotiable = False
        data = np.frombuffer(pickle.dumps(offer), np.uint8)

        def exchange(rt: Runtime) -> list[Offer]:
            # every rank sends its Offer
            return collectives.allgather_object(rt, data, "jupyter_ring.settle", None)  # type: ignore[return-value]

        rt.plan = gen  # a resync since the disagreement: it was with a round a peer gave up
        try:
            return rt.run(exchange, rt)
        except Replan:
            return None
        except Recut:
            # A header of another round met this exchange. Every rank that saw the disagreement
            # settles now, so it was sent before its sender gave that round up: its sender
            # resyncs at its next collective. This rank resyncs too, at once: every rank then
            # plans again on the new generation (Replan), none acts on what it read here.
            rt.dirty = True
            return None

    def _nap(self, seconds: float) -> None:
        """Sleep between settling exchanges; the caller's thread stays interruptible, the
        background thread stops when its round is given up."""
        rt = self.engine.rt
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            if rt.abort is not None:
                raise Abandoned(rt.abort)
            time.sleep(min(1e-3, seconds))

    def _stall(self, mine: list[Entry], offers: Sequence[Offer], missing: dict[str, list[int]], waited: float) -> None:
        """No name was queued on every rank for ``stall_timeout``: fail this rank's queued entries,
        each naming the ranks that never queued it and what they queued instead."""
        engine = self.engine
        rt = engine.rt
        timeout = engine.config.stall_timeout
        for entry in mine:
            absent = rt.name_of(missing.get(entry.name, ()))
            instead = "; ".join(f"rank {rt.world[q]}: " + (", ".join(f"{k} '{n}'" for k, n in offers[q].entries[:5])
                                                          or "nothing")
                                for q in missing.get(entry.name, ()))
            error = StallError(
                f"{entry_kind(entry)} '{entry.name}': rank {rt.world[rt.rank]} waited {waited:.1f} s for rank(s) "
                f"{absent} to call it, which never did (stall timeout {timeout:g} s); they queued other "
                f"collectives ({instead}). Collectives are matched between ranks by name: every rank must "
                "call the same ones, with the same names. Raise JUPYTER_RING_STALL_TIMEOUT if a rank is "
                "just slow.", absent)
            engine.results.setdefault(entry.handle, error)
        engine.queue.remove({entry.handle for entry in mine})
        self.unsettled_since = None
