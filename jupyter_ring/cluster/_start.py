"""Starting a :class:`RingCluster`: the controller and the engines of its :class:`LaunchPlan`,
the wait for every engine to register, and the ranks' set-up (``ring.init()``, GPUs, torchrun's
environment).

``start`` is ``RingCluster.start``'s body; ``SETUP_CODE`` is what every engine runs first (a
replaced rank's too, ``_respawn``); ``not_ready`` says why a start gave up.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import psutil

from ..engines._setup import RankRow
from ..errors import ClusterError, _rank_list
from ._death import died_starting
from ._launchers import curve_client, ipp_cluster
from ._plan import LaunchPlan, TorchWorld, torchrun_environment
from ._procs import Watchdog, live_process, shm_files, sweep_mpich_segments

if TYPE_CHECKING:
    # ipyparallel ships no type information (no py.typed, no stubs): mypy reads its classes as
    # Any, and the names say which object is meant
    import ipyparallel as ipp

    from ._ring import RingCluster

__all__ = ["SETUP_CODE", "start", "not_ready", "setup_namespace", "setup_unfinished"]

# Run first on every engine, in the user namespace: bind the GPU before any framework import,
# then start the runtime so that ``ring`` is there in every cell; rank 0 reserves the port of
# torch.distributed's rendezvous (engines._torch; torch itself is not imported).
SETUP_CODE = """\
import faulthandler as _jr_faulthandler, os as _jr_os, sys as _jr_sys
# a rank still here when the notebook is about to give up writes where it waits (every thread's
# stack) into the engines' output, which the notebook's error quotes; disarmed however it ends
_jr_faulthandler.dump_traceback_later(_jr_dump_after, file=_jr_sys.__stderr__)
try:
    _jr_os.umask(_jr_umask)
    import jupyter_ring.engines._setup as _jr_engine
    _jr_device = _jr_engine.bind_device(_jr_gpus)
    import jupyter_ring.runtime as ring
    ring.init()
    _jr_engine.watch_cells()
    _jr_engine.number_cells()
    _jr_engine.keep_own_errors()
    _jr_engine.address_interrupts()
    _jr_engine.reply_always()
    _jr_engine.ascii_logs()
    _jr_info = _jr_engine.describe(ring, _jr_device)
    _jr_engine.arm_where(_jr_where, ring.rank())
    _jr_engine.arm_debugger(_jr_where, ring.rank())
    _jr_engine.arm_elastic(_jr_where, ring.rank())
    import jupyter_ring.engines._torch as _jr_torch
    _jr_rendezvous = _jr_torch.reserve(ring, _jr_torch_addr)
finally:
    _jr_faulthandler.cancel_dump_traceback_later()
