"""The Ring panel's view of clusters: ipyparallel's cluster files plus the process table.

Listing is read-only: it parses ``$IPYTHONDIR/profile_*/security/cluster-*.json`` as JSON and asks
psutil about the pids in them, so a poll every few seconds starts no threads and rewrites no file.
Actions go the way the kernel's own do: interrupt through the engines' nannies
(``cluster._signals``, never a second SIGINT to mpiexec), stop with ipyparallel's launchers
(``Cluster.from_file``), then the process trees of ``cluster._procs`` for what is left.
"""

import asyncio
import glob
import json
import logging
import os
import re
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import psutil

from ..cluster import (cluster_file_patterns, kill_processes, live_process, mark_stopped, process_trees,
                       read_sidecar, remove_files, remove_sidecar, signal_cluster, wait_exit)
from ..errors import ClusterError, ClusterNotFound

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # Python 3.10 (requires-python): typing_extensions comes with IPython there
    from typing_extensions import NotRequired

if TYPE_CHECKING:
    from ipyparallel import Cluster

    from .._live import RunningCell
    from ..cluster import Sidecar

__all__ = ["ClusterNotFound", "ClusterDescription", "PanelRank", "Owner", "Session", "find_cluster_file",
           "list_clusters", "describe_cluster",
           "interrupt_cluster", "where_cluster", "attach_cluster", "stop_cluster", "kernel_pids",
           "kernel_sessions"]

log = logging.getLogger(__name__)

# Cluster ids are ipyparallel's "<epoch>-<4 chars>" or a user's name; anything that could walk
# out of the security folder is refused before it reaches a path.
CLUSTER_ID_RE = r"[A-Za-z0-9_.\-]+"

# Environment variables that carry the MPI rank, by launcher: MPICH/Hydra, Open MPI, PMIx, Slurm.
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")

# An ipyparallel cluster file (``cluster-<id>.json``) as json.load returns it: ipyparallel's own
# format, read field by field with .get() since any part may be missing.
ClusterFile = dict[str, Any]


class Session(TypedDict):
    """The notebook (or console) a kernel serves, from the server's sessions."""

    path: str | None
    name: str | None
    type: str | None


class Owner(TypedDict):
    """The process that started a cluster (its kernel), and the notebook it serves."""

    pid: int | None
    alive: bool
    kernel_id: str | None
    name: str | None
    session: NotRequired[Session | None]


class EngineSet(TypedDict):
    """One of ipyparallel's engine sets (an mpiexec, or a rank replaced in place)."""

    id: str
    n: int
    pid: int | None
    alive: bool


class PanelRank(TypedDict):
    """A rank as the Ring panel shows it. ``alive`` is None on another host (unknown);
    ``step``/``total``: its last ring.progress() as the owner kernel's dashboard saw it (None:
    no report yet, or no sidecar); ``replaced``: times replaced in place."""

    rank: int | None
    host: str | None
    pid: int | None
    device: str | None
    alive: bool | None
    step: int | float | None
    total: int | float | None
    replaced: int


class Restarts(TypedDict):
    """Ranks replaced in place so far, of ``--max-restarts``."""

    used: int
    max: int


class ControllerInfo(TypedDict):
    """The controller's pid and whether it runs."""

    pid: int | None
    alive: bool


class ClusterDescription(TypedDict):
    """One cluster as the Ring panel's routes describe it (docs/lab.md lists the fields)."""

    id: str
    profile: str
    profile_dir: str
    cluster_file: str
    state: str  # running | starting | degraded | stopped
    orphaned: bool
    n: int
    owner: Owner
    controller: ControllerInfo
    engine_sets: list[EngineSet]
    ranks: list[PanelRank]
    cell: "RunningCell | None"
    restarts: Restarts | None
    metrics: None


class KernelManager(Protocol):
    """What :func:`kernel_pids` reads of jupyter_server's kernel manager."""

    def list_kernel_ids(self) -> list[str]: ...

    def get_kernel(self, kernel_id: str) -> object: ...


