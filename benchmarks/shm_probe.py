"""What two processes on this machine can do through /dev/shm, without the runtime.

    .venv/bin/python benchmarks/shm_probe.py [--mib 64] [--reps 7]

Stand-alone (numpy, os.fork, a spinning counter sync in /dev/shm; no MPI, no jupyter_ring): the
ceiling the shared-memory allreduce path can reach here. Prints, as medians of interleaved runs:
memcpy of one process alone; memcpy of two processes at once (each its own buffers: they share
the memory bandwidth as two ranks do); and a 2-process in-place float32 sum allreduce through
/dev/shm slots in pieces of several sizes, with two syncs per piece (copy in; sync; reduce own
block; sync; copy out every block: the runtime's scheme before issue 17's third round) and with
one (copy in the next piece while the peer reduces: own block copied out right after it is
reduced, only the peer's block after the sync). Each allreduce is given as busbw ÷ memcpy (one
process), the figure issue 17 asks to reach 0.6.

A second table is robust to a loaded machine (no syncs, no scheduling): one process does both
ranks' data movement of the same schemes in turn, phase by phase, and the registered scheme's
(reduce straight out of both buffers, copy the peer's block out); "per rank ÷ memcpy" assumes the
two ranks' halves of the work run side by side at the same speed: what the traffic itself
allows, by piece size.
"""

import argparse
import mmap
import os
import statistics
import sys
import time

import numpy as np

MiB = 1 << 20


def segment(path, nbytes):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    m = mmap.mmap(fd, nbytes)
    os.close(fd)
    os.unlink(path)  # both processes mapped it before the fork
    return m


class Pair:
    """Two processes (rank 0 the parent, 1 the child) with a counter each and a slot each."""

    def __init__(self, slot_bytes):
        tag = f"{os.getpid()}"
        self.maps = [segment(f"/dev/shm/probe.{tag}.{q}", 4096 + slot_bytes) for q in range(2)]
        self.counters = [np.frombuffer(m, np.int64, 1, 0) for m in self.maps]
        self.slots = [np.frombuffer(m, np.uint8, slot_bytes, 4096) for m in self.maps]
        self.counters[0][0] = self.counters[1][0] = 0
        self.tick = 0

    def sync(self, me):
        self.tick += 1
        self.counters[me][0] = self.tick
        peer = self.counters[1 - me]
        while peer[0] < self.tick:
            os.sched_yield()  # the machine is shared: a waiting process lends its core


def allreduce(pair, me, buf, piece, syncs):
    """In-place 2-rank sum of ``buf`` through the slots, pieces of ``piece`` bytes, 1 or 2 syncs."""
    cap = piece // 8                  # elements of one block's region
    step = 2 * cap
    total = buf.size
    slots = [s.view(np.float32) for s in pair.slots]
    starts = list(range(0, total, step))

    def blocks(k):
        """Piece k's start and its two blocks (piece-relative bounds)."""
        a = starts[k]
        cut = (min(a + step, total) - a) // 2
        return a, [(0, cut), (cut, min(a + step, total) - a)]

    def region(q, k, i, length):
        # block i of a piece lives at a fixed place of its half, whatever the piece's length:
        # a short last piece must not move a block onto a region a peer still reads
        base = (k % 2) * step + i * cap
        return slots[q][base:base + length]

    def copy_in(k):
        a, bounds = blocks(k)
        lo, hi = bounds[1 - me]
        np.copyto(region(me, k, 1 - me, hi - lo), buf[a + lo:a + hi])

    def reduce(k, copy_own):
        a, bounds = blocks(k)
        lo, hi = bounds[me]
        out, peer, own = region(me, k, me, hi - lo), region(1 - me, k, me, hi - lo), buf[a + lo:a + hi]
        np.add(*((own, peer) if me == 0 else (peer, own)), out=out)
        if copy_own:
            np.copyto(own, out)

    def copy_out(k, own_too):
        a, bounds = blocks(k)
        lo, hi = bounds[1 - me]
        np.copyto(buf[a + lo:a + hi], region(1 - me, k, 1 - me, hi - lo))
        if own_too:
            lo, hi = bounds[me]
            np.copyto(buf[a + lo:a + hi], region(me, k, me, hi - lo))

    if syncs == 2:
        for k in range(len(starts)):
            copy_in(k)
            pair.sync(me)
            reduce(k, False)
            pair.sync(me)
            copy_out(k, True)
    else:
        copy_in(0)
        pair.sync(me)
        reduce(0, True)
        for k in range(len(starts) - 1):
            copy_in(k + 1)
            pair.sync(me)
            copy_out(k, False)
            reduce(k + 1, True)
        pair.sync(me)
        copy_out(len(starts) - 1, False)


