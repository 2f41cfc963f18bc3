"""Two source trees of jupyter_ring side by side: benchmarks/peers.py's ``ring`` row, alternated.

Usage: python benchmarks/ab_trees.py --base /tmp/base [--new .] [--rounds 5] [--cells 30]

Each round runs ``peers.py --only ring`` once in each tree (which goes first alternates), with
this Python (one venv) and the tree on ``PYTHONPATH`` and as the working directory, so the kernel,
the controller and the engines import that tree's ``jupyter_ring``. Prints each run with the
load average, then medians and new/base ratios of the start, the trivial cell and the 1 MB
cell. A base tree for a commit: ``git worktree add --detach /tmp/base <commit>``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

METRICS = (("start_s", "start to first cell (s)"), ("cell_ms", "trivial cell (ms)"),
           ("big_s", "1 MB/rank cell (s)"), ("floor_ms", "floor (ms)"),
           ("cleanup_s", "cleanup (s)"))


def run(tree, cells):
    """One ``peers.py --only ring`` in ``tree``; its figures and the load around it."""
    tree = os.path.abspath(tree)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, PYTHONPATH=tree)
        proc = subprocess.run([sys.executable, os.path.join(tree, "benchmarks", "peers.py"),
                               "--only", "ring", "--cells", str(cells), "--json", out.name],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"peers.py in {tree} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        data = json.load(open(out.name))
    figures = data["systems"]["ring"]
    if "error" in figures:
        raise RuntimeError(f"peers.py in {tree}: {figures['error']}")
    figures["load"] = [data["load_average"][0][0], data["load_average"][1][0]]
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the tree to compare against")
    parser.add_argument("--new", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the tree under test (default: this one)")
    parser.add_argument("--rounds", type=int, default=5, help="runs per tree, alternated (5)")
    parser.add_argument("--cells", type=int, default=30, help="trivial cells per run (30)")
    args = parser.parse_args(argv)
    runs = {"base": [], "new": []}
    for i in range(args.rounds):
        order = ("base", "new") if i % 2 == 0 else ("new", "base")
        for name in order:
            figures = run(getattr(args, name), args.cells)
            runs[name].append(figures)
            print(f"round {i + 1} {name:4}: load {figures['load'][0]:.2f} -> {figures['load'][1]:.2f}  "
                  + "  ".join(f"{key} {figures[key]:.3f}" for key, _ in METRICS
                              if figures.get(key) is not None), flush=True)
    print(f"\n{'median of ' + str(args.rounds):28} {'base':>9} {'new':>9} {'new/base':>9}")
    for key, label in METRICS:
        base = [r[key] for r in runs["base"] if r.get(key) is not None]
        new = [r[key] for r in runs["new"] if r.get(key) is not None]
        if base and new:
            b, n = statistics.median(base), statistics.median(new)
            print(f"{label:28} {b:9.3f} {n:9.3f} {n / b:9.2f}")
    loads = [x for name in runs for r in runs[name] for x in r["load"]]
    print(f"load average (1 min) over the runs: {min(loads):.2f} to {max(loads):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
