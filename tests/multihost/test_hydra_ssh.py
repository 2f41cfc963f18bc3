"""A cluster across two hosts, started from a real kernel with MPICH's Hydra over ssh.

The hosts are network namespaces with their own hostname and sshd (tests/multihost/twohosts.py);
the kernel runs on the first one, as a notebook on a login node would. Ranks talk over TCP
(``UCX_TLS=tcp,self``: otherwise UCX quietly uses shared memory between the namespaces).
"""

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from real_kernel import Kernel  # noqa: E402  (tests/ is on sys.path)
from twohosts import TwoHosts, built, missing  # noqa: E402

CLUSTER_PROCS = re.compile(rb"ipyparallel|ipengine|ipcontroller|mpiexec|hydra_pmi_proxy")


@pytest.fixture(scope="module")
def hosts():
    """Two hosts for the module; torn down in a finally, and nothing of them may be left."""
    why = missing()
    if why:
        pytest.skip(f"two simulated hosts: {why}")
    with built(TwoHosts) as two:
        yield two


class HostKernel(Kernel):
    """A real IPython kernel running on host ``i`` (its namespace and hostname).

    The kernel talks to this test over Unix sockets (transport ipc): its loopback is the host's
    own, which this test process cannot reach.
    """

    def __init__(self, hosts, i, env, prefix=()):
        self.dir = tempfile.mkdtemp(prefix="jr_kernel_", dir=hosts.dir)
        spec_dir = os.path.join(self.dir, "kernels", "onhost")
        os.makedirs(spec_dir)
        argv = hosts.cmd(i, [*prefix, sys.executable, "-m", "ipykernel_launcher", "-f",
                             "{connection_file}"])
        with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
            json.dump({"argv": argv, "display_name": "on host", "language": "python"}, f)
        ksm = KernelSpecManager(kernel_dirs=[os.path.join(self.dir, "kernels")])
        self.km = KernelManager(kernel_name="onhost", kernel_spec_manager=ksm, transport="ipc",
                                connection_file=os.path.join(self.dir, "kernel.json"))
        self.km.ip = os.path.join(self.dir, "k")
        self.cwd = os.path.join(self.dir, "cwd")  # the notebook's folder: must stay empty
        os.makedirs(self.cwd)
        self.km.start_kernel(env=env, cwd=self.cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=60)
        except BaseException:
            self.close()
            raise


def host_env(hosts):
    env = dict(os.environ, **hosts.env())
    env.update(UCX_TLS="tcp,self", PYTHONUNBUFFERED="1")
    return env


def cluster_procs(hosts, i):
    """Processes of a cluster (controller, mpiexec, Hydra proxies, engines) on host i."""
    found = []
    for pid in hosts.pids(i):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if CLUSTER_PROCS.search(cmdline):
            found.append((pid, cmdline.replace(b"\0", b" ").decode(errors="replace")[:120]))
    return found


def wait_no_cluster(hosts, timeout):
    """Wait until neither host runs a cluster process; return what is left per host."""
    deadline = time.monotonic() + timeout
    while True:
        left = {h["name"]: cluster_procs(hosts, i) for i, h in enumerate(hosts.hosts)}
        if not any(left.values()) or time.monotonic() > deadline:
            return {k: v for k, v in left.items() if v}
        time.sleep(0.1)


@pytest.fixture
def kernel(hosts):
    """A kernel on host a with jupyter_ring loaded; killed, and both hosts checked, after."""
    k = HostKernel(hosts, 0, host_env(hosts))
    try:
        k.ok("%load_ext jupyter_ring")
        yield k
    finally:
        k.close()
        left = wait_no_cluster(hosts, 10)
        for procs in left.values():
            for pid, _ in procs:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        assert not left, f"cluster processes left after the kernel shut down: {left}"


