"""Ranks replaced in place: the kernel's side of ``engines._respawn`` (issue 34, item 1).

A rank that dies (SIGKILL, a segfault, an out-of-memory kill) is replaced by a new engine with
the same rank number; the survivors keep their namespaces. On one host the ranks run under the
keeper (``engines._keeper``), so gforker does not end the survivors; :func:`replace_ranks`

1. interrupts the survivors (the cell that was running fails, as without respawn) and starts
   the newcomers' job (``mpiexec -n k``, an ipyparallel engine set of its own);
2. has the survivors leave the old world (``engines._respawn.leave``: the runtime stops, a
   communicator over the survivors alone, an MPI port);
3. has the survivors accept and the newcomers join on that port (``accept``/``join``): the
   runtime starts on the new world, each newcomer with the dead rank's number;
4. runs the rank set-up on the newcomers (GPU binding, ``ring``, hooks, torchrun's environment).

Every wait is bounded (``RingCluster.engine_timeout``/``setup_timeout``); a failure raises
:class:`~jupyter_ring.errors.ClusterError` naming the step, and ``%ring restart`` is the way on.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

from ..engines._setup import RankRow
from ..errors import ClusterError, _rank_list
from ._plan import torchrun_environment
from ._procs import remove_shm_files, shm_files, sweep_mpich_segments
from ._start import SETUP_CODE, setup_namespace

if TYPE_CHECKING:
    import ipyparallel as ipp

    from ._ring import RingCluster

__all__ = ["Replacement", "respawn", "next_generation", "replace_ranks", "elastic_survivors", "replaced_note", "elastic_note", "newcomer_gpus"]


class Replacement(NamedTuple):
    """What :func:`replace_ranks` did: the ranks replaced, their new rows, how long it took."""

    ranks: list[int]
    rows: list[RankRow]
    seconds: float
    notes: tuple[str, ...] = ()  # torch.distributed's groups of the old world that were dropped


def newcomer_gpus(row: RankRow, planned: Sequence[str] | None) -> list[str] | None:
    """The GPU list a newcomer binds from (``engines._setup.bind_device``): the dead rank's own
    GPU (its row says ``cuda:0 (GPU 2)``), else what the plan gave every rank."""
    found = re.search(r"\(GPU ([^)]+)\)", row["device"])
    if found:
        return [found.group(1)]
    return None if planned is None else list(planned)


def respawn(cluster: RingCluster, dead: Iterable[int], elastic: bool = False) -> Replacement:
    """``RingCluster.respawn``: replace the ``dead`` ranks in place (:func:`replace_ranks`), and
    keep the cluster's count of replacements, its shared-memory files, watchdog and sidecar up
    to date. ClusterError if it cannot be done or a step fails: ``%ring restart`` then."""
    dead = sorted(set(dead))
    if not cluster.can_respawn(dead):
        raise ClusterError(f"rank(s) {_rank_list(dead)} cannot be replaced in place "
                           f"({cluster.restarts} of --max-restarts {cluster.max_restarts} used, or "
                           "not a one-host cluster); run %ring restart")
    cluster.restarts += len(dead)
    try:
        done = replace_ranks(cluster, dead, SETUP_CODE, next_generation(cluster), elastic)
        if not elastic:  # (elastic: the survivors run their cell on; its torch groups are the user's)
            event = f"the replacement of rank(s) {_rank_list(dead)}"
            done = done._replace(notes=tuple(remake_torch_world(cluster, event)))
    except BaseException:
        # the survivors may have left the old world, a late newcomer may still register:
        # no second try on this cluster, %ring restart starts every rank afresh
        cluster.replace_failed = True
        cluster._watch()
        raise
    for rank in dead:
        cluster.replaced[rank] = cluster.replaced.get(rank, 0) + 1
    settle_new_world(cluster)
    return done


def next_generation(cluster: RingCluster) -> int:
    """The number of the cluster's next change of world (a replacement, a resize): one counter
    for both, so that a rank that acted on one notice never takes the next for it (``gen`` of
    ``engines._elastic``)."""
    cluster.generation += 1
    return cluster.generation


def settle_new_world(cluster: RingCluster) -> None:
    """After a replacement or a resize: the segments no live rank maps removed (the dead ranks'
    job's, a killed replacement's never unlinked, a job whose every rank left: now, not at stop,
    so that a long session of kills leaks none), the watchdog and the sidecar told of the new
    processes and ranks."""
    live = shm_files(cluster._local_rank_pids())
    remove_shm_files(cluster._shm - live)
    cluster._shm = live
    cluster._watch()
    cluster._write_sidecar()


def replace_ranks(cluster: RingCluster, dead: Sequence[int], setup_code: str, gen: int,
                  elastic: bool = False) -> Replacement:
    """Replace the ``dead`` ranks of ``cluster`` in place (see the module); ``setup_code``: the
    rank set-up every engine ran at start (``ring.init()`` there finds the runtime started);
    ``gen``: the cluster's count of changes of world, this one included (:func:`next_generation`).
    ``elastic``: the survivors run ``elastic.run`` in the cell, which goes on: they are told by a
    notice, not interrupted, and re-form the world from inside ``run`` (``engines._elastic``)."""
    from ..engines import _respawn

    t0 = time.monotonic()
    dead = sorted(set(dead))
    client, ipc = cluster._running_client, cluster._running_cluster
    survivors = [r for r in range(cluster.size) if r not in dead]
    if not survivors:
        raise ClusterError("every rank died: there is no survivor to keep; run %ring restart")
    known = set(client.ids)
    if elastic:  # first: the survivors give their collectives up while the newcomers start
        _tell_survivors(cluster.where_dir, gen, dead, survivors[0])
    # the newcomers' process start is the longest step: it runs while the survivors leave
    sweep_mpich_segments()  # a stale segment named as the new job's fails its MPI_Init
    ipc.start_engines_sync(len(dead))
    cluster._watch()
    survivor_ids = [cluster.engine_ids[r] for r in survivors]
    if elastic:
        port = _port_of(cluster.where_dir, gen, cluster.setup_timeout)
    else:
        port = _leave_between_cells(cluster, dead, survivors, survivor_ids)
    new_ids = _newcomers(cluster, known, dead)
    joins = {eid: client[eid].apply_async(_respawn.join, port, dead, gen, survivors[0]) for eid in new_ids}
    if not elastic:  # (elastic: the survivors accept inside their running cell)
        _everywhere(client, survivor_ids, lambda eid: client[eid].apply_async(_respawn.accept, port),
                    cluster.setup_timeout, "taking the newcomers in")
    ranks_of = {eid: int(_result(ar, cluster.setup_timeout, "joining the world"))  # type: ignore[call-overload]
                for eid, ar in joins.items()}
    if elastic:  # every survivor has taken it in (the merge is collective): no one needs it now
        _forget_notice(cluster.where_dir, gen)
    _set_up_newcomers(cluster, ranks_of, setup_code)
    cluster.view = client[cluster.engine_ids]
    cluster.view.block = False
    return Replacement(dead, [cluster.ranks[r] for r in dead], time.monotonic() - t0)


def remake_torch_world(cluster: RingCluster, event: str) -> list[str]:
    """torch.distributed for the world ``event`` made (a resize, a replacement; ``engines._scale``):
    the old world's groups dropped on every rank, a new rendezvous store on rank 0, torchrun's
    environment for the new world on every rank (the default group made again with
    ``--torch-distributed``). The notes of the ranks that had groups of their own."""
    from ..engines import _scale

    if cluster.rendezvous is None:
        return []
    client, ids, timeout = cluster._running_client, cluster.engine_ids, cluster.setup_timeout
    ours = cluster.torch_backend is not None
    notes = _everywhere(client, ids, lambda eid: client[eid].apply_async(_scale.drop_torch, ours, event),
                        timeout, "dropping torch.distributed's groups")
    address = cluster.rendezvous[0]
    cluster.rendezvous = address, port = cast("tuple[str, int]", _result(
        client[ids[0]].apply_async(_scale.rendezvous, address), timeout, "torch.distributed's rendezvous"))
    hosts = [row["host"] for row in cluster.ranks]
    run_id = cluster._running_cluster.cluster_id
    envs = {eid: torchrun_environment(rank, hosts, address, port, run_id) for rank, eid in enumerate(ids)}
    _everywhere(client, ids, lambda eid: client[eid].apply_async(_scale.retorch, envs[eid], cluster.torch_backend),
                timeout, "torch.distributed's new world")
    return sorted({str(note) for note in notes if note})


def _newcomers(cluster: RingCluster, known: set[int], dead: list[int]) -> list[int]:
    """The engine ids of the newcomers, once every one has registered (within ``engine_timeout``)."""
    client = cluster._running_client
    deadline = time.monotonic() + cluster.engine_timeout
    while len(set(client.ids) - known) < len(dead):
        if time.monotonic() > deadline:
            raise ClusterError(f"the replacement of rank(s) {_rank_list(dead)} did not register in "
                               f"{cluster.engine_timeout:g} s; run %ring restart")
        time.sleep(0.02)
    return sorted(set(client.ids) - known)


def _set_up_newcomers(cluster: RingCluster, ranks_of: dict[int, int], setup_code: str) -> None:
    """Run the rank set-up on each newcomer (engine id -> its rank in ``ranks_of``) and give it
    torchrun's environment; its row and engine id take the dead rank's place."""
    from ..engines import _torch

    client = cluster._running_client
    plan = cluster.plan_used
    rows = cluster.ranks
    for eid, rank in ranks_of.items():
        view = client[eid]
        view.push(setup_namespace(newcomer_gpus(rows[rank], plan.gpus if plan else None), cluster.user_umask,
                                  cluster.where_dir, plan.torch.master_addr if plan else "127.0.0.1",
                                  cluster.setup_timeout), block=False)
        _result(view.execute(setup_code, block=False), cluster.setup_timeout, "the rank set-up")
        info = view.pull("_jr_info", block=False)
        rows[rank] = cast(RankRow, _result(info, cluster.setup_timeout, "the rank set-up"))
        cluster.engine_ids[rank] = eid
    if cluster.rendezvous is not None:
        hosts = [row["host"] for row in rows]
        address, port_no = cluster.rendezvous
        for eid, rank in ranks_of.items():
            env = torchrun_environment(rank, hosts, address, port_no, cluster._running_cluster.cluster_id)
            _result(client[eid].apply_async(_torch.start, env, None), cluster.setup_timeout,
                    "torchrun's environment")


def _leave_between_cells(cluster: RingCluster, dead: list[int], survivors: list[int],
                         survivor_ids: list[int]) -> str:
    """Without elastic code: end the running cell on the survivors and have them leave the old
    world through requests of the kernel; the port the newcomers connect to."""
    from ..engines import _respawn

    client = cluster._running_client
    # the running cell ends there too; only busy ranks are signalled, and leaving waits until
    # their cell has ended: a SIGINT that reached an idle rank late would interrupt the leaving
    busy = [r for r, eid in zip(survivors, survivor_ids) if _busy(client, eid)]
    if busy:
        cluster.signal_ranks(signal.SIGINT, busy)
        _wait_idle(client, [cluster.engine_ids[r] for r in busy], busy, cluster.setup_timeout)
    ports = _everywhere(client, survivor_ids, lambda eid: client[eid].apply_async(_respawn.leave, dead),
                        cluster.setup_timeout, "leaving the old world")
    return str(next(p for p in ports if p))


def elastic_survivors(cluster: RingCluster, dead: Sequence[int]) -> bool:
    """Whether every rank but the ``dead`` is inside ``elastic.run`` now (each says so with a
    file, ``engines._elastic``): a replacement then lets the cell go on."""
    from ..engines import _elastic

    survivors = [r for r in range(cluster.size) if r not in dead]
    return bool(survivors) and _elastic.running_ranks(cluster.where_dir, survivors) == survivors


def _tell_survivors(directory: str, gen: int, dead: list[int], root: int) -> None:
    """The notice every survivor's runtime reads (``engines._elastic``): ranks ``dead`` died."""
    from ..engines import _elastic
    from ..runtime.internal import debugger

    for rank in dead:  # a dead rank was inside elastic.run: the newcomer is not, yet
        debugger.remove(_elastic.running_path(directory, rank))
    debugger.write_record(_elastic.notice_path(directory), {"gen": gen, "dead": dead, "root": root})


