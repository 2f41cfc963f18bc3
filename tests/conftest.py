"""Shared fixtures: an isolated home for Jupyter/IPython, and a runner for real mpiexec jobs."""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from jupyter_ring.cluster._procs import sweep_mpich_segments
from jupyter_ring.launch import find_mpiexec, mpi_env

HERE = os.path.dirname(os.path.abspath(__file__))
MPI_SCRIPTS = os.path.join(HERE, "mpi")

# Tests never write into the home folder: IPython, Jupyter and ipyparallel get temp dirs,
# set before anything imports them.
_ISOLATED = tempfile.mkdtemp(prefix="jupyter_ring_tests_")
for var, sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "jupyter_config"),
                 ("JUPYTER_DATA_DIR", "jupyter_data"), ("JUPYTER_RUNTIME_DIR", "jupyter_runtime"),
                 ("MPLCONFIGDIR", "mpl"), ("XDG_CACHE_HOME", "cache")):
    os.environ[var] = os.path.join(_ISOLATED, sub)
    os.makedirs(os.environ[var], exist_ok=True)
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")


def screenshot_path(name):
    """Where a browser test saves ``name``: a temp dir, or the folder in JUPYTER_RING_SCREENSHOTS.

    The committed pictures in docs/img are refreshed on purpose with
    ``JUPYTER_RING_SCREENSHOTS=docs/img scripts/test.sh tests/browser``, never by a plain run.
    """
    folder = os.environ.get("JUPYTER_RING_SCREENSHOTS") or os.path.join(_ISOLATED, "screenshots")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)


class MPIResult:
    def __init__(self, proc, n):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.n = n

    def lines(self, prefix):
        """Lines starting with ``prefix`` and a number (split there too, should a line arrive glued)."""
        marker = re.escape(prefix) + r" \d"
        text = re.sub(f"(?={marker})", "\n", self.stdout)
        return [line for line in text.splitlines() if re.match(marker, line)]


def run_mpi(script, n, *args, env=None, timeout=120, check=True):
    """Run ``tests/mpi/<script>`` under a real ``mpiexec -n n``; fail with every rank's output."""
    path = script if os.path.isabs(script) else os.path.join(MPI_SCRIPTS, script)
    full_env = mpi_env()
    # No PYTHONUNBUFFERED: unbuffered, print() writes its text and its newline in two writes and
    # mpiexec can put another rank's line between them ("RANK_OK 1SOAK {...}"); the scripts
    # print with flush=True, one write per line, so every line arrives whole and nothing is held.
    full_env.pop("PYTHONUNBUFFERED", None)
    # a rank that crashes in native code writes its Python stacks (as a cluster's ranks do)
    full_env.setdefault("PYTHONFAULTHANDLER", "1")
    full_env.update(env or {})
    cmd = [find_mpiexec(), "-n", str(n), sys.executable, path, *map(str, args)]
    # the segments of jobs whose ranks tests killed: one named as this job's fails its MPI_Init
    sweep_mpich_segments()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} on {n} ranks did not finish in {timeout} s (a hang)\n"
                    f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")
    result = MPIResult(proc, n)
    if check and proc.returncode != 0:
        pytest.fail(f"{script} on {n} ranks exited {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\n"
                    f"stderr:\n{proc.stderr[-6000:]}")
    return result


@pytest.fixture
def mpirun():
    """``mpirun(script, n, *args, env=..., timeout=...)`` -> MPIResult (fails on non-zero exit)."""
    return run_mpi


_BATCHES: dict = {}


