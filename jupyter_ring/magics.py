"""The ``%ring`` and ``%%distributed`` magics: a notebook front end for an MPI job of engines.

Load with ``%load_ext jupyter_ring``. The cluster is a :class:`jupyter_ring.cluster.RingCluster`
(ipyparallel engines started by mpiexec); cells run through ipyparallel's ``view.execute`` and
their output is streamed back with each line tagged by rank. Options are traitlets, settable
in IPython config as ``c.RingMagics.interrupt_grace = 10``.
"""

import argparse
import ast
import atexit
import difflib
import inspect
import os
import re
import shlex
import sys
import threading
import time
from typing import Any, NoReturn

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Enum, Float, default

from ._cell import CellRun, routes_to_ranks
from ._completion import KernelShim
from .cluster import RingCluster, format_table, parse_ranks, rank_ranges
from ._postmortem import PostMortem
from .errors import CellInterrupted, ClusterError, DistributedError, _ename
from .widgets._tabs import RankTabs, TextSink

__all__ = ["RingMagics", "DistributedError", "load_ipython_extension", "unload_ipython_extension"]

class _ArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as IPython UsageErrors instead of exiting the kernel.

    Options are never abbreviated (``--n`` is no prefix of ``--nodes``), and an option it does
    not know gets the nearest one it does as a hint (``--n 2``: did you mean ``-n``?).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.command: str | None = None  # the subcommand being parsed: its options are the hints

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.command = args[0] if args else None
        return super().parse_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        hint = self._nearest_option(message)
        raise UsageError(f"{self.prog}: {message}{hint}\n{self.format_usage()}")

    def _nearest_option(self, message: str) -> str:
        """`` (did you mean -n?)`` for the first unknown option in ``message``, or ""."""
        # a subcommand's unknown options are reported by the top parser: look in every subparser
        parsers: list[argparse.ArgumentParser] = [self]
        for action in self._subparsers._group_actions if self._subparsers is not None else ():
            if isinstance(action.choices, dict):
                # the subcommand's own options when it is known (stop --force is no --from of sync)
                chosen = action.choices.get(self.command) if self.command else None
                parsers += [chosen] if isinstance(chosen, argparse.ArgumentParser) else [
                    p for p in action.choices.values() if isinstance(p, argparse.ArgumentParser)]
        known = [o for p in parsers for o in p._option_string_actions if o not in ("-h", "--help")]
        for word in re.findall(r"(?<![\w-])(--?[\w-]+)", message.partition(":")[2]):
            if word in known:
                continue
            bare = word.lstrip("-")
            near = [o for o in known if o.lstrip("-") == bare] or difflib.get_close_matches(word, known, 1, 0.6)
            if near:
                return f" (did you mean {near[0]}?)"
        return ""

    def exit(self, status=0, message=None):
        raise UsageError(message or self.format_help())


