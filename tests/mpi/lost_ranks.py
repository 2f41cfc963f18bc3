"""A wait on a rank said to be dead ends at once (issue 34, item 2): ``lost_ranks`` armed on every
rank with the last rank as dead, the other ranks' allreduce (the last rank never calls it) raises
``RankLostError``, a ``HorovodInternalError`` naming that rank, long before the stall timeout
(60 s); ``elastic.run`` catches it, restores the last commit and calls its reset hook; once the
source says nothing is lost, collectives are exact again. The last rank waits in a barrier of its
own meanwhile. Prints ``LOST_OK <rank>``.
"""

import time

import numpy as np

import jupyter_ring.runtime as ring
from jupyter_ring.runtime._engine.errors import HorovodInternalError, RankLostError
from jupyter_ring.runtime._engine.lost import lost_ranks
from jupyter_ring.runtime._horovod import elastic as _elastic
from jupyter_ring.runtime._horovod import elastic_world as _elastic_world

ring.init()
r, n = ring.rank(), ring.size()
from mpi4py import MPI  # noqa: E402

dead = n - 1
failures = []
told = {"dead": [dead]}
lost_ranks.arm(lambda: told["dead"])
if r != dead:
    others = MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Excl([dead]))
    state = _elastic.ObjectState(bcast_object=lambda obj, root=0: obj, get_rank=ring.rank, step=0)
    resets, attempts = [], []

    def reset_hook():
        resets.append(state.step)
        others.Barrier()  # (the respawn re-forms the world here)

    _elastic_world.on_world_reset(reset_hook)

    def train(state):
        attempts.append(state.step)
        if len(attempts) > 1:
            return state.step  # after the reset: no collective with the dead rank
        state.step = 5
        state.commit()
        state.step = 7
        t0 = time.monotonic()
        try:
            ring.allreduce(np.ones(3), name="with.the.dead")
        except RankLostError as exc:
            took = time.monotonic() - t0
            if not isinstance(exc, HorovodInternalError) or exc.lost != (dead,) or took > 5:
                failures.append(f"RankLostError {exc.lost} after {took:.2f} s: {exc}")
            raise
        return state.step

    got = _elastic.run_fn(train, lambda: None)(state)
    if resets != [5] or attempts != [0, 5] or got != 5:
        failures.append(f"resets {resets} attempts {attempts}: want a restore to the commit at step 5")
    _elastic_world.remove_world_reset(reset_hook)
    lost_ranks.disarm()
MPI.COMM_WORLD.Barrier()  # the dead rank waits here for the others
if failures:
    raise SystemExit(f"rank {r}: " + "; ".join(failures))
print(f"LOST_OK {r}", flush=True)
