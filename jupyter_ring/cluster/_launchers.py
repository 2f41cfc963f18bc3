"""A :class:`LaunchPlan` carried out with ipyparallel's ``Cluster`` and launchers.

:func:`ipp_cluster` turns a plan into an ``ipyparallel.Cluster`` (not started: the caller starts
the controller, then the engines, and watches them). Launcher specifics stay in launcher
classes, as in ipyparallel: ``--launcher slurm`` is :mod:`._slurm`'s launcher class. Imports
ipyparallel only when a cluster is made.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ._machine import ensure_profile

if TYPE_CHECKING:
    # ipyparallel ships no type information (no py.typed, no stubs): mypy reads its classes as
    # Any, and the names here say which object is meant
    import ipyparallel as ipp

    from ._plan import LaunchPlan

__all__ = ["ipp_cluster", "ipp_log", "atomic_cluster_class", "curve_client"]


class _GoneLogFilter(logging.Filter):
    """Drop ipyparallel's "Failed to remove <engine log>: ... No such file" at stop.

    Its launcher checks that the output file exists, then removes it; when the file is gone in
    between (seen once on the teaching hub at ``%ring stop``), it logs an error that reaches the
    notebook as stderr although nothing failed: the file it wanted gone is gone.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Failed to remove ") and "No such file or directory" in msg)


logging.getLogger("jupyter_ring.cluster.ipyparallel").addFilter(_GoneLogFilter())


def ipp_log(name: str = "jupyter_ring.cluster.ipyparallel") -> logging.Logger:
    """The logger to hand an ``ipyparallel.Cluster``: its errors only, less the gone-log one.

    ipyparallel logs to the running application's log otherwise (the notebook's stderr in a
    kernel, the terminal of ``jupyter lab`` in the server), and at a stop whose controller
    exited by SIGTERM (every stop) it logs the controller's whole output as a warning.
    """
    log = logging.getLogger(name)
    if log.level == logging.NOTSET:
        log.setLevel(logging.ERROR)
    if not any(isinstance(f, _GoneLogFilter) for f in log.filters):
        log.addFilter(_GoneLogFilter())
    return log


def ipp_cluster(plan: LaunchPlan, log: logging.Logger | None = None) -> ipp.Cluster:
    """An ``ipyparallel.Cluster`` configured by ``plan`` (nothing started yet)."""
    import ipyparallel as ipp
    from traitlets.config import Config

    if log is None:
        log = ipp_log()
    ensure_profile(plan.profile_dir)
    # A config of our own: the shell's config must not be changed by starting a cluster.
    config = Config()
    config.MPIEngineSetLauncher.mpi_cmd = [plan.mpiexec]
    config.MPIEngineSetLauncher.mpi_args = list(plan.mpi_args)
    config.MPIEngineSetLauncher.engine_args = list(plan.engine_args)
    if plan.keeper:  # each rank under its keeper (engines._keeper), as gforker's process
        config.MPIEngineSetLauncher.engine_cmd = [sys.executable, "-m", "jupyter_ring.engines._keeper",
                                                  sys.executable, "-m", "ipyparallel.engine"]
    config.EngineLauncher.environment = dict(plan.environment)
    if plan.slurm is not None:
        job = plan.slurm
        section = config.RingSlurmEngineSetLauncher
        section.engine_args = ["--mpi", *plan.engine_args]
        section.mpiexec = plan.mpiexec
        section.nodes = job.nodes
        section.ntasks_per_node = job.ntasks_per_node
        section.partition = job.partition
        section.time_limit = job.time_limit
        # ipyparallel writes the script to '.', sbatch its output to slurm-<job>.out there:
        # both go to the profile's owner-only log dir instead of the notebook's folder
        section.batch_file_name = job.batch_file
    # shutdown_atexit=False: RingCluster.stop stops engines before the controller (0.5 s
    # instead of ipyparallel's concurrent 3+ s), and the watchdog covers a killed kernel.
    return atomic_cluster_class()(engines=plan.engine_launcher, parent=None, config=config,
                       shutdown_atexit=False, log=log, n=plan.n, delay=0,
                       profile_dir=plan.profile_dir, controller_ip=plan.controller_ip,
                       controller_args=list(plan.controller_args),
                       engine_timeout=int(plan.engine_timeout),
                       send_engines_connection_env=plan.send_engines_connection_env)


def __getattr__(name: str) -> type[ipp.Cluster]:
    # the cluster file names its class, "jupyter_ring.cluster._launchers.AtomicCluster", and
    # readers import it by that name; made on first use, as this module imports no ipyparallel
    if name == "AtomicCluster":
        return atomic_cluster_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def atomic_cluster_class() -> type[ipp.Cluster]:
    """``ipyparallel.Cluster`` whose cluster file is replaced atomically.

    ipyparallel rewrites ``cluster-<id>.json`` in place (open "w", then dump) at every start and
    stop step: a reader in between (the Jupyter server's ipyparallel extension, the Ring panel)
    finds an empty file and logs "Failed to load cluster ...: Expecting value", and a kernel
    killed in between leaves that empty file behind for good. A rename never shows half a file.
    """
    import ipyparallel as ipp

    class AtomicCluster(ipp.Cluster):  # type: ignore[misc]  # ipyparallel: no types, so Any
        @classmethod
        def from_dict(cls, d: dict[str, object], **kwargs: object) -> ipp.Cluster:
            # ipyparallel's server extension loads every cluster file it finds (by the class
            # named in it: this one) and, when a process it did not start ends, logs its whole
            # output as a warning (an exit code it cannot know counts as a failure): 150 lines
            # of a healthy controller or engines in the terminal of `jupyter lab`. Errors only.
            kwargs.setdefault("log", ipp_log())
            return super().from_dict(d, **kwargs)

        def write_cluster_file(self) -> None:
            os.makedirs(os.path.dirname(self.cluster_file), exist_ok=True)
            tmp = f"{self.cluster_file}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.to_dict(), f)
            os.replace(tmp, self.cluster_file)

    return AtomicCluster


class _NoSigningWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Message signing is disabled" not in record.getMessage()


@contextlib.contextmanager
def curve_client() -> Iterator[None]:
    """While an ipyparallel Client of a CurveZMQ cluster is made: drop jupyter_client's
    "Message signing is disabled" warning, which is wrong there (ipyparallel leaves the HMAC key
    empty because CurveZMQ encrypts and authenticates every message) and lands in the notebook
    server's log, or on the terminal of a kernel run by nbclient (the demo's first lines)."""
    from traitlets.log import get_logger

    logger = get_logger()   # the running application's log (the kernel's), else traitlets'
    if isinstance(logger, logging.LoggerAdapter):  # traitlets allows one as Application.log
        logger = logger.logger  # an adapter has no filters of its own: its logger holds them
    quiet = _NoSigningWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)

