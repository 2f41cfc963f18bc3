"""The setup ``%ring start`` runs first on every rank: GPU binding, the rank's row, cell hooks.

Runs inside each ipyparallel engine, before the user's first cell (``cluster._start.SETUP_CODE``).
It imports no framework: ``CUDA_VISIBLE_DEVICES`` must be set before torch/tensorflow/cupy first
touch CUDA.
"""

import linecache
import os
import re
import signal
import socket
import threading
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionResult

__all__ = ["RankRow", "local_rank", "bind_device", "describe", "watch_cells", "number_cells",
           "keep_own_errors", "address_interrupts", "reply_always", "arm_where", "arm_debugger", "arm_elastic", "ascii_logs",
           "CELL_NUMBER"]


class RankRow(TypedDict):
    """One rank as ``%ring start`` lists it (and the cluster keeps it: ``RingCluster.ranks``)."""

    rank: int
    size: int
    local_rank: int
    host: str
    pid: int
    device: str    # "cpu" or "cuda:0 (GPU <id>)": the GPU this rank sees as cuda:0


class RankNumbers(Protocol):
    """What :func:`describe` reads of the runtime (``jupyter_ring.runtime``, the module)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def local_rank(self) -> int: ...


# Launchers that export the node-local rank: MPICH/Hydra, Open MPI, Slurm, PMIx.
_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                    "PMIX_LOCAL_RANK", "PMI_LOCAL_RANK")


def local_rank() -> int:
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


def bind_device(gpus: list[str] | None) -> str:
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


def describe(ring: RankNumbers, device: str) -> RankRow:
    """This rank's row of the ``%ring start`` table."""
    return RankRow(rank=ring.rank(), size=ring.size(), local_rank=ring.local_rank(),
                   host=socket.gethostname(), pid=os.getpid(), device=device)


def watch_cells() -> None:
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


def keep_own_errors() -> None:
    """A rank whose cell raised keeps its own error: a SIGINT while IPython formats it is dropped.

    The notebook interrupts the ranks still running ``peer_interrupt_delay`` (0.3 s) after the
    first one failed, to free those waiting for it. A rank that raised too (a mismatch every rank
    raises alike) may still be formatting its traceback then: IPython formats it twice (shown,
    then stored in the history), and the first time it meets frames of a file it reads and
    highlights the whole file, 0.5 s on a loaded 2-core host. An interrupt landing there turned
    the rank's error into KeyboardInterrupt ("interrupted: a peer rank failed"), so a mismatch
    every rank raised read as rank 0's alone. The cell has ended on this rank by then, which is
    all the interrupt asks. Registered once per engine.
    """
    from IPython import get_ipython

    formatter = get_ipython().InteractiveTB
    structured = formatter.structured_traceback
    if getattr(structured, "_jr_keeps_errors", False):
        return

    def structured_traceback(*args: Any, **kwargs: Any) -> list[str]:
        if threading.current_thread() is not threading.main_thread():
            return _plain_library_frames(formatter, structured, args, kwargs)
        previous = signal.signal(signal.SIGINT, _too_late)
        try:
            return _plain_library_frames(formatter, structured, args, kwargs)
        finally:
            if previous is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(signal.SIGINT, previous)

    structured_traceback._jr_keeps_errors = True  # type: ignore[attr-defined]
    formatter.structured_traceback = structured_traceback


# the runtime's and the engine's own files: the frames the notebook hides below the user's last
# one (errors.trim_traceback, unless full_traceback)
_OWN_FILE = re.compile(r"[/\\]jupyter_ring[/\\](runtime|engines)[/\\]")
_CONTEXT_MODES = ("Context", "Verbose", "Docs")


