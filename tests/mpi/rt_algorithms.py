"""Every allreduce algorithm forced in turn (issue 33, item 2): exact results, bit-identical ranks.

Usage: rt_algorithms.py [ALGORITHMS]. For each algorithm (default: auto, eager, rd, ring, shm,
hier) the runtime starts with ``init(allreduce=...)`` and every rank reduces random data at
awkward lengths (0, 1, n-1, n+1, primes, not divisible by the world), in several dtypes, with
every op, prescale/postscale factors, out of place, in place (every other case) and fused; values are small
integers (and powers of two for the factors) so that every rank can compute its own exact
expected result from rank and size whatever the order of the terms. Random floats then check
that every rank ends with the same bits. Each rank checks that ``ring.stats()`` counts the
forced algorithm (where it applies here) and prints ``RANK_OK <rank>``.
"""

import sys

import numpy as np

import jupyter_ring.runtime as ring

ALGORITHMS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["auto", "eager", "rd", "ring", "shm", "hier"]
OPS = {"Sum": ring.Sum, "Average": ring.Average, "Min": ring.Min, "Max": ring.Max, "Product": ring.Product}
failures = []


def inputs(n, length, dtype, op, seed):
    """Every rank's input (each rank makes all of them: the same generator seeds)."""
    out = []
    for q in range(n):
        rng = np.random.default_rng([seed, q, length])
        if dtype == np.bool_:
            out.append(rng.integers(0, 2, length).astype(bool))
        elif op == "Product":  # |product| <= 2**n: exact in every dtype tested
            out.append(rng.choice(np.array([-1, 1, 2]) if np.dtype(dtype).kind != "u" else np.array([1, 2]),
                                  length).astype(dtype))
        else:
            low = 0 if np.dtype(dtype).kind == "u" else -8
            out.append(rng.integers(low, 9, length).astype(dtype))
    return out


