"""Which torch.distributed group the device transport uses per device type: the user's default
group when it has a backend for the device (never a second NCCL communicator), else one of ours,
made on first use over a rendezvous store of our own."""

from __future__ import annotations

import datetime
import socket
from typing import Any, cast

from ... import runtime as _ring
from . import process_groups
from .process_groups import ManagedGroup

__all__ = ["DeviceGroups"]


class DeviceGroups:
    """This process's managed group per device type, and the store our own groups meet at."""

    def __init__(self) -> None:
        self._private: dict[str, ManagedGroup] = {}  # device type -> our own group (when the user has none)
        self._store: Any = None   # the rendezvous store of our own groups (a torch.distributed TCPStore)
        self._listener: socket.socket | None = None

    def group(self, device_type: str) -> ManagedGroup:
        """The managed group for ``device_type``: the user's default group when it has a backend
        for it (never a second NCCL communicator), else one of our own, made on first use
        (collective: every rank calls this at the same point, which the agreement guarantees)."""
        group = self.lookup(device_type)
        if group is None:
            group = self._private[device_type] = self._new_private(device_type)
        return group

    def lookup(self, device_type: str) -> ManagedGroup | None:
        """The group for ``device_type`` if there is one already (never collective)."""
        shared = self._shared(device_type)
        return shared if shared is not None else self._private.get(device_type)

    def _shared(self, device_type: str) -> ManagedGroup | None:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        pg: Any = dist.group.WORLD  # (set once initialised; _get_backend below is torch's private API)
        if pg.size() != _ring.size() or pg.rank() != _ring.rank():
            return None  # a torch world that is not the ring's world: keep ours apart
        managed = process_groups.registry.find(pg)
        if managed is not None:
            return managed if device_type in managed.backends else None
        try:
            backend = pg._get_backend(torch.device(device_type))
        except RuntimeError:
            return None
        if process_groups._kind(backend) != "nccl":
            # a gloo group made outside jupyter_ring's guard: its sockets are unknown, so it
            # could not be aborted; use a group of our own
            return None
        adopted: ManagedGroup = process_groups.registry.record(
            process_groups.ManagedGroup.adopt(pg, dist.distributed_c10d._get_default_store(), set()))
        return adopted

    def _new_private(self, device_type: str) -> ManagedGroup:
        import torch.distributed as dist

        kind = "nccl" if device_type == "cuda" else "gloo"
        store = self._rendezvous_store()
        timeout = datetime.timedelta(seconds=_ring.config().stall_timeout + 30)
        prefix = dist.PrefixStore(f"jupyter_ring/device/{kind}/", store)
        backend, sockets = process_groups.new_backend(kind, prefix, _ring.rank(), _ring.size(), timeout)
        return process_groups.ManagedGroup(f"jupyter_ring's {kind} device group", f"jupyter_ring.device.{kind}", None,
                               {device_type: backend},
                               {device_type: kind}, prefix, _ring.rank(), _ring.size(), timeout,
                               sockets, {kind.upper()})

    def _rendezvous_store(self) -> Any:
        """A TCPStore on rank 0, listening on loopback when every rank is on its host."""
        import torch.distributed as dist

        if self._store is not None:
            return self._store
        hosts = _ring.allgather_object(socket.gethostname(), name="jupyter_ring.device.hosts")
        address: Any = None
        port: Any = None
        if _ring.rank() == 0:
            address = process_groups.rendezvous_address(hosts, 0)
            self._listener = socket.create_server((address, 0), backlog=1024)
            port = self._listener.getsockname()[1]
        address, port = _ring.broadcast_object((address, port), 0, name="jupyter_ring.device.store")
        timeout = datetime.timedelta(seconds=_ring.config().stall_timeout + 30)
        if _ring.rank() == 0:
            self._store = dist.TCPStore(address, port, None, True, timeout=timeout, wait_for_workers=False,
                                        master_listen_fd=cast(socket.socket, self._listener).fileno())
        else:
            self._store = dist.TCPStore(address, port, None, False, timeout=timeout)
        return self._store
