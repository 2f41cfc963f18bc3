"""Every torch collective: dtypes (bfloat16 included), awkward lengths, in place, async, autograd.

Every rank builds every rank's random input from a shared seed, computes the reference itself and
asserts its own result; it prints ``TORCH_COLLECTIVES_OK <rank>`` when all checks pass.
"""

import sys
import time

import numpy as np
import torch

import jupyter_ring.runtime.torch as hvd

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
LENGTHS = sorted({0, 1, max(n - 1, 0), n + 1, 13, 1009, 70001})
failures = []


def inputs(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.int32, torch.int64, torch.uint8):
        return [torch.randint(0, 50, shape, generator=g).to(dtype) for _ in range(n)]
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(n)]


def check(label, got, want, rtol=1e-5, atol=1e-5):
    if not isinstance(got, torch.Tensor):
        failures.append(f"{label}: got {type(got).__name__}, want a tensor")
        return
    if got.dtype != want.dtype or got.shape != want.shape:
        failures.append(f"{label}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
        return
    if not torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol):
        failures.append(f"{label}: values differ (max abs diff {(got.double() - want.double()).abs().max():.3g})")


seed = 0
for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12), (torch.float16, 2e-2),
                   (torch.bfloat16, 3e-2), (torch.int64, 0), (torch.int32, 0)):
    for length in LENGTHS:
        seed += 1
        xs = inputs(seed, (length,), dtype)
        total = sum(x.double() for x in xs) if length else torch.zeros(0, dtype=torch.float64)
        label = f"{dtype} length {length}"
        check(f"allreduce Sum {label}", hvd.allreduce(xs[r], op=hvd.Sum, name=f"s{seed}"),
              total.to(dtype), rtol=tol, atol=tol * n)
        if dtype.is_floating_point:
            check(f"allreduce Average {label}", hvd.allreduce(xs[r], name=f"a{seed}"),
                  (total / n).to(dtype), rtol=tol, atol=tol * n)
        check(f"allreduce Max {label}", hvd.allreduce(xs[r], op=hvd.Max, name=f"m{seed}"),
              torch.stack(xs).max(0).values if length else xs[r])
        t = xs[r].clone()
        out = hvd.allreduce_(t, op=hvd.Sum, name=f"i{seed}")
        if out is not t:
            failures.append(f"allreduce_ {label}: did not return its input tensor")
        check(f"allreduce_ {label}", t, total.to(dtype), rtol=tol, atol=tol * n)
        # allgather with a different dim 0 on every rank
        rows = [(length + q) % 5 for q in range(n)]
        parts = [inputs(seed + 1000 + q, (rows[q], 3), dtype)[q] for q in range(n)]
        check(f"allgather {label}", hvd.allgather(parts[r], name=f"g{seed}"), torch.cat(parts))
        root = seed % n
        check(f"broadcast root {root} {label}", hvd.broadcast(xs[r], root, name=f"b{seed}"), xs[root])
        t = xs[r].clone()
        hvd.broadcast_(t, root, name=f"bi{seed}")
        check(f"broadcast_ {label}", t, xs[root])

# non-contiguous and 2-D tensors, in place
base = inputs(99, (7, 6), torch.float32)
views = [b.t() for b in base]
t = base[r].clone().t()
hvd.allreduce_(t, op=hvd.Sum, name="noncontig")
check("allreduce_ non-contiguous", t, sum(views))

# async handles, fused, completed in reverse order
xs = inputs(7, (33, 5), torch.float32)
handles = [hvd.allreduce_async(xs[r] * (k + 1), name=f"async{k}", op=hvd.Sum) for k in range(6)]
for k in reversed(range(6)):
    check(f"allreduce_async {k}", hvd.synchronize(handles[k]), sum(xs) * (k + 1))
h = hvd.allreduce_async_(xs[r].clone(), name="poll", op=hvd.Sum)
deadline = time.monotonic() + 30
while not hvd.poll(h):  # the background engine finishes it without synchronize()
    assert time.monotonic() < deadline, "poll() never turned True"
    time.sleep(0.001)
check("poll then synchronize", hvd.synchronize(h), sum(xs))

