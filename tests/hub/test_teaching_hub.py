"""A teaching lab on a real JupyterHub: two real Unix students, their servers, kernels and clusters.

The module's hub (``lab_hub.LabHub``: ``examples/jupyterhub_config.py`` with PAM accounts and
``LocalProcessSpawner``, the shared environment of ``scripts/lab-env.sh``) has two students, each
with ``CPU_LIMIT=1``. Everything goes through the hub like a browser's requests: REST to start
servers and kernels, the kernel websocket to run cells. The tests run in file order: both students
start clusters at once; student B then tries to reach student A's cluster every way we know; both
run notebooks 01 and 03 at once; a third student on a hub with the idle culler goes idle and is
culled; last, B's server is stopped and A's is killed. After each, not one process of that student
may remain. Needs root (it creates the users); skipped with the reason otherwise.
"""

import json
import os
import re
import secrets
import sys
import time

import psutil
import pytest

from jupyter_ring import demo
from lab_hub import LabHub, at_once, build_lab_env, skip_reason, user_processes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
sys.path.insert(0, os.path.dirname(HERE))
from test_teaching_notebooks import EXPECTED  # noqa: E402  (what notebook 03's prose relies on)

if skip_reason():
    pytest.skip(skip_reason(), allow_module_level=True)

pytestmark = pytest.mark.timeout(420)

STUDENTS = [f"jrlab{tag}{os.getpid() % 10000}" for tag in "ab"]
RESULTS = {}   # figures (seconds), printed by the last test (pytest -s)
REFUSED = []   # what student B tried against student A's cluster, and the answer


def _both(fn):
    """fn(student) for both students at the same time: {student: result}."""
    return at_once(fn, STUDENTS, timeout=600)


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
        RESULTS.update({f"server spawn, two at once ({name[-5:]})": t for name, t in spawned.items()})
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
            "%%distributed\nimport os, torch\nprint('uid', os.getuid(), 'size', ring.size(), 'threads', "
            "os.environ['OMP_NUM_THREADS'], torch.get_num_threads())", timeout=60))

    started = _both(start)
    for name, (took, text, ranks) in started.items():
        RESULTS[f"cluster start, two at once ({name[-5:]})"] = took
        assert re.search(r"^1 ranks ready", text, re.M), text
        # the rank runs as the student, not as root, with 1 thread for its 1 CPU
        assert f"uid {hub.uid(name)} size 1 threads 1 1" in ranks, ranks


