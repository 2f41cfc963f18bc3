"""torch.distributed process groups that can be aborted and re-created in place.

The failure contract (a collective that cannot complete raises on every rank, waits are
interruptible, the next collective is right) needs two things torch 2.13 does not offer for gloo:

* **Abort.** ``ProcessGroupGloo.abort()`` and ``shutdown()`` leave a collective in flight blocked
  in its ``recv`` (measured: the wait ends only when the peer joins or its process exits), and the
  gloo timeout is 30 minutes. A blocked gloo wait ends at once when its connection fails, so a
  group managed here knows the TCP sockets of its gloo pairs (those that appeared while its
  backend was built, less the store's) and *aborting* shuts them down: the pending operation on
  this rank and on every peer fails with "Connection closed by peer". Listening sockets are left
  alone (gloo's accept loop terminates the process on a shut-down listener). NCCL backends are
  aborted with ``Backend.abort()`` (ncclCommAbort).
* **Re-creation that keeps the object.** A DDP model, a DeviceMesh or a user's variable holds the
  ``ProcessGroup`` object. Re-creating builds a new backend on a fresh prefix of the group's store
  and registers it for the device under a ``BackendType`` the group has not used yet
  (``ProcessGroup::setBackend`` keeps the first backend registered per type, so each re-creation
  needs a new type: a group can be re-created in place five times). After that a new
  ``ProcessGroup`` object takes the old one's place in torch.distributed's tables (the default
  group, its name, so device meshes follow). DDP modules over the group get their reducer reset
  and pointed at it (``DistributedDataParallel._update_process_group``), as torch does when a
  group changes.

Used by the device transport (:mod:`._device`) for its own groups and for the user's default
group it shares, and by the notebook engines' guard (``jupyter_ring.engines._torch``) for every
group user code creates.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import logging
import os
import socket
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:  # torch is imported where it is used: the runtime runs without it
    from torch._C._distributed_c10d import Backend  # (torch.distributed.Backend is the backend-name class)
    from torch.distributed import ProcessGroup, Store
    from torch.distributed.distributed_c10d import GroupName

_R = TypeVar("_R")  # what capture_sockets' build returns

__all__ = ["ManagedGroup", "Registry", "registry", "socket_inodes", "capture_sockets",
           "shutdown_sockets", "store_ports", "new_backend", "rendezvous_address", "install_recording",
           "abort_all", "rebuild_all"]

log = logging.getLogger(__name__)

# BackendTypes a re-created backend may be registered under, in order (never NCCL for a CPU
# device or the reverse: ProcessGroup::barrier picks its tensor's device from the default type).
_SPARE_TYPES = ("CUSTOM", "UCC", "MPI", "XCCL", "UNDEFINED")


# ------------------------------------------------------------------ sockets
def socket_inodes() -> dict[int, int]:
    """``{inode: fd}`` of this process's open sockets (Linux: /proc/self/fd)."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # pragma: no cover - not Linux
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(fd)
    return out


def capture_sockets(build: Callable[..., _R], *args: Any, **kwargs: Any) -> tuple[_R, set[int]]:
    """``(build(*args, **kwargs), inodes of the sockets that appeared meanwhile)``."""
    before = set(socket_inodes())
    result = build(*args, **kwargs)
    return result, set(socket_inodes()) - before


def _ports(sock: socket.socket) -> tuple[int | None, int | None]:
    """(local port, peer port) of a socket, peer None when it has none (a listener)."""
    local = sock.getsockname()
    try:
        peer = sock.getpeername()
    except OSError:
        return (local[1] if isinstance(local, tuple) else None), None
    return (local[1] if isinstance(local, tuple) else None), (peer[1] if isinstance(peer, tuple) else None)


def shutdown_sockets(inodes: Collection[int], exclude_ports: Collection[int] = ()) -> int:
    """Shut down (both ways) the connected sockets among ``inodes``; returns how many.

    The store's connections (``exclude_ports``) and listeners are left alone. Shutting down a dup
    of the fd ends the connection for every fd sharing it: the blocked reader gets EOF or EPIPE.
    """
    done = 0
    for inode, fd in socket_inodes().items():
        if inode not in inodes:
            continue
        try:
            dup = os.dup(fd)
        except OSError:  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # the number now names something else (gloo closed it, it was reused)
            os.close(dup)
            continue
        try:
            local, peer = _ports(sock)
            if peer is None or local in exclude_ports or peer in exclude_ports:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:  # already closed by gloo after an error
            pass
        finally:
            sock.close()
    return done


