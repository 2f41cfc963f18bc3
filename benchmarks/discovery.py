"""Host discovery resizing the world inside an ``elastic.run`` cell (issue 34, item 3): the time
from the discovery source's change to the next completed step in the new world, after a grow and
after a shrink.

    .venv/bin/python benchmarks/discovery.py [--repeats 3] [--low 2] [--high 3] [--interval 1]

Through a real notebook kernel (tests/real_kernel.py): ``%ring start --host-discovery SCRIPT``
(a script that prints a file) with ``--discovery-interval`` (Horovod polls every 1 s), a cluster
of ``--low`` ranks. One cell trains a small torch model under ``hvd.elastic.run`` (TorchState,
ElasticSampler, a commit every 2 steps, ~0.02 s steps); rank 0 writes ``localhost:HIGH`` to the
file, and once the world has run 5 steps at that size, ``localhost:LOW``, ``--repeats`` times
each. Every rank logs each step's time and world size; a figure is the time from rank 0's write
to the first step completed by any rank at the new size. It covers the poll (up to one
interval), the kernel's health tick, the newcomer's engine start (a grow), the wait for the next
commit, the re-forming of the world and the sync. The weights are checked equal on every rank at
the end. The machine's load average is printed before and after.
"""

import argparse
import json
import os
import stat
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from reliability.test_discovery_elastic import TAIL  # noqa: E402 - (tests/ is on the path from here)

CELL = """\
%%distributed
import json, os, time
import torch
import jupyter_ring.runtime.torch as hvd

N, BATCH, COMMIT, LOW, HIGH, REPEATS = 61, 3, 2, {low}, {high}, {repeats}
data = torch.Generator().manual_seed(1)
X = torch.randn(N, 5, dtype=torch.float64, generator=data)
Y = X @ torch.linspace(-1, 1, 5, dtype=torch.float64).unsqueeze(1)
model = torch.nn.Linear(5, 1).double()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, sampler=hvd.elastic.ElasticSampler(range(N), seed=3),
                               epoch=0, step=0, changes=[], at_size=0)
log = open(os.path.join({logs!r}, f"rank{{hvd.rank()}}.jsonl"), "a")
plan = [HIGH, LOW] * REPEATS

@hvd.elastic.run
def train(state):
    while len(state.changes) < len(plan) or hvd.size() != plan[-1] or state.at_size < 5:
        mine = list(state.sampler)
        for b in range(0, len(mine), BATCH):
            batch = mine[b:b + BATCH]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(X[batch]), Y[batch]).backward()
            opt.step()
            time.sleep(0.02)
            log.write(json.dumps({{"t": time.time(), "size": hvd.size(), "step": state.step}}) + "\\n")
            log.flush()
            state.sampler.record_batch(b // BATCH, BATCH)
            state.step += 1
            wanted = plan[len(state.changes) - 1] if state.changes else LOW
            state.at_size = state.at_size + 1 if hvd.size() == wanted else 0
            if state.at_size >= 5 and len(state.changes) < len(plan):
                target = plan[len(state.changes)]
                state.changes.append([target, time.time()])
                state.at_size = 0
                if hvd.rank() == 0:
                    open({slots!r}, "w").write(f"localhost:{{target}}\\n")
""" + TAIL + """\
print("SAME", len(set(hvd.allgather_object(weights))) == 1)
print("CHANGES", json.dumps(state.changes))
"""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--low", type=int, default=2)
    p.add_argument("--high", type=int, default=3)
    p.add_argument("--interval", type=float, default=1.0)
    return p.parse_args()


def main() -> None:
    args = parse()
    from real_kernel import ring_kernel

    folder = tempfile.mkdtemp(prefix="jr-discovery-bench-")
    slots = os.path.join(folder, "slots")
    with open(slots, "w") as f:
        f.write(f"localhost:{args.low}\n")
    script = os.path.join(folder, "discover.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\ncat {slots}\n")
    os.chmod(script, os.stat(script).st_mode | stat.S_IXUSR)
    logs = os.path.join(folder, "logs")
    os.mkdir(logs)
    print(f"load average before: {os.getloadavg()}", flush=True)
    start = (f"%ring start -n {args.low} --host-discovery {script} --discovery-interval {args.interval:g} "
             f"--min-ranks {args.low} --max-ranks {args.high}")
    with ring_kernel(start=start) as kernel:
        out = kernel.ok(CELL.format(low=args.low, high=args.high, repeats=args.repeats, logs=logs,
                                    slots=slots), timeout=600)
    print(f"load average after: {os.getloadavg()}", flush=True)
    same = [line for line in out.splitlines() if " SAME " in line]
    assert same and all(line.endswith("SAME True") for line in same), out
    changes = json.loads(next(line for line in out.splitlines() if " CHANGES " in line).split(" CHANGES ", 1)[1])
    steps = []
    for name in os.listdir(logs):
        with open(os.path.join(logs, name)) as f:
            steps += [json.loads(line) for line in f]
    steps.sort(key=lambda rec: rec["t"])
    figures: dict[str, list[float]] = {"grow": [], "shrink": []}
    for target, at in changes:
        first = next(rec["t"] for rec in steps if rec["t"] > at and rec["size"] == target)
        figures["grow" if target == args.high else "shrink"].append(first - at)
    for line in out.splitlines():  # the kernel's own part: from the change seen to the world re-formed
        if "Resized" in line:
            print("  " + line.split(":", 1)[1].split(": rank(s)")[0].strip(), flush=True)
    for name, values in figures.items():
        low, high = (args.low, args.high) if name == "grow" else (args.high, args.low)
        print(f"{name} {low} -> {high}: median {statistics.median(values):.2f} s "
              f"({', '.join(f'{v:.2f}' for v in values)}), discovery interval {args.interval:g} s")


if __name__ == "__main__":
    main()
