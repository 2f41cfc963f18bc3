"""An MPI job of ipyparallel engines with the ring runtime initialised on every rank.

:class:`RingCluster` wraps ``ipyparallel.Cluster(engines="mpi")``: it finds the environment's
``mpiexec``, binds one GPU per rank through ``CUDA_VISIBLE_DEVICES``, runs
``import jupyter_ring.runtime as ring; ring.init()`` on every engine, and starts a watchdog so
that nothing outlives the kernel. The ``%ring`` magic is a thin layer over this class::

    from jupyter_ring.cluster import RingCluster

    cluster = RingCluster(n=2)
    cluster.start()
    cluster.view.execute("print(ring.rank())", block=True)
    cluster.stop()

This module never imports torch, tensorflow or cupy: the engines do, after their GPU is bound.
"""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile

from traitlets import Bool, Enum, Float, Integer, List, Unicode
from traitlets.config import Config, LoggingConfigurable

from ._launch import find_mpiexec, local_mpiexec, mpi_env
from ._sidecar import remove_sidecar, write_sidecar
from ._watchdog import remove_shm_files, shm_files

__all__ = ["RingCluster", "ClusterError", "DeadRankError", "visible_gpus", "default_size",
           "threads_per_rank", "share_note", "parse_ranks", "host_slots", "routable_address"]

log = logging.getLogger(__name__)


class _GoneLogFilter(logging.Filter):
    """Drop ipyparallel's "Failed to remove <engine log>: ... No such file" at stop.

    Its launcher checks that the output file exists, then removes it; when the file is gone in
    between (seen once on the teaching hub at ``%ring stop``), it logs an error that reaches the
    notebook as stderr although nothing failed: the file it wanted gone is gone.
    """

    def filter(self, record):
        msg = record.getMessage()
        return not (msg.startswith("Failed to remove ") and "No such file or directory" in msg)


logging.getLogger(__name__ + ".ipyparallel").addFilter(_GoneLogFilter())

GiB = 1 << 30

# Run first on every engine, in the user namespace: bind the GPU before any framework import,
# then start the runtime so that ``ring`` is there in every cell.
_SETUP_CODE = """\
import os as _jr_os
_jr_os.umask(_jr_umask)
import jupyter_ring._engine as _jr_engine
_jr_device = _jr_engine.bind_device(_jr_gpus)
import jupyter_ring.runtime as ring
ring.init()
_jr_engine.watch_cells()
_jr_info = _jr_engine.describe(ring, _jr_device)
del _jr_engine, _jr_device, _jr_gpus, _jr_os, _jr_umask
"""


class ClusterError(RuntimeError):
    """The cluster could not start, or is not in a state to do what was asked."""


class DeadRankError(ClusterError):
    """One or more ranks' engines have died; ``%ring restart`` brings the cluster back."""

    def __init__(self, message, ranks):
        super().__init__(message)
        self.ranks = ranks

    def _render_traceback_(self):
        return [f"DeadRankError: {self}"]


# ---------------------------------------------------------------------------- sizing and devices
def _nvidia_gpu_count():
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


