"""Soak: many collectives of random kinds and sizes, exact results, no growth in memory/fds/threads.

Every rank draws the same op sequence from a shared seed; integer data makes every result exact.
Every 500th op is a deliberate mismatch or a bad argument on one rank (error paths leak too).
Prints ``SOAK {json}`` with the resource figures and ``RANK_OK <rank>``. Usage: rel_soak.py COUNT
(resources are compared from the op where the trace is full, JUPYTER_RING_TRACE_RECORDS)
"""

import json
import os
import sys
import threading

import numpy as np

import jupyter_ring.runtime as ring

ring.init()
r, n = ring.rank(), ring.size()
count = int(sys.argv[1])
rng = np.random.default_rng(2024)  # same sequence on every rank
SIZES = [0, 1, 2, 3, 7, 31, 257, 1021, 4099, 16411, 65537, 262147]
KINDS = ["allreduce", "allreduce", "allreduce", "async", "allgather", "broadcast", "alltoall",
         "reducescatter", "object"]


def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resources():
    return {"rss": rss(), "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "tasks": len(os.listdir("/proc/self/task"))}


def data(seed, length):
    return [np.random.default_rng(seed * 10 + q).integers(-1000, 1000, length).astype(np.int64) for q in range(n)]


warm = None
errors = 0
# resources are compared from the point where the trace (its last trace_records records, 10,000
# unless JUPYTER_RING_TRACE_RECORDS says) is full
trace_records = ring.config().trace_records
warm_at = min(count // 2, max(count // 10, trace_records + trace_records // 5))
for i in range(count):
    if i == warm_at:
        warm = resources()
    kind = KINDS[rng.integers(len(KINDS))]
    length = int(SIZES[rng.integers(len(SIZES))]) if rng.random() < 0.1 else int(SIZES[rng.integers(8)])
    seed = int(rng.integers(1 << 30))
    if i % 500 == 499:
        try:
            if i % 1000 == 999:
                ring.allreduce(np.zeros(3 + r), name="mismatch")
            else:
                ring.allreduce_(np.ones(4)[::2] if r == n - 1 else np.ones(2), name="bad")
        except (ring.CollectiveMismatchError, ring.PeerError, ValueError):
            errors += 1
        else:
            raise AssertionError(f"op {i}: the deliberate error did not raise")
        continue
    xs = data(seed, length)
    if kind == "allreduce":
        got, want = ring.allreduce(xs[r], op=ring.Sum, name="soak"), np.sum(xs, axis=0)
    elif kind == "async":
        handles = [ring.allreduce_async(x[r], op=ring.Sum, name=f"a{j}") for j, x in enumerate([xs, xs[::-1]])]
        got = np.concatenate([ring.synchronize(h) for h in reversed(handles)])
        want = np.concatenate([np.sum(xs[::-1], axis=0), np.sum(xs, axis=0)])
    elif kind == "allgather":
        parts = [x[: (length + q) % (length + 1)] for q, x in enumerate(xs)]
        got, want = ring.allgather(parts[r], name="soak"), np.concatenate(parts)
    elif kind == "broadcast":
        root = seed % n
        got, want = ring.broadcast(xs[r], root_rank=root, name="soak"), xs[root]
    elif kind == "alltoall":
        block = [x[: (length // n) * n].reshape(n, -1) if length >= n else x[:0].reshape(n, 0) for x in xs]
        got, _ = ring.alltoall(block[r], name="soak")
        want = np.concatenate([block[q][r:r + 1] for q in range(n)])
    elif kind == "reducescatter":
        total = np.sum(xs, axis=0)
        base, extra = divmod(length, n)
        lo = r * base + min(r, extra)
        got, want = ring.reducescatter(xs[r], op=ring.Sum, name="soak"), total[lo:lo + base + (r < extra)]
    else:
        got = ring.allgather_object({"i": i, "r": r, "x": xs[r][:3].tolist()}, name="soak")
        want = [{"i": i, "r": q, "x": xs[q][:3].tolist()} for q in range(n)]
        assert got == want, f"op {i}: allgather_object differs"
        continue
    assert np.array_equal(got, want), f"op {i} {kind} len {length}: wrong result"

end = resources()
print("SOAK " + json.dumps({"rank": r, "ops": count, "errors": errors, "warm": warm, "end": end}), flush=True)
print(f"RANK_OK {r}", flush=True)
