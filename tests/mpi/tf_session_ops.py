"""TF1 graph mode: one ``session.run`` of many independent collective ops, run in any order.

A session runs independent ops on its inter-op threads in any order, differently on each rank;
the collectives are matched between ranks by name (each op's build-time key). Checks, every rank
its own expected values:

1. a default session (``hvd.init()`` in graph code gives it enough inter-op threads): one run
   fetching 30 allreduces, allgathers, broadcasts, reducescatters and alltoalls of awkward sizes
   (0, 1, primes, not divisible by the ranks) and dtypes, plus broadcast and allgather gradients,
   three times over; the same ops built with ``JUPYTER_RING_TF_SESSION_WAIT=thread`` in a session
   of ONE inter-op thread (no op may hold it while it waits);
2. ranks that built two collectives in opposite orders, run by a session of one inter-op
   thread, so that every rank's thread waits for an op its peers never start: every rank gets
   FailedPreconditionError naming the ops and the fixes, within seconds, and the next run works.

Prints ``TF_SESSION_OK <rank>``.
"""

import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import jupyter_ring.runtime.tensorflow as hvd  # noqa: E402

tf.compat.v1.disable_eager_execution()
os.environ.pop("TF_NUM_INTEROP_THREADS", None)  # init() must set it itself
hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []
SIZES = [0, 1, 2, 3, 5, 7, 13, 17, 31]
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.float16]
TOLERANCE = {np.float16: 5e-2, np.float32: 1e-4}  # sums of n values of magnitude ~30; else exact


def check(label, got, want, tol=0.0):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        failures.append(f"{label}: shape {got.shape} != {want.shape}")
    elif not np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol):
        failures.append(f"{label}: max abs diff {np.abs(got.astype(np.float64) - want).max():.3g}")


def every_rank(seed, make):
    """What each rank passes, computed alike on every rank from a seed."""
    g = np.random.default_rng(seed)
    return [make(g, q) for q in range(n)]


def build():
    """30 collectives of awkward sizes and gradients through them: (fetches, expected)."""
    fetches, expected = [], []
    for i in range(30):
        kind = ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall")[i % 5]
        size = SIZES[i % len(SIZES)]
        dtype = DTYPES[i % len(DTYPES)]

        def values(g, q, rows=None):
            x = g.standard_normal((rows if rows is not None else size, 3)) * 10
            return x.astype(dtype) if np.issubdtype(dtype, np.floating) else np.round(x).astype(dtype)

        if kind == "allreduce":
            xs = every_rank(i, values)
            fetches.append(hvd.allreduce(tf.constant(xs[r]), op=hvd.Sum))
            expected.append((f"allreduce {i} {dtype.__name__}[{size}]", sum(x.astype(np.float64) for x in xs),
                             TOLERANCE.get(dtype, 0.0)))
        elif kind == "allgather":
            xs = every_rank(i, lambda g, q: values(g, q, (size + q) % 5))  # rows differ by rank, some 0
            fetches.append(hvd.allgather(tf.constant(xs[r])))
            expected.append((f"allgather {i}", np.concatenate(xs), 0.0))
        elif kind == "broadcast":
            root = i % n
            xs = every_rank(i, values)
            fetches.append(hvd.broadcast(tf.constant(xs[r]), root_rank=root))
            expected.append((f"broadcast {i} root {root}", xs[root], 0.0))
        elif kind == "reducescatter":
            rows = 2 * n + 1  # not divisible by the ranks: the first ranks get one more row
            xs = every_rank(i, lambda g, q: values(g, q, rows))
            total = sum(x.astype(np.float64) for x in xs)
            counts = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
            start = sum(counts[:r])
            fetches.append(hvd.reducescatter(tf.constant(xs[r]), op=hvd.Sum))
            expected.append((f"reducescatter {i}", total[start:start + counts[r]],
                             TOLERANCE.get(dtype, 0.0)))
        else:
            splits = every_rank(i, lambda g, q: g.integers(0, 4, n))
            xs = every_rank(i + 1000, lambda g, q: values(g, q, int(splits[q].sum())))
            out, _ = hvd.alltoall(tf.constant(xs[r]), splits=tf.constant(splits[r], tf.int32))
            fetches.append(out)
            # from each rank q, the block of its rows it sends to r
            expected.append((f"alltoall {i}", np.concatenate([xs[q][splits[q][:r].sum():splits[q][:r + 1].sum()]
                                                              for q in range(n)]), 0.0))

    # gradients in the same run: of a broadcast (root's is every rank's ones summed / n ... averaged:
    # ones on the root, zeros elsewhere) and of an allgather (this rank's rows of the averaged grads)
    for root in range(n):
        x = tf.constant(np.full((4, 2), float(r), np.float32))
        y = hvd.broadcast(x, root_rank=root)
        fetches.append(tf.gradients(y, x, tf.ones([4, 2]))[0])
        expected.append((f"broadcast grad root {root}", np.full((4, 2), 1.0 if r == root else 0.0), 0.0))
    rows = [q % 3 + 1 for q in range(n)]
    x = tf.constant(np.full((rows[r], 2), float(r), np.float32))
    y = hvd.allgather(x)
    weights = np.arange(sum(rows) * 2, dtype=np.float32).reshape(-1, 2)
    fetches.append(tf.gradients(y, x, tf.constant(weights))[0])
    start = sum(rows[:r])
    expected.append(("allgather grad", weights[start:start + rows[r]], 1e-6))  # the same weights everywhere
    return fetches, expected


