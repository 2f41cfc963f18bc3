"""Process trees and clean-up, with psutil: the one implementation the cluster, its watchdog and
the Ring panel's server share.

A cluster is a few root processes (the controller, mpiexec or the batch job's launcher, the
ranks on this host) and everything they started (Hydra proxies, engines, nannies). Killing goes
through ``psutil.Process`` objects, which check the process's create time: a pid the system
has recycled for an unrelated process is never signalled. MPICH's shared-memory segments
(named files in ``/dev/shm``, unlinked only by ``MPI_Finalize``) are cleaned up here too, and
:class:`Watchdog` starts the process that does all this when the kernel is killed (``_watchdog``).
"""

import glob
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import TypedDict

import psutil

__all__ = ["SHM_DIR", "live_process", "process_trees", "kill_processes", "wait_exit",
           "shm_files", "remove_shm_files", "sweep_mpich_segments", "cluster_file_patterns", "remove_files", "Watchdog", "PidFile"]

SHM_DIR = "/dev/shm"


def live_process(pid: object) -> psutil.Process | None:
    """A ``psutil.Process`` for ``pid`` if it runs (not a zombie) and we may see it, else None."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def process_trees(pids: Iterable[int], known: dict[int, psutil.Process] | None = None
                  ) -> dict[int, psutil.Process]:
    """The processes ``pids`` and all their descendants as ``{pid: Process}``, merged into
    ``known`` (processes seen before, whose children may have been re-parented since)."""
    found = {} if known is None else known
    for pid in pids:
        if pid not in found:
            try:
                found[pid] = psutil.Process(pid)
            except psutil.Error:
                continue
        try:
            for child in found[pid].children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.Error:
            pass
    return found


def kill_processes(procs: Iterable[psutil.Process]) -> None:
    """SIGKILL each of ``procs`` (Process objects); those already gone are skipped."""
    for proc in procs:
        try:
            proc.kill()  # psutil checks the create time: a recycled pid is never signalled
        except psutil.Error:
            pass


def wait_exit(procs: Iterable[psutil.Process | int], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds in all for ``procs`` (Processes or pids) to exit; returns
    the ones still alive."""
    objs = []
    for proc in procs:
        if not isinstance(proc, psutil.Process):
            try:
                proc = psutil.Process(proc)
            except psutil.Error:
                continue
        objs.append(proc)
    alive: list[psutil.Process]
    _, alive = psutil.wait_procs(objs, timeout=timeout)
    return alive


def shm_files(pids: Iterable[int]) -> set[str]:
    """The files in /dev/shm that the processes ``pids`` have mapped and that still have a name.

    Read from /proc/<pid>/maps (readable for our own processes only); a file already unlinked
    shows as "(deleted)" there and is left out.
    """
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if SHM_DIR not in line:  # most lines: skip the split
                        continue
                    parts = line.split(None, 5)
                    if len(parts) < 6:
                        continue
                    path = parts[5].rstrip("\n")
                    if os.path.dirname(path) == SHM_DIR and not path.endswith(" (deleted)"):
                        found.add(path)
        except OSError:
            continue
    return found


def remove_shm_files(paths: Iterable[str]) -> list[str]:
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


# MPICH's segments of a job: "mpich_shm_<FNV hash of the job's PMI kvsname, hex>_<node id>" and
# the per-VCI "mpich_vci_..." of the same job
_MPICH_SEGMENT = re.compile(r"mpich_(shm|vci)_[0-9a-f]+_\d+")


