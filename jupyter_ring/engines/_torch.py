"""torch.distributed on the ranks: a torchrun world, and the failure contract inside its collectives.

Engine side, in two steps of ``%ring start``'s rank setup (``cluster._ring``): :func:`reserve`
in the setup code after ``ring.init()``, then :func:`start` with this rank's torchrun environment,
which the notebook computes from the launch plan and the ranks' hosts
(``cluster._plan.torchrun_environment``). Nothing here imports torch before user code does (an
import hook waits for torch.distributed), so a cluster that never uses torch pays nothing but one
socket on rank 0.

**The world.** Every rank gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` ...) with the ring's rank
numbers, so ``dist.init_process_group()`` with no arguments works in a cell. Rank 0 reserves the
rendezvous port in :func:`reserve` (a listening socket on loopback, or on the address the other
hosts reach) and serves torch's TCPStore on it as soon as torch.distributed is imported,
multi-tenant, so that the store ``init_process_group`` makes on rank 0 is this one: no port race,
nothing listening on 0.0.0.0, and re-running ``init_process_group`` after
``destroy_process_group`` works.

**The failure contract.** A rank blocked inside a torch.distributed collective is blocked in C++
(gloo's ``all_reduce`` ignores SIGINT; DDP waits inside ``backward()``). Every group user code
creates is recorded with its sockets (``runtime._device.process_groups``). A monitor thread, woken by
SIGINT through ``signal.set_wakeup_fd``, checks 0.3 s later whether the main thread is still where
it was (stuck in C) and then aborts the groups: their connections are shut down, the blocked call
fails at once on this rank and on its peers, and the pending SIGINT raises KeyboardInterrupt. The
same goes for ring collectives that other threads wait on while the main thread is in C++ (the
ops of a TF1 ``session.run``, the gradient hooks autograd runs on its CUDA device thread while
``backward()`` blocks): the monitor gives them up (``abandon_queued``), the blocked call fails,
and the next collective resyncs the ranks.
The same thread publishes each group's collective count in its store once a second; a rank stuck
for the stall timeout while a peer has issued fewer collectives gets ``StallError`` naming it.
After a failed cell the notebook calls :func:`repair` on every rank: groups any rank aborted are
re-created in place (the same ``ProcessGroup`` objects, so DDP models keep working).
"""

import ctypes
import faulthandler
import importlib.abc
import importlib.util
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult
    from torch.distributed import TCPStore

    from ..runtime import Config, ProcessSet
    from ..runtime.internal import process_groups

__all__ = ["reserve", "start", "repair", "TorchGuard", "ABORT_NOTE"]

log = logging.getLogger(__name__)

_WATCHED = "torch.distributed.distributed_c10d"
_DDP = "torch.nn.parallel.distributed"  # imported by ``import torch``, after _WATCHED
# how the guard's note on stderr starts: the notebook re-creates the groups after a cell whose
# output has it (and only then: a failed cell that touched no torch group costs nothing more)
ABORT_NOTE = "[jupyter_ring] torch.distributed:"
_STUCK_AFTER = 0.3      # seconds after SIGINT a main thread that has not moved counts as stuck
_TICK = 0.5             # the monitor's period (sequence numbers, stall check)

_T = TypeVar("_T")

# The main thread's place at a tick: (id of its frame, its last instruction, the function's name).
Position = tuple[int, int, str]