def visible_gpus(spec="auto", environ=None):
    """GPU ids (strings) the ranks may use: ``"auto"``, ``"none"`` or a list like ``"0,2"``.

    ``auto`` respects the kernel's ``CUDA_VISIBLE_DEVICES`` (CUDA's rule: the list ends at the
    first invalid entry such as ``-1``), else counts the driver's GPUs.
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
    return [str(i) for i in range(_nvidia_gpu_count())]


def _cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_size(gpus, environ=None):
    """One rank per GPU; else min(cores, JupyterHub's CPU_LIMIT, MEM_LIMIT / 2 GiB), at least 1."""
    if gpus:
        return len(gpus)
    environ = os.environ if environ is None else environ
    limits = [_cpu_count()]
    for var, unit in (("CPU_LIMIT", 1), ("MEM_LIMIT", 2 * GiB)):
        raw = environ.get(var, "").strip()
        if raw:
            try:
                limits.append(int(float(raw) // unit))
            except ValueError:
                log.warning("ignoring %s=%r: not a number", var, raw)
    return max(1, min(limits))


# the thread pools of numpy's BLAS, torch and TensorFlow read these when they start
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "TF_NUM_INTRAOP_THREADS")


def _cpu_share(environ):
    """Cores this process may use: the affinity mask, lowered by JupyterHub's CPU_LIMIT."""
    cores = _cpu_count()
    try:
        limit = float(environ.get("CPU_LIMIT", "").strip() or cores)
    except ValueError:
        limit = cores
    return max(1.0, min(float(cores), limit))


def threads_per_rank(n, environ=None):
    """Threads each of ``n`` ranks on this host may use: its CPU share (cores, CPU_LIMIT) / n, >= 1.

    Without this every rank's OpenMP/MKL/torch pool takes every core: n ranks on c cores run
    n * c threads, and on a shared hub one student's ranks slow everyone's.
    """
    environ = os.environ if environ is None else environ
    return max(1, int(_cpu_share(environ) // n))


def share_note(n, gpus, environ=None):
    """What to tell a user who asks (``-n``) for more ranks than their share; "" when within it."""
    environ = os.environ if environ is None else environ
    fair = default_size(gpus, environ)
    if n <= fair:
        return ""
    if gpus:
        return (f"-n {n} is more than the {len(gpus)} visible GPU(s) ({','.join(gpus)}): ranks will "
                f"share GPUs. %ring start without -n starts one rank per GPU.")
    limits = [f"{_cpu_count()} cores"]
    for var in ("CPU_LIMIT", "MEM_LIMIT"):
        raw = environ.get(var, "").strip()
        if raw:
            try:
                limits.append(f"{var}={float(raw) / GiB:.1f} GiB" if var == "MEM_LIMIT" else
                              f"{var}={float(raw):g}")
            except ValueError:
                limits.append(f"{var}={raw}")
    threads = threads_per_rank(n, environ)
    return (f"-n {n} is more than this server's share ({', '.join(limits)}: {fair} "
            f"rank{'s' if fair > 1 else ''}); starting {n} anyway with {threads} "
            f"thread{'s' if threads > 1 else ''} each, so they share that CPU and memory. "
            f"%ring start without -n starts the fair size; OMP_NUM_THREADS set in the kernel "
            f"overrides the threads; a larger share comes from the hub's admin "
            f"(c.Spawner.cpu_limit / mem_limit).")


def parse_ranks(text, size):
    """``"0,2-3"`` -> ``[0, 2, 3]``; ValueError naming the bad part and the valid range."""
    ranks = []
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


# ---------------------------------------------------------------------------------- the cluster
class RingCluster(LoggingConfigurable):
    """ipyparallel MPI engines, one per rank, with GPUs bound and ``ring`` initialised."""

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

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ipp_cluster = None
        self.client = None
        self.view = None
        self.ranks = []          # rows of the start table, index = rank
        self.engine_ids = []     # ipyparallel engine id of each rank
        self.steps = {}          # rank -> {"step", "total"}: the last progress the dashboard saw
        self.size = 0
        self._watchdog = None
        self._pid_file = None
        self._shm = set()        # /dev/shm files the local ranks mapped (MPI's segments)
        self._user_umask = 0o022  # the kernel's umask, read (and put back) by start()
        self.note = ""           # share_note() of the last start: more ranks than the share
        self.address = ""        # the address the controller listens on (multi-host: routable)

    # ----------------------------------------------------------------------------- lifecycle
    @property
    def running(self):
        return self.ipp_cluster is not None

    def start(self):
        """Start controller and engines, bind devices, ``ring.init()``; return the rank rows."""
        # Owner-only from creation: every file and folder written while the cluster starts
        # (connection and cluster files, logs, pid files) is created 0600/0700 by this process
        # or by the controller, mpiexec and engines, which inherit this umask (ipyparallel's own
        # chmod after writing would leave a window). The ranks get the user's umask back in
        # _SETUP_CODE, so files that cells write keep their usual modes. umask is per process:
        # another thread of this kernel creating a file meanwhile gets 0600 too (never looser).
        self._user_umask = os.umask(0o077)
        try:
            return self._start()
        finally:
            os.umask(self._user_umask)

    def _start(self):
        if self.running:
            raise ClusterError("a cluster is already running; %ring restart replaces it")
        import ipyparallel as ipp

        gpus = visible_gpus(self.gpus)
        detected_gpu = bool(gpus) or self.gpus != "auto"
        # inside salloc/sbatch on several nodes, Hydra's mpiexec reads the allocation itself
        allocation = (self.launcher == "mpi" and not self.hosts and not self.hostfile
                      and _slurm_nodes(os.environ))
        one_host = (not self.hosts and not self.hostfile and self.launcher == "mpi"
                    and not allocation)
        if self.launcher == "slurm" or allocation:
            slots = [(h, None) for h in allocation or _slurm_nodes(None, self.partition)]
        else:
            slots = None if one_host else host_slots(self.hosts, self.hostfile)
        if self.n is not None:
            n = self.n
        elif allocation and os.environ.get("SLURM_NTASKS", "").isdigit():
            n = int(os.environ["SLURM_NTASKS"])
        elif self.launcher == "slurm" and self.nodes:
            n = self.nodes * (self.ntasks_per_node or 1)
        elif slots and all(k for _, k in slots):
            n = sum(k for _, k in slots)  # --hosts a:2,b:2 -> 4 ranks
        elif slots:
            n = len(slots)  # one rank per host named without a count
        else:
            n = default_size(gpus)
        if n < 1:
            raise ValueError(f"-n {n}: a cluster needs at least 1 rank")
        env = mpi_env(one_host=one_host)
        self.note = share_note(n, gpus) if self.n is not None and one_host else ""
        if one_host:  # the kernel's own OMP_NUM_THREADS etc. win (mpi_env copies os.environ)
            threads = str(threads_per_rank(n))
            for var in THREAD_VARS:
                env.setdefault(var, threads)
        for item in self.engine_env:
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"engine_env entry {item!r} is not NAME=VALUE")
            env[name] = value

        # ipyparallel logs to the kernel app's log (shown in the notebook); keep only its errors.
        ipp_log = logging.getLogger(__name__ + ".ipyparallel")
        if ipp_log.level == logging.NOTSET:
            ipp_log.setLevel(logging.ERROR)
        kwargs = dict(n=n, delay=0, log=ipp_log, profile_dir=_profile_dir(),
                      controller_args=[
                          f"--HeartMonitor.period={self.heartbeat_period}",
                          "--HeartMonitor.max_heartmonitor_misses="
                          f"{max(3, round(self.heartbeat_tolerance * 1000 / self.heartbeat_period))}",
                          f"--IPController.db_class={self.controller_db}",
                          f"--IPController.enable_curve={self.encrypt}"],
                      engine_timeout=int(self.engine_timeout))
        if one_host:
            kwargs["controller_ip"] = "127.0.0.1"
            # Start the engines while the controller starts (~0.7 s sooner): they wait for its
            # connection file in the profile (same host, same filesystem) instead of being
            # handed its contents in their environment once it is up.
            kwargs["send_engines_connection_env"] = False
        else:
            # the engines on the other hosts connect here: 127.0.0.1 (ipyparallel's default)
            # makes them time out after 5 s
            kwargs["controller_ip"] = self.controller_ip or routable_address(
                [h for h, _ in slots or []])
        self.address = kwargs["controller_ip"]
        engines = "slurm" if self.launcher == "slurm" else "mpi"
        # A config of our own: the shell's config must not be changed by starting a cluster.
        config = Config()
        # one host: MPICH's gforker, whose ranks listen on loopback only (Hydra's PMI port is on
        # 0.0.0.0 and inherited by every rank); --hosts needs Hydra's remote launch.
        mpiexec = local_mpiexec() if one_host else find_mpiexec()
        config.MPIEngineSetLauncher.mpi_cmd = [mpiexec]
        # gforker says how each rank ended (the signal) only when asked; describe_death reads it
        exitinfo = ["-exitinfo"] if mpiexec.endswith("gforker") else []
        config.MPIEngineSetLauncher.mpi_args = exitinfo + self._mpi_args()
        config.EngineLauncher.environment = {k: v for k, v in env.items()
                                             if os.environ.get(k) != v}
        engine_args = []
        if not one_host:
            # An engine whose controller is unreachable (its host cut off, the kernel's host
            # gone) shuts itself down after this many missed heartbeats (ipyparallel's default,
            # 50, is ~30 s); on one host the watchdog kills everything at once instead.
            misses = round(self.heartbeat_tolerance * 1000 / (self.heartbeat_period + 500))
            engine_args.append(f"--IPEngine.max_heartbeat_misses={max(3, misses)}")
        config.MPIEngineSetLauncher.engine_args = engine_args
        if engines == "slurm":
            config.SlurmEngineSetLauncher.engine_args = ["--mpi"] + engine_args
            # ipyparallel 9.2's default script ignores the placement options (every engine
            # landed on one node): a script of our own, with Hydra's mpiexec inside the job
            config.SlurmEngineSetLauncher.batch_template = self._slurm_script()
            # the script and the job's output go to the profile's log dir (owner-only), not to
            # the kernel's working directory (ipyparallel writes the script to '.', sbatch its
            # output to slurm-<job>.out there)
            config.SlurmEngineSetLauncher.batch_file_name = os.path.join(
                kwargs["profile_dir"], "log", f"jupyter_ring-slurm-{os.getpid()}.sbatch")
        # shutdown_atexit=False: the magics stop engines before the controller (0.5 s instead of
        # ipyparallel's concurrent 3+ s), and the watchdog covers a killed kernel.
        cluster = ipp.Cluster(engines=engines, parent=None, config=config, shutdown_atexit=False,
                              **kwargs)
        self.ipp_cluster = cluster
        try:
            self._start_watchdog()
            cluster.start_controller_sync()
            self._watch(cluster)
            cluster.start_engines_sync(n)
            self._watch(cluster)
            self.client = cluster.connect_client_sync()
            self.client.wait_for_engines(n, timeout=self.engine_timeout, block=True,
                                        interactive=False)
            self._setup_ranks(gpus if detected_gpu else None)
        except BaseException:
            self.stop()
            raise
        return self.ranks

    def _slurm_script(self):
        """The engines' sbatch script: placement options, then Hydra's mpiexec (it reads the
        job's nodes from Slurm and starts its proxies with srun)."""
        lines = ["#!/bin/sh", "#SBATCH --export=ALL", "#SBATCH --job-name=ipengine-{cluster_id}",
                 "#SBATCH --ntasks={n}", "#SBATCH --output={output_file}"]
        for flag, value in (("nodes", self.nodes), ("ntasks-per-node", self.ntasks_per_node),
                            ("partition", self.partition), ("time", self.time_limit)):
            if value:
                if re.search(r"[\s{}]", str(value)):
                    raise ValueError(f"--{flag} {value!r}: no spaces or braces")
                lines.append(f"#SBATCH --{flag}={value}")
        lines.append(f"{find_mpiexec()} -n {{n}} {{program_and_args}}")
        return "\n".join(lines) + "\n"

    def _mpi_args(self):
        if self.hostfile:
            return ["--hostfile" if _mpi_flavour() == "openmpi" else "-f", self.hostfile]
        if not self.hosts:
            return []
        args = ["-hosts", ",".join(self.hosts)]  # MPICH/Hydra; Open MPI takes --host
        if _mpi_flavour() == "openmpi":
            args = ["--host", ",".join(self.hosts)]
        elif self.launcher == "ssh":
            args = ["-launcher", "ssh"] + args
        return args

    def _setup_ranks(self, gpus):
        client = self.client
        ids = sorted(client.ids)
        view = client[ids]
        view.push({"_jr_gpus": gpus, "_jr_umask": self._user_umask}, block=False)
        ar = view.execute(_SETUP_CODE, block=False)
        if not ar.wait(self.setup_timeout):
            raise ClusterError(f"ring.init() did not finish on every rank in {self.setup_timeout:g} s")
        ar.get()
        infos = view.pull("_jr_info", block=True)
        order = sorted(range(len(ids)), key=lambda i: infos[i]["rank"])
        self.engine_ids = [ids[i] for i in order]
        self.ranks = [infos[i] for i in order]
        self.size = len(self.ranks)
        self.view = client[self.engine_ids]
        self.view.block = False
        # MPICH unlinks its shared-memory segments only in MPI_Finalize: note them now, while
        # the ranks are alive, so that a rank killed later leaves no file behind (stop, watchdog)
        self._shm = shm_files(self._local_rank_pids())
        self._watch(self.ipp_cluster)
        self._write_sidecar()

    def _write_sidecar(self):
        """The Ring panel reads the ranks' devices, steps and the owner kernel from it."""
        try:
            write_sidecar(self.ipp_cluster.profile_dir, self.ipp_cluster.cluster_id,
                          [dict(row, **self.steps.get(row["rank"], {})) for row in self.ranks])
        except OSError as exc:
            log.warning("could not write the Ring panel's sidecar file: %s", exc)

    def record_steps(self, steps):
        """Note each rank's ``{"step": s, "total": t}`` (from the dashboard) for the Ring panel."""
        if self.running and steps and steps != self.steps:
            self.steps = dict(steps)
            self._write_sidecar()

    def stop(self):
        """Stop engines, then the controller (in this order it takes ~0.5 s), then the watchdog.

        Shared-memory files that the ranks had mapped and that are still there at the end (ranks
        that died never ran MPI_Finalize, which unlinks them) are removed.
        """
        shm = self._shm | shm_files(self._local_rank_pids())
        cluster, self.ipp_cluster = self.ipp_cluster, None
        client, self.client = self.client, None
        self.view = None
        if client is not None:
            try:
                # engines that shut down on request exit cleanly (runtime atexit, exit code 0)
                client.shutdown(targets="all", hub=False, block=False)
                _wait_exit(self._root_pids(cluster)[1:], 1.5)  # the engine sets' mpiexec
            except Exception:
                log.debug("asking the engines to shut down failed", exc_info=True)
            try:
                client.close()
            except Exception:  # a closed or broken client must not stop the shutdown
                log.debug("closing the client failed", exc_info=True)
        if cluster is not None:
            try:
                cluster.stop_engines_sync()
            except Exception:
                log.warning("stopping the engines failed", exc_info=True)
            try:
                cluster.stop_controller_sync()
            except Exception:
                log.warning("stopping the controller failed", exc_info=True)
        if cluster is not None:
            remove_sidecar(cluster.profile_dir, cluster.cluster_id)
        self._stop_watchdog()
        remove_shm_files(shm)
        self.ranks, self.engine_ids, self.size, self.steps, self._shm = [], [], 0, {}, set()

    def kill(self):
        """SIGKILL every process of the cluster now (used at interpreter exit)."""
        import psutil

        procs = self._processes()
        shm = self._shm | shm_files([p.pid for p in procs])
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        self._stop_watchdog()
        remove_shm_files(shm)

    # ------------------------------------------------------------------------------- status
    def processes(self):
        """psutil.Process objects of the controller, mpiexec and every engine (and nanny)."""
        return self._processes()

    def _root_pids(self, cluster):
        pids = []
        if cluster is None:
            return pids
        launchers = [cluster.controller] + list(cluster.engines.values())
        for launcher in launchers:
            pid = getattr(launcher, "pid", -1) if launcher is not None else -1
            if pid and pid > 0:
                pids.append(pid)
        return pids

    def _local_rank_pids(self):
        """Pids of the ranks on this host: a rank's pid on another host is no process here (and
        must never be signalled here: it may be an unrelated process of this host)."""
        import socket

        me = socket.gethostname()
        return [row["pid"] for row in self.ranks if row["host"] == me]

    def _processes(self):
        import psutil

        found = {}
        for pid in self._root_pids(self.ipp_cluster) + self._local_rank_pids():
            try:
                proc = psutil.Process(pid)
                found.setdefault(proc.pid, proc)
                for child in proc.children(recursive=True):
                    found.setdefault(child.pid, child)
            except psutil.Error:
                pass
        return list(found.values())

    def dead_ranks(self):
        """Ranks whose engine has unregistered from the controller (died or was killed)."""
        if self.client is None:
            return []
        if any(es.state == "after" for es in self.ipp_cluster.engines.values()):
            return list(range(self.size))  # mpiexec has exited: every rank is gone
        alive = set(self.client.ids)
        return [rank for rank, eid in enumerate(self.engine_ids) if eid not in alive]

    def check_alive(self, ranks=None):
        """Raise DeadRankError naming the dead ranks and the fix; else return quietly."""
        if not self.running:
            raise ClusterError("no cluster is running; start one with %ring start")
        dead = self.dead_ranks()
        if ranks is not None:
            dead = [r for r in dead if r in ranks] or dead
        if dead:
            raise DeadRankError(self.describe_death(dead), dead)

    def describe_death(self, dead):
        """A message for dead ranks: which died first and how (nanny log, mpiexec report), the fix."""
        first = None
        output = ""
        try:
            for engine_set in self.ipp_cluster.engines.values():
                output += _read(getattr(engine_set, "output_file", ""))
        except Exception:
            output = ""
        # The nanny of the engine that died first logs it first; mpiexec's own report names
        # whichever rank it cleaned up, so it is used only for how the job ended.
        eid_rank = {eid: rank for rank, eid in enumerate(self.engine_ids)}
        hosts = {row["rank"]: row["host"] for row in self.ranks}
        nanny = re.search(r"\[KernelNanny\.(\d+)\] Pipe closed, parent (\d+)", output)
        exit_string = re.search(r"EXIT STRING: (.+)", output)
        if nanny and int(nanny.group(1)) in eid_rank:
            rank = eid_rank[int(nanny.group(1))]
            # gforker -exitinfo: "[0]<rank>:Return code = 0, signaled with Killed"
            gforker = re.search(rf"\]{rank}:Return code = \d+, signaled with (\w+)", output)
            how = (exit_string.group(1).strip() if exit_string
                   else f"signal: {gforker.group(1)}" if gforker else "engine process exited")
            first = (rank, hosts.get(rank, "?"), how)
        ranks = ", ".join(str(r) for r in dead)
        if first is not None:
            rank, host, how = first
            head = f"rank {rank} @ {host} died ({how})"
            others = [r for r in dead if r != rank]
            if others:
                head += f"; MPI then ended rank(s) {', '.join(map(str, others))}"
        else:
            where = {}
            for r in dead:
                where.setdefault(hosts.get(r, "?"), []).append(str(r))
            head = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)} @ {host}"
                             for host, rs in where.items())
            head += (" stopped answering (died, or the host is down or cut off from this one)"
                     if len(set(hosts.values())) > 1 else " died")
        return (f"{head}. Their variables are lost; run %ring restart for a fresh cluster "
                f"with the same arguments.")

    # ----------------------------------------------------------------------------- signals
    def signal_ranks(self, sig, ranks=None):
        """Send ``sig`` to the ranks' engines (all by default) through their ipyparallel nannies.

        Not through mpiexec (``Cluster.signal_engines``): MPICH's mpiexec forwards the first
        SIGINT but aborts the whole job on the second, which would kill every rank's state.
        """
        if not self.running:
            return
        alive = set(self.client.ids)
        ranks = range(self.size) if ranks is None else ranks
        targets = [self.engine_ids[r] for r in ranks if self.engine_ids[r] in alive]
        if targets:
            self.client.send_signal(sig, targets=targets, block=False)

    # ---------------------------------------------------------------------------- watchdog
    def _start_watchdog(self):
        if not self.watchdog:
            return
        fd, self._pid_file = tempfile.mkstemp(prefix="jupyter_ring_watch_", suffix=".json",
                                              dir=os.path.join(_profile_dir(), "security"))
        with os.fdopen(fd, "w") as f:
            json.dump({"pids": [], "shm": []}, f)
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "jupyter_ring._watchdog", str(os.getpid()), self._pid_file],
            stdin=subprocess.DEVNULL, start_new_session=True)

    def _watch(self, cluster):
        """Tell the watchdog the current root pids (atomic rename: it never reads half a file)."""
        if self._pid_file is None:
            return
        pids = self._root_pids(cluster) + self._local_rank_pids()
        tmp = self._pid_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"pids": pids, "shm": sorted(self._shm)}, f)
        os.replace(tmp, self._pid_file)

    def _stop_watchdog(self):
        proc, self._watchdog = self._watchdog, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        path, self._pid_file = self._pid_file, None
        if path:
            for p in (path, path + ".tmp"):
                try:
                    os.remove(p)
                except FileNotFoundError:
                    pass


