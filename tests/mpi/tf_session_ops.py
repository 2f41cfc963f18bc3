"""TF1 graph mode: one ``session.run`` of many independent collective ops, run in any order.

A session runs independent ops on its inter-op threads in any order, differently on each rank;
the collectives are matched between ranks by name (each op's build-time key). Checks, every rank
its own expected values:

1. ops wait on threads of their own by default; ``hvd.init()`` in graph code sets
   ``TF_NUM_INTEROP_THREADS`` (for ops that wait inline: ``JUPYTER_RING_TF_SESSION_WAIT=inline``,
   or built inside a tf.cond branch);
2. with the default (thread) wait, in a session of ONE inter-op thread (no op may
   hold it while it waits): one run fetching 30 allreduces, allgathers, broadcasts,
   reducescatters and alltoalls of awkward sizes (0, 1, primes, not divisible by the ranks) and
   dtypes, plus broadcast and allgather gradients, three times over; the same ops built with
   ``JUPYTER_RING_TF_SESSION_WAIT=inline`` in a session of the threads ``init()`` gave;
3. (at 1-2 ranks) 96 more ops built into the graph the first session already ran (Horovod's
   in-place broadcast test builds that many), each run alone once (its first run), then all in one
   run: the graph's function library does not grow with them (an op adds nodes, no function);
4. for each wait, ranks that built two collectives in opposite orders, run by a session of one
   inter-op thread, so that no op is queued under the same name on every rank: every rank gets
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
failures = []
os.environ.pop("TF_NUM_INTEROP_THREADS", None)  # init() must set it itself
os.environ.pop("JUPYTER_RING_TF_SESSION_WAIT", None)
hvd.init()  # before any session: ops that wait inline get its threads
if hvd._session_wait() != "thread":
    failures.append(f"the default session wait is {hvd._session_wait()!r}, not 'thread'")
if os.environ.get("TF_NUM_INTEROP_THREADS") != str(max(64, os.cpu_count() or 1)):
    failures.append(f"init() in graph code set TF_NUM_INTEROP_THREADS={os.environ.get('TF_NUM_INTEROP_THREADS')}")
r, n = hvd.rank(), hvd.size()
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


# thread (the default): ops wait on threads of their own, so one inter-op thread does. inline:
# ops hold an inter-op thread while they wait; init() gave the default session enough.
graph = tf.compat.v1.get_default_graph()
for wait, threads in (("thread", 1), ("inline", 0)):
    if wait == "inline":
        os.environ["JUPYTER_RING_TF_SESSION_WAIT"] = wait
    fetches, expected = build()
    os.environ.pop("JUPYTER_RING_TF_SESSION_WAIT", None)
    # (a session shares the process's pool, sized once by the first session that uses it, unless
    # it has threads of its own)
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads, use_per_session_threads=threads > 0)
    with tf.compat.v1.Session(config=config) as session:
        for repeat in range(3):
            for (label, want, tol), got in zip(expected, session.run(fetches)):
                check(f"{wait}, run {repeat}: {label}", got, want, tol)

        if wait == "thread" and n <= 2:
            # new ops in a graph the session already ran: each one's first run, then all at once
            # (what this checks is each process's own graph and waits: at 2 ranks only, for time)
            functions = len(graph.as_graph_def().library.function)
            many, wants = [], []  # the default wait
            for i in range(96):
                size = SIZES[i % len(SIZES)] + i // len(SIZES)
                xs = every_rank(5000 + i, lambda g, q: g.standard_normal(size).astype(np.float32))
                if i % 2:
                    many.append(hvd.broadcast(tf.constant(xs[r]), root_rank=i % n, name=f"many.{i}"))
                    wants.append((f"many {i}: broadcast[{size}] root {i % n}", xs[i % n], 0.0))
                else:
                    many.append(hvd.allreduce(tf.constant(xs[r]), op=hvd.Sum, name=f"many.{i}"))
                    wants.append((f"many {i}: allreduce[{size}]", sum(x.astype(np.float64) for x in xs), 1e-4))
            grown = len(graph.as_graph_def().library.function) - functions
            if grown:
                failures.append(f"96 session ops added {grown} functions to the graph's library (expected none)")
            for fetch, (label, want, tol) in zip(many, wants):
                check(f"{label}, first run", session.run(fetch), want, tol)
            for (label, want, tol), got in zip(wants, session.run(many)):
                check(f"{label}, together", got, want, tol)

# opposite orders: rank 0 builds (and so names) "first" before "second", the others "second"
# before "first", so no name is queued on every rank: each rank waits for an op its peers never
# start (with the inline wait, its only thread does)
for wait in ("thread", "inline"):
    os.environ["JUPYTER_RING_TF_SESSION_WAIT"] = wait
    a_in = tf.constant(np.arange(5, dtype=np.float32) + r)
    b_in = tf.constant(np.arange(7, dtype=np.float32) * (r + 1))
    if r == 0:
        fetch_a = hvd.allreduce(a_in, op=hvd.Sum, name="first")
        fetch_b = hvd.allreduce(b_in, op=hvd.Sum, name="second")
    else:
        fetch_b = hvd.allreduce(b_in, op=hvd.Sum, name="second")
        fetch_a = hvd.allreduce(a_in, op=hvd.Sum, name="first")
    after = hvd.allreduce(tf.constant([float(r)]), op=hvd.Sum)
    os.environ.pop("JUPYTER_RING_TF_SESSION_WAIT")
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
    with tf.compat.v1.Session(config=config) as session:
        started = time.perf_counter()
        try:
            session.run([fetch_a, fetch_b])
            failures.append(f"{wait}, opposite orders: no error")
        except tf.errors.FailedPreconditionError as exc:
            text = str(exc)
            # the op each rank's engine took first (either) meets its peers' other op: the message
            # names both (the same name at two places of the graph) and the fixes
            named = re.search(r"name (first|second) \[graph op \d+ #0\] on rank 0 but (first|second) "
                              r"\[graph op \d+ #0\] on ranks? 1\b", text)
            fixes = ("same order", "JUPYTER_RING_TF_SESSION_WAIT", "inter_op_parallelism_threads")
            if not named or "CollectiveMismatchError" not in text or not all(f in text for f in fixes):
                failures.append(f"{wait}, opposite orders: the error does not name both ops and the fixes: "
                                f"{text[:600]}")
        except Exception as exc:  # noqa: BLE001 - reported as a failure of this rank
            failures.append(f"{wait}, opposite orders: {type(exc).__name__}: {str(exc)[:600]}")
        took = time.perf_counter() - started
        if took > 30:
            failures.append(f"{wait}, opposite orders: the error took {took:.1f} s")
        # the engine is clean afterwards: the same session runs a collective again
        check(f"{wait}, after the error", session.run(after), [n * (n - 1) / 2])

if failures:
    print(f"rank {r} FAILED:\n  " + "\n  ".join(failures), flush=True)
    sys.exit(1)
print(f"TF_SESSION_OK {r}", flush=True)
