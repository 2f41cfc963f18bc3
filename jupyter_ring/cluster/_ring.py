"""RingCluster: a :class:`LaunchPlan` started on ipyparallel, the ranks set up, then stopped.

The class holds the options (traits), starts and stops the cluster, and answers questions about
its ranks; planning, launching, process trees, signals and death diagnosis are the package's
other modules.
"""

from __future__ import annotations

import itertools
import logging
import socket
import uuid
from collections.abc import Container, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import psutil

from ..engines._interrupts import CellId
from ..engines._setup import RankRow
from ..errors import ClusterError, DeadRankError
from . import _liveness, _respawn, _start, _stop
from ._death import RESTART_FIX
from ._machine import Machine
from ._options import RingOptions
from ._plan import LaunchPlan, plan_launch
from ._procs import Watchdog, process_trees
from ._respawn import Replacement, elastic_survivors
from ._scale import Scaled, scale
from ._sidecar import RankProgress, SidecarRow, write_sidecar
from ._signals import interrupt_cells, signal_engines
from ._torch_repair import TorchRepair
from ._where import RankWhere, collect_where, where_dir

if TYPE_CHECKING:
    # ipyparallel ships no type information (no py.typed, no stubs): mypy reads its classes as
    # Any, and the names say which object is meant
    import ipyparallel as ipp

__all__ = ["RingCluster", "format_table"]

log = logging.getLogger(__name__)

