"""torch.distributed's collectives in the ring's trace (issue 36, item 3.4): DDP's gradient
allreduces and ``dist.*`` calls count in the dashboard's communication figures.

One process, a gloo world of 1 (the 2-rank case runs in tests/test_dashboard_kernel.py), in a
subprocess: the wrapping patches torch.distributed, which the test process must not keep.
"""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)

SCRIPT = r"""
import json, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from jupyter_ring.runtime._device import torch_comm as _torch_comm
from jupyter_ring.runtime._observe.report import reporter
from jupyter_ring.runtime._observe.trace import Trace

def train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        opt.zero_grad()
        model(torch.full((8, 4), 1.0 + i)).pow(2).mean().backward()
        opt.step()
    return [p.detach().tolist() for p in model.parameters()]

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
plain = train(DDP(torch.nn.Linear(4, 1)))           # torch's own reducer, before the hooks

reporter.trace = Trace(0, 1, 100)
wrapped = _torch_comm.install_counting()
_torch_comm.count_ddp(DDP)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
counted = train(model)
after_ddp = reporter.trace.stats()
dist.all_reduce(torch.ones(10))
work = dist.broadcast(torch.ones(3, dtype=torch.float64), src=0, async_op=True)
work.wait()
dist.barrier()
try:
    model.register_comm_hook(None, lambda state, bucket: None)
    refused = ""
except RuntimeError as exc:
    refused = str(exc)
user = DDP(torch.nn.Linear(4, 1))
user.register_comm_hook(None, lambda state, bucket: torch.futures.Future())  # theirs: kept
print(json.dumps({"wrapped": wrapped, "same": plain == counted, "after_ddp": after_ddp,
                  "stats": reporter.trace.stats(), "refused": refused,
                  "hooks": [model.__dict__.get("_jupyter_ring_hook"), user.__dict__.get("_jupyter_ring_hook")],
                  "again": _torch_comm.install_counting() + [_torch_comm.count_ddp(DDP)]}))
dist.destroy_process_group()
"""


def test_ddp_and_dist_collectives_are_counted_with_the_same_results():
    """DDP cells showed 0 allreduces and 0 % in collectives: its reducer runs them in C++."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"all_reduce", "broadcast", "barrier", "all_gather_into_tensor"} <= set(out["wrapped"])
    assert out["same"], "the counting hook must train exactly as torch's own reducer"
    # one bucket per step (5 float32 parameters), then a 10-float allreduce
    assert out["after_ddp"]["allreduce"]["count"] == 3 and out["after_ddp"]["allreduce"]["bytes"] == 60
    stats = out["stats"]
    assert stats["allreduce"]["count"] == 4 and stats["allreduce"]["bytes"] == 100
    assert stats["broadcast"]["count"] == 1 and stats["broadcast"]["bytes"] == 24  # async: at completion
    assert stats["barrier"]["count"] == 1
    assert all(stats[k]["time_s"] > 0 for k in ("allreduce", "broadcast"))
    assert "Register your comm hook before the model's first forward" in out["refused"]
    assert out["hooks"] == ["counting", "user"]
    assert out["again"] == [False]  # idempotent