def store_ports(store: Store | None) -> frozenset[int]:
    """Ports of the TCPStore(s) under ``store`` (PrefixStores unwrapped): never shut down."""
    ports: set[int] = set()
    seen = 0
    while store is not None and seen < 16:
        port = getattr(store, "port", None)
        if isinstance(port, int):
            ports.add(port)
        store = getattr(store, "underlying_store", None)
        seen += 1
    return frozenset(ports)


def rendezvous_address(hosts: Sequence[str], rank: int = 0) -> str:
    """The address rank ``rank`` (on ``hosts[rank]``) offers the other ranks for a rendezvous.

    127.0.0.1 when every rank is on that host (nothing listens beyond loopback); else the
    address of this host on the route to the first other host (a UDP "connect" sends nothing).
    """
    me = hosts[rank]
    others = [h for h in hosts if h != me]
    if not others:
        return "127.0.0.1"
    for host in others:
        try:
            remote = socket.gethostbyname(host)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((remote, 9))
                local = str(probe.getsockname()[0])
        except OSError:
            continue
        if not local.startswith("127."):
            return local
    return socket.gethostbyname(socket.gethostname())


# ------------------------------------------------------------------ backends
def new_backend(kind: str, store: Store, rank: int, size: int,
                timeout: datetime.timedelta) -> tuple[Backend, set[int]]:
    """A new ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` on ``store``, and its socket inodes."""
    import torch.distributed as dist

    if kind == "gloo":
        from torch.distributed import ProcessGroupGloo

        backend, sockets = capture_sockets(ProcessGroupGloo, store, rank, size, timeout)
        backend._set_sequence_number_for_group()  # as torch does: the guard's stall report reads it
        return backend, sockets
    if kind == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, size, options), set()
    raise ValueError(f"jupyter_ring manages gloo and nccl process groups, not {kind!r}"
                     f" (torch.distributed {dist.__name__})")


def _kind(backend: object) -> str | None:
    name = type(backend).__name__
    if name == "ProcessGroupGloo":
        return "gloo"
    if name == "ProcessGroupNCCL":
        return "nccl"
    return None


