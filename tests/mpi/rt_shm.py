"""The shared-memory allreduce (every rank on one host), one mode per run: values, mismatch,
interrupt, stall, partial.

Run with a small JUPYTER_RING_SHM_THRESHOLD, JUPYTER_RING_EAGER_BYTES and
JUPYTER_RING_SHM_WINDOW_BYTES so that the lengths around them stay small. Every rank builds every
rank's input from seeds, computes the reference itself and asserts; each rank prints
``RANK_OK <rank>``.
"""

import os
import shutil
import signal
import sys
import threading
import tempfile
import time
import traceback
import weakref
import zlib

import numpy as np

import jupyter_ring.runtime as ring
from _checks import INTERRUPT_S, Meeting
from jupyter_ring.runtime import _api
from jupyter_ring.runtime._engine.core import OP_NAMES

mode = sys.argv[1]
ring.init()
r, n = ring.rank(), ring.size()
meeting = Meeting()  # every rank has raised before any goes on
rt = _api._proc.rt
config = ring.config()
THRESHOLD, WINDOW = config.shm_threshold, config.shm_window_bytes
assert 0 < config.eager_bytes < THRESHOLD < WINDOW, "run with small eager/threshold/window settings"
assert (rt.shm is not None) == (n > 1), f"shared memory offered: {rt.shm is not None} with {n} ranks"
failures = []


def last_algorithm():
    """``shm``; ``ring`` for the algorithms over messages (the ring, or recursive doubling up to
    its size: ``_algorithm_choice``); else ``other``, as the trace records it."""
    algorithm = rt.trace.records[-1][6]
    return algorithm if algorithm == "shm" else "ring" if algorithm in ("ring", "rd") else "other"


def inputs(seed, length, dtype, op):
    """Every rank's input (rank q's is seeded by q)."""
    out = []
    for q in range(n):
        rng = np.random.default_rng(1000 * seed + q)
        if dtype.kind in "iu":
            lo, hi = (-3, 4) if op == ring.Product else (-1000, 1000)
            out.append(rng.integers(lo, hi, length).astype(dtype))
        elif op == ring.Product:
            out.append(rng.uniform(0.5, 1.5, length).astype(dtype))
        else:
            out.append(rng.standard_normal(length).astype(dtype))
    return out


def reference(xs, op, dtype, pre, post):
    """Reduced in rank order, scaled as the runtime does: the bits every rank must get."""
    fn = {ring.Sum: np.add, ring.Average: np.add, ring.Min: np.minimum, ring.Max: np.maximum,
          ring.Product: np.multiply}[op]
    if pre != 1.0:
        xs = [x * dtype.type(pre) for x in xs]
    acc = xs[0].copy()
    for x in xs[1:]:
        fn(acc, x, out=acc)
    if op == ring.Average and dtype.kind in "iu":
        return acc // n
    if op == ring.Average:
        post = post / n
    if post != 1.0:
        acc *= dtype.type(post)
    return acc


def same(a, b, exact):
    """Bit-identical, or (``exact`` False: reduced in another order) close."""
    if exact or a.dtype.kind in "iu":
        return a.tobytes() == b.tobytes()
    tol = 1e-2 if a.dtype == np.float16 else 1e-5
    return np.allclose(a, b, rtol=tol, atol=tol)


