"""Which allreduce algorithm runs, by message size and world (issue 33, item 2): every threshold here.

An allreduce of ``m`` bytes over ``n`` ranks on ``h`` hosts costs, in the α–β model (α the
latency of one message, β the seconds a byte; docs/scaling.md fits them to measured points):

- ``eager``: the payload rides in the agreement message, which goes to every peer: one round
  trip, ``α + (n-1)·m·β`` sent by each rank. Best while ``(n-1)·m`` is small.
- ``rd``: recursive doubling after a header-only agreement: ``⌈log2 n⌉`` exchanges of the whole
  payload, ``log2(n)·(α + m·β)`` (plus two for the ranks folded in when ``n`` is not a power of
  two). Latency-optimal: small and medium messages in large worlds.
- ``ring``: the pipelined reduce-scatter + allgather, ``2(n-1)·α + 2·(n-1)/n·m·β``:
  bandwidth-optimal, the choice for large messages.
- ``shm``: every rank on one host with shared-memory slots (``_shm``): two copies of each byte
  and a counter sync per piece, no message at all.
- ``hier``: several hosts with as many ranks each (Horovod's hierarchical allreduce): a ring
  reduce-scatter inside each host, an allreduce of each slice by the ranks of the same local
  rank across hosts (``rd`` or ``ring`` by the slice's size), a ring allgather inside each host.
  Only ``m/L`` of the data crosses the network per rank, on ``L`` links at once.
- ``local``: one participating rank, or an empty tensor: nothing moves.

``choose`` is a pure function of what every rank knows alike (the setting, the size, the
world's shape), so every rank picks the same algorithm without a message. ``JUPYTER_RING_ALLREDUCE``
(or ``init(allreduce=...)``) forces one: the same value on every rank.
"""

from __future__ import annotations

__all__ = ["ALGORITHMS", "AGREEMENTS", "EAGER_FANOUT_BYTES", "LOG_AGREEMENT_RANKS", "RD_MAX_BYTES", "Chosen",
           "agreement", "choose", "eager_limit"]

KiB = 1 << 10

ALGORITHMS = ("auto", "eager", "rd", "ring", "shm", "hier")

# The eager path sends its payload to every peer: up to this many bytes a rank sends in all
# ((n-1)·m), it stays the one-round-trip path; above, recursive doubling sends log2(n)·m.
EAGER_FANOUT_BYTES = 256 * KiB
# Recursive doubling moves log2(n)·m bytes a rank, the ring 2·m: above this size (where the
# ring's 2(n-1) latencies cost less than rd's extra bytes at the fitted α/β) the ring or the
# hierarchy runs.
RD_MAX_BYTES = 256 * KiB

AGREEMENTS = ("auto", "all", "log")
# From this many ranks on, ``auto`` relays the agreement's headers in ⌈log2 n⌉ steps instead of
# sending them to every peer. Not yet at any world size: measured on this 2-core machine at 4, 8,
# 16 and 32 ranks (oversubscribed, the only worlds it holds) the relay lost to the direct exchange
# (each of its steps waits for one more rank to be scheduled, while the direct messages are all in
# flight at once) and it gives up the eager path; the model (docs/scaling.md, "The agreement") puts
# its gain on a LAN, ranks with cores of their own, past ~16 ranks, unmeasured. Opt in with
# JUPYTER_RING_AGREEMENT=log.
LOG_AGREEMENT_RANKS = 1 << 30


def agreement(requested: str, ranks: int) -> str:
    """How a world of ``ranks`` exchanges its headers under ``requested`` (``AGREEMENTS``):
    ``all`` (to every peer) or ``log`` (Bruck's allgather); one rank has nobody to tell: ``all``."""
    if ranks <= 1:
        return "all"
    if requested == "auto":
        return "log" if ranks >= LOG_AGREEMENT_RANKS else "all"
    return requested


def eager_limit(requested: str, ranks: int, eager_bytes: int, shm: bool) -> int:
    """The largest allreduce (bytes) that takes the eager path under ``requested`` (-1: none)."""
    if requested == "eager":
        return eager_bytes
    if requested == "auto" or (requested == "shm" and not shm):
        return min(eager_bytes, EAGER_FANOUT_BYTES // max(1, ranks - 1))
    return -1


def choose(requested: str, nbytes: int, ranks: int, hosts: int, uniform: bool, eager_bytes: int,
           shm: bool, shm_threshold: int) -> str:
    """The algorithm of an allreduce of ``nbytes`` over ``ranks`` participating ranks on ``hosts``
    hosts (``uniform``: as many ranks on each), ``eager_bytes`` the agreement message's payload
    capacity, ``shm`` whether one-host shared-memory slots exist (above ``shm_threshold`` bytes).

    ``requested`` is the setting (``ALGORITHMS``): ``auto`` picks by the thresholds above; a
    forced algorithm runs wherever it can (``eager`` up to ``eager_bytes``, ``shm`` where slots
    exist), else ``auto`` decides. Returns ``eager``, ``rd``, ``ring``, ``shm``, ``hier`` or ``local``.
    """
    if nbytes <= eager_limit(requested, ranks, eager_bytes, shm):
        return "eager"
    if requested == "auto" or requested == "eager" or (requested == "shm" and not shm):
        if ranks <= 1 or nbytes == 0:
            return "local"
        if shm and 0 < shm_threshold < nbytes:
            return "shm"
        if nbytes <= RD_MAX_BYTES:
            return "rd"
        if hosts > 1 and uniform and ranks > hosts:
            return "hier"
        return "ring"
    if ranks <= 1 or nbytes == 0:
        return "local"
    return requested


class Chosen:
    """One runtime's choice kept between calls (``algorithms.eager_limit`` and ``algorithms.algorithm``
    read and renew it): ``eager``, its ``eager_limit``, and ``sizes``, the algorithm of each
    allreduce size seen, valid while the runtime's ``wiring`` (``HeaderBuffers.wiring``: the
    participants, the eager capacity) and its config's ``revision`` (the setting, the shared-memory
    threshold) are the ones they were made under. ``wiring`` -1: nothing kept (a new runtime)."""

    __slots__ = ("wiring", "revision", "eager", "sizes")

    SIZES = 256
    """At most this many sizes kept (a loop's allreduces have a few): all are forgotten past it."""

    def __init__(self) -> None:
        self.wiring = -1
        self.revision = -1
        self.eager = -1
        self.sizes: dict[int, str] = {}

    def renew(self, wiring: int, revision: int, eager: int) -> None:
        """Keep ``eager`` under ``wiring`` and ``revision`` (read before the inputs ``eager`` was
        worked out from); forget the sizes chosen before. The stamps are written last: a caller
        outside the executor lock (``_api._blocking`` after its call) that finds them current
        finds what was kept under them."""
        self.sizes = {}
        self.eager = eager
        self.revision = revision
        self.wiring = wiring

    def keep(self, nbytes: int, algorithm: str) -> str:
        """Remember ``algorithm`` for ``nbytes`` (under the present wiring and revision); returns it."""
        if len(self.sizes) >= self.SIZES:
            self.sizes.clear()
        self.sizes[nbytes] = algorithm
        return algorithm
