"""Security of a one-host cluster: loopback-only sockets, owner-only files, authenticated (and by
default encrypted) messages, and another Unix user refused.

Real clusters (RingCluster: controller, mpiexec.gforker, engines and their nannies), real zmq
sockets sending forged messages, a real throwaway Unix user. Each test runs against a cluster
with CurveZMQ on (the default) and one with it off (HMAC signatures only).
Run with ``-s`` to see the listeners, the modes and what each forged attempt got.
"""

import glob
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import psutil
import pytest
import zmq
from jupyter_client.session import Session

from jupyter_ring.launch import local_mpiexec
from jupyter_ring.cluster import RingCluster
from jupyter_ring.cluster._machine import profile_dir as _profile_dir

LOOPBACK = ("127.0.0.1", "::1")
OWNER_DIRS = ("security", "log", "pid")  # where ipyparallel and jupyter_ring write


def _loose_files(profile):
    """Files under the profile's owner-only folders that group or others may read right now."""
    found = set()
    for sub in OWNER_DIRS:
        for root, _dirs, files in os.walk(os.path.join(profile, sub)):
            for name in files:
                path = os.path.join(root, name)
                try:
                    mode = os.stat(path).st_mode
                except FileNotFoundError:  # replaced or removed between listing and stat
                    continue
                if mode & 0o077:
                    found.add((path, oct(mode & 0o777)))
    return found


@pytest.fixture(scope="module", params=[True, False], ids=["curve", "hmac-only"])
def ring(request):
    """A started 2-rank cluster; while it started, a thread polled its files' modes (~every ms)."""
    profile = _profile_dir()
    before = _loose_files(profile)  # other tests' leftovers are not this start's doing
    seen, done = set(), threading.Event()

    def poll():
        while not done.is_set():
            seen.update(_loose_files(profile) - before)
            time.sleep(0.001)

    cluster = RingCluster(n=2, gpus="none", encrypt=request.param)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        cluster.start()
    finally:
        done.set()
        poller.join(5)
    procs = cluster.processes()
    try:
        yield cluster, seen
    finally:
        cluster.stop()
        _gone, alive = psutil.wait_procs(procs, timeout=5)
        for proc in alive:
            proc.kill()
        assert not alive, f"cluster processes survived stop: {[p.pid for p in alive]}"


def _role(proc, cluster):
    """What a process of the cluster is, for the printed table."""
    ranks = {row["pid"]: row["rank"] for row in cluster.ranks}
    cmd = " ".join(proc.cmdline())
    if proc.pid in ranks:
        return f"engine (rank {ranks[proc.pid]})"
    if proc.cmdline() and os.path.basename(proc.cmdline()[0]).startswith("mpiexec"):
        return os.path.basename(proc.cmdline()[0])
    if "ipyparallel.controller" in cmd:
        parent = proc.parent()
        if parent is not None and "ipyparallel.controller" in " ".join(parent.cmdline()):
            return "scheduler (controller's child)"
        return "controller"
    if "ipyparallel.engine" in cmd:
        return "nanny (engine's child)"
    return os.path.basename(proc.cmdline()[0]) if proc.cmdline() else proc.name()


def _listeners(cluster):
    """(pid, role, address, port) of every listening TCP or bound UDP socket of the tree."""
    rows = []
    for proc in cluster.processes():
        try:
            name = _role(proc, cluster)
            for conn in proc.net_connections(kind="inet"):
                listening = conn.status == psutil.CONN_LISTEN or (
                    conn.type == psutil.socket.SOCK_DGRAM and conn.laddr and not conn.raddr)
                if listening:
                    rows.append((proc.pid, os.path.basename(name), conn.laddr.ip, conn.laddr.port))
        except psutil.NoSuchProcess:
            continue
    return rows


def _cluster_files(cluster):
    security = os.path.join(cluster.ipp_cluster.profile_dir, "security")
    cid = cluster.ipp_cluster.cluster_id
    files = glob.glob(os.path.join(security, f"*{cid}*"))
    files += [es.output_file for es in cluster.ipp_cluster.engines.values()]
    files.append(cluster.ipp_cluster.controller.output_file)
    files.append(cluster._watchdog.path)  # the watchdog's list of pids
    return sorted(set(f for f in files if f and os.path.exists(f)))


