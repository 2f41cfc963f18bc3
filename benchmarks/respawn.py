"""A rank SIGKILLed: time until the next cell runs on the full world, replaced in place vs restart.

    .venv/bin/python benchmarks/respawn.py [--ranks 2,3] [--repeats 3]

Through a real notebook kernel (tests/real_kernel.py), one kernel per way, each with a cluster
of N ranks: a cell of allreduces runs, rank N-1's engine is SIGKILLed 1.5 s into it, and the
clock runs from the kill until a following cell has run an allreduce on every rank:

- ``respawn`` (the default, ``--max-restarts``): the cell fails with DeadRankError once the rank
  has been replaced; the next cell runs at once, and the survivors' variable ``kept`` is checked;
- ``restart`` (``--max-restarts 0``, the old way): the cell fails with DeadRankError (MPI ends
  every rank), then ``%ring restart`` (every variable lost), then the cell.

The two ways alternate repeat by repeat; the machine's load average is printed before and after.
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,3", help="world sizes, comma-separated (default 2,3)")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


LOOP = "%%distributed\nimport numpy as np\nfor step in range(10**9):\n    ring.allreduce(np.ones(1000), name='t')"
CHECK = ("%%distributed\nimport numpy as np\nv = ring.allreduce(np.ones(7) * (ring.rank() + 1), op=ring.Sum, name='c')\n"
         "print(v[0] == ring.size() * (ring.size() + 1) / 2, 'kept' in dir())")


def one_kill(kernel, n: int, way: str) -> float:
    """Seconds from the kill of rank n-1 to a cell that ran on every rank."""
    import json

    from real_kernel import sigkill_during

    kernel.ok("%%distributed\nkept = ring.rank()")
    rows = json.loads(kernel.ok("import json\nprint(json.dumps(get_ipython().magics_manager"
                                ".registry['RingMagics'].cluster.ranks))").strip().splitlines()[-1])
    _, error, killed = sigkill_during(kernel, rows[n - 1]["pid"], LOOP)
    if error is None or error["ename"] != "DeadRankError":
        raise SystemExit(f"{way}: the cell did not fail with DeadRankError: {error}")
    if way == "restart":
        kernel.ok("%ring restart", timeout=180)
    out, error = kernel.execute(CHECK)
    took = time.monotonic() - killed
    if error is not None:
        logs, _ = kernel.execute("c = get_ipython().magics_manager.registry['RingMagics'].cluster\n"
                                 "for es in c._running_cluster.engines.values():\n"
                                 "    print(open(es.output_file, errors='replace').read()[-4000:])")
        print(logs, file=sys.stderr)
        raise SystemExit(f"{way}, {n} ranks: the cell after the kill failed: {error['ename']}: "
                         f"{error['evalue']}\n{out}")
    said = {int(line[6:].split("]", 1)[0]): line.split("] ", 1)[1]
            for line in out.splitlines() if line.startswith("[rank ")}
    lines = [said.get(r) for r in range(n)]
    want = ["True True"] * (n - 1) + ["True False"] if way == "respawn" else ["True False"] * n
    if lines != want:
        raise SystemExit(f"{way}: after the kill the ranks said {lines}, not {want}")
    return took


def main() -> None:
    from real_kernel import ring_kernel

    args = parse()
    print(f"load average before: {open('/proc/loadavg').read().split()[0]}, {os.cpu_count()} cores")
    for n in (int(x) for x in args.ranks.split(",")):
        times: dict[str, list[float]] = {"respawn": [], "restart": []}
        starts = {"respawn": f"%ring start -n {n} --max-restarts {args.repeats}",
                  "restart": f"%ring start -n {n} --max-restarts 0"}
        kernels = {way: ring_kernel(start=line) for way, line in starts.items()}
        entered = {way: k.__enter__() for way, k in kernels.items()}
        try:
            for _ in range(args.repeats):
                for way in ("respawn", "restart"):
                    times[way].append(one_kill(entered[way], n, way))
                    print(f"  {n} ranks, {way}: {times[way][-1]:.2f} s", flush=True)
        finally:
            for k in kernels.values():
                k.__exit__(None, None, None)
        for way, ts in times.items():
            print(f"{n} ranks, {way}: kill -> next cell ran on every rank: median {statistics.median(ts):.2f} s, "
                  f"max {max(ts):.2f} s (each: {', '.join(f'{t:.2f}' for t in ts)})")
    print(f"load average after: {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
