"""DistributedOptimizer's buckets: zero copy, exact averages, overlap with backward, process sets.

Every rank computes every rank's local gradients itself (same seeds, its own shard of the batch)
and asserts that its averaged gradients are exactly their mean, bit-identical across ranks.
Prints ``TORCH_OVERLAP_OK <rank>``.
"""

import sys
import time

import torch

import jupyter_ring.runtime as ring
import jupyter_ring.runtime.torch as hvd
from jupyter_ring.runtime import _api

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []


class Net(torch.nn.Module):
    """Awkward sizes: primes, a parameter larger than a bucket, an empty one, an unused one."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(7, 13)
        self.b = torch.nn.Linear(13, 1031)      # 13 x 1031 floats: larger than the 16 KiB buckets
        self.c = torch.nn.Linear(1031, 3)
        self.empty = torch.nn.Parameter(torch.zeros(0))
        self.unused = torch.nn.Parameter(torch.ones(5))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))  # a second dtype

    def forward(self, x):
        out = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return out.sum(1) * self.scale.sum().float() + self.empty.sum()


def data(q, step):
    g = torch.Generator().manual_seed(100 * step + q)
    return torch.randn(4 + q, 7, generator=g)  # shards of different sizes


def local_grads(model, q, step):
    model.zero_grad()
    model(data(q, step)).pow(2).mean().backward()
    return {name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for name, p in model.named_parameters()}


torch.manual_seed(0)
reference = Net()
model = Net()
model.load_state_dict(reference.state_dict())
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters(),
                               bucket_bytes=16 << 10)
for step in range(3):
    want = [local_grads(reference, q, step) for q in range(n)]
    opt.zero_grad(set_to_none=(step != 1))  # step 1 keeps the views: backward accumulates in place
    model(data(r, step)).pow(2).mean().backward()
    opt.synchronize()
    flat = []
    for name, p in model.named_parameters():
        mean = sum(w[name] for w in want) / n
        if p.grad is None or not torch.allclose(p.grad, mean, rtol=1e-6, atol=1e-7):
            failures.append(f"step {step} {name}: wrong average")
        if n > 1 and p.numel() and not _api.registered(p.grad.detach().numpy()):
            failures.append(f"step {step} {name}: .grad is not a view of registered memory")
        flat.append(p.grad.reshape(-1).double())
    everyone = hvd.allgather(torch.cat(flat).unsqueeze(0), name=f"grads.{step}")
    if not all(torch.equal(everyone[0], everyone[q]) for q in range(n)):
        failures.append(f"step {step}: ranks are not bit-identical")
    with opt.skip_synchronize():
        opt.step()
if len(opt._buckets) < 3:
    failures.append(f"only {len(opt._buckets)} buckets")
opt.remove_hooks()


# Overlap: a backward whose layers "compute" (sleep, the CPU idle as while a GPU works) for 30 ms
# each; with a bucket per layer, every bucket but the last starts while backward still runs.
class Slow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.03)
        return grad


LAYERS, WIDTH = 6, 512
layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))
opt = hvd.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=0.0),
                               named_parameters=layers.named_parameters(), bucket_bytes=WIDTH * WIDTH * 4)
x = torch.randn(8, WIDTH)
for step in range(3):  # step 0 learns the order; 1 and 2 overlap
    opt.zero_grad()
    h = x
    for layer in layers:
        h = Slow.apply(layer(h))
    loss = h.pow(2).mean()
    ring.reset_stats()
    start = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    opt.synchronize()
    records = [rec for rec in _api._proc.rt.trace.records if rec[1].startswith("DistributedOptimizer.bucket")]
    if step and len(records) != LAYERS:
        failures.append(f"overlap step {step}: {len(records)} bucket allreduces, want {LAYERS}")
    started = sum(1 for rec in records if rec[3] < backward_end)
    if step and started < LAYERS - 1:
        failures.append(f"overlap step {step}: {started} of {LAYERS} bucket allreduces started before "
                        f"backward ended ({(backward_end - start) * 1e3:.0f} ms)")
    with opt.skip_synchronize():
        opt.step()
print(f"OVERLAP {r}: {started} of {LAYERS} buckets started during backward", flush=True)
opt.remove_hooks()

# A DistributedOptimizer over a process set averages over its members only.
if n >= 3:
    ps = ring.add_process_set([0, n - 1])  # the numpy API's sets serve the adapters too
    if ps.included():
        torch.manual_seed(1)
        small = torch.nn.Linear(3, 2)
        sopt = hvd.DistributedOptimizer(torch.optim.SGD(small.parameters(), lr=0.0),
                                        named_parameters=small.named_parameters(), process_set=ps)
        small(torch.full((2, 3), float(r + 1))).sum().backward()
        sopt.synchronize()
        want = torch.full((2, 3), 2.0 * (1 + n) / 2)  # rows of (r + 1) summed over 2 rows, averaged
        if not torch.allclose(small.weight.grad, want):
            failures.append(f"process set optimizer: {small.weight.grad[0].tolist()} want {want[0].tolist()}")
        sopt.remove_hooks()

if failures:
    print(f"rank {r}: {len(failures)} failures:\n  " + "\n  ".join(failures[:20]), flush=True)
    sys.exit(1)
print(f"TORCH_OVERLAP_OK {r}", flush=True)
