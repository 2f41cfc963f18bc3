"""The notebook as the world grows: %ring start, cells, output, errors, an interrupt, %ring where,
%ring stop.

    .venv/bin/python benchmarks/notebook_scale.py [--ranks 2,16,64] [--cells 20]
    .venv/bin/python benchmarks/notebook_scale.py --ranks 2,16,64 --trees /work/main,/work/wt-x --rounds 2

For each world size, in one IPython shell (the magics as a notebook kernel runs them, without the
kernel's messaging): ``%ring start -n N`` until every rank is ready; the median of ``--cells``
trivial cells (``x = 1`` through ``%%distributed``); a cell where every rank prints the same line
(checked: folded into one ``[ranks 0-N-1]`` line); a cell where rank N-1 raises while the others
wait for it in an allreduce (until the cell has failed; checked: the rank is named); a cell where
every rank raises; a cell of ``time.sleep(60)`` on every rank interrupted (SIGINT to this shell,
as the kernel's interrupt) after 1 s, timed from the SIGINT; ``%ring where``; ``%ring stop``,
then the seconds until no process of the cluster is left. A step whose check fails is marked
``!`` and its error printed below the table.

``--trees A,B``: each world size runs once per tree (its ``jupyter_ring`` on PYTHONPATH, this
script's steps), alternating tree by tree and ``--rounds`` times, each in a fresh shell: before
and after side by side under the same load.

Issue 33's targets: 16 ranks start <= 5 s, trivial cell <= 40 ms, a raise ends the cell <= 1.5 s,
stop <= 3 s; 64 ranks start <= 15 s, trivial cell <= 100 ms, %ring where <= 3 s; at 2 ranks the
trivial cell <= 10 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

COLUMNS = ("start s", "cell ms", "print all s", "raise one s", "raise all s", "interrupt s",
           "where s", "stop s", "gone s")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,8,16", help="world sizes, comma-separated")
    parser.add_argument("--cells", type=int, default=20, help="trivial cells per world size")
    parser.add_argument("--trees", default="", help="source trees to alternate (PYTHONPATH each), comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="with --trees: how many times to alternate")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one world, one row, as JSON
    return parser.parse_args()


RAISES = """import numpy as np
if ring.rank() == ring.size() - 1:
    raise ValueError("on purpose")
ring.allreduce(np.ones(3), name="waits")
"""


class Step:
    """One timed step; ``problems`` collects what a step's check found wrong."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def run(self, name: str, fn: Callable[[], object], expect: type[BaseException] | None = None,
            check: Callable[[str], str] = lambda text: "") -> float:
        """Seconds ``fn`` took, its output captured; a missing or unexpected error, or what
        ``check(output)`` says, is noted against ``name``."""
        out = io.StringIO()
        start = time.perf_counter()
        raised: BaseException | None = None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                fn()
            except BaseException as exc:  # the raising cells: their error is what is timed
                raised = exc
        took = time.perf_counter() - start
        text = out.getvalue() + ("" if raised is None else f"\n{type(raised).__name__}: {raised}")
        if expect is None and raised is not None:
            self.problems.append(f"{name}: {type(raised).__name__}: {str(raised)[:400]}")
        elif expect is not None and not isinstance(raised, expect):
            self.problems.append(f"{name}: expected {expect.__name__}, got {raised!r}"[:400])
        else:
            why = check(text)
            if why:
                self.problems.append(f"{name}: {why}")
        return took


def one_world(ip, n: int, cells: int) -> dict[str, float | list[str]]:  # type: ignore[no-untyped-def]
    """Every step at ``n`` ranks in the shell ``ip``; seconds (ms for the cell) by column."""
    import psutil

    from jupyter_ring.errors import CellInterrupted, DistributedError
    from jupyter_ring.widgets._tabs import FOLD_FROM

    step = Step()
    cell = lambda code: (lambda: ip.run_cell_magic("distributed", "", code))  # noqa: E731
    row: dict[str, float | list[str]] = {}
    row["start s"] = step.run("start", lambda: ip.run_line_magic("ring", f"start -n {n}"))
    procs = psutil.Process().children(recursive=True)
    step.run("warm cell", cell("x = 1"))
    row["cell ms"] = 1e3 * statistics.median(step.run("cell", cell("x = 1")) for _ in range(cells))
    folded = f"[ranks 0-{n - 1}] same line"
    row["print all s"] = step.run("print all", cell("print('same line')"), check=lambda text: (
        "" if (folded in text if n >= FOLD_FROM else text.count("same line") == n)
        else f"not every rank's line, folded: {text[-300:]!r}"))
    named = f"rank {n - 1}"
    row["raise one s"] = step.run("raise one", cell(RAISES), DistributedError, lambda text: (
        "" if named in text and "on purpose" in text else f"{named} not named: {text[-300:]!r}"))
    row["raise all s"] = step.run("raise all", cell("raise ValueError('everywhere')"), DistributedError)
    row["interrupt s"] = interrupted(step, cell("import time\ntime.sleep(60)"), CellInterrupted)
    step.run("after the interrupt", cell("x = 2"))
    row["where s"] = step.run("where", lambda: ip.run_line_magic("ring", "where"))
    row["stop s"] = step.run("stop", lambda: ip.run_line_magic("ring", "stop"))
    start = time.perf_counter()
    left = psutil.wait_procs(procs, timeout=30)[1]
    row["gone s"] = time.perf_counter() - start
    if left:
        step.problems.append(f"stop: {len(left)} processes left 30 s after %ring stop: "
                             + ", ".join(f"{p.pid} {' '.join(p.cmdline()[:4])}" for p in left[:5]))
    row["problems"] = step.problems
    return row


