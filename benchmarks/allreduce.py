"""jupyter_ring allreduce vs MPI_Allreduce (mpi4py, same MPI) vs torch.distributed gloo.

    .venv/bin/python benchmarks/allreduce.py [--ranks 2] [--max-mib 256] [--json out.json]

Launches itself under the environment's mpiexec. For float32 sizes 4 KiB .. 256 MiB, in one run,
interleaved per size: median time, busbw (nccl-tests: algbw * 2(n-1)/n) and jupyter_ring's ratios,
plus single-process memcpy bandwidth and a fusion line (100 async 40 KiB vs one 4 MiB).
All three reduce in place on the same buffer sizes.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

KiB, MiB = 1 << 10, 1 << 20


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def reps_for(nbytes):
    if nbytes <= 64 * KiB:
        return 300
    if nbytes <= 4 * MiB:
        return 30
    return 7


def median_time(fn, reps, barrier):
    times = []
    fn()  # warm-up: page faults, buffer allocation
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def worker(args):
    from mpi4py import MPI

    import jupyter_ring.runtime as ring

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ring.init()
    try:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getppid() % 1000))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=size)
    except ImportError:
        torch = dist = None
    barrier = comm.Barrier
    factor = 2 * (size - 1) / size
    rows = []
    nbytes = 4 * KiB
    while nbytes <= args.max_mib * MiB:
        count = nbytes // 4
        buf = np.random.default_rng(rank).standard_normal(count).astype(np.float32)
        reps = reps_for(nbytes)
        row = {"bytes": nbytes}
        row["ring"] = median_time(lambda: ring.allreduce_(buf, op=ring.Sum, name="bench"), reps, barrier)
        row["mpi"] = median_time(lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), reps, barrier)
        if dist is not None:
            tbuf = torch.from_numpy(buf)
            row["gloo"] = median_time(lambda: dist.all_reduce(tbuf), reps, barrier)
        for key in ("ring", "mpi", "gloo"):
            if key in row:
                row[key + "_busbw"] = nbytes / row[key] * factor
        rows.append(row)
        del buf
        nbytes *= 4
    # fusion: 100 async 40 KiB allreduces against one 4 MiB allreduce
    small = [np.random.default_rng(i).standard_normal(10 * KiB).astype(np.float32) for i in range(100)]
    big = np.concatenate(small)

    def batch():
        handles = [ring.allreduce_async_(t, op=ring.Sum, name=f"f{i}") for i, t in enumerate(small)]
        for h in handles:
            ring.synchronize(h)

    def unfused():
        for i, t in enumerate(small):
            ring.allreduce_(t, op=ring.Sum, name=f"u{i}")

    fusion = {
        "batch": median_time(batch, 30, barrier),
        "one": median_time(lambda: ring.allreduce_(big, op=ring.Sum, name="one"), 30, barrier),
        "unfused": median_time(unfused, 10, barrier),
    }
    if rank == 0:
        src = np.ones(256 * MiB // 4, np.float32)
        dst = np.empty_like(src)
        memcpy = src.nbytes / median_time(lambda: np.copyto(dst, src), 7, lambda: None)
        print("RESULT " + json.dumps({"rows": rows, "fusion": fusion, "memcpy": memcpy, "size": size}), flush=True)
    if dist is not None:
        dist.destroy_process_group()


def human(nbytes):
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def report(result):
    rows, fusion, memcpy = result["rows"], result["fusion"], result["memcpy"]
    gb = 1e9
    has_gloo = "gloo" in rows[0]
    head = "| size | ring µs | ring busbw GB/s | MPI µs | MPI busbw GB/s |"
    head += " gloo µs | gloo busbw GB/s |" if has_gloo else ""
    head += " ring/MPI time | ring/MPI busbw |" + (" ring/gloo busbw |" if has_gloo else "") + " ring busbw / memcpy |"
    lines = [f"{result['size']} ranks, float32, in place, medians. memcpy (1 process): {memcpy / gb:.2f} GB/s", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        cells = [human(row["bytes"]), f"{row['ring'] * 1e6:.1f}", f"{row['ring_busbw'] / gb:.2f}",
                 f"{row['mpi'] * 1e6:.1f}", f"{row['mpi_busbw'] / gb:.2f}"]
        if has_gloo:
            cells += [f"{row['gloo'] * 1e6:.1f}", f"{row['gloo_busbw'] / gb:.2f}"]
        cells += [f"{row['ring'] / row['mpi']:.2f}", f"{row['ring_busbw'] / row['mpi_busbw']:.2f}"]
        if has_gloo:
            cells += [f"{row['ring_busbw'] / row['gloo_busbw']:.2f}"]
        cells += [f"{row['ring_busbw'] / memcpy:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Fusion: 100 async 40 KiB allreduces {fusion['batch'] * 1e3:.2f} ms, one 4 MiB allreduce "
                  f"{fusion['one'] * 1e3:.2f} ms (ratio {fusion['batch'] / fusion['one']:.2f}); the same 100 "
                  f"unfused {fusion['unfused'] * 1e3:.2f} ms."]
    return "\n".join(lines)


def main():
    args = parse()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jupyter_ring.launch import find_mpiexec, mpi_env

    cmd = [find_mpiexec(), "-n", str(args.ranks), sys.executable, os.path.abspath(__file__), "--worker",
           "--max-mib", str(args.max_mib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env())
    results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        sys.exit(f"benchmark failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(results[0])
    print(report(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
