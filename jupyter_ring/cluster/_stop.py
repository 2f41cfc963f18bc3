"""Letting go of a :class:`RingCluster`: its processes stopped (or SIGKILLed at exit), its client
closed, its files, shared memory and watchdog gone; and whether someone outside the kernel
stopped it (the Ring panel).

``release`` is the body of ``RingCluster.stop`` and ``forget``; ``root_pids`` and
``cluster_files`` say which processes and files an ipyparallel Cluster has.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from .._ipp import end_sync_thread
from ._procs import (cluster_file_patterns, kill_processes, live_process, remove_files,
                     remove_shm_files, shm_files, wait_exit)
from ._sidecar import mark_stopping, read_sidecar, remove_sidecar

if TYPE_CHECKING:
    # ipyparallel ships no type information (no py.typed, no stubs): mypy reads its classes as
    # Any, and the names say which object is meant
    import ipyparallel as ipp

    from ._ring import RingCluster

__all__ = ["release", "kill", "stopped_by", "root_pids", "cluster_files"]

log = logging.getLogger(__name__)


def release(rc: RingCluster, stop_processes: bool) -> None:
    """Let go of the cluster: its processes (``stop_processes``), client, files, watchdog,
    shared memory and rank rows; ``running`` is False after it."""
    shm = rc._shm | shm_files(rc._local_rank_pids())
    # what must be gone after a stop, taken now (psutil checks create times: no recycled pid)
    procs = rc.processes() if stop_processes and rc.ipp_cluster is not None else []
    if stop_processes and rc.ipp_cluster is not None:  # the panel shows a stop, not a fault
        mark_stopping(rc.ipp_cluster.profile_dir, rc.ipp_cluster.cluster_id)
    cluster, rc.ipp_cluster = rc.ipp_cluster, None
    client, rc.client = rc.client, None
    rc.view = None
    if client is not None:
        _close_client(client, cluster, stop_processes, rc.size)
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
        end_sync_thread(cluster)  # in a kernel, ipyparallel's loop thread for this Cluster
    rc._stop_watchdog()
    remove_shm_files(shm)
    rc.ranks, rc.engine_ids, rc.size, rc.steps, rc._shm = [], [], 0, {}, set()
    rc.torch_repair.forget()
    rc.torch_backend = None
    rc.plan_used, rc.rendezvous, rc.restarts, rc.replace_failed = None, None, 0, False
    rc.replaced = {}


def _close_client(client: ipp.Client, cluster: ipp.Cluster | None, stop_processes: bool, size: int) -> None:
    """Close the client; first, with ``stop_processes``, ask the engines to shut down and give
    their jobs' mpiexec a moment to leave."""
    try:
        if stop_processes:
            # engines that shut down on request exit cleanly (runtime atexit, exit code 0)
            client.shutdown(targets="all", hub=False, block=False)
            # the engine sets' mpiexec leaves once its last rank has; at 8-16 ranks on
            # 2 cores that takes longer than 1.5 s, and ipyparallel's own stop of a
            # launcher still there then cost 5 s more (%ring stop: 6.6 s at 8 and 16)
            wait_exit(root_pids(cluster)[1:], 1.5 + 0.25 * size)
    except Exception:
        log.debug("asking the engines to shut down failed", exc_info=True)
    try:
        client.close()
    except Exception:  # a closed or broken client must not stop the shutdown
        log.debug("closing the client failed", exc_info=True)


def kill(rc: RingCluster) -> None:
    """SIGKILL every process of the cluster now (used at interpreter exit)."""
    procs = rc.processes()
    shm = rc._shm | shm_files([p.pid for p in procs])
    kill_processes(procs)
    rc._stop_watchdog()
    remove_shm_files(shm)
    remove_files(cluster_files(rc.ipp_cluster))


def stopped_by(rc: RingCluster) -> str | None:
    """Who stopped this cluster from outside the kernel (``"the Ring panel"``), or None while
    it is this kernel's to stop. Stopped from outside: its cluster file is gone and its
    controller has exited (a rank that died leaves both: that is a dead rank)."""
    cluster = rc.ipp_cluster
    if cluster is None or os.path.exists(cluster.cluster_file):
        return None
    if live_process(getattr(cluster.controller, "pid", None)) is not None:
        return None
    side = read_sidecar(cluster.profile_dir, cluster.cluster_id)
    return (side.get("stopped_by") if side else None) or "a process outside this kernel"


def root_pids(cluster: ipp.Cluster | None) -> list[int]:
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


def cluster_files(cluster: ipp.Cluster | None) -> list[str]:
    """Glob patterns of the files of an ipyparallel Cluster (``_procs.cluster_file_patterns``)."""
    if cluster is None:
        return []
    return cluster_file_patterns(cluster.profile_dir, cluster.cluster_id)
