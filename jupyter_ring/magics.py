"""The ``%ring`` and ``%%distributed`` magics: a notebook front end for an MPI job of engines.

Load with ``%load_ext jupyter_ring``. The cluster is a :class:`jupyter_ring.cluster.RingCluster`
(ipyparallel engines started by mpiexec); cells run through ipyparallel's ``view.execute`` and
their output is streamed back with each line tagged by rank. Options are traitlets, settable
in IPython config as ``c.RingMagics.interrupt_grace = 10``.
"""

import argparse
import atexit
import shlex
import signal
import sys
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float

from .cluster import DeadRankError, RingCluster, _format_table, parse_ranks

__all__ = ["RingMagics", "DistributedError", "load_ipython_extension", "unload_ipython_extension"]

# Errors on other ranks that are usually consequences of the first failure, never the headline.
_SECONDARY = {"KeyboardInterrupt", "StallError", "EngineError"}


class DistributedError(Exception):
    """A ``%%distributed`` cell failed on one or more ranks.

    Shows the first failing rank's traceback (label ``[rank r @ host]``, original exception type
    kept in ``ename``), then one line per other failed rank. ``errors`` maps rank -> the remote
    error; ``rank`` is the headline rank.
    """

    def __init__(self, rank, host, error, others, note="", reasons=None):
        self.reasons = dict(reasons or {})  # rank -> why the front end interrupted it
        self.rank = rank
        self.host = host
        self.error = error
        self.others = others          # [(rank, host, error)] in order of failure
        self.note = note
        self.ename = getattr(error, "ename", type(error).__name__)
        self.evalue = getattr(error, "evalue", str(error))
        self.errors = {rank: error, **{r: e for r, _, e in others}}
        super().__init__(self._summary())

    def _summary(self):
        text = f"[rank {self.rank} @ {self.host}] {self.ename}: {self.evalue}"
        if self.others:
            text += "; also " + ", ".join(f"rank {r}: {_ename(e)}" for r, _, e in self.others)
        return text

    def _render_traceback_(self):
        lines = [f"[rank {self.rank} @ {self.host}] {self.ename}: {self.evalue}"]
        remote_tb = getattr(self.error, "traceback", None)
        if remote_tb:
            lines.extend(str(remote_tb).splitlines())
        if self.others:
            lines.append("")
            lines.append(f"other ranks ({len(self.others)}), probably as a consequence:")
            for rank, host, error in self.others:
                line = f"  [rank {rank} @ {host}] {_ename(error)}"
                evalue = _first_line(getattr(error, "evalue", str(error)))
                if evalue:
                    line += f": {evalue}"
                if rank in self.reasons:
                    line += f" (interrupted: {self.reasons[rank]})"
                lines.append(line)
        if self.note:
            lines.append(self.note)
        return lines


def _child_error(child):
    """The remote error of one engine's finished request, else None (running or succeeded)."""
    if not child.done():
        return None
    exc = child.exception()
    if exc is not None:
        return exc
    result = child.result()
    return result if isinstance(result, BaseException) else None


def _ename(error):
    return getattr(error, "ename", None) or type(error).__name__


def _first_line(text):
    text = str(text).strip()
    return text.splitlines()[0] if text else ""


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as IPython UsageErrors instead of exiting the kernel."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")

    def exit(self, status=0, message=None):
        raise UsageError(message or self.format_help())


def _ring_parser():
    parser = _ArgumentParser(prog="%ring", add_help=False,
                             description="Start, inspect and stop the cluster of ranks.")
    sub = parser.add_subparsers(dest="command", metavar="{start,status,stop,restart,push,pull}")
    start = sub.add_parser("start", add_help=False, help="start the ranks (mpiexec + engines)")
    start.add_argument("-n", type=int, default=None,
                       help="number of ranks (default: one per GPU, else CPU ranks)")
    start.add_argument("--gpus", default="auto",
                       help="auto | none | a list of GPU ids like 0,1 (default auto)")
    start.add_argument("--launcher", choices=["mpi", "slurm", "ssh"], default="mpi",
                       help="how the engines start (default mpi: mpiexec here)")
    start.add_argument("--hosts", nargs="+", default=[],
                       help="hosts for a multi-host job (mpiexec -hosts); commas or spaces")
    sub.add_parser("status", add_help=False, help="show the ranks and whether they are alive")
    sub.add_parser("stop", add_help=False, help="stop every rank and the controller")
    sub.add_parser("restart", add_help=False, help="stop, then start with the same arguments")
    push = sub.add_parser("push", add_help=False, help="send notebook variables to every rank")
    push.add_argument("names", nargs="+", metavar="NAME")
    pull = sub.add_parser("pull", add_help=False, help="bring a rank's variable into the notebook")
    pull.add_argument("name", metavar="NAME")
    which = pull.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=0, help="rank to pull from (default 0)")
    which.add_argument("--all", action="store_true", help="a list with every rank's value")
    return parser


