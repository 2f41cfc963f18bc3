"""TF1 session ops: what one ``session.run`` of collective ops costs, per op (wall ms).

    .venv/bin/python benchmarks/session_ops.py [--runs 3] [--ops 20,40,96] [--baseline-src DIR]

Two ranks under ``mpiexec.gforker`` (``-n``), TF1 graph mode, ``--ops`` allreduces of 1 KiB
float32 tensors in one graph, built with each ``JUPYTER_RING_TF_SESSION_WAIT`` (``inline``: the
py_function holds an inter-op thread while it waits, the default; ``thread``: the op waits on a
thread of its own), the configurations alternated run by run. Cases: the first run of each op
(median, and the last op's: a session's first run of a new op prepares its executors over the
graph's whole function library, so it grows with the ops built if each op adds functions), one
op fetched alone (``session.run(op)``, median of 200 runs), every op fetched in one
``session.run`` (per op, median of 50 runs), in a session of the inter-op threads ``hvd.init()``
gives. ``--baseline-src DIR`` (a tree holding another revision's ``jupyter_ring``, e.g. ``git
archive main jupyter_ring | tar -x -C DIR``) runs that tree's thread wait too, as a row of its
own; a run that exceeds ``--timeout`` is shown as ``>`` its time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# the tree whose jupyter_ring is measured: this one, or --baseline-src's (set for the workers)
sys.path.insert(0, os.environ.get("JUPYTER_RING_BENCH_SRC") or os.path.dirname(HERE))

CASES = ("first", "last_first", "alone", "together")
HEADERS = ("first run of an op (median)", "first run of the last op", "one op alone", "all ops in one run, per op")


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ops", default="20,40,96", help="comma-separated op counts (default 20,40,96)")
    p.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--baseline-src", default=None, help="another source tree whose thread wait to measure alongside")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take (default 600)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
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
        for fetch in fetches:  # each op's first run: its executors prepared, its kernels made
            hvd.barrier()
            start = time.perf_counter()
            session.run(fetch)
            firsts.append(time.perf_counter() - start)
        alone = median_ms(lambda: session.run(fetches[0]), 200)
        together = median_ms(lambda: session.run(fetches), 50) / ops
    if hvd.rank() == 0:
        print(json.dumps({"first": statistics.median(firsts) * 1e3, "last_first": firsts[-1] * 1e3,
                          "alone": alone, "together": together}), flush=True)


def run(config, ops, args):
    """One job of ``config`` (wait, source tree or None) at ``ops`` ops: its figures, or None past the timeout."""
    wait, src = config
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec.gforker")
    env = dict(os.environ, JUPYTER_RING_TF_SESSION_WAIT=wait,
               JUPYTER_RING_BENCH_SRC=os.path.abspath(src) if src is not None else "")
    env.pop("TF_NUM_INTEROP_THREADS", None)  # as init() leaves it (inline: 64)
    cmd = [mpiexec, "-n", str(args.n), sys.executable, os.path.abspath(__file__), "--worker", str(ops)]
    # its own process group, so that a timeout ends every rank
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, cwd="/tmp", start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return None
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        sys.exit(f"session_ops.py: a run failed ({wait}, {ops} ops, exit {proc.returncode}):\n{stdout[-2000:]}\n"
                 f"{stderr[-2000:]}")
    return json.loads(lines[-1])


def main():
    args = parse()
    if args.worker is not None:
        return worker(args.worker)
    counts = [int(c) for c in args.ops.split(",")]
    configs = [("inline", None), ("thread", None)] + ([("thread", args.baseline_src)] if args.baseline_src else [])
    names = {config: config[0] + (f" (baseline {config[1]})" if config[1] else "") for config in configs}
    results = {(config, ops): [] for config in configs for ops in counts}
    before = open("/proc/loadavg").read().split()[0]
    started = time.time()
    for _ in range(args.runs):
        for ops in counts:
            for config in configs:  # alternated, so that all see the same load
                results[(config, ops)].append(run(config, ops, args))
    after = open("/proc/loadavg").read().split()[0]
    print(f"load {before} -> {after}, {(time.time() - started) / 60:.1f} min; {args.n} ranks, allreduces of 1 KiB; "
          f"medians of {args.runs} runs, ms")
    print("| ops | wait | " + " | ".join(HEADERS) + " |")
    print("|---|---|" + "---|" * len(HEADERS))

    def median(config, ops, case):
        done = [r[case] for r in results[(config, ops)] if r is not None]
        # a run past the timeout counts as slower than any that finished
        return statistics.median(done + [float("inf")] * (len(results[(config, ops)]) - len(done))) if done else None

    def cell(value):
        return f">{args.timeout * 1e3:.0f}" if value is None or value == float("inf") else f"{value:.3f}"

    for ops in counts:
        for config in configs:
            print(f"| {ops} | {names[config]} | " + " | ".join(cell(median(config, ops, c)) for c in CASES) + " |")
        for config in configs[1:]:
            ratios = []
            for case in CASES:
                a, b = median(config, ops, case), median(configs[0], ops, case)
                ratios.append("-" if a in (None, float("inf")) or not b else f"{a / b:.2f}")
            print(f"| {ops} | {names[config]} ÷ inline | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
