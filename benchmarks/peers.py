"""jupyter_ring against its peers, each in a real Jupyter kernel driven over its channels.

Usage: python benchmarks/peers.py [--cells 30] [--only ring,px,nbdistributed,jupyter-distributed]
                                  [--cache DIR] [--json FILE]

Systems, 2 CPU ranks each:
- ``ring``: ``%load_ext jupyter_ring``, ``%ring start -n 2``, ``%%distributed`` cells.
- ``px``: ipyparallel ``Cluster(engines="mpi", n=2)`` (same mpiexec) and ``%%px`` cells.
- ``nbdistributed`` 0.1.0: ``%load_ext nbdistributed``, ``%dist_init -n 2``, then auto mode
  (plain cells run on the workers).
- ``jupyter-distributed`` 0.1.1: a Jupyter server with its extension; a python3 kernel is made
  distributed through its REST route ``POST /jupyter-distributed/kernels/<id>``
  ``{"action": "set", "world_size": 2}`` (what its JupyterLab toolbar does); cells go to the
  kernel's channels (its connection file), as a notebook's do.

The peers are installed by this script into their own venvs under ``--cache``
(default ``/tmp/jupyter_ring_peers``) with ``torch==2.13.0``; jupyter_ring and
ipyparallel run from this Python. Every cell is timed from ``execute_request`` to the kernel's
``idle`` status (what a notebook user waits for), with the output received and counted.

Measures:
- start: from the start command until the first trivial cell on the ranks has finished.
- trivial cell: ``x = 1`` on every rank, median of ``--cells``; "floor": the same cell run in
  the notebook kernel itself before the start (what the machine's load costs any cell).
- 1 MB cell: every rank prints 10,000 lines of 100 bytes; the output is checked to arrive.
- cleanup: SIGKILL of the notebook kernel, then every process that descended from it
  (controller, launcher, ranks, helpers) counted with psutil until none is left (10 s at most).
"""

import argparse
import json
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

PEERS = {"nbdistributed": "nbdistributed==0.1.0",
         "jupyter-distributed": "jupyter-distributed==0.1.1"}
TORCH = "torch==2.13.0"
BIG_LINES, BIG_LINE = 10_000, 100
BIG_CELL = f"print(('y' * {BIG_LINE - 1} + '\\n') * {BIG_LINES}, end='')"