_RING_PARSER = _ring_parser()


@magics_class
class RingMagics(Magics):
    """``%ring`` (cluster control) and ``%%distributed`` (run a cell on every rank)."""

    poll_interval = Float(0.02, config=True,
                          help="Seconds between checks for new output from the ranks.")
    interrupt_grace = Float(5.0, config=True,
                            help="Seconds to wait for the ranks to stop after SIGINT before "
                                 "giving the notebook back.")
    interrupt_peers = Bool(True, config=True,
                           help="When a rank fails while others still run (e.g. blocked in a "
                                "collective waiting for it), interrupt the others.")
    peer_interrupt_delay = Float(0.3, config=True,
                                 help="Seconds the other ranks get to finish on their own after "
                                      "the first rank failed, before they are interrupted.")

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.cluster = None
        self._start_argv = None
        atexit.register(self._atexit)

    # ------------------------------------------------------------------------------- %ring
    @line_magic
    def ring(self, line=""):
        """Control the cluster of ranks: start, status, stop, restart, push, pull.

        Usage::

            %ring start [-n N] [--gpus auto|none|LIST] [--launcher mpi|slurm|ssh] [--hosts H ...]
            %ring status
            %ring stop
            %ring restart            # stop, then start with the same arguments
            %ring push NAME [NAME ...]
            %ring pull NAME [--rank R | --all]

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
        min(cores, CPU_LIMIT, MEM_LIMIT / 2 GiB). Each rank sees only its own GPU. ``ring`` (the
        runtime, ``jupyter_ring.runtime``) is initialised in every rank's namespace.
        """
        argv = shlex.split(line)
        if not argv:
            raise UsageError("%ring needs a subcommand: start, status, stop, restart, push or pull "
                             "(see %ring?)")
        args = _RING_PARSER.parse_args(argv)
        return getattr(self, f"_ring_{args.command}")(args, argv)

    def _ring_start(self, args, argv):
        if self.cluster is not None and self.cluster.running:
            raise UsageError(
                f"a cluster of {self.cluster.size} ranks is already running (started with "
                f"%ring {' '.join(self._start_argv)}); use %ring restart to replace it with the "
                f"same arguments, or %ring stop and then %ring start ...")
        if args.n is not None and args.n < 1:
            raise UsageError(f"%ring start -n {args.n}: the cluster needs at least 1 rank")
        hosts = [h for item in args.hosts for h in item.split(",") if h]
        cluster = RingCluster(parent=self, n=args.n, gpus=args.gpus, launcher=args.launcher,
                              hosts=hosts)
        t0 = time.perf_counter()
        try:
            rows = cluster.start()
        except ValueError as exc:
            raise UsageError(f"%ring start: {exc}") from None
        self.cluster = cluster
        self._start_argv = argv
        print(_format_table(rows))
        print(f"{len(rows)} ranks ready in {time.perf_counter() - t0:.1f} s; `ring` is "
              f"initialised on every rank. Run cells there with %%distributed.")

    def _ring_status(self, args, argv):
        cluster = self.cluster
        if cluster is None or not cluster.running:
            print("no cluster is running; start one with %ring start")
            return
        dead = cluster.dead_ranks()
        rows = [dict(row, device=row["device"] + ("  DEAD" if row["rank"] in dead else ""))
                for row in cluster.ranks]
        print(_format_table(rows))
        if dead:
            print(cluster.describe_death(dead))
        else:
            print(f"{cluster.size} ranks alive (started with %ring {' '.join(self._start_argv)})")

    def _ring_stop(self, args, argv):
        if self.cluster is None or not self.cluster.running:
            print("no cluster is running")
            return
        size = self.cluster.size
        self.cluster.stop()
        print(f"stopped {size} ranks")

    def _ring_restart(self, args, argv):
        if self._start_argv is None:
            raise UsageError("%ring restart: no cluster was started in this session; "
                             "use %ring start")
        if self.cluster is not None:
            self.cluster.stop()
        return self.ring(shlex.join(self._start_argv))

    def _ring_push(self, args, argv):
        cluster = self._alive_cluster()
        ns = self.shell.user_ns
        missing = [name for name in args.names if name not in ns]
        if missing:
            raise UsageError(f"%ring push: no variable {', '.join(map(repr, missing))} in the "
                             "notebook")
        cluster.view.push({name: ns[name] for name in args.names}, block=True)

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
        return _CellRun(self, cluster, ranks, cell, args).run()

    # --------------------------------------------------------------------------- internals
    def _alive_cluster(self):
        cluster = self.cluster
        if cluster is None or not cluster.running:
            raise UsageError("no cluster is running; start one with %ring start -n N")
        cluster.check_alive()  # DeadRankError names the dead ranks and says: %ring restart
        return cluster

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


