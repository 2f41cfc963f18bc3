"""The failure contract, one mode per run: mismatch, stall, interrupt, reinit.

Usage: rt_failures.py MODE. Every rank asserts its own outcome and prints ``RANK_OK <rank>``.
"""

import os
import signal
import sys
import threading
import time
from typing import Callable

import numpy as np

import jupyter_ring.runtime as ring
from _checks import INTERRUPT_S, Meeting

mode = sys.argv[1]
ring.init()
r, n = ring.rank(), ring.size()
meeting = Meeting()  # every rank has raised before any goes on


def expect_correct(label, seed=1234, length=100003):
    """A collective after a failure must be exact (same name/shape as the abandoned ones)."""
    xs = [np.random.default_rng(seed + q).standard_normal(length) for q in range(n)]
    got = ring.allreduce(xs[r], op=ring.Sum, name="w.grad")
    want = np.sum(xs, axis=0)
    assert np.allclose(got, want, rtol=1e-10, atol=1e-10), f"{label}: wrong result after recovery"
    small = ring.allreduce(np.array([r + 1.0]), op=ring.Sum, name="small")
    assert small[0] == n * (n + 1) / 2, f"{label}: small allreduce wrong after recovery: {small}"


def expect_mismatch(label, fn, *needles):
    start = time.perf_counter()
    try:
        fn()
    except ring.CollectiveMismatchError as exc:
        msg = str(exc)
        for needle in needles:
            assert needle in msg, f"{label}: {needle!r} not in {msg!r}"
        assert time.perf_counter() - start < 5, f"{label}: took {time.perf_counter() - start:.1f} s"
        print(f"MISMATCH {r} {label}: {msg}", flush=True)
    else:
        raise AssertionError(f"{label}: no CollectiveMismatchError on rank {r}")
    expect_correct(label)


if mode == "mismatch":
    assert n > 1
    expect_mismatch("shape", lambda: ring.allreduce(np.zeros([17 + r] * 3, np.float32), name="w.grad"),
                    "allreduce 'w.grad': shape (17, 17, 17) on rank 0 but (18, 18, 18) on rank 1")
    expect_mismatch("big shape", lambda: ring.allreduce(np.zeros(200000 + r, np.float32), name="big"),
                    "allreduce 'big'", "(200000,) on rank 0", "(200001,) on rank 1")
    expect_mismatch("dtype", lambda: ring.allreduce(np.zeros(4, np.float32 if r else np.float64), name="d"),
                    "dtype float64 on rank 0 but float32 on rank")
    expect_mismatch("op", lambda: ring.allreduce(np.zeros(4), op=ring.Sum if r else ring.Max, name="o"),
                    "reduce op Max on rank 0 but Sum on rank")
    expect_mismatch("name", lambda: ring.allreduce(np.zeros(4), name=f"layer{min(r, 1)}"),
                    "name layer0 on rank 0 but layer1 on rank")
    expect_mismatch("kind", lambda: ring.broadcast(np.zeros(4), 0, name="k") if r == 0 else ring.allreduce(np.zeros(4), name="k"),
                    "called broadcast on rank 0 but allreduce on rank")
    expect_mismatch("root", lambda: ring.broadcast(np.zeros(3), root_rank=min(r, 1), name="b"),
                    "root rank 0 on rank 0 but 1 on rank")
    expect_mismatch("group size", lambda: ring.grouped_allreduce([np.zeros(3)] * (2 + min(r, 1)), name="g"),
                    "number of tensors 2 on rank 0 but 3 on rank")
    # a group whose description pickles to over 64 KiB: its list of tensors is cut to the first 100
    expect_mismatch("huge group", lambda: ring.grouped_allreduce([np.zeros(1)] * (10000 + min(r, 1)), name="huge"),
                    "number of tensors 10000 on rank 0 but 10001 on rank")
    # On a prepared lane: every rank's lane of the name is warm, then the last rank's call
    # differs (it goes the full way, the others take their lane): every rank raises, and the
    # lane serves the next call exactly.
    def on_lane(name, shape, dtype):
        def call():
            for _ in range(2):
                ring.allreduce(np.ones(5, np.float32), name=name)
            ring.allreduce(np.ones(shape if r == n - 1 else 5, dtype if r == n - 1 else np.float32), name=name)
        return call

    expect_mismatch("lane shape", on_lane("lane.s", 6, np.float32), "allreduce 'lane.s': shape (5,) on rank",
                    f"(6,) on rank {n - 1}")
    expect_mismatch("lane dtype", on_lane("lane.d", 5, np.float64), "allreduce 'lane.d': dtype float32 on rank",
                    f"float64 on rank {n - 1}")
    for name in ("lane.s", "lane.d"):
        got = ring.allreduce(np.full(5, r + 1.0, np.float32), op=ring.Sum, name=name)
        assert np.array_equal(got, np.full(5, n * (n + 1) / 2, np.float32)), f"{name} after the mismatch: {got}"

    # allgather and broadcast lanes alike: the last rank's call differs on a warm lane
    def gather_on_lane():
        for _ in range(2):
            ring.allgather(np.ones((r + 1, 3), np.float32), name="lane.g")
        ring.allgather(np.ones((r + 1, 4 if r == n - 1 else 3), np.float32), name="lane.g")

    def cast_on_lane():
        for _ in range(2):
            ring.broadcast_(np.ones(4), root_rank=0, name="lane.b")
        ring.broadcast_(np.ones(4), root_rank=n - 1 if r == n - 1 else 0, name="lane.b")

    expect_mismatch("allgather lane", gather_on_lane, "allgather 'lane.g': trailing shape (3,) on rank",
                    f"(4,) on rank {n - 1}")
    expect_mismatch("broadcast lane", cast_on_lane, "broadcast 'lane.b': root rank 0 on rank", f"{n - 1} on rank {n - 1}")
    got = ring.allgather(np.full((r + 1, 3), r, np.float32), name="lane.g")
    assert np.array_equal(got, np.repeat(np.arange(n, dtype=np.float32), np.arange(1, n + 1))[:, None].repeat(3, 1)), got
    mine = np.full(4, float(r))
    ring.broadcast_(mine, root_rank=0, name="lane.b")
    assert np.array_equal(mine, np.zeros(4)), f"lane.b after the mismatch: {mine}"
    expect_mismatch("allgather trailing", lambda: ring.allgather(np.zeros((2, 3 + min(r, 1))), name="ag"),
                    "trailing shape (3,) on rank 0 but (4,) on rank")

