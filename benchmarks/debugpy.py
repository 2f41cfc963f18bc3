"""What ``%ring debugpy RANK`` costs the rank's Python code (issue 35, item 5).

Usage: python benchmarks/debugpy.py [--cells 5] [--loop 2000000]

A real kernel with ``%ring start -n 2``; each cell times the same pure-Python loop on both ranks at
once (the CPU time of the cell's thread, ``time.thread_time``: on a machine shared with other jobs
the wall time says more about the others than about the tracer), so rank 0 (never debugged) is the
side-by-side control of rank 1.
Phases, in order: before ``%ring debugpy 1``; debugpy listening, no client; a DAP client attached
(with a breakpoint set in another cell, never reached); the client disconnected. Printed: per
phase, the median of rank 1's CPU time over rank 0's in the same cell, and both medians.
"""

import argparse
import os
import re
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

LOOP = """%%distributed
import time as _t
def _spin(n):
    s = 0
    for i in range(n):
        s += i % 7
    return s
_t0 = _t.thread_time(); _spin({loop}); print("spin", _t.thread_time() - _t0)
"""
ELSEWHERE = """%%distributed
def _never_called():
    return 1
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=5)
    parser.add_argument("--loop", type=int, default=2_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jupyter_ring_bench_debugpy_") as work:
        run(args, work)


def run(args: argparse.Namespace, work: str) -> None:
    for var in ("IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
        os.environ[var] = os.path.join(work, var.lower())
    from dap_client import Dap
    from real_kernel import cluster_pids, ring_kernel

    def phase(kernel):
        rows = []
        for _ in range(args.cells):
            out = kernel.ok(LOOP.format(loop=args.loop), timeout=300)
            times = {int(r): float(t) for r, t in re.findall(r"\[rank (\d+)\] spin ([\d.e-]+)", out)}
            rows.append((times[0], times[1]))
        return rows

    results = {}
    with ring_kernel(2) as kernel:
        cluster_pids(kernel)
        results["before %ring debugpy"] = phase(kernel)
        out = kernel.ok("%ring debugpy 1")
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", out).group(1))
        results["listening, no client"] = phase(kernel)
        kernel.ok(ELSEWHERE)
        folder = re.search(r'"localRoot": "([^"]+)"', out).group(1)
        path = next(os.path.join(folder, n) for n in os.listdir(folder)
                    if "_never_called" in open(os.path.join(folder, n)).read())
        dap = Dap(port)
        dap.attach({path: [3]})
        results["client attached"] = phase(kernel)
        dap.request("disconnect")
        dap.close()
        results["client disconnected"] = phase(kernel)
    load = os.getloadavg()
    print(f"pure-Python loop of {args.loop} iterations, {args.cells} cells a phase, 2 CPU ranks; "
          f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    for name, rows in results.items():
        ratio = statistics.median(b / a for a, b in rows)
        print(f"  {name:22s} rank 1 / rank 0: {ratio:4.2f}x  (medians: rank 0 "
              f"{statistics.median(a for a, _ in rows):.3f} s, rank 1 "
              f"{statistics.median(b for _, b in rows):.3f} s)")


if __name__ == "__main__":
    main()
