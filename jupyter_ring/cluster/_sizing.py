"""How many ranks, which GPUs, how many threads each: pure functions of the environment.

JupyterHub's spawners put a user's share in ``CPU_LIMIT`` and ``MEM_LIMIT``; ``%ring start``
without ``-n`` starts the fair size, and every rank gets its share of the cores as threads.
The machine's facts (cores, the driver's GPUs) are arguments, probed when left out.
"""

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

__all__ = ["GiB", "THREAD_VARS", "HostSlot", "visible_gpus", "default_size", "threads_per_rank", "share_note",
           "ranks_beyond_cores", "parse_ranks", "host_slots", "cpu_count", "nvidia_gpu_count"]

log = logging.getLogger(__name__)

GiB = 1 << 30

# the thread pools of numpy's BLAS, torch and TensorFlow read these when they start
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "TF_NUM_INTRAOP_THREADS")


class HostSlot(NamedTuple):
    """A host of a multi-host job and how many ranks it runs (None: as many as mpiexec gives it)."""

    host: str
    ranks: int | None


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def nvidia_gpu_count() -> int:
    """GPUs the NVIDIA driver reports, without importing a framework (0 when there is none)."""
    try:
        return len([d for d in os.listdir("/proc/driver/nvidia/gpus") if d])
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def visible_gpus(spec: str = "auto", environ: Mapping[str, str] | None = None,
                 driver_gpus: int | None = None) -> list[str]:
    """GPU ids (strings) the ranks may use: ``"auto"``, ``"none"`` or a list like ``"0,2"``.

    ``auto`` respects the kernel's ``CUDA_VISIBLE_DEVICES`` (CUDA's rule: the list ends at the
    first invalid entry such as ``-1``), else counts the driver's GPUs (``driver_gpus``, probed
    when None).
    """
    environ = os.environ if environ is None else environ
    if spec == "none":
        return []
    if spec != "auto":
        ids = [part.strip() for part in str(spec).split(",") if part.strip()]
        if not ids:
            raise ValueError(f"--gpus {spec!r}: give auto, none or a list of GPU ids like 0,1")
        return ids
    env = environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = []
        for part in env.split(","):
            part = part.strip()
            if not part or part.startswith("-"):
                break
            ids.append(part)
        return ids
    count = nvidia_gpu_count() if driver_gpus is None else driver_gpus
    return [str(i) for i in range(count)]