class RingRuntime(Protocol):
    """What the guard uses of the ring runtime (``jupyter_ring.runtime``, the module)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def config(self) -> "Config": ...

    def allgather_object(self, obj: _T, name: str | None = None,
                         process_set: "ProcessSet | None" = None) -> list[_T]: ...


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` once ``name`` has been imported (its loader wrapped)."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback
        self._busy = False

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenCall(spec.loader, self)
        return spec


class _ThenCall(importlib.abc.Loader):
    """A module's own loader, then the finder's callback with the module it loaded."""

    def __init__(self, loader: importlib.abc.Loader, finder: _AfterImport) -> None:
        self.loader = loader
        self.finder = finder

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        try:
            self.finder.callback(module)
        except Exception:  # never break the user's import of torch
            log.exception("jupyter_ring: setting up torch.distributed on this rank failed")


class TorchGuard:
    """This rank's torch.distributed set-up: the rendezvous store (rank 0) and the monitor."""

    def __init__(self, ring: RingRuntime, address: str, listener: socket.socket | None) -> None:
        self.ring = ring
        self.rank = ring.rank()
        self.size = ring.size()
        self.address = address
        self.listener = listener      # rank 0: the reserved rendezvous socket
        self.server: TCPStore | None = None  # rank 0: the TCPStore served on it
        self.main = threading.main_thread().ident or 0  # (set: the main thread has started)
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._chained = -1
        self._thread: threading.Thread | None = None
        # (monotonic time, main thread position) of the last SIGINT
        self._sigint_at: tuple[float, Position | None] | None = None
        self._position: Position | None = None  # the main thread's place at the last tick
        self._still_since = time.monotonic()
        self._published: dict[str, int] = {}  # group key -> sequence number published last
        self._last_publish = 0.0
        self.executing = False        # a cell runs (IPython's pre/post_run_cell): the main thread
        # is then the user's; between cells it idles in the kernel's event loop, never "stuck"
        self.notes: list[str] = []    # what the monitor did, for repair() to report

    # ------------------------------------------------------------------ set-up
    def install(self) -> None:
        """Main thread: the SIGINT wakeup, the monitor thread, the torch.distributed hook."""
        wake_r, wake_w = self._wake_r, self._wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        # Python's C signal handler writes the signal number here even while the main thread is
        # blocked in C++; a wakeup fd already there (an event loop's) keeps getting it from us
        self._chained = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        from IPython import get_ipython

        events = get_ipython().events
        events.register("pre_run_cell", self._cell_starts)
        events.register("post_run_cell", self._cell_ends)
        self._thread = threading.Thread(target=self._monitor, name="jupyter_ring-torch-guard", daemon=True)
        self._thread.start()
        for name, callback in ((_WATCHED, self.on_torch_distributed), (_DDP, self.on_ddp)):
            if name in sys.modules:
                callback(sys.modules[name])
            else:
                sys.meta_path.insert(0, _AfterImport(name, callback))

    def on_torch_distributed(self, module: ModuleType) -> None:
        """torch.distributed was imported: record its groups, count its collectives for the
        dashboard; rank 0 serves the rendezvous store."""
        from ..runtime.internal import process_groups
        from ..runtime.internal import torch_comm as _torch_comm

        process_groups.install_recording()
        # torch.distributed may be half-imported (it imports this module first): its own
        # ``from .distributed_c10d import *`` then copies the counted functions
        _torch_comm.install_counting(module, sys.modules.get("torch.distributed"))
        if self.listener is not None and self.server is None:
            import datetime

            from torch.distributed import TCPStore

            self.server = TCPStore(self.address, self.listener.getsockname()[1], None, True,
                                   timeout=datetime.timedelta(minutes=30), wait_for_workers=False,
                                   multi_tenant=True, master_listen_fd=self.listener.fileno())

    def on_ddp(self, module: ModuleType) -> None:
        """DDP was imported: its models count their gradient allreduces (``runtime._device.torch_comm``)."""
        from ..runtime.internal import torch_comm as _torch_comm

        _torch_comm.count_ddp(module.DistributedDataParallel)

    def _cell_starts(self, _info: "ExecutionInfo") -> None:
        self._position = None     # the stall clock starts with the cell
        self._sigint_at = None    # an interrupt that came between cells is not this cell's
        self.executing = True

    def _cell_ends(self, _result: "ExecutionResult") -> None:
        self.executing = False
        self._sigint_at = None

    # ------------------------------------------------------------------ the monitor
    def _monitor(self) -> None:
        while True:
            try:
                # a tenth of a tick while torch groups exist; else only SIGINT needs waking for
                period = _TICK / 5 if _WATCHED in sys.modules else _TICK * 2
                if self._sigint_at is not None:  # look again when the main thread counts as stuck
                    period = min(period, max(0.01, self._sigint_at[0] + _STUCK_AFTER - time.monotonic()))
                wake_r = self._wake_r
                assert wake_r is not None  # install() made it before starting this thread
                readable, _, _ = select.select([wake_r], [], [], period)
                if readable:
                    self._on_signals(wake_r.recv(256))
                self._tick()
            except Exception:  # the monitor must outlive any one bad tick
                log.exception("jupyter_ring: the torch.distributed monitor failed a tick")
                time.sleep(_TICK)

    def _on_signals(self, data: bytes) -> None:
        if self._chained >= 0:
            try:
                os.write(self._chained, data)
            except OSError:
                pass
        if signal.SIGINT in data:
            self._sigint_at = (time.monotonic(), self._main_position())

    def _main_position(self) -> Position | None:
        frame = sys._current_frames().get(self.main)
        return None if frame is None else (id(frame), frame.f_lasti, frame.f_code.co_name)

    def _tick(self) -> None:
        from ..runtime.internal import api as _api  # on the rank only (the notebook imports this module too)
        from ..runtime.internal import progress as _progress

        groups = self._groups()
        if not self.executing or not (groups or self._sigint_at is not None):
            return
        now = time.monotonic()
        position = self._main_position()
        if position != self._position:
            self._position, self._still_since = position, now
        if self._sigint_at is not None and now - self._sigint_at[0] >= _STUCK_AFTER:
            at, where = self._sigint_at
            self._sigint_at = None
            if position is not None and position == where:
                if groups:
                    self._abort(groups, f"interrupted while rank {self.rank} was blocked in torch "
                                        f"({position[2]})", None)
                # ring collectives waited on in other threads while the main thread is in C++:
                # a TF1 session.run's ops (runtime.tensorflow), the gradient hooks autograd runs
                # on its CUDA device thread while backward() blocks (runtime.torch). The waits
                # raise on their threads, the blocked call returns with their error, the pending
                # SIGINT raises KeyboardInterrupt; the next collective resyncs
                if _progress.feeding.count or _api.busy():
                    # on a thread of its own: abandon waits for the collective to stop, and this
                    # thread must go on ticking (stall checks, the next interrupt) whatever happens
                    why = f"interrupted while rank {self.rank} was blocked in {position[2]}"
                    threading.Thread(target=_api.abandon_queued, args=(why,), name="jupyter_ring-guard-abandon",
                                     daemon=True).start()
        if groups and now - self._last_publish >= _TICK * 2:
            self._last_publish = now
            self._publish(groups)
            self._check_stall(groups, now)

    @staticmethod
    def _groups() -> "list[process_groups.ManagedGroup]":
        if _WATCHED not in sys.modules:
            return []
        from ..runtime.internal import process_groups

        return [g for g in process_groups.registry.groups() if g.pg is not None and not g.aborted]

    @staticmethod
    def _sequence(group: "process_groups.ManagedGroup") -> int | None:
        backend = next(iter(group.backends.values()))
        try:
            return int(backend._get_sequence_number_for_group())  # type: ignore[attr-defined]  # torch's private call, not in its stubs
        except RuntimeError:
            return None

    def _publish(self, groups: "list[process_groups.ManagedGroup]") -> None:
        for group in groups:
            seq = self._sequence(group)
            if seq is not None and self._published.get(group.key) != seq:
                group.store.set(f"jupyter_ring/seq/{group.rank}", str(seq))
                self._published[group.key] = seq

    def _check_stall(self, groups: "list[process_groups.ManagedGroup]", now: float) -> None:
        stall = self.ring.config().stall_timeout
        still = now - self._still_since
        if still < stall:
            return
        from ..runtime.internal import hold

        if hold.anyone():  # a rank held in a debugger is a pause, not a stall: the clock restarts
            self._still_since = now
            return
        for group in groups:
            mine = self._sequence(group)
            if mine is None:  # a backend that keeps no count (torch's "fake"): nothing to compare
                continue
            behind: list[int] = []
            for q in range(group.size):
                key = f"jupyter_ring/seq/{q}"
                if q != group.rank and group.store.check([key]) and int(group.store.get(key)) < mine:
                    behind.append(q)
            if behind:
                message = (f"rank {self.rank} waited {still:.1f} s in {group.label} collective #{mine} for "
                           f"rank(s) {behind} (group ranks), which never arrived (stall timeout {stall:g} s). "
                           "Every rank must call the same collectives in the same order; a rank that raised, "
                           "skipped a call or died leaves the others waiting. Raise JUPYTER_RING_STALL_TIMEOUT "
                           "if a rank is just slow.")
                self._abort(groups, f"stalled on rank {self.rank}", _stall_error(message, behind))
                return

    def _abort(self, groups: "list[process_groups.ManagedGroup]", why: str,
               error: type[BaseException] | None) -> None:
        """Abort the groups; with ``error``, raise it in the main thread too."""
        if error is not None and self.executing:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.main), ctypes.py_object(error))
        for group in groups:
            group.abort(why)
        note = (f"{ABORT_NOTE} {why}; closed the connections of "
                f"{', '.join(g.label for g in groups)} so that the cell can end. "
                "They are re-created on every rank when the cell has failed.")
        self.notes.append(note)
        print(note, file=sys.stderr, flush=True)


