"""The options of a :class:`RingCluster`: what ``%ring start``'s flags and the IPython config
(``c.RingCluster.n = 4``) set, and what :func:`plan_launch` reads (its ``LaunchOptions``).

Declarations only (traitlets traits with their help); the running cluster is ``_ring``'s.
"""

from __future__ import annotations

from traitlets import Bool, Enum, Float, Integer, List, Unicode
from traitlets.config import LoggingConfigurable

__all__ = ["RingOptions"]


class RingOptions(LoggingConfigurable):
    """The options of a ring cluster (``RingCluster`` is one): ranks, GPUs, launcher, hosts,
    timeouts, restarts."""

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
                           help="Seconds to wait for all engines to register before failing; on "
                                "one host, 3 s more for each rank beyond the cores this process "
                                "may use (their starts queue for the cores). Past it, the wait "
                                "goes on while engines still register (one at least every "
                                "min(engine_timeout, 30) s).")
    setup_timeout = Float(60.0, config=True,
                          help="Seconds to wait for ring.init() on every rank; on one host, 3 s "
                               "more for each rank beyond the cores, as engine_timeout.")
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
