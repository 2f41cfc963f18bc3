"""Notebook front end overhead: ``%ring start`` vs ipyparallel, ``%%distributed`` vs ``%%px``.

Usage: python benchmarks/frontend.py [--starts 3] [--cells 50] [-n 2]

Both sides run in one IPython shell on the same machine, one after the other:
- start: ``%ring start -n N`` (to ranks ready with ``ring.init()`` done) vs a plain
  ``ipyparallel.Cluster(engines="mpi", n=N).start_and_connect_sync()`` (same mpiexec) until
  every engine has registered; median of ``--starts`` runs each, stop not counted.
- cell: a trivial cell (``x = 1``) through ``%%distributed`` vs ``%%px`` on the same engines;
  median of ``--cells`` round trips each, interleaved so that load from others hits both.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time


def _median_ms(samples):
    return statistics.median(samples) * 1000


def bench_start(ip, n, runs):
    import ipyparallel as ipp

    from jupyter_ring.launch import find_mpiexec

    ring_times, ipp_times = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        ip.run_line_magic("ring", f"start -n {n}")
        ring_times.append(time.perf_counter() - t0)
        ip.run_line_magic("ring", "stop")

        cluster = ipp.Cluster(engines="mpi", n=n, log_level=40)
        cluster.config.MPIEngineSetLauncher.mpi_cmd = [find_mpiexec()]
        t0 = time.perf_counter()
        client = cluster.start_and_connect_sync()
        ipp_times.append(time.perf_counter() - t0)
        client.close()
        cluster.stop_engines_sync()
        cluster.stop_controller_sync()
    return ring_times, ipp_times


def bench_cells(ip, n, cells):
    ip.run_line_magic("ring", f"start -n {n}")
    try:
        magics = ip.magics_manager.registry["RingMagics"]
        view = magics.cluster.client[magics.cluster.engine_ids]
        view.block = True
        view.activate()  # registers %%px on the same engines
        for _ in range(5):  # warm up both paths
            ip.run_cell_magic("distributed", "", "x = 1")
            ip.run_cell_magic("px", "", "x = 1")
        dist, px = [], []
        for _ in range(cells):
            t0 = time.perf_counter()
            ip.run_cell_magic("distributed", "", "x = 1")
            dist.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ip.run_cell_magic("px", "", "x = 1")
            px.append(time.perf_counter() - t0)
        return dist, px
    finally:
        ip.run_line_magic("ring", "stop")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--starts", type=int, default=3, help="cluster starts per side (default 3)")
    parser.add_argument("--cells", type=int, default=50, help="cell round trips per side (default 50)")
    args = parser.parse_args(argv)
    if not os.environ.get("IPYTHONDIR"):
        os.environ["IPYTHONDIR"] = tempfile.mkdtemp(prefix="jupyter_ring_bench_")

    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "jupyter_ring")
    ring_start, ipp_start = bench_start(ip, args.n, args.starts)
    dist, px = bench_cells(ip, args.n, args.cells)

    rows = [
        (f"start, {args.n} ranks (s, median of {args.starts})", statistics.median(ring_start),
         statistics.median(ipp_start), "%ring start", "ipyparallel Cluster"),
        (f"trivial cell (ms, median of {args.cells})", _median_ms(dist), _median_ms(px),
         "%%distributed", "%%px"),
    ]
    print(f"{'measure':40} {'jupyter_ring':>13} {'ipyparallel':>12} {'ratio':>7}")
    for label, ours, theirs, _, _ in rows:
        print(f"{label:40} {ours:13.3f} {theirs:12.3f} {ours / theirs:6.2f}x")
    print(f"all start runs (s): ring {[round(t, 2) for t in ring_start]}, "
          f"ipyparallel {[round(t, 2) for t in ipp_start]}")
    print(f"cell quartiles (ms): %%distributed {[round(q * 1000, 2) for q in statistics.quantiles(dist)]}, "
          f"%%px {[round(q * 1000, 2) for q in statistics.quantiles(px)]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