def _stall_error(message: str, missing: list[int]) -> type[BaseException]:
    """A StallError class raising ``message``: PyThreadState_SetAsyncExc takes a class."""
    from ..runtime import StallError

    class _Stalled(StallError):
        def __init__(self, *_args: object) -> None:
            super().__init__(message, missing)

    _Stalled.__name__ = _Stalled.__qualname__ = "StallError"
    _Stalled.__module__ = StallError.__module__
    return _Stalled


class _Holder:
    """The engine's guard, and rank 0's reserved rendezvous socket (one per rank process)."""

    def __init__(self) -> None:
        self.guard: TorchGuard | None = None
        self.listener: socket.socket | None = None


_holder = _Holder()


def reserve(ring: RingRuntime, master_addr: str) -> tuple[str, int] | None:
    """Every rank, in the setup code after ``ring.init()`` (collective when ``master_addr`` is "").

    Rank 0 reserves the rendezvous port: a listening socket on ``master_addr`` (the plan's:
    127.0.0.1 on one host), or with "" on its own address on the route to the other ranks' hosts.
    Returns ``(address, port)`` on rank 0, None on the others.
    """
    from ..runtime.internal import process_groups

    hosts: list[str] | None = None
    if not master_addr:
        hosts = ring.allgather_object(socket.gethostname(), name="jupyter_ring.torch.hosts")
    if ring.rank() != 0:
        return None
    address = master_addr or process_groups.rendezvous_address(hosts or [], 0)  # hosts: gathered above
    listener = _holder.listener = socket.create_server((address, 0), backlog=1024)
    port: int = listener.getsockname()[1]
    return address, port


