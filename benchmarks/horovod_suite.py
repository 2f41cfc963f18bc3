"""Horovod's own test suite run against jupyter_ring's adapters: pass/fail/skip per test.

    python benchmarks/horovod_suite.py /path/to/horovod-checkout [--suite torch tensorflow ...]
                                       [-n 2] [-k SUBSTRING] [--jobs 1] [--json out.json]
                                       [--rerun-failed previous.json]

The checkout is a clone of horovod/horovod (0.28); this script fetches nothing. It writes a tiny
``horovod`` package into a temporary folder whose ``horovod.torch``, ``horovod.tensorflow``,
``horovod.tensorflow.keras`` and ``horovod.keras`` re-export ``jupyter_ring.runtime.torch``,
``.tensorflow`` and ``.keras``, plus the two test helpers the suites import from Horovod's
internals (``horovod.common.util.is_version_greater_equal_than``,
``horovod.runner.util.threads.in_thread``). Then each test of ``test/parallel/test_<suite>.py``
runs alone under ``mpiexec -n 2 python -m pytest <test>`` (``test/single/test_torch_elastic.py``
on 1 rank, as Horovod runs it) with stdin from /dev/null; every rank
writes its own JUnit report and a test passes only when every rank passed it (a rank's error,
or a report with no test case in it, fails it). An item pytest cannot even collect (a module that
stops at its imports) is a row of its own category, ``error``: counted among the non-GPU tests,
never as a pass.

A test counts as needing a GPU when its name says gpu/cuda or its skip reason does; the figure
that matters is ``passed / (tests - GPU tests)``. Prints one markdown table per suite and a
summary; needs the test extras of Horovod's suite (``pip install 'jupyter_ring[horovod-suite]'``).
"""

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SUITES = ("torch", "tensorflow", "keras", "tensorflow2_keras", "torch_elastic")
# suites of Horovod's test/single (the rest are test/parallel's): Horovod runs them in one
# process, without mpirun, so they run on 1 rank whatever -n says
SINGLE = {"torch_elastic"}

# The alias package: module name -> source. Horovod's test helpers are small re-implementations,
# not Horovod's code.
_FORWARD = """import {impl} as _impl
from {impl} import *  # noqa: F401,F403
from {impl} import __all__  # noqa: F401


def __getattr__(name):
    # private names the tests reach for (hvd._executing_eagerly, ...) come from the module itself
    return getattr(_impl, name)
"""
ALIAS = {
    "horovod/__init__.py": "__version__ = '0.28.1'\n",
    "horovod/torch/__init__.py": _FORWARD.format(impl="jupyter_ring.runtime.torch"),
    "horovod/tensorflow/__init__.py": _FORWARD.format(impl="jupyter_ring.runtime.tensorflow")
    + "from . import util  # noqa: E402,F401 - hvd.util._executing_eagerly\n",
    "horovod/tensorflow/util.py": "from jupyter_ring.runtime.tensorflow import _executing_eagerly  # noqa: F401\n",
    "horovod/tensorflow/keras/__init__.py": _FORWARD.format(impl="jupyter_ring.runtime.keras"),
    "horovod/keras/__init__.py": _FORWARD.format(impl="jupyter_ring.runtime.keras"),
    "horovod/common/__init__.py": "",
    "horovod/common/util.py": (
        "from packaging import version\n\n\n"
        "def is_version_greater_equal_than(ver, target):\n"
        "    return version.parse(ver) >= version.parse(target)\n"),
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    "horovod/runner/util/threads.py": (
        "import threading\n\n\n"
        "def in_thread(target, args=(), name=None, daemon=True, silent=False):\n"
        "    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)\n"
        "    thread.start()\n"
        "    return thread\n"),
}
_GPU = re.compile(r"gpu|cuda|nccl", re.I)
# "error": an item pytest could not even collect (a module that stops at its imports); it counts
# among the non-GPU tests and never as a pass
RESULTS = ("pass", "fail", "error", "skip")


def write_alias(folder):
    for rel, text in ALIAS.items():
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)


def child_env(alias, home):
    from jupyter_ring.launch import mpi_env

    env = mpi_env()
    env.update(PYTHONPATH=os.pathsep.join([alias, os.path.dirname(HERE)]), PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", HOME=home, KERAS_HOME=home,
               XDG_CACHE_HOME=os.path.join(home, "cache"), OMP_NUM_THREADS="1",
               HOROVOD_DYNAMIC_PROCESS_SETS="1")
    return env


class Collected(NamedTuple):
    """What pytest found in one module: runnable test ids, and the items it could not collect."""

    tests: list
    errors: list  # rows (result "error") for items whose collection raised: failures, never passes


