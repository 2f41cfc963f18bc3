"""jupyter_ring allreduce vs MPI_Allreduce (mpi4py, same MPI) vs torch.distributed gloo.

    .venv/bin/python benchmarks/allreduce.py [--ranks 2] [--min-kib 4] [--max-mib 256] [--json out.json]
        [--baseline-src DIR] [--runs 3] [--windows 1024,4096] [--no-gloo]

Launches itself under the environment's mpiexec. For float32 sizes 4 KiB .. 256 MiB, in one run,
calls interleaved per size: median time, busbw (nccl-tests: algbw * 2(n-1)/n) and jupyter_ring's
ratios for MPI_Allreduce (in place), jupyter_ring in place (``allreduce_``), out of place
(``allreduce``, a new array each call) and on a gradient bucket (``bucket_buffer``: registered
memory, zero copy), gloo when torch is there; plus single-process memcpy bandwidth and a fusion line
(100 async 40 KiB vs one 4 MiB). ``--baseline-src DIR`` runs another source tree's ``jupyter_ring``
(``git worktree add /tmp/base <commit>``) and this one in alternate runs (``--runs`` each), prints
each tree's table of medians over its runs, then this tree's busbw ÷ the baseline's per size.
``--windows 1024,4096`` (KiB) adds, per size, in-place, out-of-place and bucket allreduces with
``shm_window_bytes`` set to each value before each call, interleaved with the rest: piece sizes
compared within one run (a table of busbw ÷ memcpy per window).
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
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--baseline-src", help="another source tree to measure in alternate runs")
    parser.add_argument("--runs", type=int, default=3, help="runs of each tree with --baseline-src")
    parser.add_argument("--windows", default="", help="shm_window_bytes values (KiB) to compare, comma-separated")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--no-gloo", action="store_true",
                        help="leave torch.distributed's gloo out of the rounds: on few cores its threads, "
                             "still busy after its call, slow every other column, MPI's too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def reps_for(nbytes):
    if nbytes <= 64 * KiB:
        return 300
    if nbytes <= 4 * MiB:
        return 30
    return 7


def interleaved(fns, reps, barrier):
    """Median seconds of each function, called round-robin (a disturbance hits them alike)."""
    times = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: page faults, buffer allocation, the response cache
        fn()
    for _ in range(reps):
        for key, fn in fns.items():
            barrier()
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {k: float(np.median(v)) for k, v in times.items()}


def windowed(ring, window, buf, bucket):
    """In place, out of place and (``bucket`` not None) bucket allreduces through ``window``-byte
    shared-memory slots: ``shm_window_bytes`` is set before each call (every rank alike)."""
    config = ring.config()

    def call(fn, *args, **kwargs):
        def run():
            config.shm_window_bytes = window
            try:
                fn(*args, op=ring.Max, **kwargs)
            finally:
                config.shm_window_bytes = default
        return run
    default = config.shm_window_bytes
    fns = {f"in@{window // KiB}": call(ring.allreduce_, buf, name="bench"),
           f"out@{window // KiB}": call(ring.allreduce, buf, name="bench.out")}
    if bucket is not None:
        fns[f"bucket@{window // KiB}"] = call(ring.allreduce_, bucket, name="bench.bucket")
    return fns


def worker(args):
    from mpi4py import MPI

    import jupyter_ring.runtime as ring
    from jupyter_ring.runtime import _api

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ring.init()
    try:
        if args.no_gloo:
            raise ImportError("--no-gloo")
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
    nbytes = args.min_kib * KiB
    while nbytes <= args.max_mib * MiB:
        count = nbytes // 4
        # Max keeps repeated in-place reductions finite (Sum would overflow to inf after ~128)
        buf = np.random.default_rng(rank).standard_normal(count).astype(np.float32)
        fns = {
            "ring": lambda: ring.allreduce_(buf, op=ring.Max, name="bench"),
            "ring_out": lambda: ring.allreduce(buf, op=ring.Max, name="bench.out"),
            "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX),
        }
        if nbytes > 64 * KiB and hasattr(_api, "bucket_buffer"):  # a gradient bucket: registered memory
            bucket = _api.bucket_buffer(nbytes).view(np.float32)
            bucket[...] = buf
            fns["bucket"] = lambda: ring.allreduce_(bucket, op=ring.Max, name="bench.bucket")
        for kib in filter(None, args.windows.split(",")):
            fns.update(windowed(ring, int(kib) * KiB, buf, fns.get("bucket") and bucket))
        if dist is not None:
            tbuf = torch.from_numpy(buf)
            fns["gloo"] = lambda: dist.all_reduce(tbuf, op=dist.ReduceOp.MAX)
        row = {"bytes": nbytes, **interleaved(fns, reps_for(nbytes), barrier)}
        for key in fns:
            row[key + "_busbw"] = nbytes / row[key] * factor
        rows.append(row)
        del buf, fns
        nbytes *= 4
    # fusion: 100 async 40 KiB allreduces against one 4 MiB allreduce
    small = [np.random.default_rng(i).standard_normal(10 * KiB).astype(np.float32) for i in range(100)]
    big = np.concatenate(small)

    def batch():
        handles = [ring.allreduce_async_(t, op=ring.Max, name=f"f{i}") for i, t in enumerate(small)]
        for h in handles:
            ring.synchronize(h)

    def unfused():
        for i, t in enumerate(small):
            ring.allreduce_(t, op=ring.Max, name=f"u{i}")

    fusion = interleaved({"batch": batch, "one": lambda: ring.allreduce_(big, op=ring.Max, name="one"),
                          "unfused": unfused}, 30, barrier)
    if rank == 0:
        src = np.ones(256 * MiB // 4, np.float32)
        dst = np.empty_like(src)
        memcpy = src.nbytes / interleaved({"copy": lambda: np.copyto(dst, src)}, 7, lambda: None)["copy"]
        print("RESULT " + json.dumps({"rows": rows, "fusion": fusion, "memcpy": memcpy, "size": size}), flush=True)
    if dist is not None:
        dist.destroy_process_group()
    comm.Barrier()  # rank 0's memcpy can take seconds: finalize together (finalize_timeout)


def human(nbytes):
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def report(result):
    rows, fusion, memcpy = result["rows"], result["fusion"], result["memcpy"]
    gb = 1e9
    has_gloo = "gloo" in rows[0]
    head = ("| size | MPI µs | ring in place µs | ring out of place µs | bucket µs | ring/MPI time | "
            "busbw GB/s MPI / in / out / bucket | in/MPI busbw | out/MPI busbw | bucket/MPI busbw | "
            "in / out / bucket busbw ÷ memcpy |" + (" gloo µs |" if has_gloo else ""))
    lines = [f"{result['size']} ranks, float32, op Max, medians of interleaved calls. memcpy (1 process): "
             f"{memcpy / gb:.2f} GB/s", "", head, "|" + "---|" * (head.count("|") - 1)]

    def cell(row, key, fmt):
        return fmt(row[key]) if key in row else "-"

    for row in rows:
        us = lambda v: f"{v * 1e6:.1f}"  # noqa: E731
        ratio = lambda key: cell(row, key + "_busbw", lambda v: f"{v / row['mpi_busbw']:.2f}")  # noqa: E731
        bw = " / ".join(cell(row, k + "_busbw", lambda v: f"{v / gb:.2f}") for k in ("mpi", "ring", "ring_out", "bucket"))
        mem = " / ".join(cell(row, k + "_busbw", lambda v: f"{v / memcpy:.2f}") for k in ("ring", "ring_out", "bucket"))
        cells = [human(row["bytes"]), us(row["mpi"]), us(row["ring"]), us(row["ring_out"]), cell(row, "bucket", us),
                 f"{row['ring'] / row['mpi']:.2f}", bw, ratio("ring"), ratio("ring_out"), ratio("bucket"), mem]
        if has_gloo:
            cells.append(us(row["gloo"]))
        lines.append("| " + " | ".join(cells) + " |")
    windows = sorted({key.split("@")[1] for key in rows[-1] if "@" in key and not key.endswith("_busbw")}, key=int)
    if windows:
        kinds = ("in", "out", "bucket")
        lines += ["", "shm_window_bytes compared in the same run: busbw ÷ memcpy, in / out / bucket", "",
                  "| size | " + " | ".join(f"{w} KiB window" for w in windows) + " |",
                  "|" + "---|" * (len(windows) + 1)]
        for row in rows:
            cells = [" / ".join(cell(row, f"{k}@{w}_busbw", lambda v: f"{v / memcpy:.2f}") for k in kinds)
                     for w in windows]
            lines.append(f"| {human(row['bytes'])} | " + " | ".join(cells) + " |")
    lines += ["", f"Fusion: 100 async 40 KiB allreduces {fusion['batch'] * 1e3:.2f} ms, one 4 MiB allreduce "
                  f"{fusion['one'] * 1e3:.2f} ms (ratio {fusion['batch'] / fusion['one']:.2f}); the same 100 "
                  f"unfused {fusion['unfused'] * 1e3:.2f} ms."]
    return "\n".join(lines)


def run(args, src=None):
    """One mpiexec run of the workers (``src``: the tree whose jupyter_ring they import; None:
    the tree this script is in, put first on their path whatever is installed)."""
    from jupyter_ring.launch import find_mpiexec, mpi_env

    env = mpi_env()
    tree = os.path.abspath(src or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [find_mpiexec(), "-n", str(args.ranks), sys.executable, os.path.abspath(__file__), "--worker",
           "--min-kib", str(args.min_kib), "--max-mib", str(args.max_mib), "--windows", args.windows,
           *(["--no-gloo"] if args.no_gloo else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        sys.exit(f"benchmark failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(results[0])
    result["load"] = open("/proc/loadavg").read().split()[0]
    return result


def median_of(results):
    """One result whose every figure is the median over ``results`` (same sizes and keys)."""
    med = lambda values: float(np.median(values))  # noqa: E731
    rows = [{key: med([r["rows"][i][key] for r in results]) if key != "bytes" else row[key] for key in row}
            for i, row in enumerate(results[0]["rows"])]
    return {"rows": rows, "size": results[0]["size"], "memcpy": med([r["memcpy"] for r in results]),
            "fusion": {k: med([r["fusion"][k] for r in results]) for k in results[0]["fusion"]}}


def main():
    args = parse()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not args.baseline_src:
        result = run(args)
        print(report(result))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
        return
    trees = {"baseline": args.baseline_src, "this tree": None}
    results = {name: [] for name in trees}
    for _ in range(args.runs):  # alternate, so a disturbance hits both alike
        for name, src in trees.items():
            results[name].append(run(args, src))
    merged = {name: median_of(rs) for name, rs in results.items()}
    for name, src in trees.items():
        loads = ", ".join(r["load"] for r in results[name])
        print(f"## {name} ({src or 'this checkout'}), medians of {args.runs} runs; load at each run {loads}\n")
        print(report(merged[name]) + "\n")
    keys = [k for k in ("ring", "ring_out", "bucket") if k in merged["this tree"]["rows"][-1]]
    print("| size | " + " | ".join(f"{k} busbw this ÷ baseline" for k in keys) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for new, old in zip(merged["this tree"]["rows"], merged["baseline"]["rows"]):
        cells = [f"{new[k + '_busbw'] / old[k + '_busbw']:.2f}" if k + "_busbw" in new and k + "_busbw" in old
                 else "-" for k in keys]
        print(f"| {human(new['bytes'])} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
