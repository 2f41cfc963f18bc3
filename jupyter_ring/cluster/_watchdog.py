"""Kills a cluster's processes when the notebook kernel that started them dies.

ipyparallel starts the controller and mpiexec in their own sessions, so when the kernel is killed
(SIGKILL, OOM killer) they are re-parented to init and live on with every engine and nanny. The
watchdog, a small process started by :class:`RingCluster` in a session of its own, polls its
parent pid; when the parent is gone it SIGKILLs every process tree listed in its pid file, then
removes the shared-memory files (``/dev/shm``) those processes had mapped: MPI's own segments,
which MPICH unlinks only in ``MPI_Finalize`` (2 MB per cluster was left for every killed
kernel), and the cluster's files (its cluster file, connection files, the Ring panel's sidecar,
ipyparallel's logs) and its own pid file: a killed kernel leaves no process and no file. It
lives as long as the kernel, or until the kernel stops it (``%ring stop``); a cluster stopped
from outside (the Ring panel's Stop) leaves it watching nothing but the files, which the kernel
removes when it notices, or the watchdog when the kernel dies first.

The pid file is JSON: ``{"pids": [...], "shm": [...], "files": [...]}`` (the files the ranks had
mapped when the kernel last looked, and glob patterns of the cluster's files: ``_procs.PidFile``). ``_procs.Watchdog`` is the kernel's handle on the
process; this module is only ever run, never imported by the package.

Usage (internal): ``python -m jupyter_ring.cluster._watchdog PARENT_PID PID_FILE``
"""

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TypedDict

import psutil

from ._procs import kill_processes, process_trees, remove_files, remove_shm_files, shm_files

__all__ = ["main"]

POLL_S = 0.05         # how often the parent is checked: the kill happens within ~POLL_S
REFRESH_S = 1.0       # how often the process trees are re-read


class _Cache(TypedDict, total=False):
    """What :func:`_read_roots` last read of the pid file (``_procs.PidFile``), and its mtime."""

    pids: list[int]
    shm: list[str]
    files: list[str]
    mtime: int


def _read_roots(path: str, cache: _Cache) -> list[int]:
    """The pids in ``path``, re-read only when the file changed (``cache["shm"]``: its files)."""
    try:
        mtime = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return cache.get("pids", [])
    if cache.get("mtime") != mtime:
        try:
            with open(path) as f:
                data = json.load(f)
            cache["pids"] = [int(p) for p in data["pids"]]
            cache["shm"] = [str(p) for p in data["shm"]]
            cache["files"] = [str(p) for p in data.get("files", [])]
            cache["mtime"] = mtime
        except (OSError, ValueError, KeyError):
            pass  # half-written: the writer renames atomically, so retry on the next poll
    return cache.get("pids", [])


def main(argv: Sequence[str] | None = None) -> int:
    """Watch PARENT_PID; when it is gone, kill the trees in PID_FILE and remove their shm files."""
    argv = sys.argv[1:] if argv is None else argv
    parent, path = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the kernel's terminal is not for us
    cache: _Cache = {}
    known: dict[int, psutil.Process] = {}
    last_refresh = 0.0
    while True:
        roots = _read_roots(path, cache)
        now = time.monotonic()
        if now - last_refresh >= REFRESH_S:
            known = {pid: p for pid, p in process_trees(roots, known).items() if p.is_running()}
            last_refresh = now
        if os.getppid() != parent or not psutil.pid_exists(parent):
            # Parent gone: take the trees as they are now (the roots outlive the kernel), plus what
            # we saw before, and kill them all at once so no survivor restarts anything.
            procs = process_trees(roots, known)
            files = shm_files(procs) | set(cache.get("shm", []))  # mapped: read before the kill
            kill_processes(procs.values())
            # a second look for anything forked while the first kill went out (an mpiexec proxy
            # starting an engine): their parents are dead by now, so nothing forks after this
            time.sleep(POLL_S)
            kill_processes(process_trees(roots, known).values())
            remove_shm_files(files)
            # the processes are dead: their files go too (a cluster file left behind reads as a
            # cluster to ipyparallel and the Ring panel), then the watchdog's own
            remove_files(cache.get("files", []) + [path, path + ".tmp"])
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