def check(label, got, want, ring_result=None, rank_order=True):
    """``got`` against the rank-order reference (bit for bit where the path reduces in rank
    order: shared memory, eager, or 2 ranks) and against the ring's result."""
    if got.dtype != want.dtype or got.shape != want.shape:
        failures.append(f"{label}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    elif not same(got, want, rank_order or n <= 2):
        bad = np.flatnonzero(got != want)
        failures.append(f"{label}: {bad.size} elements differ from the rank-order reference, first at "
                        f"{bad[:3]}: {got[bad[:3]]} vs {want[bad[:3]]}")
    if ring_result is not None and not same(got, ring_result, n <= 2):
        failures.append(f"{label}: differs from the ring's result")
    digests.append(zlib.crc32(got.tobytes()))


def both_paths(label, array, expect_shm, **kwargs):
    """The allreduce through the default path, then through the ring alone."""
    got = ring.allreduce(array, name=label, **kwargs)
    algorithm = last_algorithm()
    if n > 1 and algorithm != ("shm" if expect_shm else "ring") and array.nbytes > config.eager_bytes:
        failures.append(f"{label}: {array.nbytes} bytes went through {algorithm}")
    config.shm_threshold = 0
    try:
        ring_result = ring.allreduce(array, name=label, **kwargs)
    finally:
        config.shm_threshold = THRESHOLD
    return got, ring_result


def next_prime(k):
    while k < 2 or any(k % d == 0 for d in range(2, int(k ** 0.5) + 1)):
        k += 1
    return k


def lengths(itemsize):
    """Around the threshold and past the window: threshold-1, threshold, above, a prime above,
    and more than the window (several pieces) not divisible by 2, 3 or 4."""
    at = THRESHOLD // itemsize
    big = 12 * (2 * WINDOW // itemsize) + 1  # 24 half-window pieces and one element
    return [(at - 1, False), (at, False), (at + 1, True), (next_prime(at + 2), True), (big, True)]


def expect_correct(label, length=None, seed=99):
    """A shared-memory allreduce after a failure: exact on every rank, then a small one."""
    length = length or next_prime(3 * WINDOW // 8)
    xs = inputs(seed, length, np.dtype(np.float64), ring.Sum)
    got = ring.allreduce(xs[r], op=ring.Sum, name="w.grad")
    assert last_algorithm() == ("shm" if n > 1 else "other"), f"{label}: {last_algorithm()}"
    want = reference(xs, ring.Sum, np.dtype(np.float64), 1.0, 1.0)
    assert got.tobytes() == want.tobytes(), f"{label}: wrong result after recovery"
    small = ring.allreduce(np.array([r + 1.0]), op=ring.Sum, name="small")
    assert small[0] == n * (n + 1) / 2, f"{label}: small allreduce wrong after recovery: {small}"


digests = []
if mode == "values":
    seed = 0
    OPS = (ring.Sum, ring.Average, ring.Min, ring.Max, ring.Product)
    for dtype in map(np.dtype, (np.float32, np.float64, np.float16, np.int32)):
        for length, shm in lengths(dtype.itemsize):
            for op in OPS:
                seed += 1
                xs = inputs(seed, length, dtype, op)
                got, ring_result = both_paths(f"{dtype}.{op}.{length}", xs[r], shm, op=op)
                check(f"allreduce {dtype} {OP_NAMES[op]} len={length}", got,
                      reference(xs, op, dtype, 1.0, 1.0), ring_result, rank_order=shm)
        if dtype.kind == "f":  # scale factors, with Sum and Average
            length = lengths(dtype.itemsize)[3][0]
            for op in (ring.Sum, ring.Average):
                seed += 1
                xs = inputs(seed, length, dtype, op)
                got, ring_result = both_paths(f"{dtype}.scaled.{op}", xs[r], True, op=op,
                                              prescale_factor=0.5, postscale_factor=3.0)
                check(f"allreduce {dtype} {OP_NAMES[op]} scaled", got, reference(xs, op, dtype, 0.5, 3.0),
                      ring_result)

    # in place, out of place on a strided view, and a bigger-than-window in-place one
    for length in (lengths(4)[3][0], lengths(4)[4][0]):
        seed += 1
        xs = inputs(seed, length, np.dtype(np.float32), ring.Sum)
        mine = xs[r].copy()
        out = ring.allreduce_(mine, op=ring.Average, name=f"inplace.{length}")
        if out is not mine:
            failures.append("allreduce_ did not return its argument")
        if n > 1 and last_algorithm() != "shm":
            failures.append(f"allreduce_ of {mine.nbytes} bytes went through {last_algorithm()}")
        check(f"allreduce_ len={length}", mine, reference(xs, ring.Average, np.dtype(np.float32), 1.0, 1.0))
    seed += 1
    xs = inputs(seed, 2 * lengths(8)[3][0], np.dtype(np.float64), ring.Sum)
    got = ring.allreduce(xs[r][::2], op=ring.Max, name="strided")
    check("allreduce of a strided view", got, reference([x[::2] for x in xs], ring.Max, np.dtype(np.float64), 1.0, 1.0))

    # a fused batch of small async allreduces that together pass the threshold
    count = 3 * THRESHOLD // (4 * 500) + 1
    seed += 1
    batch = [inputs(seed * 100 + i, 500, np.dtype(np.float32), ring.Sum) for i in range(count)]
    # members alone (2000 bytes) would take the ring, which adds in another order for 3+ ranks:
    # the background thread must not take the first before the last is queued (a 1 ms cycle
    # under load), so it waits; synchronize() runs the whole round in this thread
    cycle_ms, config.cycle_ms = config.cycle_ms, 60_000.0
    try:
        handles = [ring.allreduce_async(xs[r], op=ring.Sum, name=f"fused.{i}") for i, xs in enumerate(batch)]
        results = [ring.synchronize(h) for h in handles]
    finally:
        config.cycle_ms = cycle_ms
    record = rt.trace.records[-1]
    if n > 1 and (not record[1].startswith("fused[") or last_algorithm() != "shm"):
        failures.append(f"fused batch: last record {record[1]!r} went through {last_algorithm()}")
    for i, (got, xs) in enumerate(zip(results, batch)):
        check(f"fused member {i}", got, reference(xs, ring.Sum, np.dtype(np.float32), 1.0, 1.0))
    grouped = ring.grouped_allreduce([xs[r] for xs in batch[:count]], op=ring.Min, name="grouped")
    for i, (got, xs) in enumerate(zip(grouped, batch)):
        check(f"grouped member {i}", got, reference(xs, ring.Min, np.dtype(np.float32), 1.0, 1.0))

    # several pieces with a short last one: a fused pass of prime-length members with a prescale
    # (members copied straight into the slots, the own block through scratch), and in place
    # against out of place on a prime length (not divisible by any world size): bit-identical
    seed += 1
    sizes = [next_prime(WINDOW // 4 // 3 + 7 * i) for i in range(5)]
    members = [inputs(seed * 100 + i, size, np.dtype(np.float32), ring.Sum) for i, size in enumerate(sizes)]
    fused = ring.grouped_allreduce([xs[r] for xs in members], op=ring.Average, prescale_factor=0.5,
                                   name="grouped.pieces")
    if n > 1 and last_algorithm() != "shm":
        failures.append(f"grouped multi-piece batch went through {last_algorithm()}")
    for i, (got, xs) in enumerate(zip(fused, members)):
        check(f"grouped multi-piece member {i}", got, reference(xs, ring.Average, np.dtype(np.float32), 0.5, 1.0))
    seed += 1
    length = next_prime(5 * WINDOW // 8 + 3)
    xs = inputs(seed, length, np.dtype(np.float32), ring.Sum)
    out_of_place = ring.allreduce(xs[r], op=ring.Sum, name="pieces.out")
    mine = xs[r].copy()
    ring.allreduce_(mine, op=ring.Sum, name="pieces.in")
    if out_of_place.tobytes() != mine.tobytes():
        failures.append(f"len={length}: in place and out of place differ")
    check(f"allreduce_ len={length} over several pieces", mine, reference(xs, ring.Sum, np.dtype(np.float32), 1.0, 1.0))

    # the trace names the algorithm and its phases
    got = ring.allreduce(np.ones(lengths(4)[4][0], np.float32), op=ring.Sum, name="traced")
    phases = list(rt.trace.records[-1][5])
    if n > 1:
        for needed in ("negotiate", "shm-copy-in piece 0", "shm-reduce piece 0", "shm-copy-out piece 0"):
            if needed not in phases:
                failures.append(f"trace phases {phases} lack {needed!r}")
        if not any(p.startswith("shm (") for p in phases):
            failures.append(f"trace phases {phases} lack the shm total")

    # every rank got the same bits for every result
    everyone = ring.allgather_object(digests, name="digests")
    if any(d != everyone[0] for d in everyone):
        failures.append("results differ between ranks")

    # shutdown removes this runtime's files; init again works and offers shared memory again
    token = rt.shm.token if rt.shm is not None else None
    ring.shutdown()
    if token is not None:
        left = [f for f in os.listdir("/dev/shm") if f.startswith(f"jupyter_ring.{token:011x}.")]
        if left:
            failures.append(f"files left in /dev/shm after shutdown: {left}")
    ring.init()
    rt = _api._proc.rt
    expect_correct("after init again")
    if failures:
        print(f"rank {r} failures:\n  " + "\n  ".join(failures[:30]), flush=True)
        sys.exit(1)

elif mode == "registered":
    # In-place allreduces of buffers in registered memory (fused gradient buckets): reduced where
    # they lie, bit-identical to the rank-order reference, for every op, awkward lengths, scale
    # factors, views at an offset inside a buffer, buffers reused with new data, and a rank whose
    # tensor is not registered (every rank falls back to the copying path).
    seed = 500
    buffers = []
    for dtype in map(np.dtype, (np.float32, np.float64, np.int32)):
        for length in (THRESHOLD // dtype.itemsize + 1, next_prime(3 * WINDOW // dtype.itemsize),
                       12 * WINDOW // dtype.itemsize + 5):
            buf = _api.bucket_buffer(length * dtype.itemsize).view(dtype)
            buffers.append(buf)
            if n > 1 and not _api.registered(buf):
                failures.append(f"bucket_buffer of {buf.nbytes} bytes is not registered")
            for op in (ring.Sum, ring.Average, ring.Min, ring.Max):
                for pre, post in ((1.0, 1.0),) + (((0.5, 3.0),) if dtype.kind == "f" else ()):
                    seed += 1
                    xs = inputs(seed, length, dtype, op)
                    buf[...] = xs[r]
                    ring.allreduce_(buf, op=op, name=f"reg.{dtype}.{length}", prescale_factor=pre,
                                    postscale_factor=post)
                    phases = list(rt.trace.records[-1][5])
                    if n > 1 and not any(p.startswith("shm registered") for p in phases):
                        failures.append(f"registered {dtype} len={length}: phases {phases}")
                    check(f"registered {dtype} {OP_NAMES[op]} len={length} pre={pre}", buf.copy(),
                          reference(xs, op, dtype, pre, post))
    # fresh inputs handed over as sources (torch's gradients made afresh, Keras' gradients): on
    # the registered path only the blocks the peers read are copied in, the own block is reduced
    # from them where they lie; sources of 0 and 1 elements, slots already in the bucket between
    # them, a length below the threshold (every source copied), scale factors (all copied first)
    for dtype in map(np.dtype, (np.float32, np.int32)):
        for length in (THRESHOLD // dtype.itemsize - 3, next_prime(3 * WINDOW // dtype.itemsize),
                       12 * WINDOW // dtype.itemsize + 5):
            buf = _api.bucket_buffer(length * dtype.itemsize).view(dtype)
            cuts = sorted({0, 1, 2, 3, length // 3, length // 3 + 1, length // 2 + 7, length - 1, length})
            for op, pre in ((ring.Sum, 1.0), (ring.Average, 1.0)) + (((ring.Average, 0.5),) if dtype.kind == "f" else ()):
                seed += 1
                xs = inputs(seed, length, dtype, op)
                buf[...] = -77  # overwritten by a source, or by this rank's input in the slots between
                sources = []
                for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
                    if k % 3 == 1:
                        buf[a:b] = xs[r][a:b]  # already in the bucket (a gradient view of it)
                    else:
                        sources.append((a, xs[r][a:b].copy()))
                before = [arr.copy() for _, arr in sources]
                alive = [weakref.ref(arr) for _, arr in sources]
                ring.synchronize(_api.bucket_allreduce_async_(buf, f"src.{dtype}.{length}", op=op,
                                                              prescale_factor=pre, sources=sources))
                registered_path = any(p.startswith("shm registered") for p in rt.trace.records[-1][5])
                if n > 1 and registered_path != (length * dtype.itemsize > THRESHOLD):
                    failures.append(f"sources {dtype} len={length}: phases {list(rt.trace.records[-1][5])}")
                check(f"sources {dtype} {OP_NAMES[op]} len={length} pre={pre}", buf.copy(),
                      reference(xs, op, dtype, pre, 1.0), rank_order=registered_path)
                if any(not np.array_equal(x, y) for (_, x), y in zip(sources, before)):
                    failures.append(f"sources {dtype} len={length}: a source was written to")
                del sources
                if any(ref() is not None for ref in alive):
                    failures.append(f"sources {dtype} len={length}: the engine still holds a source")
    try:
        _api.bucket_allreduce_async_(buf, "src.bad", sources=[(length - 1, np.zeros(2, dtype))])
        failures.append("a source beyond the bucket was accepted")
    except ValueError as exc:
        if "does not fit the bucket" not in str(exc):
            failures.append(f"a source beyond the bucket: {exc}")
    # a view at an offset inside a registered buffer, and an async one fused with nothing
    big = buffers[1]
    seed += 1
    xs = inputs(seed, big.size - 7, big.dtype, ring.Sum)
    big[7:] = xs[r]
    ring.synchronize(ring.allreduce_async_(big[7:], op=ring.Sum, name="reg.view"))
    check("registered view at an offset", big[7:].copy(), reference(xs, ring.Sum, big.dtype, 1.0, 1.0))
    # rank 0's tensor is not registered: every rank takes the copying path, still exact
    seed += 1
    xs = inputs(seed, big.size, big.dtype, ring.Sum)
    mine = xs[r].copy() if r == 0 else big
    mine[...] = xs[r]
    ring.allreduce_(mine, op=ring.Sum, name="reg.mixed")
    if n > 1 and last_algorithm() != "shm":
        failures.append(f"mixed registration went through {last_algorithm()}")
    check("mixed registration", mine.copy(), reference(xs, ring.Sum, big.dtype, 1.0, 1.0))
    everyone = ring.allgather_object(digests, name="digests")
    if any(d != everyone[0] for d in everyone):
        failures.append("registered results differ between ranks")
    # every other rank joined (after the digests: only rank 0 checks this one): rank 0 reduces its registered tensor alone, scale factors included
    seed += 1
    xs = inputs(seed, big.size, big.dtype, ring.Sum)
    if r == 0:
        big[...] = xs[0]
        ring.allreduce_(big, op=ring.Sum, name="reg.joined", prescale_factor=0.5, postscale_factor=3.0)
        check("registered, every peer joined", big.copy(),
              reference([xs[0]] + [np.zeros_like(x) for x in xs[1:]], ring.Sum, big.dtype, 0.5, 3.0))
    ring.join()
    # memory is given back when the arrays are gone, and reused
    region = rt.shm.locate(buffers[0].view(np.uint8)) if rt.shm is not None else 0
    del buffers, big, buf, mine
    import gc
    gc.collect()
    again = _api.bucket_buffer(THRESHOLD + 8)
    if rt.shm is not None and rt.shm.locate(again) != region:
        failures.append("the memory of a dropped bucket buffer was not reused")
    if failures:
        print(f"rank {r} failures:\n  " + "\n  ".join(failures[:30]), flush=True)
        sys.exit(1)

elif mode == "mismatch":
    # shapes differ, above the threshold: every rank raises, no data moves, the next one works
    size = lengths(4)[3][0]
    try:
        ring.allreduce(np.zeros(size + min(r, 1), np.float32), name="w.grad")
    except ring.CollectiveMismatchError as exc:
        assert f"({size},) on rank 0 but ({size + 1},) on rank" in str(exc), str(exc)
        print(f"MISMATCH {r}: {exc}", flush=True)
    else:
        raise AssertionError(f"no CollectiveMismatchError on rank {r}")
    expect_correct("after mismatch")

elif mode == "interrupt":
    # SIGINT reaches every rank inside the shared-memory path: rank 0 is held (asleep) at its
    # first sync, so the others wait on it there; then every rank is interrupted mid-pipeline
    # of big allreduces. After each round, allreduces are exact.
    def kill_me(delay):
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGINT)

    def interrupted(delay, length, hold_rank0):
        arrive = rt.shm.arrive
        if hold_rank0 and r == 0:
            def held(gen):
                time.sleep(30)
                return arrive(gen)
            rt.shm.arrive = held
        threading.Thread(target=kill_me, args=(delay,), daemon=True).start()
        start = time.perf_counter()
        rounds = 0
        try:
            while True:
                ring.allreduce(np.full(length, 7.0), name="w.grad")
                rounds += 1
        except KeyboardInterrupt:
            frames = [f.name for f in traceback.extract_tb(sys.exc_info()[2])]
            latency = time.perf_counter() - start - delay
            assert latency < INTERRUPT_S, f"interrupt took {latency:.2f} s to land"
            print(f"INTERRUPTED {r} after {rounds} rounds, {latency * 1000:.1f} ms after SIGINT, "
                  f"in {frames[-1]}{' (shm)' if '_shared' in frames else ''}", flush=True)
            if hold_rank0:
                assert "_shared" in frames, f"rank {r} was interrupted outside the shm path: {frames}"
        finally:
            rt.shm.arrive = arrive
        meeting.meet()

    interrupted(0.4 + 0.1 * r, next_prime(3 * WINDOW // 8 // 8), hold_rank0=True)
    expect_correct("after an interrupt at the first sync")
    interrupted(0.3 + 0.05 * r, 40 * WINDOW // 8 + 3, hold_rank0=False)
    expect_correct("after an interrupt mid-pipeline", seed=7)

elif mode == "stall":
    # rank 0 stops inside the shared-memory path (after the agreement, before its first sync)
    # for longer than the stall timeout: the others raise StallError naming rank 0, then call
    # the same allreduce again and every rank, rank 0 included, gets the exact result. The
    # others retry only once all of them have raised (a retry's resync notice would otherwise
    # restart a rank still waiting, which is the runtime's job, but not what this tests).
    # Rank 0 stays stopped until every other rank has raised (each leaves a file), so a loaded
    # machine that wakes a waiter late changes no outcome; the bound on the wait is the promise.
    timeout = config.stall_timeout
    length = next_prime(3 * WINDOW // 8)
    xs = inputs(5, length, np.dtype(np.float64), ring.Sum)
    want = reference(xs, ring.Sum, np.dtype(np.float64), 1.0, 1.0)
    marks = ring.broadcast_object(tempfile.mkdtemp() if r == 0 else None, name="stall.marks")
    start = time.perf_counter()
    if r == 0:
        arrive = rt.shm.arrive

        def stopped(gen):
            rt.shm.arrive = arrive
            while len(os.listdir(marks)) < n - 1 and time.perf_counter() - start < timeout + 60:
                time.sleep(0.05)
            return arrive(gen)
        rt.shm.arrive = stopped
        got = ring.allreduce(xs[r], op=ring.Sum, name="w.grad")
    else:
        try:
            ring.allreduce(xs[r], op=ring.Sum, name="w.grad")
        except ring.StallError as exc:
            waited = time.perf_counter() - start
            assert exc.missing == (0,), exc.missing
            assert "rank(s) [0]" in str(exc) and "w.grad" in str(exc) and "shared memory" in str(exc), str(exc)
            assert timeout <= waited < timeout + INTERRUPT_S, f"raised after {waited:.2f} s"
            print(f"STALL {r} after {waited:.2f}s: {exc}", flush=True)
        else:
            raise AssertionError("no StallError")
        open(os.path.join(marks, f"rank{r}"), "w").close()
        while len(os.listdir(marks)) < n - 1:  # every waiter raised before any retries
            time.sleep(0.05)
        got = ring.allreduce(xs[r], op=ring.Sum, name="w.grad")
    assert got.tobytes() == want.tobytes(), f"rank {r}: wrong result after the stall"
    ring.barrier()
    if r == 0:
        shutil.rmtree(marks)
    expect_correct("after stall")
elif mode == "partial":
    # rank 1 gives up an in-place allreduce after the first piece was copied out (as if
    # interrupted at its third sync) and calls the next allreduce at once: the others, whose
    # tensors already hold part of the result, raise RingError instead of retrying with them;
    # then every rank's next allreduce is exact.
    length = 3 * (WINDOW // 2 // 8) + 5  # four pieces
    xs = inputs(3, length, np.dtype(np.float64), ring.Sum)
    mine = xs[r].copy()
    arrive = rt.shm.arrive
    if r == 1:
        calls = []

        def gives_up(gen):
            calls.append(gen)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return arrive(gen)
        rt.shm.arrive = gives_up
    try:
        ring.allreduce_(mine, op=ring.Sum, name="w.grad")
    except KeyboardInterrupt:
        assert r == 1
        print(f"GAVE_UP {r}", flush=True)
    except ring.RingError as exc:
        assert r != 1 and "partial results" in str(exc), f"rank {r}: {exc}"
        assert not np.array_equal(mine, xs[r]), "the tensor was not written: the test missed its point"
        print(f"PARTIAL {r}: {exc}", flush=True)
    else:
        raise AssertionError(f"rank {r}: the allreduce went through")
    finally:
        rt.shm.arrive = arrive
    expect_correct("after a partial in-place allreduce")
else:
    raise SystemExit(f"unknown mode {mode}")

print(f"RANK_OK {r}", flush=True)