def test_another_student_cannot_reach_a_cluster(hub):
    """Student B tries every way in to student A's running cluster; each one is refused, and A's
    cluster works afterwards."""
    a, b = STUDENTS
    ka, kb = _running_cluster(hub, a), _running_cluster(hub, b)
    ua = hub.uid(a)
    refused = REFUSED

    # 1. A's files: everything under ~/.ipython and Jupyter's runtime dir is owner-only
    files = _files(os.path.join(hub.home(a), ".ipython")) + _files(
        os.path.join(hub.home(a), ".local", "share", "jupyter", "runtime"))
    security = os.path.join(hub.home(a), ".ipython", "profile_default", "security")
    client_files = [f for f in files if re.search(r"ipcontroller-.*-client\.json$", f)]
    assert client_files, files
    loose = [f"{oct(os.stat(f).st_mode & 0o777)} {f}" for f in files
             if os.stat(f).st_mode & 0o077 and not f.endswith("startup/README")]
    assert not loose, "readable by others:\n" + "\n".join(loose)

    # 2. ... and B can neither list nor read them
    outcome = _try_each(kb, [security] + files,
                        "os.listdir(item) if os.path.isdir(item) else open(item).read()")
    assert set(outcome.values()) == {"PermissionError"}, outcome
    refused.append(f"read A's {len(files)} files and list A's security dir: PermissionError each")

    # 3. B drives A's controller. What B can know: A's ports (they show in /proc/net/tcp), its
    # own cluster's connection file, made-up keys; A's HMAC key and CurveZMQ keys are in A's
    # 0600 file only (checked below: not in A's command lines either)
    with open(client_files[0]) as f:
        a_info = json.load(f)
    a_ports = {k: v for k, v in a_info.items() if k in ("interface", "location") or
               (isinstance(v, int) and not isinstance(v, bool))}
    b_files = [f for f in _files(os.path.join(hub.home(b), ".ipython"))
               if re.search(r"ipcontroller-.*-client\.json$", f)]
    with open(b_files[0]) as f:
        b_info = json.load(f)
    b_key = b_info["key"]
    plain = {k: v for k, v in b_info.items() if not k.startswith("curve")}
    attempts = {"a forged HMAC key": dict(plain, **a_ports, key=secrets.token_hex(16)),
                "B's own connection file (B's key and CurveZMQ keys)": dict(b_info, **a_ports),
                "no key": dict(plain, **a_ports, key=""),
                "a forged HMAC key and a made-up CurveZMQ server key": dict(
                    plain, **a_ports, key=secrets.token_hex(16),
                    curve_serverkey=b_info.get("curve_serverkey") or "x" * 40)}
    # the attempts run at the same time, each in a process of B's (each waits out its 4 s
    # timeout); one whose process printed no RESULT line (it crashed) fails the test
    drive = _ok(kb.execute(
        "import json, os, subprocess, sys, tempfile\n"
        f"TRY = {_FORGED_CLIENT!r}\n"
        "tries = {}\n"
        f"for label, info in {attempts!r}.items():\n"
        "    fd, path = tempfile.mkstemp(suffix='.json')\n"
        "    with os.fdopen(fd, 'w') as f:\n"
        "        json.dump(info, f)\n"
        "    tries[label] = path, subprocess.Popen([sys.executable, '-c', TRY, path], text=True,\n"
        "                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)\n"
        "results = {}\n"
        "for label, (path, proc) in tries.items():\n"
        "    out = proc.communicate(timeout=90)[0]\n"
        "    found = [line[7:] for line in out.splitlines() if line.startswith('RESULT ')]\n"
        "    results[label] = found[-1] if found else f'NO RESULT (exit {proc.returncode}): {out[-600:]}'\n"
        "    os.remove(path)\n"
        "print(json.dumps(results))", timeout=120))
    outcome = json.loads(drive.strip().splitlines()[-1])
    assert set(outcome) == set(attempts), outcome
    for label, result in outcome.items():
        assert not result.startswith(("CONNECTED", "NO RESULT")), (label, result)
        refused.append(f"ipyparallel Client on A's controller with {label}: {result}")

    # 3b. raw messages with B's session key to every port A's kernel, controller and engine
    # nannies listen on: run code (it would write a marker file as A), signal, shut down
    marker = os.path.join(hub.home(a), "driven-by-b")
    targets = [row for row in _listening({ua: a})
               if re.search(r"ipykernel|ipyparallel\.controller|nanny", row[3])]
    assert len(targets) >= 5, targets
    execute = {"code": f"open({marker!r}, 'w')", "silent": False, "store_history": False,
               "user_expressions": {}, "allow_stdin": False}
    sent = _ok(kb.execute(
        "import time, zmq\nfrom jupyter_client.session import Session\n"
        f"session = Session(key={b_key.encode()!r}, username='b')\n"
        f"execute = {execute!r}\n"
        "ctx, socks = zmq.Context(), []\n"
        f"for port in {sorted({row[2] for row in targets})!r}:\n"
        "    sock = ctx.socket(zmq.DEALER)\n"
        "    sock.linger, sock.sndtimeo = 0, 500   # a PUB port never takes a DEALER peer\n"
        "    sock.connect(f'tcp://127.0.0.1:{port}')\n"
        "    socks.append(sock)\n"
        "time.sleep(0.5)\n"
        "delivered = 0   # queued by ZMQ; a CurveZMQ port drops them at its handshake\n"
        "for sock in socks:\n"
        "    try:\n"
        "        session.send(sock, 'execute_request', execute)\n"
        "        session.send(sock, 'signal_request', {'sig': 15})\n"
        "        session.send(sock, 'shutdown_request', {'restart': False})\n"
        "        delivered += 1\n"
        "    except zmq.Again:\n"
        "        pass\n"
        "time.sleep(1)\n"
        "print('delivered to', delivered, 'of', len(socks), 'ports')", timeout=60))
    delivered = int(re.search(r"delivered to (\d+) of", sent).group(1))
    assert delivered >= 3, sent   # at least the kernel's shell/control and the controller's
    time.sleep(2)
    assert not os.path.exists(marker), "B's forged execute_request ran in A's kernel or engine"
    assert all(psutil.pid_exists(p) for p in [t[4] for t in targets]), "a forged request stopped A"
    refused.append(f"execute/signal/shutdown requests with B's session key, sent to "
                   f"{delivered} of A's kernel, controller and nanny ports: no effect (no code "
                   "ran, every process alive)")

    # 3c. A's secrets are in no command line of A's processes (world-readable in /proc), and
    # A's process environments are closed to B
    secrets_a = [str(v) for k, v in a_info.items() if (k == "key" or k.startswith("curve"))
                 and v and len(str(v)) >= 16]
    a_all = [p.pid for p in user_processes(ua)]
    seen = _ok(kb.execute(
        "import json\nleaks, environ = 0, set()\n"
        f"for pid in {a_all!r}:\n"
        "    try:\n"
        "        cmdline = open(f'/proc/{pid}/cmdline', 'rb').read().decode(errors='replace')\n"
        f"        leaks += sum(secret in cmdline for secret in {secrets_a!r})\n"
        "    except OSError:\n"
        "        pass\n"
        "    try:\n"
        "        open(f'/proc/{pid}/environ', 'rb').read()\n"
        "        environ.add('READ')\n"
        "    except OSError as exc:\n"
        "        environ.add(type(exc).__name__)\n"
        "print(json.dumps([leaks, sorted(environ)]))"))
    leaks, environ = json.loads(seen.strip().splitlines()[-1])
    assert leaks == 0 and environ == ["PermissionError"], (leaks, environ)
    refused.append(f"look for A's {len(secrets_a)} key(s) in the command lines of A's "
                   f"{len(a_all)} processes: not there; their environments: PermissionError")

    # 4. B signals A's controller, mpiexec and engines
    a_pids = [p.pid for p in user_processes(ua)
              if re.search(r"ipcontroller|ipengine|ipyparallel|mpiexec|hydra", " ".join(p.cmdline()))]
    assert len(a_pids) >= 3, a_pids
    outcome = _try_each(kb, a_pids, "os.kill(item, signal.SIGTERM)")
    assert set(outcome.values()) == {"PermissionError"}, outcome
    refused.append(f"SIGTERM to A's {len(a_pids)} controller/mpiexec/engine processes: "
                   "PermissionError each")

    # 5. B's own hub token on A's server and on the hub's API for A
    token_b = hub.user_token(b)
    for method, path in (("GET", f"/user/{a}/api/kernels"),
                         ("GET", f"/user/{a}/jupyter-ring/clusters"),
                         ("POST", f"/user/{a}/api/kernels/{ka.id}/interrupt"),
                         ("DELETE", f"/hub/api/users/{a}/server")):
        status, _ = hub.api(method, path, token=token_b, expect=None)
        assert status in (403, 404), (method, path, status)
        path = path.replace(a, "A").replace(ka.id, "<id>")
        refused.append(f"{method} {path} with B's token: HTTP {status}")

    # A's cluster is untouched and works
    after = _ok(ka.execute("%%distributed\nprint('still', ring.size())", timeout=60))
    assert "still 1" in after, after


