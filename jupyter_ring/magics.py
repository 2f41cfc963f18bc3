"""The ``%ring`` and ``%%distributed`` magics: a notebook front end for an MPI job of engines.

Load with ``%load_ext jupyter_ring``. The cluster is a :class:`jupyter_ring.cluster.RingCluster`
(ipyparallel engines started by mpiexec); cells run through ipyparallel's ``view.execute`` and
their output is streamed back with each line tagged by rank. Options are traitlets, settable
in IPython config as ``c.RingMagics.interrupt_grace = 10``.
"""

import argparse
import ast
import atexit
import os
import shlex
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Enum, Float, default

from ._cell import routes_to_ranks
from ._completion import KernelShim
from ._distributed import DistributedCells
from ._held_cluster import HeldCluster
from ._postmortem import PostMortem
from ._ring_commands import RingCommands
from ._ring_parser import RING_PARSER
from .cluster import RingCluster
from .errors import DistributedError

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__all__ = ["RingMagics", "DistributedError", "load_ipython_extension", "unload_ipython_extension"]


@magics_class
class RingMagics(Magics):
    """``%ring`` (cluster control) and ``%%distributed`` (run a cell on every rank)."""

    interrupt_grace = Float(5.0, config=True,
                            help="Seconds to wait for the ranks to stop after SIGINT before "
                                 "giving the notebook back; on one host, 0.1 s more for each "
                                 "rank beyond the cores.")
    interrupt_peers = Bool(True, config=True,
                           help="When a rank fails while others still run (e.g. blocked in a "
                                "collective waiting for it), interrupt the others.")
    peer_interrupt_delay = Float(0.3, config=True,
                                 help="Seconds the other ranks get to finish on their own after "
                                      "the first rank failed, before they are interrupted.")

    output = Enum(["auto", "tabs", "text"], "auto", config=True,
                  help="How %%distributed shows output: 'tabs' (a tab per rank, live, then "
                       "static HTML with the rank-tagged text as text/plain), 'text' (each "
                       "line tagged [rank r] on stdout/stderr), or 'auto' (tabs in a Jupyter "
                       "kernel with ipywidgets installed, else text).")
    auto = Bool(False, config=True,
                help="Auto mode: run every cell on the ranks without %%distributed "
                     "(%ring auto on|off).")
    auto_banner = Bool(True, config=True,
                       help="In auto mode, print one line naming the ranks at the top of each "
                            "cell's output, so that the mode is visible.")
    remote_timeout = Float(3.0, config=True,
                           help="Seconds to wait for rank 0 to answer a completion or "
                                "inspection request before answering from this kernel.")
    dashboard = Bool(True, config=True,
                     help="Show the live training dashboard (a row per rank, loss chart) in a "
                          "%%distributed cell's output once a rank reports progress or metrics "
                          "(ring.progress/log/track, optimizer steps). %%distributed "
                          "--no-dashboard turns it off for one cell.")
    output_grace = Float(2.0, config=True,
                         help="Seconds to wait for more output from the ranks after their cell "
                              "finished and nothing more arrived, before giving the notebook back.")
    full_traceback = Bool(config=True,
                          help="Show the ranks' tracebacks in full, jupyter_ring's own frames "
                               "below the user's call included (default: hidden, one line "
                               "says how many; JUPYTER_RING_FULL_TRACEBACK=1 sets it).")

    @default("full_traceback")
    def _full_traceback_default(self) -> bool:
        return os.environ.get("JUPYTER_RING_FULL_TRACEBACK", "") not in ("", "0")

    health_interval = Float(0.25, config=True,
                            help="Seconds between checks for dead ranks while a cell runs.")

    def __init__(self, shell: "InteractiveShell | None" = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self.held = HeldCluster()  # the cluster %ring start made
        self.commands = RingCommands(self, self.held)  # %ring's subcommands
        self.cells = DistributedCells(self, self.held)  # %%distributed's cells
        self._local_depth = 0
        self._shim: KernelShim | None = None
        self.post_mortem = PostMortem(self)
        atexit.register(self._atexit)

    @property
    def cluster(self) -> RingCluster | None:
        """The cluster this kernel started (``%ring start``), or None."""
        return self.held.cluster

    @property
    def ipython(self) -> "InteractiveShell":
        """The shell these magics are registered with (only a registered magic runs)."""
        if self.shell is None:
            raise UsageError("%ring and %%distributed run in an IPython shell")
        return self.shell

    # ------------------------------------------------------------------------------- %ring
    @line_magic
    def ring(self, line: str = "") -> None:
        """Control the cluster of ranks: start, status, stop, restart, push, pull.

        Usage::

            %ring start [-n N] [--gpus auto|none|LIST] [--launcher mpi|slurm|ssh] [--hosts H[:K],...]
                       [--hostfile FILE] [--ip ADDR] [--nodes N --ntasks-per-node K
                       --partition P --time T]   # the last four with --launcher slurm
                       [--torch-distributed]     # also init torch.distributed's default group
                       [--max-restarts N]        # dead ranks replaced in place (default 3; 0: off)
                       [--min-ranks A] [--max-ranks B]  # bounds of %ring scale (default 1, none)
                       [--host-discovery SCRIPT|module:callable [--discovery-interval S]]
                                                 # the size follows Horovod's host discovery
            %ring status
            %ring where [--all-threads]  # each rank's stack, innermost first, and its collective
            %ring timeline [--last S]    # every rank's collectives of the last S s, drawn
            %ring stop
            %ring restart            # stop, then start with the same arguments
            %ring scale N            # grow or shrink to N ranks; the ranks that stay keep their variables
            %ring sync NAME [NAME ...] [--from R]  # to ranks that lack them (a replaced rank)
            %ring push NAME [NAME ...]
            %ring pull NAME [--rank R | --all]
            %ring auto on|off        # every following cell runs on the ranks (%%local: here)
            %ring debug [RANKS|all]  # pdb where a rank of the last failed cell raised
            %ring pdb on|off         # %ring debug after every failed %%distributed cell
            %ring debugpy RANK [--wait]  # debugpy on RANK: attach VS Code (docs/debugging.md)

        Example::

            In [1]: %load_ext jupyter_ring
            In [2]: %ring start -n 2
            rank  host  pid   device
            0     node1 4242  cpu
            1     node1 4243  cpu
            In [3]: lr = 0.1
            In [4]: %ring push lr
            In [5]: %%distributed
               ...: w = lr * ring.rank()
            In [6]: %ring pull w --all
            In [7]: w
            Out[7]: [0.0, 0.1]
            In [8]: %ring stop

        ``-n`` defaults to one rank per visible GPU (``CUDA_VISIBLE_DEVICES`` respected), else to
        min(cores, CPU_LIMIT, MEM_LIMIT / 2 GiB), and each rank's OpenMP/MKL/torch threads to
        its share of the cores (CPU_LIMIT / ranks); an -n beyond the share starts anyway and says
        so. Each rank sees only its own GPU. ``ring`` (the
        runtime, ``jupyter_ring.runtime``) is initialised in every rank's namespace, and every
        rank has torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
        ...), so ``torch.distributed.init_process_group()`` works in a cell;
        ``--torch-distributed`` calls it at start (docs/torch-distributed.md).
        """
        argv = shlex.split(line)
        if not argv:
            raise UsageError("%ring needs a subcommand: start, status, where, timeline, stop, restart, "
                             "scale, sync, push, pull, auto, debug, pdb or debugpy (see %ring?)")
        args = RING_PARSER.parse_args(argv)
        getattr(self.commands, args.command)(args, argv)

    # ------------------------------------------------------------------------ %%distributed
    @magic_arguments()
    @argument("--ranks", default=None,
              help="run on these ranks only: ints, ranges a-b, commas (e.g. 0,2-3)")
    @argument("--timeout", type=float, default=None,
              help="interrupt the ranks after this many seconds and fail the cell")
    @argument("--rank0-output", action="store_true",
              help="show only rank 0's printed output (errors still come from every rank)")
    @argument("--no-dashboard", action="store_true",
              help="do not show the live dashboard for this cell")
    @argument("--auto", action="store_true", help=argparse.SUPPRESS)
    @argument("--output", choices=["tabs", "text"], default=None,
              help="tabs: a tab per rank; text: lines tagged [rank r] (default: "
                   "RingMagics.output)")
    @cell_magic
    def distributed(self, line: str, cell: str) -> None:
        """Run the cell on every rank (or --ranks); namespaces persist between cells.

        Output streams back live, each line tagged with its rank. If a rank fails, the error
        shows that rank's traceback first and summarises the other ranks; ranks still running
        (e.g. waiting for the failed rank in a collective) are interrupted. Interrupting the
        kernel interrupts every rank; their variables survive.

        Example::

            In [2]: %ring start -n 2
            In [3]: %%distributed
               ...: import numpy as np
               ...: x = np.full(3, ring.rank() + 1.0)
               ...: s = ring.allreduce(x, op=ring.Sum, name="x")
               ...: print(s)
            [rank 0] [3. 3. 3.]
            [rank 1] [3. 3. 3.]
            In [4]: %%distributed --ranks 1
               ...: print(x)
            [rank 1] [2. 2. 2.]
        """
        args = parse_argstring(self.distributed, line)
        self.cells.run(line, cell, args)

    @cell_magic
    def local(self, line: str, cell: str) -> Any:  # the cell's last value, whatever it is
        """Run the cell in this notebook kernel, not on the ranks (for auto mode).

        Example::

            In [4]: %ring auto on
            In [5]: w = ring.rank()          # runs on every rank
            In [6]: %%local
               ...: import os; os.getpid()   # runs here; the last value is the cell's result
        """
        shell = self.ipython
        self._local_depth += 1  # the auto-mode transformer leaves the body alone
        try:
            code = shell.transform_cell(cell)
        finally:
            self._local_depth -= 1
        tree = shell.transform_ast(shell.compile.ast_parse(code))
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        name = shell.compile.cache(code, shell.execution_count, raw_code=cell)
        ns = shell.user_ns
        exec(shell.compile(tree, name, "exec"), ns)  # the user's own code, in their kernel
        if last is not None:
            return eval(shell.compile(last, name, "eval"), ns)
        return None

    def _auto_transform(self, lines: list[str]) -> list[str]:
        """Input transformer (first of ``input_transformers_cleanup``) for auto mode.

        Rewrites a cell to ``%%distributed --auto`` + the cell, unless the cell opens with a cell
        magic (``%%local``, ``%%distributed``, ``%%time`` ...) or with ``%ring`` (also
        ``%load_ext``/``%unload_ext``), which run here. Sees the raw cell, so it works the
        same in JupyterLab, Notebook, VS Code and nbclient.
        """
        if not self.auto or self._local_depth or not routes_to_ranks(lines):
            return lines
        return ["%%distributed --auto\n"] + lines

    # --------------------------------------------------------------------------- internals
    def _atexit(self) -> None:
        self.held.release()

    def close(self) -> None:
        """Stop the cluster (unload_ipython_extension)."""
        self._atexit()
        atexit.unregister(self._atexit)


def load_ipython_extension(ipython: "InteractiveShell") -> None:
    """Register ``%ring``, ``%%distributed`` and ``%%local`` (``%load_ext jupyter_ring``), the
    auto-mode input transformer, and (in a Jupyter kernel) completion/inspection from rank 0."""
    if "RingMagics" in ipython.magics_manager.registry:
        return
    magics = RingMagics(shell=ipython)
    ipython.register_magics(magics)
    ipython.input_transformers_cleanup.insert(0, magics._auto_transform)
    magics.post_mortem.install(ipython)
    kernel = getattr(ipython, "kernel", None)
    if kernel is not None and hasattr(kernel, "do_complete"):
        magics._shim = KernelShim(magics, kernel)


def unload_ipython_extension(ipython: "InteractiveShell") -> None:
    """Stop the cluster started from this shell and remove the magics and hooks."""
    magics = ipython.magics_manager.registry.pop("RingMagics", None)
    if magics is None:
        return
    magics.close()
    magics.post_mortem.remove()
    try:
        ipython.input_transformers_cleanup.remove(magics._auto_transform)
    except ValueError:
        pass
    if magics._shim is not None:
        magics._shim.remove()
        magics._shim = None
    for kind, names in (("line", ["ring"]), ("cell", ["distributed", "local"])):
        table = ipython.magics_manager.magics[kind]
        for name in names:
            table.pop(name, None)
