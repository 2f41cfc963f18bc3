"""DistributedOptimizer: n ranks on shards of a batch end where one process on the full batch ends.

Every rank also trains the single-process reference itself (same seed, full batch) and asserts
that its distributed parameters match it, and (via allgather) that all ranks are bit-identical.
Prints ``TORCH_TRAIN_OK <rank>``.
"""

import sys

import torch

import jupyter_ring.runtime.torch as hvd

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
BATCH = 24  # divisible by 1, 2, 3 and 4, and so is each shard by backward_passes_per_step=2: equal
# shards (and equal micro-batches) make the mean of their means the full mean
STEPS = 5
failures = []


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def cnn():
    return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Conv2d(4, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 2 * 2, 3))


def data(kind, step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn((BATCH, 7) if kind == "mlp" else (BATCH, 2, 8, 8), generator=g)
    y = torch.randint(0, 3, (BATCH,), generator=g)
    return x, y


def shard(t):
    per = BATCH // n
    return t[r * per:(r + 1) * per]


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def make(kind, opt_cls, lr, seed=0):
    torch.manual_seed(seed)
    model = mlp() if kind == "mlp" else cnn()
    opt = opt_cls(model.parameters(), lr=lr) if opt_cls is torch.optim.Adam else \
        opt_cls(model.parameters(), lr=lr, momentum=0.9)
    return model, opt


def reference(kind, opt_cls, lr):
    model, opt = make(kind, opt_cls, lr)
    for step in range(STEPS):
        x, y = data(kind, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return flat(model)


def distributed(kind, opt_cls, lr, label, compression=hvd.Compression.none, bpps=1):
    # a different init on every rank: broadcast_parameters must make them equal
    model, opt = make(kind, opt_cls, lr, seed=r if r else 0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=bpps)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(STEPS):
        x, y = data(kind, step)
        x, y = shard(x), shard(y)
        opt.zero_grad()
        micro = x.shape[0] // bpps
        for k in range(bpps):
            xs, ys = x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro]
            (torch.nn.functional.cross_entropy(model(xs), ys) / bpps).backward()
        opt.step()
    got = flat(model)
    everyone = hvd.allgather(got.unsqueeze(0), name=f"{label}.params")
    if not all(torch.equal(everyone[0], everyone[q]) for q in range(n)):
        failures.append(f"{label}: ranks are not bit-identical")
    opt.remove_hooks()
    return got


def close(label, got, want, tol):
    diff = (got - want).abs().max().item()
    if diff > tol:
        failures.append(f"{label}: max abs diff {diff:.3g} from the single-process run (tolerance {tol})")


for kind in ("mlp", "cnn"):
    for opt_cls, lr in ((torch.optim.SGD, 0.1), (torch.optim.Adam, 0.01)):
        want = reference(kind, opt_cls, lr)
        label = f"{kind} {opt_cls.__name__}"
        close(label, distributed(kind, opt_cls, lr, label), want, 1e-5)
want = reference("mlp", torch.optim.SGD, 0.1)
close("mlp fp16 compression", distributed("mlp", torch.optim.SGD, 0.1, "fp16", hvd.Compression.fp16), want, 3e-3)
close("mlp backward_passes_per_step=2",
      distributed("mlp", torch.optim.SGD, 0.1, "bpps", bpps=2), want, 1e-5)


# A parameter unused on some ranks, and hooks firing in a different order on different ranks.
class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 2)
        self.b = torch.nn.Linear(4, 2)
        self.only_rank0 = torch.nn.Linear(4, 2)

    def forward(self, x):
        out = self.a(x) + self.b(x) if r % 2 == 0 else self.b(x) + self.a(x)
        if r == 0:
            out = out + self.only_rank0(x)
        return out


torch.manual_seed(0)
model = Branchy()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                               named_parameters=model.named_parameters())
# each rank's own random batch; d(sum of outputs)/d(weight) is the batch's column sums in every row
batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(50 + q)) for q in range(n)]
x = batches[r]
for step in range(3):
    opt.zero_grad()
    model(x).sum().backward()
    opt.synchronize()
    w = model.only_rank0.weight.grad
    want = batches[0].sum(0).expand_as(w) / n  # rank 0's gradient averaged with the others' zeros
    if not torch.allclose(w, want, atol=1e-6):
        failures.append(f"unused parameter: grad {w[0].tolist()} != {want[0].tolist()}")
    a = model.a.weight.grad
    want = sum(b.sum(0) for b in batches).expand_as(a) / n
    if not torch.allclose(a, want, atol=1e-6):
        failures.append(f"reordered hooks: grad {a[0].tolist()} != {want[0].tolist()}")
    with opt.skip_synchronize():
        opt.step()
opt.remove_hooks()

# broadcast_optimizer_state round trip: root has Adam state (moments, step), the others none.
# Every rank builds the root's state itself (same seeds) as the expected value: nothing of the
# expectation comes through a collective.
def adam_after(steps, lr):
    model, adam = make("mlp", torch.optim.Adam, lr)
    for step in range(steps):
        x, y = data("mlp", step)
        adam.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        adam.step()
    return adam


root = n - 1
adam = adam_after(2, 0.01) if r == root else adam_after(0, 0.5)
hvd.broadcast_optimizer_state(adam, root_rank=root)
sd = adam.state_dict()
want = adam_after(2, 0.01).state_dict()
if sd["param_groups"] != want["param_groups"]:
    failures.append(f"broadcast_optimizer_state: param_groups {sd['param_groups']} != {want['param_groups']}")
if sorted(sd["state"]) != sorted(want["state"]):
    failures.append("broadcast_optimizer_state: state keys differ")
for k, st in want["state"].items():
    for key, value in st.items():
        if not torch.equal(sd["state"][k][key], value):
            failures.append(f"broadcast_optimizer_state: state[{k}][{key!r}] differs")

# An LR scheduler accepts the wrapper (it checks isinstance(optimizer, torch.optim.Optimizer)).
model, sgd = make("mlp", torch.optim.SGD, 0.1)
opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
x, y = data("mlp", 0)
opt.zero_grad()
torch.nn.functional.cross_entropy(model(shard(x)), shard(y)).backward()
opt.step()
sched.step()
if abs(sgd.param_groups[0]["lr"] - 0.05) > 1e-12:
    failures.append(f"LR scheduler: lr {sgd.param_groups[0]['lr']} != 0.05")
opt.remove_hooks()

# A wrapped model pickles (what %ring pull does) and the copy trains locally, allreducing nothing.
import pickle  # noqa: E402
model, sgd = make("mlp", torch.optim.SGD, 0.1)
opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
try:
    copy = pickle.loads(pickle.dumps(model))
except Exception as exc:  # noqa: BLE001 - recorded as a failure on this rank
    failures.append(f"pickling a wrapped model: {type(exc).__name__}: {exc}")
else:
    torch.nn.functional.cross_entropy(copy(x), y).backward()
    if any(q.grad is None for q in copy.parameters()):
        failures.append("the unpickled model did not get gradients")
opt.remove_hooks()

if failures:
    print(f"rank {r}: {len(failures)} failures:\n  " + "\n  ".join(failures[:20]), flush=True)
    sys.exit(1)
print(f"TORCH_TRAIN_OK {r}", flush=True)