elif mode == "stall":
    # Rank 0 skips a collective: the others raise StallError naming rank 0, nobody hangs, and
    # the next collective (same name and shape as the skipped one) is exact on every rank.
    assert n > 1
    timeout = float(os.environ["JUPYTER_RING_STALL_TIMEOUT"])
    if r != 0:
        start = time.perf_counter()
        try:
            ring.allreduce(np.ones(100003), name="w.grad")
        except ring.StallError as exc:
            waited = time.perf_counter() - start
            assert exc.missing == (0,), exc.missing
            assert "rank(s) [0]" in str(exc) and "w.grad" in str(exc), str(exc)
            assert timeout <= waited < timeout + 3, f"raised after {waited:.2f} s"
            print(f"STALL {r} after {waited:.2f}s: {exc}", flush=True)
        else:
            raise AssertionError("no StallError")
    meeting.meet()  # rank 0 skipped it: it goes on once the others have raised
    expect_correct("after stall")
    # The same on a warm prepared lane: rank 1 gives up a call rank 0 skips, and its next call
    # of that signature announces its resync. Its header of the given-up call still waits on the
    # old communicator, equal to what rank 0's lane expects: rank 0 must test the notice before
    # it takes it for its own call's (its sum would hold the 100). Two ranks only: with more, the
    # ranks giving up race each other's notices (one seen first rightly restarts, not raises).
    for _ in range(2):
        ring.allreduce(np.ones(5), op=ring.Sum, name="w.lane")
    if n == 2 and r == 1:
        ring.config().stall_timeout = 0.5
        try:
            ring.allreduce(np.full(5, 100.0), op=ring.Sum, name="w.lane")
        except ring.StallError:
            pass
        else:
            raise AssertionError("no StallError on the lane")
        ring.config().stall_timeout = timeout
    if n == 2:
        meeting.meet()  # rank 0 calls once rank 1 has given up its call
    got = ring.allreduce(np.full(5, r + 1.0), op=ring.Sum, name="w.lane")  # every rank, at every size
    assert np.array_equal(got, np.full(5, n * (n + 1) / 2)), f"the lane after a peer gave up a call: {got}"