class SessionManager(Protocol):
    """What :func:`kernel_sessions` reads of jupyter_server's session manager."""

    async def list_sessions(self) -> list[dict[str, Any]]: ...


# ------------------------------------------------------------------------------------- files
def _ipython_dir() -> str:
    from IPython.paths import get_ipython_dir

    return get_ipython_dir()


def _cluster_files(ipython_dir: str | None = None) -> list[str]:
    root = ipython_dir or _ipython_dir()
    return sorted(glob.glob(os.path.join(root, "profile_*", "security", "cluster-*.json")))


def find_cluster_file(cluster_id: str, ipython_dir: str | None = None) -> str:
    """Path of ``cluster-<cluster_id>.json`` in any profile; ClusterNotFound if there is none."""
    if not re.fullmatch(CLUSTER_ID_RE, cluster_id or ""):
        raise ClusterNotFound(f"{cluster_id!r} is not a cluster id")
    root = ipython_dir or _ipython_dir()
    for path in glob.glob(os.path.join(root, "profile_*", "security", f"cluster-{cluster_id}.json")):
        return path
    raise ClusterNotFound(f"no cluster {cluster_id!r} in the IPython profiles under {root}")


def _profile_name(profile_dir: str) -> str:
    base = os.path.basename(os.path.normpath(profile_dir))
    return base[len("profile_"):] if base.startswith("profile_") else profile_dir


# ---------------------------------------------------------------------------------- processes
def kernel_pids(kernel_manager: KernelManager | None) -> dict[int, str]:
    """``{pid: kernel_id}`` for the kernels this Jupyter server runs (local provisioners)."""
    found: dict[int, str] = {}
    if kernel_manager is None:
        return found
    for kernel_id in list(kernel_manager.list_kernel_ids()):
        try:
            km = kernel_manager.get_kernel(kernel_id)
        except KeyError:
            continue
        provisioner = getattr(km, "provisioner", None)
        pid = getattr(provisioner, "pid", None)
        if pid is None:
            pid = getattr(getattr(provisioner, "process", None), "pid", None)
        if isinstance(pid, int) and pid > 0:
            found[pid] = kernel_id
    return found


async def kernel_sessions(session_manager: SessionManager | None) -> dict[str, Session]:
    """``{kernel_id: {"path", "name", "type"}}`` from the server's sessions (a notebook's path
    relative to the server's root); a kernel with several sessions is named by a notebook's."""
    found: dict[str, Session] = {}
    if session_manager is None:
        return found
    for session in await session_manager.list_sessions():
        kernel_id = (session.get("kernel") or {}).get("id")
        if not kernel_id or (kernel_id in found and found[kernel_id]["type"] == "notebook"):
            continue
        found[kernel_id] = Session(path=session.get("path"), name=session.get("name"),
                                   type=session.get("type"))
    return found


def _owner(controller: psutil.Process | None, sidecar: "Sidecar | None", kernels: dict[int, str]) -> Owner:
    """The process that started the cluster: the sidecar's kernel pid, else the controller's parent.

    ipyparallel starts the controller as a child of the launching process (the kernel), so while
    that process lives it is the controller's parent; when it dies the controller is re-parented
    (to init or a subreaper) and the cluster is an orphan.
    """
    owner = Owner(pid=None, alive=False, kernel_id=None, name=None)
    pid = sidecar.get("kernel_pid") if sidecar else None
    chain: list[psutil.Process] = []
    if isinstance(pid, int) and pid > 0:
        proc = live_process(pid)
        chain = [proc] if proc is not None else []
    elif controller is not None:
        try:
            parent = controller.parent()
            # The original parent is gone when the controller was re-parented to init (pid 1) or to
            # a subreaper that is not an ancestor of this server's kernels.
            if parent is not None and parent.pid != 1:
                pid = parent.pid
                chain = [parent] + parent.parents()
        except psutil.Error:
            pass
    owner["pid"] = pid if isinstance(pid, int) else None
    if chain:
        owner["alive"] = True
        try:
            owner["name"] = chain[0].name()
        except psutil.Error:
            pass
        # The kernel may be the owner itself or an ancestor (a wrapper script, conda run, ...).
        for proc in chain:
            if proc.pid in kernels:
                owner["kernel_id"] = kernels[proc.pid]
                break
    return owner