def test_every_listening_socket_is_on_loopback(hub):
    """With both students' clusters running: every listening socket of theirs (servers, kernels,
    controllers, schedulers, nannies, mpiexec, ranks) is on loopback."""
    for name in STUDENTS:
        _running_cluster(hub, name)
    listening = _listening({hub.uid(name): name for name in STUDENTS})
    assert len(listening) >= 10, f"too few listening sockets found: {listening}"
    open_ = [row for row in listening if row[1] not in ("127.0.0.1", "::1")]
    # (MPICH's default mpiexec, hydra: its PMI proxy's 0.0.0.0 listener is inherited by every
    # rank; mpiexec.gforker, for one host, listens nowhere)
    assert not open_, f"listening beyond loopback: {open_}"
    REFUSED.append(f"{len(listening)} listening sockets of both students: all on loopback")


def test_two_students_run_notebooks_01_and_03_at_once(hub):
    """Both students run the quickstart, then the PyTorch notebook (-n 2 each: over their share of
    CPU_LIMIT=1, which %ring start says), at the same time, each in fresh kernels."""
    def run(name):
        transcripts, times = {}, {}
        for notebook in ("01-quickstart.ipynb", "03-pytorch-data-parallel.ipynb"):
            kernel = hub.kernel(name)
            try:
                t0 = time.perf_counter()
                nb = kernel.run_notebook(os.path.join(NOTEBOOKS, notebook), timeout=240)
                times[notebook] = time.perf_counter() - t0
            finally:
                kernel.shutdown()
            transcripts[notebook] = (nb, demo.format_outputs(nb))
        return transcripts, times

    ran = _both(run)
    for name, (transcripts, times) in ran.items():
        for notebook, (nb, text) in transcripts.items():
            errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                      if o.output_type == "error"]
            assert not errors, f"{name} {notebook}:\n{text[-5000:]}"
            assert re.search(r"-n 2 is more than this server's share \(\d+ cores, CPU_LIMIT=1", text), text
            assert "stopped 2 ranks" in text, text
        quick = transcripts["01-quickstart.ipynb"][1]
        assert re.search(r"rank 1 of 2: x\[0\] = \S+, sum matches: True", quick), quick
        torch_text = transcripts["03-pytorch-data-parallel.ipynb"][1]
        for pattern in EXPECTED["03-pytorch-data-parallel.ipynb"]:
            assert re.search(pattern, torch_text), f"{name}: {pattern!r} not in\n{torch_text[-5000:]}"
        RESULTS[f"notebook 03, two at once ({name[-5:]})"] = times["03-pytorch-data-parallel.ipynb"]
        RESULTS[f"notebook 01, two at once ({name[-5:]})"] = times["01-quickstart.ipynb"]


