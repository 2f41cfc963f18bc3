"""Horovod's torch names on jupyter_ring, in one launch: every rank asserts its own results.

Capability functions, process sets of odd shapes, integer and float16 scale factors as Horovod
computes them, grouped allgather/reducescatter (+async), autograd through every collective,
sparse gradients (nn.Embedding(sparse=True)) with and without sparse_as_dense, SyncBatchNorm
against BatchNorm on the whole batch, Adasum against its formula, broadcast_optimizer_state for
every optimizer in torch.optim, the timeline, join. Prints ``HVD_TORCH_OK <rank>``.
"""

import inspect
import json
import os
import sys
import tempfile
import warnings

import _checks
import numpy as np
import torch

import jupyter_ring.runtime.torch as hvd

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []
LENGTHS = sorted({0, 1, n + 1, 13})


def check(label, got, want, tol=0.0):
    if not isinstance(got, torch.Tensor):
        failures.append(f"{label}: got {type(got).__name__}, want a tensor")
        return
    if got.dtype != want.dtype or got.shape != want.shape:
        failures.append(f"{label}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
        return
    if not torch.allclose(got.double(), want.double(), rtol=tol, atol=tol):
        failures.append(f"{label}: values differ (max abs diff {(got.double() - want.double()).abs().max():.3g})")


def expect_raises(label, exc_types, fn):
    _checks.expect_raises(failures, label, exc_types, fn)


def every_rank(seed, shape, dtype=torch.float32, low=-100, high=100):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, shape, generator=g).to(dtype) if not dtype.is_floating_point
            else (torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)
            for _ in range(n)]


# ---- capability functions: what this runtime is
caps = {name: getattr(hvd, name)() for name in ("mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built",
                                                "ddl_built", "ccl_built", "cuda_built", "rocm_built")}
# NCCL: CUDA tensors go to the device transport where torch.distributed has NCCL (False on the
# CPU wheel CI runs; JUPYTER_RING_DEVICE_TRANSPORT=off stages them)
nccl = (torch.distributed.is_available() and torch.distributed.is_nccl_available()
        and os.environ.get("JUPYTER_RING_DEVICE_TRANSPORT", "auto").strip().lower() != "off")
if caps != {"mpi_built": True, "mpi_enabled": True, "gloo_built": False, "gloo_enabled": False, "nccl_built": nccl,
            "ddl_built": False, "ccl_built": False, "cuda_built": nccl and torch.version.cuda is not None,
            "rocm_built": False}:
    failures.append(f"capabilities: {caps}")
if hvd.is_homogeneous() is not True or not isinstance(hvd.mpi_threads_supported(), bool):
    failures.append("is_homogeneous/mpi_threads_supported")
if not issubclass(hvd.HorovodInternalError, RuntimeError):
    failures.append("HorovodInternalError is not a RuntimeError")

# ---- integer and float16 scale factors, as Horovod computes them (float64/float32 math, truncation)
for dtype, wide in ((torch.int32, torch.float64), (torch.int64, torch.float64), (torch.float16, torch.float32)):
    for length in LENGTHS:
        xs = every_rank(length + 7, (length,), dtype)
        pre, post = 0.37, 1.9
        got = hvd.allreduce(xs[r], op=hvd.Sum, prescale_factor=pre, name=f"pre.{dtype}.{length}")
        want = sum((x.to(wide) * pre).to(dtype).to(wide) for x in xs).to(dtype) if length else xs[r]
        tol = 2e-3 * 100 * n if dtype == torch.float16 else 0.0  # fp16 sums round at every rank's turn
        check(f"prescale {dtype} length {length}", got, want, tol)
        got = hvd.allreduce(xs[r], op=hvd.Sum, postscale_factor=post, name=f"post.{dtype}.{length}")
        want = (sum(x.to(wide) for x in xs) * post).to(dtype) if length else xs[r]
        check(f"postscale {dtype} length {length}", got, want, tol)
        got = hvd.allreduce(xs[r], op=hvd.Average, name=f"avg.{dtype}.{length}")
        want = (sum(x.to(wide) for x in xs) * (1.0 / n)).to(dtype) if length else xs[r]
        check(f"average {dtype} length {length} (truncated toward zero)", got, want, tol)
        t = xs[r].clone()
        hvd.allreduce_(t, op=hvd.Sum, postscale_factor=post, name=f"inplace.{dtype}.{length}")
        check(f"in-place postscale {dtype} length {length}", t,
              (sum(x.to(wide) for x in xs) * post).to(dtype) if length else xs[r], tol)

