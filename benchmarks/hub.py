"""Teaching-lab figures on a real JupyterHub with two real Unix students (needs root).

Usage: sudo .venv/bin/python benchmarks/hub.py [--repeat 3] [--cpu-limit 1] [--json FILE]

Uses the fixture of tests/hub (``lab_hub.LabHub``: examples/jupyterhub_config.py, PAM accounts,
LocalProcessSpawner, the shared lab environment of scripts/lab-env.sh) and measures:
- hub start: from launching ``jupyterhub`` until its REST API answers;
- server spawn: both students' servers requested at once, until each is ready;
- cluster start: ``%ring start`` (no -n: the fair size for CPU_LIMIT) in both kernels at once,
  from execute_request to the reply (what the student waits for);
- notebook 03 (PyTorch data parallel), top to bottom in a fresh kernel over the kernel websocket:
  one student alone, then both at once; as written (``-n 2``, more than a CPU_LIMIT=1 share) and
  with the fair default (``%ring start`` without -n: 1 rank, 1 thread).
Each figure is the median of --repeat runs (min and max shown).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "hub"))

from lab_hub import LabHub, at_once, build_lab_env, skip_reason  # noqa: E402

NOTEBOOK = os.path.join(os.path.dirname(HERE), "notebooks", "03-pytorch-data-parallel.ipynb")


def _fair_variant(tmp):
    """Notebook 03 with ``%ring start`` instead of ``%ring start -n 2`` (the fair size)."""
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        cell.source = cell.source.replace("%ring start -n 2", "%ring start")
    path = os.path.join(tmp, "03-fair.ipynb")
    nbformat.write(nb, path)
    return path


def _run_notebook(hub, name, path):
    kernel = hub.kernel(name)
    try:
        t0 = time.perf_counter()
        nb = kernel.run_notebook(path, timeout=300)
        took = time.perf_counter() - t0
    finally:
        kernel.shutdown()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    if errors:
        raise RuntimeError(f"{name}: {path} failed: {errors[0].get('evalue')}")
    return took


def _cluster_start(hub, name):
    kernel = hub.kernel(name)
    try:
        t0 = time.perf_counter()
        outputs = kernel.execute("%load_ext jupyter_ring\n%ring start", timeout=120)
        took = time.perf_counter() - t0
        if any(o.output_type == "error" for o in outputs):
            raise RuntimeError(f"{name}: %ring start failed: {outputs}")
        kernel.execute("%ring stop", timeout=60)
    finally:
        kernel.shutdown()
    return took


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpu-limit", type=float, default=1)
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason:
        parser.error(reason)
    build_lab_env()
    students = [f"jrbench{tag}{os.getpid() % 10000}" for tag in "ab"]
    figures = {}

    def add(key, value):
        figures.setdefault(key, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        fair = _fair_variant(tmp)
        for _ in range(args.repeat):
            hub = LabHub(students, cpu_limit=args.cpu_limit)
            try:
                hub.start()
                add("hub start", hub.timings["hub start"])
                for took in at_once(hub.spawn, students).values():
                    add("server spawn (two at once)", took)
                for took in at_once(lambda n: _cluster_start(hub, n), students).values():
                    add("cluster start, %ring start (two at once)", took)
                for label, path in (("-n 2", NOTEBOOK), ("fair size", fair)):
                    add(f"notebook 03 ({label}), one student", _run_notebook(hub, students[0], path))
                    both = at_once(lambda n: _run_notebook(hub, n, path), students)
                    for took in both.values():
                        add(f"notebook 03 ({label}), two at once", took)
            finally:
                left = hub.close()
                if left:
                    print(f"processes outlived the hub: {left}", file=sys.stderr)
    print(f"{'figure':48s} {'median':>8s} {'min':>7s} {'max':>7s}  (s, {args.repeat} runs, "
          f"CPU_LIMIT={args.cpu_limit:g}, {os.cpu_count()} cores)")
    for key, values in figures.items():
        print(f"{key:48s} {statistics.median(values):8.2f} {min(values):7.2f} {max(values):7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