def _plain_library_frames(formatter: Any, structured: Any, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> list[str]:
    """IPython's traceback, with the trailing run of jupyter_ring's own frames in plain text.

    IPython shows each frame with its context, highlighted: the first time a frame of a file
    comes up it parses and highlights that file (0.4 s for the runtime's three largest, a CPU's
    time per rank: 15 interrupted ranks on 2 cores ended a cell seconds late). The notebook hides
    those frames unless asked (``full_traceback``), so here they are one line each, in the
    layout it recognises ("File path:line, in function" then the line); the user's frames keep
    IPython's form. The traceback objects are not changed (the post-mortem debugger reads them).
    """
    etb = args[2] if len(args) > 2 else kwargs.get("etb")
    offset = (args[3] if len(args) > 3 else kwargs.get("tb_offset")) or 0
    if formatter.mode not in _CONTEXT_MODES or not isinstance(etb, TracebackType):
        return list(structured(*args, **kwargs))
    frames: list[TracebackType] = []
    tb: TracebackType | None = etb
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    keep = len(frames)
    while keep > 0 and _OWN_FILE.search(frames[keep - 1].tb_frame.f_code.co_filename):
        keep -= 1
    if keep == len(frames) or keep <= offset:
        return list(structured(*args, **kwargs))
    head: TracebackType | None = None
    for frame in reversed(frames[:keep]):  # the same frames, the chain ending at the user's last
        head = TracebackType(head, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    parts = list(structured(*args[:2], head, *args[3:], **{k: v for k, v in kwargs.items() if k != "etb"}))
    plain = []
    for frame in frames[keep:]:
        code = frame.tb_frame.f_code
        line = linecache.getline(code.co_filename, frame.tb_lineno).strip()
        plain.append(f"File {code.co_filename}:{frame.tb_lineno}, in {code.co_name}()\n"
                     f"--> {frame.tb_lineno} {line}\n")
    return parts[:-1] + plain + parts[-1:]


def _too_late(_signum: int, _frame: FrameType | None) -> None:
    """SIGINT while a failed cell's error is formatted: the cell is over on this rank already."""


def address_interrupts() -> None:
    """The notebook's interrupt stops the cell it names, on this rank, never the one after
    (``engines/_interrupts``). Registered once per engine, before ``reply_always``."""
    from . import _interrupts

    _interrupts.install()


def reply_always() -> None:
    """Make every cell's execute request get its reply, whenever an interrupt reaches the rank.

    ipykernel raises KeyboardInterrupt on SIGINT for the whole time it handles a request, not only
    while the cell's code runs: one that lands after the code ended (the reply being built, the
    output flushed, the reply sent) or before it began escapes the request's handler, which logs
    "KeyboardInterrupt caught in kernel." and sends no reply. The rank goes idle, and the notebook
    waits for that reply forever. Interrupts come at any moment: the Ring panel's, the kernel's
    peer interrupt 0.3 s after another rank failed. So: once the cell's request has run (reply
    built), SIGINT is ignored until ipykernel restores its between-requests handler (which ignores
    it too); one that escapes before that is the request's reply, a KeyboardInterrupt error.
    Registered once per engine.
    """
    from IPython import get_ipython

    kernel = get_ipython().kernel
    if getattr(kernel, "_jupyter_ring_replies", False):
        return
    run = kernel.do_execute

    async def do_execute(*args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            try:
                reply: dict[str, Any] = await run(*args, **kwargs)
            finally:
                # the cell is over: what is left is the reply (flush, send), not the cell's
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            reply = _interrupted_reply(kernel)
        return reply

    kernel.do_execute = do_execute
    kernel._jupyter_ring_replies = True


def _interrupted_reply(kernel: Any) -> dict[str, Any]:
    """The execute reply of a request interrupted outside its cell's code (as ipykernel's)."""
    from ._interrupts import interrupted_reply

    return interrupted_reply(kernel, "interrupted while the engine started or ended the cell, "
                                     "outside its code")


def ascii_logs() -> None:
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


def _after_cell(result: "ExecutionResult") -> None:
    if result.error_in_exec is not None:
        from ..runtime.internal import api as _api

        _api.abandon_queued("the cell that queued this collective failed or was interrupted "
                            f"on this rank ({type(result.error_in_exec).__name__})")


def arm_where(directory: str, rank: int) -> None:
    """Make this rank's stacks and collective readable by ``%ring where`` (runtime/_observe/where.py).

    ``directory`` is the kernel's folder for the cluster; a rank on another host without that
    folder on a shared file system makes its own, which ``%ring where`` cannot read: it says so.
    Never fails the setup: where it cannot arm, ``%ring where`` finds no file and says so.
    """
    from ..runtime.internal import where as _where

    try:
        _where.arm(directory, rank)
        _keep_cell_sources(_where.cells_path(directory, rank))
    except OSError:
        pass


_KEPT_CELLS = 64  # the sources of this many recent cells stay readable by Where?


def _keep_cell_sources(folder: str) -> None:
    """Write each cell's source where ``%ring where`` (another process) reads it: the stacks
    name a cell by the file IPython compiled it as, which is in this rank's memory only
    (linecache), so Where? showed no source line under a cell's frames. One small file per cell,
    the latest ``_KEPT_CELLS`` kept; the folder goes with the cluster's where folder."""
    from collections import deque

    from IPython import get_ipython

    from ..runtime.internal import cell_source_name

    compiler = get_ipython().compile
    if getattr(compiler, "_jupyter_ring_keeps_sources", False):
        return
    os.makedirs(folder, mode=0o700, exist_ok=True)
    cache = compiler.cache
    written: deque[str] = deque()

    def keep(transformed_code: str, number: int = 0, raw_code: str | None = None) -> str:
        name: str = cache(transformed_code, number, raw_code)
        path = os.path.join(folder, cell_source_name(name))
        try:
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
                fh.write(transformed_code)
            written.append(path)
            while len(written) > _KEPT_CELLS:
                os.unlink(written.popleft())
        except OSError:  # Where? then shows no source line for it: never fail the cell
            pass
        return name

    compiler.cache = keep
    compiler._jupyter_ring_keeps_sources = True


def arm_debugger(directory: str, rank: int) -> None:
    """Make ``breakpoint()`` and ``pdb.set_trace()`` on this rank open a pdb prompt in the
    notebook, and mark the rank held while it is there (``engines/_debugger.py``).

    Also keeps the traceback of the last cell that raised on the rank, for ``%ring debug``
    (``engines/_postmortem.py``). Never fails the setup: where the folder cannot be written, a
    breakpoint is skipped as before.
    """
    from . import _debugger, _postmortem

    try:
        _debugger.install(directory, rank)
    except OSError:
        pass
    _postmortem.keep_failures()  # %ring debug: the last failed cell's traceback, kept


def arm_elastic(directory: str, rank: int) -> None:
    """Let ``elastic.run`` on this rank go on through a peer's death (``engines/_elastic.py``):
    the runtime's waits read the kernel's notice that a rank died, ``run``'s reset re-forms the
    world, and the rank says when it is inside ``elastic.run``."""
    from . import _elastic

    _elastic.arm(directory, rank)