class _CellRun:
    """One ``%%distributed`` execution: submit, stream, watch for failures, interrupt, report."""

    def __init__(self, magics, cluster, ranks, cell, args):
        self.magics = magics
        self.cluster = cluster
        self.ranks = ranks
        self.cell = cell
        self.timeout = args.timeout
        self.only_rank = ranks[0] if args.rank0_output else None
        self.offsets = {}     # (rank, stream name) -> characters already shown
        self.partial = {}     # (rank, stream name) -> text after the last newline, not shown yet
        self.n_outputs = {}   # rank -> display_data outputs already shown
        self.interrupted = {}  # rank -> why it was interrupted

    def run(self):
        view = self.cluster.client[[self.cluster.engine_ids[r] for r in self.ranks]]
        ar = view.execute(self.cell, silent=False, block=False)
        self.ar = ar
        children = ar._children
        t0 = time.monotonic()
        first_failure = None
        next_health_check = t0 + 0.5
        try:
            while not ar.wait(self.magics.poll_interval):
                self._stream(final=False)
                now = time.monotonic()
                if now >= next_health_check:
                    next_health_check = now + 0.5
                    self._check_dead()
                if first_failure is None:
                    for child in children:
                        if _child_error(child) is not None:
                            first_failure = now
                            break
                pending = [r for r, child in zip(self.ranks, children) if not child.done()]
                if (first_failure is not None and self.magics.interrupt_peers and pending
                        and now - first_failure >= self.magics.peer_interrupt_delay):
                    self._interrupt(pending, "a peer rank failed")
                if self.timeout is not None and now - t0 > self.timeout and pending:
                    self._interrupt(pending, f"--timeout {self.timeout:g} s")
        except KeyboardInterrupt:
            self._interrupt_all()
            raise
        ar.wait_for_output(2.0)
        self._stream(final=True)
        self._show_results()
        self._raise_errors()

    def _check_dead(self):
        """A rank that died mid-cell never replies: report it now instead of waiting forever."""
        dead = self.cluster.dead_ranks()
        if not dead:
            return
        self.ar.wait(1.0)  # let ipyparallel deliver what it has
        self._stream(final=True)
        raise DeadRankError(self.cluster.describe_death(dead), dead)

    def _interrupt(self, ranks, why):
        todo = [r for r in ranks if r not in self.interrupted]
        if not todo:
            return
        for r in todo:
            self.interrupted[r] = why
        self.cluster.signal_ranks(signal.SIGINT, todo)

    def _interrupt_all(self):
        """Ctrl-C in the notebook: SIGINT every rank, give them a moment, show what they said."""
        ar = self.ar
        self.cluster.signal_ranks(signal.SIGINT)
        finished = ar.wait(self.magics.interrupt_grace)
        try:
            ar.wait_for_output(1.0)
        except Exception:
            pass
        self._stream(final=True)
        if not finished:
            pending = [r for r, c in zip(self.ranks, ar._children) if not c.done()]
            print(f"rank(s) {', '.join(map(str, pending))} did not stop within "
                  f"{self.magics.interrupt_grace:g} s of SIGINT; they may be stuck outside Python. "
                  "%ring status shows them; %ring restart replaces the cluster.", file=sys.stderr)

    # ----------------------------------------------------------------------------- output
    def _stream(self, final):
        for i, rank in enumerate(self.ranks):
            md = self.ar._metadata[i]
            if self.only_rank is None or rank == self.only_rank:
                for name in ("stdout", "stderr"):
                    self._stream_text(rank, name, md[name] or "", final)
            outputs = md["outputs"] or []
            shown = self.n_outputs.get(rank, 0)
            for content in outputs[shown:]:
                self._display(rank, content)
            self.n_outputs[rank] = len(outputs)

    def _stream_text(self, rank, name, text, final):
        key = (rank, name)
        start = self.offsets.get(key, 0)
        if len(text) <= start and not (final and self.partial.get(key)):
            return
        self.offsets[key] = len(text)
        buf = self.partial.get(key, "") + text[start:]
        lines = buf.split("\n")
        rest = lines.pop()  # after the last newline: held back until the line is complete
        if final and rest:
            lines.append(rest)
            rest = ""
        self.partial[key] = rest
        if not lines:
            return
        tag = "" if self.only_rank is not None else f"[rank {rank}] "
        stream = sys.stdout if name == "stdout" else sys.stderr
        stream.write("".join(f"{tag}{line}\n" for line in lines))
        stream.flush()

    def _display(self, rank, content):
        from IPython.display import display

        data = content.get("data") or {}
        metadata = dict(content.get("metadata") or {})
        metadata["jupyter_ring_rank"] = rank
        print(f"[rank {rank}]")
        display(data, raw=True, metadata=metadata)

    def _show_results(self):
        from IPython.display import display

        for i, rank in enumerate(self.ranks):
            result = self.ar._metadata[i]["execute_result"]
            if not result:
                continue
            data = result.get("data") or {}
            if set(data) <= {"text/plain"}:
                print(f"[rank {rank}] Out: {data.get('text/plain', '')}")
            else:
                print(f"[rank {rank}] Out:")
                display(data, raw=True, metadata=result.get("metadata") or {})

    # ----------------------------------------------------------------------------- errors
    def _raise_errors(self):
        failures = []
        for i, (rank, child) in enumerate(zip(self.ranks, self.ar._children)):
            exc = _child_error(child)
            if exc is None:
                continue
            completed = self.ar._metadata[i]["completed"] or self.ar._metadata[i]["received"]
            failures.append((rank, completed, exc))
        if not failures:
            return
        dead = self.cluster.dead_ranks()

        def order(item):
            rank, completed, exc = item
            secondary = _ename(exc) in _SECONDARY or rank in self.interrupted or rank in dead
            return (secondary, completed is None, completed or 0, rank)

        failures.sort(key=order)
        host = {row["rank"]: row["host"] for row in self.cluster.ranks}
        rank, _, exc = failures[0]
        others = [(r, host.get(r, "?"), e) for r, _, e in failures[1:]]
        notes = []
        if self.interrupted:
            by_why = {}
            for r, why in sorted(self.interrupted.items()):
                by_why.setdefault(why, []).append(str(r))
            notes += [f"interrupted rank(s) {', '.join(rs)}: {why}" for why, rs in by_why.items()]
        if dead:
            notes.append(self.cluster.describe_death(dead))
        raise DistributedError(rank, host.get(rank, "?"), exc, others, "\n".join(notes),
                               reasons=self.interrupted)


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
    """Register ``%ring`` and ``%%distributed`` (``%load_ext jupyter_ring``)."""
    if "RingMagics" in ipython.magics_manager.registry:
        return
    ipython.register_magics(RingMagics(shell=ipython))


def unload_ipython_extension(ipython):
    """Stop the cluster started from this shell and remove the magics."""
    magics = ipython.magics_manager.registry.pop("RingMagics", None)
    if magics is None:
        return
    magics.close()
    for kind, names in (("line", ["ring"]), ("cell", ["distributed"])):
        table = ipython.magics_manager.magics[kind]
        for name in names:
            table.pop(name, None)