def _engine_processes(set_state: dict[str, Any]) -> list[tuple[int | None, psutil.Process]]:
    """``[(rank_or_None, Process)]`` of the engines under one engine set's launcher pid(s)."""
    roots: list[int] = []
    if isinstance(set_state.get("pid"), int):
        roots.append(set_state["pid"])
    # LocalEngineSetLauncher keeps one launcher per engine under "engines".
    for sub in (set_state.get("engines") or {}).values():
        if isinstance(sub, dict) and isinstance(sub.get("pid"), int):
            roots.append(sub["pid"])
    found: list[tuple[int | None, psutil.Process]] = []
    for proc in process_trees([pid for pid in roots if live_process(pid) is not None]).values():
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if not _is_engine(cmd):
            continue
        rank = None
        try:
            env = proc.environ()
            for var in _RANK_VARS:
                if env.get(var, "").isdigit():
                    rank = int(env[var])
                    break
        except psutil.Error:
            pass
        found.append((rank, proc))
    return found


# Launchers whose command line names the engine program but which are not engines themselves.
_LAUNCHERS = ("mpiexec", "mpirun", "orterun", "prterun", "srun", "hydra_pmi_proxy")


def _is_engine(cmd: list[str]) -> bool:
    """An ipyparallel engine's command line (``-m ipyparallel.engine`` or ``ipengine``), not its
    nanny, not its keeper (``jupyter_ring.engines._keeper``, which names the engine's command)
    and not the ``mpiexec`` that started it."""
    text = " ".join(cmd)
    if not cmd or "ipyparallel.engine.nanny" in text or "jupyter_ring.engines._keeper" in text:
        return False
    if os.path.basename(cmd[0]).startswith(_LAUNCHERS):
        return False
    return "ipyparallel.engine" in text or any(os.path.basename(c) == "ipengine" for c in cmd)


def _nvidia_present() -> bool:
    return os.path.isdir("/proc/driver/nvidia/gpus")