# ---- grouped allgather / reducescatter (+async), awkward dim 0 on every rank
groups = [every_rank(30 + i, (4, 3)) for i in range(2)]  # tensor i has (rank + i) % 4 rows on each rank
mine = [groups[i][r][:(r + i) % 4] for i in range(2)]
wanted = [torch.cat([groups[i][q][:(q + i) % 4] for q in range(n)]) for i in range(2)]
for got, want, i in zip(hvd.grouped_allgather(mine, name="ga"), wanted, range(2)):
    check(f"grouped_allgather {i}", got, want)
for got, want, i in zip(hvd.synchronize(hvd.grouped_allgather_async(mine, name="ga.async")), wanted, range(2)):
    check(f"grouped_allgather_async {i}", got, want)
for rows in sorted({0, 1, n - 1, n + 2, 7}):
    xs, ys = every_rank(100 + rows, (rows, 2)), every_rank(200 + rows, (rows,), torch.float64)
    lo = rows // n * r + min(r, rows % n)
    hi = lo + rows // n + (1 if r < rows % n else 0)
    outs = hvd.grouped_reducescatter([xs[r], ys[r]], op=hvd.Sum, name=f"grs.{rows}")
    check(f"grouped_reducescatter rows {rows} [0]", outs[0], sum(xs)[lo:hi], 1e-4)
    check(f"grouped_reducescatter rows {rows} [1]", outs[1], sum(ys)[lo:hi], 1e-9)
    out = hvd.synchronize(hvd.reducescatter_async(xs[r], name=f"rs.{rows}", op=hvd.Average, postscale_factor=2.0))
    check(f"reducescatter_async Average postscale rows {rows}", out, (sum(xs) / n * 2.0)[lo:hi], 1e-4)
if n > 1:  # every length divides among one rank: nothing to refuse there
    expect_raises("alltoall without splits on dim 0 not divisible", (ValueError,),
                  lambda: hvd.alltoall(torch.zeros(n + 1)))
out = hvd.alltoall(torch.arange(n, dtype=torch.float32) + 10 * r, name="a2a")
check("alltoall without splits returns the output alone", out, torch.tensor([10.0 * q + r for q in range(n)]))
out, received = hvd.synchronize(hvd.alltoall_async(torch.arange(n, dtype=torch.float32) + 10 * r, splits=[1] * n,
                                                   name="a2a.async"))
check("alltoall_async", out, torch.tensor([10.0 * q + r for q in range(n)]))