class RingCluster(RingOptions):
    """ipyparallel MPI engines, one per rank, with GPUs bound and ``ring`` initialised.

    ::

        with RingCluster(n=2) as cluster:       # start() ... stop()
            cluster.view.execute("print(ring.rank())", block=True)

    ``plan()`` shows what ``start()`` would run, without starting anything. The options
    (``n``, ``hosts``, timeouts ...) are ``RingOptions``' traits.
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.ipp_cluster: ipp.Cluster | None = None
        self.client: ipp.Client | None = None
        self.view: ipp.DirectView | None = None
        self.ranks: list[RankRow] = []   # rows of the start table, index = rank
        self.engine_ids: list[int] = []  # ipyparallel engine id of each rank
        self.steps: dict[int, RankProgress] = {}  # rank -> the last progress the dashboard saw
        self.size = 0
        self.note = ""           # the plan's share note: more ranks than the share
        self.address = ""        # the address the controller listens on (multi-host: routable)
        self._watchdog: Watchdog | None = None
        self._shm: set[str] = set()  # /dev/shm files the local ranks mapped (MPI's segments)
        self._user_umask = 0o022  # the kernel's umask, read (and put back) by start()
        self.torch_backend: str | None = None  # the default process group --torch-distributed made
        self.torch_repair = TorchRepair(lambda: self._running_client)  # groups re-created after a failed cell
        self.plan_used: LaunchPlan | None = None  # the plan start() carried out
        self.rendezvous: tuple[str, int] | None = None  # torch.distributed's, reserved by rank 0
        self.restarts = 0        # ranks replaced in place so far (respawn); --max-restarts bounds it
        self.generation = 0      # changes of world so far (replacements, resizes): _respawn.next_generation
        self.replace_failed = False  # a replacement failed: dead ranks now need %ring restart
        self.replaced: dict[int, int] = {}  # rank -> how many times it was replaced in place
        # the notebook's cells: ids a rank's interrupt names (engines/_interrupts.py)
        self._cell_token = uuid.uuid4().hex[:16]
        self._cell_numbers = itertools.count(1)

    def __enter__(self) -> RingCluster:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ----------------------------------------------------------------------------- lifecycle
    @property
    def running(self) -> bool:
        return self.ipp_cluster is not None

    @property
    def _running_cluster(self) -> ipp.Cluster:
        """The ipyparallel Cluster; ClusterError when none runs (callers check ``running``)."""
        if self.ipp_cluster is None:
            raise ClusterError("no cluster is running; start one with %ring start")
        return self.ipp_cluster

    @property
    def _running_client(self) -> ipp.Client:
        """The cluster's Client; ClusterError when none runs (callers check ``running`` first)."""
        if self.client is None:
            raise ClusterError("no cluster is running; start one with %ring start")
        return self.client

    def plan(self, machine: Machine | None = None) -> LaunchPlan:
        """The :class:`LaunchPlan` ``start()`` would carry out on ``machine`` (default: here)."""
        return plan_launch(self, machine)

    def start(self) -> list[RankRow]:
        """Start controller and engines, bind devices, ``ring.init()``; return the rank rows."""
        return _start.start(self)

    @property
    def user_umask(self) -> int:
        """The kernel's umask when the cluster started: the ranks' own (files cells write)."""
        return self._user_umask

    @property
    def respawns(self) -> bool:
        """Whether this cluster replaces dead ranks in place (its ranks run under keepers and
        ``max_restarts`` is not 0), used up or not."""
        return bool(self.plan_used is not None and self.plan_used.keeper and self.max_restarts > 0)

    def can_respawn(self, dead: Iterable[int] = ()) -> bool:
        """Whether ``dead`` ranks would be replaced in place now: the ranks run under the keeper
        (``LaunchPlan.keeper``), some rank survives, and ``max_restarts`` is not used up."""
        dead = set(dead)
        return (self.running and self.plan_used is not None and self.plan_used.keeper
                and not self.replace_failed
                and self.restarts + len(dead) <= self.max_restarts and len(dead) < self.size)

    def respawn(self, dead: Iterable[int], elastic: bool = False) -> Replacement:
        """Replace the ``dead`` ranks in place: new engines with their rank numbers join the
        survivors, which keep their namespaces (``_respawn.replace_ranks``). ClusterError if it
        cannot be done (see :meth:`can_respawn`) or a step fails: ``%ring restart`` then.
        ``elastic``: the survivors are inside ``elastic.run`` (:meth:`elastic_survivors`) and
        re-form the world from there; their cell goes on."""
        return _respawn.respawn(self, dead, elastic)

    def scale(self, n: int) -> Scaled:
        """Grow or shrink the live cluster to ``n`` ranks between cells, the ranks that stay
        keeping their namespaces (``_scale.scale``); ``ScaleRefused`` when it cannot."""
        return scale(self, n, _start.SETUP_CODE)

    def elastic_survivors(self, dead: Iterable[int]) -> bool:
        """Whether every rank but the ``dead`` is inside ``elastic.run`` now."""
        return elastic_survivors(self, list(dead))

    @property
    def where_dir(self) -> str:
        """The folder where the ranks keep their stacks and collective for ``%ring where``."""
        cluster = self._running_cluster
        return where_dir(cluster.profile_dir, cluster.cluster_id)

    def repair_torch(self, wait: float) -> str:
        """After a failed cell: re-create on every rank the torch.distributed groups some rank
        aborted (``engines._torch.repair``, collective over the ranks). Returns its note for the
        user, or "" (nothing to re-create). The ranks run requests in order, so the repair always
        runs before the next cell; a rank still busy after ``wait`` seconds (formatting its
        traceback) leaves the note to :meth:`torch_repair_note`, called when the next cell starts."""
        if not self.running or self.dead_ranks():
            return ""
        self.torch_repair.send(self.engine_ids)
        return self.torch_repair.note(wait)

    def torch_repair_note(self, wait: float = 0.0) -> str:
        """The note of the last repair once it has finished (waiting up to ``wait`` s), else ""."""
        return self.torch_repair.note(wait)

    def _write_sidecar(self) -> None:
        """The Ring panel reads the ranks' devices, steps and the owner kernel from it."""
        cluster = self._running_cluster
        try:
            write_sidecar(cluster.profile_dir, cluster.cluster_id,
                          [SidecarRow(rank=row["rank"], host=row["host"], pid=row["pid"],
                                      device=row["device"], replaced=self.replaced.get(row["rank"], 0),
                                      **self.steps.get(row["rank"], {}))
                           for row in self.ranks],
                          restarts=(self.restarts, self.max_restarts) if self.respawns else None)
        except OSError as exc:
            log.warning("could not write the Ring panel's sidecar file: %s", exc)

    def record_steps(self, steps: Mapping[int, RankProgress]) -> None:
        """Note each rank's ``{"step": s, "total": t}`` (from the dashboard) for the Ring panel."""
        if self.running and steps and steps != self.steps:
            self.steps = dict(steps)
            self._write_sidecar()

    def stop(self) -> None:
        """Stop engines, then the controller (in this order it takes ~0.5 s), then the watchdog.

        Shared-memory files that the ranks had mapped and that are still there at the end (ranks
        that died never ran MPI_Finalize, which unlinks them) are removed.
        """
        _stop.release(self, stop_processes=True)

    def stopped_by(self) -> str | None:
        """Who stopped this cluster from outside the kernel (``"the Ring panel"``), or None while
        it is this kernel's to stop (see ``_stop.stopped_by``)."""
        return _stop.stopped_by(self)

    def forget(self) -> None:
        """Let go of a cluster stopped from outside (see ``stopped_by``): close the client, remove
        what is left of its files and shared memory, stop the watchdog; ``running`` is then
        False and ``start()`` starts a new cluster."""
        _stop.release(self, stop_processes=False)

    def kill(self) -> None:
        """SIGKILL every process of the cluster now (used at interpreter exit)."""
        _stop.kill(self)

    # ------------------------------------------------------------------------------- status
    def processes(self) -> list[psutil.Process]:
        """psutil.Process objects of the controller, mpiexec and every engine (and nanny)."""
        return list(process_trees(_stop.root_pids(self.ipp_cluster) + self._local_rank_pids()).values())

    def _local_rank_pids(self) -> list[int]:
        """Pids of the ranks on this host: a rank's pid on another host is no process here (and
        must never be signalled here: it may be an unrelated process of this host)."""
        me = socket.gethostname()
        return [row["pid"] for row in self.ranks if row["host"] == me]

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine has unregistered from the controller (died or was killed)."""
        return _liveness.dead_ranks(self)

    def dead_ranks_settled(self, dead: list[int], within: float = 2.0) -> list[int]:
        """``dead`` once the job has reacted to it (see ``_liveness.dead_ranks_settled``)."""
        return _liveness.dead_ranks_settled(self, dead, within)

    def check_alive(self, ranks: Container[int] | None = None) -> None:
        """Raise DeadRankError naming the dead ranks and the fix; else return quietly."""
        if not self.running:
            raise ClusterError("no cluster is running; start one with %ring start")
        dead = self.dead_ranks()
        if ranks is not None:
            dead = [r for r in dead if r in ranks] or dead
        if dead:
            raise DeadRankError(self.describe_death(dead), dead)

    def describe_death(self, dead: Iterable[int], fix: str = RESTART_FIX,
                       settle: float = 2.0) -> str:
        """A message for dead ranks: which died first and how, and ``fix`` (``_liveness.describe``)."""
        return _liveness.describe(self, dead, fix, settle)

    def _engines_output(self) -> str:
        """What the engine sets wrote (``_liveness.engines_output``)."""
        return _liveness.engines_output(self)

    # ----------------------------------------------------------------------------- signals
    def signal_ranks(self, sig: int, ranks: Iterable[int] | None = None) -> None:
        """Send ``sig`` to the ranks' engines (all by default) through their ipyparallel nannies
        (see ``_signals``: never through mpiexec)."""
        if not self.running:
            return
        ranks = range(self.size) if ranks is None else ranks
        signal_engines(self.client, sig, [self.engine_ids[r] for r in ranks])

    def new_cell(self) -> CellId:
        """The id of the next cell the notebook runs on the ranks (its requests carry it)."""
        return CellId(self._cell_token, next(self._cell_numbers))

    def interrupt_cell(self, cell: CellId, ranks: Iterable[int]) -> dict[int, Any]:
        """Interrupt ``cell``, and any earlier cell still running, on ``ranks``: each rank stops
        it if it runs, or as it begins (see ``engines/_interrupts``). Returns rank -> the future
        of the rank's reply (an ``InterruptReply`` in its content)."""
        if not self.running:
            return {}
        client = self._running_client
        alive = set(client.ids)
        ranks = [r for r in ranks if self.engine_ids[r] in alive]
        futures = interrupt_cells(client, cell, [self.engine_ids[r] for r in ranks])
        return dict(zip(ranks, futures))

    # ---------------------------------------------------------------------------- watchdog
    def where(self, ranks: Iterable[int] | None = None, timeout: float = 3.0) -> list[RankWhere]:
        """Every rank's (or ``ranks``') stack and collective, read from outside the ranks: a list
        of :class:`RankWhere` (see ``_where``); works while a cell runs and on a stuck rank."""
        return collect_where(self.where_dir, self.ranks,
                             lambda rs, sig: self.signal_ranks(sig, rs), ranks, timeout)

    def _watch(self) -> None:
        """Tell the watchdog the cluster's current root pids, shared-memory files and files."""
        if self._watchdog is not None:
            self._watchdog.watch(_stop.root_pids(self.ipp_cluster) + self._local_rank_pids(), self._shm,
                                 _stop.cluster_files(self.ipp_cluster))

    def _stop_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()


def format_table(rows: Iterable[RankRow]) -> str:
    """The compact rank table printed by ``%ring start`` and ``%ring status``."""
    header = ("rank", "host", "pid", "device")
    lines = [header] + [(str(r["rank"]), r["host"], str(r["pid"]), r["device"]) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in lines)
