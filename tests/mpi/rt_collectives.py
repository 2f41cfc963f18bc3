"""Every collective, every dtype class, awkward lengths: each rank checks its own result.

Every rank builds every rank's random input from a seed shared by all, so each rank computes
the numpy reference itself and asserts its own output.
"""

import sys
import time

import numpy as np

import jupyter_ring.runtime as ring

ring.init()
r, n = ring.rank(), ring.size()
LENGTHS = sorted({0, 1, max(n - 1, 0), n + 1, 2, 13, 1009, 16411, 65537, 1000003})
failures = []


def inputs(seed, length, dtype, lo=-50, hi=50):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if dtype.kind == "b":
            out.append(rng.integers(0, 2, length).astype(bool))
        elif dtype.kind in "iu":
            lo_ = 0 if dtype.kind == "u" else lo
            out.append(rng.integers(lo_, hi, length).astype(dtype))
        elif dtype.kind == "c":
            out.append((rng.standard_normal(length) + 1j * rng.standard_normal(length)).astype(dtype))
        else:
            out.append(rng.standard_normal(length).astype(dtype))
    return out


def check(label, got, want, dtype):
    got = np.asarray(got)
    if got.shape != want.shape or got.dtype != want.dtype:
        failures.append(f"{label}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
        return
    if dtype.kind in "fc":
        tol = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-4, np.dtype(np.complex64): 1e-4}.get(dtype, 1e-10) * max(1, n)
        ok = np.allclose(got.astype(np.complex128), want.astype(np.complex128), rtol=tol, atol=tol)
    else:
        ok = np.array_equal(got, want)
    if not ok:
        failures.append(f"{label}: values differ (max err {np.max(np.abs(got.astype(float) - want.astype(float))) if got.size else 0})")


def reference(xs, op, dtype):
    if op in (ring.Sum, ring.Average):
        acc = xs[0].astype(np.float64 if dtype.kind == "f" else dtype)
        for x in xs[1:]:
            acc = acc + x
        if op == ring.Average:
            acc = acc // n if dtype.kind in "iu" else acc / n
        return acc.astype(dtype)
    fn = {ring.Min: np.minimum, ring.Max: np.maximum, ring.Product: np.multiply}[op]
    if dtype.kind == "b":
        fn = np.logical_and if op in (ring.Min, ring.Product) else np.logical_or
    acc = xs[0]
    for x in xs[1:]:
        acc = fn(acc, x)
    return acc.astype(dtype)


DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.int8, np.uint64,
          np.int16, np.uint16, np.uint32, np.complex64, np.complex128, np.bool_]
seed = 0
# allreduce: every dtype with Sum over awkward lengths; every op on a few dtypes.
for dt in map(np.dtype, DTYPES):
    ops = [ring.Max, ring.Min] if dt.kind == "b" else [ring.Sum]
    for op in ops:
        for length in LENGTHS if dt in (np.dtype(np.float32), np.dtype(np.int64)) else [0, 1, n + 1, 16411, 65537]:
            seed += 1
            xs = inputs(seed, length, dt)
            got = ring.allreduce(xs[r], op=op, name=f"ar.{dt}.{op}.{length}")
            check(f"allreduce {dt} op={op} len={length}", got, reference(xs, op, dt), dt)

for dt in map(np.dtype, [np.float32, np.float64, np.int32, np.uint8]):
    for op in (ring.Average, ring.Min, ring.Max, ring.Product):
        for length in (1, 7, 20011):
            seed += 1
            lo, hi = (1, 3) if op == ring.Product else (-50, 50)
            xs = inputs(seed, length, dt, lo, hi)
            if op == ring.Product and dt.kind == "f":
                xs = [np.abs(x) % 2 + 0.5 for x in xs]
                xs = [x.astype(dt) for x in xs]
            got = ring.allreduce(xs[r], op=op, name=f"op.{dt}.{op}.{length}")
            check(f"allreduce {dt} op={op} len={length}", got, reference(xs, op, dt), dt)

