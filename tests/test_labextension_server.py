"""REST routes of the Ring panel (jupyter_ring.server) against a real jupyter_server and real
MPI clusters of ipyparallel engines."""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytest.importorskip("jupyter_server")
pytest.importorskip("pytest_jupyter", reason="needs pytest-jupyter[server] (in jupyter_ring[test])")

from tornado.httpclient import HTTPClientError  # noqa: E402

from jupyter_ring.launch import find_mpiexec, mpi_env  # noqa: E402
from jupyter_ring.server._clusters import describe_cluster, find_cluster_file  # noqa: E402
from jupyter_ring.cluster._sidecar import read_sidecar, write_sidecar  # noqa: E402

pytest_plugins = ["pytest_jupyter.jupyter_server"]

ROUTES = [("GET", ("jupyter-ring", "clusters")),
          ("GET", ("jupyter-ring", "clusters", "1-abcd")),
          ("POST", ("jupyter-ring", "clusters", "1-abcd", "interrupt")),
          ("POST", ("jupyter-ring", "clusters", "1-abcd", "stop")),
          ("POST", ("jupyter-ring", "clusters", "1-abcd", "attach"))]


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"jupyter_ring.server": True}}}


def _start_code(n):
    """Python that starts an MPI cluster of ``n`` engines on loopback (used here and in a child)."""
    return textwrap.dedent(f"""
        import logging
        import ipyparallel as ipp
        from traitlets.config import Config
        config = Config()
        config.MPIEngineSetLauncher.mpi_cmd = [{find_mpiexec()!r}]
        cluster = ipp.Cluster(engines="mpi", n={n}, controller_ip="127.0.0.1", delay=0,
                              config=config, shutdown_atexit=False, log_level=logging.WARNING,
                              controller_args=["--HeartMonitor.period=500"])
        client = cluster.start_and_connect_sync()
        client.wait_for_engines({n}, timeout=60, block=True)
    """)


@pytest.fixture(scope="module")
def cluster():
    """A 2-rank MPI cluster owned by this test process (stopped at the end of the module)."""
    os.environ.update({k: v for k, v in mpi_env().items() if k not in os.environ})
    namespace = {}
    exec(_start_code(2), namespace)  # noqa: S102 - our own fixed code, not user text
    c, client = namespace["cluster"], namespace["client"]
    procs = _cluster_processes(c.cluster_file)
    yield c, client
    client.close()
    c.stop_cluster_sync()
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        p.kill()
    assert not alive, f"cluster processes survived stop_cluster: {[p.pid for p in alive]}"


def _fetch_error(exc_info):
    return exc_info.value.code, json.loads(exc_info.value.response.body or b"{}")


async def test_every_route_refuses_unauthenticated_requests(jp_fetch):
    for method, parts in ROUTES:
        kwargs = {"body": b""} if method == "POST" else {}
        with pytest.raises(HTTPClientError) as exc_info:
            await jp_fetch(*parts, method=method, headers={"Authorization": ""}, **kwargs)
        assert exc_info.value.code in (401, 403), (method, parts, exc_info.value.code)


def _ring_patterns(router):
    """URL regexes of every jupyter-ring route the server registered (walks tornado's routers)."""
    found = []
    for rule in router.rules:
        if hasattr(rule.target, "rules"):
            found += _ring_patterns(rule.target)
        elif "jupyter-ring" in getattr(getattr(rule.matcher, "regex", None), "pattern", ""):
            found.append(rule.matcher.regex.pattern)
    return found


async def test_routes_checked_are_every_route_and_a_wrong_token_is_refused(jp_fetch,
                                                                           jp_serverapp):
    # a route added to setup_handlers but not to ROUTES would escape the check above
    patterns = _ring_patterns(jp_serverapp.web_app.default_router)
    assert len(patterns) >= 3, patterns
    base = jp_serverapp.base_url
    for pattern in patterns:
        assert any(re.fullmatch(pattern, base + "/".join(parts)) for _, parts in ROUTES), \
            f"route {pattern} is not in ROUTES: add it so its authentication is tested"
    for method, parts in ROUTES:
        kwargs = {"body": b""} if method == "POST" else {}
        with pytest.raises(HTTPClientError) as exc_info:
            await jp_fetch(*parts, method=method, headers={"Authorization": "token wrong"},
                           **kwargs)
        assert exc_info.value.code in (401, 403), (method, parts, exc_info.value.code)


