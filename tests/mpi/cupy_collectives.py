"""CuPy collectives on a GPU per rank (NCCL or staged, per JUPYTER_RING_CUPY_NCCL). Prints CUPY_OK <rank>."""

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
if failures:
    print(f"rank {r}: " + "; ".join(failures), flush=True)
    sys.exit(1)
print(f"CUPY_OK {r}", flush=True)
