"""The launch plan: what ``%ring start`` will run, as plain data, before anything starts.

:func:`plan_launch` reads the options (a :class:`RingCluster`'s traits, or any object with the
same attribute names) and the machine (:class:`Machine`) and returns a :class:`LaunchPlan`:
how many ranks, where, with which GPUs, the engines' environment, and every argument handed to
ipyparallel. Nothing is started; a test reads the plan of a Slurm or multi-host start on a
laptop by giving its own Machine. ``_launchers.start_plan`` carries a plan out.

The engines' environment is built in one place, :data:`ENVIRONMENT_LAYERS`: each layer adds its
variables over the kernel's own environment, in order. A new kind of variable (a framework's
world description, say) is a new layer there, and nothing else changes.

torchrun's per-rank environment (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_PORT`` ...)
depends on where each rank landed (Hydra and Slurm place them) and on the port rank 0 reserved,
so it is not one of those layers: the plan decides what it can (:class:`TorchWorld`), and
:func:`torchrun_environment` computes each rank's variables, purely, from the plan's world, the
hosts the ranks report and rank 0's port, once they run (``RingCluster`` applies them).
"""

import math
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ..launch import mpi_env
from ._machine import Machine
from ._sizing import (CROWDED_START_S, THREAD_VARS, HostSlot, default_size, host_slots,
                      ranks_beyond_cores, share_note, threads_per_rank, visible_gpus)

__all__ = ["LaunchPlan", "LaunchOptions", "SlurmJob", "Shape", "TorchWorld", "plan_launch",
           "EnvironmentLayer", "engine_environment", "torchrun_environment", "ENVIRONMENT_LAYERS",
           "SLURM_LAUNCHER"]

# The engine launcher of ``--launcher slurm`` (an import path: it is also what ipyparallel
# writes into the cluster file, and what the Ring panel's server imports to stop the job).
SLURM_LAUNCHER = "jupyter_ring.cluster._slurm.RingSlurmEngineSetLauncher"


class LaunchOptions(Protocol):
    """What :func:`plan_launch` reads of its options: :class:`RingCluster`'s traits of these names
    (read-only here, so any object with such attributes will do)."""

    @property
    def n(self) -> int | None: ...
    @property
    def gpus(self) -> str: ...
    @property
    def launcher(self) -> str: ...
    @property
    def hosts(self) -> Sequence[str]: ...
    @property
    def hostfile(self) -> str: ...
    @property
    def nodes(self) -> int | None: ...
    @property
    def ntasks_per_node(self) -> int | None: ...
    @property
    def partition(self) -> str: ...
    @property
    def time_limit(self) -> str: ...
    @property
    def controller_ip(self) -> str: ...
    @property
    def heartbeat_period(self) -> int: ...
    @property
    def heartbeat_tolerance(self) -> float: ...
    @property
    def controller_db(self) -> str: ...
    @property
    def encrypt(self) -> bool: ...
    @property
    def engine_timeout(self) -> float: ...
    @property
    def engine_env(self) -> Sequence[str]: ...
    @property
    def torch_distributed(self) -> bool: ...
    @property
    def max_restarts(self) -> int: ...


class SlurmJob(NamedTuple):
    """The engines' batch job of ``--launcher slurm`` (sbatch options; None/"" = Slurm's default)."""

    nodes: int | None
    ntasks_per_node: int | None
    partition: str
    time_limit: str
    batch_file: str   # the sbatch script: in the profile's owner-only log dir, not the cwd


class TorchWorld(NamedTuple):
    """torch.distributed's world as far as the plan can decide it (see :func:`torchrun_environment`)."""

    master_addr: str            # 127.0.0.1 on one host; "" across hosts: rank 0's address on the
                                # route to the other ranks' hosts, found by rank 0 at start
    init_backend: str | None    # "auto" with --torch-distributed (gloo; NCCL where every rank has
                                # a GPU): the default process group is made at start; else None