# In place, multi-dimensional, non-contiguous input, pre/postscale.
seed += 1
xs = inputs(seed, 6 * 7 * 5, np.dtype(np.float64))
a = xs[r].reshape(6, 7, 5).copy()
ring.allreduce_(a, op=ring.Sum, name="inplace")
check("allreduce_ in place", a, reference(xs, ring.Sum, np.dtype(np.float64)).reshape(6, 7, 5), np.dtype(np.float64))
nc = xs[r].reshape(6, 35)[:, ::2]
check("allreduce non-contiguous", ring.allreduce(nc, op=ring.Sum, name="noncontig"),
      reference([x.reshape(6, 35)[:, ::2] for x in xs], ring.Sum, np.dtype(np.float64)), np.dtype(np.float64))
got = ring.allreduce(xs[r], op=ring.Sum, prescale_factor=0.5, postscale_factor=3.0, name="scaled")
check("allreduce scales", got, reference(xs, ring.Sum, np.dtype(np.float64)) * 1.5, np.dtype(np.float64))
got = ring.allreduce(xs[r], average=True, name="average-kw")
check("allreduce average=True", got, reference(xs, ring.Average, np.dtype(np.float64)), np.dtype(np.float64))
check("allreduce 0-d", ring.allreduce(np.float32(r + 1), op=ring.Sum, name="scalar"),
      np.asarray(np.float32(n * (n + 1) / 2)), np.dtype(np.float32))

# Prepared lanes: a blocking eager allreduce's first call of a signature goes the full way, the
# next ones take its lane. Fresh random data at every call; each lane call must equal the numpy
# reference and, bit for bit, the same input through the full way (an async call never takes a
# lane); lanes really ran (counted); a change of shape, dtype, op or scale, a different input
# object or an anonymous call each get the right result.
from jupyter_ring.runtime._engine import collectives  # noqa: E402

lane_runs = [0]
LANE_CLASSES = (collectives.Lane, collectives.GatherLane, collectives.CastLane)
_lane_bodies = [cls.run for cls in LANE_CLASSES]


def counted(body):
    def run(*args):
        lane_runs[0] += 1
        return body(*args)
    return run


for cls, body in zip(LANE_CLASSES, _lane_bodies):
    cls.run = counted(body)
def lane_fits(nbytes):
    """Whether a collective of ``nbytes`` a rank takes a prepared lane once seen: lanes are eager
    only, and made on the direct agreement only (none where it is relayed: JUPYTER_RING_AGREEMENT=log)."""
    return nbytes <= ring.config().eager_bytes and "agreement[log]" not in ring.stats()


LANE_CASES = [(np.float32, ring.Sum, 1.0, 1.0), (np.float64, ring.Average, 1.0, 1.0), (np.int32, ring.Max, 1.0, 1.0),
              (np.int64, ring.Average, 1.0, 1.0), (np.float32, ring.Sum, 0.5, 3.0), (np.uint8, ring.Min, 1.0, 1.0)]
for length in (0, 1, 13, max(n - 1, 0), 2 * n + 1, 1009):
    for dt, op, pre, post in map(lambda c: (np.dtype(c[0]),) + c[1:], LANE_CASES):
        for call in range(3):  # full way, then the lane twice (a new input object each time)
            seed += 1
            xs = inputs(seed, length, dt, 0 if dt.kind == "u" else -50, 50)
            want = reference([x * pre if pre != 1.0 else x for x in xs], op, dt)
            if post != 1.0:
                want = (want * post).astype(dt)
            label = f"lane {dt} op={op} scale={pre},{post} len={length} call {call}"
            before = lane_runs[0]
            got = ring.allreduce(xs[r], op=op, prescale_factor=pre, postscale_factor=post, name=f"lane.{dt}.{op}.{pre}")
            full = ring.synchronize(ring.allreduce_async(xs[r], op=op, prescale_factor=pre, postscale_factor=post,
                                                         name=f"full.{dt}.{op}.{pre}"))
            check(label, got, want, dt)
            if not np.array_equal(got, full):
                failures.append(f"{label}: lane result differs from the full way's")
            inplace = xs[r].copy()
            returned = ring.allreduce_(inplace, op=op, prescale_factor=pre, postscale_factor=post,
                                       name=f"lane_.{dt}.{op}.{pre}")
            if returned is not inplace or not np.array_equal(inplace, full):
                failures.append(f"{label}: in-place lane result differs from the full way's")
            lanes = 2 if call and lane_fits(xs[r].nbytes) else 0
            if lane_runs[0] - before != lanes:
                failures.append(f"{label}: {lane_runs[0] - before} calls took the lane, want {lanes}")