def run_batch(scripts, n, script, env=None, timeout=600):
    """``script``'s verdict from one MPI job that runs all of ``scripts`` on ``n`` ranks in turn
    (tests/mpi/batch.py), started by the first test that asks for it in this process and kept
    for the others: the frameworks' import on every rank is paid once, not per script. Fails
    unless every rank ended ``script`` with status 0; returns the job's MPIResult (each script's
    markers are its own, so ``lines()`` finds them in the job's output)."""
    assert script in scripts, (script, scripts)
    key = (tuple(scripts), n, tuple(sorted((env or {}).items())))
    if key not in _BATCHES:
        _BATCHES[key] = run_mpi("batch.py", n, *scripts, env=env, timeout=timeout, check=False)
    result = _BATCHES[key]
    ended = {int(rank): int(code) for _, name, rank, code in
             (line.split() for line in result.stdout.splitlines() if line.startswith("BATCH_END "))
             if name == script}
    if ended != dict.fromkeys(range(n), 0):
        raised = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("BATCH_RAISED ")]
        said = [f"rank {rank} exited {code}" for rank, code in sorted(ended.items()) if code]
        missing = sorted(set(range(n)) - set(ended))
        if missing:
            why = "; ".join(f"{name} raised on rank {rank}" for name, rank in raised) or "the job ended first"
            said.append(f"rank(s) {', '.join(map(str, missing))} never ended it ({why}; the job exited "
                        f"{result.returncode})")
        pytest.fail(f"{script} on {n} ranks, in one job with {', '.join(s for s in scripts if s != script)} "
                    f"(tests/mpi/batch.py): {'; '.join(said)}. The job's output:\nstdout:\n"
                    f"{result.stdout[-8000:]}\nstderr:\n{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="session")
def mpibatch_runner():
    """``run_batch`` itself, for its own tests (tests/test_mpi_batch.py)."""
    return run_batch


# The torch scripts' jobs, one per world size and transport: torch is imported once a rank for all
# of a job's scripts (test_torch.py, test_horovod.py's names, test_elastic_api.py). The rank counts
# are spread over the scripts (the whole suite must stay under 15 minutes on 2 cores).
TORCH_JOBS = {
    1: ("torch_collectives.py", "hvd_torch.py", "elastic_api.py"),
    2: ("torch_collectives.py", "torch_train.py", "torch_errors.py", "torch_overlap.py", "hvd_torch.py",
        "elastic_api.py"),
    3: ("torch_collectives.py", "torch_train.py", "torch_errors.py", "torch_overlap.py", "hvd_torch.py",
        "elastic_api.py"),
    4: ("hvd_torch.py", "elastic_api.py"),
}
TORCH_ENV = {"PYTHONWARNINGS": "ignore"}  # torch's own warnings (no script checks warnings by this filter)
# through the device transport over gloo (JUPYTER_RING_DEVICE_TRANSPORT=gloo: NCCL's code on CPU tensors)
TORCH_GLOO_JOBS = {
    1: ("torch_collectives.py",),
    2: ("torch_collectives.py", "torch_train.py", "torch_errors.py", "torch_device.py"),
    3: ("torch_collectives.py",),
    4: ("torch_train.py", "torch_errors.py", "torch_device.py"),
}
TORCH_GLOO_ENV = {"JUPYTER_RING_DEVICE_TRANSPORT": "gloo"}


# TensorFlow's eager scripts likewise (test_tensorflow.py's tf_all.py, test_horovod.py's hvd_tf.py and
# hvd_elastic.py, which imports torch too). The graph-mode scripts (tf_graph_tutorial.py,
# tf_session_ops.py) keep jobs of their own: they turn eager execution off for the whole process
# and size TensorFlow's threads before it starts; so does keras2.py (TF_USE_LEGACY_KERAS=1).
TF_JOBS = {
    2: ("tf_all.py", "hvd_elastic.py"),
    3: ("hvd_tf.py", "hvd_elastic.py"),
    4: ("tf_all.py",),
}
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="session")
def tf_job():
    """``tf_job(script, n)`` -> ``script``'s MPIResult from the job of its world size (``TF_JOBS``),
    run once by the first test that asks; its tests share one worker (``_SHARED_FIXTURES``)."""
    def job(script, n):
        return run_batch(TF_JOBS[n], n, script, env=TF_ENV, timeout=400 * len(TF_JOBS[n]))
    return job


