"""The cluster: an MPI job of ipyparallel engines with the ring runtime initialised on every rank.

:class:`RingCluster` wraps ``ipyparallel.Cluster(engines="mpi")``: it finds the environment's
``mpiexec``, binds one GPU per rank through ``CUDA_VISIBLE_DEVICES``, runs
``import jupyter_ring.runtime as ring; ring.init()`` on every engine, and starts a watchdog so
that nothing outlives the kernel. The ``%ring`` magic is a thin layer over this class::

    from jupyter_ring.cluster import RingCluster

    with RingCluster(n=2) as cluster:
        cluster.view.execute("print(ring.rank())", block=True)

    RingCluster(n=4, hosts=["a:2", "b:2"]).plan()   # what start() would run; starts nothing

Where each part lives (one place each):

- planned: ``_plan`` (:func:`plan_launch` -> :class:`LaunchPlan`, plain data; the engines'
  environment in ``ENVIRONMENT_LAYERS``, each rank's torchrun environment in
  :func:`torchrun_environment`), from ``_sizing`` (ranks, GPUs, threads) and
  ``_machine`` (what the plan reads from the machine);
- configured: ``_options`` (``RingOptions``, the traits ``%ring start`` and the config set);
- launched: ``_launchers`` (the plan on ipyparallel's ``Cluster``), ``_slurm`` (the Slurm
  engine launcher), ``_start`` (the start: controller, engines, the wait for them to register,
  the ranks' set-up), ``_ring`` (:class:`RingCluster`, the running cluster and what it answers);
- stopped: ``_stop`` (stop, forget, kill at exit; who stopped it from outside);
- watched: ``_liveness`` (the ranks the controller lost, the message for them);
- torch.distributed groups re-created after a failed cell: ``_torch_repair``;
- interrupted: ``_signals`` (through the engines' nannies, for the kernel and the Ring panel);
- cleaned up: ``_procs`` (process trees, kill, /dev/shm), ``_watchdog`` (a killed kernel);
- diagnosed: ``_death`` (which rank died first, and how);
- repaired: ``_respawn`` (a dead rank replaced in place, the survivors keeping their variables);
- described to the Ring panel: ``_sidecar``;
- looked into (``%ring where``: every rank's stack and collective, from outside): ``_where``.

This package never imports torch, tensorflow or cupy: the engines do, after their GPU is bound.
"""

import importlib
from typing import TYPE_CHECKING

from ..errors import ClusterError, DeadRankError

if TYPE_CHECKING:  # the lazy exports below, as a type checker (and a reader) should see them
    from ._machine import Machine as Machine, routable_address as routable_address
    from ._plan import (ENVIRONMENT_LAYERS as ENVIRONMENT_LAYERS, LaunchPlan as LaunchPlan,
                        Shape as Shape, SlurmJob as SlurmJob, TorchWorld as TorchWorld,
                        plan_launch as plan_launch, torchrun_environment as torchrun_environment)
    from ._ring import RingCluster as RingCluster, format_table as format_table
    from ._signals import signal_cluster as signal_cluster, signal_engines as signal_engines
    from ._sizing import (THREAD_VARS as THREAD_VARS, HostSlot as HostSlot,
                          default_size as default_size, host_slots as host_slots,
                          parse_ranks as parse_ranks, share_note as share_note,
                          threads_per_rank as threads_per_rank, visible_gpus as visible_gpus)
    from ._launchers import atomic_cluster_class as atomic_cluster_class, ipp_log as ipp_log
    from ._respawn import elastic_note as elastic_note, replaced_note as replaced_note
    from ._procs import (cluster_file_patterns as cluster_file_patterns, kill_processes as kill_processes,
                         live_process as live_process, process_trees as process_trees,
                         remove_files as remove_files, wait_exit as wait_exit)
    from ._sidecar import (Sidecar as Sidecar, mark_stopped as mark_stopped, read_sidecar as read_sidecar,
                           remove_sidecar as remove_sidecar)
    from ._where import (RankWhere as RankWhere, collect_where as collect_where,
                         format_where as format_where, rank_ranges as rank_ranges, where_dir as where_dir,
                         where_json as where_json)

# name -> the submodule that defines it. Imported on first use: the watchdog process
# (``python -m jupyter_ring.cluster._watchdog``) and the Ring panel's listing import only the
# submodules they need, not traitlets and the rest (the watchdog starts with every cluster).
_EXPORTS = {
    "RingCluster": "_ring", "format_table": "_ring",
    "LaunchPlan": "_plan", "SlurmJob": "_plan", "Shape": "_plan", "plan_launch": "_plan",
    "ENVIRONMENT_LAYERS": "_plan", "TorchWorld": "_plan", "torchrun_environment": "_plan",
    "Machine": "_machine", "routable_address": "_machine",
    "signal_engines": "_signals", "signal_cluster": "_signals",
    "THREAD_VARS": "_sizing", "HostSlot": "_sizing", "visible_gpus": "_sizing",
    "default_size": "_sizing", "threads_per_rank": "_sizing", "share_note": "_sizing",
    "parse_ranks": "_sizing", "host_slots": "_sizing",
    "RankWhere": "_where", "collect_where": "_where", "format_where": "_where",
    "rank_ranges": "_where", "where_dir": "_where", "where_json": "_where",
    # for the Jupyter server's routes (server/_clusters.py): the cluster's files and processes
    "cluster_file_patterns": "_procs", "kill_processes": "_procs", "live_process": "_procs",
    "process_trees": "_procs", "remove_files": "_procs", "wait_exit": "_procs",
    "Sidecar": "_sidecar", "mark_stopped": "_sidecar", "read_sidecar": "_sidecar", "remove_sidecar": "_sidecar",
    "atomic_cluster_class": "_launchers", "ipp_log": "_launchers",
    "replaced_note": "_respawn", "elastic_note": "_respawn",
}

__all__ = ["ClusterError", "DeadRankError", *_EXPORTS]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