def _ring_parser():
    parser = _ArgumentParser(prog="%ring", add_help=False,
                             description="Start, inspect and stop the cluster of ranks.")
    sub = parser.add_subparsers(
        dest="command",
        metavar="{start,status,where,timeline,stop,restart,sync,push,pull,auto,debug,pdb,debugpy}")
    start = sub.add_parser("start", add_help=False, help="start the ranks (mpiexec + engines)")
    start.add_argument("-n", type=int, default=None,
                       help="number of ranks (default: one per GPU, else CPU ranks)")
    start.add_argument("--gpus", default="auto",
                       help="auto | none | a list of GPU ids like 0,1 (default auto)")
    start.add_argument("--launcher", choices=["mpi", "slurm", "ssh"], default="mpi",
                       help="how the engines start (default mpi: mpiexec here)")
    start.add_argument("--hosts", nargs="+", default=[],
                       help="hosts for a multi-host job (mpiexec -hosts), host or host:ranks; "
                            "commas or spaces")
    start.add_argument("--hostfile", default="",
                       help="a Hydra hostfile (host[:ranks] a line) for a multi-host job")
    start.add_argument("--nodes", type=int, default=None,
                       help="--launcher slurm: nodes for the engines' job (sbatch --nodes)")
    start.add_argument("--ntasks-per-node", type=int, default=None,
                       help="--launcher slurm: ranks per node (sbatch --ntasks-per-node)")
    start.add_argument("--partition", default="", help="--launcher slurm: the partition")
    start.add_argument("--time", default="", help="--launcher slurm: time limit, e.g. 1:00:00")
    start.add_argument("--ip", default="",
                       help="address the controller listens on for the other hosts "
                            "(default: this host's address on the route to them)")
    start.add_argument("--max-restarts", type=int, default=None,
                       help="how many dead ranks are replaced in place, the others keeping their "
                            "variables (default 3; 0: a dead rank ends the job, %%ring restart)")
    start.add_argument("--torch-distributed", action="store_true", default=None,
                       help="also initialise torch.distributed's default process group on "
                            "every rank (gloo; NCCL where every rank has a GPU)")
    sub.add_parser("status", add_help=False, help="show the ranks and whether they are alive")
    timeline = sub.add_parser("timeline", add_help=False,
                              help="draw every rank's recent collectives (a track per rank)")
    timeline.add_argument("--last", type=float, default=10.0,
                          help="seconds of history to draw (default 10)")
    sub.add_parser("stop", add_help=False, help="stop every rank and the controller")
    where = sub.add_parser("where", add_help=False,
                           help="every rank's Python stack and collective, read from outside")
    where.add_argument("--all-threads", action="store_true",
                       help="every thread with every frame (default: the main thread and "
                            "threads running user code, engine frames hidden)")
    where.add_argument("--timeout", type=float, default=3.0,
                       help="seconds to wait for each rank's dump (default 3)")
    sub.add_parser("restart", add_help=False, help="stop, then start with the same arguments")
    sync = sub.add_parser("sync", add_help=False,
                          help="copy ranks' variables from one rank to the ranks that lack them "
                               "(a rank replaced in place)")
    sync.add_argument("names", nargs="+", metavar="NAME")
    sync.add_argument("--from", dest="source", type=int, default=None,
                      help="the rank to copy from (default: the first rank that has them all)")
    push = sub.add_parser("push", add_help=False, help="send notebook variables to every rank")
    push.add_argument("names", nargs="+", metavar="NAME")
    pull = sub.add_parser("pull", add_help=False, help="bring a rank's variable into the notebook")
    pull.add_argument("name", metavar="NAME")
    which = pull.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=0, help="rank to pull from (default 0)")
    which.add_argument("--all", action="store_true", help="a list with every rank's value")
    auto = sub.add_parser("auto", add_help=False,
                          help="run every following cell on the ranks (on), or not (off)")
    auto.add_argument("state", nargs="?", choices=["on", "off"],
                      help="on or off (without it: show whether auto mode is on)")
    _post_mortem_parsers(sub)
    _add_debugpy_parser(sub)
    return parser


def _post_mortem_parsers(sub: Any) -> None:
    """``%ring debug`` and ``%ring pdb`` (``_postmortem.py``)."""
    debug = sub.add_parser("debug", add_help=False,
                           help="pdb where a rank of the last failed cell raised")
    debug.add_argument("ranks", nargs="?", default=None, metavar="RANKS",
                       help="the rank (default: the first failing rank), ranks as 0,2, or all")
    pdb = sub.add_parser("pdb", add_help=False,
                         help="open %%ring debug after every failed %%distributed cell (on), or not")
    pdb.add_argument("state", nargs="?", choices=["on", "off"],
                     help="on or off (without it: show whether it is on)")


def _add_debugpy_parser(sub):
    debugpy = sub.add_parser("debugpy", add_help=False,
                             help="start debugpy on a rank (127.0.0.1) and print VS Code's attach "
                                  "configuration")
    debugpy.add_argument("rank", type=int, metavar="RANK", help="the rank to debug")
    debugpy.add_argument("--wait", action="store_true",
                         help="then wait until a debugger client attaches (interrupt: stop waiting)")
    debugpy.add_argument("--timeout", type=float, default=None,
                         help="with --wait: give up after this many seconds")


_RING_PARSER = _ring_parser()


