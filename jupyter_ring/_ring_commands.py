"""The ``%ring`` magic's subcommands: one method of :class:`RingCommands` each, named as the
subcommand (``%ring start`` is :meth:`RingCommands.start`), over the kernel's
:class:`~jupyter_ring._held_cluster.HeldCluster`.

The words are parsed by ``_ring_parser``; ``RingMagics.ring`` hands the parsed arguments here.
Options (``remote_timeout``, ``dashboard``, ``output``, ``auto``) are the magics' traits.
"""

import argparse
import sys
import threading
import time
from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from ._follow import Follower
from ._held_cluster import HeldCluster, connected_client, connected_view
from ._ring_parser import RING_PARSER
from .cluster import RingCluster, format_table
from .cluster._discovery import DiscoveryError, HostDiscovery, wanted
from .cluster._scale import ScaleRefused, scale_bounds, scaled_note
from .errors import _ename, _rank_list

if TYPE_CHECKING:
    from .engines._setup import RankRow
    from .engines._timeline import RecentCollectives
    from .magics import RingMagics

__all__ = ["RingCommands"]


def _first_discovery(args: argparse.Namespace, cluster: RingCluster, hosts: bool) -> HostDiscovery | None:
    """``%ring start --host-discovery``: the source asked once before the start (UsageError
    naming what is wrong when it cannot answer); without ``-n`` the cluster starts at the size it
    reports (within ``--min-ranks``/``--max-ranks``). None without the option."""
    if args.host_discovery is None:
        return None
    where = f"%ring start --host-discovery {args.host_discovery}"
    if hosts or args.launcher != "mpi":
        raise UsageError(f"{where}: a cluster follows host discovery on one host only for now; drop "
                         "--hosts/--hostfile/--launcher, or drop --host-discovery")
    try:
        discovery = HostDiscovery(args.host_discovery, args.discovery_interval)
    except DiscoveryError as exc:
        raise UsageError(f"{where}: {exc}") from None
    found = discovery.ask()
    if found.error or found.slots is None:
        raise UsageError(f"{where}: {found.error}")
    n, why = wanted(found.slots, cluster.min_ranks, cluster.max_ranks)
    if n is None:
        raise UsageError(f"{where}: {why}; start it when the source reports more, or lower --min-ranks")
    if args.n is None:
        cluster.n = n
    return discovery