elif mode == "interrupt":
    # Every rank gets a real SIGINT while inside (or, rank 0, outside) a collective with the same
    # name and shape as the next one; afterwards collectives are exact. As in a notebook, where
    # the interrupt reaches every rank, each rank goes on only once all have been interrupted
    # (they meet), otherwise a released rank would legitimately mismatch a waiting one.
    def kill_me(delay):
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGINT)

    def interrupted_loop(delay, length, before=None, name="w.grad", also=None):
        threading.Thread(target=kill_me, args=(delay,), daemon=True).start()
        start = time.perf_counter()
        rounds = 0
        try:
            if before is not None:
                before()
            while True:
                if also is not None:
                    also()
                ring.allreduce(np.full(length, 7.0), name=name)
                rounds += 1
        except KeyboardInterrupt:
            latency = time.perf_counter() - start - delay
            assert latency < INTERRUPT_S, f"interrupt took {latency:.2f} s to land"
            print(f"INTERRUPTED {r} after {rounds} rounds, {latency * 1000:.1f} ms after SIGINT", flush=True)
        meeting.meet()

    # rank 0 is busy elsewhere: the others wait for it inside allreduce
    interrupted_loop(0.3 + 0.15 * r, 100003, before=(lambda: time.sleep(30)) if r == 0 else None)
    ring.barrier()
    expect_correct("after interrupt", seed=99)
    # inside a prepared lane's wait (the lanes of the names are warm on every rank; rank 0 is
    # busy, the others wait in the allgather's lane): then the lanes are prepared anew on the
    # fresh communicator and exact
    from jupyter_ring.runtime import _api

    def gather():
        return ring.allgather(np.full((r + 1, 2), r, np.int64), name="w.glane")

    for _ in range(2):
        gather()
        ring.allreduce(np.full(1009, 7.0), name="w.lane")
    interrupted_loop(0.3 + 0.15 * r, 1009, before=(lambda: time.sleep(30)) if r == 0 else None, name="w.lane",
                     also=gather)
    for call in range(3):
        got = ring.allreduce(np.full(1009, r + call + 1.0), op=ring.Sum, name="w.lane")
        assert np.array_equal(got, np.full(1009, n * (n + 1) / 2 + n * call)), f"lane call {call} after interrupt: {got[:3]}"
        got = gather()
        assert np.array_equal(got, np.repeat(np.arange(n), np.arange(1, n + 1))[:, None].repeat(2, 1)), got
    for key in (("w.lane", False), ("allgather", "w.glane")):
        if key[0] == "w.lane" and ring.config().allreduce not in ("auto", "eager"):
            continue  # (JUPYTER_RING_ALLREDUCE forces another algorithm: allreduces run no lane)
        if "agreement[log]" in ring.stats():
            continue  # (a relayed agreement, JUPYTER_RING_AGREEMENT=log: no lane is made)
        lane = _api._proc.engine.lanes[key]
        assert lane.prepared.wiring == _api._proc.rt.headers.wiring, f"lane {key} was not prepared anew after the resync"
    expect_correct("after an interrupt inside a lane", seed=5)
    # and again mid-ring: large buffers, small pieces, interrupts at staggered times
    ring.config().chunk_bytes = 4096
    interrupted_loop(0.2 + 0.05 * r, 400009)
    expect_correct("after mid-ring interrupt", seed=7)

