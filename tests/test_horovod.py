"""Horovod's API exactly: the conformance page is true, and the Horovod names work under real mpiexec.

tests/mpi/hvd_torch.py, tests/mpi/hvd_tf.py (TensorFlow + Keras), tests/mpi/hvd_elastic.py and
tests/mpi/tf_graph_tutorial.py (Horovod's classic TF1 tutorial with only its import changed). The
first three run in jobs shared with other scripts of their framework and world size (conftest's
``torch_job`` and ``tf_job``: torch and TensorFlow imports cost seconds per rank).
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "horovod.md")
NAMES = os.path.join(ROOT, "tests", "data", "horovod_names.json")
OURS = {
    "horovod.torch": "jupyter_ring.runtime.torch",
    "horovod.tensorflow": "jupyter_ring.runtime.tensorflow",
    "horovod.tensorflow.keras": "jupyter_ring.runtime.keras",
    "horovod.keras": "jupyter_ring.runtime.keras",
}
STATUSES = {"same", "differs", "missing"}


def _page_tables():
    """{horovod module: {name: (status, note)}} and {our module: documented additions} from the page."""
    tables, additions, current = {}, {}, None
    for line in open(PAGE, encoding="utf-8"):
        heading = re.match(r"## (horovod\.[\w.]+) → (jupyter_ring\.[\w.]+)", line)
        if heading:
            current = heading.group(1)
            if OURS.get(current) != heading.group(2):
                raise AssertionError(f"docs/horovod.md maps {current} to {heading.group(2)}")
            tables[current] = {}
            continue
        row = re.match(r"\| `([\w.]+)` \| (\w+) \| (.*) \|$", line.rstrip("\n"))
        if row and current is not None:
            name, status, note = row.groups()
            if name in tables[current]:
                raise AssertionError(f"docs/horovod.md lists {current}.{name} twice")
            tables[current][name] = (status, note.strip())
        extra = re.match(r"- `(jupyter_ring\.runtime\.\w+)`: (.*)", line)
        if extra:
            additions[extra.group(1)] = set(re.findall(r"`(\w+)`", extra.group(2)))
    return tables, additions


def test_conformance_page_is_true(framework_adapters):
    """Every Horovod name once, its status true of our module; our extra names all documented."""
    modules = framework_adapters["modules"]
    horovod = json.load(open(NAMES))
    tables, additions = _page_tables()
    problems = []
    for hmod, ours in OURS.items():
        table = tables.get(hmod, {})
        names = set(horovod[hmod])
        for name in sorted(names - set(table)):
            problems.append(f"{hmod}.{name}: not on the page")
        for name in sorted(set(table) - names):
            problems.append(f"{hmod}.{name}: on the page but not one of Horovod's names")
        for name, (status, note) in sorted(table.items()):
            exists = name in modules[ours]["present"]
            public = name in modules[ours]["all"] or name.startswith("callbacks.")
            if status not in STATUSES:
                problems.append(f"{hmod}.{name}: status {status!r} is not one of {sorted(STATUSES)}")
            elif status == "missing" and exists:
                problems.append(f"{hmod}.{name}: marked missing but {ours} has it")
            elif status != "missing" and not (exists and public):
                problems.append(f"{hmod}.{name}: marked {status} but {ours} lacks it (or it is not in __all__)")
            if status != "same" and not note:
                problems.append(f"{hmod}.{name}: marked {status} without saying how or why")
    for ours in set(OURS.values()):
        theirs = set().union(*(set(horovod[h]) for h, o in OURS.items() if o == ours))
        extra = set(modules[ours]["all"]) - theirs
        if extra != additions.get(ours, set()):
            problems.append(f"{ours}: additions on the page {sorted(additions.get(ours, set()))} but the module's "
                            f"are {sorted(extra)}")
    assert not problems, "docs/horovod.md is not true:\n" + "\n".join(problems)


def test_every_public_name_has_a_docstring(framework_adapters):
    modules = framework_adapters["modules"]
    undocumented = [f"{mod}.{n}" for mod, names in modules.items() for n in names["undocumented"]]
    assert sorted(modules) == sorted(set(OURS.values())) and undocumented == [], undocumented


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_horovod_torch_names(torch_job, n):
    pytest.importorskip("torch", reason="needs torch: pip install 'jupyter_ring[torch]'")
    result = torch_job("hvd_torch.py", n)  # in the torch job of its world size (conftest's torch_job)
    assert sorted(int(line.split()[1]) for line in result.lines("HVD_TORCH_OK")) == list(range(n)), result.stdout


@pytest.mark.parametrize("n", [pytest.param(3, marks=pytest.mark.slow)])  # 2 ranks: tests/mpi/tf_all.py
def test_horovod_tensorflow_and_keras_names(tf_job, n):
    pytest.importorskip("tensorflow", reason="needs tensorflow: pip install 'jupyter_ring[tensorflow]'")
    result = tf_job("hvd_tf.py", n)  # in the TensorFlow job of its world size (conftest's tf_job)
    assert sorted(int(line.split()[1]) for line in result.lines("HVD_TF_OK")) == list(range(n)), result.stdout


@pytest.mark.parametrize("n", [2, 4])  # 4 ranks outnumber the cores here
def test_graph_mode_tutorial_runs_with_only_its_import_changed(mpirun, n):
    pytest.importorskip("tensorflow", reason="needs tensorflow: pip install 'jupyter_ring[tensorflow]'")
    result = mpirun("tf_graph_tutorial.py", n, timeout=400, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    assert sorted(int(line.split()[1]) for line in result.lines("TF_TUTORIAL_OK")) == list(range(n)), result.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_elastic_state_and_run_for_a_fixed_world(tf_job, n):
    """hvd.elastic in torch, TensorFlow and Keras: sync from rank 0, restore, commit, run's retry
    from the last commit and its reset limit, the Keras callbacks through fit."""
    pytest.importorskip("torch", reason="needs torch: pip install 'jupyter_ring[torch]'")
    pytest.importorskip("tensorflow", reason="needs tensorflow: pip install 'jupyter_ring[tensorflow]'")
    result = tf_job("hvd_elastic.py", n)  # in the TensorFlow job of its world size (conftest's tf_job)
    assert sorted(int(line.split()[1]) for line in result.lines("HVD_ELASTIC_OK")) == list(range(n)), result.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_session_runs_many_collective_ops_in_any_order(mpirun, n):
    """TF1: one session.run of 32 independent collectives (and gradients) matched by name in
    whatever order each rank's threads run them, in a session of one inter-op thread with the
    default wait (no op holds it while it waits) and with the inline wait in the threads init()
    gives; 96 new ops' first runs with the graph's function library not growing (2 ranks); ops
    no rank can pair fail on every rank with FailedPreconditionError naming them and the fix,
    under both waits, and the session works after."""
    pytest.importorskip("tensorflow", reason="needs tensorflow: pip install 'jupyter_ring[tensorflow]'")
    result = mpirun("tf_session_ops.py", n, timeout=400, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    assert sorted(int(line.split()[1]) for line in result.lines("TF_SESSION_OK")) == list(range(n)), result.stdout


def test_suite_harness_counts_a_collection_error_as_an_error_never_a_pass(tmp_path):
    """benchmarks/horovod_suite.py on a stand-in checkout: a test class that stops while pytest
    collects it (as Horovod's test_keras.py does under Keras 3) is an ``error`` row, a failing test
    fails, a passing one passes, each judged from every rank's report (one rank each here)."""
    for module in ("parameterized", "mock", "cloudpickle", "packaging"):
        pytest.importorskip(module, reason="needs the horovod-suite extra: pip install 'jupyter_ring[horovod-suite]'")
    parallel = tmp_path / "horovod" / "test" / "parallel"
    parallel.mkdir(parents=True)
    (parallel / "test_keras.py").write_text(
        "import unittest\n\n\n"
        "class KerasTests(unittest.TestCase):\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        raise AttributeError(\"module 'tensorflow' has no attribute 'ConfigProto' (a long message)\")\n\n"
        "    def test_never_runs(self):\n"
        "        pass\n\n\n"
        "def test_passes():\n"
        "    assert 1 + 1 == 2\n\n\n"
        "def test_fails():\n"
        "    assert 1 + 1 == 3, 'one and one'\n")
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "horovod_suite.py"),
                           str(tmp_path / "horovod"), "--suite", "keras", "-n", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["test"]: row for row in json.load(open(out))["keras"]}
    assert {name: row["result"] for name, row in rows.items()} == {
        "KerasTests": "error", "test_passes": "pass", "test_fails": "fail"}, rows
    assert "AttributeError: module 'tensorflow' has no attribute 'ConfigProto' (a long message)" in \
        rows["KerasTests"]["reason"]
    assert "one and one" in rows["test_fails"]["reason"]
    assert "| test_keras.py | 3 | 1 | 1 | 1 | 0 | 0 | 1 / 3 = 33.3 % |" in proc.stdout, proc.stdout
    # --rerun-failed with -k runs the selected failure again and keeps every other row as it was
    again = tmp_path / "again.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "horovod_suite.py"),
                           str(tmp_path / "horovod"), "--suite", "keras", "-n", "1", "--rerun-failed", str(out),
                           "-k", "test_fails", "--json", str(again)],
                          capture_output=True, text=True, cwd=ROOT, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test_fails" in proc.stderr and "test_passes" not in proc.stderr, proc.stderr  # only it ran
    assert {row["test"]: row["result"] for row in json.load(open(again))["keras"]} == {
        "KerasTests": "error", "test_passes": "pass", "test_fails": "fail"}