@dataclasses.dataclass(eq=False)
class ManagedGroup:
    """A process group (a user's ``ProcessGroup``, or backends of our own) that can be aborted and
    re-created on every rank.

    ``pg`` is the user-visible ``ProcessGroup`` (None for a transport's private group);
    ``backends`` maps a device type ("cpu", "cuda") to the backend in use for it.
    """

    label: str
    key: str                     # the same on every rank: torch's group name, or ours
    pg: ProcessGroup | None
    backends: dict[str, Backend]
    kinds: dict[str, str]        # device type -> "gloo" or "nccl"
    store: Store
    rank: int
    size: int
    timeout: datetime.timedelta
    sockets: set[int] = dataclasses.field(default_factory=set)
    used_types: set[str] = dataclasses.field(default_factory=set)
    generation: int = 0
    aborted: str = ""            # why it was aborted; "" while its connections are intact
    desc: str = ""               # torch's group description, given to re-created backends

    @classmethod
    def adopt(cls, pg: ProcessGroup, store: Store, sockets: Iterable[int]) -> ManagedGroup:
        """Manage ``pg`` (made by torch.distributed) whose backends opened ``sockets``."""
        import torch

        backends: dict[str, Backend] = {}
        kinds: dict[str, str] = {}
        used: set[str] = set()
        for device in pg._device_types:
            backend = pg._get_backend(torch.device(device.type))
            kind = _kind(backend)
            if kind is None:
                continue  # a backend we cannot rebuild (MPI, UCC, custom): left as it is
            backends[device.type], kinds[device.type] = backend, kind
            used.add(kind.upper())
        timeout = getattr(getattr(next(iter(backends.values()), None), "options", None), "_timeout", None)
        if not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(minutes=30)
        key = str(getattr(pg, "group_name", "?"))
        label = f"torch.distributed process group '{key}' ({'/'.join(sorted(set(kinds.values())))})"
        return cls(label, key, pg, backends, kinds, store, pg.rank(), pg.size(), timeout, set(sockets), used,
                   desc=str(getattr(pg, "group_desc", "")))

    @property
    def store_ports(self) -> frozenset[int]:
        return store_ports(self.store)

    def backend(self, device_type: str) -> Any:
        """The backend that runs collectives on tensors of ``device_type`` ("cpu", "cuda")."""
        # (Any: torch's Backend stub declares none of the collectives its gloo and NCCL backends have)
        return self.backends[device_type]

    def abort(self, reason: str) -> int:
        """Make every collective in flight on this group fail now, here and on the peers."""
        if not self.aborted:
            self.aborted = reason
        shut = shutdown_sockets(self.sockets, self.store_ports)
        for device, backend in self.backends.items():
            if self.kinds[device] == "nccl":
                try:
                    backend.abort()
                except RuntimeError as exc:  # pragma: no cover - GPU only
                    log.warning("jupyter_ring: aborting the NCCL communicator failed: %s", exc)
        log.info("jupyter_ring: aborted %s (%s): %d connections closed", self.label, reason, shut)
        return shut

    def rebuild(self) -> None:
        """New backends on a fresh store prefix; collective: every rank of the group calls it."""
        import torch
        import torch.distributed as dist

        # connections still open on this rank (a peer aborted, this rank did not) are closed too,
        # so that nothing of the old backends can pair with the new ones
        shutdown_sockets(self.sockets, self.store_ports)
        self.generation += 1
        backends: dict[str, Backend] = {}
        sockets: set[int] = set()
        built: dict[str, tuple[Backend, set[int]]] = {}
        for device, kind in self.kinds.items():
            if kind not in built:  # one gloo backend serves cpu and cuda alike
                prefix = dist.PrefixStore(f"jupyter_ring/rebuild{self.generation}/{kind}/", self.store)
                built[kind] = new_backend(kind, prefix, self.rank, self.size, self.timeout)
            backends[device], new_sockets = built[kind]
            sockets |= new_sockets
        if self.pg is not None:
            spares = [t for t in _SPARE_TYPES if t not in self.used_types]
            distinct = list({id(b): b for b in backends.values()}.values())
            if len(spares) >= len(distinct):
                # in place: every holder of the ProcessGroup object keeps working. One type per
                # backend object (a gloo backend serving cpu and cuda is registered for both)
                types = {id(b): spare for b, spare in zip(distinct, spares)}
                for device, backend in backends.items():
                    spare = types[id(backend)]
                    self.used_types.add(spare)
                    self.pg._register_backend(torch.device(device), getattr(dist.ProcessGroup.BackendType, spare),
                                              backend)
                self._name(self.pg)
                _reset_ddp_modules(self.pg, self.pg)
            else:
                self._new_object(self.pg, backends)
        self.backends, self.sockets, self.aborted = backends, sockets, ""

    def _name(self, pg: ProcessGroup) -> None:
        """The group's name and description (ProcessGroup reads them from its backends: new
        backends have none, and device meshes and functional collectives look groups up by name)."""
        pg._set_group_name(cast("GroupName", self.key))
        pg._set_group_desc(self.desc)

    def _new_object(self, old: ProcessGroup, backends: dict[str, Backend]) -> None:
        """No backend type left to re-create in place: a new ProcessGroup object takes the old one's
        place in torch.distributed's tables (default group, name, tag) and DDP modules move to
        it; device meshes resolve the group by name, so they follow. Only code holding the old
        object itself (a variable) keeps the old, closed one."""
        import torch
        import torch.distributed as dist
        from torch._C import _distributed_c10d as C
        from torch.distributed import distributed_c10d as c10d

        new = dist.ProcessGroup(self.store, self.rank, self.size)
        for device, backend in backends.items():
            new._register_backend(torch.device(device), getattr(dist.ProcessGroup.BackendType,
                                                                self.kinds[device].upper()), backend)
        new._set_default_backend(getattr(dist.ProcessGroup.BackendType, next(iter(self.kinds.values())).upper()))
        name = cast("GroupName", self.key)
        self._name(new)
        world = c10d._world
        tables: list[dict[ProcessGroup, Any]] = [world.pg_map, world.pg_names, world.pg_group_ranks,
                                                 world.pg_backend_config, world.pg_to_tag]
        for table in tables:
            if old in table:
                table[new] = table.pop(old)
        for members in world.tags_to_pg.values():
            members[:] = [new if pg is old else pg for pg in members]
        world.pg_coalesce_state.pop(old, None)
        if world.default_pg is old:
            c10d._update_default_pg(new)
        C._unregister_process_group(name)
        C._register_process_group(name, new)
        _reset_ddp_modules(old, new)
        self.pg = new
        self.used_types = {kind.upper() for kind in self.kinds.values()}
        log.warning("jupyter_ring: %s is a new ProcessGroup object after %d re-creations in place",
                    self.label, self.generation - 1)

    @property
    def alive(self) -> bool:
        """False once torch.distributed destroyed the user's group (or it was collected)."""
        if self.pg is None:
            return True
        import torch.distributed as dist

        return self.pg in dist.distributed_c10d._world.pg_map


