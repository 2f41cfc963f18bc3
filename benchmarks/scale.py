"""``%ring scale``: how long growing a live cluster 2 -> 4 and shrinking it 4 -> 2 take (issue 34,
item 3), beside what the resize spares: ``%ring stop`` then ``%ring start -n 4`` (every variable lost).

    .venv/bin/python benchmarks/scale.py [--repeats 3] [--low 2] [--high 4]

Through a real notebook kernel (tests/real_kernel.py): a cluster of ``--low`` ranks with a variable
on each; then, ``--repeats`` times, interleaved: ``%ring scale HIGH``, ``%ring scale LOW``, and a
``%ring stop`` + ``%ring start -n HIGH`` + ``%ring stop`` + ``%ring start -n LOW`` for reference.
Each figure is the notebook's wall time of the magic (what a user waits), and the scale's own
figure (the "in X s" of its note). After every resize an allreduce of random data of a prime
length is checked exact on every rank, and the ranks that stayed still hold their variable. The
machine's load average is printed before and after.
"""

import argparse
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--low", type=int, default=2)
    p.add_argument("--high", type=int, default=4)
    return p.parse_args()


def timed(kernel, line: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = kernel.ok(line, timeout=180)
    return time.perf_counter() - t0, out


def main() -> None:
    args = parse()
    from real_kernel import ring_kernel
    from reliability.test_scale_notebook import exact

    print(f"load average before: {os.getloadavg()}", flush=True)
    wall: dict[str, list[float]] = {"grow": [], "shrink": [], "stop+start high": [], "stop+start low": []}
    own: dict[str, list[float]] = {"grow": [], "shrink": []}
    with ring_kernel(args.low) as kernel:
        keep = "%%distributed\nimport numpy as np\nkept = ring.rank()"
        kernel.ok(keep)
        for i in range(args.repeats):
            for name, size in (("grow", args.high), ("shrink", args.low)):
                seconds, out = timed(kernel, f"%ring scale {size}")
                wall[name].append(seconds)
                own[name].append(float(re.search(r" in ([\d.]+) s:", out).group(1)))
                has = exact(kernel, size, f"{name}{i}")
                assert all(has[r] for r in range(min(args.low, size))), has
                print(f"{name} -> {size}: {seconds:.2f} s (the note: {own[name][-1]:.1f} s)", flush=True)
            for name, size in (("stop+start high", args.high), ("stop+start low", args.low)):
                t0 = time.perf_counter()
                kernel.ok("%ring stop", timeout=60)
                kernel.ok(f"%ring start -n {size}", timeout=180)
                wall[name].append(time.perf_counter() - t0)
                print(f"{name}: {wall[name][-1]:.2f} s", flush=True)
            kernel.ok(keep)
    print(f"load average after: {os.getloadavg()}")
    for name, values in wall.items():
        print(f"{name}: median {statistics.median(values):.2f} s of {len(values)} "
              f"({', '.join(f'{v:.2f}' for v in values)})")
    for name, values in own.items():
        print(f"{name} (the note's figure): median {statistics.median(values):.2f} s")


if __name__ == "__main__":
    main()
