"""CUDA tensors reduced by the ring through pinned host buffers: prints TORCH_STAGED_OK <rank>.

Run with ``JUPYTER_RING_DEVICE_TRANSPORT=off`` (what two ranks sharing one GPU need: NCCL refuses
them). The pageable host copy (``_to_numpy``) raises for a CUDA tensor here, so every allreduce
below must take the pinned path. Checks exact results on every rank at awkward sizes, in place and
out of place, non-contiguous inputs, scale factors, several collectives in flight at once (each
holds its own buffer), that buffers are reused, not allocated per call, and DistributedOptimizer
training (host buckets) against one process's SGD.
"""

import sys

import _checks
import torch

import jupyter_ring.runtime.torch as hvd
from jupyter_ring.runtime.torch import mpi_ops

hvd.init()
r, n = hvd.rank(), hvd.size()
dev = _checks.rank_gpu(hvd)
failures = []
_checks.forbid_for_cuda(hvd, "_to_numpy", "a CUDA allreduce went through a pageable host copy")


def check(label, got, want):
    if not (got.is_cuda and got.shape == want.shape and torch.equal(got.cpu(), want.cpu())):
        failures.append(f"{label}: got {got.flatten()[:4].tolist()} on {got.device}, want {want.flatten()[:4].tolist()}")


def every_rank(shape, dtype, seed):
    """Every rank's random input (each rank makes all of them from the same seeds)."""
    out = []
    for q in range(n):
        g = torch.Generator().manual_seed(seed * 1000 + q)
        out.append(torch.randint(-50, 50, shape, generator=g).to(dtype))
    return out


sizes = sorted({0, 1, 7, n + 1, 1009, (1 << 20) + 3})
for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16):
    for length in sizes:
        xs = every_rank((length,), dtype, length)
        label = f"{dtype} {length}"
        want = sum(x.double() for x in xs).to(dtype) if length else xs[r]
        check(f"allreduce Sum {label}", hvd.allreduce(xs[r].to(dev), op=hvd.Sum, name=f"s{label}"), want)
        t = xs[r].to(dev)
        out = hvd.allreduce_(t, op=hvd.Max, name=f"m{label}")
        check(f"allreduce_ Max {label}", t, torch.stack(xs).max(0).values if length else xs[r])
        if out is not t:
            failures.append(f"allreduce_ {label} returned another tensor")
# non-contiguous, in place and out: the result lands in the tensor's own layout
xs = every_rank((13, 11), torch.float32, 3)
t = xs[r].to(dev).t()
hvd.allreduce_(t, op=hvd.Sum, name="transposed")
check("allreduce_ transposed", t, sum(xs).t())
check("allreduce transposed", hvd.allreduce(xs[r].to(dev).t(), op=hvd.Sum, name="transposed2"), sum(xs).t())
# Average and scale factors (float32: the runtime scales)
xs = every_rank((101,), torch.float32, 5)
got = hvd.allreduce(xs[r].to(dev), op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0, name="scaled")
check("allreduce scaled", got, sum(x * 0.5 for x in xs) * 4.0)
got = hvd.allreduce(xs[r].to(dev) * n, op=hvd.Average, name="avg")
check("allreduce Average", got, sum(x * n for x in xs) / n)
# several in flight at once, finished in reverse order: each has its own buffer
inputs = [every_rank((257 + 31 * k,), torch.float32, 10 + k) for k in range(4)]
tensors = [inp[r].to(dev) for inp in inputs]
handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"flight{k}") for k, t in enumerate(tensors)]
for k in reversed(range(4)):
    hvd.synchronize(handles[k])
    check(f"in flight {k}", tensors[k], sum(inputs[k]))
# buffers are kept and lent again, not allocated per call
before = {key: len(v) for key, v in mpi_ops._staging.free.items()}
for _ in range(5):
    hvd.allreduce_(torch.ones(1009, device=dev), op=hvd.Sum, name="reuse")
after = {key: len(v) for key, v in mpi_ops._staging.free.items()}
if after != before or not all(b.is_pinned() for v in mpi_ops._staging.free.values() for b in v):
    failures.append(f"staging buffers not reused or not pinned: {before} -> {after}")
# DistributedOptimizer on CUDA parameters with the transport off: host buckets the ring reduces
opt = _checks.train_matches_one_process(hvd, dev, failures)
if any(b.device is not None for b in opt._buckets):
    failures.append(f"buckets on {[str(b.device) for b in opt._buckets]} with the transport off")
if failures:
    print(f"rank {r}: " + "; ".join(failures[:10]), flush=True)
    sys.exit(1)
print(f"TORCH_STAGED_OK {r} {torch.cuda.get_device_name()}", flush=True)