@magics_class
class RingMagics(Magics):
    """``%ring`` (cluster control) and ``%%distributed`` (run a cell on every rank)."""

    interrupt_grace = Float(5.0, config=True,
                            help="Seconds to wait for the ranks to stop after SIGINT before "
                                 "giving the notebook back.")
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
    def _full_traceback_default(self):
        return os.environ.get("JUPYTER_RING_FULL_TRACEBACK", "") not in ("", "0")

    health_interval = Float(0.25, config=True,
                            help="Seconds between checks for dead ranks while a cell runs.")

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.cluster = None
        self._start_argv = None
        self._widgets_ok = None
        self._dashboard_ready = False
        self._local_depth = 0
        self._shim = None
        self.post_mortem = PostMortem(self)
        atexit.register(self._atexit)

    # ------------------------------------------------------------------------------- %ring
    @line_magic
    def ring(self, line=""):
        """Control the cluster of ranks: start, status, stop, restart, push, pull.

        Usage::

            %ring start [-n N] [--gpus auto|none|LIST] [--launcher mpi|slurm|ssh] [--hosts H[:K],...]
                       [--hostfile FILE] [--ip ADDR] [--nodes N --ntasks-per-node K
                       --partition P --time T]   # the last four with --launcher slurm
                       [--torch-distributed]     # also init torch.distributed's default group
                       [--max-restarts N]        # dead ranks replaced in place (default 3; 0: off)
            %ring status
            %ring where [--all-threads]  # each rank's stack, innermost first, and its collective
            %ring timeline [--last S]    # every rank's collectives of the last S s, drawn
            %ring stop
            %ring restart            # stop, then start with the same arguments
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
                             "sync, push, pull, auto, debug, pdb or debugpy (see %ring?)")
        args = _RING_PARSER.parse_args(argv)
        return getattr(self, f"_ring_{args.command}")(args, argv)

    def _ring_start(self, args, argv):
        stopped = self._stopped_outside()
        if stopped:
            print(f"({stopped}; starting a new one)")
        if self.cluster is not None and self.cluster.running:
            raise UsageError(
                f"a cluster of {self.cluster.size} ranks is already running (started with "
                f"%ring {' '.join(self._start_argv)}); use %ring restart to replace it with the "
                f"same arguments, or %ring stop and then %ring start ...")
        if args.n is not None and args.n < 1:
            raise UsageError(f"%ring start -n {args.n}: the cluster needs at least 1 rank")
        hosts = [h for item in args.hosts for h in item.split(",") if h]
        # a config trait (RingCluster.torch_distributed) stands unless the flag is given
        options = {} if args.torch_distributed is None else {"torch_distributed": True}
        if args.max_restarts is not None:
            if args.max_restarts < 0:
                raise UsageError(f"%ring start --max-restarts {args.max_restarts}: 0 (never "
                                 "replace a dead rank) or more")
            options["max_restarts"] = args.max_restarts
        cluster = RingCluster(parent=self, n=args.n, gpus=args.gpus, launcher=args.launcher,
                              hosts=hosts, hostfile=args.hostfile, controller_ip=args.ip,
                              nodes=args.nodes, ntasks_per_node=args.ntasks_per_node,
                              partition=args.partition, time_limit=args.time, **options)
        if (self._widgets_ok is None and self.output != "text"
                and getattr(self.shell, "kernel", None) is not None):
            # ipywidgets takes ~0.5 s to import: overlap it with the ranks starting up
            threading.Thread(target=self._import_widgets, name="jupyter_ring-import-widgets",
                             daemon=True).start()
        t0 = time.perf_counter()
        try:
            rows = cluster.start()
        except ValueError as exc:
            raise UsageError(f"%ring start: {exc}") from None
        self.cluster = cluster
        self._start_argv = argv
        self._dashboard_ready = self._setup_dashboard(cluster)
        print(format_table(rows))
        if cluster.note:
            print(cluster.note)
        if cluster.address != "127.0.0.1":
            print(f"controller listening on {cluster.address} for the ranks on "
                  f"{len({row['host'] for row in rows})} hosts (--ip ADDR to choose another)")
        if cluster.torch_backend:
            print(f"torch.distributed: default process group initialised on every rank "
                  f"({cluster.torch_backend}); RANK, WORLD_SIZE, MASTER_ADDR ... are torchrun's")
        print(f"{len(rows)} ranks ready in {time.perf_counter() - t0:.1f} s; `ring` is "
              f"initialised on every rank. Run cells there with %%distributed.")

    def _setup_dashboard(self, cluster):
        """Install the dashboard's snapshot publisher on every rank (widgets.live.ENGINE_SETUP);
        only where widgets can show (a Jupyter kernel): a terminal gets no dashboard."""
        if not self.dashboard or not self._widgets_available():
            return False
        try:
            from .widgets.live import ENGINE_SETUP

            # not block=True: that also waits, without a timeout, for the ranks' "idle" on
            # IOPub, which can fail to arrive (a teaching-lab run hung here for minutes)
            cluster.view.execute(ENGINE_SETUP, block=False).get(timeout=cluster.setup_timeout)
        except Exception as exc:  # the ranks still work; only the dashboard is missing
            print(f"(no live dashboard: installing its publisher on the ranks failed: {exc})",
                  file=sys.stderr)
            return False
        return True

    def _ring_status(self, args, argv):
        stopped = self._stopped_outside()
        cluster = self.cluster
        if cluster is None or not cluster.running:
            print(f"no cluster is running{': ' + stopped if stopped else ''}; start one with "
                  f"{self._start_hint()}")
            return
        dead = cluster.dead_ranks()
        rows = [dict(row, device=row["device"] + _rank_mark(row["rank"], dead, cluster.replaced))
                for row in cluster.ranks]
        print(format_table(rows))
        if dead:
            print(cluster.describe_death(dead))
        else:
            print(f"{cluster.size} ranks alive (started with %ring {' '.join(self._start_argv)})")
        print(_restarts_line(cluster))
        print(self._auto_status())

    def _ring_where(self, args, argv):
        from .cluster import format_where

        cluster = self.cluster
        if cluster is None or not cluster.running:
            raise UsageError("no cluster is running; start one with %ring start -n N")
        # no check_alive(): the living ranks' stacks matter most when one has died
        print(format_where(cluster.where(timeout=args.timeout), all_threads=args.all_threads))

    def _ring_debugpy(self, args, argv):
        from . import _debugpy

        cluster = self._alive_cluster()
        try:
            endpoint = _debugpy.start_on_rank(cluster, args.rank, timeout=self.remote_timeout * 10)
        except _debugpy.DebugpyError as exc:
            raise UsageError(str(exc)) from None
        print(_debugpy.describe(args.rank, endpoint, cluster.where_dir), flush=True)
        if not args.wait:
            return
        print(f"waiting for a debugger client to attach to rank {args.rank} "
              "(interrupt the kernel to stop waiting)", flush=True)
        try:
            attached = _debugpy.wait_for_client(cluster, args.rank, args.timeout)
        except KeyboardInterrupt:
            print("(stopped waiting; debugpy still listens on the rank)")
            return
        print(f"a client is attached to rank {args.rank}" if attached else
              f"no client attached within {args.timeout:g} s; debugpy still listens on the rank")

    def _ring_timeline(self, args, argv):
        from IPython.display import display

        from .engines._timeline import recent_collectives
        from .widgets._timeline import timeline_html, timeline_text

        if args.last <= 0:
            raise UsageError(f"%ring timeline --last takes a positive number of seconds, got {args.last:g}")
        cluster = self._alive_cluster()
        replies = cluster.view.apply_async(recent_collectives, args.last).get(self.remote_timeout * 3)
        ranks = {r: reply["records"] for r, reply in enumerate(replies)}
        display({"text/html": timeline_html(ranks, args.last),
                 "text/plain": timeline_text(ranks, args.last)}, raw=True)

    def _ring_stop(self, args, argv):
        stopped = self._stopped_outside()
        if self.cluster is None or not self.cluster.running:
            print(f"no cluster is running{': ' + stopped if stopped else ''}")
            return
        size = self.cluster.size
        self.cluster.stop()
        print(f"stopped {size} ranks")

    def _ring_restart(self, args, argv):
        if self._start_argv is None:
            raise UsageError("%ring restart: no cluster was started in this session; "
                             "use %ring start")
        stopped = self._stopped_outside()
        if stopped:
            print(f"({stopped})")
        if self.cluster is not None:
            self.cluster.stop()
        return self.ring(shlex.join(self._start_argv))

    def _ring_auto(self, args, argv):
        if args.state is not None:
            self.auto = args.state == "on"
        print(self._auto_status())

    # ------------------------------------------------------------- post-mortem (_postmortem.py)
    def _ring_debug(self, args, argv):
        self.post_mortem.debug(args.ranks)

    def _ring_pdb(self, args, argv):
        if args.state is not None:
            self.post_mortem.auto = args.state == "on"
        print("%ring pdb on: a failed %%distributed cell opens pdb where its first failing rank "
              "raised (%ring pdb off ends it)" if self.post_mortem.auto else
              "%ring pdb off: %ring debug opens pdb where a rank of the last failed cell raised")

    def _auto_status(self):
        if self.auto:
            return ("auto mode on: every cell runs on the ranks; a %%local cell runs in this "
                    "kernel; %ring auto off ends it")
        return "auto mode off: cells run in this kernel; %%distributed cells run on the ranks"

    def _cell_number(self) -> int:
        """The notebook's count of the cell running now (IPython has moved on to the next)."""
        shell = self.shell
        if shell is None:  # only a magic registered with a shell runs
            raise UsageError("%%distributed runs in an IPython shell")
        running = getattr(shell.displayhook, "exec_result", None)
        if running is not None and running.execution_count is not None:
            return int(running.execution_count)
        return int(shell.execution_count)

    def _auto_transform(self, lines):
        """Input transformer (first of ``input_transformers_cleanup``) for auto mode.

        Rewrites a cell to ``%%distributed --auto`` + the cell, unless the cell opens with a cell
        magic (``%%local``, ``%%distributed``, ``%%time`` ...) or with ``%ring`` (also
        ``%load_ext``/``%unload_ext``), which run here. Sees the raw cell, so it works the
        same in JupyterLab, Notebook, VS Code and nbclient.
        """
        if not self.auto or self._local_depth or not routes_to_ranks(lines):
            return lines
        return ["%%distributed --auto\n"] + lines

    def _ring_push(self, args, argv):
        cluster = self._alive_cluster()
        ns = self.shell.user_ns
        missing = [name for name in args.names if name not in ns]
        if missing:
            raise UsageError(f"%ring push: no variable {', '.join(map(repr, missing))} in the "
                             "notebook")
        cluster.view.push({name: ns[name] for name in args.names}, block=True)

    def _ring_sync(self, args, argv):
        """``%ring sync NAME... [--from R]``: the ranks that lack any of the variables get them
        all from rank R (default: the first rank that has them all), e.g. a rank replaced in
        place after the survivors kept theirs."""
        from .engines._respawn import missing

        cluster = self._alive_cluster()
        bad = [name for name in args.names if not name.isidentifier()]
        if bad:
            raise UsageError(f"%ring sync: {', '.join(map(repr, bad))} is not a variable name")
        lacks = cluster.client[cluster.engine_ids].apply_sync(missing, args.names)
        source = args.source
        if source is None:
            source = next((r for r, names in enumerate(lacks) if not names), None)
            if source is None:
                raise UsageError(f"%ring sync: no rank has every one of {', '.join(args.names)}")
        elif not 0 <= source < cluster.size:
            raise UsageError(f"%ring sync --from {source}: the cluster has ranks 0..{cluster.size - 1}")
        elif lacks[source]:
            raise UsageError(f"%ring sync --from {source}: rank {source} has no variable "
                             f"{', '.join(map(repr, lacks[source]))}")
        targets = [r for r, names in enumerate(lacks) if names and r != source]
        if not targets:
            print(f"every rank has {', '.join(args.names)}: nothing to copy")
            return
        values = cluster.client[cluster.engine_ids[source]].pull(args.names, block=True)
        cluster.client[[cluster.engine_ids[r] for r in targets]].push(
            dict(zip(args.names, values)), block=True)
        print(f"copied {', '.join(args.names)} from rank {source} to rank(s) "
              f"{', '.join(map(str, targets))}")

    def _ring_pull(self, args, argv):
        cluster = self._alive_cluster()
        name = args.name
        if not name.isidentifier():
            raise UsageError(f"%ring pull: {name!r} is not a variable name")
        ranks = list(range(cluster.size)) if args.all else [args.rank]
        for rank in ranks:
            if not 0 <= rank < cluster.size:
                raise UsageError(f"%ring pull --rank {rank}: the cluster has ranks "
                                 f"0..{cluster.size - 1}")
        view = cluster.client[[cluster.engine_ids[r] for r in ranks]]
        try:
            values = view.pull(name, block=True)
        except Exception as exc:
            raise _render_pull_error(exc, name, ranks, cluster) from None
        self.shell.user_ns[name] = values if args.all else values[0]

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
    def distributed(self, line, cell):
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
        cluster = self._alive_cluster()
        if args.ranks is None:
            ranks = list(range(cluster.size))
        else:
            try:
                ranks = parse_ranks(args.ranks, cluster.size)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"--timeout {args.timeout:g}: give a positive number of seconds")
        if args.auto and self.auto_banner:
            print(f"[ring auto] ranks {rank_ranges(ranks)} of {cluster.size} "
                  "(%%local runs a cell here; %ring auto off)")
        # The ranks number lines and cells as the notebook does. Line 1 is the %%distributed line,
        # a comment there (IPython drops leading blank lines); in auto mode the cell has no such
        # line and its own first line is line 1. The last line, a comment the ranks take off,
        # is the notebook's count: a rank's traceback says Cell In[17] where the notebook does.
        from .engines._setup import CELL_NUMBER  # the ranks' side of this line

        body = (cell if args.auto else f"# %%distributed {line}".rstrip() + "\n" + cell)
        number = self._cell_number()
        body = body.rstrip("\n") + "\n" + CELL_NUMBER.format(number)
        try:
            return CellRun(self, cluster, ranks, body, args, self._sink(ranks, args)).run()
        except (DistributedError, CellInterrupted) as exc:
            self.post_mortem.note(exc, number, cluster)  # for %ring debug
            raise

    @cell_magic
    def local(self, line, cell):
        """Run the cell in this notebook kernel, not on the ranks (for auto mode).

        Example::

            In [4]: %ring auto on
            In [5]: w = ring.rank()          # runs on every rank
            In [6]: %%local
               ...: import os; os.getpid()   # runs here; the last value is the cell's result
        """
        self._local_depth += 1  # the auto-mode transformer leaves the body alone
        try:
            code = self.shell.transform_cell(cell)
        finally:
            self._local_depth -= 1
        tree = self.shell.transform_ast(self.shell.compile.ast_parse(code))
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        name = self.shell.compile.cache(code, self.shell.execution_count, raw_code=cell)
        ns = self.shell.user_ns
        exec(self.shell.compile(tree, name, "exec"), ns)  # the user's own code, in their kernel
        if last is not None:
            return eval(self.shell.compile(last, name, "eval"), ns)
        return None

    def _sink(self, ranks, args):
        """Tabs or tagged text for one cell (see jupyter_ring.widgets._tabs)."""
        mode = args.output or self.output
        if args.rank0_output:
            return TextSink(tag=False)
        if mode == "auto":
            mode = "tabs" if self._widgets_available() else "text"
        if mode == "tabs":
            return RankTabs(ranks)
        return TextSink(ranks=ranks)

    def _widgets_available(self):
        """A Jupyter kernel (not a terminal) with ipywidgets importable."""
        if getattr(self.shell, "kernel", None) is None:
            return False
        if self._widgets_ok is None:
            self._import_widgets()
        return self._widgets_ok

    def _import_widgets(self):
        try:
            import ipywidgets  # noqa: F401  (imported ahead of the first cell with output)

            self._widgets_ok = True
        except ImportError:
            self._widgets_ok = False

    # --------------------------------------------------------------------------- internals
    def _stopped_outside(self):
        """If the cluster was stopped from outside this kernel (the Ring panel's Stop), let go
        of it (the next %ring start just works) and return a note naming who; else ""."""
        cluster = self.cluster
        by = cluster.stopped_by() if cluster is not None else None
        if by is None:
            return ""
        size = cluster.size
        cluster.forget()
        return f"the cluster of {size} ranks was stopped by {by}"

    def _start_hint(self):
        return f"%ring {shlex.join(self._start_argv)}" if self._start_argv else "%ring start -n N"

    def _alive_cluster(self) -> RingCluster:
        stopped = self._stopped_outside()
        cluster = self.cluster
        if cluster is None or not cluster.running:
            raise UsageError(f"no cluster is running{': ' + stopped if stopped else ''}; start "
                             f"one with {self._start_hint()}")
        dead = cluster.dead_ranks()
        if dead and cluster.can_respawn(dead):  # a rank died between cells: replaced now
            print(self._replace_dead(cluster, dead), file=sys.stderr)
        cluster.check_alive()  # DeadRankError names the dead ranks and says: %ring restart
        return cluster

    def _replace_dead(self, cluster, dead):
        """Replace the ``dead`` ranks in place where the cluster can (``RingCluster.respawn``);
        the message that names them, how they died and what now (the new ranks' namespaces are
        fresh; or %ring restart)."""
        if not cluster.can_respawn(dead):
            return cluster.describe_death(dead)
        from .cluster import replaced_note

        head = cluster.describe_death(dead, fix="").rstrip()  # how they died: read before the
        try:                                                    # new ranks take their rows
            done = cluster.respawn(dead)
        except ClusterError as exc:
            return f"{head} Replacing it in place failed: {exc}"
        except Exception as exc:  # ipyparallel's own (a survivor's engine gone meanwhile: no engines)
            lost = sorted(set(dead) | set(cluster.dead_ranks()))
            if lost != sorted(dead):  # a survivor died too: say how, as for the first
                head = cluster.describe_death(lost, fix="").rstrip()
            return (f"{head} Replacing it in place failed ({type(exc).__name__}: {exc}); %ring "
                    "restart starts every rank afresh.")
        self._new_rank_dashboard(cluster, done.ranks)
        return f"{head} {replaced_note(done, cluster.size, cluster.restarts, cluster.max_restarts)}"

    def _new_rank_dashboard(self, cluster, ranks):
        """The dashboard's publisher on ranks that replaced dead ones (when the dashboard is on)."""
        if not self._dashboard_ready:
            return
        from .widgets.live import ENGINE_SETUP

        try:
            new = cluster.client[[cluster.engine_ids[r] for r in ranks]]
            new.execute(ENGINE_SETUP, block=False).get(timeout=cluster.setup_timeout)
        except Exception as exc:  # the ranks work; only the new ranks' dashboard rows are missing
            print(f"(no dashboard on the new rank(s): {exc})", file=sys.stderr)

    def _atexit(self):
        cluster, self.cluster = self.cluster, None
        if cluster is not None and cluster.running:
            try:
                cluster.stop()
            except BaseException:
                cluster.kill()

    def close(self):
        """Stop the cluster (unload_ipython_extension)."""
        self._atexit()
        atexit.unregister(self._atexit)