async def test_unknown_and_malformed_ids_are_404(jp_fetch):
    for cluster_id in ("1-nope", "..", "a b"):
        with pytest.raises(HTTPClientError) as exc_info:
            await jp_fetch("jupyter-ring", "clusters", cluster_id)
        assert exc_info.value.code == 404
    with pytest.raises(HTTPClientError) as exc_info:
        await jp_fetch("jupyter-ring", "clusters", "1-nope", "stop", method="POST", body=b"")
    assert exc_info.value.code == 404


async def test_list_shows_the_cluster_its_ranks_and_owner(jp_fetch, cluster):
    c, client = cluster
    response = await jp_fetch("jupyter-ring", "clusters")
    clusters = json.loads(response.body)["clusters"]
    (info,) = [x for x in clusters if x["id"] == c.cluster_id]
    assert info["state"] == "running"
    assert info["n"] == 2
    assert info["orphaned"] is False
    assert info["owner"]["pid"] == os.getpid() and info["owner"]["alive"]
    assert info["owner"]["kernel_id"] is None  # started by this test, not by a kernel of the server
    assert info["metrics"] is None
    engine_pids = sorted(client[:].apply_sync(os.getpid))
    assert [r["rank"] for r in info["ranks"]] == [0, 1]
    assert sorted(r["pid"] for r in info["ranks"]) == engine_pids
    for row in info["ranks"]:
        assert row["alive"] is True and row["step"] is None and row["host"]
    response = await jp_fetch("jupyter-ring", "clusters", c.cluster_id)
    assert json.loads(response.body)["ranks"] == info["ranks"]


def test_owner_kernel_and_sidecar_devices(cluster):
    c, client = cluster
    path = find_cluster_file(c.cluster_id)
    info = describe_cluster(path, kernels={os.getpid(): "kernel-abc"})
    assert info["owner"]["kernel_id"] == "kernel-abc"
    rows = [{"rank": i, "host": row["host"], "pid": row["pid"], "device": f"cuda:0 (GPU {i})",
             "step": 10 + i, "total": 50}
            for i, row in enumerate(info["ranks"])]
    sidecar = write_sidecar(c.profile_dir, c.cluster_id, rows, kernel_pid=os.getpid())
    try:
        assert oct(os.stat(sidecar).st_mode & 0o777) == "0o600"
        assert read_sidecar(c.profile_dir, c.cluster_id)["ranks"][1]["device"] == "cuda:0 (GPU 1)"
        info = describe_cluster(path, kernels={os.getpid(): "kernel-abc"})
        assert [r["device"] for r in info["ranks"]] == ["cuda:0 (GPU 0)", "cuda:0 (GPU 1)"]
        assert [(r["step"], r["total"]) for r in info["ranks"]] == [(10, 50), (11, 50)]
        assert all(r["alive"] for r in info["ranks"])
        assert info["owner"]["kernel_id"] == "kernel-abc"
    finally:
        os.remove(sidecar)


async def test_the_running_cell_is_described_and_its_live_view_asked_for(jp_fetch, cluster):
    """A cell its kernel runs (jupyter_ring._live, as %%distributed records it) is in the
    cluster's description; POST .../attach leaves the request the cell's loop takes (409 when
    no cell runs)."""
    from jupyter_ring import _live
    from jupyter_ring.cluster._where import where_dir

    c, client = cluster
    folder = where_dir(c.profile_dir, c.cluster_id)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    try:
        response = await jp_fetch("jupyter-ring", "clusters", c.cluster_id)
        assert json.loads(response.body)["cell"] is None
        with pytest.raises(HTTPClientError) as exc_info:
            await jp_fetch("jupyter-ring", "clusters", c.cluster_id, "attach", method="POST", body=b"")
        code, body = _fetch_error(exc_info)
        assert code == 409 and "no cell is running on this cluster" in body["message"], body
        parent = {"header": {"msg_id": "req-1"}, "metadata": {"cellId": "cell-7"}}
        _live.note_running_cell(folder, parent, 12)
        response = await jp_fetch("jupyter-ring", "clusters", c.cluster_id)
        cell = json.loads(response.body)["cell"]
        assert (cell["cell_id"], cell["msg_id"], cell["execution_count"]) == ("cell-7", "req-1", 12)
        assert cell["kernel_pid"] == os.getpid()
        response = await jp_fetch("jupyter-ring", "clusters", c.cluster_id, "attach", method="POST",
                                  body=b"")
        assert json.loads(response.body)["cell"]["msg_id"] == "req-1"
        assert _live.take_attach_request(folder) and not _live.take_attach_request(folder)
        _live.clear_running_cell(folder)
        response = await jp_fetch("jupyter-ring", "clusters", c.cluster_id)
        assert json.loads(response.body)["cell"] is None
    finally:
        _live.clear_running_cell(folder)