# ------------------------------------------------------------------------------- the kernel driver
class Kernel:
    """A kernel over jupyter_client: run code, time it to idle, count the output received."""

    def __init__(self, km=None, kc=None, specs=None):
        self.km, self.kc = km, kc
        self.specs = specs  # a temp dir of ours (kernelspec, connection file), removed by _close

    @classmethod
    def start(cls, python, env=None):
        """A kernel running ``python`` (a kernelspec and connection file in a temp dir)."""
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import KernelManager

        specs = tempfile.mkdtemp(prefix="jupyter_ring_peers_spec_")
        os.makedirs(os.path.join(specs, "bench"))
        with open(os.path.join(specs, "bench", "kernel.json"), "w") as f:
            json.dump({"argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                       "display_name": "bench", "language": "python"}, f)
        km = KernelManager(kernel_name="bench", connection_file=os.path.join(specs, "conn.json"),
                           kernel_spec_manager=KernelSpecManager(kernel_dirs=[specs]))
        km.start_kernel(env=dict(os.environ, **(env or {})))
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        return cls(km, kc, specs)

    @classmethod
    def connect(cls, connection_file):
        from jupyter_client import BlockingKernelClient

        kc = BlockingKernelClient(connection_file=connection_file)
        kc.load_connection_file()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)
        except Exception:
            kc.stop_channels()
            raise
        return cls(None, kc)

    def run(self, code, timeout=120):
        """(seconds to idle, text of the output, error or None)."""
        t0 = time.perf_counter()
        msg_id = self.kc.execute(code)
        chars, error = [], None
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no idle in {timeout} s after {code[:60]!r}")
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                chars.append(content["text"])
            elif kind in ("display_data", "update_display_data", "execute_result"):
                chars.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                return time.perf_counter() - t0, "".join(chars), error

    def ok(self, code, timeout=120):
        took, text, error = self.run(code, timeout)
        if error:
            raise RuntimeError(f"{code[:60]!r} failed: {error}")
        return took, text


def _descendants(pid):
    import psutil

    try:
        return [p for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _alive(procs):
    import psutil

    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            pass
    return out


def kill_and_count(pid, extra=(), limit=10.0):
    """SIGKILL ``pid``; seconds until all its descendants (and ``extra``) are gone, or None."""
    procs = _descendants(pid) + list(extra)
    n = len(procs)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while _alive(procs) and time.monotonic() - t0 < limit:
        time.sleep(0.02)
    left = _alive(procs)
    took = time.monotonic() - t0
    for proc in left:  # do not leave the orphans of a peer behind
        try:
            proc.kill()
        except Exception:
            pass
    return (None if left else took), n, len(left)


# ------------------------------------------------------------------------------------ the systems
def measure(kernel, start_code, first_cell, trivial, cells, setup=None, failed=None):
    """Start, trivial cells, 1 MB cell on a kernel; returns the measures (cleanup separately).

    ``failed(text)``: whether a cell's output says it did not run on the ranks (a peer that
    reports failures as printed text); the start then counts until a first cell succeeded.
    """
    if setup:
        kernel.ok(setup)
    floor = _floor(kernel)
    t_start, _ = kernel.ok(start_code, timeout=180)
    t_command = t_start
    lost = []
    for _ in range(3):
        took, text = kernel.ok(first_cell, timeout=120)
        t_start += took
        if failed is None or not failed(text):
            break
        lost.append(f"{took:.1f} s: {text.strip()[:120]}")
    for _ in range(3):  # warm up
        kernel.ok(trivial)
    times = [kernel.ok(trivial)[0] for _ in range(cells)]
    big = [kernel.ok(trivial.replace("x = 1", BIG_CELL), timeout=300) for _ in range(3)]
    big_s = statistics.median(t for t, _ in big)
    return {"start_s": t_start, "start_command_s": t_command, "first_cells_lost": lost,
            "floor_ms": floor,
            "cell_ms": statistics.median(times) * 1000,
            "cell_quartiles_ms": [round(q * 1000, 2) for q in statistics.quantiles(times)],
            "big_s": big_s, "big_chars": min(_count_ys(text) for _, text in big)}


def _floor(kernel, n=20):
    """Median ms of a plain ``x = 1`` in the kernel itself: the floor under any cell."""
    for _ in range(3):
        kernel.ok("x = 1")
    return statistics.median(kernel.ok("x = 1")[0] for _ in range(n)) * 1000


def _count_ys(text):
    """Bytes of the 1 MB cell's lines that arrived (each rank prints BIG_LINES lines)."""
    return text.count("y" * (BIG_LINE - 1)) * BIG_LINE


def run_ring(cells, workdir):
    kernel = Kernel.start(sys.executable, env={"IPYTHONDIR": os.path.join(workdir, "ipython")})
    try:
        res = measure(kernel, "%ring start -n 2", "%%distributed\nx = 1", "%%distributed\nx = 1",
                      cells, setup="%load_ext jupyter_ring")
        pid = kernel.km.provisioner.process.pid
        res["cleanup_s"], res["procs"], res["left"] = kill_and_count(pid)
        return res
    finally:
        _close(kernel)


def run_px(cells, workdir):
    from jupyter_ring.launch import find_mpiexec

    kernel = Kernel.start(sys.executable, env={"IPYTHONDIR": os.path.join(workdir, "ipython")})
    start = ("import ipyparallel as ipp\n"
             "cluster = ipp.Cluster(engines='mpi', n=2, log_level=40)\n"
             f"cluster.config.MPIEngineSetLauncher.mpi_cmd = [{find_mpiexec()!r}]\n"
             "rc = cluster.start_and_connect_sync()\nrc.wait_for_engines(2)\n"
             "view = rc[:]\nview.block = True  # else %%px returns before the ranks ran\n"
             "view.activate()")
    try:
        res = measure(kernel, start, "%%px\nx = 1", "%%px\nx = 1", cells)
        pid = kernel.km.provisioner.process.pid
        res["cleanup_s"], res["procs"], res["left"] = kill_and_count(pid)
        return res
    finally:
        _close(kernel)


def run_nbdistributed(cells, workdir, cache):
    python = ensure_peer("nbdistributed", cache, extra=["ipykernel", "numpy"])
    # nbdistributed starts its workers as "python" from PATH: its venv must come first, as
    # in an activated environment
    path = os.path.dirname(python) + os.pathsep + os.environ.get("PATH", "")
    kernel = Kernel.start(python, env={"IPYTHONDIR": os.path.join(workdir, "ipython"),
                                       "PATH": path})
    try:
        res = measure(kernel, "%dist_init -n 2", "x = 1", "x = 1", cells,
                      setup="%load_ext nbdistributed",
                      failed=lambda text: "Error executing distributed code" in text)
        pid = kernel.km.provisioner.process.pid
        res["cleanup_s"], res["procs"], res["left"] = kill_and_count(pid)
        return res
    finally:
        _close(kernel)


def run_jupyter_distributed(cells, workdir, cache):
    python = ensure_peer("jupyter-distributed", cache)
    port, token = _free_port(), uuid.uuid4().hex
    root, runtime = os.path.join(workdir, "root"), os.path.join(workdir, "runtime")
    os.makedirs(root, exist_ok=True)
    os.makedirs(runtime, exist_ok=True)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=runtime,
               JUPYTER_CONFIG_DIR=os.path.join(workdir, "config"),
               JUPYTER_DATA_DIR=os.path.join(workdir, "data"),
               IPYTHONDIR=os.path.join(workdir, "ipython"))
    log = open(os.path.join(workdir, "server.log"), "w")
    server = subprocess.Popen(
        [python, "-m", "jupyter_server", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.port_retries=0"], env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    kernel = None
    try:
        _wait_http(f"{base}/jupyter-distributed/health", token, server)
        kid = _http(f"{base}/api/kernels", token, "POST", {"name": "python3"})["id"]
        conn = os.path.join(runtime, f"kernel-{kid}.json")
        kernel = Kernel.connect(conn)
        floor = _floor(kernel)  # still the plain python3 kernel
        t0 = time.perf_counter()  # the kernel is up: what the toolbar's world-size change costs
        model = _http(f"{base}/jupyter-distributed/kernels/{kid}", token, "POST",
                      {"action": "set", "world_size": 2})
        kernel.kc.stop_channels()
        kernel = None
        # the kernel restarts as the proxy with the same connection file; the route may answer
        # before its heartbeat does, which wait_for_ready takes for a death: try again
        deadline = time.monotonic() + 120
        while kernel is None:
            try:
                kernel = Kernel.connect(conn)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        kernel.ok("import os\nx = 1", timeout=120)
        t_start = time.perf_counter() - t0
        for _ in range(3):
            kernel.ok("x = 1")
        times = [kernel.ok("x = 1")[0] for _ in range(cells)]
        big = [kernel.ok(BIG_CELL, timeout=300) for _ in range(3)]
        res = {"start_s": t_start, "first_cells_lost": [], "floor_ms": floor,
               "cell_ms": statistics.median(times) * 1000,
               "cell_quartiles_ms": [round(q * 1000, 2) for q in statistics.quantiles(times)],
               "big_s": statistics.median(t for t, _ in big),
               "big_chars": min(_count_ys(text) for _, text in big),
               "world_size": model.get("world_size")}
        pid = _kernel_pid_of(conn)
        res["cleanup_s"], res["procs"], res["left"] = kill_and_count(pid)
        return res
    finally:
        if kernel is not None:
            kernel.kc.stop_channels()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def _kernel_pid_of(connection_file):
    """The process launched with this connection file (the proxy kernel), not a rank's."""
    import psutil

    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if connection_file in cmd and any("jupyter_distributed.kernel" in c for c in cmd):
            return proc.info["pid"]
    raise RuntimeError(f"no jupyter_distributed.kernel process with {connection_file}")


# -------------------------------------------------------------------------------------- plumbing
def ensure_peer(name, cache, extra=()):
    """The venv python of a peer, installing ``PEERS[name]`` and torch into it if missing."""
    venv = os.path.join(cache, name)
    python = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, ".installed")
    want = " ".join([TORCH, PEERS[name], *extra])
    if os.path.exists(stamp) and open(stamp).read() == want:
        return python
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    print(f"[peers] installing {want} into {venv}", file=sys.stderr)
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    TORCH, PEERS[name], *extra], check=True)
    with open(stamp, "w") as f:
        f.write(want)
    return python


