"""A rank replaced in place: the survivors and the newcomers re-form one world, on the engines.

MPI's world is fixed at launch, so the world the runtime runs on is the latest communicator made
here (``MPI.COMM_WORLD`` until a rank is replaced). The notebook (``cluster._respawn``) calls,
in order:

1. :func:`leave` on every survivor: the runtime is shut down (its communicators, shared-memory
   slots, queued work and process sets go: nothing of the old world reaches the new one), the
   survivors make a communicator of their own with ``Create_group`` (collective over them
   alone: the dead rank is never waited for), and the first survivor opens an MPI port;
2. :func:`accept` on the survivors and :func:`join` on the newcomers (a separate
   ``mpiexec -n k`` job of ipyparallel engines): ``Accept``/``Connect`` on that port, then
   ``Intercomm.Merge`` and a ``Split`` keyed by rank number, so each newcomer gets the number of
   the rank it replaces and the survivors keep theirs; the runtime starts on that communicator
   with the survivors' configuration.

The survivors' namespaces are untouched; only the runtime's state is re-made.
"""

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["world", "leave", "accept", "join", "joined_gen", "missing"]


class _World:
    """This rank's current world (None: ``MPI.COMM_WORLD``) and the survivors' communicator
    between :func:`leave` and :func:`accept`."""

    def __init__(self) -> None:
        self.comm: "MPI.Intracomm | None" = None
        self.survivors: "MPI.Intracomm | None" = None
        self.port: str | None = None
        self.config: dict[str, object] = {}
        self.gen = 0  # the replacement this rank joined in (0: a rank of the first start)


_state = _World()


def world() -> "MPI.Intracomm":
    """The communicator of this rank's current world (``MPI.COMM_WORLD`` until a replacement)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD if _state.comm is None else _state.comm


def leave(dead: Sequence[int]) -> str | None:
    """Every survivor: stop the runtime and make the survivors' communicator (without ``dead``).

    Returns the MPI port the newcomers connect to on the first survivor, None on the others.
    """
    from mpi4py import MPI

    from .. import runtime as ring

    if ring.is_initialized():
        _state.config = dataclasses.asdict(ring.config())
    ring.shutdown()
    _close_port()
    old = world()
    old.Set_errhandler(MPI.ERRORS_RETURN)  # a dead peer is an error to report, not an abort
    group = old.Get_group()
    # (a growing world passes its new ranks' numbers, beyond the old world: nothing to exclude)
    survivors_group = group.Excl([r for r in sorted(set(dead)) if r < group.Get_size()])
    group.Free()
    _state.survivors = old.Create_group(survivors_group)
    survivors_group.Free()
    if _state.survivors.Get_rank() == 0:
        _state.port = MPI.Open_port()
    return _state.port


def accept(port: str) -> int:
    """Every survivor, after :func:`leave`: take the newcomers in on ``port`` (the first
    survivor's) and start the runtime on the new world; returns this rank's number (unchanged)."""
    from mpi4py import MPI

    survivors = _state.survivors
    if survivors is None:
        raise RuntimeError("accept() before leave(): this rank has no survivors' communicator")
    me = world().Get_rank()
    inter = survivors.Accept(port, MPI.INFO_NULL, 0)  # read on the first survivor only
    new = _merge(inter, high=False, key=me)
    survivors.Free()
    _state.survivors = None
    _close_port()
    return _adopt(new)


def join(port: str, ranks: Sequence[int], gen: int = 0, root: int = 0) -> int:
    """Every newcomer (its own ``mpiexec -n k`` world): connect to the survivors on ``port``,
    take rank number ``ranks[i]`` (i: its rank in its launch world), start the runtime; returns
    the rank number. ``gen``: the cluster's count of replacements, this one included (a notice of
    it is not news to the newcomer, ``engines._elastic``); ``root``: the survivor whose state
    ``elastic.run``'s next sync takes."""
    from mpi4py import MPI

    from ..runtime.internal import elastic_world

    _state.gen = gen
    elastic_world.set_sync_root(root)
    inter = MPI.COMM_WORLD.Connect(port, MPI.INFO_NULL, 0)
    new = _merge(inter, high=True, key=ranks[MPI.COMM_WORLD.Get_rank()])
    return _adopt(new)


def joined_gen() -> int:
    """The replacement this rank joined in (``join``'s ``gen``), 0 for a rank of the first start."""
    return _state.gen


def _merge(inter: "MPI.Intercomm", high: bool, key: int) -> "MPI.Intracomm":
    from mpi4py import MPI

    merged = inter.Merge(high)
    inter.Free()
    # the survivors keep their numbers, each newcomer takes the number of the rank it replaces
    new = merged.Split(0, key)
    merged.Free()
    assert isinstance(new, MPI.Intracomm)  # Split of an intracommunicator
    return new


def _adopt(new: "MPI.Intracomm") -> int:
    """``new`` becomes this rank's world; the runtime starts on it (collective over it)."""
    from mpi4py import MPI

    from .. import runtime as ring

    old, _state.comm = _state.comm, new
    if old is not None:
        try:
            old.Free()  # local in MPICH: does not wait for the rank that died
        except MPI.Exception:
            pass
    ring.init(comm=new, process_sets=None, **_state.config)  # (the sets are the user's to add again)
    return new.Get_rank()


def _close_port() -> None:
    if _state.port is not None:
        from mpi4py import MPI

        port, _state.port = _state.port, None
        try:
            MPI.Close_port(port)
        except MPI.Exception:
            pass


def missing(names: Sequence[str]) -> list[str]:
    """Which of ``names`` this rank's namespace lacks (``%ring sync`` copies them to it)."""
    from IPython import get_ipython

    shell = get_ipython()
    namespace = shell.user_ns if shell is not None else {}
    return [name for name in names if name not in namespace]
