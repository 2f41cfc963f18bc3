"""The agreement relayed in log2(n) steps (JUPYTER_RING_AGREEMENT=log, set by the test): every
collective kind exact on every rank at awkward sizes, the exchanges counted in ``ring.stats()``,
a mismatch raised alike on every rank, a rank's bad arguments (its poison) reaching every peer,
and exact collectives after each. Every rank asserts its own expected values and prints
RANK_OK r or RANK_FAIL r: reasons. ``resyncs``: resyncs in a row, under either agreement."""

import os
import sys

import numpy as np

from jupyter_ring import runtime as ring
from jupyter_ring.runtime._engine.wire import HEADER_BYTES

ring.init()
r, n = ring.rank(), ring.size()
failures = []
LENGTHS = sorted({0, 1, 2, n - 1, n + 1, 13, 1009})


def data(seed, q, shape, dtype=np.float64):
    rng = np.random.default_rng(1000 * seed + q)
    return (rng.standard_normal(shape) * 10).astype(dtype) if np.dtype(dtype).kind == "f" else \
        rng.integers(-50, 50, shape).astype(dtype)


def check(label, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-12, atol=1e-12):
        failures.append(f"{label}: got {got.ravel()[:4]} shape {got.shape}, want {want.ravel()[:4]} shape {want.shape}")


