"""The world grown or shrunk between cells, on the engines (``%ring scale N``, issue 34 item 3).

The kernel's side is ``cluster._scale``. Growing is a replacement whose newcomers take new rank
numbers: every rank of the old world leaves it with no rank excluded and the newcomers join keyed
by their numbers (``engines._respawn``). Shrinking has no newcomer and no port: :func:`shrink` on
every rank of the old world stops the runtime; ranks ``0..size-1`` make their new world with
``Create_group`` (collective over them alone), the others are then shut down by the kernel.
After either, :func:`retorch` on every rank of the new world gives it torchrun's environment for
the new size and drops torch.distributed's groups of the old world.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from . import _respawn

__all__ = ["shrink", "retorch"]


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


def retorch(environment: dict[str, str], backend: str | None) -> str | None:
    """Every rank of the new world (collective over it when ``backend`` is given): torchrun's
    ``environment`` for the new size; where torch.distributed was imported, its groups of the old
    world are aborted and destroyed, the device transport's own groups dropped, and with
    ``backend`` (``%ring start --torch-distributed``) the default group is made again over the new
    world. Returns a note naming the user's groups that were dropped, or None."""
    os.environ.update(environment)
    dropped: list[str] = []
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        from ..runtime.internal import process_groups

        made = dist.is_available() and dist.is_initialized()
        default = process_groups.registry.find(dist.group.WORLD) if made else None
        dropped = process_groups.abort_all("the world was resized (%ring scale)")
        if backend and default is not None:  # ours (--torch-distributed): made again below
            dropped.remove(default.label)
        _drop_device_groups()
        if made:
            dist.destroy_process_group()
    if backend:
        from .. import runtime as ring
        from . import _torch

        _torch._init_default_group(ring, backend)
    if not dropped:
        return None
    return (f"torch.distributed: {', '.join(dropped)} belonged to the world before the resize and "
            "was destroyed; call dist.init_process_group() (and new_group) again in a cell")


def _drop_device_groups() -> None:
    """The device transport's own groups (made over the old world) aborted; the next device
    collective makes a transport, and its groups, for the new world."""
    module = sys.modules.get("jupyter_ring.runtime._device.transport")
    holder = getattr(module, "_holder", None)
    transport = getattr(holder, "transport", None)
    if holder is None or transport is None:
        return
    for group in list(transport._groups._private.values()):
        group.abort("the world was resized (%ring scale)")
    holder.transport = None