# grouped
group = [inputs(50 + k, (k * 3 + 1,), torch.float32) for k in range(4)]
outs = hvd.grouped_allreduce([g[r] for g in group], op=hvd.Sum, name="group")
for k, out in enumerate(outs):
    check(f"grouped_allreduce {k}", out, sum(group[k]))
mine = [g[r].clone() for g in group]
hvd.grouped_allreduce_(mine, name="group_", op=hvd.Average)
for k, t in enumerate(mine):
    check(f"grouped_allreduce_ {k}", t, sum(group[k]) / n)

# fp16 compression keeps the dtype
xs = inputs(8, (101,), torch.float32)
check("allreduce fp16 compression", hvd.allreduce(xs[r], name="fp16", compression=hvd.Compression.fp16),
      sum(xs) / n, rtol=1e-2, atol=1e-2)

# alltoall: rank r sends (r + q) % 3 rows to rank q
splits = [(r + q) % 3 for q in range(n)]
rows = [torch.full(((p + r) % 3, 2), float(100 * p + r)) for p in range(n)]  # what p sends r
mine = torch.cat([torch.full((splits[q], 2), float(100 * r + q)) for q in range(n)])
out, received = hvd.alltoall(mine, splits=torch.tensor(splits), name="a2a")
check("alltoall", out, torch.cat(rows))
if received.tolist() != [(p + r) % 3 for p in range(n)]:
    failures.append(f"alltoall received_splits {received.tolist()}")

# reducescatter: rows split as Horovod does (first ranks get the extra row)
xs = inputs(9, (2 * n + 1, 4), torch.float32)
lo = sum(2 + (1 if q < 1 else 0) for q in range(r))
mine_rows = 2 + (1 if r < 1 else 0)
check("reducescatter", hvd.reducescatter(xs[r], op=hvd.Sum, name="rs"), sum(xs)[lo:lo + mine_rows])

# autograd: d/dx sum(allreduce(x * w)) = allreduce(ones) * w = w  (Average of ones)
x = torch.arange(5.0, requires_grad=True)
y = hvd.allreduce(x * (r + 1), name="ag.allreduce", op=hvd.Sum)
check("autograd allreduce forward", y.detach(), torch.arange(5.0) * sum(range(1, n + 1)))
y.sum().backward()
check("autograd allreduce backward", x.grad, torch.full((5,), float(n * (r + 1))))
x = torch.ones(r + 1, 2, requires_grad=True)
g = hvd.allgather(x, name="ag.allgather")
(g * torch.arange(g.shape[0], dtype=torch.float32).unsqueeze(1)).sum().backward()
offset = sum(q + 1 for q in range(r))
check("autograd allgather backward", x.grad,
      torch.arange(offset, offset + r + 1, dtype=torch.float32).unsqueeze(1).expand(r + 1, 2))

# objects and parameters
obj = hvd.broadcast_object({"rank": r, "list": list(range(r))}, root_rank=n - 1)
if obj != {"rank": n - 1, "list": list(range(n - 1))}:
    failures.append(f"broadcast_object: {obj}")
if hvd.allgather_object(("r", r)) != [("r", q) for q in range(n)]:
    failures.append("allgather_object")
torch.manual_seed(r)
model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
flat = torch.cat([v.double().reshape(-1) for v in model.state_dict().values()])
everyone = hvd.allgather(flat.unsqueeze(0), name="params")
if not all(torch.equal(everyone[0], everyone[q]) for q in range(n)):
    failures.append("broadcast_parameters: ranks differ")

# a mismatch raises on every rank (never hangs) and the runtime stays usable
if n > 1:
    try:
        hvd.allreduce(torch.zeros(17 + r), name="mismatch")
        failures.append("mismatched shapes did not raise")
    except hvd.CollectiveMismatchError as exc:
        if "mismatch" not in str(exc):
            failures.append(f"mismatch error does not name the tensor: {exc}")
check("after mismatch", hvd.allreduce(torch.ones(3), op=hvd.Sum, name="after"), torch.full((3,), float(n)))

if failures:
    print(f"rank {r}: {len(failures)} failures:\n  " + "\n  ".join(failures[:20]), flush=True)
    sys.exit(1)
print(f"TORCH_COLLECTIVES_OK {r}", flush=True)
