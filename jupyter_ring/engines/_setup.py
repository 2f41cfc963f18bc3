"""The setup ``%ring start`` runs first on every rank: GPU binding, the rank's row, cell hooks.

Runs inside each ipyparallel engine, before the user's first cell (``cluster._ring._SETUP_CODE``).
It imports no framework: ``CUDA_VISIBLE_DEVICES`` must be set before torch/tensorflow/cupy first
touch CUDA.
"""

import os
import re
import socket
from typing import TypedDict

__all__ = ["RankRow", "local_rank", "bind_device", "describe", "watch_cells", "number_cells", "arm_where",
           "arm_debugger", "ascii_logs", "CELL_NUMBER"]


class RankRow(TypedDict):
    """One rank as ``%ring start`` lists it (and the cluster keeps it: ``RingCluster.ranks``)."""

    rank: int
    size: int
    local_rank: int
    host: str
    pid: int
    device: str    # "cpu" or "cuda:0 (GPU <id>)": the GPU this rank sees as cuda:0


# Launchers that export the node-local rank: MPICH/Hydra, Open MPI, Slurm, PMIx.
_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                    "PMIX_LOCAL_RANK", "PMI_LOCAL_RANK")


def local_rank():
    """This process's rank among the ranks on its host, from the launcher or from MPI."""
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    from mpi4py import MPI

    # Collective over COMM_WORLD: every engine runs this same setup code, so all ranks enter.
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def bind_device(gpus):
    """Set ``CUDA_VISIBLE_DEVICES`` to this rank's GPU; return a device label for the table.

    ``gpus`` is the list of GPU ids (strings) visible to the notebook kernel, ``[]`` to hide every
    GPU, or ``None`` to leave the environment alone (no GPU on this machine).
    """
    if gpus is None:
        return "cpu"
    if not gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return "cpu"
    gpu = gpus[local_rank() % len(gpus)]
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    return f"cuda:0 (GPU {gpu})"


def describe(ring, device):
    """This rank's row of the ``%ring start`` table."""
    return RankRow(rank=ring.rank(), size=ring.size(), local_rank=ring.local_rank(),
                   host=socket.gethostname(), pid=os.getpid(), device=device)


def watch_cells():
    """After a cell fails or is interrupted on this rank, abandon the collectives it queued.

    An interrupt can land between ``loss.backward()`` (whose hooks queue the gradients'
    allreduces) and ``optimizer.step()``; left queued, they would run at the start of the next
    cell on this rank only, and the ranks would disagree. Registered once per engine.
    """
    from IPython import get_ipython

    events = get_ipython().events
    if _after_cell not in events.callbacks["post_run_cell"]:
        events.register("post_run_cell", _after_cell)


# The last line the notebook adds to a cell it sends: the notebook's own execution count.
CELL_NUMBER = "# jupyter_ring In[{}]"
_CELL_NUMBER = re.compile(r"# jupyter_ring In\[(\d+)\]\s*")


def number_cells() -> None:
    """Number this rank's cells as the notebook does: a traceback says ``Cell In[17]``, as the
    notebook's prompt, not the engine's own count (which also counts the cluster's own requests).

    The notebook appends ``CELL_NUMBER`` as the cell's last line (a comment: the cell's other
    line numbers and its last expression stay as they are); this input transformer, run first on
    every cell of the rank, takes it off and sets the engine's count, which IPython reads right
    after the transformers to name the cell. The count may go back (the notebook's runs behind
    the engine's after ``%ring start``), so the rank keeps no history database, whose rows are
    keyed on it; nobody reads a rank's history there. Registered once per engine.
    """
    from IPython import get_ipython

    shell = get_ipython()
    shell.history_manager.enabled = False
    transformers = shell.input_transformers_cleanup
    if _take_cell_number not in transformers:
        transformers.insert(0, _take_cell_number)


def _take_cell_number(lines: list[str]) -> list[str]:
    match = _CELL_NUMBER.fullmatch(lines[-1]) if lines else None
    if match is None:
        return lines
    from IPython import get_ipython

    get_ipython().execution_count = int(match.group(1))
    return lines[:-1]


def ascii_logs():
    """Write the engine's own log lines with non-ASCII characters escaped (``\\u00e9``).

    MPICH's ``mpiexec.gforker`` stops forwarding a rank's stdout/stderr at the first non-ASCII
    byte: it closes its end of the pipe, and from then on every log line of that engine fails
    with BrokenPipeError, shown in the notebook as "--- Logging error ---" (and ``%ring stop``
    cannot read the truncated output file back). An exception's text is logged by the engine;
    gloo's ends in an emoji, so the first torch.distributed failure broke the rank's log.
    """
    import io

    from IPython import get_ipython

    log = get_ipython().kernel.log
    while log is not None:
        for handler in log.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(encoding="ascii", errors="backslashreplace")
        log = log.parent if log.propagate else None


def _after_cell(result):
    if result.error_in_exec is not None:
        from ..runtime import _api

        _api.abandon_queued("the cell that queued this collective failed or was interrupted "
                            f"on this rank ({type(result.error_in_exec).__name__})")


def arm_where(directory, rank):
    """Make this rank's stacks and collective readable by ``%ring where`` (runtime/_where.py).

    ``directory`` is the kernel's folder for the cluster; a rank on another host without that
    folder on a shared file system makes its own, which ``%ring where`` cannot read: it says so.
    Never fails the setup: where it cannot arm, ``%ring where`` finds no file and says so.
    """
    from ..runtime import _where

    try:
        _where.arm(directory, rank)
    except OSError:
        pass


def arm_debugger(directory: str, rank: int) -> None:
    """Make ``breakpoint()`` and ``pdb.set_trace()`` on this rank open a pdb prompt in the
    notebook, and mark the rank held while it is there (``engines/_debugger.py``).

    Never fails the setup: where the folder cannot be written, a breakpoint is skipped as before.
    """
    from . import _debugger

    try:
        _debugger.install(directory, rank)
    except OSError:
        pass