# an anonymous lane, 2-d, then another shape under the same name (the full way, a new lane)
for shape in ((3, 5), (3, 5), (5, 3), (5, 3)):
    seed += 1
    xs = [x.reshape(shape) for x in inputs(seed, 15, np.dtype(np.float64))]
    check(f"lane anonymous {shape}", ring.allreduce(xs[r], op=ring.Sum), reference(xs, ring.Sum, np.dtype(np.float64)),
          np.dtype(np.float64))
    check(f"lane named {shape}", ring.allreduce(xs[r], op=ring.Sum, name="reshaped"),
          reference(xs, ring.Sum, np.dtype(np.float64)), np.dtype(np.float64))

# Lanes of allgather (and allgather_object) and broadcast: the same rule. allgather's first dims
# differ per rank and ride in the headers: a rank whose dim 0 changed goes the full way while
# the others stay on their lanes, and every rank still gets the right answer (the later calls
# take the lanes again). Every call's output equals the reference and the full way's
# (allgather_async / broadcast_async never take a lane) bit for bit.
ROWS = [lambda q: 0, lambda q: 1, lambda q: 13, lambda q: q + 1, lambda q: (7 * q + 3) % 11, lambda q: 0 if q % 2 else 2]
for index, rows_of in enumerate(ROWS):
    for rest, dt in (((3,), np.dtype(np.float64)), ((), np.dtype(np.int32)), ((2, 5), np.dtype(np.uint8))):
        for call in range(4):  # full way, lane, the last rank's dim 0 changes (full way there), lane
            seed += 1
            rows = [rows_of(q) + (3 if call >= 2 and q == n - 1 else 0) for q in range(n)]
            blocks = [inputs(seed + q, rows[q] * int(np.prod(rest, dtype=int)), dt)[q].reshape((rows[q],) + rest)
                      for q in range(n)]
            label = f"allgather lane rows={rows} rest={rest} {dt} call {call}"
            before = lane_runs[0]
            got = ring.allgather(blocks[r], name=f"agl.{index}.{rest}")
            full = ring.synchronize(ring.allgather_async(blocks[r], name=f"agf.{index}.{rest}"))
            check(label, got, np.concatenate(blocks), dt)
            if got.shape != full.shape or got.tobytes() != full.tobytes():
                failures.append(f"{label}: lane result differs from the full way's")
            fits = lane_fits(blocks[r].nbytes)
            lanes = int(fits and call in (1, 3) or (call == 2 and r != n - 1 and fits))
            if lane_runs[0] - before != lanes:
                failures.append(f"{label}: {lane_runs[0] - before} calls took a lane, want {lanes}")
for call in range(3):  # anonymous and 0-d
    check(f"allgather lane 0-d call {call}", ring.allgather(np.int64(r * 10 + call)),
          np.arange(n, dtype=np.int64) * 10 + call, np.dtype(np.int64))
for call in range(3):  # pickles of one size on this rank (each rank's own size), then of another
    pad = "x" * (r * 7 + (40 if call == 2 else 0))
    objs = ring.allgather_object({"rank": r, "call": call, "pad": pad}, name="agobj")
    want = [{"rank": q, "call": call, "pad": "x" * (q * 7 + (40 if call == 2 else 0))} for q in range(n)]
    if objs != want:
        failures.append(f"allgather_object lane call {call}: {objs}")