def _profile_dir():
    """The IPython profile dir (under IPYTHONDIR): cluster and connection files go there."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None and getattr(ip, "profile_dir", None) is not None:
            path = ip.profile_dir.location
        else:
            raise LookupError
    except (ImportError, LookupError):
        from IPython.core.profiledir import ProfileDir
        from IPython.paths import get_ipython_dir

        path = ProfileDir.create_profile_dir_by_name(get_ipython_dir(), "default").location
    # ipyparallel writes connection and cluster files to security/, logs to log/, pid files to
    # pid/: owner-only folders (IPython makes log/ and pid/ 0755), so nobody else can list them.
    for sub in ("security", "log", "pid"):
        sub_path = os.path.join(path, sub)
        os.makedirs(sub_path, mode=0o700, exist_ok=True)
        if os.stat(sub_path).st_mode & 0o077:
            os.chmod(sub_path, 0o700)
    return path


def host_slots(hosts, hostfile=""):
    """``[(host, K or None), ...]`` from ``--hosts a:2,b`` or a Hydra hostfile (``host[:K]`` lines).

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
        slots.append((match.group(1), int(match.group(2)) if match.group(2) else None))
    return slots


def _slurm_nodes(environ, partition=""):
    """Node names of this Slurm allocation (``environ``: [] outside one or on one node), or of
    the cluster (``environ=None``: ``sinfo``, for ``--launcher slurm``)."""
    if environ is not None:
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not environ.get("SLURM_JOB_ID") or not nodelist:
            return []
        cmd = ["scontrol", "show", "hostnames", nodelist]
    else:
        cmd = ["sinfo", "-h", "-N", "-o", "%N"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        out = environ.get("SLURM_JOB_NODELIST", "") if environ is not None else ""
    nodes = list(dict.fromkeys(out.split()))
    return nodes if environ is None or len(nodes) > 1 else []


def routable_address(hosts):
    """This host's address on the route to the first of ``hosts`` that is not this host.

    A UDP "connect" sends nothing; it asks the kernel which local address it would use.
    Falls back to the address of this host's name, and raises ClusterError when that is
    loopback too (the other hosts could not connect; set RingCluster.controller_ip / --ip).
    """
    import socket

    for host in hosts:
        try:
            remote = socket.gethostbyname(host)
        except OSError:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((remote, 9))
            except OSError:
                continue
            local = probe.getsockname()[0]
        if not local.startswith("127."):
            return local
    try:
        local = socket.gethostbyname(socket.gethostname())
    except OSError:
        local = "127.0.0.1"
    if local.startswith("127."):
        raise ClusterError(f"no address of this host reaches {', '.join(hosts) or 'the hosts'} "
                           f"(only loopback found); give the controller's address with --ip ADDR")
    return local


def _wait_exit(pids, timeout):
    """Wait up to ``timeout`` seconds in all for these processes to exit."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def _mpi_flavour():
    try:
        out = subprocess.run([find_mpiexec(), "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return "openmpi" if "Open MPI" in out or "OpenRTE" in out else "mpich"


def _read(path):
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _format_table(rows):
    """The compact rank table printed by ``%ring start`` and ``%ring status``."""
    header = ("rank", "host", "pid", "device")
    lines = [header] + [(str(r["rank"]), r["host"], str(r["pid"]), r["device"]) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in lines)