async def test_owner_is_named_by_its_notebook_session(jp_fetch, jp_serverapp, cluster):
    """The owner kernel's session (the server's session manager) names the notebook: a real
    kernel started for ``course/week 1/train.ipynb``, recorded as the owner in the sidecar as
    ``%ring start`` records it."""
    c, client = cluster
    os.makedirs(os.path.join(jp_serverapp.root_dir, "course", "week 1"), exist_ok=True)
    response = await jp_fetch("api", "sessions", method="POST", body=json.dumps({
        "path": "course/week 1/train.ipynb", "type": "notebook", "name": "train.ipynb",
        "kernel": {"name": "python3"}}))
    session = json.loads(response.body)
    kernel_id = session["kernel"]["id"]
    sidecar = None
    try:
        from jupyter_ring.server._clusters import kernel_pids

        pids = {k: pid for pid, k in kernel_pids(jp_serverapp.kernel_manager).items()}
        assert kernel_id in pids, "the session's kernel has no local pid"
        sidecar = write_sidecar(c.profile_dir, c.cluster_id, [], kernel_pid=pids[kernel_id])
        response = await jp_fetch("jupyter-ring", "clusters", c.cluster_id)
        owner = json.loads(response.body)["owner"]
        assert owner["kernel_id"] == kernel_id and owner["pid"] == pids[kernel_id]
        assert owner["session"] == {"path": "course/week 1/train.ipynb", "name": "train.ipynb",
                                    "type": "notebook"}
        response = await jp_fetch("jupyter-ring", "clusters")
        (listed,) = [x for x in json.loads(response.body)["clusters"] if x["id"] == c.cluster_id]
        assert listed["owner"]["session"]["path"] == "course/week 1/train.ipynb"
    finally:
        if sidecar:
            os.remove(sidecar)
        await jp_fetch("api", "sessions", session["id"], method="DELETE")
    # a cluster whose owner has no session (this test process): no session, the route still works
    response = await jp_fetch("jupyter-ring", "clusters", c.cluster_id)
    assert json.loads(response.body)["owner"]["session"] is None


async def test_interrupt_stops_a_running_cell_on_every_rank(jp_fetch, cluster):
    c, client = cluster
    ar = client[:].execute("import time; time.sleep(60)", block=False)
    time.sleep(0.5)
    t0 = time.monotonic()
    response = await jp_fetch("jupyter-ring", "clusters", c.cluster_id, "interrupt",
                              method="POST", body=b"")
    assert json.loads(response.body)["signal"] == "SIGINT"
    assert ar.wait(10), "the cell was still running 10 s after the interrupt"
    assert time.monotonic() - t0 < 10
    with pytest.raises(Exception) as exc_info:
        ar.get()
    assert "KeyboardInterrupt" in str(exc_info.value)
    # The ranks survive an interrupt and keep working.
    client[:].execute("x = 1 + 1", block=True)
    assert client[:].pull("x", block=True) == [2, 2]


def _cluster_processes(path):
    with open(path) as f:
        data = json.load(f)
    pids = [data["controller"]["state"]["pid"]] + [s["pid"] for s in data["engines"]["sets"].values()]
    procs = []
    for pid in pids:
        p = psutil.Process(pid)
        procs += [p] + p.children(recursive=True)
    return procs


