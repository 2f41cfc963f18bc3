"""What CurveZMQ encryption (``RingCluster.encrypt``, on by default) costs: start, cells, output.

Usage: python benchmarks/security.py [--starts 3] [--cells 50] [--outputs 10] [-n 2]

One IPython shell, ``%ring start`` with ``c.RingCluster.encrypt`` True and False, interleaved
(on, off, on, off, ...) so that load from other work on the machine hits both alike:
- start: ``%ring start -n N`` until the ranks are ready; median of ``--starts`` runs each.
- trivial cell: ``%%distributed`` ``x = 1``; median of ``--cells`` round trips.
- 1 MiB output: a ``%%distributed`` cell where rank 0 prints 1 MiB of text (captured, not shown);
  median of ``--outputs`` cells.
- launcher: ``%ring start`` with MPICH's ``mpiexec.gforker`` (one-host default: loopback only)
  vs Hydra's ``mpiexec`` (listens on 0.0.0.0), both with curve on; median of ``--starts`` each.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

from IPython.utils.capture import capture_output

MIB_CELL = "if ring.rank() == 0:\n    print('x' * (1 << 20))"


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(ip, n, starts, cells, outputs):
    times = {True: {"start": [], "cell": [], "output": []},
             False: {"start": [], "cell": [], "output": []}}
    for run in range(starts):
        for encrypt in (True, False):
            ip.config.RingCluster.encrypt = encrypt
            with capture_output():
                times[encrypt]["start"].append(
                    _timed(lambda: ip.run_line_magic("ring", f"start -n {n}")))
            try:
                client = ip.magics_manager.registry["RingMagics"].cluster.client
                if bool(client.curve_serverkey) != encrypt:
                    raise RuntimeError(f"encrypt={encrypt} did not reach the cluster")
                if run == 0:  # cells on the first cluster of each kind only
                    for _ in range(3):  # warm up
                        ip.run_cell_magic("distributed", "", "x = 1")
                    for _ in range(cells):
                        times[encrypt]["cell"].append(
                            _timed(lambda: ip.run_cell_magic("distributed", "", "x = 1")))
                    for _ in range(outputs):
                        with capture_output() as cap:
                            times[encrypt]["output"].append(
                                _timed(lambda: ip.run_cell_magic("distributed", "", MIB_CELL)))
                        if len(cap.stdout) < (1 << 20):
                            raise RuntimeError(f"the 1 MiB cell printed {len(cap.stdout)} chars")
            finally:
                with capture_output():
                    ip.run_line_magic("ring", "stop")
    return times


def bench_launcher(ip, n, starts):
    """Start times with gforker (the default on one host) and with Hydra's mpiexec."""
    from jupyter_ring.cluster import Machine
    from jupyter_ring.launch import find_mpiexec, local_mpiexec

    if local_mpiexec() == find_mpiexec():
        return None  # no gforker beside this mpiexec (not MPICH): nothing to compare
    ip.config.RingCluster.encrypt = True
    times = {"gforker": [], "hydra": []}
    # the one-host launcher is the plan's Machine.local_mpiexec: Hydra's mpiexec stands in for it
    default = Machine.__dict__["local_mpiexec"]
    try:
        for _ in range(starts):
            for name, launcher in (("gforker", local_mpiexec), ("hydra", find_mpiexec)):
                Machine.local_mpiexec = property(lambda self, launcher=launcher: launcher())
                with capture_output():
                    times[name].append(_timed(lambda: ip.run_line_magic("ring", f"start -n {n}")))
                    cmd = ip.magics_manager.registry["RingMagics"].cluster.ipp_cluster.config
                    ip.run_line_magic("ring", "stop")
                if cmd.MPIEngineSetLauncher.mpi_cmd != [launcher()]:
                    raise RuntimeError(f"the {name} run used {cmd.MPIEngineSetLauncher.mpi_cmd}")
    finally:
        Machine.local_mpiexec = default
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--starts", type=int, default=3, help="starts per setting (default 3)")
    parser.add_argument("--cells", type=int, default=50, help="trivial cells per setting (default 50)")
    parser.add_argument("--outputs", type=int, default=10, help="1 MiB cells per setting (default 10)")
    args = parser.parse_args(argv)
    if not os.environ.get("IPYTHONDIR"):
        os.environ["IPYTHONDIR"] = tempfile.mkdtemp(prefix="jupyter_ring_bench_")

    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "jupyter_ring")
    t = bench(ip, args.n, args.starts, args.cells, args.outputs)
    rows = [(f"start, {args.n} ranks (s, median of {args.starts})", "start", 1),
            (f"trivial cell (ms, median of {args.cells})", "cell", 1000),
            (f"1 MiB output cell (ms, median of {args.outputs})", "output", 1000)]
    print(f"{'measure':44} {'curve on':>10} {'curve off':>10} {'ratio':>7}")
    for label, key, scale in rows:
        on, off = (statistics.median(t[e][key]) * scale for e in (True, False))
        print(f"{label:44} {on:10.3f} {off:10.3f} {on / off:6.2f}x")
    launch = bench_launcher(ip, args.n, args.starts)
    if launch:
        g, h = (statistics.median(launch[k]) for k in ("gforker", "hydra"))
        print(f"{'launcher (curve on)':44} {'gforker':>10} {'hydra':>10} {'ratio':>7}")
        print(f"{f'start, {args.n} ranks (s, median of {args.starts})':44} {g:10.3f} {h:10.3f} "
              f"{g / h:6.2f}x")
        print("all starts (s): gforker", [round(x, 2) for x in launch["gforker"]],
              "hydra", [round(x, 2) for x in launch["hydra"]])
    print("all starts (s): curve on", [round(x, 2) for x in t[True]["start"]],
          "off", [round(x, 2) for x in t[False]["start"]])
    for key in ("cell", "output"):
        print(f"{key} quartiles (ms): curve on",
              [round(q * 1000, 1) for q in statistics.quantiles(t[True][key])],
              "off", [round(q * 1000, 1) for q in statistics.quantiles(t[False][key])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