def _close(kernel):
    try:
        kernel.kc.stop_channels()
    except Exception:
        pass
    if kernel.km is not None:
        try:
            kernel.km.shutdown_kernel(now=True)
        except Exception:
            pass
    if kernel.specs:
        shutil.rmtree(kernel.specs, ignore_errors=True)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url, token, method="GET", body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, method=method, data=data,
                                 headers={"Authorization": f"token {token}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        text = resp.read()
    return json.loads(text) if text else None


def _wait_http(url, token, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _http(url, token)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the jupyter server did not answer {url}")
            time.sleep(0.3)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=30, help="trivial cells per system (30)")
    parser.add_argument("--only", default="ring,px,nbdistributed,jupyter-distributed",
                        help="comma-separated systems to run")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(),
                                                        "jupyter_ring_peers"),
                        help="where the peers' venvs live (outside the repo and the home folder)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    os.makedirs(args.cache, exist_ok=True)

    results, load = {}, [os.getloadavg()]
    for name in args.only.split(","):
        workdir = tempfile.mkdtemp(prefix=f"jupyter_ring_peers_{name}_")
        print(f"[peers] {name} ...", file=sys.stderr, flush=True)
        try:
            if name == "ring":
                results[name] = run_ring(args.cells, workdir)
            elif name == "px":
                results[name] = run_px(args.cells, workdir)
            elif name == "nbdistributed":
                results[name] = run_nbdistributed(args.cells, workdir, args.cache)
            elif name == "jupyter-distributed":
                results[name] = run_jupyter_distributed(args.cells, workdir, args.cache)
            else:
                raise ValueError(f"unknown system {name!r}")
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"[peers] {name}: {results[name]}", file=sys.stderr, flush=True)

    load.append(os.getloadavg())
    want_chars = 2 * BIG_LINES * BIG_LINE
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}"
          .format(*load[0], *load[1]))
    print(f"{'system':22} {'start (s)':>10} {'cell (ms)':>10} {'floor (ms)':>11} "
          f"{'1 MB/rank (s)':>14} {'output':>8} {'cleanup (s)':>12}  first cells lost")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:22} n/a: {r['error']}")
            continue
        cleanup = (f"{r['cleanup_s']:.2f}" if r["cleanup_s"] is not None
                   else f"{r['left']} of {r['procs']} left")
        print(f"{name:22} {r['start_s']:10.2f} {r['cell_ms']:10.2f} {r['floor_ms']:11.2f} "
              f"{r['big_s']:14.2f} "
              f"{r['big_chars'] / want_chars:7.0%} {cleanup:>12}  {len(r['first_cells_lost'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": load, "systems": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
