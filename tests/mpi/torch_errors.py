"""Misuse of the torch adapter raises a clear error on every rank, and never hangs.

Prints ``TORCH_ERRORS_OK <rank>``.
"""

import sys

import torch

import jupyter_ring.runtime.torch as hvd

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
failures = []


def expect(label, exc_type, words, fn):
    try:
        fn()
    except exc_type as exc:
        missing = [w for w in words if w not in str(exc)]
        if missing:
            failures.append(f"{label}: message lacks {missing}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001 - reported as a failure
        failures.append(f"{label}: raised {type(exc).__name__}, want {exc_type.__name__}: {exc}")
        return
    failures.append(f"{label}: did not raise {exc_type.__name__}")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def loss(m):
    return m(torch.ones(2, 3) * (r + 1)).sum()


# duplicate names
m1, m2 = model(), model()
named = list(m1.named_parameters()) + list(m2.named_parameters())
expect("duplicate names", ValueError, ["duplicate names", "'0.weight'", "prefix"],
       lambda: hvd.DistributedOptimizer(torch.optim.SGD(list(m1.parameters()) + list(m2.parameters()), lr=0.1),
                                        named_parameters=named))
# names that miss some of the optimizer's parameters
expect("unnamed parameters", ValueError, ["not in it", "named_parameters()"],
       lambda: hvd.DistributedOptimizer(torch.optim.SGD(list(m1.parameters()) + list(m2.parameters()), lr=0.1),
                                        named_parameters=m1.named_parameters()))
expect("wrapping twice", TypeError, ["already a DistributedOptimizer"],
       lambda: hvd.DistributedOptimizer(hvd.DistributedOptimizer(torch.optim.SGD(m1.parameters(), lr=0.1))))
expect("Adasum", ValueError, ["Adasum", "op=Average"],
       lambda: hvd.DistributedOptimizer(torch.optim.SGD(m1.parameters(), lr=0.1), op=hvd.Adasum))

# zero_grad() between backward() and step(): raises, then step() still works on every rank
m = model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
loss(m).backward()
expect("zero_grad between backward and step", hvd.RingError,
       ["zero_grad()", "after loss.backward()", "before backward()"], opt.zero_grad)
opt.step()
opt.zero_grad()
flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
everyone = hvd.allgather(flat.unsqueeze(0), name="after_zero_grad")
if not all(torch.equal(everyone[0], everyone[q]) for q in range(n)):
    failures.append("after the zero_grad error, step() left the ranks different")

# more backward passes than backward_passes_per_step
loss(m).backward()
expect("too many backward passes", hvd.RingError, ["backward_passes_per_step=1", "raise"],
       lambda: loss(m).backward())
opt.step()  # the queued allreduces still complete on every rank
opt.zero_grad()
opt.remove_hooks()

# re-wrapping the same parameters (a re-run notebook cell) replaces the old hooks
opt1 = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
opt2 = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
opt2.zero_grad()
loss(m).backward()
opt2.step()
if any(opt1._counts):
    failures.append("the first wrapper's hooks still fire after re-wrapping")
opt2.remove_hooks()

# ranks that disagree on a parameter's shape: a mismatch error naming it, on every rank
torch.manual_seed(0)
odd = torch.nn.Linear(3, 4 + r)
opt = hvd.DistributedOptimizer(torch.optim.SGD(odd.parameters(), lr=0.1), named_parameters=odd.named_parameters())
odd(torch.ones(1, 3)).sum().backward()
expect("shape mismatch", hvd.CollectiveMismatchError, ["bias"] if n > 1 else [],
       opt.step) if n > 1 else opt.step()
opt.remove_hooks()
# the runtime is usable afterwards
out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after")
if not torch.equal(out, torch.full((2,), float(n))):
    failures.append(f"after the mismatch: {out}")

# wrong argument types
expect("not a tensor", TypeError, ["torch.Tensor"], lambda: hvd.allreduce([1.0, 2.0]))
expect("bad backward_passes_per_step", ValueError, ["backward_passes_per_step"],
       lambda: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), backward_passes_per_step=0))

if failures:
    print(f"rank {r}: {len(failures)} failures:\n  " + "\n  ".join(failures[:20]), flush=True)
    sys.exit(1)
print(f"TORCH_ERRORS_OK {r}", flush=True)