def collect(path, env, workdir):
    """The test ids of one module, and a row per collection error (pytest --collect-only, one process)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-c", os.path.join(workdir, "pytest.ini"), "--rootdir", os.path.dirname(path), path],
                         capture_output=True, text=True, env=env, cwd=os.path.dirname(path),
                         stdin=subprocess.DEVNULL)
    ids, errors = [], []
    # the traceback's "E   <exception>" lines: the short summary cuts its messages with "..."
    raised = [line[1:].strip() for line in out.stdout.splitlines() if line.startswith("E ")]
    for line in out.stdout.splitlines():
        # "ERROR test_x.py::Class - AttributeError: ..." (the short summary of a collection error)
        failed = re.match(r"ERROR (\S+?)(?: - (.*))?$", line)
        if failed:
            node, message = failed.group(1), failed.group(2) or "collection error"
            if message.endswith("..."):
                message = next((text for text in raised if text.startswith(message[:-3])), message)
            errors.append({"test": node.split("::", 1)[-1], "result": "error", "gpu": False, "seconds": 0.0,
                           "reason": _first_line(f"collection error: {message}")})
        elif "::" in line and not line.startswith(("ERROR", "FAILED")):
            ids.append(line.split("::", 1)[1])
    if not ids and not errors:
        raise SystemExit(f"no tests collected from {path}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return Collected(ids, errors)


def _reports(folder, n):
    """rank -> (outcome, message) from each rank's JUnit file (None where a rank wrote none)."""
    found = {}
    for r in range(n):
        path = os.path.join(folder, f"rank{r}.xml")
        if not os.path.exists(path):
            found[r] = None
            continue
        try:
            case = ET.parse(path).getroot().find(".//testcase")
        except ET.ParseError:
            found[r] = None
            continue
        if case is None:
            found[r] = ("error", "no test case ran")
            continue
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (node.get("message") or node.text or "").strip()
                break
        found[r] = (outcome, message)
    return found


def _first_line(text, limit=220):
    text = re.sub(r"\s+", " ", text.strip())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def run_one(path, test, n, env, timeout, workdir):
    from jupyter_ring.launch import find_mpiexec

    folder = tempfile.mkdtemp(prefix="case_", dir=workdir)
    script = (f'exec "{sys.executable}" -m pytest -q -p no:cacheprovider -c "{workdir}/pytest.ini" '
              f'--rootdir "{os.path.dirname(path)}" --junitxml="{folder}/rank$PMI_RANK.xml" '
              f'"{path}::{test}"')
    cmd = [find_mpiexec(), "-n", str(n), "sh", "-c", script]
    load = os.getloadavg()[0]  # the machine's load as the test starts (other work distorts timings)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=os.path.dirname(path), stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        timed_out = True
    seconds = time.perf_counter() - start
    reports = _reports(folder, n)
    outcomes = {r: rep[0] for r, rep in reports.items() if rep is not None}
    # anything but passed or skipped (a failure, an error, a report with no test case) is a failure
    failed = sorted(r for r, o in outcomes.items() if o not in ("passed", "skipped"))
    silent = sorted(r for r, rep in reports.items() if rep is None)
    if failed:
        verdict, reason = "fail", f"rank {failed[0]}: {_first_line(reports[failed[0]][1])}"
    elif silent:
        tail = _first_line(output[-400:]) if output else ""
        verdict = "fail"
        reason = (f"timed out after {timeout} s" if timed_out else f"rank(s) {silent} wrote no report") + \
                  (f" ({tail})" if tail else "")
    elif all(o == "skipped" for o in outcomes.values()):
        verdict, reason = "skip", _first_line(reports[0][1])
    elif any(o == "skipped" for o in outcomes.values()):
        skipped = sorted(r for r, o in outcomes.items() if o == "skipped")
        verdict, reason = "pass", f"skipped on rank(s) {skipped}: {_first_line(reports[skipped[0]][1])}"
    else:
        verdict, reason = "pass", ""
    gpu = bool(_GPU.search(test)) or (verdict == "skip" and bool(_GPU.search(reason)))
    return {"test": test, "result": verdict, "reason": reason, "gpu": gpu, "seconds": round(seconds, 1),
            "load": round(load, 2)}


def table(suite, rows):
    lines = [f"### test_{suite}.py", "", "| test | result | reason |", "|---|---|---|"]
    for row in rows:
        mark = row["result"] + (" (GPU)" if row["gpu"] else "")
        lines.append(f"| {row['test'].split('::')[-1]} | {mark} | {row['reason'].replace('|', '/')} |")
    return "\n".join(lines)


