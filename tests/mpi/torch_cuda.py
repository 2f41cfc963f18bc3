"""CUDA tensors through the device transport (NCCL), never staged: prints TORCH_CUDA_OK <rank>.

Collectives of every dtype at awkward sizes, grouped allreduce, DistributedOptimizer training
(device buckets, .grad views of them, launched during backward) against one process's SGD, and
the NCCL communicator aborted (idle, and with an allreduce in flight) and re-created before the
next collective.

Staging is made impossible: the adapter's host copy (``_to_numpy``) raises for a CUDA tensor, so
a collective that would stage fails here instead of passing slowly. One GPU per rank (NCCL refuses
two ranks on one device); one rank is NCCL's one-rank path.
"""

import sys

import _checks
import torch

import jupyter_ring.runtime.torch as hvd
from jupyter_ring.runtime import RingError
from jupyter_ring.runtime._device import transport as _device

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

# ---- abort and rebuild of the NCCL communicator: what an interrupt or a stall inside a transfer
# does (the transport gives the group up; the notebook's guard aborts a user's group it shares),
# once with nothing in flight and once with a 64 MiB allreduce launched; the group is re-created
# on every rank before the next collective, which is exact, and training goes on
big = torch.full((1 << 24,), float(r + 1), device=dev)
for label, in_flight in (("idle", False), ("in flight", True)):
    generation, backend = group.generation, group.backends["cuda"]
    handle = hvd.allreduce_async_(big, op=hvd.Sum, name=f"abandoned {label}") if in_flight else None
    group.abort(f"test: given up {label}")
    if handle is not None:
        try:  # done before the abort (one rank is quick), or failed by it: either is right
            hvd.synchronize(handle)
        except RingError as exc:
            print(f"rank {r}: the allreduce in flight failed with the abort: {str(exc)[:80]}", flush=True)
    t = torch.arange(1009, dtype=torch.float32, device=dev) + r
    hvd.allreduce_(t, op=hvd.Sum, name=f"after abort {label}")
    check(f"allreduce after the abort ({label})", t, torch.arange(1009, dtype=torch.float64) * n + n * (n - 1) / 2)
    if group.generation != generation + 1 or group.backends["cuda"] is backend or group.aborted:
        failures.append(f"the NCCL group was not re-created after the abort ({label}): generation "
                        f"{generation} -> {group.generation}, aborted {group.aborted!r}")
    if group.kinds["cuda"] != "nccl":
        failures.append(f"after the abort ({label}) the CUDA group is {group.kinds}, not NCCL")
_checks.train_matches_one_process(hvd, dev, failures)
if failures:
    print(f"rank {r}: " + "; ".join(failures[:10]), flush=True)
    sys.exit(1)
print(f"TORCH_CUDA_OK {r} {torch.cuda.get_device_name()}", flush=True)
