"""Small blocking collectives other than allreduce (allgather, broadcast, objects) against a lane
allreduce of the same bytes: wall medians, 1 and 2 ranks, this tree and another side by side.

    .venv/bin/python benchmarks/small_calls.py [--baseline-src DIR] [--runs 3] [--reps 2000]

Each call runs between two barriers; within a run every case's calls are interleaved (case A,
barrier, case B, barrier, ...), so a disturbance hits every case alike; runs of the two trees
alternate. The table gives each case's median over its runs (µs), and its ratio to the
``allreduce_`` of 6 int64 (op Max, the same 48 bytes as the (1, 5) int64 allgather plus one row)
of the same tree and run. "this tree" is the source tree this script is in (put first on the
ranks' path); ``--baseline-src DIR`` is another source tree (``git archive main | tar -x -C
/tmp/base``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-src", help="another source tree to measure alternately")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def worker(reps):
    import numpy as np
    from mpi4py import MPI

    import jupyter_ring.runtime as ring

    comm = MPI.COMM_WORLD
    ring.init()
    r, n = ring.rank(), ring.size()
    six = np.zeros(6, np.int64)
    row = np.zeros((1, 5), np.int64)
    rows = np.zeros((1 + r, 7), np.float32)  # first dims differ per rank
    block = np.zeros(1024, np.float32)
    cases = {
        "allreduce_ 6 int64 (Max)": lambda: ring.allreduce_(six, op=ring.Max, name="agree.r"),
        "allgather (1, 5) int64": lambda: ring.allgather(row, name="agree.g"),
        "allgather (1 + rank, 7) float32": lambda: ring.allgather(rows, name="agree.rows"),
        "broadcast_ 4 KiB": lambda: ring.broadcast_(block, root_rank=0, name="agree.b_"),
        "broadcast 4 KiB": lambda: ring.broadcast(block, root_rank=0, name="agree.b"),
        "allgather_object (small dict)": lambda: ring.allgather_object({"step": 1, "rank": r}, name="agree.go"),
        "broadcast_object (small dict)": lambda: ring.broadcast_object({"step": 1}, root_rank=0, name="agree.bo"),
    }
    times = {label: [] for label in cases}
    for i in range(reps + 2):
        for label, fn in cases.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if i >= 2:  # the first calls build caches and lanes
                times[label].append(t1 - t0)
    comm.Barrier()
    out = {label: float(np.median(v)) for label, v in times.items()}
    if r == 0:
        print("RESULT " + json.dumps({"ranks": n, "medians": out}), flush=True)
    ring.shutdown()


def run(src, ranks, reps):
    """One run of the worker on ``ranks`` ranks, on the source tree ``src`` (None: the tree this
    script is in, whatever ``jupyter_ring`` is installed); its medians."""
    from jupyter_ring.launch import find_mpiexec, mpi_env

    env = mpi_env()
    tree = os.path.abspath(src or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker",
           "--reps", str(reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT "):])["medians"]


def main():
    args = parse()
    if args.worker:
        worker(args.reps)
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trees = {"this tree": None}
    if args.baseline_src:
        trees = {"baseline": args.baseline_src, **trees}
    print(f"medians of {args.reps} calls between barriers, median over {args.runs} runs (µs; "
          "÷ lane: ratio to the same tree's allreduce_ of 6 int64 in the same run)\n")
    for ranks in map(int, args.ranks.split(",")):
        results = {name: [] for name in trees}
        loads = []
        for _ in range(args.runs):  # alternate, so a disturbance hits both alike
            for name, src in trees.items():
                loads.append(float(open("/proc/loadavg").read().split()[0]))
                results[name].append(run(src, ranks, args.reps))
        cases = list(results["this tree"][0])
        ref = cases[0]
        head = f"| {ranks} rank(s) | " + " | ".join(f"{name} µs | ÷ lane" for name in trees)
        if args.baseline_src:
            head += " | this ÷ baseline"
        print(head + f" |   (load {min(loads):.1f}-{max(loads):.1f})")
        print("|" + "---|" * (head.count("|")))
        for case in cases:
            cells = []
            med = {}
            for name in trees:
                med[name] = statistics.median(run_[case] for run_ in results[name])
                ratio = statistics.median(run_[case] / run_[ref] for run_ in results[name])
                cells.append(f"{med[name] * 1e6:.1f} | {ratio:.2f}")
            if args.baseline_src:
                cells.append(f"{med['this tree'] / med['baseline']:.2f}")
            print(f"| {case} | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main()