elif mode == "cells":
    # test_notebooks' shared kernel, cell by cell, without the kernel: after each failed cell
    # every rank abandons what it queued (engines/_setup._after_cell); interrupts reach every
    # rank together (they meet after it); then a mismatch must be raised alike on every rank,
    # naming only its own collective: nothing of the interrupted cells may take part in it.
    from jupyter_ring.runtime import _api

    def interrupted_cell(body: Callable[[], None], delay: float = 1.0) -> BaseException | None:
        """Run ``body`` as a cell that every rank's SIGINT ends ``delay`` s in; its failure is
        the cell's, and what it queued is abandoned, as on an engine."""
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - a cell's failure, as IPython catches it
            _api.abandon_queued(f"the cell failed on this rank ({type(exc).__name__})")
            failed = exc
        else:
            failed = None
        finally:
            timer.cancel()
        meeting.meet()
        return failed

    def barrier_while_peers_sleep() -> None:  # test_interrupt_in_kernel_during_collective_keeps_state
        if r != 0:
            time.sleep(30)
        ring.barrier()

    kept = r + 1
    for _ in range(2):
        exc = interrupted_cell(barrier_while_peers_sleep)
        assert isinstance(exc, KeyboardInterrupt), f"rank {r}: {exc!r}"
        total = ring.allreduce(np.array([kept]), op=ring.Sum, name="kept")
        assert total[0] == n * (n + 1) // 2, f"rank {r}: kept {total}"

    def off_main() -> None:  # ...while_another_thread_waits_in_a_collective: the guard abandons it
        got = []
        if r == 0:
            def hook() -> None:
                try:
                    got.append(ring.allreduce(np.ones(5), op=ring.Sum, name="off_main"))
                except BaseException as exc:  # noqa: BLE001 - what the thread saw
                    got.append(exc)

            thread = threading.Thread(target=hook)
            thread.start()
            time.sleep(0.5)
            _api.abandon_queued("the main thread is stuck in C and was interrupted")
            thread.join(10)
            assert type(got[0]).__name__ == "Abandoned", got
        else:
            time.sleep(30)

    interrupted_cell(off_main)
    got = ring.allreduce(np.arange(3.0) + r, op=ring.Sum, name="after_off_main")
    assert np.array_equal(got, n * np.arange(3.0) + n * (n - 1) / 2), f"rank {r}: after_off_main {got}"

    def one_rank_raises() -> None:  # test_error_in_notebook_names_first_failing_rank
        if r == n - 1:
            time.sleep(0.2)
            raise RuntimeError("only the last rank")
        ring.barrier()

    exc = interrupted_cell(one_rank_raises)
    assert isinstance(exc, RuntimeError if r == n - 1 else KeyboardInterrupt), f"rank {r}: {exc!r}"
    # test_mismatch_is_everybodys_error_shown_once_without_runtime_frames, without a restart
    for attempt in range(2):
        try:
            ring.allreduce(np.zeros(3 + r), name="w")
        except ring.CollectiveMismatchError as exc:
            want = "allreduce 'w': shape (3,) on rank 0 but (4,) on rank 1"
            assert str(exc).startswith(want), f"rank {r}: {exc}"
            print(f"MISMATCH {r} {attempt}: {exc}", flush=True)
        else:
            raise AssertionError(f"rank {r}: no mismatch")
    expect_correct("after the notebook's cells")

elif mode == "reinit":
    ring.init()  # a second init is a no-op
    expect_correct("first")
    ring.shutdown()
    ring.shutdown()  # twice is harmless
    assert not ring.is_initialized()
    try:
        ring.allreduce(np.zeros(1))
    except ring.NotInitializedError as exc:
        assert "ring.init()" in str(exc)
    else:
        raise AssertionError("allreduce after shutdown did not raise")
    ring.init()
    assert ring.size() == n and ring.rank() == r
    expect_correct("after reinit")
elif mode == "held":
    # The last rank is held in a debugger (the marker engines/_debugger.py keeps while pdb has
    # the rank; usage: rt_failures.py held FOLDER) for three stall timeouts, twice: the peers wait
    # for it in an allreduce, then in the background engine's agreement by name (the held rank
    # queued another name first: the queues disagree until it queues theirs); neither raises
    # StallError, the results are exact, and a wait that outlasts the stall warning says the rank
    # is in the debugger (on stderr, checked by the test).
    from jupyter_ring.runtime._observe.debugger import hold

    hold.arm(sys.argv[2], r)
    timeout = float(os.environ["JUPYTER_RING_STALL_TIMEOUT"])
    held = n - 1
    total = n * (n + 1) / 2

    def held_for_a_while():
        if r == held:
            hold.enter("rt_failures.py:1 in <module>")
            time.sleep(3 * timeout)
            hold.leave()

    def by_name(name):
        return ring.allreduce_async(np.ones(5) * (r + 1), op=ring.Sum, name=name)

    held_for_a_while()
    start = time.perf_counter()
    got = ring.allreduce(np.ones(5) * (r + 1), op=ring.Sum, name="after_the_hold")
    waited = time.perf_counter() - start
    assert got.tolist() == [total] * 5, got
    assert r == held or waited > 2 * timeout, f"rank {r} waited only {waited:.1f} s"
    print(f"HELD {r} allreduce waited {waited:.1f}s", flush=True)

    start = time.perf_counter()
    if r == held:
        first = by_name("other")
        held_for_a_while()
        got = ring.synchronize(by_name("theirs"))
        assert ring.synchronize(first).tolist() == [total] * 5
    else:
        got = ring.synchronize(by_name("theirs"))
        waited = time.perf_counter() - start
        assert ring.synchronize(by_name("other")).tolist() == [total] * 5
        assert waited > 2 * timeout, f"rank {r} waited only {waited:.1f} s"
    assert got.tolist() == [total] * 5, got
    print(f"HELD {r} by name waited {time.perf_counter() - start:.1f}s", flush=True)
    expect_correct("after the hold")
else:
    raise SystemExit(f"unknown mode {mode}")

print(f"RANK_OK {r}", flush=True)