def _rank_mark(rank: int, dead: list[int], replaced: dict[int, int]) -> str:
    """What ``%ring status`` adds to a rank's device: DEAD, or that it is a replacement."""
    if rank in dead:
        return "  DEAD"
    times = replaced.get(rank, 0)
    return f"  replaced {times}\u00d7, fresh namespace" if times else ""


def _restarts_line(cluster: RingCluster) -> str:
    """``%ring status``'s line on replacing ranks in place: used of --max-restarts, or off."""
    if not cluster.respawns:
        return "dead ranks are not replaced in place (--max-restarts 0): %ring restart"
    line = f"restarts {cluster.restarts} of --max-restarts {cluster.max_restarts} used"
    if cluster.replaced:
        kept = [r for r in range(cluster.size) if r not in cluster.replaced]
        line += (f"; replaced rank(s) started with a fresh namespace: %ring sync NAME"
                 + (f" --from {kept[0]}" if kept else "") + " copies variables to them")
    return line


def _render_pull_error(exc, name, ranks, cluster):
    ename = _ename(exc)
    inner = getattr(exc, "elist", None)
    if inner:
        ename = inner[0][0]
    if ename == "NameError" or "NameError" in str(exc):
        return UsageError(f"%ring pull: {name!r} is not defined on rank(s) "
                          f"{', '.join(map(str, ranks))}")
    return UsageError(f"%ring pull {name}: {ename}: {exc}")


def load_ipython_extension(ipython):
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


def unload_ipython_extension(ipython):
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
