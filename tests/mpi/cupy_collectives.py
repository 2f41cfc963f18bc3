"""CuPy collectives on a GPU per rank (NCCL or staged, per JUPYTER_RING_CUPY_NCCL), reducescatter, alltoall and
process sets. Prints CUPY_OK <rank>."""

import sys

import cupy as cp
import numpy as np

import jupyter_ring.runtime.cupy as ring

ring.init()
r, n = ring.rank(), ring.size()
cp.cuda.Device(ring.local_rank() % cp.cuda.runtime.getDeviceCount()).use()
failures = []


def close(label, got, want, tol=1e-5):
    got = cp.asnumpy(got) if isinstance(got, cp.ndarray) else np.asarray(got)
    if got.shape != np.shape(want) or not np.allclose(got, want, rtol=tol, atol=tol):
        failures.append(f"{label}: got {got.ravel()[:4]} shape {got.shape}")


for length in sorted({0, 1, n + 1, 1009, 1 << 20}):
    xs = [np.random.default_rng(length + q).standard_normal(length).astype(np.float32) for q in range(n)]
    close(f"allreduce Sum {length}", ring.allreduce(cp.asarray(xs[r]), op=ring.Sum, name=f"s{length}"), sum(xs))
    close(f"allreduce Average {length}", ring.allreduce(cp.asarray(xs[r]), name=f"a{length}"), sum(xs) / n)
    close(f"broadcast {length}", ring.broadcast(cp.asarray(xs[r]), n - 1, name=f"b{length}"), xs[n - 1])
parts = [np.full((q + 1, 2), q, np.float32) for q in range(n)]
close("allgather", ring.allgather(cp.asarray(parts[r]), name="g"), np.concatenate(parts))
if n > 1:
    try:
        ring.allreduce(cp.zeros(17 + r, cp.float32), name="mismatch")
        failures.append("a shape mismatch did not raise")
    except ring.CollectiveMismatchError:
        pass
close("after mismatch", ring.allreduce(cp.ones(3, cp.float32), op=ring.Sum, name="after"), np.full(3, n))

# reducescatter and alltoall (staged on every path): rows not divisible by the world size
rows = np.random.default_rng(7 + r).standard_normal((2 * n + 1, 3)).astype(np.float32)
every = [np.random.default_rng(7 + q).standard_normal((2 * n + 1, 3)).astype(np.float32) for q in range(n)]
cut = np.cumsum([0] + [(2 * n + 1) // n + (1 if q < (2 * n + 1) % n else 0) for q in range(n)])
close("reducescatter Sum", ring.reducescatter(cp.asarray(rows), op=ring.Sum, name="rs"), sum(every)[cut[r]:cut[r + 1]])
splits = [q + 1 for q in range(n)]  # rank q gets q + 1 rows from everyone
mine = np.full((sum(splits), 2), r, np.float32)
out, received = ring.alltoall(cp.asarray(mine), splits, name="a2a")
close("alltoall", out, np.concatenate([np.full((r + 1, 2), q, np.float32) for q in range(n)]))
if list(received) != [r + 1] * n:
    failures.append(f"alltoall received splits {list(received)}")

# process sets (staged through the ring's set, as the torch adapter does): {last rank} alone, and
# {0, last} of 3 or more (a set of every rank is the global one); a rank outside a set is told so
for members in sorted(s for s in {(n - 1,), (0, n - 1)} if len(s) < n):
    ps = ring.add_process_set(list(members))
    if r in members:
        k = members.index(r)
        xs = [np.random.default_rng(31 + q).standard_normal(1009).astype(np.float32) for q in members]
        close(f"set {members} allreduce Sum", ring.allreduce(cp.asarray(xs[k]), op=ring.Sum, name="ps", process_set=ps), sum(xs))
        close(f"set {members} allreduce_ Average", ring.allreduce_(cp.asarray(xs[k]), name="ps_", process_set=ps),
              sum(xs) / len(members))
        close(f"set {members} broadcast", ring.broadcast(cp.asarray(xs[k]), members[-1], name="psb", process_set=ps),
              xs[-1])
        parts = [np.full((q + 1, 2), q, np.float32) for q in members]
        close(f"set {members} allgather", ring.allgather(cp.asarray(parts[k]), name="psg", process_set=ps),
              np.concatenate(parts))
    else:
        try:
            ring.allreduce(cp.ones(3, cp.float32), name="outside", process_set=ps)
            failures.append(f"allreduce on set {members} from rank {r}, outside it, did not raise")
        except ValueError as exc:
            if "not in process set" not in str(exc):
                failures.append(f"outside set {members}: {exc}")
    ring.remove_process_set(ps)
close("after the sets", ring.allreduce(cp.ones(3, cp.float32), op=ring.Sum, name="after_sets"), np.full(3, n))
if failures:
    print(f"rank {r}: " + "; ".join(failures), flush=True)
    sys.exit(1)
print(f"CUPY_OK {r}", flush=True)