@pytest.fixture(scope="session")
def torch_job():
    """``torch_job(script, n, gloo=False)`` -> ``script``'s MPIResult from the job of its world size
    (``TORCH_JOBS``, or ``TORCH_GLOO_JOBS`` through the device transport), run once by the first
    test that asks (``run_batch``). The tests that use it share one worker (``_SHARED_FIXTURES``)."""
    def job(script, n, gloo=False):
        scripts, env = (TORCH_GLOO_JOBS[n], TORCH_GLOO_ENV) if gloo else (TORCH_JOBS[n], TORCH_ENV)
        return run_batch(scripts, n, script, env=env, timeout=240 * len(scripts))
    return job


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    """One JupyterLab server for this process's browser tests (tests/browser/lab_server.py),
    started by the first; each test gets a fresh notebook and kernel on it from the ``lab``
    fixture of tests/browser/test_lab_panel.py. Session-scoped, not module-scoped: the browser
    tests stay free to go to either worker (a module scope would make each module a group)."""
    if os.path.join(HERE, "browser") not in sys.path:   # imported from there already, normally
        sys.path.insert(0, os.path.join(HERE, "browser"))
    from lab_server import LabServer

    server = LabServer(tmp_path_factory.mktemp("lab"))
    yield server
    server.stop()


_ADAPTERS = """
import json, sys
import jupyter_ring.runtime.tensorflow, jupyter_ring.runtime.keras
beside_tensorflow = {"torch": "torch" in sys.modules, "cupy": "cupy" in sys.modules}
import jupyter_ring.runtime.torch
modules = {}
for mod in ("jupyter_ring.runtime.torch", "jupyter_ring.runtime.tensorflow", "jupyter_ring.runtime.keras"):
    m = sys.modules[mod]
    present = set(dir(m))
    cbs = getattr(m, "callbacks", None)
    present |= {"callbacks." + n for n in (vars(cbs) if cbs is not None else ()) if not n.startswith("_")}
    modules[mod] = {"all": sorted(m.__all__), "present": sorted(present),
                    "undocumented": [n for n in m.__all__ if n != "callbacks" and not getattr(m, n).__doc__]}
print(json.dumps({"beside_tensorflow": beside_tensorflow, "modules": modules}))
"""


