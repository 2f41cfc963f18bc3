"""The dashboard shows what is so (issue 36, item 3), in a real kernel on a real 2-rank cluster:
cells in a row, as a new user runs them in JupyterLab. One kernel for the whole module."""

import re

import pytest

from real_kernel import ring_kernel

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def kernel():
    with ring_kernel(2) as k:
        yield k


def dashboards(messages):
    """The (text/plain, text/html) of every dashboard the cell displayed, as last updated."""
    shown = {}
    for m in messages:
        if m["msg_type"] in ("display_data", "update_display_data"):
            data = m["content"]["data"]
            if "jr-dash" in data.get("text/html", ""):
                key = (m["content"].get("transient") or {}).get("display_id") or len(shown)
                shown[key] = (data.get("text/plain", ""), data["text/html"])
    return list(shown.values())


def run(kernel, code, messages=None):
    messages = [] if messages is None else messages
    kernel.ok("%%distributed\n" + code, messages=messages, timeout=120)
    return dashboards(messages)


def progress_bars(messages):
    """How many progress bars (a dashboard's rows) the cell's live widgets showed at most: the
    rows are an HTML widget holding the static view's table; 0 where the cell made no widget."""
    rows = [0]
    for m in messages:
        if m["msg_type"] in ("comm_open", "comm_msg"):
            value = m["content"].get("data", {}).get("state", {}).get("value")
            if isinstance(value, str) and 'class="jr-ranks"' in value:
                rows.append(value.count('<span class="jr-bar">'))
    return max(rows)


def test_each_cell_shows_its_own_progress_and_torch_distributed_collectives(kernel):
    # a training cell that overruns its total, then a cell that only steps once (item 1)
    first = []
    (text, _), = run(kernel, """
import time, torch
import numpy as np
import jupyter_ring.runtime.torch as hvd
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
ring.progress(0, total=30, desc='short')
for i in range(35):
    opt.zero_grad()
    loss = model(torch.ones(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    ring.log(loss=loss.item())
    time.sleep(0.01)
""", first)
    assert progress_bars(first) == 2, "a bar per rank"
    assert "rank 0: step 35/30" in text and "rank 1: step 35/30" in text, text
    (text, page), = run(kernel, "opt.step()")
    for rank in (0, 1):
        line = next(line for line in text.splitlines() if line.startswith(f"rank {rank}:"))
        assert line.startswith(f"rank {rank}: step 1,"), text    # no total, no label, no loss
        assert "loss" not in line and "allreduce 1x" in line and "since ring.init()" in line, text
    assert "short" not in page and "/ 30" not in page and "jr-series" not in page

    # a cell that does not train: a total set, a collective, a print (item 2)
    messages = []
    assert run(kernel, "ring.progress(0, total=10)\n"
                       "x = ring.allreduce(np.ones(3), name='x')\nprint(ring.rank())", messages) == []
    assert progress_bars(messages) == 0  # not even a widget that is never shown

    # DDP on gloo: its gradient allreduces count; the chart starts at step 1 as above (items 4, 5)
    (text, page), = run(kernel, """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group('gloo')
ddp = DDP(torch.nn.Linear(4, 1))
ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for xb in ring.track(range(20), desc='DDP'):
    ddp_opt.zero_grad()
    l = ddp(torch.ones(8, 4) * (1 + ring.rank())).pow(2).mean()
    l.backward()
    ddp_opt.step()
    ring.log(loss=l.item())
    time.sleep(0.01)
""")
    for rank in (0, 1):
        line = next(line for line in text.splitlines() if line.startswith(f"rank {rank}:"))
        assert line.startswith(f"rank {rank}: step 20/20 (100%)") and "allreduce 20x" in line, text
        assert re.search(r"comm \d+%", line), text
    firsts = set(re.findall(r'class="jr-series" data-rank="\d" data-points="\d+" data-first="([^"]+)"', page))
    assert firsts == {"1"}, firsts


def test_an_interrupted_cell_shows_each_rank_interrupted_at_its_real_step(kernel):
    """Item 3: a rank that stalled or was interrupted showed '0 … done' with a full bar."""
    messages = []
    out, error = kernel.execute("""%%distributed
import time
import numpy as np
for i in ring.track(range(1000), desc='train'):
    if ring.rank() == 1 and i == 7:
        time.sleep(60)
    ring.allreduce(np.ones(4), name='g')
    ring.log(loss=1.0 / (i + 1))
    time.sleep(0.01)
""", timeout=60, interrupt_after=4.0, messages=messages)
    assert error is not None and error["ename"] == "CellInterrupted", (out, error)
    (text, page), = dashboards(messages)
    lines = text.splitlines()
    # rank 1 sleeps inside its 8th step (7 done), rank 0 waits inside that step's allreduce
    assert lines[0].startswith("rank 0: step 7/1000 (1%), interrupted"), text
    assert lines[1].startswith("rank 1: step 7/1000 (1%), interrupted"), text
    assert page.count(">interrupted<") == 2 and "width:100.0%" not in page and ">done<" not in page
