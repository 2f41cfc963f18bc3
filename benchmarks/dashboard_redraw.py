"""CPU cost of redrawing the live dashboard in the notebook: rows alone, rows and chart.

Usage: python benchmarks/dashboard_redraw.py [--ranks 2] [--points 30000] [--repeat 5]

A ``Dashboard`` (no display) over a state holding ``--points`` logged losses per rank (the chart
draws its ≤ 500-point decimation of them); each redraw is timed in CPU time (``process_time``,
so other load on the machine inflates it less than wall time would), median of 300 redraws,
median of ``--repeat`` rounds. Then what a second of training costs the notebook at 5 row redraws
a second with the chart redrawn every 1, 0.5 or 0.2 s (``LiveDashboard(chart_interval=...)``).

To compare two trees, run the same command with ``PYTHONPATH=<other tree>`` in alternation.
"""

import argparse
import math
import statistics
import sys
import time


def _state(ranks, points):
    from jupyter_ring.widgets._state import DashboardState

    state = DashboardState(ranks)
    for rank in range(ranks):
        history = [(1 + i, 100 + i * 0.01, {"loss": 0.69 * math.exp(-i / (points / 10)) + 0.003})
                   for i in range(points)]
        state.ingest(rank, {"rank": rank, "step": points, "total": 2 * points, "history": history,
                            "time": 200.0})
    return state


def _redraw_ms(dashboard, chart, n=300):
    state = dashboard.state
    times = []
    for _ in range(n):
        state.version += 1  # as after an ingest: something to redraw
        t0 = time.process_time()
        dashboard.refresh(chart=chart)
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--points", type=int, default=30000, help="losses logged per rank (default 30000)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    args = parser.parse_args(argv)
    import jupyter_ring
    from jupyter_ring.widgets import Dashboard

    dashboard = Dashboard(state=_state(args.ranks, args.points))
    rows, full = [], []
    for _ in range(args.repeat):
        rows.append(_redraw_ms(dashboard, chart=False))
        full.append(_redraw_ms(dashboard, chart=True))
    r, f = statistics.median(rows), statistics.median(full)
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[0]
    print(f"jupyter_ring from {jupyter_ring.__file__.rsplit('/', 2)[0]}; {args.ranks} ranks x "
          f"{args.points} points; load average {load}")
    print("| redraw | CPU per redraw (ms, median) |")
    print("|---|---|")
    print(f"| rows only | {r:.3f} |")
    print(f"| rows and chart | {f:.3f} |")
    print("| chart redrawn every | notebook CPU per second of training (rows 5/s) | share of a core |")
    print("|---|---|---|")
    for interval in (1.0, 0.5, 0.2):
        charts = min(5.0, 1 / interval)
        per_second = charts * f + (5 - charts) * r
        print(f"| {interval:g} s | {per_second:.1f} ms | {per_second / 10:.2f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