@pytest.fixture(scope="session")
def framework_adapters():
    """The torch, TensorFlow and Keras adapters as a fresh interpreter sees them, for the tests of
    their names (test_horovod.py, test_tensorflow.py): ``modules`` maps each adapter to its
    ``all``, ``present`` (dir() and callbacks.*) and ``undocumented`` public names;
    ``beside_tensorflow`` says whether importing the TensorFlow and Keras adapters imported torch or
    cupy (before the torch adapter is imported). One interpreter for all of it: importing torch and
    TensorFlow costs seconds."""
    pytest.importorskip("tensorflow", reason="the adapters' names need tensorflow: pip install 'jupyter_ring[tensorflow]'")
    pytest.importorskip("torch", reason="the adapters' names need torch: pip install 'jupyter_ring[torch]'")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    proc = subprocess.run([sys.executable, "-c", _ADAPTERS], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- two workers (scripts/test.sh runs pytest -n 2 --dist loadgroup) ---------------------------
# A test alone waits on processes (an MPI job starting, a kernel, a browser) for much of its time,
# and one worker used one of the two cores for about two thirds of the suite; two workers fill
# both. What must not run beside itself shares a group, which one worker runs in order:
# - tests/multihost build network namespaces, veth pairs, sshd and Slurm daemons on fixed names;
# - tests/hub run JupyterHub with real Unix accounts;
# - a module whose tests share a module-scoped fixture (one kernel and cluster for the module)
#   stays on one worker, so the fixture starts once.
# The groups go out first, longest first, then the tests that start processes (a browser, an MPI
# job), the others, and last the quick modules' tests: the last tests either worker takes (each
# holds up to three ahead) are then short, and neither worker is left alone with a long tail.
_SHARED_GROUPS = {"multihost": "hosts", "hub": "hub"}
_GROUP_ORDER = ("hub", "hosts")
_HEAVY_FOLDERS = ("browser", "reliability")  # every test there starts a browser, kernel or job
# modules whose tests start no process (a few seconds for all of them): the end of the queue
_QUICK_MODULES = ("test_benchmarks_import.py", "test_dashboard.py", "test_dashboard_figures.py",
                  "test_dashboard_summary.py", "test_debug_prompts.py", "test_plan.py",
                  "test_report.py", "test_tabs.py", "test_timeline.py")


def _queue_place(item, group, rank):
    """Where ``item`` goes in the workers' queue (lower first): the named groups in order, the
    other groups, the tests that start processes, the others, the quick modules' tests."""
    if group is not None:
        return rank.get(group, len(rank))
    parts = os.path.relpath(str(item.path), HERE).split(os.sep)
    if parts[0] in _QUICK_MODULES:
        return len(rank) + 3
    heavy = parts[0] in _HEAVY_FOLDERS or "mpirun" in getattr(item, "fixturenames", ())
    return len(rank) + (1 if heavy else 2)


# tests of several modules that share a costly session-scoped fixture: one worker, so it runs once
_SHARED_FIXTURES = {"framework_adapters": "framework_adapters",  # torch and TensorFlow imported
                    # one MPI job for several scripts (torch or TensorFlow on every rank)
                    "torch_job": "torch_jobs", "tf_job": "tf_jobs"}


def _xdist_group(item):
    parts = os.path.relpath(str(item.path), HERE).split(os.sep)
    if parts[0] in _SHARED_GROUPS:
        return _SHARED_GROUPS[parts[0]]
    shared = [group for name, group in _SHARED_FIXTURES.items() if name in getattr(item, "fixturenames", ())]
    if shared:
        return shared[0]
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    if any(d[-1].scope in ("module", "package") for d in defs if d):
        return "/".join(parts)
    return None


def _join_group(item, group):
    """Put ``item`` in xdist's ``group``: the mark, and the ``@group`` suffix of its node id that
    xdist's scheduler reads. xdist (3.8) adds the suffix by setting ``item._nodeid``, which pytest 9
    no longer reads (a node's id is ``item._id``, a NodeId): every test was then a group of its own,
    a module's fixture started on both workers and the groups' tests ran on both at once."""
    item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(item, "_id") and not hasattr(item, "_nodeid"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # xdist's workers collect; a plain run keeps its order
        return
    rank = {name: i for i, name in enumerate(_GROUP_ORDER)}
    grouped = []
    for item in items:
        group = _xdist_group(item)
        if group is not None:
            _join_group(item, group)
        grouped.append((_queue_place(item, group, rank), item))
    items[:] = [item for _, item in sorted(grouped, key=lambda pair: pair[0])]


# ---- where the suite's CPU goes (issue 32, item 5): JUPYTER_RING_TEST_CPU=FILE -----------------
# Each test's wall seconds and the CPU seconds of this worker and of its reaped children (kernels,
# clusters, MPI jobs, browsers: counted when reaped, so a module's fixtures count at its last
# test) as JSON lines appended to FILE; benchmarks/suite_cpu.py sums them by module.
_CPU_LOG = os.environ.get("JUPYTER_RING_TEST_CPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return
    import resource
    import time

    def cpu():
        me, kids = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime

    wall, (me, kids) = time.monotonic(), cpu()
    yield
    me2, kids2 = cpu()
    with open(_CPU_LOG, "a") as log:
        log.write(json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                              "end": round(time.time(), 3), "wall": round(time.monotonic() - wall, 3),
                              "self": round(me2 - me, 3), "children": round(kids2 - kids, 3)}) + "\n")