# ---- autograd through every collective: d/dx of sum(op(x) * w) on every rank
w = [torch.full((4, 3), float(q + 1)) for q in range(n)]
W = sum(w)
x = torch.ones(4, 3, requires_grad=True)
(hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum, name="g.ar")[1] * w[r]).sum().backward()
check("grad grouped_allreduce", x.grad, 2 * W)
x = torch.ones(r + 1, 3, requires_grad=True)
rows = [q + 1 for q in range(n)]
weights = torch.arange(sum(rows) * 3, dtype=torch.float32).reshape(-1, 3)
(hvd.grouped_allgather([x], name="g.ag")[0] * weights).sum().backward()
check("grad grouped_allgather", x.grad, weights[sum(rows[:r]):sum(rows[:r]) + r + 1])
x = torch.ones(2 * n, 3, requires_grad=True)
(hvd.reducescatter(x, op=hvd.Sum, name="g.rs") * w[r][:1]).sum().backward()
check("grad reducescatter Sum", x.grad, torch.cat([w[q][:1].expand(2, 3) for q in range(n)]) * n)
x = torch.ones(2 * n, 3, requires_grad=True)
(hvd.grouped_reducescatter([x], op=hvd.Average, name="g.grs")[0] * w[r][:1]).sum().backward()
check("grad grouped_reducescatter Average", x.grad, torch.cat([w[q][:1].expand(2, 3) for q in range(n)]))
x = torch.ones(n, 3, requires_grad=True)
out, _ = hvd.alltoall(x, splits=[1] * n, name="g.a2a")
(out * w[r][:n]).sum().backward()
check("grad alltoall", x.grad, torch.stack([w[q][0] for q in range(n)]))
x = torch.ones(3, requires_grad=True)
(hvd.broadcast(x, root_rank=n - 1, name="g.b") * (r + 1)).sum().backward()
check("grad broadcast", x.grad, torch.full((3,), (sum(range(1, n + 1)) / n) if r == n - 1 else 0.0), 1e-6)

# ---- sparse_allreduce_async and nn.Embedding(sparse=True) gradients
dense = every_rank(7, (11, 4))
for t in dense:
    t[t.abs() < 50] = 0
got = hvd.sparse_allreduce_async(dense[r].to_sparse(), name="sparse", op=hvd.Average)()
check("sparse_allreduce_async", got.to_dense(), sum(dense) / n, 1e-5)
for sparse_as_dense in (False, True):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=sparse_as_dense)
    ids = [torch.tensor([q % 10, (3 * q + 1) % 10, 9]) for q in range(n)]
    opt.zero_grad()
    emb(ids[r]).sum().backward()
    opt.step()
    if not emb.weight.grad.is_sparse:
        failures.append(f"sparse_as_dense={sparse_as_dense}: the gradient is no longer sparse")
    counts = torch.zeros(10)
    for q in range(n):
        counts.index_add_(0, ids[q], torch.ones(3))
    check(f"sparse gradient sparse_as_dense={sparse_as_dense}", emb.weight.grad.to_dense(),
          (counts / n)[:, None].expand(10, 3).contiguous(), 1e-6)
    names = set(opt._parameter_names.values())
    if names != {"weight"}:
        failures.append(f"_parameter_names: {names}")
    opt.remove_hooks()

# ---- SyncBatchNorm: rank r's rows of one batch == BatchNorm1d on the whole batch
torch.manual_seed(3)
batch = torch.randn(2 * n, 4, 5)
sync_bn, bn = hvd.SyncBatchNorm(4), torch.nn.BatchNorm1d(4)
mine = batch[2 * r:2 * r + 2].clone().requires_grad_()
whole = batch.clone().requires_grad_()
out_sync, out_bn = sync_bn(mine), bn(whole)
check("SyncBatchNorm forward", out_sync, out_bn[2 * r:2 * r + 2].detach(), 1e-5)
check("SyncBatchNorm running_mean", sync_bn.running_mean, bn.running_mean, 1e-6)
check("SyncBatchNorm running_var", sync_bn.running_var, bn.running_var, 1e-6)
coef = torch.randn(2 * n, 4, 5, generator=torch.Generator().manual_seed(5))
(out_sync * coef[2 * r:2 * r + 2]).sum().backward()
(out_bn * coef).sum().backward()
check("SyncBatchNorm input grad", mine.grad, whole.grad[2 * r:2 * r + 2], 1e-5)
check("SyncBatchNorm weight grad (summed over ranks)", hvd.allreduce(sync_bn.weight.grad, op=hvd.Sum, name="bn.w"),
      bn.weight.grad, 1e-5)