# inline (the default): ops hold an inter-op thread while they wait; init() gave the default
# session enough. thread: ops wait on threads of their own, so one inter-op thread does.
for wait, threads in (("inline", 0), ("thread", 1)):
    os.environ["JUPYTER_RING_TF_SESSION_WAIT"] = wait
    fetches, expected = build()
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads)
    with tf.compat.v1.Session(config=config) as session:
        for repeat in range(3):
            for (label, want, tol), got in zip(expected, session.run(fetches)):
                check(f"{wait}, run {repeat}: {label}", got, want, tol)
os.environ.pop("JUPYTER_RING_TF_SESSION_WAIT")

# opposite orders: rank 0 builds (and so names) "first" before "second", the others "second"
# before "first", so no name is queued on every rank: each rank's only thread waits for an op its
# peers never start
a_in = tf.constant(np.arange(5, dtype=np.float32) + r)
b_in = tf.constant(np.arange(7, dtype=np.float32) * (r + 1))
if r == 0:
    fetch_a = hvd.allreduce(a_in, op=hvd.Sum, name="first")
    fetch_b = hvd.allreduce(b_in, op=hvd.Sum, name="second")
else:
    fetch_b = hvd.allreduce(b_in, op=hvd.Sum, name="second")
    fetch_a = hvd.allreduce(a_in, op=hvd.Sum, name="first")
config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
with tf.compat.v1.Session(config=config) as session:
    started = time.perf_counter()
    try:
        session.run([fetch_a, fetch_b])
        failures.append("opposite orders: no error")
    except tf.errors.FailedPreconditionError as exc:
        text = str(exc)
        # the op each rank's engine took first (either) meets its peers' other op: the message
        # names both (the same name at two places of the graph) and the fix
        named = re.search(r"name (first|second) \[graph op \d+ #0\] on rank 0 but (first|second) \[graph op \d+ #0\] "
                          r"on ranks? 1\b", text)
        if not named or "CollectiveMismatchError" not in text or "inter_op_parallelism_threads" not in text or "JUPYTER_RING_TF_SESSION_WAIT=thread" not in text:
            failures.append(f"opposite orders: the error does not name both ops and the fix: {text[:600]}")
    except Exception as exc:  # noqa: BLE001 - reported as a failure of this rank
        failures.append(f"opposite orders: {type(exc).__name__}: {str(exc)[:600]}")
    took = time.perf_counter() - started
    if took > 30:
        failures.append(f"opposite orders: the error took {took:.1f} s")
    # the engine is clean afterwards: the same session runs a collective again
    check("after the error", session.run(hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum)),
          [n * (n - 1) / 2])

if failures:
    print(f"rank {r} FAILED:\n  " + "\n  ".join(failures), flush=True)
    sys.exit(1)
print(f"TF_SESSION_OK {r}", flush=True)
