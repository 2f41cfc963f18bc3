"""A rank SIGKILLed and replaced in place, at the runtime's level (no notebook, no ipyparallel).

Usage: under ``mpiexec.gforker -n N python -m jupyter_ring.engines._keeper python respawn_world.py
DEAD PORTFILE`` (the keeper keeps gforker from ending the survivors). Rank DEAD kills itself;
the survivors, inside an allreduce, raise StallError naming it, then re-form the world
(``engines._respawn``) with a newcomer started by the first survivor, as the notebook would:
``mpiexec.gforker -n 1 ... respawn_world.py DEAD PORTFILE --newcomer``. Every rank of the new
world asserts its own results and prints ``RANK_OK <rank>``.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np

import jupyter_ring.runtime as ring
from jupyter_ring.engines import _respawn

dead, portfile = int(sys.argv[1]), sys.argv[2]
newcomer = "--newcomer" in sys.argv


def check_world(tag: str) -> None:
    """Collectives on random data of awkward lengths: every rank checks its own result."""
    r, n = ring.rank(), ring.size()
    for length in (0, 1, n - 1, n + 1, 17, 100003):
        xs = [np.random.default_rng(1000 * length + q).integers(-2**40, 2**40, length) for q in range(n)]
        got = ring.allreduce(xs[r], op=ring.Sum, name=f"{tag}.{length}")
        assert np.array_equal(got, np.sum(xs, axis=0)), f"rank {r}: allreduce of {length} wrong"
        rows = ring.allgather(xs[r][: (length + r) % 5], name=f"{tag}.g{length}")
        assert np.array_equal(rows, np.concatenate([xs[q][: (length + q) % 5] for q in range(n)]))
    got = ring.broadcast(np.arange(7) * 10 + ring.rank(), root_rank=dead, name=f"{tag}.b")
    assert np.array_equal(got, np.arange(7) * 10 + dead)


if newcomer:
    with open(portfile) as f:
        port = f.read()
    r = _respawn.join(port, [dead])
    assert r == dead and ring.rank() == dead, (r, ring.rank())
    assert "kept" not in globals()  # a fresh namespace
    check_world("after")
    size = ring.size()
    print(f"RANK_OK {r} newcomer of {size}", flush=True)
    ring.shutdown()
    sys.exit(0)

ring.init(stall_timeout=1.0)
r, n = ring.rank(), ring.size()
kept = np.random.default_rng(r).standard_normal(1009)  # the survivors' state
check_world("before")
if r == dead:
    os.kill(os.getpid(), signal.SIGKILL)
t0 = time.monotonic()
try:
    ring.allreduce(np.ones(10), name="during")
    raise AssertionError(f"rank {r}: an allreduce with a dead peer returned")
except ring.StallError as exc:
    assert str(dead) in str(exc), exc
print(f"rank {r}: StallError after {time.monotonic() - t0:.2f} s", flush=True)

port = _respawn.leave([dead])
child = None
if port is not None:  # the first survivor plays the notebook's part: it starts the newcomer
    with open(portfile + ".tmp", "w") as f:
        f.write(port)
    os.replace(portfile + ".tmp", portfile)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMI_")}
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec.gforker")
    child = subprocess.Popen([mpiexec, "-n", "1", sys.executable, "-m", "jupyter_ring.engines._keeper",
                              sys.executable, __file__, str(dead), portfile, "--newcomer"], env=env)
t0 = time.monotonic()
assert _respawn.accept(port or "") == r
print(f"rank {r}: new world of {ring.size()} in {time.monotonic() - t0:.2f} s", flush=True)
assert ring.size() == n and ring.rank() == r
assert np.array_equal(kept, np.random.default_rng(r).standard_normal(1009))  # intact
check_world("after")
ring.shutdown()
if child is not None:
    assert child.wait(60) == 0
print(f"RANK_OK {r} survivor of {n}", flush=True)