for root in sorted({0, n - 1}):
    for length in (0, 1, 13, 1009):
        for in_place in (True, False):
            for call in range(2):  # the full way, then the lane
                seed += 1
                xs = inputs(seed, length, np.dtype(np.float32))
                label = f"broadcast lane root={root} len={length} in place={in_place} call {call}"
                before = lane_runs[0]
                mine = xs[r].copy()
                if in_place:
                    got = ring.broadcast_(mine, root_rank=root, name=f"bcl_.{length}")
                    if got is not mine:
                        failures.append(f"{label}: broadcast_ returned another array")
                else:
                    got = ring.broadcast(mine, root_rank=root, name=f"bcl.{length}")
                full = ring.synchronize(ring.broadcast_async(xs[r], root_rank=root, name=f"bcf.{length}"))
                check(label, got, xs[root], np.dtype(np.float32))
                if got.tobytes() != full.tobytes():
                    failures.append(f"{label}: lane result differs from the full way's")
                lanes = int(call > 0 and lane_fits(xs[r].nbytes))
                if lane_runs[0] - before != lanes:
                    failures.append(f"{label}: {lane_runs[0] - before} calls took a lane, want {lanes}")
check("broadcast lane 0-d", [ring.broadcast(np.float64(r + 0.25 + c), root_rank=n - 1, name="bc0l") for c in range(3)][-1],
      np.asarray(np.float64(n - 1 + 2.25)), np.dtype(np.float64))
for cls, body in zip(LANE_CLASSES, _lane_bodies):
    cls.run = body

# Async + fusion: 37 small tensors of awkward sizes, handles resolved in reverse order.
seed += 1
rng = np.random.default_rng(seed)
sizes = [int(s) for s in rng.integers(0, 3000, 37)]
per_rank = [[np.random.default_rng(seed * 1000 + q * 100 + i).standard_normal(s).astype(np.float32)
             for i, s in enumerate(sizes)] for q in range(n)]
handles = [ring.allreduce_async(per_rank[r][i], op=ring.Sum, name=f"fuse.{i}") for i in range(len(sizes))]
# poll() tells the truth and runs nothing: the background engine finishes the batch on its own
deadline = time.monotonic() + 30
while not all(ring.poll(h) for h in handles):
    assert time.monotonic() < deadline, "poll() never turned True without synchronize()"
    time.sleep(0.001)
for i in reversed(range(len(sizes))):
    want = reference([per_rank[q][i] for q in range(n)], ring.Sum, np.dtype(np.float32))
    check(f"fused allreduce {i}", ring.synchronize(handles[i]), want, np.dtype(np.float32))
inplace = [per_rank[r][i].copy() for i in range(5)]
hs = [ring.allreduce_async_(t, op=ring.Sum, name=f"fusein.{i}") for i, t in enumerate(inplace)]
for i, h in enumerate(hs):
    ring.synchronize(h)
    check(f"fused in place {i}", inplace[i], reference([per_rank[q][i] for q in range(n)], ring.Sum, np.dtype(np.float32)), np.dtype(np.float32))
outs = ring.grouped_allreduce([per_rank[r][i] for i in range(6)], op=ring.Sum, name="group")
for i in range(6):
    check(f"grouped {i}", outs[i], reference([per_rank[q][i] for q in range(n)], ring.Sum, np.dtype(np.float32)), np.dtype(np.float32))

# allgather: dim 0 differs per rank, awkward trailing dims and dtypes.
for dt in map(np.dtype, [np.float32, np.int16, np.bool_, np.complex128]):
    for big in (False, True):
        seed += 1
        rows = [(q * 3 + (9000 if big else 0)) % 7919 for q in range(n)]
        blocks = [inputs(seed + q, rows[q] * 3 * 2, dt)[q].reshape(rows[q], 3, 2) for q in range(n)]
        got = ring.allgather(blocks[r], name=f"ag.{dt}.{big}")
        check(f"allgather {dt} big={big}", got, np.concatenate(blocks), dt)
check("allgather 0-d", ring.allgather(np.int32(r), name="ag0"), np.arange(n, dtype=np.int32), np.dtype(np.int32))
h = ring.allgather_async(np.full(2, r, np.int8), name="ag-async")
check("allgather async", ring.synchronize(h), np.repeat(np.arange(n, dtype=np.int8), 2), np.dtype(np.int8))

