"""One JupyterLab server for the browser tests of a pytest process, and a fresh start for each test.

Starting JupyterLab costs a test about 2 s and stopping it 1-3 s more; eight tests started one
each. :class:`LabServer` starts one (the session fixture ``lab_server`` in tests/conftest.py) and
:meth:`LabServer.fresh` gives every test a clean slate on it: no kernel or session left, no
process of an earlier test's kernels or clusters alive, an empty root folder and workspace (the
layout JupyterLab restores), a new ``ring.ipynb`` with its kernel started, and the log from that
point on. A server that died is started again. What a test leaves behind is cleared by
:meth:`LabServer.clear`; a cluster's process that outlives its kernel's shutdown fails that
test's teardown, naming it (and is killed, so that the next test starts clean).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import psutil

# A kernel shut down through the server has shutdown_wait_time (5 s) to end before it is
# killed, and its cluster's watchdog then ends the controller, mpiexec and engines (bounds.GONE_S):
# what is alive past this has leaked.
LEFT_BEHIND_S = 30.0
START_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(url: str, token: str, method: str = "GET", body: bytes | None = None) -> object:
    """A REST call to the server with its token; the parsed JSON answer (None when empty)."""
    req = urllib.request.Request(url, method=method, data=body,
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        data = resp.read()
    return json.loads(data) if data else None


class LabServer:
    """A JupyterLab on 127.0.0.1 (free port, token auth) with its root, settings, workspaces and
    log under ``home``; started on first use, stopped by :meth:`stop`."""

    def __init__(self, home: "os.PathLike[str] | str") -> None:
        self.home = os.fspath(home)
        self.root = os.path.join(self.home, "root")
        self.workspaces = os.path.join(self.home, "workspaces")
        self.log_path = os.path.join(self.home, "lab.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = ""
        self.token = ""
        self.starts = 0   # how many servers this object started (1 unless one died)

    # ------------------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        for folder in (self.root, self.workspaces):
            os.makedirs(folder, exist_ok=True)
        port, self.token = _free_port(), uuid.uuid4().hex
        env = dict(os.environ)  # tests/conftest.py has put IPYTHONDIR and JUPYTER_* in temp dirs
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        # JupyterLab 4.6 may still ask "Select Kernel" for a notebook whose kernel is already
        # running under load; starting the preferred kernel without asking keeps the page free of
        # dialogs.
        settings = os.path.join(self.home, "lab-settings", "@jupyterlab")
        os.makedirs(os.path.join(settings, "notebook-extension"), exist_ok=True)
        with open(os.path.join(settings, "notebook-extension", "tracker.jupyterlab-settings"), "w") as f:
            json.dump({"autoStartDefaultKernel": True}, f)
        # ... nor the "get notified about Jupyter news?" toast, which can cover a screenshot
        os.makedirs(os.path.join(settings, "apputils-extension"), exist_ok=True)
        with open(os.path.join(settings, "apputils-extension", "notification.jupyterlab-settings"),
                  "w") as f:
            json.dump({"fetchNews": "false", "checkForUpdates": False}, f)
        env["JUPYTERLAB_SETTINGS_DIR"] = os.path.dirname(settings)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
                 "--ip=127.0.0.1", f"--port={port}", f"--ServerApp.token={self.token}",
                 f"--ServerApp.root_dir={self.root}", "--ServerApp.port_retries=0",
                 f"--LabApp.workspaces_dir={self.workspaces}",
                 "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_S
        while True:
            try:
                self.api("/api/status")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self._kill()
                    raise RuntimeError(f"JupyterLab did not start in {START_S:.0f} s:\n"
                                       f"{self.log_text(0)[-4000:]}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """Shut the kernels down (their watchdogs then end any cluster), then the server."""
        if self.proc is None:
            return
        try:
            for kernel in self._list("/api/kernels"):
                self.api(f"/api/kernels/{kernel['id']}", "DELETE")
        except OSError:
            pass
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self._kill()
        self.proc = None

    def _kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait(5)

    # ------------------------------------------------------------------------------ each test
    def api(self, path: str, method: str = "GET", body: bytes | None = None) -> object:
        return get(self.base + path, self.token, method, body)

    def _list(self, path: str) -> list[dict[str, str]]:
        found = self.api(path)
        return found if isinstance(found, list) else []

    def fresh(self) -> int:
        """Make the server as a test expects to find it (see the module's docstring); returns the
        log's offset, from which :meth:`log_text` reads this test's part."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            self._start()
        self.clear()   # nothing after a passing test; a failed teardown has named what it kills
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        for name in os.listdir(self.workspaces):
            os.remove(os.path.join(self.workspaces, name))
        nb = {"cells": [], "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                       "language": "python"}},
              "nbformat": 4, "nbformat_minor": 5}
        self.api("/api/contents/ring.ipynb", "PUT",
                 json.dumps({"type": "notebook", "content": nb}).encode())
        # Start the notebook's kernel up front, so that the page attaches to it (no kernel dialog).
        self.api("/api/sessions", "POST",
                 json.dumps({"path": "ring.ipynb", "type": "notebook", "name": "ring.ipynb",
                             "kernel": {"name": "python3"}}).encode())
        return os.path.getsize(self.log_path)

    def clear(self) -> list[str]:
        """Shut every session and kernel down and wait until no process the server started (a
        kernel, a cluster's controller, mpiexec or engines) is alive. What is alive after
        LEFT_BEHIND_S is killed; the cluster processes among it are returned (pid and command
        line). A kernel the server restarts meanwhile (one a test killed) is shut down again."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        # the tree now, kernels alive: a cluster's processes leave it when their kernel ends
        tree = _descendants(psutil.Process(self.proc.pid))
        deadline = time.monotonic() + LEFT_BEHIND_S
        while True:
            try:
                for session in self._list("/api/sessions"):
                    self.api(f"/api/sessions/{session['id']}", "DELETE")
                for kernel in self._list("/api/kernels"):
                    self.api(f"/api/kernels/{kernel['id']}", "DELETE")
            except urllib.error.HTTPError:
                pass   # one went away or is restarting: asked again on the next round
            procs = {p.pid: p for p in tree + _descendants(psutil.Process(self.proc.pid))}
            left = [p for p in procs.values() if _alive(p)]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        leaked = []
        for proc in left:
            try:
                cmdline = " ".join(proc.cmdline())
                proc.kill()
            except psutil.Error:
                continue
            if "ipykernel_launcher" not in cmdline:
                leaked.append(f"{proc.pid} {cmdline[:160]}")
        psutil.wait_procs(left, timeout=5)
        return leaked

    def wait_quiet(self, timeout: float) -> list[str]:
        """Wait until no process but the server and its kernels holds the log open: a cluster's
        controller or engine that has gone can add nothing more to it. Returns those still
        holding it after ``timeout`` (pid and command line; [] when quiet)."""
        assert self.proc is not None
        path = os.path.realpath(self.log_path)
        deadline = time.monotonic() + timeout
        while True:
            writers = []
            for proc in psutil.process_iter(["pid", "cmdline"]):
                cmdline = " ".join(proc.info["cmdline"] or [])
                if proc.info["pid"] == self.proc.pid or "ipykernel_launcher" in cmdline:
                    continue
                try:
                    if any(f.path == path for f in proc.open_files()):
                        writers.append(f"{proc.info['pid']} {cmdline[:160]}")
                except psutil.Error:
                    pass
            if not writers or time.monotonic() > deadline:
                return writers
            time.sleep(0.1)

    def log_text(self, offset: int) -> str:
        """The server's log (kernels' and controllers' output too) from ``offset`` on."""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