def summary(suite, rows):
    count = {k: sum(1 for r in rows if r["result"] == k) for k in RESULTS}
    cpu = [r for r in rows if not r["gpu"]]
    cpu_pass = sum(1 for r in cpu if r["result"] == "pass")
    share = f"{100.0 * cpu_pass / len(cpu):.1f} %" if cpu else "-"
    return (f"| test_{suite}.py | {len(rows)} | {count['pass']} | {count['fail']} | {count['error']} | "
            f"{count['skip']} | {len(rows) - len(cpu)} | {cpu_pass} / {len(cpu)} = {share} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", help="a clone of horovod/horovod (its test/parallel folder is used)")
    p.add_argument("--suite", nargs="+", choices=SUITES, default=list(SUITES))
    p.add_argument("-n", type=int, default=2, help="ranks per test (default 2)")
    p.add_argument("-k", default=None, help="run only tests whose name contains this")
    p.add_argument("--jobs", type=int, default=1, help="tests run at once (default 1)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per test (default 300)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--rerun-failed", default=None, metavar="JSON",
                   help="a previous --json: run only the tests that failed there, keep its other rows")
    args = p.parse_args()
    tests_dir = os.path.join(os.path.abspath(args.checkout), "test", "parallel")
    if not os.path.isdir(tests_dir):
        raise SystemExit(f"{args.checkout} has no test/parallel folder; pass a clone of horovod/horovod")
    if set(args.suite) & set(SINGLE) and not os.path.isdir(os.path.join(os.path.dirname(tests_dir), "single")):
        raise SystemExit(f"{args.checkout} has no test/single folder (suites {sorted(set(args.suite) & set(SINGLE))}); "
                         "pass a clone of horovod/horovod")
    for module in ("parameterized", "mock", "cloudpickle", "packaging", "pytest"):
        try:
            __import__(module)
        except ImportError:
            raise SystemExit(f"Horovod's tests import {module}: pip install 'jupyter_ring[horovod-suite]'") from None
    workdir = tempfile.mkdtemp(prefix="horovod_suite_")
    try:
        run_suites(args, tests_dir, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_suites(args, tests_dir, workdir):
    """Run every chosen suite's tests in ``workdir``; print the tables, the summary and the load."""
    with open(os.path.join(workdir, "pytest.ini"), "w") as fh:
        fh.write("[pytest]\n")
    alias, home = os.path.join(workdir, "alias"), os.path.join(workdir, "home")
    os.makedirs(home)
    write_alias(alias)
    env = child_env(alias, home)
    previous = json.load(open(args.rerun_failed)) if args.rerun_failed else {}
    results = {}
    for suite in args.suite:
        folder = os.path.join(os.path.dirname(tests_dir), "single") if suite in SINGLE else tests_dir
        path = os.path.join(folder, f"test_{suite}.py")
        ranks = 1 if suite in SINGLE else args.n
        found = collect(path, env, workdir)
        tests = [t for t in found.tests if args.k is None or args.k in t]
        errors = [row for row in found.errors if args.k is None or args.k in row["test"]]
        kept = {}
        if suite in previous:
            # passes and skips stay; so do failures that -k leaves out (the table stays whole)
            kept = {row["test"]: row for row in previous[suite]
                    if row["result"] in ("pass", "skip") or (args.k is not None and args.k not in row["test"])}
            tests = [t for t in tests if t not in kept]
            errors = [row for row in errors if row["test"] not in kept]
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_one, path, t, ranks, env, args.timeout, workdir) for t in tests]
            rows = []
            for fut in futures:
                row = fut.result()
                rows.append(row)
                print(f"[{suite}] {row['result']:4} {row['seconds']:6.1f}s {row['test']} {row['reason'][:120]}",
                      file=sys.stderr, flush=True)
        for row in errors:
            print(f"[{suite}] error {row['test']} {row['reason'][:120]}", file=sys.stderr, flush=True)
        rows = sorted(rows + errors + list(kept.values()), key=lambda row: row["test"])
        results[suite] = rows
        print(table(suite, rows) + "\n", flush=True)
    loads = sorted(row["load"] for rows in results.values() for row in rows if "load" in row)
    seen = (f"load {loads[0]:.1f}-{loads[-1]:.1f} (median {loads[len(loads) // 2]:.1f}) as the tests started"
            if loads else "no test ran")
    print(f"{args.n} ranks, {time.strftime('%Y-%m-%d %H:%M')}, {seen}, load {os.getloadavg()[0]:.1f} at the end\n")
    print("| suite | tests | pass | fail | collection error | skip | need a GPU | pass of the non-GPU tests |")
    print("|---|---|---|---|---|---|---|---|")
    for suite, rows in results.items():
        print(summary(suite, rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
