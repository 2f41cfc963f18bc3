"""A live one-host cluster grown or shrunk between cells: ``%ring scale N`` (issue 34, item 3).

Built on the replacement in place (``_respawn``, ``engines._respawn``); the ranks' side is
``engines._scale``. Every rank that stays keeps its Python namespace and its rank number.

- **Grow** ``N_old -> N``: ranks ``N_old..N-1`` are started as a replacement's newcomers are (an
  ``mpiexec -n k`` job of their own under keepers), every rank of the old world leaves it with no
  rank excluded, the newcomers join keyed by their new numbers, and the rank set-up runs on them:
  :func:`~jupyter_ring.cluster._respawn.replace_ranks` with rows for ranks that did not exist.
- **Shrink** ``N_old -> N``: every rank stops its runtime; ranks ``0..N-1`` make their world of
  ``N`` with ``Create_group`` (no newcomer, no port), then the engines of ranks ``N..N_old-1`` are
  shut down (an engine that asked to end exits 0 and its keeper with it, so gforker ends no one)
  and every process of theirs is waited for, then killed if it outlives the bound; the shared-memory
  segments that no live rank maps are removed.
- Either way, every rank of the new world then loses torch.distributed's groups of the old world,
  rank 0 serves a new rendezvous store (the old one holds the old groups' keys, which a new
  ``init_process_group`` would read) and every rank gets torchrun's environment for the new size;
  the default group is made again where ``--torch-distributed`` made it (``engines._scale``). Process sets are the user's to add again,
  as after a replacement.

Refused (:class:`ScaleRefused`, nothing changed): fewer than 1 rank, the size it has, outside
``--min-ranks``/``--max-ranks``, a multi-host cluster (one host only for now), a cluster without
keepers (``--max-restarts 0``), one whose replacement failed, one with a dead rank, and while a
cell runs on any rank.
A step that fails raises :class:`~jupyter_ring.errors.ClusterError`; ``%ring restart`` is the way on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import psutil

from ..engines._setup import RankRow
from ..errors import ClusterError, _rank_list
from ._procs import kill_processes, process_trees, wait_exit
from ._respawn import (_busy, _everywhere, _result, next_generation, remake_torch_world, replace_ranks,
                       settle_new_world)

if TYPE_CHECKING:
    from ._ring import RingCluster

__all__ = ["Scaled", "ScaleRefused", "scale_bounds", "check_scale", "scale", "scaled_note"]

# seconds the engines of the ranks that leave get to exit once asked, before they are killed
_EXIT_BOUND = 10.0


class ScaleRefused(ClusterError):
    """``%ring scale`` cannot do what was asked on this cluster now; nothing was changed."""


class Scaled(NamedTuple):
    """What :func:`scale` did: the sizes, the ranks added or removed, how long it took, and
    notes (torch.distributed groups dropped, processes that had to be killed)."""

    old: int
    new: int
    added: list[int]
    removed: list[int]
    seconds: float
    notes: list[str]


def scale_bounds(n: int | None, min_ranks: int | None, max_ranks: int | None, where: str) -> dict[str, int]:
    """``%ring start``'s ``--min-ranks``/``--max-ranks`` as RingCluster options (those given);
    ``ValueError`` naming ``where`` when they make no sense or ``-n`` is outside them."""
    low = 1 if min_ranks is None else min_ranks
    if low < 1:
        raise ValueError(f"{where} --min-ranks {low}: a cluster needs at least 1 rank")
    if max_ranks is not None and max_ranks < low:
        raise ValueError(f"{where} --max-ranks {max_ranks} is below --min-ranks {low}")
    if n is not None and not low <= n <= (n if max_ranks is None else max_ranks):
        raise ValueError(f"{where} -n {n} is outside --min-ranks {low} .. --max-ranks "
                         f"{'unbounded' if max_ranks is None else max_ranks}")
    return {name: value for name, value in (("min_ranks", min_ranks), ("max_ranks", max_ranks))
            if value is not None}


def check_scale(cluster: RingCluster, n: int, running_cell: bool = False) -> None:
    """:class:`ScaleRefused` with what is wrong and the fix, when ``cluster`` cannot go to ``n``
    ranks now; nothing is changed either way. ``running_cell``: the resize happens inside the
    running cell (``_elastic_resize``), so busy ranks are expected."""
    size = cluster.size
    if n < 1:
        raise ScaleRefused(f"a cluster needs at least 1 rank (asked {n}); %ring stop stops every rank")
    plan = cluster.plan_used
    if plan is None or not plan.one_host:
        raise ScaleRefused("resizing a live cluster is one-host only for now: this cluster runs on "
                           "several hosts (Hydra or Slurm); %ring stop, then %ring start with the "
                           "new -n")
    if not plan.keeper:
        raise ScaleRefused("this cluster's ranks run without keepers (--max-restarts 0, or an "
                           "mpiexec other than gforker): a rank cannot leave or join without "
                           "ending the job; %ring stop, then %ring start -n N with --max-restarts "
                           "1 or more")
    if cluster.replace_failed:
        raise ScaleRefused("replacing a rank in place failed earlier on this cluster; %ring restart "
                           "starts every rank afresh")
    if n == size:
        raise ScaleRefused(f"the cluster has {size} ranks already: nothing to do")
    if n < cluster.min_ranks:
        raise ScaleRefused(f"{n} is below --min-ranks {cluster.min_ranks} (set by %ring start): "
                           f"scale to {cluster.min_ranks} or more, or start the cluster again "
                           f"with a lower --min-ranks")
    if cluster.max_ranks is not None and n > cluster.max_ranks:
        raise ScaleRefused(f"{n} is above --max-ranks {cluster.max_ranks} (set by %ring start): "
                           f"scale to {cluster.max_ranks} or fewer, or start the cluster again "
                           f"with a higher --max-ranks")
    dead = cluster.dead_ranks()
    if dead:  # (%ring scale replaces them first, where it can: _alive_cluster)
        raise ScaleRefused(f"rank(s) {_rank_list(dead)} are dead: run a cell to have them replaced in "
                           "place, or %ring restart, then scale")
    if running_cell:
        return
    client = cluster._running_client
    busy = [r for r, eid in enumerate(cluster.engine_ids) if _busy(client, eid)]
    if busy:
        raise ScaleRefused(f"a cell is still running on rank(s) {_rank_list(busy)}: wait for it to end "
                           "or interrupt it (%ring where shows where it is), then scale")


def scale(cluster: RingCluster, n: int, setup_code: str) -> Scaled:
    """Grow or shrink ``cluster`` to ``n`` ranks (see the module); ``setup_code``: the rank
    set-up the newcomers run. :class:`ScaleRefused` first if it cannot (:func:`check_scale`)."""
    check_scale(cluster, n)
    t0, old = time.monotonic(), cluster.size
    try:
        notes = _grow(cluster, n, setup_code) if n > old else _shrink(cluster, n)
        for row in cluster.ranks:
            row["size"] = n
        notes += remake_torch_world(cluster, "the resize (%ring scale)")
    except ClusterError as exc:
        cluster.replace_failed = True  # the world may be half re-formed: %ring restart only
        cluster._watch()
        raise ClusterError(str(exc).replace("replacing the dead rank(s)", f"scaling {old} -> {n} ranks")
                           ) from exc
    except BaseException:
        cluster.replace_failed = True
        cluster._watch()
        raise
    settle_new_world(cluster)
    added, removed = list(range(old, n)), list(range(n, old))
    return Scaled(old, n, added, removed, time.monotonic() - t0, notes)


def _grow(cluster: RingCluster, n: int, setup_code: str) -> list[str]:
    """Ranks ``size..n-1`` started and joined, as newcomers of a replacement (``replace_ranks``)."""
    plan = cluster.plan_used
    gpus = list(plan.gpus) if plan is not None and plan.gpus else []
    host = cluster.ranks[0]["host"]
    new = list(range(cluster.size, n))
    for rank in new:  # rows for the ranks to come: one host, a GPU as %ring start deals them out
        device = f"cuda:0 (GPU {gpus[rank % len(gpus)]})" if gpus else "cpu"
        cluster.ranks.append(RankRow(rank=rank, size=n, local_rank=rank, host=host, pid=0, device=device))
        cluster.engine_ids.append(-1)
    cluster.size = n  # the old ranks are replace_ranks' survivors, the new ones its "dead"
    replace_ranks(cluster, new, setup_code, next_generation(cluster))
    return []


def _shrink(cluster: RingCluster, n: int) -> list[str]:
    """Every rank stops its runtime; ranks ``0..n-1`` re-form a world of ``n`` (``engines._scale.shrink``),
    then the others are stopped (:func:`_stop_leavers`)."""
    from ..engines import _scale

    client = cluster._running_client
    ids = list(cluster.engine_ids)
    stays = _everywhere(client, ids, lambda eid: client[eid].apply_async(_scale.shrink, n),
                        cluster.setup_timeout, "re-forming the world")
    if stays != [r < n for r in range(len(ids))]:
        raise ClusterError(f"the ranks disagree on who stays: {stays}")
    return _stop_leavers(cluster, n)


def _stop_leavers(cluster: RingCluster, n: int) -> list[str]:
    """The cluster's ranks cut to ``0..n-1``; the engines of the others (their runtime stopped
    by ``_shrink``) shut down, and every process of theirs waited for: engine, nanny, keeper.
    Returns a note when some had to be killed."""
    return Leavers(cluster, n).wait()


class Leavers:
    """The ranks beyond ``n`` leaving ``cluster``: made, the cluster's ranks are cut to
    ``0..n-1`` and the others' engines asked to shut down; :meth:`gone` looks (without waiting)
    whether every process of theirs (engine, nanny, keeper) has exited, and kills those still
    there ``_EXIT_BOUND`` seconds after the request; :meth:`wait` waits for that."""

    def __init__(self, cluster: RingCluster, n: int) -> None:
        rows, ids = cluster.ranks[n:], cluster.engine_ids[n:]
        self.procs = _rank_processes([row["pid"] for row in rows])
        cluster.ranks, cluster.engine_ids, cluster.size = cluster.ranks[:n], cluster.engine_ids[:n], n
        cluster.view = cluster._running_client[cluster.engine_ids]
        cluster.view.block = False
        cluster.replaced = {r: k for r, k in cluster.replaced.items() if r < n}
        cluster.steps = {r: s for r, s in cluster.steps.items() if r < n}
        cluster._running_client.shutdown(targets=ids, hub=False, block=False)
        self.deadline = time.monotonic() + _EXIT_BOUND

    def gone(self) -> list[str] | None:
        """None while a process of the leavers runs and the bound has not passed; else (the
        stragglers killed) the notes of those that had to be killed."""
        running = [p for p in self.procs if _running(p)]
        if running and time.monotonic() < self.deadline:
            return None
        return self._kill(running)

    def wait(self) -> list[str]:
        """Wait for the leavers' processes up to the deadline; kill what is left; the notes of
        those that had to be killed."""
        return self._kill(wait_exit(self.procs, max(0.0, self.deadline - time.monotonic())))

    @staticmethod
    def _kill(stuck: list[psutil.Process]) -> list[str]:
        kill_processes(stuck)
        if not stuck:
            return []
        return [f"(killed {len(stuck)} process(es) of the removed rank(s) that did not exit within "
                f"{_EXIT_BOUND:g} s: {', '.join(str(p.pid) for p in stuck)})"]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _rank_processes(pids: Sequence[int]) -> list[psutil.Process]:
    """The engines ``pids``, their keepers (each engine's parent, started by gforker) and every
    child of those (the engine's nanny)."""
    roots = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            parent = proc.parent()
        except psutil.Error:
            continue
        keeper = parent is not None and "jupyter_ring.engines._keeper" in " ".join(_cmdline(parent))
        roots.append(parent.pid if keeper and parent is not None else pid)
    return list(process_trees(roots).values())


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def scaled_note(done: Scaled) -> str:
    """What the notebook says after a scale: which ranks are new (fresh namespaces, and how to
    give them variables) or gone, and what the ranks that stayed kept."""
    kept = list(range(min(done.old, done.new)))
    head = f"Scaled {done.old} -> {done.new} ranks in {done.seconds:.1f} s: "
    if done.added:
        body = (f"rank(s) {_rank_list(done.added)} are new, with a fresh namespace (only `ring`); rank(s) "
                f"{_rank_list(kept)} kept their variables. Copy variables to the new rank(s) with "
                f"%ring sync NAME [NAME ...] --from 0.")
    else:
        body = (f"rank(s) {_rank_list(done.removed)} stopped, their variables gone; rank(s) {_rank_list(kept)} "
                f"kept theirs.")
    tail = (f" ring.size() is {done.new} on every rank; process sets made with ring.add_process_set "
            "belong to the old world: add them again.")
    return " ".join([head + body + tail, *done.notes])