def test_every_socket_of_the_cluster_is_on_loopback(ring):
    cluster, _ = ring
    rows = _listeners(cluster)
    print(f"\nlisteners (encrypt={cluster.encrypt}): {len(rows)} sockets, "
          f"{len({r[3] for r in rows})} ports")
    by_proc = {}
    for pid, name, ip, port in rows:
        by_proc.setdefault((name, pid), set()).add(ip)
    for proc in sorted(cluster.processes(), key=lambda p: p.pid):
        name = _role(proc, cluster)
        ips = by_proc.get((name, proc.pid), set())
        count = sum(1 for r in rows if r[0] == proc.pid)
        print(f"  {proc.pid:>7}  {name:<32} {count} listening on {sorted(ips) or '-'}")
    assert rows, "found no listening socket at all: the psutil scan is broken"
    launcher = os.path.basename(local_mpiexec())
    assert any(_role(p, cluster) == launcher for p in cluster.processes()), \
        f"no {launcher} in the cluster's processes"
    outside = [row for row in rows if row[2] not in LOOPBACK]
    assert not outside, f"sockets reachable from other hosts: {outside}"


def test_files_are_owner_only_from_creation(ring):
    cluster, seen_loose = ring
    files = _cluster_files(cluster)
    print(f"\nfiles (encrypt={cluster.encrypt}):")
    for path in files:
        print(f"  {oct(os.stat(path).st_mode & 0o777)}  {path}")
    names = " ".join(os.path.basename(f) for f in files)
    for kind in ("client.json", "engine.json", "cluster-", "jupyter_ring-", "ipcontroller-"):
        assert kind in names, f"no {kind} file among {names}: the cluster's files moved?"
    # a cluster's folders (the ranks' where files, issue 22, and in them each rank's recent cells'
    # sources) are 0700, every file in them 0600, at any depth
    folders = [f for f in files if os.path.isdir(f)]
    files = [f for f in files if not os.path.isdir(f)]
    for top in list(folders):
        for root, dirs, names in os.walk(top):
            folders += [os.path.join(root, d) for d in dirs]
            files += [os.path.join(root, n) for n in names]
    assert all(os.stat(d).st_mode & 0o777 == 0o700 for d in folders), \
        [(d, oct(os.stat(d).st_mode)) for d in folders]
    assert all(os.stat(f).st_mode & 0o777 == 0o600 for f in files), \
        [(f, oct(os.stat(f).st_mode)) for f in files]
    for sub in OWNER_DIRS:
        mode = os.stat(os.path.join(cluster.ipp_cluster.profile_dir, sub)).st_mode & 0o777
        assert mode == 0o700, f"{sub}/ is {oct(mode)}"
    # What proves "from creation": every process that writes them runs under umask 077 (the
    # kernel during start, the controller, mpiexec, the nannies), so no file is ever created
    # with group/other bits; the poll (every ~ms during start) is extra evidence, not proof.
    assert not seen_loose, f"world/group-readable while the cluster started: {seen_loose}"
    rank_pids = {row["pid"] for row in cluster.ranks}
    user_umask = os.umask(0o022)
    os.umask(user_umask)
    for proc in cluster.processes():
        with open(f"/proc/{proc.pid}/status") as f:
            umask = int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
        expected = user_umask if proc.pid in rank_pids else 0o077
        assert umask == expected, (proc.pid, proc.name(), oct(umask), oct(expected))