ALLREDUCE_CHECK = """\
import numpy as np
_r, _n = ring.rank(), ring.size()
def _data(q, length):  # random integers as float64: sums are exact in any order
    return np.random.default_rng(1000 * q + length).integers(-999, 999, length).astype(np.float64)
for _len in (0, 1, _n - 1, _n + 1, 13, 1 << 16):
    _y = ring.allreduce(_data(_r, _len), op=ring.Sum, name=f"len{_len}")
    _want = sum(_data(q, _len) for q in range(_n))
    assert np.array_equal(_y, _want), (_len, _y[:4], _want[:4])
print("ok", _r, ring.local_rank(), ring.local_size(), ring.cross_rank(), ring.cross_size())
"""


def topology(out):
    rows = {}
    for line in out.splitlines():
        m = re.search(r"ok (\d+) (\d+) (\d+) (\d+) (\d+)", line)
        if m:
            r, *rest = map(int, m.groups())
            rows[r] = tuple(rest)
    return rows


def test_hostfile_cluster_across_two_hosts(hosts, kernel):
    """--hostfile: 2 ranks per host, the controller on the routable address, hostnames and
    topology right on every rank, allreduce exact over TCP, and %ring stop leaves no process
    on either host."""
    a, b = hosts.hosts
    out = kernel.ok(f"%ring start --hostfile {hosts.hostfile} --gpus none", timeout=120)
    assert f"controller listening on {a['ip']}" in out, out
    table = re.findall(r"^(\d+)\s+(\S+)\s+\d+\s+cpu$", out, re.M)
    assert [h for _, h in table] == [a["name"]] * 2 + [b["name"]] * 2, out
    for i in range(2):
        assert cluster_procs(hosts, i), f"no engine on {hosts.hosts[i]['name']}"
    out = kernel.ok("%%distributed\n" + ALLREDUCE_CHECK, timeout=120)
    # rank -> (local_rank, local_size, cross_rank, cross_size)
    assert topology(out) == {0: (0, 2, 0, 2), 1: (1, 2, 0, 2), 2: (0, 2, 1, 2),
                             3: (1, 2, 1, 2)}, out
    kernel.ok("%ring stop", timeout=60)
    left = wait_no_cluster(hosts, 10)
    assert not left, f"%ring stop left processes: {left}"


RING_HOPS = """\
import numpy as np
from jupyter_ring.runtime import _api
_rt = _api.running_runtime()
_n = ring.size()
# big enough for the pipelined ring (past the eager path), odd rows for reducescatter
def _ints(q, shape):  # random integers as float64: sums are exact in any order
    return np.random.default_rng(q).integers(-999, 999, shape).astype(np.float64)
_len = 3 * (1 << 15) + 1
_auto = ring.config().allreduce
ring.config().allreduce = "ring"  # the ring's order is what this checks (auto takes the hierarchy)
_y = ring.allreduce(_ints(ring.rank(), _len), op=ring.Sum, name="hops")
ring.config().allreduce = _auto
assert np.array_equal(_y, sum(_ints(q, _len) for q in range(_n)))
_shape = (2 * _n + 1, 1 << 12)
_z = ring.reducescatter(_ints(100 + ring.rank(), _shape), op=ring.Sum, name="rs")
_mine = 2 + (1 if ring.rank() < 1 else 0)
_lo = 2 * ring.rank() + min(ring.rank(), 1)
assert np.array_equal(_z, sum(_ints(100 + q, _shape) for q in range(_n))[_lo:_lo + _mine]), _z.shape
_phases = [p for rec in _rt.trace.records if rec[1] == "hops" for p in rec[5]]
_net = sorted({p.split(" from ")[1] for p in _phases if "(network)" in p})
print("order", ring.rank(), _rt.ring_order, "network-left", _net)
"""


