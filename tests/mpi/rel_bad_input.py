"""Bad input, one case after another: every rank raises a clear error, then the next collective works.

Prints one ``CASE {json}`` line per rank and case (exception type, message, seconds to raise) and
``RANK_OK <rank>`` at the end. Usage: rel_bad_input.py [repeats]
"""

import json
import sys
import time

import numpy as np

import jupyter_ring.runtime as ring

ring.init()
r, n = ring.rank(), ring.size()
repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 1
other = 1 % n  # the rank that misbehaves where one rank does


def ro():
    a = np.ones(8)
    a.setflags(write=False)
    return a


CASES = {
    "shape": lambda: ring.allreduce(np.zeros([17 + r] * 3, np.float32), name="w.grad"),
    "dtype": lambda: ring.allreduce(np.zeros(5, np.float64 if r == other else np.float32), name="d"),
    "count": lambda: ring.allgather(np.zeros((2, 3 + (r == other))), name="rows"),
    "reduce op": lambda: ring.allreduce(np.ones(3), op=ring.Max if r == other else ring.Sum, name="o"),
    "root": lambda: ring.broadcast(np.ones(3), root_rank=(1 if r == other else 0) % n, name="b"),
    "name": lambda: ring.allreduce(np.ones(3), name="bias" if r == other else "weight"),
    "number of tensors": lambda: ring.grouped_allreduce([np.ones(2)] * (3 if r == other else 2), name="g"),
    "kind": lambda: ring.broadcast(np.ones(4), 0, name="k") if r == other else ring.allreduce(np.ones(4), name="k"),
    "object type": lambda: ring.broadcast_object((lambda: 1) if r == 0 else None, root_rank=0, name="obj"),
    "non-contiguous": lambda: ring.allreduce_(np.ones((4, 4))[:, ::2] if r == other else np.ones(8), name="nc"),
    "read-only": lambda: ring.allreduce_(ro() if r == other else np.ones(8), name="ro"),
    "unsupported dtype": lambda: ring.allreduce(np.array(["a", "b"]) if r == other else np.ones(2), name="s"),
    "root out of range": lambda: ring.broadcast(np.ones(2), root_rank=n + 5 if r == other else 0, name="rr"),
    "alltoall splits": lambda: ring.alltoall(np.ones((n, 2)), splits=[n + 1] + [0] * (n - 1) if r == other else None, name="a2a"),
    "adasum everywhere": lambda: ring.allreduce(np.ones(3), op=ring.Adasum, name="ad"),
    "int prescale": lambda: ring.allreduce(np.ones(3, np.int32), prescale_factor=0.5, name="ip"),
}


def check_next(label):
    xs = [np.random.default_rng(q + 17).standard_normal(1009) for q in range(n)]
    got = ring.allreduce(xs[r], op=ring.Sum, name="w.grad")
    assert np.allclose(got, np.sum(xs, axis=0), rtol=1e-12, atol=1e-12), f"after {label}: wrong result"
    big = ring.allreduce(np.full(200003, float(r)), op=ring.Sum, name="big")
    assert np.all(big == n * (n - 1) / 2), f"after {label}: wrong large result"


for repeat in range(repeats):
    for label, call in CASES.items():
        start = time.perf_counter()
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - every rank must raise something clear; we record what
            record = {"case": label, "rank": r, "repeat": repeat, "type": type(exc).__name__,
                      "message": str(exc), "seconds": time.perf_counter() - start}
        else:
            record = {"case": label, "rank": r, "repeat": repeat, "type": None, "message": "",
                      "seconds": time.perf_counter() - start}
        print("CASE " + json.dumps(record), flush=True)
        check_next(label)

print(f"RANK_OK {r}", flush=True)