def start(environment: dict[str, str], init_backend: str | None = None,
          dump_after: float | None = None) -> str | None:
    """Every rank, once, after :func:`reserve`: this rank's torchrun ``environment`` (computed by
    the notebook from the plan), the guard; with ``init_backend`` ("auto", "gloo" or "nccl") the
    default process group too (collective). Returns its backend, or None. ``dump_after``: seconds
    after which a rank still here writes every thread's stack to its stderr (the notebook, about
    to give up, quotes them)."""
    from .. import runtime as ring

    os.environ.update(environment)
    # A rank is a process of a torchrun world, not an interactive session: IPython's sys.ps1
    # ("so that scripts can decide if they are running interactively") makes Lightning refuse
    # strategy="ddp" (or want to spawn processes of its own) on the ranks.
    for prompt in ("ps1", "ps2"):
        if hasattr(sys, prompt):
            delattr(sys, prompt)
    guard = _holder.guard = TorchGuard(ring, environment["MASTER_ADDR"], _holder.listener)
    guard.install()
    if not init_backend:
        return None
    if dump_after is not None:
        faulthandler.dump_traceback_later(dump_after, file=sys.__stderr__ or sys.stderr)
    try:
        return _init_default_group(ring, init_backend)
    finally:
        if dump_after is not None:
            faulthandler.cancel_dump_traceback_later()


def _init_default_group(ring: RingRuntime, backend: str) -> str:
    import torch
    import torch.distributed as dist

    every = ring.allgather_object(torch.cuda.is_available(), name="jupyter_ring.torch.gpus")
    if backend == "auto":
        backend = "cpu:gloo,cuda:nccl" if all(every) and dist.is_nccl_available() else "gloo"
    kwargs: dict[str, Any] = {"device_id": torch.device("cuda", 0)} if "nccl" in backend else {}
    dist.init_process_group(backend, **kwargs)
    return backend


def repair() -> str | None:
    """After a failed cell, on every rank (collective over the ring): re-create in place every
    torch.distributed group some rank aborted. Returns a note for the notebook, or None."""
    guard = _holder.guard
    if guard is None:
        return None
    from ..runtime.internal import process_groups

    if _WATCHED not in sys.modules:
        # no torch here: still take part, other ranks may hold groups
        guard.ring.allgather_object({}, name="jupyter_ring.process_groups.state")
        return None
    rebuilt = process_groups.rebuild_all()
    guard.notes.clear()
    if not rebuilt:
        return None
    parts = [f"{label} (aborted on rank(s) {', '.join(map(str, on))})" for label, on in rebuilt]
    return (f"torch.distributed: re-created {'; '.join(parts)} on every rank; the same group objects "
            "(DDP models, device meshes) keep working.")
