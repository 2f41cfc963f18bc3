"""The runtime's own Python per collective: CPU time of one rank's calling thread, no messaging.

    .venv/bin/python benchmarks/hotpath.py [--baseline-src DIR ...] [--runs 5] [--profile]

One rank (so what is measured is the Python and numpy work of a call, not a peer's latency),
``time.thread_time`` of the calling thread, best of 5 blocks per run, medians over ``--runs``
runs. Cases: a blocking 4 KiB ``allreduce_`` and ``allreduce``, an async 4 KiB allreduce then
its ``synchronize``, and 100 async 40 KiB allreduces fused (per member, beyond one 4 MiB
allreduce). "this tree" is the source tree this script is in (its ``jupyter_ring`` is put first on
the ranks' path, whatever is installed); ``--baseline-src DIR`` runs another source tree's
``jupyter_ring`` (a checkout of an older commit: ``git worktree add /tmp/base <commit>``; repeat
it for several) in alternate runs and prints them all with this tree's ratio to each. Each run
says where its ``jupyter_ring`` came from, and a run that imported it from elsewhere stops the
benchmark. ``--profile`` prints cProfile's top functions for the blocking 4 KiB call instead.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

THIS_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-src", action="append",
                   help="another source tree to measure alternately (repeat it for more)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def worker(profile):
    import numpy as np

    import jupyter_ring.runtime as ring

    ring.init()
    small = np.ones(1024, np.float32)
    members = [np.ones(10 * 1024, np.float32) for _ in range(100)]
    big = np.concatenate(members)

    def batch():
        handles = [ring.allreduce_async_(t, op=ring.Max, name=f"f{i}") for i, t in enumerate(members)]
        for h in handles:
            ring.synchronize(h)

    cases = {
        "allreduce_ 4 KiB": (lambda: ring.allreduce_(small, op=ring.Max, name="b"), 5000),
        "allreduce 4 KiB": (lambda: ring.allreduce(small, op=ring.Max, name="b"), 5000),
        "async + synchronize 4 KiB": (lambda: ring.synchronize(ring.allreduce_async_(small, op=ring.Max, name="b")), 5000),
        "100 x 40 KiB fused": (batch, 50),
        "one 4 MiB": (lambda: ring.allreduce_(big, op=ring.Max, name="one"), 50),
    }
    if profile:
        import cProfile
        import pstats

        fn, count = cases["allreduce_ 4 KiB"]
        fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(count):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        return
    out = {}
    for label, (fn, count) in cases.items():
        fn()
        best = []
        for _ in range(5):
            start = time.thread_time()
            for _ in range(count):
                fn()
            best.append((time.thread_time() - start) / count)
        out[label] = min(best)
    out["fused, per member beyond one 4 MiB"] = (out["100 x 40 KiB fused"] - out["one 4 MiB"]) / 100
    import jupyter_ring

    print("SOURCE " + os.path.dirname(os.path.dirname(os.path.abspath(jupyter_ring.__file__))), flush=True)
    print("RESULT " + json.dumps(out), flush=True)


def run(src, profile=False):
    """One run of the worker on the source tree ``src`` (None: this tree); its results."""
    from jupyter_ring.launch import find_mpiexec, mpi_env

    env = mpi_env()
    tree = os.path.abspath(src or THIS_TREE)
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [find_mpiexec(), "-n", "1", sys.executable, os.path.abspath(__file__), "--worker"]
    if profile:
        cmd.append("--profile")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if profile:
        print(proc.stdout)
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    source = [line[len("SOURCE "):] for line in proc.stdout.splitlines() if line.startswith("SOURCE ")]
    if source != [tree]:
        sys.exit(f"the run meant for {tree} imported jupyter_ring from {source}: remove what puts another "
                 "tree first on the path (a .pth file, PYTHONPATH) or pass that tree as --baseline-src")
    return json.loads(lines[0][len("RESULT "):])


def main():
    args = parse()
    if args.worker:
        worker("--profile" in sys.argv)
        return
    sys.path.insert(0, THIS_TREE)
    if args.profile:
        run(None, profile=True)
        return
    baselines = args.baseline_src or []
    names = ["baseline"] if len(baselines) == 1 else [f"baseline {i + 1}" for i in range(len(baselines))]
    trees = {**dict(zip(names, baselines)), "this tree": None}
    results = {name: [] for name in trees}
    loads = []
    for _ in range(args.runs):  # alternate, so a disturbance hits every tree alike
        for name, src in trees.items():
            loads.append(os.getloadavg()[0])
            results[name].append(run(src))
    cases = list(results["this tree"][0])
    head = ("| per call (µs, CPU of the calling thread) | " + " | ".join(trees)
            + "".join(f" | this ÷ {name}" for name in names) + " |")
    print(f"1 rank, medians of {args.runs} runs (best of 5 blocks each); load average {min(loads):.1f}-{max(loads):.1f}")
    print("trees: " + ", ".join(f"{name} {os.path.abspath(src or THIS_TREE)}" for name, src in trees.items()) + "\n")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for case in cases:
        med = {name: statistics.median(r[case] for r in results[name]) for name in trees}
        cells = [f"{med[name] * 1e6:.1f}" for name in trees]
        cells += [f"{med['this tree'] / med[name]:.2f}" for name in names]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
