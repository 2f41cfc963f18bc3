"""CUDA tensors through the device transport (NCCL), never staged: prints TORCH_CUDA_OK <rank>.

Collectives of every dtype at awkward sizes, grouped allreduce, and DistributedOptimizer training
(device buckets, .grad views of them, launched during backward) against one process's SGD.

Staging is made impossible: the adapter's host copy (``_to_numpy``) raises for a CUDA tensor, so
a collective that would stage fails here instead of passing slowly. One GPU per rank (NCCL refuses
two ranks on one device); one rank is NCCL's one-rank path.
"""

import sys

import _checks
import torch

import jupyter_ring.runtime.torch as hvd
from jupyter_ring.runtime import _device

hvd.init()
r, n = hvd.rank(), hvd.size()
dev = _checks.rank_gpu(hvd)
failures = []
_checks.forbid_for_cuda(hvd, "_to_numpy", "a CUDA tensor was staged through host memory")


def check(label, got, want, tol=1e-4):
    if not (got.is_cuda and got.shape == want.shape and torch.allclose(got.double().cpu(), want.double(),
                                                                       rtol=tol, atol=tol)):
        failures.append(f"{label}: got {got.flatten()[:4]} on {got.device}")


for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
    for length in sorted({0, 1, n + 1, 1009, (1 << 20) + 3}):
        g = torch.Generator().manual_seed(length)
        xs = [torch.randint(0, 9, (length,), generator=g).to(dtype) for _ in range(n)]
        total = sum(x.double() for x in xs) if length else torch.zeros(0, dtype=torch.float64)
        label = f"{dtype} {length}"
        check(f"allreduce Sum {label}", hvd.allreduce(xs[r].to(dev), op=hvd.Sum, name=f"s{label}"), total, 0.1)
        t = xs[r].to(dev)
        hvd.allreduce_(t, op=hvd.Max, name=f"m{label}")
        check(f"allreduce_ Max {label}", t, torch.stack(xs).double().max(0).values if length else xs[r].double())
        root = length % n
        check(f"broadcast {label}", hvd.broadcast(xs[r].to(dev), root, name=f"b{label}"), xs[root].double())
rows = [torch.full((q + 1, 3), float(q)) for q in range(n)]
check("allgather", hvd.allgather(rows[r].to(dev), name="g"), torch.cat(rows).double())
grads = [torch.randn(5, 7, device=dev), torch.randn(11, device=dev)]
want = [g.clone() for g in grads]
hvd.grouped_allreduce_(grads, op=hvd.Average, name="fused")
for got, w in zip(grads, want):
    # every rank had its own random values: compare with the all-gathered mean
    every = hvd.allgather(w.reshape(1, -1), name=f"ref{w.numel()}")
    check(f"grouped_allreduce_ {tuple(w.shape)}", got.reshape(1, -1), every.mean(0, keepdim=True).cpu().double())
# DistributedOptimizer on CUDA parameters: device buckets over NCCL, .grad views of them, launched
# during backward, the same parameters as one process's SGD on the full batch
opt = _checks.train_matches_one_process(hvd, dev, failures)
for b in opt._buckets:
    if not b.flat.is_cuda or type(b.handle).__name__ not in ("NoneType", "DeviceWork"):
        failures.append(f"bucket {b.index} lives on {b.flat.device}")
    for i in b.params:
        grad = opt._params[i].grad
        start, end = b.flat.data_ptr(), b.flat.data_ptr() + b.flat.numel() * b.flat.element_size()
        if not start <= grad.data_ptr() < end:
            failures.append(f"{opt._names[i]}.grad is not a view of its bucket")
group = _device.transport().group("cuda")
if group.kinds["cuda"] != "nccl":
    failures.append(f"the CUDA group is {group.kinds}, not NCCL")
if failures:
    print(f"rank {r}: " + "; ".join(failures[:10]), flush=True)
    sys.exit(1)
print(f"TORCH_CUDA_OK {r} {torch.cuda.get_device_name()}", flush=True)