def run(args):
    nbytes = args.mib * MiB
    pieces = [p * 1024 for p in (128, 256, 512, 1024, 2048)]
    pair = Pair(2 * max(pieces))
    pid = os.fork()
    me = 0 if pid else 1
    rng = np.random.default_rng(me)
    buf = rng.standard_normal(nbytes // 4).astype(np.float32)
    dst = np.empty_like(buf)
    cases = {"memcpy, 2 processes at once": lambda: np.copyto(dst, buf)}
    for syncs in (2, 1):
        for piece in pieces:
            cases[f"allreduce {syncs} sync(s)/piece, {piece // 1024} KiB pieces"] = (
                lambda piece=piece, syncs=syncs: allreduce(pair, me, buf, piece, syncs))
    times = {k: [] for k in cases}
    solo = []
    # correctness of both schemes once: integers in float32 sum exactly
    check = np.arange(nbytes // 4 % 1000003 + 17, dtype=np.float32) * (me + 1)
    for piece in pieces[:2]:
        for syncs in (1, 2):
            got = check.copy()
            allreduce(pair, me, got, piece, syncs)
            if not np.array_equal(got, np.arange(got.size, dtype=np.float32) * 3):
                print(f"rank {me}: wrong sum ({syncs} syncs, {piece} B pieces)", flush=True)
                os._exit(1)
    for _ in range(args.reps + 1):
        for key, fn in cases.items():
            pair.sync(me)
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
        pair.sync(me)
        if me == 0:  # memcpy alone: the peer waits in the next sync meanwhile
            t0 = time.perf_counter()
            np.copyto(dst, buf)
            solo.append(time.perf_counter() - t0)
        pair.sync(me)
    if me == 1:
        os._exit(0)
    os.waitpid(pid, 0)
    memcpy = nbytes / statistics.median(solo[1:])
    print(f"{args.mib} MiB float32, 2 processes, medians of {args.reps}; load {open('/proc/loadavg').read().split()[:3]}")
    print(f"memcpy, 1 process alone: {memcpy / 1e9:.2f} GB/s")
    print("| case | ms | GB/s (busbw per process) | ÷ memcpy alone |")
    print("|---|---|---|---|")
    for key, ts in times.items():
        t = statistics.median(ts[1:])
        print(f"| {key} | {t * 1e3:.1f} | {nbytes / t / 1e9:.2f} | {nbytes / t / memcpy:.2f} |")


def sequential(args):
    """Both ranks' copies, reductions and copy-outs in one process: the traffic's own cost."""
    count = args.mib * MiB // 4
    bufs = [np.random.default_rng(q).standard_normal(count).astype(np.float32) for q in range(2)]
    dst = np.empty_like(bufs[0])
    pieces = [p * 1024 for p in (128, 256, 512, 1024, 2048, 4096)]
    slots = [np.zeros(2 * max(pieces) // 4, np.float32) for _ in range(2)]

    def copying(piece, own_hot):
        step = piece // 4
        for k, a in enumerate(range(0, count, step)):
            b = min(a + step, count)
            base, h = (k % 2) * step, (b - a) // 2
            own = [(0, h), (h, b - a)]
            for me in (0, 1):  # copy in the peer's block
                lo, hi = own[1 - me]
                np.copyto(slots[me][base + lo:base + hi], bufs[me][a + lo:a + hi])
            for me in (0, 1):  # reduce the own block into the slot (and, own_hot, into the output)
                lo, hi = own[me]
                np.add(bufs[me][a + lo:a + hi], slots[1 - me][base + lo:base + hi],
                       out=slots[me][base + lo:base + hi])
                if own_hot:
                    np.copyto(bufs[me][a + lo:a + hi], slots[me][base + lo:base + hi])
            for me in (0, 1):  # copy out the peer's block (and the own one, not own_hot)
                lo, hi = own[1 - me]
                np.copyto(bufs[me][a + lo:a + hi], slots[1 - me][base + lo:base + hi])
                if not own_hot:
                    lo, hi = own[me]
                    np.copyto(bufs[me][a + lo:a + hi], slots[me][base + lo:base + hi])

    def registered(piece):
        step = piece // 4
        for a in range(0, count, step):
            b = min(a + step, count)
            own = [(a, a + (b - a) // 2), (a + (b - a) // 2, b)]
            for me in (0, 1):
                lo, hi = own[me]
                np.add(bufs[0][lo:hi], bufs[1][lo:hi], out=bufs[me][lo:hi])
            for me in (0, 1):
                lo, hi = own[1 - me]
                np.copyto(bufs[me][lo:hi], bufs[1 - me][lo:hi])

    cases = {"memcpy": lambda: np.copyto(dst, bufs[0])}
    for piece in pieces:
        kib = piece // 1024
        cases[f"copy out after the sync, {kib} KiB pieces"] = lambda piece=piece: copying(piece, False)
        cases[f"own block copied out at once, {kib} KiB pieces"] = lambda piece=piece: copying(piece, True)
        cases[f"registered, {kib} KiB pieces"] = lambda piece=piece: registered(piece)
    times = {k: [] for k in cases}
    for _ in range(args.reps):
        for key, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    memcpy = statistics.median(times.pop("memcpy"))
    print(f"\nOne process, both ranks' data movement in turn ({args.mib} MiB, medians of {args.reps}); "
          f"memcpy {args.mib * MiB / memcpy / 1e9:.2f} GB/s; load {open('/proc/loadavg').read().split()[:3]}")
    print("| scheme | both ranks ms | per rank ÷ memcpy |")
    print("|---|---|---|")
    for key, ts in sorted(times.items(), key=lambda kv: kv[0].split(",")[0]):
        t = statistics.median(ts)
        print(f"| {key} | {t * 1e3:.1f} | {memcpy / (t / 2):.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--sequential-only", action="store_true", help="only the one-process table")
    args = parser.parse_args()
    if not args.sequential_only:
        run(args)
    sequential(args)


if __name__ == "__main__":
    main()
