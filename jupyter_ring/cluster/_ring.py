"""RingCluster: a :class:`LaunchPlan` started on ipyparallel, the ranks set up, then stopped.

The class holds the options (traits), starts and stops the cluster, and answers questions about
its ranks; planning, launching, process trees, signals and death diagnosis are the package's
other modules.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Container, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import psutil
from traitlets import Bool, Enum, Float, Integer, List, Unicode
from traitlets.config import LoggingConfigurable

from ..engines._interrupts import CellId
from ..engines._setup import RankRow
from ..errors import ClusterError, DeadRankError
from ._death import RESTART_FIX, describe_death, died_starting, says_how
from ._launchers import curve_client, ipp_cluster
from ._machine import Machine
from ._plan import LaunchPlan, TorchWorld, plan_launch, torchrun_environment
from ._procs import (Watchdog, cluster_file_patterns, kill_processes, live_process,
                     process_trees, remove_files, remove_shm_files, shm_files,
                     sweep_mpich_segments, wait_exit)
from ._respawn import Replacement, elastic_survivors, replace_ranks
from ._scale import Scaled, scale
from ._sidecar import (RankProgress, SidecarRow, mark_stopping, read_sidecar, remove_sidecar,
                       write_sidecar)
from ._signals import interrupt_cells, signal_engines
from ._where import RankWhere, collect_where, where_dir

if TYPE_CHECKING:
    # ipyparallel ships no type information (no py.typed, no stubs): mypy reads its classes as
    # Any, and the names say which object is meant
    import ipyparallel as ipp

__all__ = ["RingCluster", "format_table"]

log = logging.getLogger(__name__)

# Run first on every engine, in the user namespace: bind the GPU before any framework import,
# then start the runtime so that ``ring`` is there in every cell; rank 0 reserves the port of
# torch.distributed's rendezvous (engines._torch; torch itself is not imported).
_SETUP_CODE = """\
import os as _jr_os
_jr_os.umask(_jr_umask)
import jupyter_ring.engines._setup as _jr_engine
_jr_device = _jr_engine.bind_device(_jr_gpus)
import jupyter_ring.runtime as ring
ring.init()
_jr_engine.watch_cells()
_jr_engine.number_cells()
_jr_engine.keep_own_errors()
_jr_engine.address_interrupts()
_jr_engine.reply_always()
_jr_engine.ascii_logs()
_jr_info = _jr_engine.describe(ring, _jr_device)
_jr_engine.arm_where(_jr_where, ring.rank())
_jr_engine.arm_debugger(_jr_where, ring.rank())
_jr_engine.arm_elastic(_jr_where, ring.rank())
import jupyter_ring.engines._torch as _jr_torch
_jr_rendezvous = _jr_torch.reserve(ring, _jr_torch_addr)
del _jr_engine, _jr_device, _jr_gpus, _jr_os, _jr_umask, _jr_where, _jr_torch, _jr_torch_addr
"""


class RingCluster(LoggingConfigurable):
    """ipyparallel MPI engines, one per rank, with GPUs bound and ``ring`` initialised.

    ::

        with RingCluster(n=2) as cluster:       # start() ... stop()
            cluster.view.execute("print(ring.rank())", block=True)

    ``plan()`` shows what ``start()`` would run, without starting anything.
    """

    n = Integer(None, allow_none=True, config=True,
                help="Number of ranks (default: one per visible GPU, else CPU ranks as in "
                     "default_size()).")
    gpus = Unicode("auto", config=True,
                   help="GPUs for the ranks: 'auto' (CUDA_VISIBLE_DEVICES or all the driver's "
                        "GPUs), 'none' (CPU ranks, GPUs hidden), or a list of ids like '0,2'.")
    launcher = Enum(["mpi", "slurm", "ssh"], "mpi", config=True,
                    help="How engines start: 'mpi' (mpiexec on this host, or on --hosts), "
                         "'slurm' (ipyparallel's Slurm launcher), 'ssh' (mpiexec over ssh to "
                         "--hosts).")
    hosts = List(Unicode(), config=True,
                 help="Hosts for a multi-host job (passed to mpiexec); empty means this host "
                      "only, with every socket on loopback. 'host:K' puts K ranks on host.")
    hostfile = Unicode("", config=True,
                       help="A Hydra hostfile (one 'host[:K]' a line) for a multi-host job "
                            "(mpiexec -f FILE); HYDRA_LAUNCHER_EXEC picks the ssh command.")
    nodes = Integer(None, allow_none=True, config=True,
                    help="--launcher slurm: nodes for the engines' batch job (sbatch --nodes).")
    ntasks_per_node = Integer(None, allow_none=True, config=True,
                              help="--launcher slurm: ranks per node (sbatch --ntasks-per-node).")
    partition = Unicode("", config=True,
                        help="--launcher slurm: the partition (sbatch --partition).")
    time_limit = Unicode("", config=True,
                         help="--launcher slurm: the job's time limit (sbatch --time), e.g. 1:00:00.")
    controller_ip = Unicode("", config=True,
                            help="Address the controller listens on in a multi-host job; empty: "
                                 "this host's address on the route to the other hosts (the one "
                                 "they can reach). One-host clusters always use 127.0.0.1.")
    heartbeat_period = Integer(100, config=True,
                               help="Controller heartbeat period in ms: an engine registers "
                                    "on a heartbeat, so ipyparallel's 3000 makes the start "
                                    "wait seconds (500: ~0.4 s slower than 100).")
    heartbeat_tolerance = Float(5.0, config=True,
                                help="Seconds of missed heartbeats before the controller "
                                     "declares an engine dead (a busy machine can delay a "
                                     "beat; a dead process is noticed at once by its nanny).")
    controller_db = Unicode("NoDB", config=True,
                            help="The controller's record store (IPController.db_class). "
                                 "ipyparallel's DictDB keeps every task's record and output, "
                                 "deep-copying it on each output message (CPU and memory in "
                                 "the controller for every line printed or snapshot sent); the "
                                 "magics never read it back, so NoDB by default.")
    encrypt = Bool(True, config=True,
                   help="Encrypt and authenticate every message between this kernel, the "
                        "controller and the engines with CurveZMQ (ipyparallel's "
                        "enable_curve): without it, anyone on the host who can reach the "
                        "controller's loopback ports can read the ranks' output, and messages "
                        "are only signed (HMAC key in the connection file). Costs: see "
                        "docs/benchmarks.md.")
    engine_timeout = Float(60.0, config=True,
                           help="Seconds to wait for all engines to register before failing.")
    setup_timeout = Float(60.0, config=True,
                          help="Seconds to wait for ring.init() on every rank.")
    watchdog = Bool(True, config=True,
                    help="Start a watchdog process that kills the cluster if this process dies.")
    engine_env = List(Unicode(), config=True,
                      help="Extra NAME=VALUE environment variables for the engines.")
    max_restarts = Integer(3, config=True,
                           help="How many times a rank that dies (SIGKILL, a segfault, an "
                                "out-of-memory kill) is replaced in place, the survivors keeping "
                                "their variables (as torchrun's --max-restarts); 0: never, a dead "
                                "rank ends the job and %ring restart starts every rank afresh. "
                                "One-host clusters (gforker) only; elsewhere a dead rank ends "
                                "the job.")
    min_ranks = Integer(1, config=True,
                        help="The fewest ranks %ring scale may leave (Horovod's --min-np).")
    max_ranks = Integer(None, allow_none=True, config=True,
                        help="The most ranks %ring scale may make (Horovod's --max-np); None: no bound.")
    torch_distributed = Bool(False, config=True,
                             help="Also initialise torch.distributed's default process group on "
                                  "every rank at start (gloo on CPU ranks, NCCL where every rank "
                                  "has a GPU). Without it the ranks still get torchrun's "
                                  "environment, so init_process_group() works in a cell.")

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
        # engine id -> its re-creation of aborted torch groups, in flight
        self._repair: dict[int, ipp.AsyncResult] | None = None
        self._repair_notes: list[str | None] = []  # the answers of those finished (None: no note)
        self.plan_used: LaunchPlan | None = None  # the plan start() carried out
        self.rendezvous: tuple[str, int] | None = None  # torch.distributed's, reserved by rank 0
        self.restarts = 0        # ranks replaced in place so far (respawn); --max-restarts bounds it
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
        if self.running:
            raise ClusterError("a cluster is already running; %ring restart replaces it")
        # Owner-only from creation: every file and folder written while the cluster starts
        # (connection and cluster files, logs, pid files) is created 0600/0700 by this process
        # or by the controller, mpiexec and engines, which inherit this umask (ipyparallel's own
        # chmod after writing would leave a window). The ranks get the user's umask back in
        # _SETUP_CODE, so files that cells write keep their usual modes. umask is per process:
        # another thread of this kernel creating a file meanwhile gets 0600 too (never looser).
        self._user_umask = os.umask(0o077)
        try:
            plan = self.plan()
            self.note, self.address = plan.note, plan.controller_ip
            self.ipp_cluster = cluster = ipp_cluster(plan)
            try:
                if self.watchdog:
                    self._watchdog = Watchdog(os.path.join(plan.profile_dir, "security"))
                    self._watchdog.start()
                cluster.start_controller_sync()
                self._watch()
                sweep_mpich_segments()  # a stale segment named as the job's fails its MPI_Init
                cluster.start_engines_sync(plan.n)
                self._watch()
                with curve_client():
                    self.client = cluster.connect_client_sync()
                self._wait_for_engines(plan.n)
                self._setup_ranks(plan)
            except BaseException:
                self.stop()
                raise
        finally:
            os.umask(self._user_umask)
        return self.ranks

    def _wait_for_engines(self, n: int) -> None:
        """Wait until ``n`` engines registered; ClusterError (:meth:`_not_ready`) when
        ``engine_timeout`` passes or the engines' job ends first. The job is looked at here every
        half second: ipyparallel hears of its end only while its event loop runs, which outside
        a running loop (a script, a test) it does not, and a job that failed at once cost the
        whole timeout."""
        client = self._running_client
        deadline = time.monotonic() + self.engine_timeout
        while True:
            left = deadline - time.monotonic()
            try:
                client.wait_for_engines(n, timeout=max(min(left, 0.5), 0.01), block=True,
                                        interactive=False)
                return
            except TimeoutError:
                pass
            except Exception as exc:  # ipyparallel's EngineError: the engines' job ended
                if type(exc).__name__ != "EngineError":
                    raise
                why = f"the engines' job ended while they started ({exc})"
                raise ClusterError(self._not_ready(n, why)) from exc
            ended = _jobs_ended(self._running_cluster) or died_starting(self._engines_output())
            if ended:
                raise ClusterError(self._not_ready(n, ended))
            if left <= 0.5:
                raise ClusterError(self._not_ready(n))

    def _setup_ranks(self, plan: LaunchPlan) -> None:
        client = self._running_client
        ids = sorted(client.ids)
        view = client[ids]
        view.push({"_jr_gpus": None if plan.gpus is None else list(plan.gpus),
                   "_jr_umask": self._user_umask, "_jr_where": self.where_dir,
                   "_jr_torch_addr": plan.torch.master_addr}, block=False)
        ar = view.execute(_SETUP_CODE, block=False)
        if not ar.wait(self.setup_timeout):
            raise ClusterError(f"ring.init() did not finish on every rank in {self.setup_timeout:g} s")
        ar.get()
        infos, rendezvous = zip(*view.pull(("_jr_info", "_jr_rendezvous"), block=True))
        order = sorted(range(len(ids)), key=lambda i: infos[i]["rank"])
        self.engine_ids = [ids[i] for i in order]
        self.ranks = [infos[i] for i in order]
        self.size = len(self.ranks)
        self.view = client[self.engine_ids]
        self.view.block = False
        self.plan_used, self.rendezvous = plan, rendezvous[order[0]]
        self._start_torch(plan.torch, rendezvous[order[0]])
        # MPICH unlinks its shared-memory segments only in MPI_Finalize: note them now, while
        # the ranks are alive, so that a rank killed later leaves no file behind (stop, watchdog)
        self._shm = shm_files(self._local_rank_pids())
        self._watch()
        self._write_sidecar()

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
        dead = sorted(set(dead))
        if not self.can_respawn(dead):
            raise ClusterError(f"rank(s) {', '.join(map(str, dead))} cannot be replaced in place "
                               f"({self.restarts} of --max-restarts {self.max_restarts} used, or "
                               "not a one-host cluster); run %ring restart")
        self.restarts += len(dead)
        try:
            done = replace_ranks(self, dead, _SETUP_CODE, self.restarts, elastic)
        except BaseException:
            # the survivors may have left the old world, a late newcomer may still register:
            # no second try on this cluster, %ring restart starts every rank afresh
            self.replace_failed = True
            self._watch()
            raise
        for rank in dead:
            self.replaced[rank] = self.replaced.get(rank, 0) + 1
        # the dead ranks' segments that no live rank maps (their job's, the killed replacement's
        # never unlinked): gone now, not at stop, so that a long session of kills leaks none
        live = shm_files(self._local_rank_pids())
        remove_shm_files(self._shm - live)
        self._shm = live
        self._watch()
        self._write_sidecar()
        return done

    def scale(self, n: int) -> Scaled:
        """Grow or shrink the live cluster to ``n`` ranks between cells, the ranks that stay
        keeping their namespaces (``_scale.scale``); ``ScaleRefused`` when it cannot."""
        return scale(self, n, _SETUP_CODE)

    def elastic_survivors(self, dead: Iterable[int]) -> bool:
        """Whether every rank but the ``dead`` is inside ``elastic.run`` now."""
        return elastic_survivors(self, list(dead))

    @property
    def where_dir(self) -> str:
        """The folder where the ranks keep their stacks and collective for ``%ring where``."""
        cluster = self._running_cluster
        return where_dir(cluster.profile_dir, cluster.cluster_id)

    def _start_torch(self, world: TorchWorld, rendezvous: tuple[str, int]) -> None:
        """Give every rank torchrun's environment (computed here, from the plan's world, the
        hosts the ranks reported and rank 0's reserved port) and its torch.distributed guard;
        with --torch-distributed, the default process group."""
        from ..engines import _torch

        hosts = [row["host"] for row in self.ranks]
        address, port = rendezvous
        run_id = self._running_cluster.cluster_id
        pending = [self._running_client[eid].apply_async(
            _torch.start, torchrun_environment(rank, hosts, address, port, run_id),
            world.init_backend) for rank, eid in enumerate(self.engine_ids)]
        deadline = time.monotonic() + self.setup_timeout
        for ar in pending:
            if not ar.wait(max(0.0, deadline - time.monotonic())):
                raise ClusterError("torch.distributed's set-up did not finish on every rank in "
                                   f"{self.setup_timeout:g} s")
        self.torch_backend = pending[0].get()

    def repair_torch(self, wait: float) -> str:
        """After a failed cell: re-create on every rank the torch.distributed groups some rank
        aborted (``engines._torch.repair``, collective over the ranks). Returns its note for the
        user, or "" (nothing to re-create). The ranks run requests in order, so the repair always
        runs before the next cell; a rank still busy after ``wait`` seconds (formatting its
        traceback) leaves the note to :meth:`torch_repair_note`, called when the next cell starts."""
        if not self.running or self.dead_ranks():
            return ""
        self._repair = {eid: self._send_repair(eid) for eid in self.engine_ids}
        self._repair_notes = []
        return self.torch_repair_note(wait)

    def _send_repair(self, engine_id: int) -> ipp.AsyncResult:
        from ..engines import _torch

        return self._running_client[engine_id].apply_async(_torch.repair)

    def torch_repair_note(self, wait: float = 0.0) -> str:
        """The note of the last repair once it has finished (waiting up to ``wait`` s), else "".

        An engine whose cell just failed aborts the requests that reach it before it has finished
        "aborting its queue" (ipykernel's stop_on_error): a repair aborted there is sent again to
        that engine alone (the others wait for it inside the repair's collective)."""
        import ipyparallel as ipp

        pending = self._repair
        if not pending:
            return ""
        deadline = time.monotonic() + wait
        notes = self._repair_notes
        while True:
            for eid, ar in list(pending.items()):
                if not ar.ready():
                    continue
                try:
                    notes.append(ar.get())
                except ipp.error.TaskAborted:
                    pending[eid] = self._send_repair(eid)
                    continue
                except Exception as exc:  # the cell's error stands; this says what is left to do
                    self._repair = None
                    return (f"(torch.distributed groups could not be re-created after the failure: "
                            f"{type(exc).__name__}: {exc}; run %ring restart)")
                del pending[eid]
            if not pending:
                self._repair = None
                return next((note for note in notes if note), "")
            if time.monotonic() >= deadline:
                return ""
            time.sleep(0.02)

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
        self._release(stop_processes=True)

    def _release(self, stop_processes: bool) -> None:
        """Let go of the cluster: its processes (``stop_processes``), client, files, watchdog,
        shared memory and rank rows; ``running`` is False after it."""
        shm = self._shm | shm_files(self._local_rank_pids())
        # what must be gone after a stop, taken now (psutil checks create times: no recycled pid)
        procs = self.processes() if stop_processes and self.ipp_cluster is not None else []
        if stop_processes and self.ipp_cluster is not None:  # the panel shows a stop, not a fault
            mark_stopping(self.ipp_cluster.profile_dir, self.ipp_cluster.cluster_id)
        cluster, self.ipp_cluster = self.ipp_cluster, None
        client, self.client = self.client, None
        self.view = None
        if client is not None:
            try:
                if stop_processes:
                    # engines that shut down on request exit cleanly (runtime atexit, exit code 0)
                    client.shutdown(targets="all", hub=False, block=False)
                    # the engine sets' mpiexec leaves once its last rank has; at 8-16 ranks on
                    # 2 cores that takes longer than 1.5 s, and ipyparallel's own stop of a
                    # launcher still there then cost 5 s more (%ring stop: 6.6 s at 8 and 16)
                    wait_exit(_root_pids(cluster)[1:], 1.5 + 0.25 * self.size)
            except Exception:
                log.debug("asking the engines to shut down failed", exc_info=True)
            try:
                client.close()
            except Exception:  # a closed or broken client must not stop the shutdown
                log.debug("closing the client failed", exc_info=True)
        if cluster is not None and stop_processes:
            for what, step in (("engines", cluster.stop_engines_sync),
                               ("controller", cluster.stop_controller_sync)):
                try:
                    step()
                except Exception:
                    log.warning("stopping the %s failed", what, exc_info=True)
        # ipyparallel's stop ends mpiexec (SIGTERM, then SIGKILL); a rank stuck in C code runs
        # no handler for the SIGTERM its keeper passes on and outlived it, a core busy for good
        kill_processes(wait_exit(procs, 1.0))
        if cluster is not None:
            remove_sidecar(cluster.profile_dir, cluster.cluster_id)
            remove_files(cluster_files(cluster))  # what ipyparallel left (a log, a stale file)
        self._stop_watchdog()
        remove_shm_files(shm)
        self.ranks, self.engine_ids, self.size, self.steps, self._shm = [], [], 0, {}, set()
        self._repair, self.torch_backend = None, None
        self.plan_used, self.rendezvous, self.restarts, self.replace_failed = None, None, 0, False
        self.replaced = {}

    def stopped_by(self) -> str | None:
        """Who stopped this cluster from outside the kernel (``"the Ring panel"``), or None while
        it is this kernel's to stop. Stopped from outside: its cluster file is gone and its
        controller has exited (a rank that died leaves both: that is a dead rank)."""
        cluster = self.ipp_cluster
        if cluster is None or os.path.exists(cluster.cluster_file):
            return None
        if live_process(getattr(cluster.controller, "pid", None)) is not None:
            return None
        side = read_sidecar(cluster.profile_dir, cluster.cluster_id)
        return (side.get("stopped_by") if side else None) or "a process outside this kernel"

    def forget(self) -> None:
        """Let go of a cluster stopped from outside (see ``stopped_by``): close the client, remove
        what is left of its files and shared memory, stop the watchdog; ``running`` is then
        False and ``start()`` starts a new cluster."""
        self._release(stop_processes=False)

    def kill(self) -> None:
        """SIGKILL every process of the cluster now (used at interpreter exit)."""
        procs = self.processes()
        shm = self._shm | shm_files([p.pid for p in procs])
        kill_processes(procs)
        self._stop_watchdog()
        remove_shm_files(shm)
        remove_files(cluster_files(self.ipp_cluster))

    # ------------------------------------------------------------------------------- status
    def processes(self) -> list[psutil.Process]:
        """psutil.Process objects of the controller, mpiexec and every engine (and nanny)."""
        return list(process_trees(_root_pids(self.ipp_cluster) + self._local_rank_pids()).values())

    def _local_rank_pids(self) -> list[int]:
        """Pids of the ranks on this host: a rank's pid on another host is no process here (and
        must never be signalled here: it may be an unrelated process of this host)."""
        me = socket.gethostname()
        return [row["pid"] for row in self.ranks if row["host"] == me]

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine has unregistered from the controller (died or was killed)."""
        if self.client is None or self.ipp_cluster is None:
            return []
        keepers = self.plan_used is not None and self.plan_used.keeper
        # mpiexec has exited: every rank is gone. Not so under keepers: a replaced rank's job
        # (mpiexec -n 1) ends with that rank alone, and each dead engine's nanny unregisters it
        if not keepers and any(es.state == "after" for es in self.ipp_cluster.engines.values()):
            return list(range(self.size))
        alive = set(self.client.ids)
        return [rank for rank, eid in enumerate(self.engine_ids) if eid not in alive]

    def dead_ranks_settled(self, dead: list[int], within: float = 2.0) -> list[int]:
        """``dead`` once the job has reacted to it: MPI ends the other ranks of a job whose rank
        died (MPICH's default), which takes it about a second on one host (measured: the other
        rank's process exits 1.05 s after the SIGKILL). Waits until every rank is gone or
        ``within`` seconds passed, so that a report names every rank that is lost, as
        ``%ring status`` will a moment later."""
        if self.plan_used is not None and self.plan_used.keeper:
            return dead  # the ranks' keepers keep the others alive: no one else is lost
        deadline = time.monotonic() + within
        while len(dead) < self.size and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.dead_ranks()
        return dead

    def check_alive(self, ranks: Container[int] | None = None) -> None:
        """Raise DeadRankError naming the dead ranks and the fix; else return quietly."""
        if not self.running:
            raise ClusterError("no cluster is running; start one with %ring start")
        dead = self.dead_ranks()
        if ranks is not None:
            dead = [r for r in dead if r in ranks] or dead
        if dead:
            raise DeadRankError(self.describe_death(dead), dead)

    def _not_ready(self, n: int, why: str = "") -> str:
        """Why ``start`` gave up: how many ranks registered, and the end of the engines' output
        (mpiexec's and the engines' own lines: where a rank that never came says why).
        ``why``: what ended the wait before the engine timeout (the job ended, a rank died)."""
        ready = len(self._running_client.ids) if self.client is not None else 0
        lines = self._engines_output().strip().splitlines()
        # a rank that crashed wrote its Python stacks (PYTHONFAULTHANDLER): they begin the excerpt
        crashed = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
        tail = "\n".join(lines[crashed[-1]:crashed[-1] + 40] if crashed else lines[-20:])
        tail = tail or "(the engines wrote nothing)"
        why = why or f"they did not register with the controller within {self.engine_timeout:g} s"
        return (f"{n - ready} of {n} ranks did not start: {why} ({ready} registered). "
                f"The end of the engines' output:\n{tail}\n"
                "Run %ring start again; if it happens again, the lines above say why.")

    def describe_death(self, dead: Iterable[int], fix: str = RESTART_FIX,
                       settle: float = 2.0) -> str:
        """A message for dead ranks: which died first and how (nanny log, mpiexec report, a
        keeper's line), ``fix``. Under keepers the signal comes in the rank's keeper's line,
        which may follow its nanny's by a moment: a message that does not say how yet is read
        again for up to ``settle`` seconds ("died (engine process exited)" where the rank was
        SIGKILLed, or a bare "died")."""
        dead = list(dead)
        deadline = time.monotonic() + settle
        while True:
            text = describe_death(dead, self.ranks, self.engine_ids, self._engines_output(), fix)
            keepers = self.plan_used is not None and self.plan_used.keeper
            if not keepers or says_how(text) or time.monotonic() >= deadline:
                return text
            time.sleep(0.1)

    def _engines_output(self) -> str:
        """What the engine sets wrote (mpiexec's report, the nannies' and keepers' lines); ""
        where it cannot be read: a message built from it is the point, its detail a bonus."""
        output = ""
        try:
            for engine_set in self._running_cluster.engines.values():
                output += _read(getattr(engine_set, "output_file", ""))
        except Exception:  # noqa: BLE001
            return ""
        return output

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
            self._watchdog.watch(_root_pids(self.ipp_cluster) + self._local_rank_pids(), self._shm,
                                 cluster_files(self.ipp_cluster))

    def _stop_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()


def _root_pids(cluster: ipp.Cluster | None) -> list[int]:
    """Pids of the controller and of each engine set's launcher (mpiexec) of an ipyparallel
    Cluster, those started so far."""
    pids: list[int] = []
    if cluster is None:
        return pids
    for launcher in [cluster.controller] + list(cluster.engines.values()):
        pid = getattr(launcher, "pid", -1) if launcher is not None else -1
        if pid and pid > 0:
            pids.append(pid)
    return pids


def _jobs_ended(cluster: ipp.Cluster) -> str:
    """How the engine sets' local jobs (mpiexec) that have ended did ("" while all run). A
    batch job's launcher (sbatch) has no process of its own here: it is not looked at."""
    ended = []
    for launcher in cluster.engines.values():
        proc = getattr(launcher, "process", None)
        if isinstance(proc, psutil.Process) and live_process(proc.pid) is None:
            try:
                code: object = proc.wait(0)
            except psutil.Error:
                code = None  # reaped by ipyparallel's own wait meanwhile
            ended.append(f"the engines' job (pid {proc.pid}) ended while they started"
                         + ("" if code is None else f", exit code {code}"))
    return "; ".join(ended)


def cluster_files(cluster: ipp.Cluster | None) -> list[str]:
    """Glob patterns of the files of an ipyparallel Cluster (``_procs.cluster_file_patterns``)."""
    if cluster is None:
        return []
    return cluster_file_patterns(cluster.profile_dir, cluster.cluster_id)


def _read(path: str) -> str:
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def format_table(rows: Iterable[RankRow]) -> str:
    """The compact rank table printed by ``%ring start`` and ``%ring status``."""
    header = ("rank", "host", "pid", "device")
    lines = [header] + [(str(r["rank"]), r["host"], str(r["pid"]), r["device"]) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in lines)
