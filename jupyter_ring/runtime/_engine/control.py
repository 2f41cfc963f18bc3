"""The exceptions that steer a collective between the runtime and the engine.

None of them reaches a user: ``Restart`` makes ``Runtime.run`` resync and try again, ``Recut``,
``Disagree`` and ``Replan`` make the engine plan its round again (cut short, settled by name, or
on a fresh communicator), ``Abandoned`` stops the collective a waiting thread gave up.
"""

from __future__ import annotations

__all__ = ["Restart", "Recut", "Disagree", "Replan", "Abandoned"]


class Restart(Exception):
    """A peer asked for a resync while this rank waited: retry the collective on a fresh comm."""


class Recut(Exception):
    """The ranks' engines proposed rounds of different lengths: every rank runs the first ``count``.

    Raised on every rank by the same exchange (every rank sees every header), after it completed,
    so nothing is in flight; the engine re-plans its round and runs the collective again.
    """

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


class Disagree(Exception):
    """The ranks' headers name different collectives: the engine settles what runs by name.

    Raised on every rank by the same exchange (when headers are not all alike, every rank sees
    one unlike its own), after it completed, so nothing is in flight. Only where the engine
    allows it (``Runtime.negotiable``); elsewhere a disagreement is a mismatch, explained.
    ``gen`` is the communicator's generation: a resync before the settling exchange means a header
    came from a collective a peer abandoned (and announces now), and the round starts over.
    """

    def __init__(self, gen: int) -> None:
        super().__init__(gen)
        self.gen = gen


class Replan(Exception):
    """A resync came between the engine's plan of its round and this collective: stop before sending.

    A round's plan (the names settled, the cut of a ``Recut``) holds for the communicator
    generation it was made in (``Runtime.plan``): a resync means some rank gave up a collective
    of it, or dropped the round, and every rank moves to the next generation before it sends
    anything there. So every rank plans again from its queue (negotiable, every entry pending),
    as at the start of a round, and no rank runs a batch of a plan that a peer has left.
    """


class Abandoned(BaseException):
    """The thread waiting for this collective gave it up (interrupt, abandoned cell): stop now.

    A BaseException, as KeyboardInterrupt is: ``Runtime.run`` abandons the requests in flight and
    marks the runtime for a resync, exactly as after an interrupt in the calling thread.
    """