CULL_S = 5   # the idle culler's timeout here (a course: an hour)


def test_culled_server_leaves_nothing():
    """A hub with the example's idle culler (here after CULL_S idle; each server reports its
    activity to the hub every second): a student, with a JupyterLab page open (its polling of
    the server's API is activity, also while ``%ring start`` runs silently), starts a cluster,
    closes the page and goes idle; the culler stops the server and no process of the student
    remains."""
    student = f"jrlabd{os.getpid() % 10000}"
    lab = LabHub([student], cull_timeout=CULL_S, activity_interval=1)
    try:
        lab.start()
        lab.spawn(student)
        with lab.page_open(student):
            kernel = lab.kernel(student)
            assert "1 ranks ready" in _ok(kernel.execute("%load_ext jupyter_ring\n%ring start",
                                                         timeout=120))
            assert len(user_processes(lab.uid(student))) >= 4
            kernel.close()
        t0 = time.perf_counter()
        deadline = time.monotonic() + 90
        while lab.server_pid(student) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not lab.server_pid(student), f"the idle culler did not stop the server:\n{lab.log()}"
        culled = time.perf_counter() - t0
        # idle for the timeout first: the culler counts from the last activity, not from its start
        assert culled >= CULL_S / 2, f"culled {culled:.1f} s after the page closed"
        left = _wait_gone(lab.uid(student), 20)
        assert not left, f"after the culler stopped the server, still running:\n{left}"
        RESULTS[f"culled ({CULL_S} s idle) -> no process left (s)"] = time.perf_counter() - t0
        assert "idle-culler" in lab.log(tail=200_000)
    finally:
        survivors = lab.close()
    assert not survivors, survivors