async def test_stop_ends_every_process_and_removes_the_cluster(jp_fetch):
    namespace = {}
    exec(_start_code(1), namespace)  # noqa: S102
    c, client = namespace["cluster"], namespace["client"]
    client.close()
    try:
        path = find_cluster_file(c.cluster_id)
        procs = _cluster_processes(path)
        response = await jp_fetch("jupyter-ring", "clusters", c.cluster_id, "stop",
                                  method="POST", body=b"")
        assert json.loads(response.body)["stopped"] is True
        _, alive = psutil.wait_procs(procs, timeout=5)
        assert not alive, [p.pid for p in alive]
        assert not os.path.exists(path)
        response = await jp_fetch("jupyter-ring", "clusters")
        assert c.cluster_id not in [x["id"] for x in json.loads(response.body)["clusters"]]
    finally:
        if c._is_running():
            c.stop_cluster_sync()


async def test_orphaned_cluster_is_shown_and_can_be_stopped(jp_fetch):
    # A process starts a cluster and dies without stopping it (as a SIGKILLed kernel would).
    code = _start_code(1) + "print(cluster.cluster_id, flush=True)\nimport os\nos._exit(0)\n"
    env = mpi_env()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90,
                         env=env, check=True).stdout
    cluster_id = out.split()[-1]
    path = find_cluster_file(cluster_id)
    procs = _cluster_processes(path)
    try:
        response = await jp_fetch("jupyter-ring", "clusters", cluster_id)
        info = json.loads(response.body)
        assert info["orphaned"] is True
        assert info["owner"]["alive"] is False
        assert info["state"] == "running"  # still running: that is what makes it an orphan
        response = await jp_fetch("jupyter-ring", "clusters", cluster_id, "stop",
                                  method="POST", body=b"")
        _, alive = psutil.wait_procs(procs, timeout=5)
        assert not alive, [p.pid for p in alive]
    finally:
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass


# A busy cell: allreduces in a loop, so an interrupt lands inside a collective (or between two).
BUSY = """\
import time
_t0 = time.monotonic()
while time.monotonic() - _t0 < 60:
    ring.allreduce(np.ones(1 << 14), op=ring.Sum, name="busy")
"""


async def test_two_quick_interrupts_only_interrupt_and_the_variables_stay(jp_fetch):
    """The panel's Interrupt pressed twice at once on a busy cell (a one-host, gforker cluster):
    every rank's cell ends with KeyboardInterrupt, no rank dies, and the next cell on the same
    cluster finds its variables and runs an exact allreduce. (Two SIGINTs to MPICH's Hydra
    mpiexec would abort the whole job: the route goes through the nannies; the Hydra case is in
    tests/multihost/test_hydra_ssh.py.)"""
    import asyncio

    import numpy as np

    from jupyter_ring.cluster import RingCluster

    with RingCluster(n=3, gpus="none", watchdog=False) as rc:
        rc.view.execute("import numpy as np\nkept = ring.rank() + 1", block=True)
        ar = rc.view.execute(BUSY)
        time.sleep(1.0)
        assert not ar.ready(), "the busy cell ended before the interrupts"
        cid = rc.ipp_cluster.cluster_id
        responses = await asyncio.gather(*(
            jp_fetch("jupyter-ring", "clusters", cid, "interrupt", method="POST", body=b"")
            for _ in range(2)))
        for response in responses:
            body = json.loads(response.body)
            assert body["signal"] == "SIGINT" and sorted(body["engines"]) == sorted(rc.engine_ids)
        assert ar.wait(15), "the busy cell was still running 15 s after two interrupts"
        errors = ar.get(return_exceptions=True)
        assert [getattr(e, "ename", e) for e in errors] == ["KeyboardInterrupt"] * 3, errors
        time.sleep(0.5)  # a second SIGINT that came late lands on an idle engine: it must live
        assert rc.dead_ranks() == []
        rc.view.execute("z = ring.allreduce(np.array([kept * 1.0]), op=ring.Sum, name='z')",
                        block=True)
        assert [v.tolist() for v in rc.view.pull("z", block=True)] == [[6.0]] * 3
        assert rc.view.pull("kept", block=True) == [1, 2, 3]
    assert not rc.running


