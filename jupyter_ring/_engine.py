"""Engine-side code: the setup ``%ring start`` runs first on every rank (GPU binding, then the
runtime), and the completion/inspection helpers the notebook kernel calls on rank 0.

Runs inside each ipyparallel engine, before the user's first cell. It imports no framework:
``CUDA_VISIBLE_DEVICES`` must be set before torch/tensorflow/cupy first touch CUDA.
"""

import os
import socket

__all__ = ["local_rank", "bind_device", "describe", "watch_cells", "complete", "inspect"]

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
    """One row of the ``%ring start`` table for this rank."""
    return {"rank": ring.rank(), "size": ring.size(), "local_rank": ring.local_rank(),
            "host": socket.gethostname(), "pid": os.getpid(), "device": device}


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


def _after_cell(result):
    if result.error_in_exec is not None:
        from .runtime import _api

        _api.abandon_queued("the cell that queued this collective failed or was interrupted "
                            f"on this rank ({type(result.error_in_exec).__name__})")


# ------------------------------------------------------------- completion and inspection (rank 0)
# Called on rank 0 with view.apply by the notebook kernel's complete/inspect handlers, so that
# names that exist only on the ranks complete, and ``?`` / Shift-Tab describe the rank's object.
def complete(code, cursor_pos):
    """This engine's kernel's ``complete_reply`` content for ``code`` (the cell body)."""
    from IPython import get_ipython

    ip = get_ipython()
    # Jedi's first completion in a process takes 1-3 s (its warm-up), longer than the notebook
    # waits for a rank (remote_timeout); IPython's own completer answers from the namespace in ms.
    ip.Completer.use_jedi = False
    kernel = getattr(ip, "kernel", None)
    if kernel is not None:
        reply = kernel.do_complete(code, cursor_pos)
        if not hasattr(reply, "close"):  # a dict; an async handler would return a coroutine
            return reply
        reply.close()
    text, matches = ip.complete("", code[:cursor_pos].rsplit("\n", 1)[-1])
    return {"status": "ok", "matches": matches, "cursor_start": cursor_pos - len(text),
            "cursor_end": cursor_pos, "metadata": {}}


def inspect(code, cursor_pos, detail_level=0, omit_sections=()):
    """This engine's kernel's ``inspect_reply`` content (``?``, Shift-Tab) for ``code``."""
    from IPython import get_ipython

    kernel = get_ipython().kernel
    reply = kernel.do_inspect(code, cursor_pos, detail_level, omit_sections)
    if hasattr(reply, "close"):
        reply.close()
        return {"status": "ok", "found": False, "data": {}, "metadata": {}}
    return reply
