"""What the kernel knows about its cluster and ipyparallel's cluster file does not: the ranks.

The notebook kernel that starts a cluster may write ``jupyter_ring-<cluster_id>.json`` next to
ipyparallel's ``cluster-<cluster_id>.json`` (in ``<profile>/security/``). The Ring panel reads it
for the per-rank device and for the owner kernel; without it, the panel finds the ranks in the
process table (host and pid, device unknown on GPU hosts) and the owner as the controller's parent.

Format (one JSON object)::

    {"version": 1, "cluster_id": "1795400639-v1wr", "kernel_pid": 4242,
     "connection_file": "/.../kernel-<id>.json",
     "ranks": [{"rank": 0, "host": "vm", "pid": 9130, "device": "cpu",
                "step": 120, "total": 500, "replaced": 0}, ...],
     "restarts": 1, "max_restarts": 3}

``replaced``: how many times the rank was replaced in place (``RingCluster.respawn``: a new
engine, a fresh namespace); ``restarts``/``max_restarts``: the replacements used of
``--max-restarts``, absent when the cluster does not replace ranks (``--max-restarts 0``).

``step``/``total``: the rank's last ``ring.progress()`` as the kernel's dashboard saw it (rewritten
at most once a second while a cell reports, and when it ends); null before any report.

When the Ring panel stops a cluster whose kernel still runs, the server leaves the sidecar with
``"stopped_by": "the Ring panel"`` (:func:`mark_stopped`) and removes everything else: the kernel
reads it to say who stopped its cluster, then removes it (its watchdog does, if the kernel dies
first).

The format is :class:`Sidecar` (its rows :class:`SidecarRank`). This module imports nothing
from Jupyter or ipyparallel, so the kernel and the server use it cheaply.
"""

import json
import os
import sys
from collections.abc import Iterable
from typing import TypedDict, cast

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # Python 3.10 (requires-python): typing_extensions comes with IPython there
    from typing_extensions import NotRequired

__all__ = ["Sidecar", "SidecarRank", "SidecarRow", "RankProgress", "VERSION", "sidecar_path",
           "write_sidecar", "read_sidecar", "remove_sidecar", "mark_stopped", "mark_stopping"]

VERSION = 1


class SidecarRank(TypedDict):
    """One rank of the sidecar: where it runs and its last reported step."""

    rank: int
    host: str
    pid: int
    device: str
    step: int | float | None    # the rank's last ring.progress() step the dashboard saw
    total: int | float | None
    replaced: NotRequired[int]  # times replaced in place (absent: 0, a sidecar of before)


class RankProgress(TypedDict, total=False):
    """A rank's last ``ring.progress()`` as the dashboard saw it (``RingCluster.record_steps``)."""

    step: int | float | None
    total: int | float | None


class SidecarRow(TypedDict):
    """A row :func:`write_sidecar` records: the start row's (``RankRow``) rank, host, pid and
    device, with the rank's progress once the dashboard has seen one."""

    rank: int
    host: str
    pid: int
    device: str
    step: NotRequired[int | float | None]
    total: NotRequired[int | float | None]
    replaced: NotRequired[int]


class Sidecar(TypedDict):
    """The sidecar file's JSON object."""

    version: int
    cluster_id: str
    kernel_pid: int
    connection_file: str | None
    ranks: list[SidecarRank]
    restarts: NotRequired[int]      # ranks replaced in place so far (absent: respawn is off)
    max_restarts: NotRequired[int]  # --max-restarts
    stopped_by: NotRequired[str]  # who stopped the cluster from outside the kernel
    stopping: NotRequired[bool]   # its kernel is stopping it (%ring stop): the ranks going is no fault


def sidecar_path(profile_dir: str, cluster_id: str) -> str:
    """The sidecar file of cluster ``cluster_id`` in ``profile_dir``."""
    return os.path.join(profile_dir, "security", f"jupyter_ring-{cluster_id}.json")


def write_sidecar(profile_dir: str, cluster_id: str, ranks: Iterable[SidecarRow],
                  kernel_pid: int | None = None, connection_file: str | None = None,
                  restarts: tuple[int, int] | None = None) -> str:
    """Record ``ranks`` (rows with rank, host, pid, device) and the owner kernel; owner-only file.
    ``restarts``: (used, ``--max-restarts``) where the cluster replaces dead ranks in place.

    Called in the kernel after the ranks are up (``RingCluster`` does, at the end of its start,
    and removes it on stop).
    """
    if kernel_pid is None:
        kernel_pid = os.getpid()
    if connection_file is None:
        connection_file = _connection_file()
    data = Sidecar(version=VERSION, cluster_id=cluster_id, kernel_pid=int(kernel_pid),
                   connection_file=connection_file,
                   ranks=[SidecarRank(rank=row.get("rank"), host=row.get("host"),
                                      pid=row.get("pid"), device=row.get("device"),
                                      step=row.get("step"), total=row.get("total"),
                                      replaced=row.get("replaced", 0))
                          for row in ranks])
    if restarts is not None:
        data["restarts"], data["max_restarts"] = restarts
    return _write(profile_dir, cluster_id, data)


def mark_stopped(profile_dir: str, cluster_id: str, by: str) -> bool:
    """Note in the sidecar that ``by`` stopped the cluster (the kernel reads it, then removes
    it). False when there is no sidecar to mark."""
    return _mark(profile_dir, cluster_id, stopped_by=by)


def mark_stopping(profile_dir: str, cluster_id: str) -> bool:
    """Note in the sidecar that the kernel is stopping its cluster, so that the Ring panel shows
    the ranks going as a stop, not as a fault ("degraded · 0/2 ranks" after a clean %ring stop).
    False when there is no sidecar to mark."""
    return _mark(profile_dir, cluster_id, stopping=True)


def _mark(profile_dir: str, cluster_id: str, **fields: object) -> bool:
    """Add ``fields`` to the sidecar; False when there is none."""
    data = read_sidecar(profile_dir, cluster_id)
    if data is None:
        return False
    data.update(fields)  # type: ignore[typeddict-item]  # the callers pass Sidecar's own keys
    _write(profile_dir, cluster_id, data)
    return True


def _write(profile_dir: str, cluster_id: str, data: Sidecar) -> str:
    path = sidecar_path(profile_dir, cluster_id)
    tmp = path + ".tmp"
    # 0o600: the connection-file path and pids are nobody else's business on a shared host.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # readers never see half a file
    return path


def read_sidecar(profile_dir: str, cluster_id: str) -> Sidecar | None:
    """The sidecar's dict, or None when there is none or it is unreadable."""
    try:
        with open(sidecar_path(profile_dir, cluster_id)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("cluster_id") != cluster_id:
        return None
    return cast(Sidecar, data)  # this cluster's JSON object, in write_sidecar's format


def remove_sidecar(profile_dir: str, cluster_id: str) -> None:
    """Delete the sidecar (missing is fine)."""
    try:
        os.remove(sidecar_path(profile_dir, cluster_id))
    except FileNotFoundError:
        pass


def _connection_file() -> str | None:
    try:
        from ipykernel.connect import get_connection_file

        return get_connection_file()
    except Exception:  # not in a kernel: no connection file to record
        return None