# broadcast from every root, small and large.
for root in range(n):
    for length in (0, 5, 70001):
        seed += 1
        xs = inputs(seed, length, np.dtype(np.float32))
        check(f"broadcast root={root} len={length}", ring.broadcast(xs[r], root_rank=root, name=f"bc.{root}.{length}"), xs[root], np.dtype(np.float32))
zero_d = ring.broadcast(np.float64(r + 0.5), root_rank=n - 1, name="bc0d")
check("broadcast 0-d keeps its shape", zero_d, np.asarray(np.float64(n - 0.5)), np.dtype(np.float64))
buf = inputs(seed, 11, np.dtype(np.int64))[r].copy()
ring.broadcast_(buf, root_rank=n - 1, name="bc_")
check("broadcast_", buf, inputs(seed, 11, np.dtype(np.int64))[n - 1], np.dtype(np.int64))

# reducescatter: rows not divisible by the world size.
for rows in (1, n + 1, 2 * n + 3, 9001):
    seed += 1
    xs = [x.reshape(rows, 3) for x in inputs(seed, rows * 3, np.dtype(np.float64))]
    full = reference(xs, ring.Sum, np.dtype(np.float64))
    base, extra = divmod(rows, n)
    lo = r * base + min(r, extra)
    hi = lo + base + (1 if r < extra else 0)
    check(f"reducescatter rows={rows}", ring.reducescatter(xs[r], op=ring.Sum, name=f"rs.{rows}"), full[lo:hi], np.dtype(np.float64))

# alltoall with uneven splits, small and large blocks.
for scale in (1, 3000):
    splits_of = [[(q + d) % 3 * scale for d in range(n)] for q in range(n)]
    blocks = [np.concatenate([np.full((splits_of[q][d], 2), q * 100 + d, np.int32) for d in range(n)]) for q in range(n)]
    out, received = ring.alltoall(blocks[r], splits=splits_of[r], name=f"a2a.{scale}")
    want = np.concatenate([np.full((splits_of[q][r], 2), q * 100 + r, np.int32) for q in range(n)])
    check(f"alltoall scale={scale}", out, want, np.dtype(np.int32))
    check(f"alltoall splits scale={scale}", received, np.array([splits_of[q][r] for q in range(n)], np.int32), np.dtype(np.int32))

# objects, barrier, stats, timeline.
obj = ring.broadcast_object({"from": r, "data": list(range(r + 3))} if r == 0 else None, root_rank=0, name="obj")
assert obj == {"from": 0, "data": [0, 1, 2]}, obj
big = ring.broadcast_object(b"x" * 200000 if r == n - 1 else None, root_rank=n - 1)
assert big == b"x" * 200000
objs = ring.allgather_object({"rank": r, "pad": "y" * (r * 50000)})
assert [o["rank"] for o in objs] == list(range(n)) and all(len(o["pad"]) == q * 50000 for q, o in enumerate(objs))
ring.barrier()
stats = ring.stats()
assert stats["allreduce"]["count"] > 50 and stats["allreduce"]["bytes"] > 0, stats
if n > 1:
    assert abs(stats["allreduce"]["busbw"] / stats["allreduce"]["algbw"] - 2 * (n - 1) / n) < 1e-9

# timeline: collective, rank 0 writes one Chrome trace with a track (pid) per rank
import json, os, tempfile  # noqa: E402
path = ring.broadcast_object(os.path.join(tempfile.mkdtemp(), "trace.json") if r == 0 else None)
ring.timeline(path)
ring.barrier()
if r == 0:
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    pids = {e["pid"] for e in events if e["ph"] == "X"}
    assert pids == set(range(n)), pids
    assert any(e["name"].startswith("allreduce ar.float32") for e in events)
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")

if failures:
    print(f"RANK_FAIL {r}: " + "; ".join(failures[:20]), flush=True)
    sys.exit(1)
print(f"RANK_OK {r}", flush=True)
