"""What every rank agrees to before a device collective, over the ring runtime.

NCCL and gloo hang when ranks disagree; so before every device collective each rank votes, over
the ring (interruptible, with its stall timeout), with a fingerprint of what it is about to do,
its group's generation and whether its arguments were good. A mismatch raises
``CollectiveMismatchError`` on every rank, bad arguments on one rank ``PeerError`` on the others;
a group some rank abandoned is re-created on every rank before going on.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, NoReturn, cast

import numpy as np
import numpy.typing as npt

from ... import runtime as _ring
from .._engine.core import OP_NAMES, Desc, Description, Max, describe_mismatch
from .._engine.errors import CollectiveMismatchError, PeerError

if TYPE_CHECKING:
    from .groups import DeviceGroups

__all__ = ["Agreement", "agree"]

# status of a rank in the agreement message
_OK, _BAD_ARGS = 0, 1


class Agreement(NamedTuple):
    """What every rank agreed to before a device collective."""

    rows: npt.NDArray[np.int64] | None  # every rank's aux (allgather's first dimensions), or None
    joined: bool    # some rank has called join(): its zeros go through the ring, not the group


def _fingerprint(desc: Desc) -> int:
    text = repr(desc).encode()
    return ((zlib.crc32(text) << 31) ^ zlib.adler32(text)) & ((1 << 62) - 1)


def agree(groups: DeviceGroups, rebuild: Callable[[str, list[int]], None], kind: str, name: str, device_type: str,
          desc: Desc, aux: int | None = None, error: Exception | None = None) -> Agreement:
    """Agree with every rank on ``desc`` (raises on every rank if anyone differs or failed);
    re-create the group (``rebuild(device_type, abandoned_on)``) where a rank abandoned a
    collective. Returns an ``Agreement``: every rank's ``aux`` (an int; allgather's first
    dimensions; None without ``aux``), and whether some rank has called ``join()`` (then only an
    allreduce may run, through the ring).

    Without ``aux`` the vote is one element-wise Max over seven int64s, which takes the ring's
    prepared lane after the first call (~4x cheaper than an allgather): the fingerprint and
    the generation go in as ``x`` and ``-x``, so ``max(x) != -max(-x)`` exactly when two
    ranks differ. Every rank sees the same reduced vote, so all take the same branch. A rank
    that called ``join()`` contributes zeros to the ring's allreduces: every voting rank
    puts -1 last, so a 0 there says that some rank joined (its zeros make the rest of the
    vote meaningless, and it takes no part in the group's transfers).
    """
    group = groups.lookup(device_type)
    # a group aborted here (this transport gave a collective up, or the notebook's guard
    # aborted the user's group it shares) is re-created by every rank before going on
    generation, aborted = (group.generation, bool(group.aborted)) if group else (0, False)
    if _ring.size() == 1:  # nobody to disagree with; the checks below stay local
        if error is not None:
            raise error
        if aborted:
            rebuild(device_type, [0])
        return Agreement(None if aux is None else np.array([aux], np.int64), False)
    fingerprint = _fingerprint(desc)
    if aux is None:
        vote = _vote(kind, name, fingerprint, generation, aborted, error)
        if vote is None:
            return Agreement(None, True)
        bad, differ, rebuilds, rows, abandoned = vote
    else:
        mine = np.array([[fingerprint, generation, aborted, _BAD_ARGS if error else _OK, aux]], np.int64)
        every = _ring.allgather(mine, name="jupyter_ring.device")
        bad, differ = bool((every[:, 3] == _BAD_ARGS).any()), bool((every[:, 0] != every[0, 0]).any())
        rebuilds, rows = bool(every[:, 2].any()) or bool((every[:, 1] != every[0, 1]).any()), every[:, 4]
        abandoned = [r for r in range(len(every)) if every[r, 2]]
    if bad:
        _raise_bad_arguments(kind, name, error)
    if differ:
        _raise_mismatch(kind, name, desc)
    if rebuilds:
        if abandoned is None:  # which ranks, for the log: every rank takes this branch
            flags = _ring.allgather_object(aborted, name="jupyter_ring.device.aborted")
            abandoned = [r for r, flag in enumerate(flags) if flag]
        rebuild(device_type, abandoned)
    return Agreement(rows, False)


def _vote(kind: str, name: str, fingerprint: int, generation: int, aborted: bool,
          error: Exception | None) -> tuple[bool, bool, bool, None, None] | None:
    """The one-allreduce vote: (bad, differ, rebuild, rows, abandoned), or None when some rank
    has joined (after raising this rank's own error, or a peer's bad arguments)."""
    vote = np.array([fingerprint, -fingerprint, generation, -generation, aborted,
                     _BAD_ARGS if error else _OK, -1], np.int64)
    _ring.allreduce_(vote, op=Max, name="jupyter_ring.device.vote")
    if vote[6] == 0:
        if error is not None:
            raise error
        if vote[5] == _BAD_ARGS:  # (no object exchange while a rank is joined)
            raise PeerError(f"{kind} '{name}': another rank could not join this collective and raised "
                            "its own error there; fix the call on that rank. Every rank raises here so "
                            "that none is left waiting.", None, None)
        return None
    return (bool(vote[5] == _BAD_ARGS), bool(vote[0] != -vote[1]), bool(vote[4]) or bool(vote[2] != -vote[3]),
            None, None)


def _raise_bad_arguments(kind: str, name: str, error: Exception | None) -> NoReturn:
    """Some rank's arguments were bad: it raises its own error, every other rank a PeerError."""
    reasons = _ring.allgather_object(None if error is None else f"{type(error).__name__}: {error}",
                                     name="jupyter_ring.device.error")
    if error is not None:
        raise error
    bad = next(r for r, reason in enumerate(reasons) if reason)
    raise PeerError(f"{kind} '{name}': rank {bad} could not join this collective and raised "
                    f"{reasons[bad]}. Fix the call on rank {bad}; every rank raises here so that "
                    "none is left waiting.", bad, reasons[bad])


def _raise_mismatch(kind: str, name: str, desc: Desc) -> NoReturn:
    """The ranks' descriptions differ: every rank raises the same CollectiveMismatchError."""
    labelled = dict(desc)
    op = labelled.get("op")
    mine_desc = {"kind": kind, "name": name, "op": OP_NAMES.get(op, op) if isinstance(op, int) else op,
                 "root": labelled.get("root"), "dtype": labelled.get("dtype"),
                 "desc": tuple(item for item in desc if item[0] not in ("op", "root", "dtype"))}
    descs = _ring.allgather_object(mine_desc, name="jupyter_ring.device.describe")
    # (the engine's Description, with root None where a collective has none)
    raise CollectiveMismatchError(describe_mismatch(cast("dict[int, Description]", dict(enumerate(descs)))))