class RingCommands:
    """The handlers of ``%ring``'s subcommands, each taking the parsed arguments and the words."""

    def __init__(self, magics: "RingMagics", held: HeldCluster) -> None:
        self.magics = magics
        self.held = held

    def start(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring start``: a new cluster, its rank table, and what else the user should know."""
        stopped = self.held.stopped_outside()
        if stopped:
            print(f"({stopped}; starting a new one)")
        if self.held.cluster is not None and self.held.cluster.running:
            raise UsageError(
                f"a cluster of {self.held.cluster.size} ranks is already running (started with "
                f"%ring {' '.join(self.held.start_argv or [])}); use %ring restart to replace it with the "
                f"same arguments, or %ring stop and then %ring start ...")
        if args.n is not None and args.n < 1:
            raise UsageError(f"%ring start -n {args.n}: the cluster needs at least 1 rank")
        hosts = [h for item in args.hosts for h in item.split(",") if h]
        # a config trait (RingCluster.torch_distributed) stands unless the flag is given
        options: dict[str, bool | int] = {} if args.torch_distributed is None else {"torch_distributed": True}
        if args.max_restarts is not None:
            if args.max_restarts < 0:
                raise UsageError(f"%ring start --max-restarts {args.max_restarts}: 0 (never "
                                 "replace a dead rank) or more")
            options["max_restarts"] = args.max_restarts
        try:
            options.update(scale_bounds(args.n, args.min_ranks, args.max_ranks, "%ring start"))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        cluster = RingCluster(parent=self.magics, n=args.n, gpus=args.gpus, launcher=args.launcher,
                              hosts=hosts, hostfile=args.hostfile, controller_ip=args.ip,
                              nodes=args.nodes, ntasks_per_node=args.ntasks_per_node,
                              partition=args.partition, time_limit=args.time, **options)
        self.held.stop_following()  # (a cluster stopped from outside may have left one)
        discovery = _first_discovery(args, cluster, bool(hosts or args.hostfile))
        if (self.magics.cells.widgets_ok is None and self.magics.output != "text"
                and getattr(self.magics.shell, "kernel", None) is not None):
            # ipywidgets takes ~0.5 s to import: overlap it with the ranks starting up
            threading.Thread(target=self.magics.cells.import_widgets, name="jupyter_ring-import-widgets",
                             daemon=True).start()
        t0 = time.perf_counter()
        try:
            rows = cluster.start()
        except ValueError as exc:
            raise UsageError(f"%ring start: {exc}") from None
        self.held.cluster = cluster
        self.held.start_argv = argv
        self.held.dashboard_ready = self._setup_dashboard(cluster)
        print(format_table(rows))
        if discovery is not None:
            self.held.follow = Follower(discovery, cluster)
            discovery.start()
            print(f"host discovery: {discovery.spec} reports {discovery.latest().slots} slot(s); the "
                  f"cluster follows it (asked every {discovery.interval:g} s, within --min-ranks "
                  f"{cluster.min_ranks} .. --max-ranks {cluster.max_ranks or 'unbounded'})")
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

    def _setup_dashboard(self, cluster: RingCluster) -> bool:
        """Install the dashboard's snapshot publisher on every rank (widgets.live.ENGINE_SETUP);
        only where widgets can show (a Jupyter kernel): a terminal gets no dashboard."""
        if not self.magics.dashboard or not self.magics.cells.widgets_available():
            return False
        try:
            from .widgets.live import ENGINE_SETUP

            # not block=True: that also waits, without a timeout, for the ranks' "idle" on
            # IOPub, which can fail to arrive (a teaching-lab run hung here for minutes)
            connected_view(cluster).execute(ENGINE_SETUP, block=False).get(timeout=cluster.setup_timeout)
        except Exception as exc:  # the ranks still work; only the dashboard is missing
            print(f"(no live dashboard: installing its publisher on the ranks failed: {exc})",
                  file=sys.stderr)
            return False
        return True

    def status(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring status``: the rank table, dead or replaced ranks marked, and the modes."""
        stopped = self.held.stopped_outside()
        cluster = self.held.cluster
        if cluster is None or not cluster.running:
            print(f"no cluster is running{': ' + stopped if stopped else ''}; start one with "
                  f"{self.held.start_hint()}")
            return
        dead = cluster.dead_ranks()
        rows = [_marked_row(row, dead, cluster.replaced) for row in cluster.ranks]
        print(format_table(rows))
        if dead:
            print(cluster.describe_death(dead))
        else:
            print(f"{cluster.size} ranks alive (started with %ring {' '.join(self.held.start_argv or [])})")
        print(_restarts_line(cluster))
        follow = self.held.follow
        if follow is not None and follow.cluster is cluster:
            found = follow.discovery.latest()
            print(f"host discovery {follow.discovery.spec}: "
                  + (found.error if found.error else f"{found.slots} slot(s) ({', '.join(f'{h}:{k}' for h, k in found.hosts.items())})"))
        print(self.auto_status())

    def where(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring where``: every rank's stack and collective, also with a rank dead."""
        from .cluster import format_where

        cluster = self.held.cluster
        if cluster is None or not cluster.running:
            raise UsageError("no cluster is running; start one with %ring start -n N")
        # no check_alive(): the living ranks' stacks matter most when one has died
        print(format_where(cluster.where(timeout=args.timeout), all_threads=args.all_threads))

    def debugpy(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring debugpy RANK [--wait]``: debugpy on a rank and VS Code's attach configuration."""
        from . import _debugpy

        cluster = self.held.alive()
        try:
            endpoint = _debugpy.start_on_rank(cluster, args.rank, timeout=self.magics.remote_timeout * 10)
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

    def timeline(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring timeline [--last S]``: every rank's recent collectives, drawn."""
        from IPython.display import display

        from .engines._timeline import recent_collectives
        from .widgets._timeline import timeline_html, timeline_text

        if args.last <= 0:
            raise UsageError(f"%ring timeline --last takes a positive number of seconds, got {args.last:g}")
        cluster = self.held.alive()
        replies: list[RecentCollectives] = connected_view(cluster).apply_async(recent_collectives, args.last).get(self.magics.remote_timeout * 3)
        ranks = {r: reply["records"] for r, reply in enumerate(replies)}
        display({"text/html": timeline_html(ranks, args.last),
                 "text/plain": timeline_text(ranks, args.last)}, raw=True)

    def stop(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring stop``: every rank and the controller."""
        stopped = self.held.stopped_outside()
        cluster = self.held.cluster
        if cluster is None or not cluster.running:
            print(f"no cluster is running{': ' + stopped if stopped else ''}")
            return
        size = cluster.size
        self.held.stop_following()
        cluster.stop()
        print(f"stopped {size} ranks")

    def restart(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring restart``: stop, then ``%ring start`` with the words that started it."""
        start_argv = self.held.start_argv
        if start_argv is None:
            raise UsageError("%ring restart: no cluster was started in this session; "
                             "use %ring start")
        stopped = self.held.stopped_outside()
        if stopped:
            print(f"({stopped})")
        self.held.stop_following()
        if self.held.cluster is not None:
            self.held.cluster.stop()
        self.start(RING_PARSER.parse_args(start_argv), start_argv)

    def scale(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring scale N``: the live cluster grown or shrunk to N ranks (``cluster._scale``)."""
        follow = self.held.follow
        if follow is not None and follow.cluster is self.held.cluster:
            raise UsageError(f"%ring scale {args.n}: the cluster's size follows --host-discovery "
                             f"{follow.discovery.spec}; change what it reports, or %ring restart "
                             "without --host-discovery")
        cluster = self.held.alive()
        try:
            done = cluster.scale(args.n)
        except ScaleRefused as exc:
            raise UsageError(f"%ring scale {args.n}: {exc}") from None
        if done.added:
            self.held.new_rank_dashboard(cluster, done.added)
        print(scaled_note(done))

    def auto(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring auto [on|off]``: every following cell on the ranks, or not; says which."""
        if args.state is not None:
            self.magics.auto = args.state == "on"
        print(self.auto_status())

    def debug(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring debug [RANKS|all]``: pdb where a rank of the last failed cell raised."""
        self.magics.post_mortem.debug(args.ranks)

    def pdb(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring pdb [on|off]``: ``%ring debug`` after every failed cell, or not; says which."""
        if args.state is not None:
            self.magics.post_mortem.auto = args.state == "on"
        print("%ring pdb on: a failed %%distributed cell opens pdb where its first failing rank "
              "raised (%ring pdb off ends it)" if self.magics.post_mortem.auto else
              "%ring pdb off: %ring debug opens pdb where a rank of the last failed cell raised")

    def auto_status(self) -> str:
        """One line: whether auto mode is on, and what runs where."""
        if self.magics.auto:
            return ("auto mode on: every cell runs on the ranks; a %%local cell runs in this "
                    "kernel; %ring auto off ends it")
        return "auto mode off: cells run in this kernel; %%distributed cells run on the ranks"

    def push(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring push NAME...``: the notebook's variables to every rank."""
        cluster = self.held.alive()
        ns = self.magics.ipython.user_ns
        missing = [name for name in args.names if name not in ns]
        if missing:
            raise UsageError(f"%ring push: no variable {', '.join(map(repr, missing))} in the "
                             "notebook")
        connected_view(cluster).push({name: ns[name] for name in args.names}, block=True)

    def sync(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring sync NAME... [--from R]``: the ranks that lack any of the variables get them
        all from rank R (default: the first rank that has them all), e.g. a rank replaced in
        place after the survivors kept theirs."""
        from .engines._respawn import missing

        cluster = self.held.alive()
        bad = [name for name in args.names if not name.isidentifier()]
        if bad:
            raise UsageError(f"%ring sync: {', '.join(map(repr, bad))} is not a variable name")
        client = connected_client(cluster)
        lacks: list[list[str]] = client[cluster.engine_ids].apply_sync(missing, args.names)
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
        values = client[cluster.engine_ids[source]].pull(args.names, block=True)
        client[[cluster.engine_ids[r] for r in targets]].push(
            dict(zip(args.names, values)), block=True)
        print(f"copied {', '.join(args.names)} from rank {source} to rank(s) {_rank_list(targets)}")

    def pull(self, args: argparse.Namespace, argv: list[str]) -> None:
        """``%ring pull NAME [--rank R | --all]``: a rank's variable (or every rank's) into the notebook."""
        cluster = self.held.alive()
        name = args.name
        if not name.isidentifier():
            raise UsageError(f"%ring pull: {name!r} is not a variable name")
        ranks = list(range(cluster.size)) if args.all else [args.rank]
        for rank in ranks:
            if not 0 <= rank < cluster.size:
                raise UsageError(f"%ring pull --rank {rank}: the cluster has ranks "
                                 f"0..{cluster.size - 1}")
        view = connected_client(cluster)[[cluster.engine_ids[r] for r in ranks]]
        try:
            values = view.pull(name, block=True)
        except Exception as exc:
            raise _render_pull_error(exc, name, ranks) from None
        self.magics.ipython.user_ns[name] = values if args.all else values[0]


def _marked_row(row: "RankRow", dead: list[int], replaced: dict[int, int]) -> "RankRow":
    """A copy of ``row`` for ``%ring status``, its device marked with :func:`_rank_mark`."""
    marked = row.copy()
    marked["device"] = row["device"] + _rank_mark(row["rank"], dead, replaced)
    return marked


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


def _render_pull_error(exc: Exception, name: str, ranks: list[int]) -> UsageError:
    """The UsageError of a failed ``%ring pull``: a name the ranks lack, or what they raised."""
    ename = _ename(exc)
    inner = getattr(exc, "elist", None)
    if inner:
        ename = inner[0][0]
    if ename == "NameError" or "NameError" in str(exc):
        return UsageError(f"%ring pull: {name!r} is not defined on rank(s) {_rank_list(ranks)}")
    return UsageError(f"%ring pull {name}: {ename}: {exc}")