def test_nothing_outlives_a_students_server(hub):
    """B's server stopped through the hub (Stop button, idle culler), A's server SIGKILLed: within
    seconds no process of either student remains (controller, mpiexec, engines, kernel)."""
    a, b = STUDENTS
    for name in STUDENTS:
        _running_cluster(hub, name)
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
    print("\n" + "\n".join([f"{k:45s} {v:6.1f} s" for k, v in RESULTS.items()] + REFUSED))


def _running_cluster(hub, name):
    """The student's kernel with a running cluster: the first test's, or started now (when run
    alone with -k)."""
    kernel = hub.kernels.get(name) or hub.kernels.setdefault(name, hub.kernel(name))
    if "no cluster is running" in _ok(kernel.execute("%load_ext jupyter_ring\n%ring status")):
        _ok(kernel.execute("%ring start", timeout=120))
    return kernel


# One forged ipyparallel Client, run by student B: ``python -c _FORGED_CLIENT connection.json``
_FORGED_CLIENT = """\
import os, signal, sys, traceback
stage = 'the Client'   # what is waited for, should it never answer
def stuck(signum, frame):
    # no answer at all (once in CI one of the four hung for 90 s): refused too, unless the Client
    # had connected (then 'CONNECTED', which fails the test)
    where = traceback.extract_stack(frame)[-1]
    print(f'RESULT {"CONNECTED, " if stage != "the Client" else ""}no answer within 30 s from '
          f'{stage} (waiting in {where.name}, {os.path.basename(where.filename)}:{where.lineno})', flush=True)
    os._exit(0)
signal.signal(signal.SIGALRM, stuck)
signal.alarm(30)
import ipyparallel as ipp
try:
    c = ipp.Client(sys.argv[1], timeout=4)
    stage = 'apply_sync on the engines'
    result = 'CONNECTED ' + repr(c[:].apply_sync(os.getuid))
    c.close()
except Exception as exc:
    result = f'{type(exc).__name__}: {exc}'[:120]
print('RESULT ' + result, flush=True)
os._exit(0)   # not held up by a thread the failed Client left behind
"""


def _try_each(kernel, items, action):
    """Run ``action`` (code using ``item``) in the kernel for each item:
    {str(item): "DONE" or the OSError's type name}."""
    text = _ok(kernel.execute(
        "import json, os, signal\nresults = {}\n"
        f"for item in {items!r}:\n"
        "    try:\n"
        f"        {action}\n"
        "        results[str(item)] = 'DONE'\n"
        "    except OSError as exc:\n"
        "        results[str(item)] = type(exc).__name__\n"
        "print(json.dumps(results))"))
    return json.loads(text.strip().splitlines()[-1])


def _files(top):
    found = []
    for folder, dirs, names in os.walk(top):
        found.extend(os.path.join(folder, n) for n in names)
    return found


def _listening(uids):
    """(user, ip, port, command line, pid) of every listening TCP or bound UDP socket of these
    uids."""
    rows = []
    for conn in psutil.net_connections("inet"):
        if conn.status not in (psutil.CONN_LISTEN, psutil.CONN_NONE) or not conn.pid:
            continue
        try:
            proc = psutil.Process(conn.pid)
            uid = proc.uids().real
            if uid in uids:
                rows.append((uids[uid], conn.laddr.ip, conn.laddr.port,
                             " ".join(proc.cmdline())[:100], proc.pid))
        except psutil.Error:
            pass
    return rows


def _wait_gone(uid, timeout):
    deadline = time.monotonic() + timeout
    while True:
        left = user_processes(uid)
        if not left or time.monotonic() > deadline:
            return "\n".join(f"{p.pid} {' '.join(p.cmdline())[:150]}" for p in left
                             if p.is_running())
        time.sleep(0.2)


