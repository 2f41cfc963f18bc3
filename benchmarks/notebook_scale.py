"""The notebook as the world grows: %ring start, a trivial cell, a raise, %ring where, %ring stop.

    .venv/bin/python benchmarks/notebook_scale.py [--ranks 2,8,16] [--cells 20]

For each world size, in one IPython shell (the magics as a notebook kernel runs them, without the
kernel's messaging): ``%ring start -n N`` until every rank is ready; the median of ``--cells``
trivial cells (``x = 1`` through ``%%distributed``); a cell where rank N-1 raises while the
others wait for it in an allreduce (until the cell has failed); ``%ring where``; ``%ring stop``.
Issue 33's targets: 16 ranks start <= 5 s, trivial cell <= 40 ms, a raise ends the cell <= 1.5 s,
stop <= 3 s; at 2 ranks the trivial cell <= 10 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,8,16", help="world sizes, comma-separated")
    parser.add_argument("--cells", type=int, default=20, help="trivial cells per world size")
    return parser.parse_args()


RAISES = """import numpy as np
if ring.rank() == ring.size() - 1:
    raise ValueError("on purpose")
ring.allreduce(np.ones(3), name="waits")
"""


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            fn()
        except Exception:  # the raising cell: its error is what is timed
            pass
    return time.perf_counter() - start


def main() -> None:
    args = parse()
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp())
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "jupyter_ring")
    print(f"# {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} at start, {time.strftime('%H:%M')} UTC\n")
    print("| ranks | start s | trivial cell ms (median) | raise ends the cell s | %ring where s | stop s |")
    print("|---|---|---|---|---|---|")
    for n in [int(r) for r in args.ranks.split(",")]:
        start = timed(lambda: ip.run_line_magic("ring", f"start -n {n}"))
        timed(lambda: ip.run_cell_magic("distributed", "", "x = 1"))  # warm
        cells = [timed(lambda: ip.run_cell_magic("distributed", "", "x = 1")) for _ in range(args.cells)]
        raised = timed(lambda: ip.run_cell_magic("distributed", "", RAISES))
        where = timed(lambda: ip.run_line_magic("ring", "where"))
        stop = timed(lambda: ip.run_line_magic("ring", "stop"))
        print(f"| {n} | {start:.1f} | {statistics.median(cells) * 1e3:.0f} | {raised:.2f} | {where:.2f} | "
              f"{stop:.2f} |", flush=True)
    print(f"\n# load {os.getloadavg()[0]:.2f} at the end, {time.strftime('%H:%M')} UTC")


if __name__ == "__main__":
    main()