# --------------------------------------------------------------------------------- describing
def describe_cluster(path: str, kernels: dict[int, str] | None = None,
                     sessions: dict[str, Session] | None = None) -> ClusterDescription:
    """A JSON-able dict for the cluster file at ``path`` (see docs/lab.md for the fields).

    ``kernels``: ``{pid: kernel_id}`` (kernel_pids); ``sessions``: ``{kernel_id: session}``
    (kernel_sessions), which names the owner kernel's notebook."""
    kernels = kernels or {}
    with open(path) as f:
        data: ClusterFile = json.load(f)
    info = data.get("cluster", {})
    cluster_id = info.get("cluster_id", "")
    profile_dir = info.get("profile_dir") or os.path.dirname(os.path.dirname(path))
    sidecar = read_sidecar(profile_dir, cluster_id)

    controller_state = ((data.get("controller") or {}).get("state") or {})
    controller = live_process(controller_state.get("pid"))
    engine_sets, engines, n = _engine_sets(data)
    n = n or info.get("n") or 0

    ranks = _rank_rows(engines, sidecar, socket.gethostname())
    restarts = _restarts(sidecar)
    if restarts is not None and ranks:
        # ranks replaced in place: each replacement is an engine set of its own, and a set whose
        # rank died (and was replaced again) has ended; the world is the sidecar's rows
        n = len(ranks)
    if n < len(ranks):
        n = len(ranks)
    owner = _owner(controller, sidecar, kernels)
    kernel_id = owner["kernel_id"]
    owner["session"] = sessions.get(kernel_id) if sessions and kernel_id is not None else None
    controller_alive = controller is not None
    anything_alive = controller_alive or any(s["alive"] for s in engine_sets)
    state = _cluster_state(controller_alive, engine_sets, ranks, n, restarts is not None,
                           stopping=bool(sidecar and sidecar.get("stopping")))
    return ClusterDescription(
        id=cluster_id,
        profile=_profile_name(profile_dir),
        profile_dir=profile_dir,
        cluster_file=path,
        state=state,
        # Nobody owns it any more but processes still run: show it so that it can be stopped.
        orphaned=anything_alive and not owner["alive"],
        n=n,
        owner=owner,
        controller=ControllerInfo(pid=controller_state.get("pid"), alive=controller_alive),
        engine_sets=engine_sets,
        ranks=ranks,
        # the %%distributed cell its kernel runs (jupyter_ring._live), None between cells: the
        # Ring panel offers its live view to a notebook reopened meanwhile
        cell=_running_cell(profile_dir, cluster_id) if state != "stopped" else None,
        # {"used": 1, "max": 3}: ranks replaced in place of --max-restarts (None: respawn off)
        restarts=restarts,
        # Filled by the metrics issue: per-cluster summary of ring.progress()/ring.log().
        metrics=None,
    )


def _engine_sets(data: ClusterFile) -> tuple[list[EngineSet], list[tuple[int | None, psutil.Process]], int]:
    """The cluster file's engine sets (alive: its launcher or one of its engines runs), the
    engine processes found under them, and how many engines the sets say they started."""
    engine_sets: list[EngineSet] = []
    engines: list[tuple[int | None, psutil.Process]] = []
    n = 0
    for set_id, state in ((data.get("engines") or {}).get("sets") or {}).items():
        set_n = state.get("n") or len(state.get("engines") or {}) or 0
        n += set_n
        launcher = live_process(state.get("pid"))
        engine_sets.append(EngineSet(id=set_id, n=set_n, pid=state.get("pid"),
                                     alive=launcher is not None or any(
                                         live_process(s.get("pid")) for s in (state.get("engines") or {}).values()
                                         if isinstance(s, dict))))
        engines.extend(_engine_processes(state))
    return engine_sets, engines, n


def _cluster_state(controller_alive: bool, engine_sets: list[EngineSet], ranks: list[PanelRank], n: int,
                   respawns: bool, stopping: bool) -> str:
    """running, starting, degraded (some part died: the controller, mpiexec or a rank) or
    stopped (gone, or going: its kernel is stopping it, %ring stop). ``respawns``: ranks are
    replaced in place, each replacement an engine set of its own (one of them alive will do)."""
    sets_alive = bool(engine_sets) and (any if respawns else all)(s["alive"] for s in engine_sets)
    anything_alive = controller_alive or any(s["alive"] for s in engine_sets)
    dead = [r for r in ranks if r["alive"] is False]
    if not anything_alive or stopping:
        return "stopped"
    if controller_alive and sets_alive and not dead and len(ranks) >= n:
        return "running"
    if controller_alive and not engine_sets and not ranks:
        return "starting"   # no engine set and no rank yet (a cluster that had ranks lost them)
    return "degraded"


def _restarts(sidecar: "Sidecar | None") -> Restarts | None:
    """``{"used", "max"}`` from the sidecar of a cluster that replaces dead ranks in place."""
    used, most = (sidecar.get("restarts"), sidecar.get("max_restarts")) if sidecar else (None, None)
    if isinstance(used, int) and isinstance(most, int):
        return Restarts(used=used, max=most)
    return None


