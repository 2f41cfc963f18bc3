"""Where the test suite's CPU goes, by module (issue 32, item 5).

Run the suite with ``JUPYTER_RING_TEST_CPU=/tmp/cpu.jsonl bash scripts/test.sh`` (tests/conftest.py
appends a line a test: wall seconds, the worker's CPU and its reaped children's), then
``python benchmarks/suite_cpu.py /tmp/cpu.jsonl [--top N]``: modules by CPU seconds (the worker's
and its children's: kernels, clusters, MPI jobs, browsers), with their wall seconds and tests;
``--schedule``: each xdist worker's run instead, module by module in time order (from each test's
worker and end), with when each stretch began and ended and its CPU.
On two full cores the suite's wall time is about its CPU over two: the modules at the top are
where a saving shortens the suite.
"""

import argparse
import collections
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the JSON lines JUPYTER_RING_TEST_CPU wrote")
    parser.add_argument("--top", type=int, default=30, help="modules to list (default 30)")
    parser.add_argument("--schedule", action="store_true",
                        help="each worker's modules in time order (start, end, wall, CPU) instead")
    args = parser.parse_args()
    if args.schedule:
        schedule(args.log)
        return
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    with open(args.log) as log:
        for line in log:
            rec = json.loads(line)
            module = rec["test"].split("::")[0]
            row = rows[module]
            row[0] += rec["self"] + rec["children"]
            row[1] += rec["children"]
            row[2] += rec["wall"]
            row[3] += 1
    total = sum(r[0] for r in rows.values())
    print(f"{'module':60} {'CPU s':>8} {'of it children':>14} {'wall s':>8} {'tests':>5}")
    for module, (cpu, kids, wall, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{module:60} {cpu:8.1f} {kids:14.1f} {wall:8.1f} {int(n):5d}")
    print(f"{'all ' + str(len(rows)) + ' modules':60} {total:8.1f} {'':14} "
          f"{sum(r[2] for r in rows.values()):8.1f} {sum(int(r[3]) for r in rows.values()):5d}")


def schedule(path: str, least_wall: float = 5.0) -> None:
    """Each worker's tests in time order, folded into stretches of one module (those of at least
    ``least_wall`` seconds listed): where each worker was when, and how much CPU it drew."""
    with open(path) as log:
        recs = [json.loads(line) for line in log]
    t0 = min(rec["end"] - rec["wall"] for rec in recs)
    workers: dict[str, list[dict]] = collections.defaultdict(list)
    for rec in recs:
        workers[rec.get("worker", "")].append(rec)
    for worker, runs in sorted(workers.items()):
        runs.sort(key=lambda rec: rec["end"])
        print(f"worker {worker or '(one process)'}: {len(runs)} tests, its last ended at "
              f"{runs[-1]['end'] - t0:.0f} s, {sum(rec['wall'] for rec in runs):.0f} s of tests")
        stretches: list[list] = []  # [module, start, end, wall, cpu]
        for rec in runs:
            module, cpu = rec["test"].split("::")[0], rec["self"] + rec["children"]
            if stretches and stretches[-1][0] == module:
                stretches[-1][2:] = [rec["end"] - t0, stretches[-1][3] + rec["wall"], stretches[-1][4] + cpu]
            else:
                stretches.append([module, rec["end"] - rec["wall"] - t0, rec["end"] - t0, rec["wall"], cpu])
        for module, start, end, wall, cpu in stretches:
            if wall >= least_wall:
                print(f"  {start:6.0f}-{end:6.0f} s  wall {wall:6.1f}  CPU {cpu:6.1f}  {module}")


if __name__ == "__main__":
    main()