def exact(label, seed):
    """One of each collective kind on random data at awkward sizes, checked on this rank."""
    for length in LENGTHS:
        xs = [data(seed + length, q, length) for q in range(n)]
        check(f"{label} allreduce len={length}", ring.allreduce(xs[r], op=ring.Sum, name=f"ar.{length}"), sum(xs))
        ints = [data(seed + length, q, length, np.int32) for q in range(n)]
        check(f"{label} allreduce max len={length}", ring.allreduce(ints[r], op=ring.Max, name=f"mx.{length}"),
              np.max(ints, axis=0) if length else ints[0])
        rows = [(length + q) % 5 for q in range(n)]  # rows differ per rank, 0 among them
        blocks = [data(seed + 7, q, (rows[q], 3)) for q in range(n)]
        check(f"{label} allgather len={length}", ring.allgather(blocks[r], name=f"ag.{length}"), np.concatenate(blocks))
        root = (length + 1) % n
        check(f"{label} broadcast len={length}", ring.broadcast(xs[r], root_rank=root, name=f"bc.{length}"), xs[root])
        total = sum(xs)
        cuts = np.cumsum([0] + [length // n + (1 if q < length % n else 0) for q in range(n)])
        check(f"{label} reducescatter len={length}", ring.reducescatter(xs[r], op=ring.Sum, name=f"rs.{length}"),
              total[cuts[r]:cuts[r + 1]])
    # alltoall: rank q sends (q + p) % 3 rows to rank p
    splits = np.array([(r + p) % 3 for p in range(n)], np.int32)
    sent = {q: data(seed + 11, q, (sum((q + p) % 3 for p in range(n)), 2)) for q in range(n)}
    got, recv_splits = ring.alltoall(sent[r], splits=splits, name="a2a")
    want = []
    for q in range(n):
        start = sum((q + p) % 3 for p in range(r))
        want.append(sent[q][start:start + (q + r) % 3])
    check(f"{label} alltoall", got, np.concatenate(want))
    if list(recv_splits) != [(q + r) % 3 for q in range(n)]:
        failures.append(f"{label} alltoall: received splits {list(recv_splits)}")
    ring.barrier()
    obj = ring.broadcast_object({"from": n - 1, "seed": seed} if r == n - 1 else None, root_rank=n - 1)
    if obj != {"from": n - 1, "seed": seed}:
        failures.append(f"{label} broadcast_object: {obj}")
    if ring.allgather_object((r, seed)) != [(q, seed) for q in range(n)]:
        failures.append(f"{label} allgather_object")


def expect(label, kind, parts, fn):
    """``fn`` raises ``kind`` on this rank, naming every one of ``parts``; returns its message."""
    try:
        fn()
    except kind as exc:
        missing = [part for part in parts if part not in str(exc)]
        if missing:
            failures.append(f"{label}: {type(exc).__name__} without {missing}: {exc}")
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - reported as the failure it is
        failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
        return ""
    failures.append(f"{label}: nothing raised")
    return ""


if sys.argv[1:] == ["resyncs"]:
    # Resyncs in a row, each announced by a rank that completed the collective before while its
    # peers may still wait for that collective's last messages (a relay, recursive doubling): the
    # notice must not send them back to run it alone on the fresh communicator.
    from jupyter_ring.runtime import _api

    rt = _api._proc.rt
    for i in range(3 * n + 2):
        if i and r == i % n:
            rt.dirty = True  # as after a collective this rank gave up
        xs = [data(60 + i, q, 5 + i) for q in range(n)]
        try:
            check(f"resync {i}", ring.allreduce(xs[r], op=ring.Sum, name=f"resync.{i}"), sum(xs))
        except ring.RingError as exc:
            failures.append(f"resync {i}: {type(exc).__name__}: {exc}")
            break
    print(f"RANK_FAIL {r}: " + "; ".join(failures[:20]) if failures else f"RANK_OK {r}", flush=True)
    ring.shutdown()
    sys.exit(0)
assert os.environ.get("JUPYTER_RING_AGREEMENT") == "log"

ring.reset_stats()
exact("first", 1)
stats = ring.stats()
if n > 1:
    relayed = stats.get("agreement[log]")
    if relayed is None or "agreement[all]" in stats:
        failures.append(f"stats() has {sorted(k for k in stats if k.startswith('agreement'))}, want agreement[log]")
    elif relayed["count"] < 5 * len(LENGTHS) + 4 or relayed["bytes"] != relayed["count"] * (n - 1) * HEADER_BYTES:
        # alltoall's per-peer headers follow its relayed agreement, directly (counted apart)
        failures.append(f"agreement[log]: {relayed}, want at least {5 * len(LENGTHS) + 4} of {n - 1} headers")
    if "allreduce[eager]" in stats:
        failures.append("an eager allreduce ran: relayed headers carry no payload")

if n > 1:
    # a mismatch: raised on every rank with the same message, then exact collectives
    message = expect("shape mismatch", ring.CollectiveMismatchError, ["'w'", "shape", f"rank {n - 1}"],
                     lambda: ring.allreduce(np.ones(4 + (r == n - 1)), name="w"))
    said = ring.allgather_object(message)
    if len(set(said)) != 1:
        failures.append(f"the mismatch differs between ranks: {said}")
    exact("after a mismatch", 2)
    # a rank's bad arguments: its ValueError there, PeerError naming it on every other rank
    bad = n // 2
    if r == bad:
        expect("bad op on this rank", ValueError, ["Adasum"],
               lambda: ring.allreduce(np.ones(5), op=ring.Adasum, name="g"))
    else:
        expect("a peer's bad op", ring.PeerError, [f"rank {bad}", "Adasum", "'g'"],
               lambda: ring.allreduce(np.ones(5), name="g"))
    exact("after a peer's poison", 3)
    # twice in a row, another rank: the resync after the first leaves nothing behind
    bad = n - 1
    if r == bad:
        expect("bad root on this rank", ValueError, ["root_rank"],
               lambda: ring.broadcast(np.ones(3), root_rank=n + 5, name="b"))
    else:
        expect("a peer's bad root", ring.PeerError, [f"rank {bad}", "'b'"],
               lambda: ring.broadcast(np.ones(3), root_rank=0, name="b"))
    exact("after a second poison", 4)
    # every rank's arguments bad alike: each raises its own error, none a peer's, then exact
    expect("bad root on every rank", ValueError, ["root_rank"],
           lambda: ring.broadcast(np.ones(3), root_rank=-1, name="b2"))
    exact("after every rank's poison", 5)

print(f"RANK_FAIL {r}: " + "; ".join(failures[:20]) if failures else f"RANK_OK {r}", flush=True)
ring.shutdown()