def _port_of(directory: str, gen: int, timeout: float) -> str:
    """The port the first survivor opened inside its reset (``engines._elastic.reform``)."""
    from ..engines import _elastic
    from ..runtime.internal import debugger

    path = _elastic.port_path(directory, gen)
    deadline = time.monotonic() + timeout
    while True:
        record = debugger.read_record(path)
        if record is not None:
            debugger.remove(path)
            return str(record["port"])
        if time.monotonic() > deadline:
            raise ClusterError(f"the survivors did not re-form their world inside elastic.run within "
                               f"{timeout:g} s (no port from the first survivor); run %ring restart")
        time.sleep(0.02)


def _forget_notice(directory: str, gen: int) -> None:
    from ..engines import _elastic
    from ..runtime.internal import debugger

    path = _elastic.notice_path(directory)
    record = debugger.read_record(path)
    if record is not None and record.get("gen") == gen:
        debugger.remove(path)


def _busy(client: ipp.Client, engine_id: int) -> bool:
    """Whether the engine has a request queued or running (a cell, an apply)."""
    status = cast("dict[int, dict[str, int]]", client.queue_status(targets=[engine_id], verbose=False))
    return bool(status.get(engine_id, {}).get("queue", 0))


def _wait_idle(client: ipp.Client, engine_ids: Sequence[int], ranks: Sequence[int], timeout: float) -> None:
    """Wait until none of the engines has a request left; ClusterError naming ``ranks`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(_busy(client, eid) for eid in engine_ids):
        if time.monotonic() > deadline:
            raise ClusterError(f"rank(s) {_rank_list(list(ranks))} did not end their cell within {timeout:g} s "
                               "of the interrupt; run %ring restart")
        time.sleep(0.05)


def _everywhere(client: ipp.Client, engine_ids: Sequence[int],
                send: Callable[[int], ipp.AsyncResult], timeout: float, what: str) -> list[object]:
    """``send(eid)`` on every engine, collective over them: the results in order. A request that
    ipykernel aborted (it came just after the failed cell, see ``RingCluster.torch_repair_note``)
    is sent again to that engine alone, while the others wait for it inside the collective."""
    import ipyparallel as ipp

    pending = {eid: send(eid) for eid in engine_ids}
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while pending:
        for eid, ar in list(pending.items()):
            if not ar.ready():
                continue
            try:
                results[eid] = ar.get()
            except ipp.error.TaskAborted:
                pending[eid] = send(eid)
                continue
            except Exception as exc:
                raise ClusterError(f"replacing the dead rank(s) failed while {what} on engine "
                                   f"{eid}: {type(exc).__name__}: {exc}; run %ring restart") from exc
            del pending[eid]
        if pending and time.monotonic() > deadline:
            raise ClusterError(f"replacing the dead rank(s): {what} did not finish in {timeout:g} s "
                               "on every survivor; run %ring restart")
        time.sleep(0.01)
    return [results[eid] for eid in engine_ids]


def _result(ar: ipp.AsyncResult, timeout: float, what: str) -> object:
    if not ar.wait(timeout):
        raise ClusterError(f"replacing the dead rank(s): {what} did not finish in {timeout:g} s "
                           "on the new rank; run %ring restart")
    try:
        return ar.get()
    except Exception as exc:
        raise ClusterError(f"replacing the dead rank(s) failed in {what} on the new rank: "
                           f"{type(exc).__name__}: {exc}; run %ring restart") from exc


def replaced_note(done: Replacement, size: int, restarts: int, max_restarts: int) -> str:
    """What the notebook says after a replacement: which ranks are new, that their namespaces
    are fresh, and how to give them the survivors' variables."""
    ranks = _rank_list(done.ranks)
    kept = [r for r in range(size) if r not in done.ranks]
    return (f"Rank(s) {ranks} replaced in place in {done.seconds:.1f} s (restart {restarts} of "
            f"--max-restarts {max_restarts}): the new rank(s) have a fresh namespace (only `ring`); "
            f"rank(s) {_rank_list(kept)} kept their variables. Copy variables to the new rank(s) with "
            f"%ring sync NAME [NAME ...] --from {kept[0]}; the cell that was running must be run again."
            + "".join(f"\n{note}" for note in done.notes))


def elastic_note(done: Replacement, restarts: int, max_restarts: int) -> str:
    """What the notebook says when a rank was replaced while ``elastic.run`` ran: the cell goes on."""
    ranks = _rank_list(done.ranks)
    return (f"Rank(s) {ranks} replaced in place in {done.seconds:.1f} s (restart {restarts} of "
            f"--max-restarts {max_restarts}); elastic.run goes on from its last commit: the new rank(s) "
            f"run this cell from its start and take the state from the survivors.")