def sweep_mpich_segments(min_age: float = 5.0) -> list[str]:
    """Unlink this user's MPICH segments in /dev/shm that no process has mapped; their paths.

    MPICH names a job's segment after its PMI kvsname, which gforker and Hydra make from
    mpiexec's pid, and only ``MPI_Finalize`` unlinks it: the ranks of a job that was killed
    (a test's SIGKILL, an OOM kill, a killed kernel's engines whose cluster no kernel cleaned up)
    leave theirs. Pids wrap (at 32,768 by default), and a later job whose mpiexec gets that pid
    opens the stale segment as its own: ``MPI_Init`` fails ("Out of memory" in
    ``MPIDI_POSIX_comm_bootstrap``, exit code 15) or a rank crashes as it starts. Called before
    a job is launched. A segment written in the last ``min_age`` seconds is left alone: a job
    starting now creates its own (which sets its mtime), then maps it, in between.
    """
    uid, now = os.getuid(), time.time()
    stale = set()
    try:
        names = [n for n in os.listdir(SHM_DIR) if _MPICH_SEGMENT.fullmatch(n)]
    except OSError:
        return []
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_uid == uid and stat.S_ISREG(info.st_mode) and now - info.st_mtime >= min_age:
            stale.add(path)
    if not stale:
        return []
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return remove_shm_files(stale - shm_files(pids))


def cluster_file_patterns(profile_dir: str, cluster_id: str, sidecar: bool = True) -> list[str]:
    """Glob patterns of every file a cluster leaves in its profile: ipyparallel's cluster file,
    the controller's connection files, the processes' logs, the ranks' ``%ring where`` and debugger
    files (``_where.where_dir``), and (``sidecar``) the Ring panel's sidecar (``_sidecar.sidecar_path``)."""
    cid = glob.escape(cluster_id)
    security = os.path.join(glob.escape(profile_dir), "security")
    patterns = [os.path.join(security, f"cluster-{cid}.json"),
                os.path.join(security, f"ipcontroller-{cid}-*.json"),
                os.path.join(glob.escape(profile_dir), "log", f"*{cid}*"),
                # the ranks' files, then their folders of recent cells' sources (emptied first),
                # then the where folder itself, each emptied by the lines above it
                os.path.join(security, f"jupyter_ring-{cid}-where", "*.cells", "*"),
                os.path.join(security, f"jupyter_ring-{cid}-where", "*"),
                os.path.join(security, f"jupyter_ring-{cid}-where")]
    if sidecar:
        patterns.append(os.path.join(security, f"jupyter_ring-{cid}.json"))
    return patterns


def remove_files(patterns: Iterable[str]) -> list[str]:
    """Remove the files matching the glob ``patterns`` (a cluster's files once its processes are
    gone: no reader may find a cluster file whose processes are dead). Returns those removed."""
    removed = []
    for pattern in patterns:
        for path in glob.glob(pattern):
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)  # only an emptied folder of the cluster's (its where folder)
                else:
                    os.remove(path)
                removed.append(path)
            except OSError:
                pass
    return removed


# ----------------------------------------------------------------- the watchdog, kernel side
class PidFile(TypedDict):
    """The watchdog's pid file, written by :meth:`Watchdog.watch`."""

    pids: list[int]   # roots of the cluster's process trees
    shm: list[str]    # /dev/shm files the ranks had mapped
    files: list[str]  # glob patterns of the cluster's files (cluster, connection, sidecar, logs)


class Watchdog:
    """The kernel's side: starts the watchdog process and keeps its pid file current."""

    def __init__(self, folder: str) -> None:
        self.folder = folder      # owner-only: the profile's security dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.path: str | None = None

    def start(self) -> None:
        """Start the process, watching nothing yet."""
        fd, self.path = tempfile.mkstemp(prefix="jupyter_ring_watch_", suffix=".json",
                                         dir=self.folder)
        with os.fdopen(fd, "w") as f:
            json.dump(PidFile(pids=[], shm=[], files=[]), f)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_ring.cluster._watchdog", str(os.getpid()), self.path],
            stdin=subprocess.DEVNULL, start_new_session=True)

    def watch(self, pids: Iterable[int], shm: Iterable[str] = (),
              files: Iterable[str] = ()) -> None:
        """Tell the watchdog the current root pids, shared-memory files and the cluster's file
        patterns (atomic rename: it never reads half a file)."""
        if self.path is None:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(PidFile(pids=list(pids), shm=sorted(shm), files=list(files)), f)
        os.replace(tmp, self.path)

    def stop(self) -> None:
        """Stop the process (the cluster is stopped) and remove its files."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        path, self.path = self.path, None
        if path:
            for p in (path, path + ".tmp"):
                try:
                    os.remove(p)
                except FileNotFoundError:
                    pass