# ---- Adasum: Horovod's pairing on power-of-2 rank counts; NotImplementedError otherwise
vecs = every_rank(9, (6,), torch.float64)
if n & (n - 1) == 0:
    def adasum(a, b):
        return (1 - a @ b / (2 * (a @ a))) * a + (1 - a @ b / (2 * (b @ b))) * b
    level = list(vecs)
    while len(level) > 1:
        level = [adasum(a, b) for a, b in zip(level[0::2], level[1::2])]
    check("Adasum", hvd.allreduce(vecs[r], op=hvd.Adasum, name="adasum"), level[0], 1e-12)
else:
    expect_raises("Adasum on a non-power-of-2 world", (NotImplementedError,),
                  lambda: hvd.allreduce(vecs[r], op=hvd.Adasum, name="adasum"))

# ---- broadcast_optimizer_state: every optimizer in torch.optim (2-D parameters: Muon takes no others)
for name, cls in sorted(inspect.getmembers(torch.optim, inspect.isclass)):
    if not issubclass(cls, torch.optim.Optimizer) or cls in (torch.optim.Optimizer, torch.optim.LBFGS):
        continue
    torch.manual_seed(r)
    model = torch.nn.Linear(3, 4, bias=False)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    try:
        opt = cls(model.parameters(), lr=0.01 * (r + 1))
    except TypeError:
        opt = cls(model.parameters())
    if r == 0 and cls is not torch.optim.SparseAdam:
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    states = hvd.allgather_object(repr(opt.state_dict()), name=f"state.{name}")
    if len(set(states)) != 1:
        failures.append(f"broadcast_optimizer_state {name}: ranks differ")
expect_raises("broadcast_optimizer_state(LBFGS)", (ValueError,),
              lambda: hvd.broadcast_optimizer_state(torch.optim.LBFGS(torch.nn.Linear(2, 2).parameters()), 0))

# ---- process sets of odd shapes: {0, 2} of 3+ ({0} of 2), {1} of 2+, and errors at synchronize
if n >= 2:
    odd = [0, 2] if n >= 3 else [0]
    ps, single = hvd.add_process_set(odd), hvd.add_process_set([1])
    members = [q for q in range(n) if q in odd]
    if ps.size() != len(members) or ps.included() != (r in members):
        failures.append(f"process set {odd}: size {ps.size()} included {ps.included()}")
    if r in members:
        xs = every_rank(50, (13,))
        check("allreduce on a process set", hvd.allreduce(xs[r], op=hvd.Sum, process_set=ps, name="ps"),
              sum(xs[q] for q in members), 1e-4)
        check("allgather on a process set", hvd.allgather(torch.full((q_rows := r + 1,), float(r)), process_set=ps),
              torch.cat([torch.full((q + 1,), float(q)) for q in members]))
        check("broadcast on a process set (global root)",
              hvd.broadcast(torch.tensor([float(r)]), root_rank=members[-1], process_set=ps), torch.tensor([float(members[-1])]))
        if hvd.allgather_object(r, process_set=ps) != members:
            failures.append("allgather_object on a process set")
        hvd.barrier(process_set=ps)
        if len(members) > 1:
            handle = hvd.allreduce_async(torch.zeros(3 + r), name="ps.mismatch", process_set=ps)
            expect_raises("mismatch on a process set raises at synchronize", (hvd.CollectiveMismatchError,),
                          lambda: hvd.synchronize(handle))
    if r == 1:
        check("a one-rank process set", hvd.allreduce(torch.ones(2), process_set=single, name="one"), torch.ones(2))
    else:
        expect_raises("a collective on a set this rank is not in", (ValueError,),
                      lambda: hvd.allreduce(torch.ones(2), process_set=single))
    expect_raises("a duplicate process set", (ValueError,), lambda: hvd.add_process_set(odd))
    if not (hvd.remove_process_set(ps) and hvd.remove_process_set(single)) or hvd.remove_process_set(
            hvd.global_process_set):
        failures.append("remove_process_set")

