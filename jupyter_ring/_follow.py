"""The kernel follows ``%ring start --host-discovery``: the cluster resized to what the source reports.

The source is asked on a thread of its own (``cluster._discovery.HostDiscovery``); everything
that touches the cluster happens here, on the kernel's thread, at three moments:

- **between cells**: before a ``%%distributed`` cell or a ``%ring`` command runs, and after a cell
  ends, the cluster is grown or shrunk as ``%ring scale N`` does (:meth:`Follower.between_cells`);
- **during a cell under ``elastic.run``** on every rank: the resize happens at the next
  ``state.commit()`` (``_cell.CellRun``, ``cluster._elastic_resize``);
- **during any other cell**: nothing is disturbed; the notebook says the resize waits for the
  cell's end (:meth:`Follower.wait_for_cell`).

What the source says that changes nothing (it failed, printed garbage, reports fewer slots than
``--min-ranks``) is said once in the notebook, not at every poll.
"""

import sys
from typing import TYPE_CHECKING

from .cluster._discovery import HostDiscovery, wanted
from .cluster._respawn import remake_torch_world
from .cluster._scale import ScaleRefused, scaled_note

if TYPE_CHECKING:
    from ._held_cluster import HeldCluster
    from .cluster import RingCluster
    from .cluster._elastic_resize import ElasticResize

__all__ = ["Follower"]


class Follower:
    """``cluster`` resized to what ``discovery`` reports (see the module)."""

    def __init__(self, discovery: HostDiscovery, cluster: "RingCluster") -> None:
        self.discovery = discovery
        self.cluster = cluster
        self._said = ""          # the last note said (a note is said once, until another)
        self._waiting_for: int | None = None  # the size a running cell was told it waits for
        self.torch_due = False   # a resize inside a cell: torch.distributed's world made after it
        self.gave_up: int | None = None  # a size whose resize inside a cell failed: after the cell

    def stop(self) -> None:
        """Stop asking the source (the cluster stops, or another replaces it)."""
        self.discovery.stop()

    def target(self) -> int | None:
        """The world size the source asks for now, when it differs from the cluster's (None: keep
        it); a failure or a bound that applies is said in the notebook, once."""
        found = self.discovery.latest()
        size = self.cluster.size
        if found.error:
            self.say(f"({found.error}; the cluster stays at {size} ranks)")
            return None
        if found.slots is None:
            return None
        n, why = wanted(found.slots, self.cluster.min_ranks, self.cluster.max_ranks)
        if why:
            self.say(f"({why}; {size} ranks now)")
        else:
            self._said = ""
        if n != self.gave_up:
            self.gave_up = None
        return n if n is not None and n != size and n != self.gave_up else None

    def say(self, note: str) -> None:
        """``note`` on the notebook's stderr, unless it was the last one said."""
        if note != self._said:
            self._said = note
            print(note, file=sys.stderr)

    def between_cells(self, held: "HeldCluster") -> None:
        """Grow or shrink the cluster to the size the source asks for, as ``%ring scale`` does
        (nothing when it asks for none, or the cluster cannot now: said once)."""
        self._waiting_for = None
        self.gave_up = None
        if self.torch_due and self.cluster.running:
            self.torch_due = False
            notes = remake_torch_world(self.cluster, "the resize (host discovery)")
            if notes:
                print("\n".join(notes), file=sys.stderr)
        n = self.target()
        if n is None or not self.cluster.running:
            return
        slots = self.discovery.latest().slots
        try:
            done = self.cluster.scale(n)
        except ScaleRefused as exc:
            self.say(f"(host discovery asks for {n} ranks; not now: {exc})")
            return
        if done.added:
            held.new_rank_dashboard(self.cluster, done.added)
        print(f"(host discovery: {slots} slots) {scaled_note(done)}", file=sys.stderr)

    def resizing(self, n: int) -> None:
        """A cell under ``elastic.run`` resizes the world to ``n`` at its next commit: said once."""
        print(f"(host discovery asks for {n} ranks: every rank runs elastic.run, so the world "
              f"changes at its next state.commit())", file=sys.stderr)

    def resized(self, resize: "ElasticResize") -> None:
        """The cell's resize is done: torch.distributed's world is made again after the cell."""
        self.torch_due = self.cluster.rendezvous is not None

    def wait_for_cell(self, n: int) -> None:
        """A cell that is not under ``elastic.run`` runs while the source asks for ``n`` ranks:
        the notebook is told, once, that the resize comes when the cell ends."""
        if self._waiting_for != n:
            self._waiting_for = n
            print(f"(host discovery asks for {n} ranks: this cell is not under elastic.run on every "
                  f"rank, so it runs on {self.cluster.size} ranks undisturbed; the cluster resizes "
                  f"when it ends)", file=sys.stderr)
