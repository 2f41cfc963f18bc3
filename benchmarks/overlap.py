"""How much of DistributedOptimizer's communication hides behind backward, on 2 ranks.

    .venv/bin/python benchmarks/overlap.py [--ranks 2] [--layers 8] [--width 1024] [--compute-ms 4] [--steps 20]

Launches itself under the venv's ``mpiexec``. A model of ``--layers`` bias-free Linear layers
(width x width float32 gradients each) whose backward is emulated layer by layer: each layer's
backward sleeps ``--compute-ms`` (the CPU idles, as while a GPU computes), then its gradient is
ready. Three measurements, interleaved step by step, medians over ``--steps`` (the slower rank's
step sets the pace):

- compute: the step (forward, backward, optimizer step) with the same model and no
  communication (a plain torch optimizer), with the sleeps and without them;
- communication: the step with DistributedOptimizer and no sleeps (its allreduces alone, plus
  the same small compute);
- overlapped: the step with DistributedOptimizer and the sleeps.

hidden = 1 - (overlapped - compute) / (communication - compute without sleeps): the share of the
communication that the overlapped step does not add to the compute. Also the CPU time of rank 0's
calling thread and of its other threads (the engine's) per step: work on the calling thread
cannot be hidden, and the engine's needs an idle core. One bucket per layer
(``bucket_bytes`` = one layer's gradient) unless ``--bucket-mib`` says otherwise.
"""

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parser(description):
    """The options of this benchmark and of its TensorFlow twin (overlap_tf.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--compute-ms", type=float, default=4.0, help="emulated backward time per layer")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def parse():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--bucket-mib", type=float, default=0, help="bucket size (default: one layer)")
    return p.parse_args()


def launch(script, args, *extra, **env_extra):
    """Run ``script --worker`` with ``args``' options under the venv's mpiexec; rank 0's RESULT dict."""
    from jupyter_ring.launch import find_mpiexec, mpi_env

    env = mpi_env()
    env.update(OMP_NUM_THREADS="1", **env_extra)
    cmd = [find_mpiexec(), "-n", str(args.ranks), sys.executable, os.path.abspath(script), "--worker",
           "--layers", str(args.layers), "--width", str(args.width), "--compute-ms", str(args.compute_ms),
           "--steps", str(args.steps), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"benchmark failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT "):])


def worker(args):
    import torch

    import jupyter_ring.runtime.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    sleep = [args.compute_ms / 1000.0]

    class Compute(torch.autograd.Function):
        """Identity forward; backward idles like a GPU kernel of compute_ms would."""

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if sleep[0]:
                time.sleep(sleep[0])
            return grad

    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleList(torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers))

    x = torch.randn(4, args.width)
    bucket = int(args.bucket_mib * (1 << 20)) or args.width * args.width * 4
    local, shared = model(), model()  # the wrapper's gradient hooks live on shared's parameters
    plain = (local, torch.optim.SGD(local.parameters(), lr=0.0))
    # a tree without buckets (a baseline such as main before the engine) reduces at step()
    extra = {"bucket_bytes": bucket} if "bucket_bytes" in inspect.signature(hvd.DistributedOptimizer).parameters else {}
    dist = (shared, hvd.DistributedOptimizer(torch.optim.SGD(shared.parameters(), lr=0.0),
                                             named_parameters=shared.named_parameters(), **extra))

    def step(pair, compute):
        layers, opt = pair
        sleep[0] = args.compute_ms / 1000.0 if compute else 0.0
        hvd.barrier()
        start, own, every = time.perf_counter(), time.thread_time(), time.process_time()
        opt.zero_grad()
        h = x
        for layer in layers:
            h = Compute.apply(layer(h))
        h.pow(2).mean().backward()
        opt.step()
        own = time.thread_time() - own
        return time.perf_counter() - start, own, time.process_time() - every - own

    kinds = {"compute": (plain, True), "compute, no sleeps": (plain, False),
             "communication": (dist, False), "overlapped": (dist, True)}
    times = {k: [] for k in kinds}
    cpu = {k: [] for k in kinds}
    for kind, (opt, compute) in kinds.items():  # warm-up: buffers, the learned order
        for _ in range(3):
            step(opt, compute)
    for _ in range(args.steps):
        for kind, (opt, compute) in kinds.items():
            wall, own, others = step(opt, compute)
            times[kind].append(wall)
            cpu[kind].append((own, others))
    # the slower rank's step sets the pace: take each step's maximum over ranks
    everyone = hvd.allgather_object(times)
    if hvd.rank() == 0:
        paced = {k: [max(t[k][i] for t in everyone) for i in range(args.steps)] for k in kinds}
        result = {k: statistics.median(v) for k, v in paced.items()}
        # CPU of rank 0's calling thread and of its other threads (the engine's): they hold up
        # under load where wall times do not
        result["cpu"] = {k: [statistics.median(c[0] for c in v), statistics.median(c[1] for c in v)]
                         for k, v in cpu.items()}
        print("RESULT " + json.dumps(result), flush=True)


def main():
    args = parse()
    if args.worker:
        worker(args)
        return
    t = launch(__file__, args, "--bucket-mib", str(args.bucket_mib))
    grads = args.layers * args.width * args.width * 4 / (1 << 20)
    comm = t["communication"] - t["compute, no sleeps"]
    exposed = t["overlapped"] - t["compute"]
    hidden = 1 - exposed / comm if comm > 0 else float("nan")
    print(f"{args.ranks} ranks, {args.layers} layers x {grads / args.layers:.0f} MiB of gradients "
          f"({grads:.0f} MiB), backward {args.compute_ms:g} ms a layer (emulated), medians of {args.steps} steps\n")
    print("| step | ms | rank 0's calling thread, CPU ms | its other threads (the engine), CPU ms |")
    print("|---|---|---|---|")
    for kind in ("compute, no sleeps", "compute", "communication", "overlapped"):
        own, others = t["cpu"][kind]
        print(f"| {kind} | {t[kind] * 1e3:.1f} | {own * 1e3:.1f} | {others * 1e3:.1f} |")
    print(f"\ncommunication alone {comm * 1e3:.1f} ms, exposed in the overlapped step {exposed * 1e3:.1f} ms: "
          f"**{100 * hidden:.0f} % hidden**")
    if comm <= 0 or exposed <= 0:
        # with a core for each engine thread the allreduces hide even behind the real compute
        print("(no communication visible at this resolution: a step with DistributedOptimizer is no slower "
              "than the plain one; compare the rows, not the percentage)")


if __name__ == "__main__":
    main()