def test_round_robin_placement_gets_a_host_contiguous_ring(hosts, kernel):
    """--hosts a,b -n 4: Hydra deals ranks round-robin (0,2 on a; 1,3 on b); GPUs go by local
    rank on each host (--gpus 0,1 here: only CUDA_VISIBLE_DEVICES is set). The ring still
    visits each host's ranks together, so only the first rank of each host receives over the
    network (named in its per-hop trace phases), and allreduce/reducescatter are exact."""
    a, b = hosts.hosts
    out = kernel.ok(f"%ring start --hosts {a['name']},{b['name']} -n 4 --gpus 0,1",
                    timeout=120)
    # GPUs are pinned by local rank: ranks 0 and 2 are local 0 and 1 on a, 1 and 3 on b
    table = re.findall(r"^(\d+)\s+(\S+)\s+\d+\s+cuda:0 \(GPU (\d)\)$", out, re.M)
    assert table == [("0", a["name"], "0"), ("1", b["name"], "0"), ("2", a["name"], "1"),
                     ("3", b["name"], "1")], out
    out = kernel.ok("%%distributed\n" + RING_HOPS, timeout=120)
    rows = {int(r): (json.loads(order), net) for r, order, net in
            re.findall(r"order (\d) (\[[\d, ]+\]) network-left (\[.*\])", out)}
    assert sorted(rows) == [0, 1, 2, 3], out
    assert {tuple(order) for order, _ in rows.values()} == {(0, 2, 1, 3)}, out
    # ring 0 -> 2 -> 1 -> 3 -> 0: rank 1 receives from 2 (on a), rank 0 from 3 (on b) over the
    # network; 2 and 3 receive from their own host
    assert rows[1][1] == f"['2 @ {a['name']} (network)']", out
    assert rows[0][1] == f"['3 @ {b['name']} (network)']", out
    assert rows[2][1] == "[]" and rows[3][1] == "[]", out
    kernel.ok("%ring stop", timeout=60)


# every rank's random integers (65,537: prime), the sum each rank expects computed from the shared
# seeds; every result until the cut is checked on every rank
LONG_ALLREDUCE = """\
import time
import numpy as np
_xs = [np.random.default_rng(4099 + q).integers(-1000, 1000, 65537) for q in range(ring.size())]
_want = np.sum(_xs, axis=0)
_t0 = time.monotonic()
while time.monotonic() - _t0 < 60:
    assert np.array_equal(ring.allreduce(_xs[ring.rank()], op=ring.Sum, name="loop"), _want)
"""


def test_host_cut_off_mid_collective(hosts):
    """Host b's veth goes down while every rank loops on allreduce: the cell fails (no hang)
    within the stall timeout with a DeadRankError naming b's ranks and host; %ring stop leaves
    nothing on a, and b's engines end on their own once the controller's heartbeat is gone
    (IPEngine.max_heartbeat_misses) and MPI_Finalize is bounded (finalize_timeout)."""
    a, b = hosts.hosts
    stall = 8
    env = dict(host_env(hosts), JUPYTER_RING_STALL_TIMEOUT=str(stall),
               JUPYTER_RING_FINALIZE_TIMEOUT="3")
    k = HostKernel(hosts, 0, env)
    try:
        k.ok("%load_ext jupyter_ring")
        k.ok(f"%ring start --hostfile {hosts.hostfile} --gpus none", timeout=120)
        cut_at = []
        timer = threading.Timer(3, lambda: (hosts.cut(1), cut_at.append(time.monotonic())))
        timer.start()
        try:
            out, error = k.execute("%%distributed\n" + LONG_ALLREDUCE, timeout=90)
        finally:
            timer.cancel()
        took = time.monotonic() - cut_at[0]
        assert error is not None and error["ename"] == "DeadRankError", (error, out)
        assert f"ranks 2, 3 @ {b['name']} stopped answering" in error["evalue"], error["evalue"]
        assert took < stall + 5, f"the cut-off host was reported {took:.1f} s after the cut"
        k.ok("%ring stop", timeout=60)
        left = wait_no_cluster(hosts, 15)
        assert a["name"] not in left, f"%ring stop left processes on {a['name']}: {left}"
        left = wait_no_cluster(hosts, 60)
        assert not left, f"{b['name']} (cut off) kept cluster processes for 60 s: {left}"
    finally:
        k.close()
        hosts.heal(1)