def _reset_ddp_modules(pg: ProcessGroup, new: ProcessGroup) -> None:
    """DDP modules over ``pg``: reset the reducer (a backward cut short leaves it mid-step) and
    point it to ``new`` (``pg`` itself when it was re-created in place).

    Found through the garbage collector's referrers of ``pg`` (a module's ``__dict__`` holds it
    as ``process_group``), not by scanning every object."""
    from torch.nn.parallel import DistributedDataParallel

    for ref in gc.get_referrers(pg):
        if not (isinstance(ref, dict) and ref.get("process_group") is pg):
            continue
        for owner in gc.get_referrers(ref):
            if isinstance(owner, DistributedDataParallel) and getattr(owner, "__dict__", None) is ref:
                owner._update_process_group(new)


class Registry:
    """The managed groups of this process, in creation order (the same order on every rank)."""

    def __init__(self) -> None:
        self._groups: list[ManagedGroup] = []
        self._lock = threading.Lock()

    def record(self, group: ManagedGroup) -> ManagedGroup:
        with self._lock:
            self._groups.append(group)
        return group

    def find(self, pg: object) -> ManagedGroup | None:
        """The managed group of ``pg``, or None."""
        with self._lock:
            return next((g for g in self._groups if g.pg is pg), None)

    def groups(self) -> list[ManagedGroup]:
        """Live managed groups: those torch.distributed has not destroyed.

        Filtered, never dropped: the engine's monitor thread asks while a re-creation on the main
        thread may be moving a group to a new ProcessGroup object (for a moment in neither
        table); dropping it then lost the group for good."""
        with self._lock:
            return [g for g in self._groups if g.alive]


registry = Registry()


# ------------------------------------------------------------------ groups made by user code
def install_recording() -> None:
    """Record every process group torch.distributed makes from now on (``init_process_group``,
    ``new_group``, a DeviceMesh's groups) with the sockets its backends opened, so that it can be
    aborted and re-created. Idempotent; needs torch.distributed imported."""
    from torch.distributed import distributed_c10d

    helper = distributed_c10d._new_process_group_helper
    if getattr(helper, "_jupyter_ring_records", False):
        return
    distributed_c10d._new_process_group_helper = _recording(helper)


def _recording(helper: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
    @functools.wraps(helper)
    def new_process_group(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        (pg, prefix_store), sockets = capture_sockets(helper, *args, **kwargs)
        from torch.distributed import GroupMember, ProcessGroup

        non_member: object = GroupMember.NON_GROUP_MEMBER  # (-100 in torch 2.x; an object() in older ones)
        if isinstance(pg, ProcessGroup) and pg is not non_member:
            registry.record(ManagedGroup.adopt(pg, prefix_store, sockets))
        return pg, prefix_store

    setattr(new_process_group, "_jupyter_ring_records", True)  # (the mark install_recording reads)
    return new_process_group


def abort_all(reason: str) -> list[str]:
    """Abort every managed group of the user's (connections shut down, NCCL aborted); returns
    the labels of those aborted."""
    aborted: list[str] = []
    for group in registry.groups():
        if group.pg is not None:
            group.abort(reason)
            aborted.append(group.label)
    return aborted


def rebuild_all() -> list[tuple[str, list[int]]]:
    """Re-create (in place) every managed user group that any rank aborted; collective over the
    ring: every rank calls it, also one without torch or groups. Returns ``[(label, ranks that
    had aborted it), ...]`` for the groups this rank re-created.

    Groups are matched across ranks by torch's group name; a rank re-creates, in creation order,
    each group it is a member of that some rank reported aborted (the members of a group all
    hold it, so each re-creation is entered by exactly its members, in the same order)."""
    from ... import runtime as ring

    groups = [g for g in registry.groups() if g.pg is not None]
    states = ring.allgather_object({g.key: bool(g.aborted) for g in groups},
                                   name="jupyter_ring.process_groups.state")
    rebuilt: list[tuple[str, list[int]]] = []
    for group in groups:
        on = [rank for rank, state in enumerate(states) if state.get(group.key)]
        if on:
            group.rebuild()
            rebuilt.append((group.label, on))
    return rebuilt
