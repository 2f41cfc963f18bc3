"""The cluster a kernel holds: the one :class:`RingCluster` ``%ring start`` made, how it was
started, and whether its ranks publish the dashboard's snapshots.

Both ``%ring``'s subcommands and a ``%%distributed`` cell ask it for a running cluster
(:meth:`HeldCluster.alive`), which notices a cluster stopped from outside (the Ring panel's
Stop) and replaces ranks that died between cells in place, where the cluster can.
"""

import shlex
import sys
from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from ._follow import Follower
from .cluster import RingCluster
from .errors import ClusterError

if TYPE_CHECKING:
    import ipyparallel as ipp

__all__ = ["HeldCluster", "connected_client", "connected_view"]


class HeldCluster:
    """The kernel's cluster (``cluster``, None before ``%ring start``), the words that started it
    (``start_argv``, for ``%ring restart``) and whether its ranks publish the dashboard's
    snapshots (``dashboard_ready``)."""

    def __init__(self) -> None:
        self.cluster: RingCluster | None = None
        self.start_argv: list[str] | None = None
        self.dashboard_ready = False
        self.follow: Follower | None = None  # --host-discovery: the cluster follows its source

    def stopped_outside(self) -> str:
        """If the cluster was stopped from outside this kernel (the Ring panel's Stop), let go
        of it (the next %ring start just works) and return a note naming who; else ""."""
        cluster = self.cluster
        by = cluster.stopped_by() if cluster is not None else None
        if cluster is None or by is None:
            return ""
        size = cluster.size
        cluster.forget()
        return f"the cluster of {size} ranks was stopped by {by}"

    def start_hint(self) -> str:
        """The ``%ring start`` line that starts the cluster again (or a generic one)."""
        return f"%ring {shlex.join(self.start_argv)}" if self.start_argv else "%ring start -n N"

    def alive(self) -> RingCluster:
        """The running cluster, its dead ranks replaced first where it can; UsageError when none
        runs, DeadRankError when ranks are dead for good."""
        stopped = self.stopped_outside()
        cluster = self.cluster
        if cluster is None or not cluster.running:
            raise UsageError(f"no cluster is running{': ' + stopped if stopped else ''}; start "
                             f"one with {self.start_hint()}")
        dead = cluster.dead_ranks()
        if dead and cluster.can_respawn(dead):  # a rank died between cells: replaced now
            print(self.replace_dead(cluster, dead), file=sys.stderr)
        cluster.check_alive()  # DeadRankError names the dead ranks and says: %ring restart
        self.follow_discovery()
        return cluster

    def follow_discovery(self) -> None:
        """With ``--host-discovery``: the cluster resized to what its source reports, between
        cells (``_follow``); nothing otherwise."""
        follow, cluster = self.follow, self.cluster
        if follow is None:
            return
        if cluster is None or not cluster.running or follow.cluster is not cluster:
            self.stop_following()
            return
        follow.between_cells(self)

    def stop_following(self) -> None:
        """Stop asking the discovery source (the cluster stopped, or is replaced)."""
        follow, self.follow = self.follow, None
        if follow is not None:
            follow.stop()

    def replace_dead(self, cluster: RingCluster, dead: list[int]) -> str:
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
        self.new_rank_dashboard(cluster, done.ranks)
        return f"{head} {replaced_note(done, cluster.size, cluster.restarts, cluster.max_restarts)}"

    def new_rank_dashboard(self, cluster: RingCluster, ranks: list[int]) -> None:
        """The dashboard's publisher on ranks that replaced dead ones (when the dashboard is on)."""
        if not self.dashboard_ready:
            return
        from .widgets.live import ENGINE_SETUP

        try:
            new = connected_client(cluster)[[cluster.engine_ids[r] for r in ranks]]
            new.execute(ENGINE_SETUP, block=False).get(timeout=cluster.setup_timeout)
        except Exception as exc:  # the ranks work; only the new ranks' dashboard rows are missing
            print(f"(no dashboard on the new rank(s): {exc})", file=sys.stderr)

    def release(self) -> None:
        """Stop the cluster (kill it if stopping fails) and let go of it: the kernel's exit."""
        cluster, self.cluster = self.cluster, None
        self.stop_following()
        if cluster is not None and cluster.running:
            try:
                cluster.stop()
            except BaseException:
                cluster.kill()


def connected_client(cluster: RingCluster) -> "ipp.Client":
    """The running cluster's ipyparallel client (ClusterError once it has stopped)."""
    if cluster.client is None:
        raise ClusterError("no cluster is running; start one with %ring start")
    return cluster.client


def connected_view(cluster: RingCluster) -> "ipp.DirectView":
    """The running cluster's view of every rank (ClusterError once it has stopped)."""
    if cluster.view is None:
        raise ClusterError("no cluster is running; start one with %ring start")
    return cluster.view
