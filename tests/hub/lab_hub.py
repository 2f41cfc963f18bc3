"""A real JupyterHub with real Unix student accounts: the teaching-lab tests' and benchmark's fixture.

:class:`LabHub` creates Unix users, starts JupyterHub (as root, from the shared lab environment
that ``scripts/lab-env.sh`` builds) with ``examples/jupyterhub_config.py`` on free loopback ports
plus a service token for the test, starts the users' servers through the hub's REST API and runs
code in their kernels over the kernel websocket, the way JupyterLab does. ``close()`` stops it all,
removes the users (``userdel -r``) and reports any process of theirs that survived.
"""

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

import nbformat
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAB = os.environ.get("JUPYTER_RING_LAB", "/opt/jupyter_ring-lab")
EXAMPLE_CONFIG = os.path.join(ROOT, "examples", "jupyterhub_config.py")

__all__ = ["LabHub", "HubKernel", "HubError", "skip_reason", "build_lab_env", "user_processes",
           "at_once"]


class HubError(RuntimeError):
    """The hub, a server or a kernel did not do what was asked in time."""


def skip_reason():
    """Why the hub tests cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "the teaching-lab tests create Unix users and run JupyterHub as root: run as root"
    for tool in ("useradd", "userdel", "chpasswd", "npm"):
        if shutil.which(tool) is None:
            return f"the teaching-lab tests need {tool} (apt-get install passwd nodejs npm)"
    if not os.path.exists("/usr/bin/python3"):
        return "the teaching-lab tests need the system Python /usr/bin/python3 for the lab venv"
    return None


def build_lab_env(timeout=1200):
    """Run scripts/lab-env.sh (quick when the environment is up to date); return its output."""
    proc = subprocess.run([os.path.join(ROOT, "scripts", "lab-env.sh"), LAB], capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise HubError(f"scripts/lab-env.sh failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                       f"{proc.stderr[-3000:]}")
    return proc.stdout


def at_once(fn, names, timeout=900):
    """Run fn(name) for every name at the same time (a thread each); {name: result}. Raises the
    first failure, naming whose it was."""
    results, errors = {}, {}

    def run(name):
        try:
            results[name] = fn(name)
        except BaseException as exc:  # re-raised below in the caller's thread
            errors[name] = exc

    threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in names]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        name, exc = next(iter(errors.items()))
        raise HubError(f"{name}: {type(exc).__name__}: {exc}") from exc
    late = [name for name in names if name not in results]
    if late:
        raise HubError(f"{', '.join(late)} did not finish in {timeout} s")
    return results


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def user_processes(uid):
    """Every live process whose real or effective uid is ``uid``."""
    found = []
    for proc in psutil.process_iter(["uids", "status"]):
        try:
            uids = proc.info["uids"]
            if uids and uid in (uids.real, uids.effective) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def _describe(procs):
    lines = []
    for proc in procs:
        try:
            lines.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            lines.append(f"{proc.pid} (gone)")
    return "\n".join(lines)


class LabHub:
    """JupyterHub on 127.0.0.1 with ``users`` as real Unix accounts (created here, removed on close)."""

    def __init__(self, users, cpu_limit=1, mem_limit="4G", password=None, cull_timeout=0,
                 activity_interval=None):
        self.users = list(users)
        self.cull_timeout = cull_timeout   # seconds; 0: no idle culler
        # seconds between the servers' reports of their last activity to the hub (jupyterhub-
        # singleuser's JUPYTERHUB_ACTIVITY_INTERVAL); None: JupyterHub's default, 300 s
        self.activity_interval = activity_interval
        self.cpu_limit = cpu_limit
        self.mem_limit = mem_limit
        self.password = password or secrets.token_urlsafe(12)
        self.token = secrets.token_hex(24)   # the test's service token
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proxy_api_port = _free_port()
        self.state = None
        self.proc = None
        self.log_path = None
        self.created = []
        self.user_tokens = {}
        self.timings = {}

    # ------------------------------------------------------------------------------ lifecycle
    def start(self, timeout=60):
        self.state = tempfile.mkdtemp(prefix="jupyter_ring_hub_")   # 0700, root's
        for name in self.users:
            if _user_exists(name):
                raise HubError(f"Unix user {name} already exists; the test makes its own users")
            _run(["useradd", "--create-home", "--shell", "/bin/bash", name])
            self.created.append(name)
            _run(["chpasswd"], input=f"{name}:{self.password}\n")
        config = os.path.join(self.state, "jupyterhub_config.py")
        with open(config, "w") as f:
            f.write(f"c = get_config()\n"
                    f"load_subconfig({EXAMPLE_CONFIG!r})\n"
                    f"c.JupyterHub.services.append({{'name': 'lab-tests', 'api_token': {self.token!r}}})\n"
                    f"c.JupyterHub.load_roles.append({{'name': 'lab-tests', 'services': ['lab-tests'],\n"
                    f"    'scopes': ['admin:users', 'admin:servers', 'tokens', 'access:servers']}})\n"
                    f"c.JupyterHub.log_level = 'INFO'\n")
            if self.activity_interval is not None:
                f.write(f"c.Spawner.environment['JUPYTERHUB_ACTIVITY_INTERVAL'] = "
                        f"'{self.activity_interval:d}'\n")
        env = dict(os.environ, JUPYTER_RING_LAB=LAB, LAB_USERS=",".join(self.users),
                   LAB_CPU_LIMIT=str(self.cpu_limit), LAB_MEM_LIMIT=str(self.mem_limit),
                   LAB_PORT=str(self.port), LAB_HUB_PORT=str(_free_port()),
                   LAB_PROXY_API_PORT=str(self.proxy_api_port), LAB_STATE_DIR=self.state,
                   LAB_CULL_TIMEOUT=str(self.cull_timeout),
                   PATH=f"{LAB}/bin:/usr/local/bin:/usr/bin:/bin")
        for var in ("IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR",
                    "VIRTUAL_ENV", "PYTHONPATH"):
            env.pop(var, None)   # the hub is root's; students' servers get their own homes
        self.log_path = os.path.join(self.state, "hub.log")
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([os.path.join(LAB, "bin", "jupyterhub"), "-f", config],
                                         cwd=self.state, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.api("GET", "/hub/api/")
                break
            except (OSError, HubError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise HubError(f"JupyterHub did not answer in {timeout} s:\n{self.log()}")
                time.sleep(0.2)
        self.timings["hub start"] = time.perf_counter() - t0
        return self

    def log(self, tail=6000):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-tail:]
        except (OSError, TypeError):
            return ""

    def close(self):
        """Stop every server and the hub, remove the users; return what survived (pid + cmdline)."""
        survivors = []
        for name in self.created:
            try:
                self.stop_server(name, timeout=30)
            except Exception:
                pass
        helpers = []   # the hub's proxy and services must go with it
        if self.proc is not None and self.proc.poll() is None:
            try:
                helpers = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        _, left = psutil.wait_procs(helpers, timeout=10)
        # JupyterHub stops its proxy and services on SIGTERM; one that is still stopping when the
        # hub is gone (a busy machine) gets its own SIGTERM: only one that ignores that survives
        for proc in left:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, left = psutil.wait_procs(left, timeout=10)
        if left:
            survivors.append(f"the hub's proxy or services, 20 s after SIGTERM:\n{_describe(left)}")
            for proc in left:
                proc.kill()
        for name in self.created:
            uid = pwd.getpwnam(name).pw_uid
            left = user_processes(uid)
            if left:
                survivors.append(f"{name}:\n{_describe(left)}")
                for proc in left:
                    try:
                        proc.kill()
                    except psutil.Error:
                        pass
                psutil.wait_procs(left, timeout=5)
            subprocess.run(["userdel", "--remove", name], capture_output=True, timeout=60)
        self.created = []
        if self.state:
            shutil.rmtree(self.state, ignore_errors=True)
        return survivors

    # ------------------------------------------------------------------------------------ REST
    def api(self, method, path, body=None, token=None, expect=(200, 201, 202, 204)):
        """A hub or user-server REST call through the proxy; returns (status, parsed JSON or None)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, method=method, data=data,
                                     headers={"Authorization": f"token {token or self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        if expect is not None and status not in expect:
            raise HubError(f"{method} {path}: HTTP {status} {raw[:500]!r}")
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def uid(self, name):
        return pwd.getpwnam(name).pw_uid

    def home(self, name):
        return pwd.getpwnam(name).pw_dir

    def user_token(self, name):
        """A token of the student's own (what their browser session carries)."""
        if name not in self.user_tokens:
            _, reply = self.api("POST", f"/hub/api/users/{name}/tokens",
                                {"expires_in": 3600, "note": "jupyter_ring lab tests"})
            self.user_tokens[name] = reply["token"]
        return self.user_tokens[name]

    def spawn(self, name, timeout=90):
        """Start the student's server and wait until it is ready; returns the seconds it took."""
        t0 = time.perf_counter()
        self.api("POST", f"/hub/api/users/{name}/server")
        deadline = time.monotonic() + timeout
        while True:
            _, user = self.api("GET", f"/hub/api/users/{name}")
            server = (user.get("servers") or {}).get("")
            if server and server.get("ready"):
                break
            if time.monotonic() > deadline:
                raise HubError(f"{name}'s server was not ready in {timeout} s:\n{self.log()}")
            time.sleep(0.2)
        took = time.perf_counter() - t0
        self.timings[f"spawn {name}"] = took
        return took

    def server_pid(self, name):
        _, user = self.api("GET", f"/hub/api/users/{name}")
        server = (user.get("servers") or {}).get("") or {}
        return (server.get("state") or {}).get("pid")

    def stop_server(self, name, timeout=60):
        """Stop the student's server (what the hub's Stop button and an idle culler do)."""
        status, _ = self.api("DELETE", f"/hub/api/users/{name}/server", expect=None)
        if status not in (202, 204, 400, 404):
            raise HubError(f"stopping {name}'s server: HTTP {status}")
        deadline = time.monotonic() + timeout
        while True:
            _, user = self.api("GET", f"/hub/api/users/{name}", expect=None)
            if not isinstance(user, dict) or not (user.get("servers") or {}).get(""):
                return
            if time.monotonic() > deadline:
                raise HubError(f"{name}'s server did not stop in {timeout} s:\n{self.log()}")
            time.sleep(0.2)

    @contextlib.contextmanager
    def page_open(self, name, every=0.5):
        """While the block runs, poll the student's server's kernel list with their token, as an
        open JupyterLab page does: the server counts that as activity (jupyter_server's
        api_last_activity), so an idle culler leaves it alone, also while a cell runs silently."""
        stop = threading.Event()

        def poll():
            while not stop.wait(every):
                try:
                    self.api("GET", f"/user/{name}/api/kernels", token=self.user_token(name),
                             expect=None)
                except OSError:
                    pass   # a busy server answers late; the next poll counts

        thread = threading.Thread(target=poll, name=f"page of {name}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(35)

    def kernel(self, name, token=None, timeout=60):
        """Start a python3 kernel in the student's server and connect to its websocket."""
        token = token or self.user_token(name)
        _, info = self.api("POST", f"/user/{name}/api/kernels", {"name": "python3"}, token=token)
        return HubKernel(self, name, info["id"], token, timeout=timeout)

    def upload(self, name, path, dest=None):
        """Put a notebook into the student's home through their server's contents API."""
        nb = nbformat.read(path, as_version=4)
        dest = dest or os.path.basename(path)
        self.api("PUT", f"/user/{name}/api/contents/{dest}",
                 {"type": "notebook", "format": "json", "content": nb}, token=self.user_token(name))
        return dest


class HubKernel:
    """A kernel in a student's server, driven over its websocket (Jupyter's kernel protocol)."""

    def __init__(self, hub, user, kernel_id, token, timeout=60):
        self.hub, self.user, self.id, self.token = hub, user, kernel_id, token
        self.session = uuid.uuid4().hex
        self.ws = None
        self._connect(timeout)

    def _connect(self, timeout):
        """(Re)open the websocket and wait until the kernel answers a kernel_info_request."""
        import websocket

        self.close()
        url = (self.hub.url.replace("http://", "ws://")
               + f"/user/{self.user}/api/kernels/{self.id}/channels")
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.ws = websocket.create_connection(
                    url, timeout=timeout, header=[f"Authorization: token {self.token}"])
                break
            except (OSError, websocket.WebSocketException) as exc:
                if time.monotonic() > deadline:
                    raise HubError(f"{self.user}'s kernel websocket did not open: {exc}") from exc
                time.sleep(0.3)
        self._last_read = time.monotonic()
        self._request("kernel_info_request", {}, "kernel_info_reply", timeout)

    def _send(self, msg_type, content):
        # the server pings every 30 s and closes a websocket whose pongs stop; pongs only go out
        # while we read, so a websocket left unread for a while is reopened before use
        if time.monotonic() - self._last_read > 20:
            self._connect(60)
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "username": self.user, "session": self.session,
                       "msg_type": msg_type, "version": "5.3",
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "parent_header": {}, "metadata": {}, "content": content, "channel": "shell",
            "buffers": []}))
        return msg_id

    def _request(self, msg_type, content, reply_type, timeout):
        msg_id = self._send(msg_type, content)
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv(deadline, f"{msg_type} to {self.user}'s kernel")
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == reply_type:
                return msg

    def _recv(self, deadline, what):
        import websocket

        # short reads: the server's pings (every 30 s) would restart one long socket timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HubError(f"{what}: no answer in time")
            self.ws.settimeout(min(left, 2.0))
            try:
                data = self.ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            if not data:
                raise HubError(f"{what}: the kernel's websocket closed")
            self._last_read = time.monotonic()
            return json.loads(data)

    def execute(self, code, timeout=120):
        """Run ``code``; return its nbformat outputs (display updates and clear_output applied)."""
        msg_id = self._send("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True})
        outputs, displays, clear_pending = [], {}, False
        idle = replied = False
        deadline = time.monotonic() + timeout
        while not (idle and replied):
            msg = self._recv(deadline, f"cell in {self.user}'s kernel ({code.splitlines()[0][:60]!r})")
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "execute_reply":
                replied = True
            elif kind == "status":
                idle = content.get("execution_state") == "idle"
            elif kind == "clear_output":
                if content.get("wait"):
                    clear_pending = True
                else:
                    outputs.clear()
            elif kind == "update_display_data":
                display_id = content.get("transient", {}).get("display_id")
                for out in displays.get(display_id, []):
                    out["data"], out["metadata"] = content["data"], content.get("metadata", {})
            elif kind in ("stream", "display_data", "execute_result", "error"):
                if clear_pending:
                    outputs.clear()
                    clear_pending = False
                out = nbformat.v4.output_from_msg(msg)
                outputs.append(out)
                display_id = content.get("transient", {}).get("display_id")
                if display_id:
                    displays.setdefault(display_id, []).append(out)
        return outputs

    def run_notebook(self, path, timeout=180):
        """Every code cell of the notebook in order (stops at the first error); the executed nb."""
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            cell.outputs = self.execute(cell.source, timeout=timeout)
            if any(out.output_type == "error" for out in cell.outputs):
                break
        return nb

    def close(self):
        if self.ws is None:
            return
        try:
            self.ws.close()
        except Exception:
            pass

    def shutdown(self):
        """Shut the kernel down through its server (what closing a notebook's kernel does)."""
        self.close()
        self.hub.api("DELETE", f"/user/{self.user}/api/kernels/{self.id}", token=self.token)


def _user_exists(name):
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _run(cmd, input=None):
    proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise HubError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
