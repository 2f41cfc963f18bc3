"""The parts of a blocking 4 KiB allreduce_ on its prepared lane, each timed alone (one rank).

    cd /tmp && PYTHONPATH=TREE .venv/bin/mpiexec -n 1 .venv/bin/python TREE/benchmarks/hotpath_parts.py

``timeit`` with ``time.thread_time`` (CPU of the calling thread: steadier than wall time on a
loaded machine), best of 9 repeats of 100,000 calls, in ns a call. The whole call, then the
frames it runs through (``_api._blocking``, ``Engine.run_lane``, ``Lane.run``), then the pieces
the lane path calls on the way: where a change of the call's cost lies (hotpath.py measures the
whole call, tree against tree). Internal names of this tree: an older tree needs its own names.
"""

import threading
import time
import timeit

import numpy as np

import jupyter_ring.runtime as ring
from jupyter_ring.runtime import _api
from jupyter_ring.runtime._engine import algorithms


def main() -> None:
    ring.init()
    small = np.ones(1024, np.float32)

    def call() -> None:
        ring.allreduce_(small, op=ring.Max, name="b")

    call()
    call()  # the second call runs on the lane the first left
    engine = _api._proc.engine
    rt = engine.rt
    lane = engine.lanes[("b", True)]
    names = {"ring": ring, "_api": _api, "algorithms": algorithms, "engine": engine, "rt": rt, "lane": lane,
             "small": small, "call": call, "lock": threading.Lock()}
    parts = {  # statements, timed as written (no wrapper call counted)
        "whole allreduce_ 4 KiB": "call()",
        "_api._blocking": "_api._blocking(small, True, None, 'b', ring.Max, 1.0, 1.0, None)",
        "Engine.run_lane": "engine.run_lane(lane, _api._lane_entry, small, True, 'b', 'b')",
        "Lane.run": "lane.run(rt, small, True, 'b', 'b')",
        "algorithms.eager_limit(rt) (the full way asks it)": "algorithms.eager_limit(rt)",
        "trace.record": "rt.trace.record('allreduce', 'b', 4096, 1.0, 2.0, {}, 'eager')",
        "executor lock take + give_back": "engine.lock.take(); engine.lock.give_back()",
        "plain threading.Lock acquire + release": "lock.acquire(False); lock.release()",
        "recovery.due()": "rt.recovery.due()",
        "Runtime.finished()": "rt.finished()",
        "Lane.fits": "lane.fits(small, ring.Max, None, 1.0, 1.0)",
    }
    print(f"1 rank, CPU ns a call, best of 9 x 100,000 (load average {open('/proc/loadavg').read().split()[0]})")
    for label, stmt in parts.items():
        best = min(timeit.repeat(stmt, globals=names, number=100_000, repeat=9, timer=time.thread_time)) / 100_000
        print(f"| {label} | {best * 1e9:.0f} |")
    ring.shutdown()


if __name__ == "__main__":
    main()
