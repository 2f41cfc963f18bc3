"""A resize while every rank runs ``elastic.run`` in a cell, at the next commit (issue 34, item 3).

Host discovery (``_follow``) asks for another size while a cell runs ``elastic.run`` on every
rank; the cell goes on, and the world changes at the next ``state.commit()``. The kernel's cell
loop (``_cell.CellRun``) drives one :class:`ElasticResize` a tick at a time, never blocking on
the ranks' progress:

- **grow** ``old -> n``: :meth:`begin` starts ranks ``old..n-1`` as a replacement's newcomers
  are (an ``mpiexec -n k`` engine set of their own, under keepers) and waits for them to
  register, then writes the notice (``engines._elastic``: ``resize: grow``). The old ranks train
  on meanwhile; at their next commit every one raises ``HostsUpdatedInterrupt`` (added), and in
  ``run``'s reset they leave the old world with no rank excluded and the first opens a port.
  :meth:`port` finds it; :meth:`join` has the newcomers join keyed by their new numbers, runs
  the rank set-up on them, and the cell sends them the cell (their ``run`` syncs the state from
  rank 0 as the old ranks' reset syncs it);
- **shrink** ``old -> n``: :meth:`begin` writes the notice (``resize: shrink``). At the next
  commit every rank raises ``HostsUpdatedInterrupt`` (removed: no sync, every rank holds the
  commit); in the reset ranks ``0..n-1`` make their world of ``n`` and the others raise
  ``LeftTheWorld`` out of ``run``; once each of those replied, :meth:`stop_leavers` cuts the
  cluster to ``n`` ranks and asks their engines to shut down, and :meth:`leavers_gone` follows
  their processes out tick by tick (``_scale.Leavers``): the cell's output, interrupts and
  dashboard go on meanwhile.

:meth:`cancel` takes the notice back (and stops newcomers that never joined) when the cell ends
first, or a rank dies meanwhile: the resize is then done between cells. torch.distributed's
world is made again after the cell (``remake_torch_world``): its requests wait for the cell.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..engines._setup import RankRow
from ..errors import _rank_list
from ._procs import sweep_mpich_segments
from ._respawn import (_forget_notice, _newcomers, _result, _set_up_newcomers, next_generation,
                       settle_new_world)
from ._scale import Leavers, check_scale

if TYPE_CHECKING:
    from ._ring import RingCluster

__all__ = ["ElasticResize"]


class ElasticResize:
    """``cluster`` resized to ``n`` ranks inside a running elastic cell (see the module);
    ``setup_code``: the rank set-up the newcomers run; ``slots``: what the source reported."""

    def __init__(self, cluster: RingCluster, n: int, setup_code: str, slots: int | None = None) -> None:
        self.cluster = cluster
        self.old, self.n = cluster.size, n
        self.setup_code = setup_code
        self.slots = n if slots is None else slots  # what the source reported (the note says it)
        self.added = list(range(self.old, n))
        self.removed = list(range(n, self.old))
        self.gen = 0
        self.t0 = time.monotonic()
        self.told_at = 0.0            # when the ranks were told (the notice written)
        self._set_id: str | None = None  # the newcomers' engine set (stopped by cancel)
        self._new_ids: list[int] = []
        self._leavers: Leavers | None = None  # a shrink's leavers while their processes exit

    @property
    def grows(self) -> bool:
        return self.n > self.old

    def begin(self) -> None:
        """Newcomers started and registered (a grow), then the ranks told: they act at their next
        commit. ``ScaleRefused`` when the cluster cannot resize (nothing started)."""
        from ..engines import _elastic
        from ..runtime.internal import debugger

        cluster = self.cluster
        check_scale(cluster, self.n, running_cell=True)
        if self.grows:
            client = cluster._running_client
            known = set(client.ids)
            sweep_mpich_segments()  # a stale segment named as the new job's fails its MPI_Init
            self._set_id = str(cluster._running_cluster.start_engines_sync(len(self.added)))
            cluster._watch()
            self._new_ids = _newcomers(cluster, known, self.added)
        self.gen = next_generation(cluster)
        self.told_at = time.time()
        debugger.write_record(_elastic.notice_path(cluster.where_dir), {
            "gen": self.gen, "dead": self.added or self.removed, "root": 0,
            "resize": "grow" if self.grows else "shrink", "size": self.n, "ts": self.told_at})

    def port(self) -> str | None:
        """The port rank 0 opened in its reset (a grow), once it has; None before."""
        from ..engines import _elastic
        from ..runtime.internal import debugger

        path = _elastic.port_path(self.cluster.where_dir, self.gen)
        record = debugger.read_record(path)
        if record is None:
            return None
        debugger.remove(path)
        return str(record["port"])

    def join(self, port: str) -> dict[int, int]:
        """The newcomers join the old ranks on ``port`` and get the rank set-up; the cluster's
        rows and engine ids grow to ``n``. Returns rank -> engine id of each newcomer."""
        from ..engines import _respawn

        cluster = self.cluster
        client = cluster._running_client
        plan = cluster.plan_used
        gpus = list(plan.gpus) if plan is not None and plan.gpus else []
        host = cluster.ranks[0]["host"]
        for rank in self.added:  # rows for the ranks to come, as _scale._grow makes them
            device = f"cuda:0 (GPU {gpus[rank % len(gpus)]})" if gpus else "cpu"
            cluster.ranks.append(RankRow(rank=rank, size=self.n, local_rank=rank, host=host, pid=0, device=device))
            cluster.engine_ids.append(-1)
        cluster.size = self.n
        joins = {eid: client[eid].apply_async(_respawn.join, port, self.added, self.gen, 0) for eid in self._new_ids}
        ranks_of = {eid: int(_result(ar, cluster.setup_timeout, "joining the world"))  # type: ignore[call-overload]
                    for eid, ar in joins.items()}
        _forget_notice(cluster.where_dir, self.gen)
        _set_up_newcomers(cluster, ranks_of, self.setup_code)
        for row in cluster.ranks:
            row["size"] = self.n
        cluster.view = client[cluster.engine_ids]
        cluster.view.block = False
        self._set_id = None  # joined: theirs to keep
        settle_new_world(cluster)
        return {rank: eid for eid, rank in ranks_of.items()}

    def stop_leavers(self) -> None:
        """After every rank beyond ``n`` left the world (a shrink): the cluster cut to ``n`` ranks
        and the leavers' engines asked to shut down, without waiting for them: :meth:`leavers_gone`
        says when every process of theirs has exited (``_scale.Leavers``)."""
        _forget_notice(self.cluster.where_dir, self.gen)
        self._leavers = Leavers(self.cluster, self.n)
        for row in self.cluster.ranks:
            row["size"] = self.n
        self.cluster._write_sidecar()  # the Ring panel shows the new world at once

    def leavers_gone(self, wait: bool = False) -> list[str] | None:
        """None while a process of the leavers still runs (``wait``: wait for them, bounded);
        once all are gone (stragglers killed at the bound), the cluster's files and watchdog are
        brought to the new world and the notes of those killed are returned, once."""
        leavers = self._leavers
        if leavers is None:
            return []
        notes = leavers.wait() if wait else leavers.gone()
        if notes is not None:
            self._leavers = None
            settle_new_world(self.cluster)
        return notes

    def cancel(self) -> None:
        """Take the notice back; newcomers that never joined are stopped (their engine set)."""
        cluster = self.cluster
        _forget_notice(cluster.where_dir, self.gen)
        if self._set_id is not None:
            set_id, self._set_id = self._set_id, None
            client = cluster._running_client
            try:
                client.shutdown(targets=self._new_ids, hub=False, block=False)
            finally:
                cluster._running_cluster.stop_engines_sync(set_id)
            deadline = time.monotonic() + cluster.engine_timeout
            while set(self._new_ids) & set(client.ids) and time.monotonic() < deadline:
                time.sleep(0.05)
            cluster._watch()

    def note(self) -> str:
        """What the notebook says once the world has its new size."""
        took = time.monotonic() - self.t0
        head = (f"(host discovery: {self.slots} slots) Resized {self.old} -> {self.n} ranks at the next commit "
                f"of elastic.run, {took:.1f} s after the change was seen: ")
        if self.grows:
            return head + (f"rank(s) {_rank_list(self.added)} are new and run this cell from its start, "
                           "taking the state from rank 0 (their namespace is fresh otherwise).")
        return head + (f"rank(s) {_rank_list(self.removed)} left the world at that commit (their engines "
                       f"are shutting down); training goes on on rank(s) {_rank_list(list(range(self.n)))}.")