def test_cells_write_files_with_the_users_umask(ring, tmp_path):
    cluster, _ = ring
    path = str(tmp_path / "from-rank.txt")
    cluster.view.execute(f"if ring.rank() == 0: open({path!r}, 'w').write('x')").get(timeout=30)
    user_umask = os.umask(0o022)
    os.umask(user_umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~user_umask


def _engine_idents(cluster):
    return [cluster.client._engines[eid].encode() for eid in cluster.engine_ids]


def _execute_request(code):
    return {"code": code, "silent": False, "store_history": False, "user_expressions": {},
            "allow_stdin": False}


def _forge(ports, idents, key, curve_serverkey, code, wait=1.5):
    """Send an execute_request (to every engine identity and unrouted) and a shutdown_request to
    every port, signed with ``key``; with ``curve_serverkey`` the sockets use CURVE with it."""
    ctx = zmq.Context()
    session = Session(key=key, username="intruder")
    socks = []
    try:
        for port in ports:
            for ident in [None] + idents:
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                sock.sndtimeo = 500
                if curve_serverkey is not None:
                    sock.curve_serverkey = curve_serverkey
                    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
                sock.connect(f"tcp://127.0.0.1:{port}")
                socks.append(sock)
                try:
                    session.send(sock, "execute_request", _execute_request(code), ident=ident)
                    session.send(sock, "shutdown_request", {"restart": False}, ident=ident)
                except zmq.Again:
                    pass
        time.sleep(wait)
        replies = 0
        for sock in socks:
            while sock.poll(0):
                sock.recv_multipart()
                replies += 1
        return replies
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()


def _log_notes(cluster, since):
    """Lines the controller and engines logged about bad messages since byte offsets ``since``."""
    notes = []
    for path, offset in since.items():
        with open(path, errors="replace") as f:
            f.seek(offset)
            notes += [line.strip() for line in f
                      if any(w in line.lower() for w in ("invalid", "signature", "digest", "curve"))]
    return notes


def test_forged_requests_run_nothing_and_stop_nothing(ring, tmp_path):
    cluster, _ = ring
    ports = sorted({row[3] for row in _listeners(cluster)})
    idents = _engine_idents(cluster)
    logs = {f: os.path.getsize(f) for f in _cluster_files(cluster) if f.endswith(".log")}
    attempts = [("wrong key", uuid.uuid4().hex.encode(),
                 zmq.curve_keypair()[0] if cluster.encrypt else None),
                ("no key", b"", None)]
    print(f"\nforged requests (encrypt={cluster.encrypt}) to {len(ports)} ports:")
    for label, key, curve_key in attempts:
        marker = tmp_path / f"forged-{label.replace(' ', '-')}"
        code = f"open({str(marker)!r}, 'w').write('forged')"
        replies = _forge(ports, idents, key, curve_key, code)
        print(f"  {label:<9} curve={'random server key' if curve_key else 'off'}: "
              f"marker written: {marker.exists()}, replies: {replies}")
        assert not marker.exists(), f"a request signed with the {label} ran on the engines"
    notes = _log_notes(cluster, logs)
    print(f"  logged: {sum('Invalid Signature' in n for n in notes)} 'Invalid Signature' "
          f"rejections, {len(notes)} lines in all" + (f"; first: {notes[0][:90]}" if notes else ""))
    # the cluster still works, and the same code sent by the real client does write its marker
    real = tmp_path / "real"
    cluster.view.execute(f"open({str(real)!r} + str(ring.rank()), 'w').write('real')").get(timeout=30)
    assert sorted(os.listdir(tmp_path)) == ["real0", "real1"]
    assert cluster.dead_ranks() == []


# ------------------------------------------------------------------------ another Unix user
_INTRUDER = r"""
import json, os, signal, sys, time
import zmq
from jupyter_client.session import Session
args = json.loads(sys.argv[1])
out = {"read": {}, "kill": {}}
for path in args["paths"]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path).read()
        out["read"][path] = "read"
    except OSError as exc:
        out["read"][path] = type(exc).__name__
for pid in args["pids"]:
    try:
        os.kill(pid, signal.SIGTERM)
        out["kill"][pid] = "sent"
    except OSError as exc:
        out["kill"][pid] = type(exc).__name__
ctx = zmq.Context()
subs = []
for port in args["ports"]:
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    subs.append(sub)
session = Session(key=b"guessed-key", username="intruder")
for port in args["ports"]:
    for ident in [None] + [i.encode() for i in args["idents"]]:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndtimeo = 500
        sock.connect(f"tcp://127.0.0.1:{port}")
        code = f"open({args['marker']!r}, 'w').write('x')"
        try:
            session.send(sock, "execute_request", {"code": code, "silent": False,
                         "store_history": False, "user_expressions": {}, "allow_stdin": False},
                         ident=ident)
            session.send(sock, "shutdown_request", {"restart": False}, ident=ident)
        except zmq.Again:
            pass
print("ready", flush=True)
heard, deadline = b"", time.monotonic() + args["listen"]
while time.monotonic() < deadline:
    for sub in subs:
        while sub.poll(0):
            heard += b"".join(sub.recv_multipart())
    time.sleep(0.01)
out["heard_secret"] = args["secret"].encode() in heard
out["heard_bytes"] = len(heard)
print(json.dumps(out), flush=True)
"""


def _intruder_python():
    """An interpreter another user can run with the venv's packages: sys.executable when every
    folder above it is traversable, else the system python3 of the same version."""
    candidates = [os.path.realpath(sys.executable), "/usr/bin/python3"]
    for py in candidates:
        folders = [os.path.dirname(py)]
        while folders[-1] != "/":
            folders.append(os.path.dirname(folders[-1]))
        if not all(os.stat(d).st_mode & 0o001 for d in folders):
            continue
        version = subprocess.run([py, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        if version == str(sys.version_info[:2]):
            return py
    return None


@pytest.fixture(scope="module")
def intruder():
    """A throwaway Unix user (removed afterwards) and the interpreter it runs."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("creating a second Unix user needs root and useradd")
    py = _intruder_python()
    if py is None:
        pytest.skip("no Python of this version that another user may run (the venv's is under a "
                    "private folder and /usr/bin/python3 differs)")
    name = f"jrsec{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True, timeout=30)
    try:
        yield pwd.getpwnam(name), py
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30)
        try:
            pwd.getpwnam(name)
            pytest.fail(f"could not remove the throwaway user {name}")
        except KeyError:
            pass


def test_another_user_cannot_read_sign_signal_or_listen(ring, intruder):
    cluster, _ = ring
    user, py = intruder
    profile = cluster.ipp_cluster.profile_dir
    paths = _cluster_files(cluster) + [os.path.join(profile, sub) for sub in OWNER_DIRS]
    pids = [p.pid for p in cluster.processes()]
    drop = tempfile.mkdtemp(prefix="jr_sec_")  # where the forged code would write (as the owner)
    marker = os.path.join(drop, "intruder-ran")
    secret = f"secret-{uuid.uuid4().hex}"
    site = [p for p in sys.path if p.endswith("site-packages")]
    args = {"paths": paths, "pids": pids, "ports": sorted({r[3] for r in _listeners(cluster)}),
            "idents": [i.decode() for i in _engine_idents(cluster)], "marker": marker,
            "secret": secret, "listen": 3.0}
    proc = subprocess.Popen([py, "-c", _INTRUDER, json.dumps(args)], user=user.pw_uid,
                            group=user.pw_gid, extra_groups=[], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/",
                            env={"PYTHONPATH": os.pathsep.join(site), "HOME": "/nonexistent",
                                 "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        # the owner's cell prints a secret while the intruder listens on every port
        cluster.view.execute(f"print({secret!r})").get(timeout=30)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    print(f"\nanother user (uid {user.pw_uid}), encrypt={cluster.encrypt}:")
    print("  read:", sorted(set(result["read"].values())), "of", len(paths), "files/folders")
    print("  kill:", sorted(set(result["kill"].values())), "of", len(pids), "processes")
    print(f"  forged execute ran: {os.path.exists(marker)}; heard {result['heard_bytes']} bytes "
          f"on the ports, the secret output among them: {result['heard_secret']}")
    try:
        assert set(result["read"].values()) == {"PermissionError"}, result["read"]
        assert set(result["kill"].values()) == {"PermissionError"}, result["kill"]
        assert not os.path.exists(marker), "the other user's forged request ran on the engines"
        if cluster.encrypt:
            assert not result["heard_secret"], "the other user read the ranks' output"
        assert cluster.dead_ranks() == []
        assert cluster.view.execute("ring.rank()").get(timeout=30) is not None
    finally:
        shutil.rmtree(drop, ignore_errors=True)