# ---- start_timeline / stop_timeline: Horovod's format
path = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(), "timeline.json") if r == 0 else None)
hvd.start_timeline(path, mark_cycles=True)
hvd.allreduce(torch.ones(3), name="test_allreduce")
hvd.stop_timeline()
if r == 0:
    text = open(path).read()
    json.loads(text)
    for token in ("allreduce.test_allreduce", "start_time_since_epoch_in_micros", "NEGOTIATE_ALLREDUCE",
                  "ALLREDUCE", "CYCLE_START"):
        if token not in text:
            failures.append(f"timeline lacks {token}")

# ---- step() after synchronize() outside skip_synchronize(): one warning (Horovod's), then the step
linear = torch.nn.Linear(1, 1)
hvd.broadcast_parameters(linear.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(linear.parameters(), lr=0.1), named_parameters=linear.named_parameters())
before = linear.weight.detach().clone()
torch.nn.functional.mse_loss(linear(torch.full((1, 1), float(r))), torch.ones(1, 1)).backward()
opt.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.step()
if len(caught) != 1 or "optimizer.step() called without optimizer.skip_synchronize()" not in str(caught[0].message):
    failures.append(f"step after synchronize warned {[str(w.message) for w in caught]}")
if torch.equal(linear.weight.detach(), before) and n > 1:
    failures.append("step after synchronize did not step")

# ---- join: every rank joins at the same point, after the same collectives: the last to join is
# the highest rank among equals, on every rank
last = hvd.join()
if last != n - 1:
    failures.append(f"join returned {last}, want {n - 1}")

# ---- join after a refused collective (Horovod's test_horovod_join_{allgather,broadcast}): each rank
# in turn joins first; the others' allgather/broadcast raises on each of them, then they join too.
# The refused collective still counts: join returns a later joiner (the highest rank of those),
# never the first, the same on every rank.
if n > 1:
    for first in range(n):
        for kind in ("allgather", "broadcast"):
            if r != first:
                tensor = every_rank(first, (17, 3))[r]
                call = ((lambda: hvd.allgather(tensor)) if kind == "allgather"
                        else (lambda: hvd.broadcast(tensor, r, name="join.broadcast")))
                expect_raises(f"{kind} while rank {first} has joined", (hvd.CollectiveMismatchError,), call)
            last = hvd.join()
            want = max(q for q in range(n) if q != first)
            if hvd.allgather_object(last) != [want] * n:
                failures.append(f"join after a refused {kind} (rank {first} joined first): {last}, want {want}")
    check("allreduce after the joins", hvd.allreduce(torch.full((5,), float(r)), op=hvd.Sum, name="after.joins"),
          torch.full((5,), float(n * (n - 1) // 2)))

# ---- join before DistributedOptimizer's first step (uneven data: a rank without a single batch).
# The first step learns the bucket order by an allreduce the joined rank answers with zeros; with
# rank 0 joined there is no order to learn and the constructor's stays. Every active rank steps
# with the sum of the active ranks' gradients over n (Horovod's average with the joined zeros).
for joiner in sorted({0, n - 1}) if n > 1 else []:
    def joined_mlp():
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

    model, reference = joined_mlp(), joined_mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), bucket_bytes=64)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    active = [q for q in range(n) if q != joiner]
    if r == joiner:
        last = hvd.join()
    else:
        for step in range(3):
            batches = [torch.randn(2 + q, 7, generator=torch.Generator().manual_seed(97 * step + q)) for q in range(n)]
            opt.zero_grad()
            model(batches[r]).square().mean().backward()
            opt.step()
            ref_opt.zero_grad()
            (sum(reference(batches[q]).square().mean() for q in active) / n).backward()
            ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):
                failures.append(f"join before the first step (rank {joiner} joined): {name} "
                                f"{p.flatten()[:3].tolist()} vs {q.flatten()[:3].tolist()}")
        last = hvd.join()
    if hvd.allgather_object(last) != [last] * n or last not in active:
        failures.append(f"join before the first step (rank {joiner} joined): join returned {last}")

if failures:
    print(f"rank {r}: {len(failures)} failures:\n  " + "\n  ".join(failures[:30]), flush=True)
    sys.exit(1)
print(f"HVD_TORCH_OK {r}", flush=True)
