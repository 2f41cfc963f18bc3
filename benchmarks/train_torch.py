"""Training throughput of a ~10M-parameter MLP: jupyter_ring vs DDP (gloo) vs one rank.

    python benchmarks/train_torch.py [--steps 30] [--batch 64] [--repeats 3]

runs each configuration under the venv's ``mpiexec`` (one torch thread per rank) and prints a
markdown table: median samples/s, the fraction of step time spent in communication (jupyter_ring:
time inside allreduces, from ``stats()``) and the scaling efficiency
``throughput(2 ranks) / (2 * throughput(1 rank))``. ``--worker MODE`` is what each rank runs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def model_and_data(batch, seed=0):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    x = torch.randn(batch, 1024)
    y = torch.randint(0, 10, (batch,))
    return model, x, y


def worker(mode, steps, batch, warmup, fusion, bucket_mib):
    import torch

    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    model, x, y = model_and_data(batch, seed=rank)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ring = None
    if mode == "ring":
        import jupyter_ring.runtime.torch as hvd

        hvd.init(fusion_threshold=fusion) if fusion else hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        extra = {"bucket_bytes": int(bucket_mib * (1 << 20))} if bucket_mib else {}
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **extra)
        ring = hvd
    elif mode == "ddp":
        import socket

        import torch.distributed as dist

        port = None
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            comm.Barrier()
            if ring is not None:
                ring.stats()  # (warm-up collectives are excluded below)
                import jupyter_ring.runtime as core

                core.reset_stats()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    times = times[warmup:]
    comm_s = None
    if ring is not None:
        comm_s = ring.stats().get("allreduce", {}).get("time_s", 0.0)
    result = {"mode": mode, "size": size, "params": params, "step_s": statistics.median(times),
              "total_s": sum(times), "comm_s": comm_s}
    results = comm.gather(result, root=0)
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    if mode == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()


def launch(mode, n, args):
    from jupyter_ring.launch import find_mpiexec, mpi_env

    env = mpi_env()
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [find_mpiexec(), "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", mode,
           "--steps", str(args.steps), "--batch", str(args.batch), "--warmup", str(args.warmup)]
    if args.fusion:
        cmd += ["--fusion", str(args.fusion)]
    if args.bucket_mib:
        cmd += ["--bucket-mib", str(args.bucket_mib)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    ranks = json.loads(line[len("RESULT "):])
    step = max(r["step_s"] for r in ranks)  # the slowest rank sets the pace
    comm = None
    if ranks[0]["comm_s"] is not None:
        comm = statistics.mean(r["comm_s"] / r["total_s"] for r in ranks)
    return {"samples_s": n * args.batch / step, "step_ms": step * 1e3, "comm_frac": comm,
            "params": ranks[0]["params"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=["ring", "ddp", "single"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fusion", type=int, default=0, help="fusion_threshold bytes for the ring (0: default)")
    p.add_argument("--bucket-mib", type=float, default=0,
                   help="DistributedOptimizer bucket size in MiB (0: its default)")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.batch, args.warmup, args.fusion, args.bucket_mib)
        return
    configs = [("single", 1), ("ring", 2), ("ddp", 2)]
    runs = {c: [] for c in configs}
    for _ in range(args.repeats):  # interleaved, so a disturbance hits every configuration alike
        for mode, n in configs:
            runs[(mode, n)].append(launch(mode, n, args))
    med = {c: {k: (statistics.median(r[k] for r in rs) if rs[0][k] is not None else None)
               for k in rs[0]} for c, rs in runs.items()}
    single = med[("single", 1)]["samples_s"]
    print(f"MLP with {med[('single', 1)]['params'] / 1e6:.1f}M parameters, batch {args.batch} per rank, "
          f"{args.steps} steps x {args.repeats} runs, medians, torch threads per rank: 1\n")
    print("| configuration | ranks | samples/s | step (ms) | comm. wait | scaling efficiency |")
    print("|---|---|---|---|---|---|")
    names = {"single": "one process", "ring": "jupyter_ring DistributedOptimizer", "ddp": "torch DDP (gloo)"}
    for (mode, n), m in med.items():
        eff = m["samples_s"] / (n * single)
        frac = "-" if m["comm_frac"] is None else f"{100 * m['comm_frac']:.0f}%"
        print(f"| {names[mode]} | {n} | {m['samples_s']:.0f} | {m['step_ms']:.1f} | {frac} | {eff:.2f} |")
    ratio = med[("ring", 2)]["samples_s"] / med[("ddp", 2)]["samples_s"]
    print(f"\njupyter_ring / DDP-gloo throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
