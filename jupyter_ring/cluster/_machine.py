"""What a launch plan reads from the machine it starts on, in one object a test can replace.

:class:`Machine` answers every question :func:`jupyter_ring.cluster.plan_launch` asks of the
world (environment, cores, the driver's GPUs, Slurm, which MPI, the controller's address, the
IPython profile). Each answer is probed at most once per Machine. A test subclasses it with fixed
answers and reads the plan without starting anything.
"""

import functools
import os
import socket
import subprocess
from collections.abc import Mapping, Sequence

from ..errors import ClusterError
from ..launch import find_mpiexec, local_mpiexec
from ._sizing import cpu_count, nvidia_gpu_count

__all__ = ["Machine", "routable_address", "profile_location", "ensure_profile", "profile_dir",
           "slurm_allocation_nodes", "slurm_partition_nodes", "mpi_flavour"]


class Machine:
    """This machine, as the plan sees it (``environ``: the kernel's environment by default)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)

    @functools.cached_property
    def cpus(self) -> int:
        """Cores this process may run on."""
        return cpu_count()

    @functools.cached_property
    def driver_gpus(self) -> int:
        """GPUs the NVIDIA driver reports (used when CUDA_VISIBLE_DEVICES is not set)."""
        return nvidia_gpu_count()

    @functools.cached_property
    def pid(self) -> int:
        """The process that plans (the kernel): names its files."""
        return os.getpid()

    @functools.cached_property
    def mpiexec(self) -> str:
        """The environment's ``mpiexec`` (Hydra for MPICH): multi-host jobs and Slurm."""
        return find_mpiexec()

    @functools.cached_property
    def local_mpiexec(self) -> str:
        """The one-host launcher: MPICH's gforker where there is one (see ``launch``)."""
        return local_mpiexec()

    @functools.cached_property
    def mpi_flavour(self) -> str:
        """``"openmpi"`` or ``"mpich"`` (also for unknown MPIs: Hydra's options)."""
        return mpi_flavour(self.mpiexec)

    @functools.cached_property
    def profile_dir(self) -> str:
        """The IPython profile the cluster's files go to (made when the cluster starts)."""
        return profile_location()

    def slurm_allocation(self) -> list[str]:
        """Node names of the Slurm allocation this kernel runs in ([] outside one or on one node)."""
        return slurm_allocation_nodes(self.environ)

    def slurm_nodes(self, partition: str = "") -> list[str]:
        """Node names of the Slurm cluster (``sinfo``), for ``--launcher slurm``."""
        return slurm_partition_nodes(partition)

    def address_towards(self, hosts: Sequence[str]) -> str:
        """This host's address that ``hosts`` can reach (the controller listens there)."""
        return routable_address(hosts)


def profile_location() -> str:
    """Where the IPython profile is (this shell's, else ``default`` under IPYTHONDIR); nothing
    is created but IPYTHONDIR itself (IPython's rule)."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None and getattr(ip, "profile_dir", None) is not None:
            location: str = ip.profile_dir.location  # a traitlets Instance: Any to mypy
            return location
    except ImportError:
        pass
    from IPython.paths import get_ipython_dir

    return os.path.join(get_ipython_dir(), "profile_default")


def ensure_profile(path: str) -> str:
    """Create the profile at ``path`` if needed, with owner-only folders for the cluster's files."""
    from IPython.core.profiledir import ProfileDir

    ProfileDir.create_profile_dir(path)
    # ipyparallel writes connection and cluster files to security/, logs to log/, pid files to
    # pid/: owner-only folders (IPython makes log/ and pid/ 0755), so nobody else can list them.
    for sub in ("security", "log", "pid"):
        sub_path = os.path.join(path, sub)
        os.makedirs(sub_path, mode=0o700, exist_ok=True)
        if os.stat(sub_path).st_mode & 0o077:
            os.chmod(sub_path, 0o700)
    return path


def profile_dir() -> str:
    """The IPython profile dir (under IPYTHONDIR), created if needed: the cluster's files go there."""
    return ensure_profile(profile_location())


def _node_names(cmd: Sequence[str], fallback: str = "") -> list[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        out = fallback
    return list(dict.fromkeys(out.split()))


def slurm_allocation_nodes(environ: Mapping[str, str]) -> list[str]:
    """Node names of the Slurm allocation described by ``environ`` ([] outside one or on one node)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not environ.get("SLURM_JOB_ID") or not nodelist:
        return []
    nodes = _node_names(["scontrol", "show", "hostnames", nodelist], fallback=nodelist)
    return nodes if len(nodes) > 1 else []


def slurm_partition_nodes(partition: str = "") -> list[str]:
    """Node names ``sinfo`` lists (of ``partition``, or of every partition)."""
    return _node_names(["sinfo", "-h", "-N", "-o", "%N"] + (["-p", partition] if partition else []))


def mpi_flavour(mpiexec: str) -> str:
    """``"openmpi"`` when ``mpiexec --version`` says Open MPI, else ``"mpich"``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return "openmpi" if "Open MPI" in out or "OpenRTE" in out else "mpich"


def routable_address(hosts: Sequence[str]) -> str:
    """This host's address on the route to the first of ``hosts`` that is not this host.

    A UDP "connect" sends nothing; it asks the kernel which local address it would use.
    Falls back to the address of this host's name, and raises ClusterError when that is
    loopback too (the other hosts could not connect; set RingCluster.controller_ip / --ip).
    """
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
            local: str = probe.getsockname()[0]  # (host, port) for AF_INET
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
