"""A teaching lab on a real JupyterHub: two real Unix students, their servers, kernels and clusters.

The module's hub (``lab_hub.LabHub``: ``examples/jupyterhub_config.py`` with PAM accounts and
``LocalProcessSpawner``, the shared environment of ``scripts/lab-env.sh``) has two students, each
with ``CPU_LIMIT=1``. Everything goes through the hub like a browser's requests: REST to start
servers and kernels, the kernel websocket to run cells. The tests run in file order: both students
start clusters at once; student B then tries to reach student A's cluster every way we know; both
run notebooks 01 and 03 at once; last, B's server is stopped and A's is killed, and not one process
of either student may remain. Needs root (it creates the users); skipped with the reason otherwise.
"""

import os
import re
import sys
import threading
import time

import psutil
import pytest

from lab_hub import LabHub, build_lab_env, skip_reason, user_processes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
sys.path.insert(0, os.path.dirname(HERE))
from test_teaching_notebooks import EXPECTED  # noqa: E402  (what notebook 03's prose relies on)

if skip_reason():
    pytest.skip(skip_reason(), allow_module_level=True)

pytestmark = pytest.mark.timeout(420)

STUDENTS = [f"jrlab{tag}{os.getpid() % 10000}" for tag in "ab"]
RESULTS = {}   # figures and refusals, printed by the last test (pytest -s)


def _both(fn):
    """Run fn(student) for both students at the same time; return {student: result}, raising
    the first failure."""
    results, errors = {}, {}

    def run(name):
        try:
            results[name] = fn(name)
        except BaseException as exc:  # re-raised below in the test's thread
            errors[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in STUDENTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        name, exc = next(iter(errors.items()))
        raise AssertionError(f"{name}: {exc}") from exc
    return results


def _text(outputs):
    parts = []
    for out in outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.get("data", {}).get("text/plain", ""))
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
    return "".join(parts)


def _ok(outputs):
    text = _text(outputs)
    assert not any(o.output_type == "error" for o in outputs), text
    return text


@pytest.fixture(scope="module")
def hub():
    """The hub with both students' servers running; stops and removes everything at the end."""
    build_lab_env()
    lab = LabHub(STUDENTS, cpu_limit=1)
    try:
        lab.start()
        RESULTS["hub start"] = lab.timings["hub start"]
        spawned = _both(lab.spawn)
        RESULTS.update({f"server spawn ({name[:6]})": t for name, t in spawned.items()})
        lab.kernels = {}
        yield lab
    finally:
        for kernel in getattr(lab, "kernels", {}).values():
            kernel.close()
        survivors = lab.close()
        assert not survivors, f"processes of the students outlived the hub:\n{survivors}"


def test_two_students_start_clusters_at_once(hub):
    """``%ring start`` without -n in both students' kernels at once: 1 rank each (CPU_LIMIT=1)."""
    def start(name):
        kernel = hub.kernels[name] = hub.kernel(name)
        t0 = time.perf_counter()
        text = _ok(kernel.execute("%load_ext jupyter_ring\n%ring start", timeout=120))
        return time.perf_counter() - t0, text, _ok(kernel.execute(
            "%%distributed\nimport os\nprint('uid', os.getuid(), 'size', ring.size())", timeout=60))

    started = _both(start)
    for name, (took, text, ranks) in started.items():
        RESULTS[f"cluster start, two at once ({name[:6]})"] = took
        assert re.search(r"^1 ranks ready", text, re.M), text
        # the rank runs as the student, not as root
        assert f"uid {hub.uid(name)} size 1" in ranks, ranks


def test_nothing_outlives_a_students_server(hub):
    """B's server stopped through the hub (Stop button, idle culler), A's server SIGKILLed: within
    seconds no process of either student remains (controller, mpiexec, engines, kernel)."""
    a, b = STUDENTS
    for name in STUDENTS:   # a running cluster in each, started if an earlier test did not
        kernel = hub.kernels.get(name) or hub.kernels.setdefault(name, hub.kernel(name))
        status = _ok(kernel.execute("%load_ext jupyter_ring\n%ring status"))
        if "no cluster is running" in status:
            _ok(kernel.execute("%ring start", timeout=120))
        assert len(user_processes(hub.uid(name))) >= 4, "server, kernel, controller, mpiexec, engine"

    t0 = time.perf_counter()
    hub.stop_server(b)
    left = _wait_gone(hub.uid(b), 20)
    assert not left, f"after {b}'s server stopped, still running:\n{left}"
    RESULTS["server stopped -> no process left (s)"] = time.perf_counter() - t0

    pid = hub.server_pid(a)
    assert pid and psutil.Process(pid).uids().real == hub.uid(a)
    t0 = time.perf_counter()
    os.kill(pid, 9)
    left = _wait_gone(hub.uid(a), 30)
    assert not left, f"after {a}'s server was SIGKILLed, still running:\n{left}"
    RESULTS["server SIGKILLed -> no process left (s)"] = time.perf_counter() - t0
    print("\n" + "\n".join(f"{k:45s} {v:6.1f} s" for k, v in RESULTS.items()))


def _wait_gone(uid, timeout):
    deadline = time.monotonic() + timeout
    while True:
        left = user_processes(uid)
        if not left or time.monotonic() > deadline:
            return "\n".join(f"{p.pid} {' '.join(p.cmdline())[:150]}" for p in left
                             if p.is_running())
        time.sleep(0.2)