del _jr_engine, _jr_device, _jr_gpus, _jr_os, _jr_umask, _jr_where, _jr_torch, _jr_torch_addr
del _jr_faulthandler, _jr_sys, _jr_dump_after
"""


def start(rc: RingCluster) -> list[RankRow]:
    """Start controller and engines, bind devices, ``ring.init()``; return the rank rows."""
    if rc.running:
        raise ClusterError("a cluster is already running; %ring restart replaces it")
    # Owner-only from creation: every file and folder written while the cluster starts
    # (connection and cluster files, logs, pid files) is created 0600/0700 by this process
    # or by the controller, mpiexec and engines, which inherit this umask (ipyparallel's own
    # chmod after writing would leave a window). The ranks get the user's umask back in
    # SETUP_CODE, so files that cells write keep their usual modes. umask is per process:
    # another thread of this kernel creating a file meanwhile gets 0600 too (never looser).
    rc._user_umask = os.umask(0o077)
    try:
        plan = rc.plan()
        rc.note, rc.address = plan.note, plan.controller_ip
        rc.ipp_cluster = cluster = ipp_cluster(plan)
        try:
            if rc.watchdog:
                rc._watchdog = Watchdog(os.path.join(plan.profile_dir, "security"))
                rc._watchdog.start()
            cluster.start_controller_sync()
            rc._watch()
            sweep_mpich_segments()  # a stale segment named as the job's fails its MPI_Init
            cluster.start_engines_sync(plan.n)
            rc._watch()
            with curve_client():
                rc.client = cluster.connect_client_sync()
            _wait_for_engines(rc, plan)
            _setup_ranks(rc, plan)
        except BaseException:
            rc.stop()
            raise
    finally:
        os.umask(rc._user_umask)
    return rc.ranks


def _wait_for_engines(rc: RingCluster, plan: LaunchPlan) -> None:
    """Wait until the plan's ``n`` engines registered; ClusterError (:func:`not_ready`) when its
    ``engine_timeout`` (the option's, grown for ranks beyond the cores) has passed with no
    engine registering for ``engine_timeout`` (the option's, at most 30 s): a start still
    making progress on a crowded host goes on. Or when the engines' job ends first. The job is
    looked at here every half second: ipyparallel hears of its end only while its event loop
    runs, which outside a running loop (a script, a test) it does not, and a job that failed at
    once cost the whole timeout."""
    client, n = rc._running_client, plan.n
    started = last_progress = time.monotonic()
    deadline, stall, seen = started + plan.engine_timeout, min(rc.engine_timeout, 30.0), 0
    while True:
        now = time.monotonic()
        if len(client.ids) > seen:
            seen, last_progress = len(client.ids), now
        left = max(deadline - now, last_progress + stall - now)
        try:
            client.wait_for_engines(n, timeout=max(min(left, 0.5), 0.01), block=True,
                                    interactive=False)
            return
        except TimeoutError:
            pass
        except Exception as exc:  # ipyparallel's EngineError: the engines' job ended
            if type(exc).__name__ != "EngineError":
                raise
            why = f"the engines' job ended while they started ({exc})"
            raise ClusterError(not_ready(rc, n, why)) from exc
        ended = _jobs_ended(rc._running_cluster) or died_starting(rc._engines_output())
        if ended:
            raise ClusterError(not_ready(rc, n, ended))
        if left <= 0.5:
            waited = max(plan.engine_timeout, round(time.monotonic() - started))
            raise ClusterError(not_ready(rc, n, timeout=waited))


def _setup_ranks(rc: RingCluster, plan: LaunchPlan) -> None:
    """Run ``SETUP_CODE`` on every engine and take the ranks' rows, in rank order."""
    client = rc._running_client
    ids = sorted(client.ids)
    view = client[ids]
    timeout = rc.setup_timeout + plan.start_allowance  # ranks beyond the cores queue for them
    view.push(setup_namespace(None if plan.gpus is None else list(plan.gpus), rc._user_umask, rc.where_dir,
                              plan.torch.master_addr, timeout), block=False)
    ar = view.execute(SETUP_CODE, block=False)
    if not ar.wait(timeout):
        raise ClusterError(setup_unfinished(rc, ar, ids, timeout))
    ar.get()
    infos, rendezvous = zip(*view.pull(("_jr_info", "_jr_rendezvous"), block=True))
    order = sorted(range(len(ids)), key=lambda i: infos[i]["rank"])
    rc.engine_ids = [ids[i] for i in order]
    rc.ranks = [infos[i] for i in order]
    rc.size = len(rc.ranks)
    rc.view = client[rc.engine_ids]
    rc.view.block = False
    rc.plan_used, rc.rendezvous = plan, rendezvous[order[0]]
    _start_torch(rc, plan.torch, rendezvous[order[0]], timeout)
    # MPICH unlinks its shared-memory segments only in MPI_Finalize: note them now, while
    # the ranks are alive, so that a rank killed later leaves no file behind (stop, watchdog)
    rc._shm = shm_files(rc._local_rank_pids())
    rc._watch()
    rc._write_sidecar()


def setup_namespace(gpus: list[str] | None, umask: int, where_dir: str, torch_addr: str,
                    timeout: float) -> dict[str, object]:
    """The names ``SETUP_CODE`` reads, pushed to a rank before it runs: its GPUs, the user's
    umask, the where folder, torch's rendezvous address, and when (a little before the notebook's
    ``timeout``) a rank still in the set-up writes its stacks for the notebook's error."""
    return {"_jr_gpus": gpus, "_jr_umask": umask, "_jr_where": where_dir, "_jr_torch_addr": torch_addr,
            "_jr_dump_after": max(1.0, timeout - _STACKS_AHEAD)}


# seconds before its timeout that the notebook has a rank still in the set-up write its stacks:
# enough for faulthandler's dump to reach the engines' output before the error quotes it
_STACKS_AHEAD = 2.0


def setup_unfinished(rc: RingCluster, ar: ipp.AsyncResult, ids: list[int], timeout: float) -> str:
    """Why the ranks' set-up timed out: which engines were still in it, and the engines' output
    from the first stacks a rank still in it wrote (``SETUP_CODE``'s faulthandler)."""
    client = rc._running_client
    stuck = [eid for eid, msg_id in zip(ids, ar.msg_ids) if msg_id in client.outstanding]
    where = (f"engine{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} still in it" if stuck
             else "every engine answered as the wait ended")
    return (f"the ranks' set-up (ring.init() and the torch rendezvous) did not finish on every rank in "
            f"{timeout:g} s: {where} ({len(ids) - len(stuck)} of {len(ids)} done). {_stacks(rc)}")


def _stacks(rc: RingCluster) -> str:
    """The engines' output from the first stacks a rank still in a set-up wrote (faulthandler's
    ``Timeout`` dump, armed a little before the notebook's timeout), and what to do."""
    lines = rc._engines_output().strip().splitlines()
    dumps = [i for i, line in enumerate(lines) if line.startswith("Timeout (")]  # faulthandler's header
    tail = "\n".join(lines[dumps[0]:][:80] if dumps else lines[-20:]) or "(the engines wrote nothing)"
    return (f"Each rank still in it wrote its stacks to the engines' output; its end:\n{tail}\n"
            "Run %ring stop and %ring start again; if it happens again, the stacks above say where "
            "the set-up waits (please report them).")


def _start_torch(rc: RingCluster, world: TorchWorld, rendezvous: tuple[str, int], timeout: float) -> None:
    """Give every rank torchrun's environment (computed here, from the plan's world, the
    hosts the ranks reported and rank 0's reserved port) and its torch.distributed guard;
    with --torch-distributed, the default process group."""
    from ..engines import _torch

    hosts = [row["host"] for row in rc.ranks]
    address, port = rendezvous
    run_id = rc._running_cluster.cluster_id
    pending = [rc._running_client[eid].apply_async(
        _torch.start, torchrun_environment(rank, hosts, address, port, run_id),
        world.init_backend, max(1.0, timeout - _STACKS_AHEAD)) for rank, eid in enumerate(rc.engine_ids)]
    deadline = time.monotonic() + timeout
    for ar in pending:
        if not ar.wait(max(0.0, deadline - time.monotonic())):
            stuck = [rank for rank, request in enumerate(pending) if not request.ready()]
            raise ClusterError(f"torch.distributed's set-up (init_process_group with {world.init_backend}) did "
                               f"not finish on every rank in {timeout:g} s: rank(s) {_rank_list(stuck)} "
                               f"still in it. {_stacks(rc)}")
    rc.torch_backend = pending[0].get()


def not_ready(rc: RingCluster, n: int, why: str = "", timeout: float | None = None) -> str:
    """Why ``start`` gave up: how many ranks registered, and the end of the engines' output
    (mpiexec's and the engines' own lines: where a rank that never came says why).
    ``why``: what ended the wait before the engine timeout (the job ended, a rank died);
    ``timeout``: the seconds waited (default ``engine_timeout``)."""
    ready = len(rc._running_client.ids) if rc.client is not None else 0
    lines = rc._engines_output().strip().splitlines()
    # a rank that crashed wrote its Python stacks (PYTHONFAULTHANDLER): they begin the excerpt
    crashed = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    tail = "\n".join(lines[crashed[-1]:crashed[-1] + 40] if crashed else lines[-20:])
    tail = tail or "(the engines wrote nothing)"
    waited = rc.engine_timeout if timeout is None else timeout
    why = why or f"they did not register with the controller within {waited:g} s"
    return (f"{n - ready} of {n} ranks did not start: {why} ({ready} registered). "
            f"The end of the engines' output:\n{tail}\n"
            "Run %ring start again; if it happens again, the lines above say why.")


def _jobs_ended(cluster: ipp.Cluster) -> str:
    """How the engine sets' local jobs (mpiexec) that have ended did ("" while all run). A
    batch job's launcher (sbatch) has no process of its own here: it is not looked at."""
    ended = []
    for launcher in cluster.engines.values():
        proc = getattr(launcher, "process", None)
        if isinstance(proc, psutil.Process) and live_process(proc.pid) is None:
            try:
                code: object = proc.wait(0)
            except psutil.Error:
                code = None  # reaped by ipyparallel's own wait meanwhile
            ended.append(f"the engines' job (pid {proc.pid}) ended while they started"
                         + ("" if code is None else f", exit code {code}"))
    return "; ".join(ended)
