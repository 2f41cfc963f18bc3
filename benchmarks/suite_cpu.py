"""Where the test suite's CPU goes, by module (issue 32, item 5).

Run the suite with ``JUPYTER_RING_TEST_CPU=/tmp/cpu.jsonl bash scripts/test.sh`` (tests/conftest.py
appends a line a test: wall seconds, the worker's CPU and its reaped children's), then
``python benchmarks/suite_cpu.py /tmp/cpu.jsonl [--top N]``: modules by CPU seconds (the worker's
and its children's: kernels, clusters, MPI jobs, browsers), with their wall seconds and tests.
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
