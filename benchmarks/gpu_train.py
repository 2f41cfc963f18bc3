"""A training step on one GPU: plain torch, DistributedOptimizer's device buckets, staged buckets, DDP.

    python benchmarks/gpu_train.py [--steps 20] [--repeats 5] [--batch 256] [--device cuda|cpu]

One rank under the environment's mpiexec, one process holding four copies of the same ~10.5M
parameter MLP (train_torch.py's), each trained in turn, interleaved per repeat (median of the
repeats' mean step time, `torch.cuda.synchronize()` around each block of steps):

* **plain**: the torch optimizer alone (no communication): the floor;
* **device buckets**: ``DistributedOptimizer`` whose buckets live on the GPU and go to NCCL's
  one-rank path through the device transport (what a CUDA model gets by default);
* **staged buckets**: the same wrapper made with ``JUPYTER_RING_DEVICE_TRANSPORT=off``, whose
  buckets are host arrays the ring reduces (what every CUDA model got before the device buckets;
  what two ranks sharing one GPU still get);
* **DDP**: ``DistributedDataParallel`` over torch's own NCCL (gloo on CPU) at world size 1.

What one rank measures is each wrapper's own cost per step on top of the step: agreement, bucket
copies, launches and waits. NCCL between ranks needs two GPUs. ``--device cpu`` runs the same
over CPU tensors (the transport over gloo) to check the script on a machine without a GPU.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=5, help="blocks per configuration, interleaved")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the device buckets' steps (cProfile, top functions by own time)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def mlp(torch, dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
        torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).to(dev)


def worker(args):
    import torch
    import torch.distributed as dist

    import jupyter_ring.runtime.torch as hvd
    from jupyter_ring.runtime._device.transport import TRANSPORT_ENV

    cuda = args.device == "cuda"
    if not cuda:
        os.environ[TRANSPORT_ENV] = "gloo"  # CPU tensors take the device transport too
        torch.set_num_threads(1)
    hvd.init()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    configs = {}
    model = mlp(torch, dev)
    configs["plain"] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    model = mlp(torch, dev)
    configs["device buckets"] = (model, hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), named_parameters=model.named_parameters()))
    model = mlp(torch, dev)
    saved = os.environ.get(TRANSPORT_ENV)
    os.environ[TRANSPORT_ENV] = "off"  # buckets are made now: host arrays for the ring
    configs["staged buckets"] = (model, hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), named_parameters=model.named_parameters()))
    if saved is None:
        del os.environ[TRANSPORT_ENV]
    else:
        os.environ[TRANSPORT_ENV] = saved
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(mlp(torch, dev))
    configs["DDP"] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    kinds = [str(b.device) for b in configs["device buckets"][1]._buckets]
    staged = [str(b.device) for b in configs["staged buckets"][1]._buckets]

    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 1024, generator=g).to(dev)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(dev)

    def block(model, opt, steps):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        sync()
        return (time.perf_counter() - start) / steps

    for model, opt in configs.values():  # warm-up: kernels, buckets, communicators, lanes
        block(model, opt, 3)
    times = {k: [] for k in configs}
    for _ in range(args.repeats):
        for key, (model, opt) in configs.items():
            times[key].append(block(model, opt, args.steps))
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        model, opt = configs["device buckets"]
        profiler.runcall(block, model, opt, args.steps)
        print(f"cProfile of {args.steps} steps with device buckets (own time):", flush=True)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
        sys.stdout.flush()
    dist.destroy_process_group()
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print("RESULT " + json.dumps({"device": name, "batch": args.batch, "buckets": kinds, "staged": staged,
                                  "step_s": {k: statistics.median(v) for k, v in times.items()}}), flush=True)


def main():
    args = parse()
    if args.worker:
        worker(args)
        return
    from jupyter_ring.launch import find_mpiexec, mpi_env

    cmd = [find_mpiexec(), "-n", "1", sys.executable, os.path.abspath(__file__), "--worker",
           "--steps", str(args.steps), "--repeats", str(args.repeats), "--batch", str(args.batch),
           "--device", args.device] + (["--profile"] if args.profile else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), stdin=subprocess.DEVNULL, timeout=600)
    found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not found:
        sys.exit(f"the run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(found[0])
    if args.profile:
        start = proc.stdout.find("cProfile of")
        print(proc.stdout[start:proc.stdout.find("RESULT ")])
    steps = result["step_s"]
    base = steps["plain"]
    print(f"one rank, {result['device']}, MLP 10.5M parameters, batch {result['batch']}: median ms a step "
          f"({args.repeats} blocks of {args.steps} steps, interleaved); device buckets on {result['buckets']}, "
          f"staged buckets on {result['staged']}\n")
    print("| configuration | ms a step | ÷ plain |\n|---|---|---|")
    for key, value in steps.items():
        print(f"| {key} | {value * 1e3:.2f} | {value / base:.2f} |")


if __name__ == "__main__":
    main()
