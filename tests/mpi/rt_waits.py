"""How ranks wait for each other (issue 33, item 1): the policy in force, and waits that leave the core.

Usage: rt_waits.py. Every rank checks its own wait policy against what its host's ranks and
cores call for (``JUPYTER_RING_WAIT`` overrides ``auto``); then rank 0 computes for 2 s while
every other rank waits in an allreduce (eager, ring and shared-memory sizes, random data at
awkward lengths): each waiter's result is exact, and the CPU it spent waiting is a small part of
the wait (its poll sleeps instead of spinning); after that the collectives are exact at every
length without a pause. Each rank prints ``RANK_OK <rank>``.
"""

import os
import time

import numpy as np

import jupyter_ring.runtime as ring
from jupyter_ring.runtime._engine import waits as _waits

ring.init()
r, n = ring.rank(), ring.size()
failures = []

# ---- the policy in force: what this host's ranks and cores call for, or the setting
policy = ring.wait_policy()
requested = os.environ.get("JUPYTER_RING_WAIT", "auto") or "auto"
cores = _waits.cores_available()
want = requested if requested != "auto" else ("yield" if ring.local_size() > cores else "spin")
if (policy.mode, policy.requested, policy.ranks_on_host) != (want, requested, ring.local_size()):
    failures.append(f"policy {policy} but want mode {want}, requested {requested}, {ring.local_size()} ranks")
if policy.mode not in policy.describe() or str(ring.local_size()) not in policy.describe():
    failures.append(f"describe() does not say the mode and the ranks: {policy.describe()!r}")

# ---- a long wait costs the waiter little CPU, and its result is exact
COMPUTE = 2.0
for length in (1, 1009, 70001):  # eager payload, pipelined ring or shared memory
    inputs = [np.random.default_rng(1000 * q + length).standard_normal(length) for q in range(n)]
    ring.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    if r == 0:
        while time.perf_counter() - wall < COMPUTE:  # a rank busy computing, not sleeping
            pass
    got = ring.allreduce(inputs[r], op=ring.Sum, name=f"late{length}")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if not np.allclose(got, np.sum(inputs, axis=0), rtol=1e-12, atol=1e-12):
        failures.append(f"late{length}: wrong sum")
    if r != 0:
        if wall < COMPUTE * 0.9:
            failures.append(f"late{length}: returned after {wall:.2f} s, before rank 0 arrived")
        # spinning would cost about the whole wait; polling with naps costs a few per cent
        if cpu > 0.25 * wall:
            failures.append(f"late{length}: waiting {wall:.2f} s cost {cpu:.2f} s of CPU")

# ---- back to back, no pause: exact at every length, also 0 and a prime above the eager size
for length in (0, 1, 2, n - 1, n + 1, 13, 4099, 70001, 300007):
    for op, reduce in ((ring.Sum, np.sum), (ring.Max, np.max)):
        inputs = [np.random.default_rng(7 * q + length).standard_normal(length).astype(np.float32)
                  for q in range(n)]
        got = ring.allreduce(inputs[r], op=op, name=f"b2b{length}.{op}")
        if got.shape != (length,) or not np.allclose(got, reduce(inputs, axis=0), rtol=1e-5, atol=1e-5):
            failures.append(f"b2b{length} op {op}: wrong result")

if failures:
    for failure in failures:
        print(f"rank {r} FAIL {failure}", flush=True)
else:
    print(f"RANK_OK {r}", flush=True)
ring.shutdown()