def _rank_rows(engines: list[tuple[int | None, psutil.Process]], sidecar: "Sidecar | None",
               here: str) -> list[PanelRank]:
    """One row per rank: from the sidecar when the kernel wrote one, else from the process table."""
    by_pid = {proc.pid: (rank, proc) for rank, proc in engines}
    rows: list[PanelRank] = []
    if sidecar and sidecar.get("ranks"):
        for row in sidecar["ranks"]:
            pid = row.get("pid")
            host = row.get("host")
            local = host in (here, None, "localhost")
            alive = (live_process(pid) is not None) if local else None  # None: another host, unknown
            rows.append(_row(row.get("rank"), host, pid, row.get("device"), alive,
                             row.get("step"), row.get("total"), row.get("replaced") or 0))
        return sorted(rows, key=lambda r: (r["rank"] is None, r["rank"]))
    device = None if _nvidia_present() else "cpu"
    unranked = 0
    for pid, (rank, proc) in sorted(by_pid.items()):
        if rank is None:
            rank = unranked
            unranked += 1
        rows.append(_row(rank, here, pid, device, True))
    return sorted(rows, key=lambda r: (r["rank"] is None, r["rank"]))


def _row(rank: int | None, host: str | None, pid: int | None, device: str | None, alive: bool | None,
         step: int | float | None = None, total: int | float | None = None, replaced: int = 0) -> PanelRank:
    return PanelRank(rank=rank, host=host, pid=pid, device=device, alive=alive, step=step, total=total,
                   replaced=replaced)


def list_clusters(kernels: dict[int, str] | None = None, ipython_dir: str | None = None,
                  sessions: dict[str, Session] | None = None) -> list[ClusterDescription]:
    """Every cluster file's description, newest first; unreadable files are skipped and logged."""
    clusters: list[ClusterDescription] = []
    for path in _cluster_files(ipython_dir):
        try:
            clusters.append(describe_cluster(path, kernels, sessions))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("skipping unreadable cluster file %s: %s", path, exc)
    clusters.sort(key=lambda c: c["id"], reverse=True)
    return clusters


# ------------------------------------------------------------------------------------ actions
def _read_cluster_file(path: str) -> ClusterFile:
    """The cluster file's JSON; ClusterNotFound when it went away (the cluster was stopped)."""
    try:
        with open(path) as f:
            data: ClusterFile = json.load(f)
            return data
    except FileNotFoundError:
        raise ClusterNotFound(f"cluster file {path} is gone: the cluster has stopped") from None


async def interrupt_cluster(path: str) -> dict[str, object]:
    """SIGINT every rank through its engine's nanny (``cluster._signals``: the kernel's own
    path), so that any number of presses only interrupts, under gforker or Hydra alike."""
    info = _read_cluster_file(path).get("cluster", {})
    profile_dir = info.get("profile_dir") or os.path.dirname(os.path.dirname(path))
    # connecting a client blocks (sockets, registration): not on the server's event loop
    engines = await asyncio.to_thread(signal_cluster, profile_dir, info.get("cluster_id", ""),
                                      signal.SIGINT)
    return {"signal": "SIGINT", "engines": engines}


async def where_cluster(path: str, timeout: float = 3.0) -> dict[str, object]:
    """Every rank's stack and collective (``cluster._where``), also while a cell is busy: the
    ranks' where signal goes through the nannies, as an interrupt does; their dumps are read
    from the cluster's where folder. ``{"ranks": [...], "text": ...}``."""
    from ..cluster import collect_where, format_where, where_dir, where_json

    info = _read_cluster_file(path).get("cluster", {})
    profile_dir = info.get("profile_dir") or os.path.dirname(os.path.dirname(path))
    cluster_id = info.get("cluster_id", "")
    sidecar = read_sidecar(profile_dir, cluster_id)
    rows = [r for r in (sidecar.get("ranks") or [] if sidecar else []) if isinstance(r, dict) and "rank" in r]
    if not rows:
        raise ClusterError(f"cluster {cluster_id!r} has no rank table (its kernel has not finished "
                           "starting it, or it was not started by %ring start)")

    def collect() -> dict[str, object]:
        items = collect_where(where_dir(profile_dir, cluster_id), rows,
                              lambda ranks, sig: signal_cluster(profile_dir, cluster_id, sig),
                              timeout=timeout)
        return {"ranks": where_json(items), "text": format_where(items)}

    # connecting a client and waiting for the dumps block: not on the server's event loop
    return await asyncio.to_thread(collect)


