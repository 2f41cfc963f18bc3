"""torch.distributed on a GPU the way ``%ring start`` sets it up: prints TORCH_CUDA_DIST_OK <rank>.

The rank setup of the notebook's cluster without the notebook (the torchrun environment the plan
computes, the default group as ``engines._torch.start(..., init_backend="auto")`` makes it): the
default group must be ``cpu:gloo,cuda:nccl``; DDP on CUDA trains to the same parameters as one process;
the runtime's allreduce of a CUDA tensor shares the user's NCCL group (no second communicator);
Lightning's ``strategy="ddp"`` on the GPU uses this world instead of starting processes. One rank
per GPU (NCCL refuses two ranks on one device).
"""

import os
import socket
import sys

import _checks
import torch
import torch.distributed as dist

import jupyter_ring.runtime as ring
import jupyter_ring.runtime.torch as hvd
from jupyter_ring.cluster._plan import torchrun_environment
from jupyter_ring.engines import _torch as engine_torch
from jupyter_ring.runtime._device import transport as _device

ring.init()
r, n = ring.rank(), ring.size()
failures = []


def expect(label, ok, detail=""):
    if not ok:
        failures.append(f"{label}: {detail}")


# start() minus its guard, which needs the engines' IPython (the GPU image has none; the guard is
# tested on CPU by tests/test_torch_distributed.py): torchrun's environment from the plan, then
# the default group as init_backend="auto" makes it. Rank 0 picks the port (no reserved listener:
# without the guard nothing serves the store on it, so init_process_group's own store binds it).
port = _checks.free_port(ring)
hosts = ring.allgather_object(socket.gethostname(), name="test.hosts")
os.environ.update(torchrun_environment(r, hosts, "127.0.0.1", port, "gpu-test"))
backend = engine_torch._init_default_group(ring, "auto")
expect("default backend", backend == "cpu:gloo,cuda:nccl", backend)
expect("world", dist.is_initialized() and dist.get_world_size() == n and dist.get_rank() == r,
       f"{dist.is_initialized()} {dist.get_world_size() if dist.is_initialized() else None}")
dev = _checks.rank_gpu(hvd)

# DDP on CUDA, every rank its shard of a batch; one process on the full batch as reference
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dev)


ddp = torch.nn.parallel.DistributedDataParallel(model())
reference = model()
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for step in range(4):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * n, 9, generator=g).to(dev), torch.randn(4 * n, 4, generator=g).to(dev)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4]).backward()
    opt.step()
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
# one rank's shard is the whole batch: the comparison says something only where ranks average
if n > 1:
    for (name, p), q in zip(ddp.module.named_parameters(), reference.parameters()):
        expect(f"DDP {name}", torch.allclose(p, q, rtol=1e-4, atol=1e-5),
               f"{p.flatten()[:3].tolist()} vs {q.flatten()[:3].tolist()}")
else:
    print(f"rank {r}: one GPU, one rank: DDP's averaging over shards is not checked here (it needs 2 GPUs)", flush=True)

# the runtime's allreduce of a CUDA tensor goes to the user's default group's NCCL backend
t = torch.full((1009,), float(r + 1), device=dev)
hvd.allreduce_(t, op=hvd.Sum, name="shared")
expect("allreduce on the shared group", torch.equal(t.cpu(), torch.full((1009,), float(n * (n + 1) // 2))),
       t[:3].tolist())
group = _device.transport().group("cuda")
expect("one NCCL communicator", group.pg is dist.group.WORLD and group.kinds.get("cuda") == "nccl",
       f"{group.label} {group.kinds}")

# Lightning: strategy="ddp" on the GPU inside this world (the driver skips, saying so, without it)
import lightning.pytorch as pl


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(9, 1)

    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = torch.utils.data.TensorDataset(torch.randn(64, 9), torch.randn(64, 1))
trainer = pl.Trainer(accelerator="gpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                     num_nodes=int(os.environ["GROUP_WORLD_SIZE"]), strategy="ddp", max_steps=5, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
expect("Lightning world", trainer.world_size == n and trainer.global_rank == r and trainer.global_step == 5,
       f"world {trainer.world_size} rank {trainer.global_rank} steps {trainer.global_step}")
weights = hvd.allgather(next(trainer.lightning_module.parameters()).detach().reshape(1, -1), name="pl.w")
expect("Lightning ranks agree", bool((weights == weights[0]).all()), "")

if failures:
    print(f"rank {r}: " + "; ".join(failures[:10]), flush=True)
    sys.exit(1)
print(f"TORCH_CUDA_DIST_OK {r} {torch.cuda.get_device_name()} lightning={pl.__version__}", flush=True)
