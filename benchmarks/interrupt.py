"""Interrupt latency inside a collective as the world grows: SIGINT to KeyboardInterrupt, per rank.

    .venv/bin/python benchmarks/interrupt.py [--ranks 2,4,8] [--repeats 10] [--waits auto]

For each world size (and each ``JUPYTER_RING_WAIT`` in ``--waits``), one ``mpiexec -n N`` run.
Each repeat: rank 0 sleeps (busy elsewhere) while every other rank waits for it inside
``ring.allreduce`` (a 400 KiB payload: shared memory on one host); at an agreed wall-clock time
every rank sends itself SIGINT (what the notebook's interrupt does through the engines' nanny),
and each rank records how long after that time its KeyboardInterrupt landed. After each repeat an
allreduce must be exact (the interrupted one left nothing behind). Prints per world size the
median and the largest latency over every rank and repeat, the machine's load beside them. The
tests assert only the notebook's promise (within its 5 s ``interrupt_grace``, tests/bounds.py);
this is where the typical figure is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8", help="world sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--waits", default="auto", help="JUPYTER_RING_WAIT values, comma-separated")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(repeats: int) -> None:
    import jupyter_ring.runtime as ring

    ring.init()
    rank, n = ring.rank(), ring.size()
    payload = np.ones(100_003)
    latencies: list[float] = []
    for i in range(repeats):
        at = ring.broadcast_object(time.time() + 0.5, root_rank=0, name=f"at{i}")
        threading.Timer(max(0.0, at - time.time()), os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            if rank == 0:
                time.sleep(30)  # busy elsewhere: the others wait for it inside the allreduce
            ring.allreduce(payload, op=ring.Sum, name="held")
        except KeyboardInterrupt:
            latencies.append(time.time() - at)
        time.sleep(max(0.0, at + 0.3 - time.time()))  # every rank has been interrupted
        x = np.random.default_rng(1000 * i + rank).standard_normal(4099)
        want = sum(np.random.default_rng(1000 * i + q).standard_normal(4099) for q in range(n))
        if not np.allclose(ring.allreduce(x, op=ring.Sum, name=f"after{i}"), want):
            raise SystemExit(f"rank {rank}: the allreduce after interrupt {i} was wrong")
    every = ring.allgather_object(latencies, name="latencies")
    if rank == 0:
        flat = [t for row in every for t in row]
        print("RESULT " + json.dumps({"ranks": n, "wait": ring.wait_policy().mode, "latencies": flat}), flush=True)
    ring.shutdown()


def launch(ranks: int, wait: str, repeats: int) -> dict:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec, "-n", str(ranks), sys.executable, __file__, "--worker", "--repeats", str(repeats)]
    env = {**os.environ, "JUPYTER_RING_WAIT": wait, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{ranks} ranks: no result\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def main() -> None:
    args = parse()
    if args.worker:
        worker(args.repeats)
        return
    print(f"# {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} at start, {time.strftime('%H:%M')} UTC\n")
    print("| ranks | wait | interrupts | median ms | max ms |")
    print("|---|---|---|---|---|")
    for ranks in [int(r) for r in args.ranks.split(",")]:
        for wait in [w.strip() for w in args.waits.split(",") if w.strip()]:
            result = launch(ranks, wait, args.repeats)
            lat = result["latencies"]
            print(f"| {ranks} | {result['wait']} | {len(lat)} | {statistics.median(lat) * 1e3:.1f} | "
                  f"{max(lat) * 1e3:.1f} |", flush=True)
    print(f"\n# load {os.getloadavg()[0]:.2f} at the end, {time.strftime('%H:%M')} UTC")


if __name__ == "__main__":
    main()
