"""The world grown or shrunk between cells, on the engines (``%ring scale N``, issue 34 item 3).

The kernel's side is ``cluster._scale``. Growing is a replacement whose newcomers take new rank
numbers: every rank of the old world leaves it with no rank excluded and the newcomers join keyed
by their numbers (``engines._respawn``). Shrinking has no newcomer and no port: :func:`shrink` on
every rank of the old world stops the runtime; ranks ``0..size-1`` make their new world with
``Create_group`` (collective over them alone), the others are then shut down by the kernel.
After either, on the new world: :func:`drop_torch` (every rank) drops torch.distributed's groups
of the old world, :func:`rendezvous` (rank 0) opens a new rendezvous store, :func:`retorch`
(every rank) gives torchrun's environment for the new size and makes the default group again
where ``--torch-distributed`` made it.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from . import _respawn

__all__ = ["shrink", "drop_torch", "rendezvous", "retorch"]


def shrink(size: int) -> bool:
    """Every rank of the old world: stop the runtime; ranks below ``size`` start it again on a
    world of ``size`` ranks (their numbers kept, their namespaces untouched). Returns whether this
    rank stays (False: the kernel shuts its engine down next)."""
    from mpi4py import MPI

    from .. import runtime as ring

    state = _respawn._state
    if ring.is_initialized():
        state.config = dataclasses.asdict(ring.config())
    ring.shutdown()
    old = _respawn.world()
    if old.Get_rank() >= size:
        return False
    old.Set_errhandler(MPI.ERRORS_RETURN)  # a peer gone meanwhile is an error to report, not an abort
    group = old.Get_group()
    kept = group.Incl(list(range(size)))
    group.Free()
    new = old.Create_group(kept)  # collective over the ranks kept: those leaving are not waited for
    kept.Free()
    _respawn._adopt(new)
    return True


def drop_torch(ours: bool, event: str = "the resize (%ring scale)") -> str | None:
    """Every rank of the new world, where torch.distributed was imported: its groups of the old
    world aborted (connections closed) and destroyed, the device transport's own groups dropped
    (the next device collective makes them over the new world). ``ours``: the default group was
    made by ``--torch-distributed`` (it is made again, no note). Returns a note naming the user's
    groups that were dropped, or None."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    from ..runtime.internal import process_groups

    made = dist.is_available() and dist.is_initialized()
    default = process_groups.registry.find(dist.group.WORLD) if made else None
    why = f"{event} ended the world it belonged to"
    dropped = process_groups.abort_all(why)
    if ours and default is not None:
        dropped.remove(default.label)
    _drop_device_groups(why)
    if made:
        dist.destroy_process_group()
    if not dropped:
        return None
    return (f"torch.distributed: {', '.join(dropped)} belonged to the world before {event} and "
            "was destroyed; call dist.init_process_group() (and new_group) again in a cell")


_retired_stores: list[object] = []  # rank 0's rendezvous stores of the worlds before a resize


def rendezvous(master_addr: str) -> tuple[str, int]:
    """Rank 0 of the new world: a new rendezvous port for torch.distributed (``engines._torch.reserve``
    on one host), its store served there at once where torch.distributed is imported. The old
    world's store keeps the keys its groups wrote, and ``init_process_group`` after
    ``destroy_process_group`` writes and reads the same keys: a new store, so none of those stale
    addresses is read by the new world."""
    from .. import runtime as ring
    from . import _torch

    old = _torch._holder.listener
    reserved = _torch.reserve(ring, master_addr)
    if reserved is None:  # (only rank 0 reserves: the kernel asks rank 0)
        raise RuntimeError("rendezvous() runs on rank 0 of the new world")
    address, port = reserved
    guard = _torch._holder.guard
    if guard is not None:
        guard.listener = _torch._holder.listener
        if guard.server is not None:  # torch.distributed imported: the store is served now
            # the old store is kept: a TCPStore server's destructor blocked the rank for good
            _retired_stores.append(guard.server)
            guard.server = None
            guard.on_torch_distributed(sys.modules[_torch._WATCHED])
        elif old is not None:
            old.close()
    return address, port


def retorch(environment: dict[str, str], backend: str | None) -> None:
    """Every rank of the new world (collective over it when ``backend`` is given): torchrun's
    ``environment`` for the new size (the new rendezvous port); with ``backend``
    (``%ring start --torch-distributed``) the default group made again over the new world."""
    os.environ.update(environment)
    if backend:
        from .. import runtime as ring
        from . import _torch

        _torch._init_default_group(ring, backend)


def _drop_device_groups(why: str) -> None:
    """The device transport's own groups (made over the old world) aborted; the next device
    collective makes a transport, and its groups, for the new world."""
    module = sys.modules.get("jupyter_ring.runtime._device.transport")
    holder = getattr(module, "_holder", None)
    transport = getattr(holder, "transport", None)
    if holder is None or transport is None:
        return
    for group in list(transport._groups._private.values()):
        group.abort(why)
    holder.transport = None
