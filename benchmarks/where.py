"""What ``%ring where`` costs: its latency on a real cluster, and keeping it armed on a training step.

Usage: python benchmarks/where.py [--calls 15] [--blocks 12] [--ranks 2 4]

- latency: ``RingCluster(n).where()`` (the signal through the nannies, every rank's dump read)
  on an idle cluster of 2 and of 4 ranks, ``--calls`` calls each, median and max.
- armed cost: under ``mpiexec -n 2``, a training-like step (a 256x256 float32 matmul, then 8
  allreduces of 64 KiB..1 MiB, the runtime's ring/shm paths) timed in blocks of 50 steps,
  alternating armed (record mapped, faulthandler registered) and disarmed in the same processes;
  the median block of each and their ratio. The record is rewritten at each collective's start,
  first wait and end either way (attribute stores); armed adds the copy into the map.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

STEP = r"""
import sys, statistics, tempfile, time
import numpy as np
import jupyter_ring.runtime as ring
from jupyter_ring.runtime._observe import where as _where
ring.init()
blocks = int(sys.argv[1])
rng = np.random.default_rng(ring.rank())
a = rng.standard_normal((256, 256), dtype=np.float32)
grads = [rng.standard_normal(n, dtype=np.float32) for n in (16384, 32768, 65536, 131072, 262144,
                                                             16384, 4099, 262144)]
where = tempfile.mkdtemp(prefix="where-bench-")
def block():
    ring.barrier()
    t = time.perf_counter()
    for _ in range(50):
        (a @ a).sum()
        for i, g in enumerate(grads):
            ring.allreduce_(g, name=f"g{i}")
    return (time.perf_counter() - t) / 50
block()  # warm-up: agreement caches, shm segments
times = {"armed": [], "off": []}
for b in range(blocks):
    for mode in (("armed", "off") if b % 2 == 0 else ("off", "armed")):
        if mode == "armed":
            _where.arm(where, ring.rank())
        else:
            _where.disarm()
        times[mode].append(block())
_where.disarm()
if ring.rank() == 0:
    on, off = statistics.median(times["armed"]), statistics.median(times["off"])
    print(f"step_ms armed {on * 1e3:.3f} off {off * 1e3:.3f} ratio {on / off:.4f}")
"""


def armed_cost(blocks):
    from jupyter_ring.launch import local_mpiexec

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(STEP)
    try:
        out = subprocess.run([local_mpiexec(), "-n", "2", sys.executable, fh.name, str(blocks)],
                             capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    finally:
        os.remove(fh.name)
    if out.returncode:
        raise SystemExit(out.stderr)
    return out.stdout.strip().splitlines()[-1]


def record_cost(rounds=200000):
    """Seconds per collective of the record's three rewrites (begin, first wait, end), armed
    and not, interleaved in this process: the part of the armed cost that is not noise."""
    from jupyter_ring.runtime._observe.where import Activity

    activity, where = Activity(), tempfile.mkdtemp(prefix="where-bench-")
    out = {"armed": [], "off": []}
    for b in range(10):
        for mode in (("armed", "off") if b % 2 == 0 else ("off", "armed")):
            activity.arm(where, 0) if mode == "armed" else activity.disarm()
            t = time.perf_counter()
            for _ in range(rounds // 10):
                activity.begin("allreduce", "fc1.weight.grad")
                activity.waiting((1,))
                activity.end()
            out[mode].append((time.perf_counter() - t) / (rounds // 10))
    activity.disarm()
    return statistics.median(out["armed"]), statistics.median(out["off"])


def latency(n, calls):
    from jupyter_ring.cluster import RingCluster

    with RingCluster(n=n) as cluster:
        cluster.where()  # first call: files opened, linecache warm
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            items = cluster.where()
            times.append(time.perf_counter() - t)
            assert all(not i.problem for i in items), [i.problem for i in items]
    return statistics.median(times), max(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4],
                        help="cluster sizes for the latency (none: skip it)")
    args = parser.parse_args()
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="where-ipython-"))
    print(f"load before: {open('/proc/loadavg').read().strip()}")
    print("| measure | median | max |\n|---|---|---|")
    for n in args.ranks:
        med, worst = latency(n, args.calls)
        print(f"| %ring where latency, {n} ranks (idle) | {med * 1e3:.1f} ms | {worst * 1e3:.1f} ms |")
    on, off = record_cost()
    print(f"record per collective: armed {on * 1e6:.2f} us, off {off * 1e6:.2f} us "
          f"(+{(on - off) * 1e6:.2f} us a collective)")
    line = armed_cost(args.blocks)
    print(f"armed cost ({args.blocks} blocks of 50 steps each way, 2 ranks): {line}")
    off_ms = float(line.split()[4])
    print(f"estimate from the record's cost: 8 collectives x {(on - off) * 1e6:.2f} us on a "
          f"{off_ms:.1f} ms step = {8 * (on - off) * 1e3 / off_ms * 100:.3f} % (the step ratio "
          "above is within this machine's block-to-block noise when it is loaded)")
    print(f"load after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
