"""Kills a cluster's processes when the notebook kernel that started them dies.

ipyparallel starts the controller and mpiexec in their own sessions, so when the kernel is killed
(SIGKILL, OOM killer) they are re-parented to init and live on with every engine and nanny. This
small process, started by :class:`jupyter_ring.cluster.RingCluster` in a session of its own,
polls its parent pid; when the parent is gone it SIGKILLs every process tree listed in its pid
file, then removes the shared-memory files (``/dev/shm``) those processes had mapped: MPI's own
segments, which MPICH unlinks only in ``MPI_Finalize`` (2 MB per cluster was left for every
killed kernel). It exits on its own when every listed process has exited (a normal ``%ring stop``).

The pid file is JSON: ``{"pids": [...], "shm": [...]}`` (the files the ranks had mapped when the
kernel last looked).

Usage (internal): ``python -m jupyter_ring._watchdog PARENT_PID PID_FILE``
"""

import json
import os
import signal
import stat
import sys
import time

import psutil

__all__ = ["main", "shm_files", "remove_shm_files"]

SHM_DIR = "/dev/shm"

POLL_S = 0.05         # how often the parent is checked: the kill happens within ~POLL_S
REFRESH_S = 1.0       # how often the process trees are re-read


def _read_roots(path, cache):
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
            cache["mtime"] = mtime
        except (OSError, ValueError, KeyError):
            pass  # half-written: the writer renames atomically, so retry on the next poll
    return cache.get("pids", [])


def shm_files(pids):
    """The files in /dev/shm that the processes ``pids`` have mapped and that still have a name.

    Read from /proc/<pid>/maps (readable for our own processes only); a file already unlinked
    shows as "(deleted)" there and is left out.
    """
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.split(None, 5)
                    if len(parts) < 6:
                        continue
                    path = parts[5].rstrip("\n")
                    if os.path.dirname(path) == SHM_DIR and not path.endswith(" (deleted)"):
                        found.add(path)
        except OSError:
            continue
    return found


def remove_shm_files(paths):
    """Unlink ``paths``: regular files of /dev/shm owned by this user. Returns those removed.

    Called for a cluster being stopped or killed. Unlinking only removes the name: a rank still
    exiting keeps its mapping until it is gone, and no process opens these files by name after
    MPI_Init, so nothing waits here for the ranks to exit.
    """
    removed = []
    uid = os.getuid()
    for path in sorted(paths):
        if os.path.dirname(path) != SHM_DIR:
            continue
        try:
            info = os.lstat(path)
            if info.st_uid == uid and stat.S_ISREG(info.st_mode):
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def _trees(pids, known):
    """Processes for ``pids`` and all their descendants, merged into ``known`` (pid -> Process)."""
    for pid in pids:
        if pid not in known:
            try:
                known[pid] = psutil.Process(pid)
            except psutil.Error:
                continue
        try:
            for child in known[pid].children(recursive=True):
                known.setdefault(child.pid, child)
        except psutil.Error:
            pass
    return known


def _kill(procs):
    for proc in procs:
        try:
            # psutil checks the create time, so a recycled pid is never signalled.
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parent, path = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the kernel's terminal is not for us
    cache, known = {}, {}
    last_refresh = 0.0
    seen_any = False
    while True:
        roots = _read_roots(path, cache)
        now = time.monotonic()
        if now - last_refresh >= REFRESH_S:
            known = {pid: p for pid, p in _trees(roots, known).items() if p.is_running()}
            last_refresh = now
            seen_any = seen_any or bool(known)
            if seen_any and not known:
                return 0  # the cluster stopped normally
        if os.getppid() != parent or not psutil.pid_exists(parent):
            # Parent gone: take the trees as they are now (the roots outlive the kernel), plus what
            # we saw before, and kill them all at once so no survivor restarts anything.
            procs = _trees(roots, known)
            files = shm_files(procs) | set(cache.get("shm", []))  # mapped: read before the kill
            _kill(procs.values())
            # a second look for anything forked while the first kill went out (an mpiexec proxy
            # starting an engine): their parents are dead by now, so nothing forks after this
            time.sleep(POLL_S)
            _kill(_trees(roots, known).values())
            remove_shm_files(files)
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
