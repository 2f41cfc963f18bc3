"""A rank's exit: MPI_Finalize is bounded by ``finalize_timeout``, and nothing else is.

An atexit handler registered before ``ring.init()`` (it runs after the runtime's own) takes
longer than the timeout, as freeing torch or TensorFlow does on a loaded host; the rank must
still exit 0. Every rank checks a collective first and prints ``RANK_OK <rank>``.
"""

import atexit
import time

import numpy as np

import jupyter_ring.runtime as ring


def slow_teardown():
    time.sleep(2.5)  # over JUPYTER_RING_FINALIZE_TIMEOUT=1 (the test sets it)
    print(f"TEARDOWN_DONE {ring_rank}", flush=True)


atexit.register(slow_teardown)
ring.init()
ring_rank, n = ring.rank(), ring.size()
xs = [np.random.default_rng(40 + q).standard_normal(11) for q in range(n)]
got = ring.allreduce(xs[ring_rank], op=ring.Sum, name="exit")
if not np.allclose(got, sum(xs)):
    raise SystemExit(f"RANK_FAIL {ring_rank}: allreduce")
print(f"RANK_OK {ring_rank}", flush=True)
