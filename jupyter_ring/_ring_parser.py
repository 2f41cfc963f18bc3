"""The ``%ring`` magic's words: its argument parser, one subparser per subcommand.

Errors are IPython ``UsageError``s (never ``SystemExit`` in the kernel), options are never
abbreviated, and an unknown option gets the nearest known one as a hint. The handlers of the
parsed subcommands are the methods of :class:`jupyter_ring._ring_commands.RingCommands`.
"""

import argparse
import difflib
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from IPython.core.error import UsageError

__all__ = ["RingArgumentParser", "ring_parser", "RING_PARSER"]


class RingArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as IPython UsageErrors instead of exiting the kernel.

    Options are never abbreviated (``--n`` is no prefix of ``--nodes``), and an option it does
    not know gets the nearest one it does as a hint (``--n 2``: did you mean ``-n``?).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.command: str | None = None  # the subcommand being parsed: its options are the hints

    # one signature instead of argparse's overloads: %ring passes its words, never a namespace
    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: None = None) -> argparse.Namespace:
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

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise UsageError(message or self.format_help())


def ring_parser() -> RingArgumentParser:
    """The parser of ``%ring``'s words: a subcommand and its options."""
    parser = RingArgumentParser(prog="%ring", add_help=False,
                                  description="Start, inspect and stop the cluster of ranks.")
    sub = parser.add_subparsers(
        dest="command",
        metavar="{start,status,where,timeline,stop,restart,scale,sync,push,pull,auto,debug,pdb,debugpy}")
    _start_parser(sub)
    _state_parsers(sub)
    _variable_parsers(sub)
    auto = sub.add_parser("auto", add_help=False,
                          help="run every following cell on the ranks (on), or not (off)")
    auto.add_argument("state", nargs="?", choices=["on", "off"],
                      help="on or off (without it: show whether auto mode is on)")
    _post_mortem_parsers(sub)
    _debugpy_parser(sub)
    return parser


def _start_parser(sub: "argparse._SubParsersAction[RingArgumentParser]") -> None:
    """``%ring start``: how many ranks, where, how they start."""
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
    start.add_argument("--min-ranks", type=int, default=None,
                       help="the fewest ranks %%ring scale may leave (default 1)")
    start.add_argument("--max-ranks", type=int, default=None,
                       help="the most ranks %%ring scale may make (default: no bound)")
    start.add_argument("--host-discovery", default=None, metavar="SCRIPT|module:callable",
                       help="Horovod's host discovery: a script printing 'host:slots' lines, or "
                            "module:callable; the cluster grows and shrinks to its total of slots "
                            "(one host; within --min-ranks/--max-ranks)")
    start.add_argument("--discovery-interval", type=float, default=1.0,
                       help="seconds between two questions to --host-discovery (default 1)")
    start.add_argument("--torch-distributed", action="store_true", default=None,
                       help="also initialise torch.distributed's default process group on "
                            "every rank (gloo; NCCL where every rank has a GPU)")


def _state_parsers(sub: "argparse._SubParsersAction[RingArgumentParser]") -> None:
    """The cluster's state: ``%ring status``, ``timeline``, ``stop``, ``where``, ``restart``, ``scale``."""
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
    scale = sub.add_parser("scale", add_help=False,
                           help="grow or shrink the live cluster to N ranks, the ranks that stay "
                                "keeping their variables (one host)")
    scale.add_argument("n", type=int, metavar="N", help="the new number of ranks")


def _variable_parsers(sub: "argparse._SubParsersAction[RingArgumentParser]") -> None:
    """Variables between the notebook and the ranks: ``%ring sync``, ``push``, ``pull``."""
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


def _post_mortem_parsers(sub: "argparse._SubParsersAction[RingArgumentParser]") -> None:
    """``%ring debug`` and ``%ring pdb`` (``_postmortem.py``)."""
    debug = sub.add_parser("debug", add_help=False,
                           help="pdb where a rank of the last failed cell raised")
    debug.add_argument("ranks", nargs="?", default=None, metavar="RANKS",
                       help="the rank (default: the first failing rank), ranks as 0,2, or all")
    pdb = sub.add_parser("pdb", add_help=False,
                         help="open %%ring debug after every failed %%distributed cell (on), or not")
    pdb.add_argument("state", nargs="?", choices=["on", "off"],
                     help="on or off (without it: show whether it is on)")


def _debugpy_parser(sub: "argparse._SubParsersAction[RingArgumentParser]") -> None:
    """``%ring debugpy``: debugpy on a rank, for VS Code."""
    debugpy = sub.add_parser("debugpy", add_help=False,
                             help="start debugpy on a rank (127.0.0.1) and print VS Code's attach "
                                  "configuration")
    debugpy.add_argument("rank", type=int, metavar="RANK", help="the rank to debug")
    debugpy.add_argument("--wait", action="store_true",
                         help="then wait until a debugger client attaches (interrupt: stop waiting)")
    debugpy.add_argument("--timeout", type=float, default=None,
                         help="with --wait: give up after this many seconds")


RING_PARSER = ring_parser()
