"""The progress engine, process sets and join, one mode per run: async, sets, join.

Usage: rt_engine.py MODE. Every rank builds every rank's input from seeds, computes its own
expected result from ``rank`` and ``size`` and asserts it; each prints ``RANK_OK <rank>``.

- async: poll() tells the truth (False while a peer is late, then True without synchronize);
  errors of async collectives surface at synchronize() on every rank; an interrupt while the
  background thread runs a collective lands within a second and the next collectives are exact;
  a rank that skips a collective run in the background leaves the others a StallError naming it;
  after a rank's cell raises with entries queued, or a rank is busy while the others wait, and
  every rank is interrupted, nothing of the abandoned ops reaches the fresh collectives (also
  two resyncs later, when a freed communicator's id would come back).
- names: collectives are matched by name (Horovod): a second pending op of a name is refused;
  ops queued in different orders run once every rank queued them; a rank still computing is
  waited for; every rank blocked with no common name, or one name with two shapes, is a mismatch
  on every rank; a name never queued stalls, named; an interrupt while settling lands in a second.
- sets: process sets of odd shapes ({0,2} of 3, {1} of 2, ...): every collective inside a set,
  non-members refused, mismatch and stall inside a set name global ranks, remove/re-add.
- lock: an interrupt that lands just as a caller took the engine's executor lock (raised at the
  first check after ``acquire`` returned, before the caller's ``try``) never leaks it: on every
  path that takes it (a blocking call at once, on its prepared lane, a wait, an abandon) the next
  collectives run and are exact. The landing is made certain by a lock that raises as it is taken.
- join: ranks run out of data at different steps (rank r after 2 + r steps, then 2 + n-1-r) and call join();
  the others' allreduces (fused, eager and shared memory, Average/Sum/Max) count the joined ranks
  as zeros; join() returns the last rank on every rank; collectives are exact afterwards.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import jupyter_ring.runtime as ring
from _checks import INTERRUPT_S, Meeting
from jupyter_ring.runtime import _api

mode = sys.argv[1]
ring.init()
r, n = ring.rank(), ring.size()
meeting = Meeting()  # every rank has raised before any goes on
failures = []
LENGTHS = (0, 1, 13, 1009, 70001)  # empty, one, prime, eager, shared memory / ring


def data(seed, q, length, dtype=np.float64):
    """Rank q's input for test ``seed`` (every rank can compute every rank's)."""
    rng = np.random.default_rng(seed * 1000 + q)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-100, 100, length).astype(dtype)
    return rng.standard_normal(length).astype(dtype)


def close(label, got, want, tol=1e-9):
    got = np.asarray(got)
    if got.shape != want.shape or not np.allclose(got, want, rtol=tol, atol=tol):
        err = np.max(np.abs(got - want)) if got.shape == want.shape and got.size else "shape"
        failures.append(f"{label}: got {got.dtype}{got.shape} want {want.dtype}{want.shape} (err {err})")


def expect(label, exc_type, words, fn):
    try:
        fn()
    except exc_type as exc:
        missing = [w for w in words if w not in str(exc)]
        if missing:
            failures.append(f"{label}: message lacks {missing}: {exc}")
        return exc
    except Exception as exc:  # noqa: BLE001 - reported as a failure
        failures.append(f"{label}: raised {type(exc).__name__}, want {exc_type.__name__}: {exc}")
        return None
    failures.append(f"{label}: did not raise {exc_type.__name__}")
    return None


def exact_after(label, seed):
    """A blocking allreduce (eager and shared memory) after a failure is exact on every rank."""
    for length in (1009, 70001):
        xs = [data(seed, q, length) for q in range(n)]
        close(f"{label}: allreduce len={length}", ring.allreduce(xs[r], op=ring.Sum, name="w.grad"), sum(xs))
    h = ring.allreduce_async(np.full(3, r + 1.0), op=ring.Sum, name=f"{label}.async")
    close(f"{label}: async", ring.synchronize(h), np.full(3, n * (n + 1) / 2))


def stalled_on_rank0(exc, waited, timeout):
    """The StallError ``exc`` names rank 0 alone and came within the timeout's window."""
    if exc is not None and exc.missing != (0,):
        failures.append(f"stall: missing {exc.missing}, want (0,)")
    if not timeout <= waited < timeout + 3:
        failures.append(f"stall raised after {waited:.2f} s (timeout {timeout})")
    print(f"STALL {r} after {waited:.2f}s", flush=True)