async def test_interrupt_and_stop_reach_an_encrypted_ring_cluster(jp_fetch):
    # RingCluster's default: CurveZMQ on, gforker ranks; the server's client must follow suit
    from jupyter_ring.cluster import RingCluster

    rc = RingCluster(n=2, gpus="none", watchdog=False)
    rc.start()
    try:
        assert rc.client.curve_serverkey, "RingCluster started without CurveZMQ"
        procs = rc.processes()
        ar = rc.view.execute("import time; time.sleep(60)")
        time.sleep(0.5)
        cid = rc.ipp_cluster.cluster_id
        await jp_fetch("jupyter-ring", "clusters", cid, "interrupt", method="POST", body=b"")
        assert ar.wait(10), "the cell was still running 10 s after the interrupt"
        with pytest.raises(Exception, match="KeyboardInterrupt"):
            ar.get()
        response = await jp_fetch("jupyter-ring", "clusters", cid, "stop", method="POST", body=b"")
        assert json.loads(response.body)["stopped"] is True
        _, alive = psutil.wait_procs(procs, timeout=5)
        assert not alive, [p.pid for p in alive]
    finally:
        rc.stop()


def test_a_cluster_its_kernel_is_stopping_reads_stopped_not_degraded(tmp_path):
    """Issue 36: the status bar said 'Ring: degraded · 0/2 ranks' after a clean %ring stop (the
    ranks had gone, the controller not yet). The kernel marks its sidecar before it stops
    anything; the route then says stopped. Made-up files: this process stands in for the
    controller, and the ranks' pids are of a process that has exited."""
    from jupyter_ring.cluster._sidecar import mark_stopping, write_sidecar
    from jupyter_ring.server._clusters import describe_cluster

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    profile = tmp_path / "profile_default"
    (profile / "security").mkdir(parents=True)
    path = profile / "security" / "cluster-c1.json"
    path.write_text(json.dumps({"cluster": {"cluster_id": "c1", "profile_dir": str(profile), "n": 2},
                                "controller": {"state": {"pid": os.getpid()}},
                                "engines": {"sets": {}}}))
    rows = [{"rank": r, "host": os.uname().nodename, "pid": gone.pid, "device": "cpu"} for r in (0, 1)]
    write_sidecar(str(profile), "c1", rows, kernel_pid=os.getpid(), connection_file=None)
    assert describe_cluster(str(path))["state"] == "degraded"  # ranks gone, nobody said why
    assert mark_stopping(str(profile), "c1")
    assert describe_cluster(str(path))["state"] == "stopped"


def test_a_cluster_with_ranks_replaced_in_place_reads_running_with_its_restarts(tmp_path):
    """Issue 34 item 4: rank 1 replaced twice (each replacement an engine set of its own, the
    first one ended with the rank it started) is a running 2-rank cluster, 'restarts 2/3', rank 1
    marked; the same files without respawn's fields read degraded (a set ended, 4 engines
    launched for 2 ranks). Made-up files: this process stands in for the live processes."""
    from jupyter_ring.cluster._sidecar import write_sidecar
    from jupyter_ring.server._clusters import describe_cluster

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    profile = tmp_path / "profile_default"
    (profile / "security").mkdir(parents=True)
    path = profile / "security" / "cluster-c2.json"
    sets = {"s0": {"n": 2, "pid": os.getpid()}, "s1": {"n": 1, "pid": gone.pid},
            "s2": {"n": 1, "pid": os.getpid()}}
    path.write_text(json.dumps({"cluster": {"cluster_id": "c2", "profile_dir": str(profile), "n": 2},
                                "controller": {"state": {"pid": os.getpid()}},
                                "engines": {"sets": sets}}))
    rows = [{"rank": r, "host": socket.gethostname(), "pid": os.getpid(), "device": "cpu",
             "replaced": 2 * r} for r in (0, 1)]
    write_sidecar(str(profile), "c2", rows, kernel_pid=os.getpid(), connection_file=None,
                  restarts=(2, 3))
    described = describe_cluster(str(path))
    assert (described["state"], described["n"], described["restarts"]) == ("running", 2, {"used": 2, "max": 3})
    assert [(r["rank"], r["alive"], r["replaced"]) for r in described["ranks"]] == [(0, True, 0), (1, True, 2)]
    write_sidecar(str(profile), "c2", rows, kernel_pid=os.getpid(), connection_file=None)
    described = describe_cluster(str(path))
    assert (described["state"], described["n"], described["restarts"]) == ("degraded", 4, None)
