"""Allreduce of torch CUDA tensors through jupyter_ring, side by side with what it stands on.

    python benchmarks/gpu_allreduce.py [--max-mib 256] [--device cuda|cpu] [--json out.json]

Two runs, each launched under the environment's mpiexec, every configuration interleaved per size
(median of the calls):

1. **one rank, the device transport** (NCCL's one-rank path): ``hvd.allreduce_`` of a CUDA tensor
   against the same allreduce on the transport's own NCCL backend (torch's ``ProcessGroupNCCL``,
   called directly) and a device-to-device
   copy of the same bytes (``dst.copy_(src)``): what the agreement, the fusion buffer and the polled
   completion cost on top of NCCL.
2. **two ranks sharing one GPU, staged** (``JUPYTER_RING_DEVICE_TRANSPORT=off``: NCCL refuses two
   ranks on one device, so CUDA tensors go device -> host -> ring -> host -> device): the same
   ``hvd.allreduce_`` against the ring on host tensors of the same size, i.e. what staging costs.

``--device cpu`` runs both over CPU tensors (the transport over gloo) so that the script itself is
checked on a machine without a GPU; its figures say nothing about GPUs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

KiB, MiB = 1 << 10, 1 << 20


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", choices=("transport", "staged"), help=argparse.SUPPRESS)
    return parser.parse_args()


def sizes(max_mib):
    out, n = [], 4 * KiB
    while n <= max_mib * MiB:
        out.append(n)
        n *= 4
    return out


def reps_for(nbytes):
    return 200 if nbytes <= 64 * KiB else 30 if nbytes <= 4 * MiB else 7


def interleaved(fns, reps, sync):
    """Median seconds of each function, called round-robin; ``sync()`` after each call (the
    device's work is asynchronous) and before it (a barrier between ranks)."""
    times = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: communicators, buffers, the response cache
        fn()
        sync()
    for _ in range(reps):
        for key, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def worker(args):
    import torch

    import jupyter_ring.runtime.torch as hvd
    from jupyter_ring.runtime._device import transport as _device

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # one GPU: in the staged run both ranks share it
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize()
        hvd.barrier()

    rows = []
    for nbytes in sizes(args.max_mib):
        x = torch.rand(nbytes // 4, device=dev)
        fns = {"jupyter_ring": lambda: hvd.allreduce_(x, op=hvd.Sum, name="bench")}
        if args.worker == "transport":
            hvd.allreduce_(x, op=hvd.Sum, name="bench")  # makes the transport's group
            backend = _device.transport().group(dev.type).backends[dev.type]
            fns["torch backend"] = lambda: backend.allreduce([x]).wait()
            dst = torch.empty_like(x)
            fns["copy"] = lambda: dst.copy_(x)
        else:
            host = torch.rand(nbytes // 4)
            fns["ring on host tensors"] = lambda: hvd.allreduce_(host, op=hvd.Sum, name="host")
        rows.append({"bytes": nbytes, "seconds": interleaved(fns, reps_for(nbytes), sync)})
    if rank == 0:
        name = torch.cuda.get_device_name(0) if cuda else "cpu"
        print("RESULT " + json.dumps({"run": args.worker, "ranks": size, "device": name, "rows": rows}),
              flush=True)


def table(result):
    rows = result["rows"]
    keys = list(rows[0]["seconds"])
    base = keys[0]
    head = f"{result['run']}, {result['ranks']} rank(s), {result['device']}: median µs (GB/s of the buffer)"
    lines = [head, "", "| size | " + " | ".join(keys) + " | " +
             " | ".join(f"{base} ÷ {k}" for k in keys[1:]) + " |",
             "|---" * (1 + 2 * len(keys) - 1) + "|"]
    for row in rows:
        s, n = row["seconds"], row["bytes"]
        size = f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"
        cells = [f"{s[k] * 1e6:.1f} ({n / s[k] / 1e9:.2f})" for k in keys]
        ratios = [f"{s[base] / s[k]:.2f}" for k in keys[1:]]
        lines.append("| " + " | ".join([size] + cells + ratios) + " |")
    return "\n".join(lines)


def main():
    args = parse()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jupyter_ring.launch import find_mpiexec, mpi_env

    results = []
    for run, ranks, env in (("transport", 1, {"JUPYTER_RING_DEVICE_TRANSPORT": "auto" if args.device == "cuda" else "gloo"}),
                            ("staged", 2, {"JUPYTER_RING_DEVICE_TRANSPORT": "off"})):
        cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, os.path.abspath(__file__),
               "--worker", run, "--device", args.device, "--max-mib", str(args.max_mib)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**mpi_env(), **env},
                              stdin=subprocess.DEVNULL)
        found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            sys.exit(f"{run} run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        results.append(json.loads(found[0]))
        print(table(results[-1]), end="\n\n", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
