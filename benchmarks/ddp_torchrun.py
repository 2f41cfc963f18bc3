"""DDP (gloo) through the cluster against the same code under torchrun: samples/s, interleaved.

    python benchmarks/ddp_torchrun.py [--rounds 5] [--steps 20] [--batch 64] [-n 2]

One cluster of ``-n`` ranks (``RingCluster``, as ``%ring start``; ``init_process_group()`` with
no arguments in a cell, as a user would) and ``torch.distributed.run --nproc-per-node n`` running
this file with ``--worker``, alternated round by round (torchrun first in even rounds), after one untimed round of each. Each round
trains the same ~10M-parameter MLP with DDP for ``--steps`` timed steps after 3 warm-up steps,
one torch thread per rank, and reports global samples/s (timed between two barriers). Prints a
markdown table: the median of each, their ratio, the median of the rounds' own ratios (the two
runs of a round ran back to back), every round's figure and the load average.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# The same training code for both: run by the torchrun workers and in the cluster's cell.
TRAIN = """
import time
import torch
import torch.distributed as dist

def ddp_samples_per_second(steps, batch, warmup=3):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, 1024, generator=g), torch.randint(0, 10, (batch,), generator=g)
    for step in range(warmup + steps):
        if step == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    dist.barrier()
    return steps * batch * dist.get_world_size() / (time.perf_counter() - t0)
"""


def worker(steps, batch):
    import torch.distributed as dist

    namespace = {}
    exec(TRAIN, namespace)  # our own constant above, not user text
    dist.init_process_group("gloo")
    sps = namespace["ddp_samples_per_second"](steps, batch)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"sps": sps}), flush=True)
    dist.destroy_process_group()


def torchrun_round(n, steps, batch):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           os.path.abspath(__file__), "--worker", "--steps", str(steps), "--batch", str(batch)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])["sps"]


def cluster_round(cluster, steps, batch):
    ar = cluster.view.execute(f"_bench_sps = ddp_samples_per_second({steps}, {batch})", block=False)
    ar.get(timeout=900)
    return cluster.client[cluster.engine_ids[0]].pull("_bench_sps", block=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps a round (default 20)")
    parser.add_argument("--batch", type=int, default=64, help="batch per rank (default 64)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.steps, args.batch)
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="jupyter_ring_bench_"))
    from jupyter_ring.cluster import RingCluster

    cluster = RingCluster(n=args.n)
    cluster.start()
    figures = {"torchrun": [], "cluster": []}
    loads = []
    try:
        cluster.view.execute(TRAIN + "\ndist.init_process_group()\n", block=True).get()
        # one untimed round of each first: the cluster's ranks live on, so their first DDP
        # (allocator, gloo buffers) would otherwise count against them alone
        cluster_round(cluster, args.steps, args.batch)
        torchrun_round(args.n, args.steps, args.batch)
        for rnd in range(args.rounds):
            order = ("torchrun", "cluster") if rnd % 2 == 0 else ("cluster", "torchrun")
            for mode in order:
                loads.append(os.getloadavg()[0])
                sps = (torchrun_round(args.n, args.steps, args.batch) if mode == "torchrun"
                       else cluster_round(cluster, args.steps, args.batch))
                figures[mode].append(sps)
                print(f"round {rnd} {mode}: {sps:.1f} samples/s (load {loads[-1]:.2f})", file=sys.stderr)
    finally:
        cluster.stop()
    t, c = statistics.median(figures["torchrun"]), statistics.median(figures["cluster"])
    # the two runs of one round ran back to back, under nearly the same load: their ratio is
    # less exposed to the other processes of a shared machine than the ratio of the medians
    pairs = [cl / tr for tr, cl in zip(figures["torchrun"], figures["cluster"])]
    print(f"| {args.n} ranks, DDP (gloo), {args.steps} steps x {args.batch} per rank | samples/s (median of "
          f"{args.rounds}) | every round |")
    print("|---|---|---|")
    print(f"| torchrun --nproc-per-node {args.n} | {t:.1f} | {', '.join(f'{v:.1f}' for v in figures['torchrun'])} |")
    print(f"| %ring start, init_process_group() in a cell | {c:.1f} | "
          f"{', '.join(f'{v:.1f}' for v in figures['cluster'])} |")
    print(f"| cluster / torchrun, ratio of the medians | {c / t:.3f} | load average {min(loads):.2f}-{max(loads):.2f} |")
    print(f"| cluster / torchrun, median of the rounds' ratios | {statistics.median(pairs):.3f} | "
          f"{', '.join(f'{v:.2f}' for v in pairs)} |")


if __name__ == "__main__":
    main()
