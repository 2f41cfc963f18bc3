"""Training throughput of a ~10M-parameter MLP: jupyter_ring vs DDP (gloo) vs one rank.

    python benchmarks/train_torch.py [--steps 30] [--batch 64] [--repeats 3] [--baseline-src DIR]

runs each configuration under the venv's ``mpiexec`` (one torch thread per rank) and prints a
markdown table: median samples/s, the fraction of step time spent in communication (jupyter_ring:
time inside allreduces, from ``stats()``) and the scaling efficiency
``throughput(2 ranks) / (2 * throughput(1 rank))``. ``--worker MODE`` is what each rank runs.
``--baseline-src DIR`` (a tree holding another revision's ``jupyter_ring``, e.g. ``git archive
main jupyter_ring | tar -x -C DIR``) runs that tree's DistributedOptimizer too, interleaved, as a
row of its own. "engine CPU" is the CPU a step of the ring's other threads (the engine) takes
beside the calling thread, the rank's median.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the tree whose jupyter_ring is measured: this one, or --baseline-src's (set for the workers)
sys.path.insert(0, os.environ.get("JUPYTER_RING_BENCH_SRC") or os.path.dirname(HERE))


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
    times, others = [], []
    for step in range(warmup + steps):
        if step == warmup:
            comm.Barrier()
            if ring is not None:
                ring.stats()  # (warm-up collectives are excluded below)
                import jupyter_ring.runtime as core

                core.reset_stats()
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        others.append((time.process_time() - p0) - (time.thread_time() - c0))
    times = times[warmup:]
    comm_s = None
    if ring is not None:
        comm_s = ring.stats().get("allreduce", {}).get("time_s", 0.0)
    result = {"mode": mode, "size": size, "params": params, "step_s": statistics.median(times),
              "total_s": sum(times), "comm_s": comm_s, "other_cpu_s": statistics.median(others[warmup:])}
    results = comm.gather(result, root=0)
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    if mode == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()


def launch(mode, n, args, src=None):
    from jupyter_ring.launch import find_mpiexec, mpi_env

    env = mpi_env()
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["JUPYTER_RING_BENCH_SRC"] = os.path.abspath(src) if src is not None else ""
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
            "other_cpu_ms": max(r["other_cpu_s"] for r in ranks) * 1e3, "params": ranks[0]["params"]}


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
    p.add_argument("--baseline-src", default=None, help="another source tree whose ring to measure alongside")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.batch, args.warmup, args.fusion, args.bucket_mib)
        return
    configs = [("single", 1, None), ("ring", 2, None), ("ddp", 2, None)]
    if args.baseline_src:
        configs.append(("ring", 2, args.baseline_src))
    runs = {c: [] for c in configs}
    loads = []
    for _ in range(args.repeats):  # interleaved, so a disturbance hits every configuration alike
        for mode, n, src in configs:
            loads.append(os.getloadavg()[0])
            runs[(mode, n, src)].append(launch(mode, n, args, src))
    med = {c: {k: (statistics.median(r[k] for r in rs) if rs[0][k] is not None else None)
               for k in rs[0]} for c, rs in runs.items()}
    single = med[("single", 1, None)]["samples_s"]
    print(f"MLP with {med[('single', 1, None)]['params'] / 1e6:.1f}M parameters, batch {args.batch} per rank, "
          f"{args.steps} steps x {args.repeats} runs interleaved, medians, torch threads per rank: 1, "
          f"load {min(loads):.1f}-{max(loads):.1f}\n")
    print("| configuration | ranks | samples/s | step (ms) | comm. wait | engine CPU (ms a step) | scaling efficiency |")
    print("|---|---|---|---|---|---|---|")
    names = {"single": "one process", "ring": "jupyter_ring DistributedOptimizer", "ddp": "torch DDP (gloo)"}
    for (mode, n, src), m in med.items():
        eff = m["samples_s"] / (n * single)
        frac = "-" if m["comm_frac"] is None else f"{100 * m['comm_frac']:.0f}%"
        name = names[mode] + (f" (baseline {src})" if src else "")
        print(f"| {name} | {n} | {m['samples_s']:.0f} | {m['step_ms']:.1f} | {frac} | {max(0.0, m['other_cpu_ms']):.1f} | "
              f"{eff:.2f} |")
    ddp = med[("ring", 2, None)]["samples_s"] / med[("ddp", 2, None)]["samples_s"]
    print(f"\njupyter_ring / DDP-gloo throughput: {ddp:.2f}x")
    if args.baseline_src:
        base = med[("ring", 2, args.baseline_src)]["samples_s"]
        print(f"this tree / baseline, 2 ranks: {med[('ring', 2, None)]['samples_s'] / base:.2f}x "
              f"(baseline / DDP-gloo {base / med[('ddp', 2, None)]['samples_s']:.2f}x)")


if __name__ == "__main__":
    main()