def default_size(gpus: Sequence[str], environ: Mapping[str, str] | None = None,
                 cpus: int | None = None) -> int:
    """One rank per GPU; else min(cores, JupyterHub's CPU_LIMIT, MEM_LIMIT / 2 GiB), at least 1."""
    if gpus:
        return len(gpus)
    environ = os.environ if environ is None else environ
    limits = [cpu_count() if cpus is None else cpus]
    for var, unit in (("CPU_LIMIT", 1), ("MEM_LIMIT", 2 * GiB)):
        raw = environ.get(var, "").strip()
        if raw:
            try:
                limits.append(int(float(raw) // unit))
            except ValueError:
                log.warning("ignoring %s=%r: not a number", var, raw)
    return max(1, min(limits))


def _cpu_share(environ: Mapping[str, str], cpus: int) -> float:
    """Cores this process may use: the affinity mask, lowered by JupyterHub's CPU_LIMIT."""
    try:
        limit = float(environ.get("CPU_LIMIT", "").strip() or cpus)
    except ValueError:
        limit = cpus
    return max(1.0, min(float(cpus), limit))


# Seconds the engine and set-up timeouts grow for each rank beyond the cores it may use on one
# host: a rank's start (its engine, nanny and keeper: imports, registration, ring.init()) is
# about a CPU-second, and the ranks beyond the cores queue for them, so a fixed 60 s gave up on
# 64 ranks on 2 cores under load with none registered yet. Room for a host shared with others.
CROWDED_START_S = 3.0


def ranks_beyond_cores(n: int, environ: Mapping[str, str], cpus: int) -> float:
    """How many of ``n`` ranks on this host are beyond the cores this process may use (0 when
    they fit): each waits for a core, and the waits that scale with the world grow by it."""
    return max(0.0, n - _cpu_share(environ, cpus))


def threads_per_rank(n: int, environ: Mapping[str, str] | None = None,
                     cpus: int | None = None) -> int:
    """Threads each of ``n`` ranks on this host may use: its CPU share (cores, CPU_LIMIT) / n, >= 1.

    Without this every rank's OpenMP/MKL/torch pool takes every core: n ranks on c cores run
    n * c threads, and on a shared hub one student's ranks slow everyone's.
    """
    environ = os.environ if environ is None else environ
    cpus = cpu_count() if cpus is None else cpus
    return max(1, int(_cpu_share(environ, cpus) // n))


def share_note(n: int, gpus: Sequence[str], environ: Mapping[str, str] | None = None,
               cpus: int | None = None) -> str:
    """What to tell a user who asks (``-n``) for more ranks than their share; "" when within it."""
    environ = os.environ if environ is None else environ
    cpus = cpu_count() if cpus is None else cpus
    fair = default_size(gpus, environ, cpus)
    if n <= fair:
        return ""
    if gpus:
        return (f"-n {n} is more than the {len(gpus)} visible GPU(s) ({','.join(gpus)}): ranks will "
                f"share GPUs. %ring start without -n starts one rank per GPU.")
    limits = [f"{cpus} cores"]
    for var in ("CPU_LIMIT", "MEM_LIMIT"):
        raw = environ.get(var, "").strip()
        if raw:
            try:
                limits.append(f"{var}={float(raw) / GiB:.1f} GiB" if var == "MEM_LIMIT" else
                              f"{var}={float(raw):g}")
            except ValueError:
                limits.append(f"{var}={raw}")
    threads = threads_per_rank(n, environ, cpus)
    # only a JupyterHub server (the hub sets JUPYTERHUB_* in it) has an admin to ask for more
    more = ("; a larger share comes from the hub's admin (c.Spawner.cpu_limit / mem_limit)"
            if any(var.startswith("JUPYTERHUB_") for var in environ) else "")
    return (f"-n {n} is more than this server's share ({', '.join(limits)}: {fair} "
            f"rank{'s' if fair > 1 else ''}); starting {n} anyway with {threads} "
            f"thread{'s' if threads > 1 else ''} each, so they share that CPU and memory. "
            f"%ring start without -n starts the fair size; OMP_NUM_THREADS set in the kernel "
            f"overrides the threads{more}.")


def parse_ranks(text: str, size: int) -> list[int]:
    """``"0,2-3"`` -> ``[0, 2, 3]``; ValueError naming the bad part and the valid range."""
    ranks: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not match:
            raise ValueError(f"--ranks {text!r}: {part!r} is not a rank or a range a-b; "
                             f"use e.g. --ranks 0,2-3 (ranks are 0..{size - 1})")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"--ranks {text!r}: range {part!r} runs backwards; write {hi}-{lo}")
        if hi >= size:
            raise ValueError(f"--ranks {text!r}: rank {hi} does not exist; the cluster has ranks "
                             f"0..{size - 1}")
        ranks.extend(r for r in range(lo, hi + 1) if r not in ranks)
    return sorted(ranks)


def host_slots(hosts: Iterable[str], hostfile: str = "") -> list[HostSlot]:
    """``[HostSlot(host, K or None), ...]`` from ``--hosts a:2,b`` or a Hydra hostfile (``host[:K]`` lines).

    ValueError names the bad entry and the form expected.
    """
    entries, where = list(hosts), "--hosts"
    if hostfile:
        try:
            with open(hostfile) as f:
                entries = [line.split("#")[0].strip() for line in f]
        except OSError as exc:
            raise ValueError(f"--hostfile {hostfile!r}: {exc.strerror}; give a file with one "
                             f"host[:ranks] a line") from None
        entries, where = [e for e in entries if e], f"--hostfile {hostfile!r}"
        if not entries:
            raise ValueError(f"{where} names no host; write one host[:ranks] a line")
    slots = []
    for entry in entries:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?::(\d+))?", entry.strip())
        if not match or (match.group(2) is not None and int(match.group(2)) < 1):
            raise ValueError(f"{where}: {entry!r} is not host or host:ranks (ranks >= 1); "
                             f"use e.g. --hosts nodeA:2,nodeB:2")
        slots.append(HostSlot(match.group(1), int(match.group(2)) if match.group(2) else None))
    return slots