def kill_me(delay):
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGINT)


def until(label, condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            failures.append(f"{label}: not true after {timeout} s")
            return False
        time.sleep(0.001)
    return True


if mode == "async":
    assert n > 1
    engine = _api._proc.engine
    # -- poll tells the truth: rank 0 queues its part 0.5 s late
    for length in (1009, 70001):
        xs = [data(1, q, length) for q in range(n)]
        if r == 0:
            time.sleep(0.5)
        h = ring.allreduce_async(xs[r], op=ring.Sum, name=f"late.{length}")
        if r != 0 and ring.poll(h):
            failures.append(f"poll len={length}: True while rank 0 had not called the collective")
        until(f"poll len={length} turns True without synchronize", lambda: ring.poll(h))
        close(f"late allreduce len={length}", ring.synchronize(h), sum(xs))
    # reducescatter and alltoall run in the background too (rank 0 late again); rows not
    # divisible by n: the first ranks get the extra row
    rows = 2 * n + 1
    blocks = [data(4, q, rows * 3).reshape(rows, 3) for q in range(n)]
    if r == 0:
        time.sleep(0.5)
    hr = ring.reducescatter_async(blocks[r], op=ring.Sum, name="late.rs")
    counts = [1 + (q + 1) % 3 for q in range(n)]                  # rows rank r sends to q
    sent = data(5, r, sum(counts) * 2).reshape(-1, 2)
    ha = ring.alltoall_async(sent, splits=counts, name="late.a2a")
    if r != 0 and (ring.poll(hr) or ring.poll(ha)):
        failures.append("poll of reducescatter/alltoall: True while rank 0 had not called them")
    until("reducescatter/alltoall turn True without synchronize", lambda: ring.poll(hr) and ring.poll(ha))
    start = sum(rows // n + (q < rows % n) for q in range(r))
    close("late reducescatter", ring.synchronize(hr), sum(blocks)[start:start + rows // n + (r < rows % n)])
    got, received = ring.synchronize(ha)
    offset = sum(counts[:r])   # every rank sends counts[r] rows to rank r, from its own offset
    want = np.concatenate([data(5, q, sum(counts) * 2).reshape(-1, 2)[offset:offset + counts[r]] for q in range(n)])
    close("late alltoall", got, want)
    if list(received) != [counts[r]] * n:
        failures.append(f"alltoall received splits {list(received)}, want {[counts[r]] * n}")
    # many small async ones fused in the background, then polled to completion
    parts = [[data(2, q, k) for k in LENGTHS[:4]] for q in range(n)]
    handles = [ring.allreduce_async(parts[r][i], op=ring.Average, name=f"bg.{i}") for i in range(4)]
    until("fused batch completes in the background", lambda: all(ring.poll(h) for h in handles))
    for i, h in enumerate(handles):
        close(f"background fused {i}", ring.synchronize(h), sum(p[i] for p in parts) / n)

    # -- errors of async collectives surface at synchronize(), on every rank
    h = ring.allreduce_async(np.zeros(17 + r), name="bad")  # no error here
    expect("mismatch at synchronize", ring.CollectiveMismatchError,
           ["allreduce 'bad'", "shape (17,) on rank 0 but (18,) on rank 1"], lambda: ring.synchronize(h))
    h = ring.allgather_async(np.zeros((2, 3 + min(r, 1))), name="bad.ag")
    expect("allgather mismatch at synchronize", ring.CollectiveMismatchError,
           ["trailing shape (3,) on rank 0 but (4,) on rank"], lambda: ring.synchronize(h))
    expect("synchronize twice", ValueError, ["already synchronized"], lambda: ring.synchronize(h))
    exact_after("after async mismatch", 3)

    # -- an interrupt while the background thread runs the collective (rank 0 never joins it)
    threading.Thread(target=kill_me, args=(0.8,), daemon=True).start()
    start = time.perf_counter()
    try:
        if r == 0:
            time.sleep(30)  # busy elsewhere: the others wait for it
        else:
            xs = [data(4, q, 70001) for q in range(n)]
            h = ring.allreduce_async(xs[r], op=ring.Sum, name="w.grad")
            until("the background thread takes the collective", engine.lock.locked, 5.0)
            ring.synchronize(h)
        failures.append("no KeyboardInterrupt")
    except KeyboardInterrupt:
        latency = time.perf_counter() - start - 0.8
        if latency > INTERRUPT_S:
            failures.append(f"interrupt took {latency:.2f} s to land")
        print(f"INTERRUPTED {r} {latency * 1000:.1f} ms after SIGINT", flush=True)
    if r != 0:
        if engine.lock.locked() or engine.queue.entries:
            failures.append("the background round still runs after the interrupt")
        expect("the interrupted handle", ring.RingError, ["cancelled"], lambda: ring.synchronize(h))
    meeting.meet()
    exact_after("after a background interrupt", 5)

    # -- a rank that skips a collective run in the background: StallError names it. The others
    # go on only once all have raised (a peer's next collective would otherwise restart the
    # wait of one still waiting, which pairs it with that next collective: the runtime's
    # documented recovery, but not what this tests).
    timeout = ring.config().stall_timeout
    if r != 0:
        start = time.perf_counter()
        h = ring.allreduce_async(np.ones(1009), name="w.grad")
        until("the stalled collective finishes (with an error) in the background", lambda: ring.poll(h),
              timeout + 10)
        waited = time.perf_counter() - start
        exc = expect("stall at synchronize", ring.StallError, ["rank(s) [0]", "w.grad"], lambda: ring.synchronize(h))
        stalled_on_rank0(exc, waited, timeout)
    meeting.meet()
    exact_after("after a background stall", 6)

    # -- nothing of an abandoned op reaches a later one. As in a notebook: rank 0's cell raises
    # with entries queued while the others sit in a fused round; every rank is interrupted,
    # abandons what its cell queued (the kernel's post-cell hook) and, once all have, runs fresh
    # collectives named and shaped unlike the abandoned ones.
    killer = threading.Thread(target=kill_me, args=(0.6,), daemon=True)
    killer.start()
    try:
        if r == 0:
            ring.allreduce_async(data(40, r, 13), name="stale.0")
            ring.allreduce_async(data(41, r, 1009), name="stale.1")
            raise RuntimeError("the cell failed on rank 0")
        hs = [ring.allreduce_async(data(40 + i, r, (13, 1009, 70001, 1, 2)[i]), name=f"stale.{i}") for i in range(5)]
        for h in hs:
            ring.synchronize(h)
        failures.append("the abandoned round finished")
    except (KeyboardInterrupt, RuntimeError):
        pass
    try:
        killer.join()  # the SIGINT lands on every rank, the one that raised too
    except KeyboardInterrupt:
        pass
    _api.abandon_queued("the cell failed or was interrupted")
    meeting.meet()
    fresh = [(3, "w"), (1009, "w"), (70001, "w")]  # eager, and shared memory / ring
    # ... and several resyncs in a row, each after one rank abandoned a collective while the
    # others were clean: their headers of the next collective go out on the old communicator
    # before they see the resync, and stay queued on the abandoning rank. MPICH hands a freed
    # communicator's context id to a later one, where such a header would match.
    fresh += [(5 + i, f"resync.{i}") for i in range(2 * n + 2)]
    rt = _api._proc.rt
    for i, (length, name) in enumerate(fresh):
        if i >= 3 and r == i % n:
            rt.dirty = True  # as after an abandoned collective
        xs = [data(50 + i, q, length) for q in range(n)]
        try:
            close(f"fresh allreduce {name} len={length}", ring.allreduce(xs[r], op=ring.Sum, name=name), sum(xs))
        except ring.RingError as exc:
            failures.append(f"fresh allreduce {name} len={length}: {type(exc).__name__}: {exc}")
            break
    exact_after("after abandoned rounds", 8)

elif mode == "names":
    assert n > 1
    timeout = ring.config().stall_timeout

    def op_set(seed):
        """Every rank's collectives of one test: name -> (submit, want), all named."""
        ops = {}
        for i, length in enumerate(LENGTHS):
            xs = [data(seed + i, q, length) for q in range(n)]
            ops[f"ar.{length}"] = (lambda xs=xs, nm=f"ar.{length}": ring.allreduce_async(xs[r], op=ring.Sum, name=nm),
                                   sum(xs))
        rows = [(q * 5 + seed) % 4 for q in range(n)]               # 0 rows on some rank
        blocks = [data(seed + 10, q, rows[q] * 3).reshape(rows[q], 3) for q in range(n)]
        ops["ag"] = (lambda: ring.allgather_async(blocks[r], name="ag"), np.concatenate(blocks))
        root = (seed + 1) % n
        ops["bc"] = (lambda: ring.broadcast_async(data(seed + 20, r, 11), root_rank=root, name="bc"),
                     data(seed + 20, root, 11))
        total = 2 * n + 1                                            # not divisible by n
        mats = [data(seed + 30, q, total * 2).reshape(total, 2) for q in range(n)]
        start = sum(total // n + (q < total % n) for q in range(r))
        ops["rs"] = (lambda: ring.reducescatter_async(mats[r], op=ring.Sum, name="rs"),
                     sum(mats)[start:start + total // n + (r < total % n)])
        return ops

    # -- Horovod's duplicate-name sequence, every collective: a second pending op of a name is
    # refused at the call (ValueError); rank 0's first one waits in its queue while the others run
    # barrier() first, then runs once they queue it
    ring.config().cycle_ms = 50.0  # the others' first one is still pending at their second call
    for kind in ("allreduce", "allgather", "broadcast", "reducescatter"):
        t = np.full((n, 3), float(r + 1))
        submit = {"allreduce": lambda: ring.allreduce_async(t, op=ring.Sum, name=f"dup.{kind}"),
                  "allgather": lambda: ring.allgather_async(t, name=f"dup.{kind}"),
                  "broadcast": lambda: ring.broadcast_async(t, root_rank=0, name=f"dup.{kind}"),
                  "reducescatter": lambda: ring.reducescatter_async(t, op=ring.Sum, name=f"dup.{kind}")}[kind]
        want = {"allreduce": np.full((n, 3), n * (n + 1) / 2), "broadcast": np.full((n, 3), 1.0),
                "allgather": np.concatenate([np.full((n, 3), q + 1.0) for q in range(n)]),
                "reducescatter": np.full((1, 3), n * (n + 1) / 2)}[kind]
        h = None
        if r == 0:
            h = submit()
            expect(f"{kind}: second pending op of the name, rank 0", ValueError, [f"'dup.{kind}'", "still pending"],
                   submit)
        ring.barrier()
        if r > 0:
            h = submit()
            expect(f"{kind}: second pending op of the name, rank {r}", ValueError, ["still pending"], submit)
        ring.barrier()
        close(f"{kind}: the op queued before barrier()", ring.synchronize(h), want)
    ring.config().cycle_ms = 1.0

    # -- the same collectives queued in a different order on every rank, synchronized in yet
    # another: each runs once every rank has queued it
    for seed in (100, 200):
        ops = op_set(seed)
        names = list(ops)
        rng = np.random.default_rng(seed + r)
        handles = {name: ops[name][0]() for name in rng.permutation(names)}
        for name in rng.permutation(names):
            close(f"order {seed}: {name}", ring.synchronize(handles[name]), ops[name][1])

    # -- a rank still computing: the others wait for it (no mismatch), whatever they queued first
    xs = {nm: [data(300 + i, q, 70001 if i else 13) for q in range(n)] for i, nm in enumerate(("early", "late"))}
    if r == 0:
        h_early = ring.allreduce_async(xs["early"][r], op=ring.Sum, name="early")
        time.sleep(0.3)  # computing; the others block on "late" meanwhile
        h_late = ring.allreduce_async(xs["late"][r], op=ring.Sum, name="late")
    else:
        h_late = ring.allreduce_async(xs["late"][r], op=ring.Sum, name="late")
        h_early = ring.allreduce_async(xs["early"][r], op=ring.Sum, name="early")
    close("late: queued late on rank 0", ring.synchronize(h_late), sum(xs["late"]))
    close("early", ring.synchronize(h_early), sum(xs["early"]))

    # -- every rank blocked, no name in common: the mismatch on every rank at once, naming each
    # rank's op; the same name with another shape: a mismatch naming both
    others = ", ".join(f"only.{q} on rank {q}" for q in range(1, n))
    expect("no common name", ring.CollectiveMismatchError, [f"name only.0 on rank 0 but {others}"],
           lambda: ring.allreduce(np.ones(3), name=f"only.{r}"))
    expect("no common name, async", ring.CollectiveMismatchError, ["allgather on rank"],
           lambda: ring.synchronize(ring.allgather_async(np.ones((1, 2)), name="g") if r == 0
                                    else ring.allreduce_async(np.ones(2), name="g2")))
    expect("same name, another shape", ring.CollectiveMismatchError, ["shape (3,) on rank 0 but (4,) on rank"],
           lambda: ring.allreduce(np.ones(4 if r else 3), name="shape"))
    exact_after("after name mismatches", 400)

    # -- a rank that never queues the others' name: a StallError after the stall timeout, naming
    # it and what it queued instead; its own op fails alike
    start = time.perf_counter()
    if r == 0:
        h = ring.allreduce_async(np.ones(5), name="mine")
        time.sleep(timeout + 1.0)  # computing past the stall timeout
        expect("stall, the computing rank", ring.StallError, ["allreduce 'mine'", "rank(s) [1"],
               lambda: ring.synchronize(h))
    else:
        exc = expect("stall, a blocked rank", ring.StallError, ["allreduce 'theirs'", "rank(s) [0]", "allreduce 'mine'"],
                     lambda: ring.allreduce(np.ones(5), name="theirs"))
        stalled_on_rank0(exc, time.perf_counter() - start, timeout)
    meeting.meet()
    exact_after("after a name stall", 401)

    # -- an interrupt while the ranks wait for each other's names lands within a second
    threading.Thread(target=kill_me, args=(0.5,), daemon=True).start()
    start = time.perf_counter()
    try:
        if r == 0:
            ring.allreduce(np.ones(7), name="blocked")
        else:
            ring.allreduce_async(np.ones(7), name="queued")
            time.sleep(30)  # computing
        failures.append("no KeyboardInterrupt")
    except KeyboardInterrupt:
        latency = time.perf_counter() - start - 0.5
        if latency > INTERRUPT_S:
            failures.append(f"interrupt took {latency:.2f} s to land")
        print(f"INTERRUPTED {r} {latency * 1000:.1f} ms after SIGINT", flush=True)
    _api.abandon_queued("the cell was interrupted")
    meeting.meet()
    exact_after("after an interrupt while settling", 402)

elif mode == "sets":
    assert n > 1
    evens = ring.add_process_set([q for q in range(n) if q % 2 == 0])   # {0,2} of 3, {0} of 2
    one = ring.add_process_set(ring.ProcessSet([1]))                    # {1}
    tail = ring.add_process_set(list(range(1, n))) if n > 2 else None  # {1..n-1}
    for ps in (evens, one) + ((tail,) if tail else ()):
        members = ps.ranks
        if ps.size() != len(members) or ps.included() != (r in members):
            failures.append(f"{ps}: size {ps.size()} included {ps.included()}")
        if not ps.included():
            expect(f"non-member {members}", ValueError, [f"rank {r} is not in process set {members}"],
                   lambda: ring.allreduce(np.zeros(3), process_set=ps))
            continue
        if ps.rank() != members.index(r):
            failures.append(f"{ps}: rank() {ps.rank()} want {members.index(r)}")
        tag = "".join(map(str, members))
        for length in LENGTHS:
            xs = {q: data(10 + length, q, length) for q in members}
            close(f"set {members} allreduce len={length}",
                  ring.allreduce(xs[r], op=ring.Sum, name=f"s{tag}.{length}", process_set=ps),
                  sum(xs.values()) if length else np.zeros(0))
            got = ring.allreduce(xs[r], name=f"a{tag}.{length}", process_set=ps)  # Average over the set
            close(f"set {members} average len={length}", got, sum(xs.values()) / len(members))
        hs = [ring.allreduce_async(data(20 + i, r, 7 * i + 1), op=ring.Max, name=f"f{tag}.{i}", process_set=ps)
              for i in range(5)]
        for i, h in enumerate(hs):
            close(f"set {members} fused {i}", ring.synchronize(h),
                  np.max([data(20 + i, q, 7 * i + 1) for q in members], axis=0))
        rows = {q: (q * 3) % 4 for q in members}
        got = ring.allgather(np.full((rows[r], 2), r, np.int32), name=f"g{tag}", process_set=ps)
        want = np.concatenate([np.full((rows[q], 2), q, np.int32) for q in members])
        close(f"set {members} allgather", got, want)
        root = members[-1]
        close(f"set {members} broadcast root {root}",
              ring.broadcast(data(30, r, 11), root_rank=root, name=f"b{tag}", process_set=ps), data(30, root, 11))
        objs = ring.allgather_object((r, "x" * r), process_set=ps)
        if objs != [(q, "x" * q) for q in members]:
            failures.append(f"set {members} allgather_object: {objs}")
        if ring.broadcast_object({"root": root} if r == root else None, root_rank=root, process_set=ps) != {"root": root}:
            failures.append(f"set {members} broadcast_object")
        rs = ring.reducescatter(np.full((len(members) + 1, 2), float(r)), op=ring.Sum, process_set=ps)
        if rs.shape[0] != (2 if ps.rank() == 0 else 1) or not np.all(rs == sum(members)):
            failures.append(f"set {members} reducescatter: {rs}")
        ring.barrier(process_set=ps)
        outside = [q for q in range(n) if q not in members]
        if outside:
            expect(f"root outside {members}", ValueError, [f"root_rank {outside[0]} is not in process set"],
                   lambda: ring.broadcast(np.zeros(2), root_rank=outside[0], process_set=ps))
    # the global set goes on between them
    close("global after sets", ring.allreduce(np.full(5, r + 1.0), op=ring.Sum, name="glob"),
          np.full(5, n * (n + 1) / 2))
    # mismatch and stall inside a set name global ranks; the others wait that out
    if n >= 3 and r in tail.ranks:
        last = tail.ranks[-1]
        expect("set mismatch", ring.CollectiveMismatchError,
               ["shape (4,) on rank", f"(5,) on rank {last}"],
               lambda: ring.allreduce(np.zeros(5 if r == last else 4), name="m", process_set=tail))
        close("set after mismatch", ring.allreduce(np.ones(2), op=ring.Sum, name="m2", process_set=tail),
              np.full(2, len(tail.ranks)))
        timeout = ring.config().stall_timeout
        resume = ring.broadcast_object(time.time() + timeout + 1.5, root_rank=tail.ranks[0], process_set=tail)
        if r != last:
            exc = expect("set stall", ring.StallError, [f"rank(s) [{last}]"],
                         lambda: ring.allreduce(np.ones(3), name="st", process_set=tail))
            if exc is not None and exc.missing != (last,):
                failures.append(f"set stall missing {exc.missing}, want ({last},)")
        time.sleep(max(0.0, resume - time.time()))  # every waiting member has raised by then
        close("set after stall", ring.allreduce(np.ones(2), op=ring.Sum, name="m3", process_set=tail),
              np.full(2, len(tail.ranks)))
    meeting.meet()
    expect("duplicate set", ValueError, ["duplicate process set"], lambda: ring.add_process_set([1]))
    if not ring.remove_process_set(one) or one.process_set_id is not None:
        failures.append("remove_process_set did not remove {1}")
    if r == 1:
        expect("removed set", ValueError, ["not registered"],
               lambda: ring.allreduce(np.zeros(1), process_set=one))
    again = ring.add_process_set([1])
    if r == 1:
        close("re-added {1}", ring.allreduce(np.full(2, 3.0), op=ring.Sum, process_set=again), np.full(2, 3.0))
    close("global at the end", ring.allreduce(np.full(2, r + 1.0), op=ring.Sum, name="end"),
          np.full(2, n * (n + 1) / 2))

elif mode == "join":
    def steps(q, rnd):
        # round 0: rank q runs out of data after 2 + q steps (rank 0 joins first); round 1 the
        # other way round, after round 0 left the last rank with the most collectives run
        return 2 + (q if rnd == 0 else n - 1 - q)

    for rnd in range(2):  # join twice: the joined state resets between
        def active(step):
            return [q for q in range(n) if step < steps(q, rnd)]

        for step in range(steps(r, rnd)):
            seed = 100 * rnd + step
            a = {q: data(seed, q, 5) for q in range(n)}
            b = {q: data(seed + 50, q, 17) for q in range(n)}
            big = {q: data(seed + 70, q, 70001) for q in range(n)}
            ha = ring.allreduce_async(a[r], name="tensor_a")  # Average: joined ranks count as zeros
            hb = ring.allreduce_async(b[r], name="tensor_b")
            close(f"join {rnd} step {step} a", ring.synchronize(ha), sum(a[q] for q in active(step)) / n)
            close(f"join {rnd} step {step} b", ring.synchronize(hb), sum(b[q] for q in active(step)) / n)
            close(f"join {rnd} step {step} big", ring.allreduce(big[r], op=ring.Sum, name="big"),
                  sum(big[q] for q in active(step)))
            want = np.max([big[q] for q in active(step)] + ([np.zeros(70001)] if len(active(step)) < n else []), axis=0)
            close(f"join {rnd} step {step} max", ring.allreduce(big[r], op=ring.Max, name="max"), want)
            ints = {q: data(seed, q, 9, np.int64) for q in range(n)}
            close(f"join {rnd} step {step} int average",
                  ring.allreduce(ints[r], name="ints"), sum(ints[q] for q in active(step)) // n)
            if n >= 3 and rnd == 0 and step == steps(0, rnd):  # rank 0 has joined: only allreduce may run
                expect("broadcast while a rank joined", ring.RingError, ["rank(s) [0] called join()"],
                       lambda: ring.broadcast(np.zeros(3), root_rank=1, name="bc"))
        last, want = ring.join(), (n - 1 if rnd == 0 else 0)
        if last != want:
            failures.append(f"join round {rnd}: returned {last}, want {want}")
        everyone = ring.allgather_object(last)
        if everyone != [want] * n:
            failures.append(f"join round {rnd}: ranks returned {everyone}")
        exact_after(f"after join round {rnd}", 7 + rnd)
elif mode == "lock":
    class InterruptAsTaken:
        """The engine's lock, raising KeyboardInterrupt once, just after it was taken while armed
        (where a real SIGINT lands when it arrives as ``acquire`` returns)."""

        def __init__(self, inner):
            self.inner, self.armed = inner, False

        def acquire(self, *args, **kwargs):
            took = self.inner.acquire(*args, **kwargs)
            if took and self.armed and threading.current_thread() is threading.main_thread():
                self.armed = False
                raise KeyboardInterrupt
            return took

        def __getattr__(self, name):
            return getattr(self.inner, name)

    engine = _api._proc.engine
    lock = engine.lock._lock = InterruptAsTaken(engine.lock._lock)
    hung = threading.Timer(60.0, lambda: (print(f"RANK_FAIL {r}: the executor lock leaked (hang)",
                                                flush=True), os._exit(1)))
    hung.daemon = True
    hung.start()
    xs = [data(11, q, 1009) for q in range(n)]
    for label, call in (
            ("blocking call", lambda: ring.allreduce(xs[r], op=ring.Sum, name="lk")),
            ("prepared lane", lambda: ring.allreduce(xs[r], op=ring.Sum, name="lk")),  # 2nd: on its lane
            ("wait", lambda: ring.synchronize(ring.allreduce_async(xs[r], op=ring.Sum, name="lk.a"))),
            ("broadcast lane", lambda: ring.broadcast(xs[r], root_rank=0, name="lk.b"))):
        for attempt in range(2):  # the first leaves its lane prepared for the second
            lock.armed = True
            try:
                got = call()
            except KeyboardInterrupt:
                got = None
            if lock.armed:
                failures.append(f"{label}, {attempt}: the main thread never took the lock (nothing tested)")
            lock.armed = False
            exact_after(f"after an interrupt as the lock was taken ({label}, {attempt})", 12 + attempt)
    engine.abandon("a test's abandon")  # abandon takes the lock too (blocking, with a timeout)
    exact_after("after abandon", 14)
    hung.cancel()
else:
    raise SystemExit(f"unknown mode {mode}")

if failures:
    print(f"RANK_FAIL {r}: " + "; ".join(failures[:20]), flush=True)
    sys.exit(1)
print(f"RANK_OK {r}", flush=True)
