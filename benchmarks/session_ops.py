"""TF1 session ops: what one ``session.run`` of collective ops costs, per op (wall ms).

    .venv/bin/python benchmarks/session_ops.py [--baseline-src DIR] [--runs 3] [--ops 20]

Two ranks under ``mpiexec.gforker`` (``-n``), TF1 graph mode, ``--ops`` allreduces of 1 KiB
float32 tensors. Cases: one op fetched alone (``session.run(op)``, median of 200 runs) and every
op fetched in one ``session.run`` (per op, median of 50 runs), in a session of TensorFlow's
default inter-op threads. ``--baseline-src DIR`` runs another source tree's ``jupyter_ring``
(``git archive <commit> | tar -x -C DIR``) in alternate runs and prints both with their ratio.
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
    p.add_argument("--ops", type=int, default=20)
    p.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def worker(ops):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    import jupyter_ring.runtime.tensorflow as hvd

    tf.compat.v1.disable_eager_execution()
    hvd.init()
    fetches = [hvd.allreduce(tf.constant(np.full(256, i, np.float32)), op=hvd.Sum) for i in range(ops)]

    def median_ms(fn, count):
        times = []
        for _ in range(count):
            hvd.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    with tf.compat.v1.Session() as session:
        session.run(fetches)  # warm: kernels made, iterators started
        alone = median_ms(lambda: session.run(fetches[0]), 200)
        together = median_ms(lambda: session.run(fetches), 50) / ops
    if hvd.rank() == 0:
        print(json.dumps({"alone": alone, "together": together}), flush=True)


def run(src, args):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec.gforker")
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    out = subprocess.run([mpiexec, "-n", str(args.n), sys.executable, os.path.abspath(__file__), "--worker",
                          "--ops", str(args.ops)], env=env, capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL, cwd="/tmp")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        sys.exit(f"session_ops.py: a run failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main():
    args = parse()
    if args.worker:
        return worker(args.ops)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("this tree", here)] + ([("baseline", args.baseline_src)] if args.baseline_src else [])
    results = {name: [] for name, _src in trees}
    for _ in range(args.runs):
        for name, src in trees:  # alternated, so that both see the same load
            results[name].append(run(src, args))
    print(f"load {open('/proc/loadavg').read().split()[:3]}; {args.n} ranks, {args.ops} allreduces of 1 KiB; "
          f"medians of {args.runs} runs, ms per op")
    print(f"| tree | one op alone | {args.ops} ops in one session.run, per op |")
    print("|---|---|---|")
    medians = {}
    for name, _src in trees:
        medians[name] = {k: statistics.median(r[k] for r in results[name]) for k in ("alone", "together")}
        print(f"| {name} | {medians[name]['alone']:.3f} | {medians[name]['together']:.3f} |")
    if args.baseline_src:
        a, b = medians["this tree"], medians["baseline"]
        print(f"| ratio | {a['alone'] / b['alone']:.2f} | {a['together'] / b['together']:.2f} |")


if __name__ == "__main__":
    main()