def expected(xs, dtype, op, n, pre, post):
    """What every rank must get: exact (integer-valued terms, powers of two for the factors)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.logical_and.reduce(xs) if op == "Min" else np.logical_or.reduce(xs)
    terms = [x * dtype.type(pre) if pre != 1.0 else x for x in xs]
    fold = {"Sum": np.add, "Average": np.add, "Min": np.minimum, "Max": np.maximum, "Product": np.multiply}[op]
    total = terms[0].copy()
    for t in terms[1:]:
        fold(total, t, out=total)
    if dtype.kind in "iu":
        return total // n if op == "Average" and n > 1 else total
    scale = post / n if op == "Average" else post
    return total * dtype.type(scale) if scale != 1.0 else total


def check(label, got, want):
    if got.shape != want.shape or got.dtype != want.dtype:
        failures.append(f"{label}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    elif not np.array_equal(got, want):
        bad = int(np.flatnonzero(got != want)[0])
        failures.append(f"{label}: element {bad} is {got[bad]!r}, want {want[bad]!r}")


def run(algorithm):
    ring.init(allreduce=algorithm)
    r, n = ring.rank(), ring.size()
    every_case = [(np.float32, op) for op in OPS] + [(np.float64, "Average"), (np.int32, "Average"),
                                                     (np.int64, "Product"), (np.uint8, "Max"), (np.bool_, "Min"),
                                                     (np.bool_, "Max")]
    # small lengths with every case; past the eager and shared-memory sizes a few
    plan = [(length, every_case) for length in sorted({0, 1, max(1, n - 1), n + 1, 101})]
    plan += [(4099, every_case[:5]), (20011, [(np.float64, "Average"), (np.int32, "Average")]),
             (65537, [(np.float32, "Sum"), (np.float32, "Min"), (np.int64, "Product")])]
    seed = 0
    for length, cases in plan:
        for dtype, op in cases:
            seed += 1
            xs = inputs(n, length, dtype, op, seed)
            floating = np.dtype(dtype).kind == "f"
            pre, post = (2.0, 0.5) if floating and op in ("Sum", "Average") else (1.0, 1.0)
            want = expected(xs, dtype, op, n, pre, post)
            label = f"{algorithm} {np.dtype(dtype).name} {op} length {length}"
            got = ring.allreduce(xs[r], op=OPS[op], name=f"x.{length}.{seed}", prescale_factor=pre,
                                 postscale_factor=post)
            check(label + " out of place", got, want)
            if seed % 2:  # in place: every other case (each op and dtype at some length)
                continue
            inplace = xs[r].copy()
            ring.allreduce_(inplace, op=OPS[op], name=f"y.{length}.{seed}", prescale_factor=pre,
                            postscale_factor=post)
            check(label + " in place", inplace, want)
    # a fused batch of awkward members (the Flat path of every algorithm)
    members = [inputs(n, length, np.float32, "Sum", 900 + length) for length in (0, 1, 7, n + 1, 4099, 30011)]
    handles = [ring.allreduce_async(xs[r], op=ring.Sum, name=f"fused{i}") for i, xs in enumerate(members)]
    for i, (handle, xs) in enumerate(zip(handles, members)):
        check(f"{algorithm} fused member {i}", ring.synchronize(handle), expected(xs, np.float32, "Sum", n, 1.0, 1.0))
    # random floats: the order of terms is the algorithm's, but every rank gets the same bits
    for length in (1, n + 1, 4099, 65537, 200003):
        x = np.random.default_rng([r, length]).standard_normal(length).astype(np.float32)
        got = ring.allreduce(x, op=ring.Average, name=f"bits.{length}", prescale_factor=1.5)
        every = ring.allgather(got[None], name=f"bits.gather.{length}")
        if not all(np.array_equal(every[q].view(np.uint32), got.view(np.uint32)) for q in range(n)):
            failures.append(f"{algorithm}: ranks differ in the bits of a random float allreduce of {length}")
        want = np.mean([np.random.default_rng([q, length]).standard_normal(length).astype(np.float32) * 1.5
                        for q in range(n)], axis=0)
        if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
            failures.append(f"{algorithm}: random float allreduce of {length} is off")
    # a process set (every other rank): its own world, its own choice of algorithm
    if n >= 3:
        members_of = list(range(0, n, 2))
        ps = ring.add_process_set(members_of)
        if r in members_of:
            for length in (1, 4099, 65537):
                xs = inputs(n, length, np.float64, "Sum", 7000 + length)
                got = ring.allreduce(xs[r], op=ring.Sum, name=f"ps.{length}", process_set=ps)
                check(f"{algorithm} process set {members_of} length {length}", got,
                      expected([xs[q] for q in members_of], np.float64, "Sum", len(members_of), 1.0, 1.0))
        ring.remove_process_set(ps)
    # the timeline names the algorithm, and the hierarchy's steps that crossed hosts say so
    from jupyter_ring.runtime import _api

    records = [rec for rec in _api._proc.rt.trace.chrome_events() if rec.get("cat") == "allreduce"]
    named = {rec["args"].get("algorithm") for rec in records if rec.get("tid") == 0}
    if n > 1 and algorithm not in ("auto", "eager", "shm") and algorithm not in named:
        failures.append(f"{algorithm}: the timeline's allreduces name {sorted(map(str, named))}")
    if algorithm == "hier" and n > 1:
        phases = {rec["name"] for rec in records if rec.get("tid") == 1}
        crossed = any("(network)" in phase for phase in phases)
        if "hier across hosts" not in phases or crossed != (ring.cross_size() > 1):
            failures.append(f"hier: phases {sorted(phases)[:6]}... on {ring.cross_size()} host(s)")
    # what ran is counted per algorithm
    # (length 0 and a world of one move nothing: "local"; the auto choice is docs/runtime.md's)
    ran = {key[len("allreduce["):-1] for key in ring.stats() if key.startswith("allreduce[")}
    if n == 1:
        ok = ran <= {"eager", "local"}
    elif algorithm in ("auto", "eager"):
        # a relayed agreement carries no payload (JUPYTER_RING_AGREEMENT=log): no eager allreduce
        eager = {"eager"} if "agreement[log]" not in ring.stats() else set()
        ok = eager <= ran <= {"eager", "local", "rd", "shm", "ring", "hier"} - ({"eager"} - eager)
    else:
        ok = ran == {algorithm, "local"}
    if not ok:
        failures.append(f"{algorithm}: stats() counts {sorted(ran)} allreduce algorithms")
    ring.shutdown()


for algorithm in ALGORITHMS:
    run(algorithm)
from mpi4py import MPI  # noqa: E402  (initialised by the runtime by now)

rank = MPI.COMM_WORLD.Get_rank()
if failures:
    print(f"RANK_FAIL {rank}: " + "; ".join(failures[:8]), flush=True)
    sys.exit(1)
print(f"RANK_OK {rank}", flush=True)
