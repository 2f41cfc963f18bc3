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
