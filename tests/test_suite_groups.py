"""The suite's own scheduling (tests/conftest.py): on two xdist workers, as scripts/test.sh runs it,
the tests of a group share one worker (a module-scoped fixture starts once; tests/multihost and
tests/hub never run beside themselves)."""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_groups_tests_run_on_one_worker_under_their_group_id():
    # tests/multihost/test_args.py: the "hosts" group, and quick (no hosts are built); test_plan.py:
    # no group (nothing module-scoped), so its tests go wherever a worker is free
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "--no-loadscope-reorder", "tests/multihost/test_args.py", "tests/test_plan.py"],
        cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ran = re.findall(r"^\[(gw\d)\] \[\s*\d+%\] \w+ (tests/.*?)\s*$", proc.stdout, re.M)
    hosts = [(worker, nodeid) for worker, nodeid in ran if nodeid.startswith("tests/multihost/")]
    plan = [nodeid for _, nodeid in ran if nodeid.startswith("tests/test_plan.py")]
    assert len(hosts) >= 9 and len(plan) >= 10, proc.stdout[-4000:]
    # the id xdist's scheduler groups by ends in "@hosts" (with pytest 9 and xdist 3.8 it did not:
    # every test was its own group and a group's tests ran on both workers)
    assert all(nodeid.endswith("@hosts") for _, nodeid in hosts), hosts
    assert len({worker for worker, _ in hosts}) == 1, hosts
    assert not [nodeid for nodeid in plan if "@" in nodeid], plan


class _Item:
    """What ``conftest._queue`` reads of a test item: its path and its fixtures."""

    def __init__(self, name, path, fixtures=()):
        self.name, self.path, self.fixturenames = name, os.path.join(HERE, path), list(fixtures)


def test_the_queue_interleaves_waiting_tests_and_mpi_jobs_between_the_long_groups_and_the_quick_ones():
    import conftest  # tests/conftest.py, as pytest loaded it

    made = [("hub1", "hub/test_a.py", (), "hub"), ("q1", "test_plan.py", (), None),
            ("mpi1", "test_runtime.py", ("mpirun",), None), ("g1", "test_where.py", (), "test_where.py"),
            ("mpi2", "test_runtime.py", ("mpirun",), None), ("host1", "multihost/test_b.py", (), "hosts"),
            ("g2", "test_where.py", (), "test_where.py"), ("b1", "browser/test_c.py", (), None),
            ("mpi3", "test_torch.py", ("mpirun",), None), ("mpi4", "test_torch.py", ("mpirun",), None),
            ("hub2", "hub/test_a.py", (), "hub"), ("g3", "test_where.py", (), "test_where.py"),
            ("q2", "test_tabs.py", (), None), ("o1", "test_cluster.py", (), None)]
    items = [_Item(name, path, fixtures) for name, path, fixtures, _ in made]
    order = [item.name for item in conftest._queue(items, [group for *_, group in made])]
    assert sorted(order) == sorted(name for name, *_ in made)
    assert order[:3] == ["hub1", "hub2", "host1"], order          # the long groups, in their order
    assert order[-2:] == ["q1", "q2"], order                     # the quick modules' tests last
    g = order.index("g1")
    assert order[g:g + 3] == ["g1", "g2", "g3"], order           # a group stays one unit
    middle = order[3:-2]
    mpi = [i for i, name in enumerate(middle) if name.startswith("mpi")]
    # the MPI jobs spread through the middle: not all after the waiting tests, nor before them
    assert mpi[0] < middle.index("o1") and mpi[-1] > middle.index("g1"), order