class Shape(NamedTuple):
    """Where the ranks run, as the environment layers see it."""

    n: int
    one_host: bool
    slots: tuple[HostSlot, ...]
    controller_ip: str


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a start needs, decided before anything starts (see :func:`plan_launch`)."""

    n: int                          # ranks
    one_host: bool                  # every rank here, every socket on loopback
    slots: tuple[HostSlot, ...]     # the hosts of a multi-host job (() on one host)
    gpus: tuple[str, ...] | None    # GPU ids the ranks share out by local rank; None: no GPU
                                    # detected, CUDA_VISIBLE_DEVICES left alone
    note: str                       # share_note() for an -n beyond the fair share
    profile_dir: str
    controller_ip: str
    controller_args: tuple[str, ...]
    engine_launcher: str            # ipyparallel's "mpi", or SLURM_LAUNCHER
    mpiexec: str
    mpi_args: tuple[str, ...]
    engine_args: tuple[str, ...]
    # the engines' environment: only the variables whose value differs from the kernel's
    environment: dict[str, str] = field(default_factory=dict)
    # one host: engines start with the controller and read its connection file from the
    # profile (~0.7 s sooner) instead of getting it in their environment once it is up
    send_engines_connection_env: bool = True
    engine_timeout: float = 60.0    # the option's, plus start_allowance
    # the ranks beyond this host's cores (one host; 0 where the ranks' hosts are not this one),
    # and the seconds that adds to the engine and set-up timeouts (CROWDED_START_S each)
    crowded: float = 0.0
    start_allowance: float = 0.0
    slurm: SlurmJob | None = None
    torch: TorchWorld = TorchWorld("127.0.0.1", None)
    # each rank runs under engines._keeper, so that a dead rank can be replaced in place (one
    # host, gforker, --max-restarts above 0): gforker would end every rank of the job
    keeper: bool = False


def plan_launch(options: LaunchOptions, machine: Machine | None = None) -> LaunchPlan:
    """The :class:`LaunchPlan` for ``options`` (RingCluster traits) on ``machine``.

    Raises ValueError for options that cannot work (bad hosts, no rank, a malformed
    ``engine_env`` entry or Slurm option), before anything starts.
    """
    machine = Machine() if machine is None else machine
    environ = machine.environ
    asks_driver = options.gpus == "auto" and "CUDA_VISIBLE_DEVICES" not in environ
    gpus = visible_gpus(options.gpus, environ, machine.driver_gpus if asks_driver else 0)
    launcher = options.launcher
    shape = _shape(options, machine, gpus)
    n, one_host, controller_ip = shape.n, shape.one_host, shape.controller_ip
    # one host: MPICH's gforker, whose ranks listen on loopback only (Hydra's PMI port is on
    # 0.0.0.0 and inherited by every rank); --hosts needs Hydra's remote launch.
    mpiexec = machine.local_mpiexec if one_host else machine.mpiexec
    # gforker says how each rank ended (the signal) only when asked; death diagnosis reads it
    exitinfo = ("-exitinfo",) if mpiexec.endswith("gforker") else ()
    engine_args: tuple[str, ...] = ()
    if not one_host:
        # An engine whose controller is unreachable (its host cut off, the kernel's host gone)
        # shuts itself down after this many missed heartbeats (ipyparallel's default, 50, is
        # ~30 s); on one host the watchdog kills everything at once instead.
        misses = round(options.heartbeat_tolerance * 1000 / (options.heartbeat_period + 500))
        engine_args = (f"--IPEngine.max_heartbeat_misses={max(3, misses)}",)
    profile = machine.profile_dir
    slurm = None
    if launcher == "slurm":
        slurm = SlurmJob(options.nodes, options.ntasks_per_node, options.partition,
                         options.time_limit,
                         os.path.join(profile, "log", f"jupyter_ring-slurm-{machine.pid}.sbatch"))
        _check_slurm(slurm)
    keeper = mpiexec.endswith("gforker") and options.max_restarts > 0
    crowded = ranks_beyond_cores(n, environ, machine.cpus) if one_host else 0.0
    allowance = CROWDED_START_S * crowded
    return LaunchPlan(
        n=n, one_host=one_host, slots=shape.slots, keeper=keeper,
        gpus=tuple(gpus) if gpus or options.gpus != "auto" else None,
        note=share_note(n, gpus, environ, machine.cpus) if options.n is not None and one_host
        else "",
        profile_dir=profile, controller_ip=controller_ip,
        controller_args=_controller_args(options, options.engine_timeout + allowance),
        engine_launcher=SLURM_LAUNCHER if launcher == "slurm" else "mpi",
        mpiexec=mpiexec, mpi_args=exitinfo + _mpi_args(options, machine),
        engine_args=engine_args,
        environment=engine_environment(options, machine, shape),
        send_engines_connection_env=not one_host,
        engine_timeout=options.engine_timeout + allowance, crowded=crowded, start_allowance=allowance,
        slurm=slurm,
        torch=TorchWorld("127.0.0.1" if one_host else "",
                         "auto" if options.torch_distributed else None))


def _shape(options: LaunchOptions, machine: Machine, gpus: Sequence[str]) -> Shape:
    """Where the ranks run: this host alone, the hosts given, or a Slurm allocation; how many;
    and the address the controller listens on."""
    launcher = options.launcher
    # inside salloc/sbatch on several nodes, Hydra's mpiexec reads the allocation itself
    allocation = (machine.slurm_allocation()
                  if launcher == "mpi" and not options.hosts and not options.hostfile else [])
    one_host = (launcher == "mpi" and not options.hosts and not options.hostfile
                and not allocation)
    if launcher == "slurm" or allocation:
        slots = [HostSlot(h, None) for h in allocation or machine.slurm_nodes(options.partition)]
    else:
        slots = [] if one_host else host_slots(options.hosts, options.hostfile)
    n = _size(options, machine.environ, slots, allocation, gpus, machine.cpus)
    if n < 1:
        raise ValueError(f"-n {n}: a cluster needs at least 1 rank")
    if one_host:
        controller_ip = "127.0.0.1"
    else:
        # the engines on the other hosts connect here: 127.0.0.1 (ipyparallel's default)
        # makes them time out after 5 s
        controller_ip = options.controller_ip or machine.address_towards([h for h, _ in slots])
    return Shape(n, one_host, tuple(slots), controller_ip)


def _size(options: LaunchOptions, environ: Mapping[str, str], slots: Sequence[HostSlot],
          allocation: Sequence[str], gpus: Sequence[str], cpus: int) -> int:
    if options.n is not None:
        return options.n
    if allocation and environ.get("SLURM_NTASKS", "").isdigit():
        return int(environ["SLURM_NTASKS"])
    if options.launcher == "slurm" and options.nodes:
        return options.nodes * (options.ntasks_per_node or 1)
    if slots and all(k for _, k in slots):
        return sum(k for _, k in slots if k)  # --hosts a:2,b:2 -> 4 ranks
    if slots:
        return len(slots)  # one rank per host named without a count
    return default_size(gpus, environ, cpus)


def _controller_args(options: LaunchOptions, engine_timeout: float) -> tuple[str, ...]:
    # the controller declares an engine dead after heartbeat_tolerance seconds of missed beats
    misses = max(3, round(options.heartbeat_tolerance * 1000 / options.heartbeat_period))
    # An engine's heart starts beating only once it has started its nanny and its kernel after
    # the controller accepted it; a registration whose first beat takes longer than this is
    # dropped, the engine running on unseen (ipyparallel's 30 s: 64 ranks on 2 cores under load
    # were all dropped). As long as the kernel waits for the engines, at least 30 s.
    registration = max(30, math.ceil(engine_timeout))
    return (f"--HeartMonitor.period={options.heartbeat_period}",
            f"--HeartMonitor.max_heartmonitor_misses={misses}",
            f"--IPController.registration_timeout={registration}",
            f"--IPController.db_class={options.controller_db}",
            f"--IPController.enable_curve={options.encrypt}",
            # its warnings are noise here: one "unhandled iopub msg_type: 'data_message'" per
            # dashboard publication (ipyparallel's hub knows no datapub), 150 lines a cell
            "--log-level=ERROR")


def _mpi_args(options: LaunchOptions, machine: Machine) -> tuple[str, ...]:
    if options.hostfile:
        return ("--hostfile" if machine.mpi_flavour == "openmpi" else "-f", options.hostfile)
    if not options.hosts:
        return ()
    if machine.mpi_flavour == "openmpi":
        return ("--host", ",".join(options.hosts))
    args = ("-hosts", ",".join(options.hosts))  # MPICH/Hydra
    return ("-launcher", "ssh") + args if options.launcher == "ssh" else args


def _check_slurm(job: SlurmJob) -> None:
    for flag, value in (("nodes", job.nodes), ("ntasks-per-node", job.ntasks_per_node),
                        ("partition", job.partition), ("time", job.time_limit)):
        # one #SBATCH line each, and the script is a str.format template: no spaces or braces
        if value and any(c.isspace() or c in "{}" for c in str(value)):
            raise ValueError(f"--{flag} {value!r}: no spaces or braces")


# ------------------------------------------------------------------ the engines' environment
def _mpi_layer(env: MutableMapping[str, str], options: LaunchOptions, machine: Machine,
               shape: Shape) -> None:
    """Loopback-only UCX on one host, Open MPI's root and oversubscription flags (kernel wins)."""
    env.update(mpi_env(env, one_host=shape.one_host))


