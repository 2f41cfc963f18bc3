"""Abandoned rounds never reach the next one: ``abandon_queued`` on every rank at its own moment.

Usage: rt_abandon.py [ITERATIONS]. Each iteration, as an elastic reset or a failed notebook cell
does: every rank queues several allreduces at moments of its own (so that the background threads
cut their rounds at different entries, then cut again or settle by name; random data at awkward
sizes: empty, one, primes, one past the eager limit), waits a moment of its own (so that some
ranks' rounds never started, some are settling or cut, some finished), calls ``abandon_queued``
and at once (no meeting) runs a multi-entry round: named allreduces, broadcasts from a rotating
root and an unnamed fused pair, then a blocking allreduce.

Every rank asserts: each abandoned handle is either exact (its round finished before the
abandon) or raises ``RingError`` naming the abandon; the round after it is exact on every entry
(nothing of the abandoned round reaches it, no internal ``Recut`` escapes); it never stalls.
Prints ``ABANDONED <rank> <count>`` (handles that raised) and ``RANK_OK <rank>``.
"""

import sys
import time
import traceback

import numpy as np

import jupyter_ring.runtime as ring
from jupyter_ring.runtime import _api

iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 60
ring.init()
r, n = ring.rank(), ring.size()
failures = []
SIZES = (0, 1, 2, 3, 7, 13, 31, 1009, 8209)  # empty, one, primes; 8209 doubles pass eager_bytes (64 KiB)


def data(seed, q, length):
    """Rank q's input for ``seed`` (every rank can compute every rank's)."""
    return np.random.default_rng(seed * 1009 + q).standard_normal(length)


def close(label, got, want):
    got = np.asarray(got)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-9, atol=1e-9):
        failures.append(f"{label}: got {got.dtype}{got.shape} want {want.dtype}{want.shape}")


abandoned = 0
for it in range(iterations):
    plan = np.random.default_rng(it)  # the same on every rank: what each iteration calls
    sizes = plan.choice(SIZES, 5)
    reason = f"the test abandons iteration {it}"
    label = f"iteration {it}"
    try:
        # -- the round to abandon, queued at each rank's own moments: the background thread cuts
        # its round after one entry on one rank, after all on another (then the ranks cut
        # again, or settle by name) ...
        moments = np.random.default_rng((it, r)).uniform(-0.002, 0.002, 6)
        handles = []
        for k, size in enumerate(sizes):
            if moments[k] > 0:
                time.sleep(moments[k])
            handles.append(ring.allreduce_async(data(it * 10 + k, r, size), name=f"gone.{it}.{k}", op=ring.Sum))
        # ... and abandons before that round starts, during it (settling, cut) or after it
        pause = np.random.default_rng((it, r, 1)).uniform(0.0, 0.02)
        if pause > 0.001:
            time.sleep(pause)
        _api.abandon_queued(reason)
        for k, (h, size) in enumerate(zip(handles, sizes)):
            try:
                got = ring.synchronize(h)
            except ring.RingError as exc:
                abandoned += 1
                if "cancelled" not in str(exc) or reason not in str(exc):
                    failures.append(f"{label}: abandoned handle {k} raised {exc!r}, which does not name the abandon")
                continue
            close(f"{label}: handle {k} finished before the abandon", got,
                  sum(data(it * 10 + k, q, size) for q in range(n)))

        # -- the round after it, at once: named allreduces, broadcasts, an unnamed fused pair
        root = it % n
        after = [int(s) for s in plan.choice(SIZES, 4)]
        hs = [ring.allreduce_async(data(it * 10 + 5 + k, r, size), name=f"after.{it}.{k}", op=ring.Sum)
              for k, size in enumerate(after[:2])]
        bs = [ring.broadcast_async(data(it * 10 + 7 + k, r, size), root_rank=root, name=f"param.{it}.{k}")
              for k, size in enumerate(after[2:])]
        us = [ring.allreduce_async(data(it * 10 + 9, r, after[0]), op=ring.Sum),
              ring.allreduce_async(data(it * 10 + 10, r, after[1]), op=ring.Max)]
        for k, (h, size) in enumerate(zip(hs, after[:2])):
            close(f"{label}: allreduce {k} after the abandon", ring.synchronize(h),
                  sum(data(it * 10 + 5 + k, q, size) for q in range(n)))
        for k, (h, size) in enumerate(zip(bs, after[2:])):
            close(f"{label}: broadcast {k} after the abandon", ring.synchronize(h), data(it * 10 + 7 + k, root, size))
        close(f"{label}: unnamed Sum after the abandon", ring.synchronize(us[0]),
              sum(data(it * 10 + 9, q, after[0]) for q in range(n)))
        close(f"{label}: unnamed Max after the abandon", ring.synchronize(us[1]),
              np.max([data(it * 10 + 10, q, after[1]) for q in range(n)], axis=0))
        close(f"{label}: blocking allreduce", ring.allreduce(data(it * 10 + 11, r, 13), op=ring.Sum, name="w"),
              sum(data(it * 10 + 11, q, 13) for q in range(n)))
    except Exception as exc:  # noqa: BLE001 - reported with its iteration
        failures.append(f"{label}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        break

print(f"ABANDONED {r} {abandoned}", flush=True)
if failures:
    print(f"RANK_FAIL {r}: " + "; ".join(failures[:10]), flush=True)
    sys.exit(1)
print(f"RANK_OK {r}", flush=True)
