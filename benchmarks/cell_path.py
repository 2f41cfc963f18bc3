"""The %%distributed cell path before and after issue 20, in one kernel on one cluster, alternated.

Usage: python benchmarks/cell_path.py --base /tmp/base [--rounds 8]

``--base``: a tree from before issue 20 (its ``jupyter_ring/magics.py`` has ``_CellRun``, which
polled ``AsyncResult._children/_metadata`` every 20 ms), e.g.
``git worktree add --detach /tmp/base 209c4b5``. One real kernel (jupyter_client) runs
``%ring start -n 2`` with this tree, loads the base tree's magics beside it under another package
name, and runs each cell through the old ``_CellRun`` or this tree's ``_cell.CellRun`` on the
same cluster with the same sink, alternating, so the machine's load hits both alike. Each round:
5 trivial cells (``x = 1``) and one cell printing 1 MB per rank, each way; timed from
``execute_request`` to the kernel's idle, the output counted. Prints medians and new/old ratios.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import BIG_CELL, BIG_LINE, BIG_LINES, Kernel, _close, _count_ys  # noqa: E402

SETUP = '''\
import importlib.util, sys
_spec = importlib.util.spec_from_file_location(
    "jr_base", {init!r}, submodule_search_locations=[{package!r}])
_jr_base = importlib.util.module_from_spec(_spec)
sys.modules["jr_base"] = _jr_base
_spec.loader.exec_module(_jr_base)
import jr_base.magics as _old
from jupyter_ring._cell import CellRun as _New
from IPython.core.magic_arguments import parse_argstring as _parse
_m = get_ipython().magics_manager.registry["RingMagics"]
_m.poll_interval = 0.02   # the old loop's trait, gone from RingMagics
def _run(which, code):
    args = _parse(_m.distributed, "")
    ranks = list(range(_m.cluster.size))
    run = _old._CellRun if which == "old" else _New
    return run(_m, _m.cluster, ranks, code, args, _m.cells.sink(ranks, args)).run()
'''


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="a tree from before issue 20")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, alternating (8)")
    args = parser.parse_args(argv)
    package = os.path.join(os.path.abspath(args.base), "jupyter_ring")
    workdir = tempfile.mkdtemp(prefix="jupyter_ring_cellpath_")
    kernel = Kernel.start(sys.executable, env={"IPYTHONDIR": os.path.join(workdir, "ipython")})
    times = {"old": {"x": [], "big": []}, "new": {"x": [], "big": []}}
    try:
        kernel.ok("%load_ext jupyter_ring")
        kernel.ok("%ring start -n 2", timeout=180)
        kernel.ok(SETUP.format(init=os.path.join(package, "__init__.py"), package=package))
        for which in ("old", "new"):  # warm up both
            for _ in range(3):
                kernel.ok(f"_run({which!r}, 'x = 1')")
        load = [os.getloadavg()[0]]
        for i in range(args.rounds):
            for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
                for _ in range(5):
                    times[which]["x"].append(kernel.ok(f"_run({which!r}, 'x = 1')")[0])
                took, text = kernel.ok(f"_run({which!r}, {BIG_CELL!r})", timeout=300)
                if _count_ys(text) != 2 * BIG_LINES * BIG_LINE:
                    raise RuntimeError(f"{which}: {_count_ys(text)} bytes of the 1 MB cells arrived")
                times[which]["big"].append(took)
        load.append(os.getloadavg()[0])
    finally:
        _close(kernel)
    print(f"{'median':24} {'old':>9} {'new':>9} {'new/old':>8}")
    for kind, label, scale in (("x", "trivial cell (ms)", 1000), ("big", "1 MB/rank cell (s)", 1)):
        old, new = statistics.median(times["old"][kind]), statistics.median(times["new"][kind])
        print(f"{label:24} {old * scale:9.3f} {new * scale:9.3f} {new / old:8.2f}"
              f"   (n = {len(times['old'][kind])} each)")
    print(f"load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
