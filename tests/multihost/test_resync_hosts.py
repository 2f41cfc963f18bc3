"""Interrupted collectives across two hosts, each followed by a collective on every rank
(the rig of test_hydra_ssh: network namespaces, Hydra over ssh, ranks 2 and 3 on host b).

Every loop resyncs the ranks (the three that were interrupted in the collective announce it on
the control communicator; rank 3, which skipped it, hears their notices). With one
``MPI.ANY_SOURCE`` receive for the notices, MPICH stopped matching them after one to five loops
(MPI_Iprobe found them waiting): the next collective's resync stalled on every rank.
"""

import os
import re
import tempfile
import time

from bounds import INTERRUPT_S
from test_hydra_ssh import hosts, kernel  # noqa: F401  (the rig and a kernel on host a)

# ranks 0-2 wait in an allreduce that rank 3 (host b) never joins; the kernel interrupts the cell
# once every rank has begun it
SKIPPED = """%%distributed
import os, time
import numpy as np
open(os.path.join({marks!r}, '{loop}-' + str(ring.rank())), 'w').close()
if ring.rank() != 3:
    ring.allreduce(np.ones({length}), op=ring.Sum, name="skipped_by_3")
else:
    time.sleep(60)
"""

EVERY = """%%distributed
_rng = np.random.default_rng({seed} + ring.rank())
_x = _rng.integers(-999, 999, {length}).astype(np.float64)
_want = sum(np.random.default_rng({seed} + q).integers(-999, 999, {length}).astype(np.float64)
            for q in range(ring.size()))
_got = ring.allreduce(_x, op=ring.Sum, name="every_rank")
assert np.array_equal(_got, _want), (ring.rank(), _got, _want)
print("loop {loop} rank", ring.rank(), "ok")
"""


def test_collective_after_repeated_interrupts_of_a_collective_one_rank_skipped(hosts, kernel):  # noqa: F811
    kernel.ok(f"%ring start --hostfile {hosts.hostfile} --gpus none", timeout=120)
    kernel.ok("%%distributed\nimport numpy as np")
    marks = tempfile.mkdtemp(dir=hosts.dir)
    for loop, length in enumerate((1, 7, 3, 13, 2, 5)):
        begun = [os.path.join(marks, f"{loop}-{r}") for r in range(4)]
        out, error = kernel.execute(SKIPPED.format(marks=marks, loop=loop, length=length), timeout=60,
                                    interrupt_when=lambda: all(map(os.path.exists, begun)))
        stopped = time.monotonic() - kernel.interrupted_at
        assert error is not None and "Interrupt" in error["ename"] + error["evalue"], (loop, error, out)
        assert stopped <= INTERRUPT_S, (loop, stopped)
        out, error = kernel.execute(EVERY.format(seed=100 * loop, length=length, loop=loop), timeout=60)
        assert error is None, (loop, error, out)
        assert sorted(re.findall(rf"loop {loop} rank (\d) ok", out)) == ["0", "1", "2", "3"], out
    kernel.ok("%ring stop", timeout=60)