def interrupted(step: Step, fn: Callable[[], object], expect: type[BaseException]) -> float:
    """Seconds from a SIGINT to this shell (the kernel's interrupt), sent 1 s into ``fn``, to
    ``fn``'s end; a cell that ended before it is noted."""
    running, sent, ended = threading.Event(), [], []

    def send() -> None:
        if running.is_set():
            sent.append(time.perf_counter())
            os.kill(os.getpid(), signal.SIGINT)

    def run() -> None:
        running.set()
        try:
            fn()
        finally:
            running.clear()
            ended.append(time.perf_counter())

    timer = threading.Timer(1.0, send)
    timer.start()
    took = step.run("interrupt", run, expect)
    timer.cancel()
    timer.join()
    if not sent:
        step.problems.append(f"interrupt: the cell ended in {took:.2f} s, before the interrupt")
        return float("nan")
    return ended[0] - sent[0]


def run_here(ranks: list[int], cells: int) -> list[tuple[int, dict[str, float | list[str]]]]:
    """Every world size in this process's shell."""
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp())
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "jupyter_ring")
    return [(n, one_world(ip, n, cells)) for n in ranks]


def run_tree(tree: str, n: int, cells: int) -> dict[str, float | list[str]]:
    """One world size in a fresh shell that imports ``tree``'s jupyter_ring."""
    env = dict(os.environ, PYTHONPATH=tree, IPYTHONDIR=tempfile.mkdtemp())
    proc = subprocess.run([sys.executable, __file__, "--ranks", str(n), "--cells", str(cells), "--json"],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"problems": [f"exit {proc.returncode}: {proc.stderr[-600:]}"]}
    row: dict[str, float | list[str]] = json.loads(lines[-1])
    return row


def table(rows: list[tuple[str, int, dict[str, float | list[str]]]]) -> None:
    """The rows as a Markdown table, then their problems."""
    print("| tree | ranks | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    problems = []
    for tree, n, row in rows:
        cells = []
        if any(p.startswith("start:") for p in row.get("problems", [])):  # type: ignore[union-attr]
            print(f"| {tree} | {n} | failed | " + " | ".join("-" for _ in COLUMNS[1:]) + " |")
            problems += [f"{tree} {n}: {row['problems'][0]}"]  # type: ignore[index]
            continue
        for column in COLUMNS:
            value = row.get(column)
            flag = "!" if any(p.startswith(column.split(" s")[0].split(" ms")[0])
                              for p in row.get("problems", [])) else ""  # type: ignore[union-attr]
            cells.append("-" if not isinstance(value, float) or value != value else
                         f"{value:.0f}{flag}" if column == "cell ms" else f"{value:.2f}{flag}")
        print(f"| {tree} | {n} | " + " | ".join(cells) + " |", flush=True)
        problems += [f"{tree} {n}: {p}" for p in row.get("problems", [])]  # type: ignore[union-attr]
    for p in problems:
        print(f"! {p}")


def main() -> None:
    args = parse()
    ranks = [int(r) for r in args.ranks.split(",")]
    if args.json:
        for _, row in run_here(ranks, args.cells):
            print(json.dumps(row), flush=True)
        return
    print(f"# {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} at start, {time.strftime('%H:%M')} UTC\n")
    rows = []
    if args.trees:
        for round_ in range(args.rounds):
            for n in ranks:
                trees = args.trees.split(",")
                for tree in trees if round_ % 2 == 0 else trees[::-1]:
                    row = run_tree(tree, n, args.cells)
                    rows.append((os.path.basename(tree.rstrip("/")), n, row))
                    print(f"# {rows[-1][0]} {n}: load {os.getloadavg()[0]:.1f} {time.strftime('%H:%M:%S')} "
                          + json.dumps(row), flush=True)
    else:
        rows = [("", n, row) for n, row in run_here(ranks, args.cells)]
    table(rows)
    print(f"\n# load {os.getloadavg()[0]:.2f} at the end, {time.strftime('%H:%M')} UTC")


if __name__ == "__main__":
    main()
