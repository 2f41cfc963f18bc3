"""``--launcher slurm``: ipyparallel's Slurm engine launcher with a batch script of our own.

ipyparallel 9.2's default script ignores the placement options (every engine landed on one
node); ours writes them as ``#SBATCH`` lines and runs Hydra's ``mpiexec`` inside the job, which
reads the allocation's nodes from Slurm and starts its proxies with ``srun``. Imported only for a
Slurm cluster (by ``_launchers``, and by ipyparallel when it loads such a cluster from its file).
"""

from ipyparallel.cluster.launcher import SlurmEngineSetLauncher
from traitlets import Integer, Unicode, default

from ._plan import SLURM_LAUNCHER

__all__ = ["RingSlurmEngineSetLauncher", "slurm_batch_template"]


def slurm_batch_template(mpiexec: str, nodes: int | None = None, ntasks_per_node: int | None = None,
                         partition: str = "", time_limit: str = "") -> str:
    """The engines' sbatch script as an ipyparallel batch template (``{n}`` etc. filled in later)."""
    lines = ["#!/bin/sh", "#SBATCH --export=ALL", "#SBATCH --job-name=ipengine-{cluster_id}",
             "#SBATCH --ntasks={n}", "#SBATCH --output={output_file}"]
    for flag, value in (("nodes", nodes), ("ntasks-per-node", ntasks_per_node),
                        ("partition", partition), ("time", time_limit)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines.append(f"{mpiexec} -n {{n}} {{program_and_args}}")
    return "\n".join(lines) + "\n"


# ipyparallel ships no type information: its launcher is Any to mypy, and subclassing Any is
# what disallow_subclassing_any reports
class RingSlurmEngineSetLauncher(SlurmEngineSetLauncher):  # type: ignore[misc]
    """Engines as one Slurm job: our placement options, then Hydra's mpiexec inside the job."""

    # the name ipyparallel writes into the cluster file, so that Cluster.from_file finds us
    entrypoint_name = SLURM_LAUNCHER

    mpiexec = Unicode("mpiexec", config=True,
                      help="The mpiexec the job runs (Hydra: it reads the job's nodes).")
    nodes = Integer(None, allow_none=True, config=True, help="sbatch --nodes.")
    ntasks_per_node = Integer(None, allow_none=True, config=True, help="sbatch --ntasks-per-node.")
    partition = Unicode("", config=True, help="sbatch --partition.")
    time_limit = Unicode("", config=True, help="sbatch --time, e.g. 1:00:00.")

    @default("batch_template")
    def _batch_template_default(self) -> str:
        return slurm_batch_template(self.mpiexec, self.nodes, self.ntasks_per_node,
                                    self.partition, self.time_limit)
