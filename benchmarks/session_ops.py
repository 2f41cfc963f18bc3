"""TF1 session ops: what one ``session.run`` of collective ops costs, per op (wall ms).

    .venv/bin/python benchmarks/session_ops.py [--runs 3] [--ops 20]

Two ranks under ``mpiexec.gforker`` (``-n``), TF1 graph mode, ``--ops`` allreduces of 1 KiB
float32 tensors, built with each ``JUPYTER_RING_TF_SESSION_WAIT`` (``inline``: the py_function
holds its inter-op thread while it waits, the default; ``thread``: it waits on a thread of its
own), the two alternated run by run. Cases: one op fetched alone (``session.run(op)``, median of
200 runs), every op fetched in one ``session.run`` (per op, median of 50 runs), in a session of
the inter-op threads ``hvd.init()`` gives, and the first run of each op (median).
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
        firsts = []
        for fetch in fetches:  # each op's first run: its kernels made, its iterator started
            hvd.barrier()
            start = time.perf_counter()
            session.run(fetch)
            firsts.append(time.perf_counter() - start)
        first = statistics.median(firsts) * 1e3
        alone = median_ms(lambda: session.run(fetches[0]), 200)
        together = median_ms(lambda: session.run(fetches), 50) / ops
    if hvd.rank() == 0:
        print(json.dumps({"alone": alone, "together": together, "first": first}), flush=True)


def run(wait, args):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec.gforker")
    env = dict(os.environ, JUPYTER_RING_TF_SESSION_WAIT=wait)
    out = subprocess.run([mpiexec, "-n", str(args.n), sys.executable, os.path.abspath(__file__), "--worker",
                          "--ops", str(args.ops)], env=env, capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL, cwd="/tmp")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        sys.exit(f"session_ops.py: a run failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


CASES = ("alone", "together", "first")


def main():
    args = parse()
    if args.worker:
        return worker(args.ops)
    waits = ("inline", "thread")
    results = {wait: [] for wait in waits}
    before = open("/proc/loadavg").read().split()[0]
    for _ in range(args.runs):
        for wait in waits:  # alternated, so that both see the same load
            results[wait].append(run(wait, args))
    after = open("/proc/loadavg").read().split()[0]
    print(f"load {before} -> {after}; {args.n} ranks, {args.ops} allreduces of 1 KiB; medians of {args.runs} runs, "
          "ms per op")
    print(f"| wait | one op alone | {args.ops} ops in one session.run, per op | first run of an op |")
    print("|---|---|---|---|")
    medians = {}
    for wait in waits:
        medians[wait] = {k: statistics.median(r[k] for r in results[wait]) for k in CASES}
        print(f"| {wait} | " + " | ".join(f"{medians[wait][k]:.3f}" for k in CASES) + " |")
    print("| thread ÷ inline | " + " | ".join(f"{medians['thread'][k] / medians['inline'][k]:.2f}" for k in CASES) + " |")


if __name__ == "__main__":
    main()