def test_host_dies_mid_collective(hosts, kernel):
    """Every process on host b (sshd too) is SIGKILLed mid-allreduce: Hydra ends the whole job,
    the cell fails at once with a DeadRankError that names b's ranks and host (with a's, which
    MPI ended), and %ring stop leaves nothing on a."""
    a, b = hosts.hosts
    kernel.ok(f"%ring start --hostfile {hosts.hostfile} --gpus none", timeout=120)
    died_at = []

    def die():
        for pid in hosts.pids(1):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        died_at.append(time.monotonic())

    timer = threading.Timer(3, die)
    timer.start()
    try:
        out, error = kernel.execute("%%distributed\n" + LONG_ALLREDUCE, timeout=90)
        took = time.monotonic() - died_at[0]
        assert error is not None and error["ename"] == "DeadRankError", (error, out)
        assert f"ranks 2, 3 @ {b['name']}" in error["evalue"], error["evalue"]
        assert took < 15, f"the dead host was reported {took:.1f} s after it died"
        kernel.ok("%ring stop", timeout=60)
        left = wait_no_cluster(hosts, 15)
        assert not left, f"processes left after host b died and %ring stop: {left}"
    finally:
        timer.cancel()
        if died_at:  # the other tests of the module need b's sshd
            hosts.restart_sshd(1)


def test_kernel_killed_cleans_both_hosts(hosts):
    """SIGKILL to the kernel on a: its watchdog ends the controller and mpiexec, ssh closes,
    and no cluster process is left on either host."""
    k = HostKernel(hosts, 0, host_env(hosts))
    try:
        k.ok("%load_ext jupyter_ring")
        k.ok(f"%ring start --hostfile {hosts.hostfile} --gpus none", timeout=120)
        assert all(cluster_procs(hosts, i) for i in range(2))
        t0 = time.monotonic()
        k.km.provisioner.process.send_signal(signal.SIGKILL)
        # the kernel runs under `ip netns exec ... unshare ... sh -c exec`: the same pid
        left = wait_no_cluster(hosts, 30)
        took = time.monotonic() - t0
        assert not left, f"cluster processes left 30 s after the kernel was killed: {left}"
        print(f"both hosts clean {took:.1f} s after the kernel was killed")
    finally:
        k.close()


# ------------------------------------------------------------------- the Ring panel under Hydra
class _UnixHTTP(http.client.HTTPConnection):
    """HTTP over a Unix socket: the server runs in host a's network namespace, which this
    process cannot reach over TCP, but the socket file is on the shared filesystem."""

    def __init__(self, path, timeout=60):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