def _running_cell(profile_dir: str, cluster_id: str) -> "RunningCell | None":
    from .._live import running_cell
    from ..cluster import where_dir

    return running_cell(where_dir(profile_dir, cluster_id))


async def attach_cluster(path: str) -> dict[str, object]:
    """Ask the kernel running a cell on this cluster to show the cell's live view again, for a
    notebook reopened while it runs (``jupyter_ring._live``): the cell's loop sees the request
    within a fraction of a second, busy or not. ``{"cell": {...}}``; ClusterError when no cell
    runs."""
    from .._live import request_attach
    from ..cluster import where_dir

    info = _read_cluster_file(path).get("cluster", {})
    profile_dir = info.get("profile_dir") or os.path.dirname(os.path.dirname(path))
    try:
        cell = request_attach(where_dir(profile_dir, info.get("cluster_id", "")))
    except LookupError as exc:
        raise ClusterError(str(exc)) from None
    return {"cell": cell}


async def stop_cluster(path: str, grace: float = 5.0) -> dict[str, object]:
    """Stop engines then controller with ipyparallel; SIGKILL whatever still runs after ``grace`` s.

    The second step matters for orphans whose controller died: ipyparallel then has no launcher
    for it, but its processes are still listed in the cluster file.
    """
    data = _read_cluster_file(path)
    info = data.get("cluster", {})
    tree = process_trees([pid for pid in _all_pids(data) if live_process(pid) is not None])
    try:
        cluster = _load(path)
        await asyncio.wait_for(cluster.stop_engines(), grace)
        await asyncio.wait_for(cluster.stop_controller(), grace)
    except Exception as exc:  # a broken half of the cluster must not keep the rest alive
        log.warning("ipyparallel could not stop cluster %s cleanly (%s); killing its processes",
                    info.get("cluster_id"), exc)
    alive = wait_exit(tree.values(), 0.5)
    kill_processes(alive)
    wait_exit(alive, 2)
    profile_dir = info.get("profile_dir") or os.path.dirname(os.path.dirname(path))
    cluster_id = info.get("cluster_id", "")
    remove_files([path] + cluster_file_patterns(profile_dir, cluster_id, sidecar=False))
    # the owner kernel still holds the cluster: the sidecar stays, marked, to tell it who
    # stopped it (it removes the file when it notices; its watchdog if it dies first)
    sidecar = read_sidecar(profile_dir, cluster_id)
    owner = live_process(sidecar.get("kernel_pid") if sidecar else None)
    if owner is None or not mark_stopped(profile_dir, cluster_id, "the Ring panel"):
        remove_sidecar(profile_dir, cluster_id)
    return {"stopped": True, "killed": sorted(p.pid for p in alive)}


def _load(path: str) -> "Cluster":
    from ..cluster import atomic_cluster_class, ipp_log

    # not the server's log: ipyparallel would write the controller's whole output there
    return atomic_cluster_class().from_file(path, log=ipp_log(f"{__name__}.ipyparallel"))


def _all_pids(data: ClusterFile) -> list[int]:
    pids = [((data.get("controller") or {}).get("state") or {}).get("pid")]
    for state in ((data.get("engines") or {}).get("sets") or {}).values():
        pids.append(state.get("pid"))
        for sub in (state.get("engines") or {}).values():
            if isinstance(sub, dict):
                pids.append(sub.get("pid"))
    return [p for p in pids if isinstance(p, int) and p > 0]