def _thread_layer(env: MutableMapping[str, str], options: LaunchOptions, machine: Machine,
                  shape: Shape) -> None:
    """One host: each rank's share of the cores as its thread pools' size (kernel wins)."""
    if shape.one_host:
        threads = str(threads_per_rank(shape.n, machine.environ, machine.cpus))
        for var in THREAD_VARS:
            env.setdefault(var, threads)


def _respawn_layer(env: MutableMapping[str, str], options: LaunchOptions, machine: Machine,
                   shape: Shape) -> None:
    """Ranks that may be replaced (see ``LaunchPlan.keeper``): MPI_Finalize waits for no peer
    (the PMI barrier of MPICH's finalize would wait for a rank that died)."""
    if shape.one_host and options.max_restarts > 0 and machine.local_mpiexec.endswith("gforker"):
        env["MPIR_CVAR_NO_COLLECTIVE_FINALIZE"] = "1"


def _crash_layer(env: MutableMapping[str, str], options: LaunchOptions, machine: Machine,
                 shape: Shape) -> None:
    """A rank that crashes in native code (a segfault in an extension, an abort inside MPI)
    writes every thread's Python stack to the engines' output, which the start's and the death
    report's messages end with (kernel wins)."""
    env.setdefault("PYTHONFAULTHANDLER", "1")