@contextlib.contextmanager
def lab_server(hosts, env):
    """A real Jupyter server with the Ring panel's routes, on host a (as JupyterLab beside the
    kernel would run), listening on a Unix socket; yields ``request(method, path)``."""
    folder = tempfile.mkdtemp(prefix="jr_server_", dir=hosts.dir)
    sock, token = os.path.join(folder, "server.sock"), uuid.uuid4().hex
    log = open(os.path.join(folder, "server.log"), "w")
    proc = subprocess.Popen(hosts.cmd(0, [
        sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root",
        f"--ServerApp.sock={sock}", f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={folder}",
        "--ServerApp.jpserver_extensions={'jupyter_ring.server': True}"]),
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def request(method, path):
        conn = _UnixHTTP(sock)
        try:
            conn.request(method, path, body=b"" if method == "POST" else None,
                         headers={"Authorization": f"token {token}"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if request("GET", "/jupyter-ring/clusters")[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(log.name) as f:
                    raise RuntimeError(f"the Jupyter server on host a did not come up:\n{f.read()[-3000:]}")
            time.sleep(0.2)
        yield request
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()


def test_panel_interrupt_pressed_twice_on_a_hydra_cluster(hosts, kernel):
    """The Ring panel's Interrupt, pressed twice at once while every rank of a 4-rank cluster
    across two hosts (Hydra over ssh) loops on allreduce: the cell ends with KeyboardInterrupt,
    no rank dies (a second SIGINT to Hydra's mpiexec would abort the whole job), and the next
    cell on the same cluster finds its variables and runs exact allreduces."""
    kernel.ok(f"%ring start --hostfile {hosts.hostfile} --gpus none", timeout=120)
    kernel.ok("%%distributed\nkept = ring.rank() * 10")
    cid = kernel.ok("print(get_ipython().magics_manager.registry['RingMagics']"
                    ".cluster.ipp_cluster.cluster_id)").strip()
    with lab_server(hosts, host_env(hosts)) as request:
        answers = []

        def press_twice():
            presses = [threading.Thread(target=lambda: answers.append(request(
                "POST", f"/jupyter-ring/clusters/{cid}/interrupt"))) for _ in range(2)]
            for t in presses:
                t.start()
            for t in presses:
                t.join(60)

        timer = threading.Timer(4, press_twice)
        timer.start()
        try:
            out, error = kernel.execute("%%distributed\n" + LONG_ALLREDUCE, timeout=90)
        finally:
            timer.join(70)
    assert [status for status, _ in answers] == [200, 200], answers
    assert all(len(json.loads(body)["engines"]) == 4 for _, body in answers), answers
    # every rank stopped by the interrupt: CellInterrupted ("interrupted by the Ring panel's
    # Interrupt") when the kernel saw every rank's KeyboardInterrupt in time, else the ranks'
    # KeyboardInterrupt in one headline; either way no rank is blamed for another's error
    assert error is not None and error["ename"] in ("CellInterrupted", "DistributedError"), (error, out)
    assert ("interrupted by" in error["evalue"] if error["ename"] == "CellInterrupted"
            else "KeyboardInterrupt" in error["evalue"]), error["evalue"]
    time.sleep(0.5)  # a late second SIGINT lands on idle engines: they must live
    status = kernel.ok("%ring status")
    assert "4 ranks alive" in status, status
    out = kernel.ok("%%distributed\nprint('kept', ring.rank(), kept)\n" + ALLREDUCE_CHECK,
                    timeout=120)
    assert sorted(re.findall(r"kept (\d) (\d+)", out)) == [(str(r), str(10 * r)) for r in range(4)], out
    assert sorted(topology(out)) == [0, 1, 2, 3], out
    kernel.ok("%ring stop", timeout=60)



@pytest.mark.parametrize("placement", ["hostfile", "round-robin"])
def test_every_allreduce_algorithm_is_exact_across_two_hosts(hosts, placement):
    """Issue 33, item 2: 4 ranks, 2 a host, placed by the hostfile (0, 1 on a) or round robin
    (``-hosts a,b``: 0, 2 on a); every rank asserts its exact results for auto, rd, ring and hier,
    and that the hierarchy's step across hosts went over the network (tests/mpi/rt_algorithms.py)."""
    a, b = hosts.hosts
    place = ["-f", hosts.hostfile] if placement == "hostfile" else ["-hosts", f"{a['name']},{b['name']}"]
    root = os.path.dirname(os.path.dirname(HERE))
    env = dict(host_env(hosts), PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    script = os.path.join(os.path.dirname(HERE), "mpi", "rt_algorithms.py")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    proc = subprocess.run(hosts.cmd(0, [mpiexec, *place, "-n", "4", sys.executable, script, "auto,rd,ring,hier"]),
                          env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    ok = sorted(int(rank) for rank in re.findall(r"RANK_OK (\d+)", proc.stdout))  # (ranks' lines may interleave)
    assert proc.returncode == 0 and ok == [0, 1, 2, 3], proc.stdout[-3000:] + proc.stderr[-3000:]
