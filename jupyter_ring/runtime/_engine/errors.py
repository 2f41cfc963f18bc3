"""The runtime's exceptions: one root, a few subclasses."""

from collections.abc import Iterable

__all__ = ["RingError", "NotInitializedError", "CollectiveMismatchError", "StallError", "PeerError",
           "HorovodInternalError", "RankLostError"]


class RingError(RuntimeError):
    """Root of every error the ring runtime raises."""


class NotInitializedError(RingError, ValueError):
    """A collective was called before ``init()`` (or after ``shutdown()``)."""


class CollectiveMismatchError(RingError):
    """Ranks entered the same collective with different kind, dtype, shape, op, root or name.

    Raised on every rank that entered the collective, with the same message everywhere.
    """


class StallError(RingError):
    """Some ranks never arrived at a collective within the stall timeout.

    ``missing`` lists the ranks this rank waited for.
    """

    def __init__(self, message: str, missing: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class PeerError(RingError):
    """Another rank could not join the collective (its arguments were bad) and said why.

    The rank at fault raises its own error (TypeError, ValueError ...); the others raise this,
    naming it, instead of waiting for the stall timeout. ``rank`` and ``reason`` say who and why.
    """

    def __init__(self, message: str, rank: int | None, reason: str | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason


class HorovodInternalError(RingError):
    """Horovod's name for a collective that failed inside the runtime (a ``RingError`` here):
    ``elastic.run`` restores the last commit and tries again after it."""


class RankLostError(HorovodInternalError):
    """A rank this collective waited for died (``lost`` names it): the collective is given up at
    once instead of waiting for the stall timeout (see ``lost.lost_ranks``)."""

    def __init__(self, message: str, lost: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.lost = tuple(lost)