def _user_layer(env: MutableMapping[str, str], options: LaunchOptions, machine: Machine,
                shape: Shape) -> None:
    """``RingCluster.engine_env``: the user's NAME=VALUE entries, over everything else."""
    for item in options.engine_env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"engine_env entry {item!r} is not NAME=VALUE")
        env[name] = value


# A layer: layer(env, options, machine, shape) adds its variables to env.
EnvironmentLayer = Callable[[MutableMapping[str, str], LaunchOptions, Machine, Shape], None]

# Applied in order over a copy of the kernel's environment; each layer says whether the kernel's
# own value wins (setdefault) or its value does. Signature: layer(env, options, machine, shape).
ENVIRONMENT_LAYERS: tuple[EnvironmentLayer, ...] = (_mpi_layer, _thread_layer, _respawn_layer,
                                                     _crash_layer, _user_layer)


def engine_environment(options: LaunchOptions, machine: Machine, shape: Shape) -> dict[str, str]:
    """The engines' environment as the variables that differ from the kernel's."""
    env = dict(machine.environ)
    for layer in ENVIRONMENT_LAYERS:
        layer(env, options, machine, shape)
    return {k: v for k, v in env.items() if machine.environ.get(k) != v}


# ------------------------------------------------------------------ torchrun's world
def torchrun_environment(rank: int, hosts: Sequence[str], master_addr: str, master_port: int,
                         run_id: str) -> dict[str, str]:
    """torchrun's environment for ``rank``, where ``hosts[r]`` is the host rank r runs on.

    Nodes are numbered in the order of their first rank (GROUP_RANK); LOCAL_RANK counts the
    ranks of one host in rank order. RANK is the ring's rank whatever the placement (one world:
    the runtime's rank numbers are torch.distributed's). ``master_addr``/``master_port``: where
    rank 0 serves the rendezvous store; ``run_id`` names the run (the ipyparallel cluster id).
    """
    size = len(hosts)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not one of the {size} ranks placed on {hosts}")
    nodes = list(dict.fromkeys(hosts))
    me = hosts[rank]
    local = [r for r in range(size) if hosts[r] == me]
    return {
        "RANK": str(rank), "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(local.index(rank)), "LOCAL_WORLD_SIZE": str(len(local)),
        "GROUP_RANK": str(nodes.index(me)), "GROUP_WORLD_SIZE": str(len(nodes)),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(size), "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }
