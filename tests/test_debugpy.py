"""``%ring debugpy RANK`` (issue 35, item 5): debugpy on one rank, driven by a real DAP client
over its socket, as VS Code drives it, on a real kernel and a real 2-rank cluster whose stall
timeout is 2 s (a rank stopped at a breakpoint longer than that must not stall its peer)."""

import json
import os
import random
import re
import socket
import threading
import time

import psutil
import pytest
from bounds import GONE_S
from dap_client import Dap
from real_kernel import alive, cluster_pids, ring_kernel

from jupyter_ring.cluster._where import RankWhere, format_where
from jupyter_ring.runtime._observe.debugger import read_held

pytestmark = pytest.mark.slow

STALL_TIMEOUT = 2


@pytest.fixture(scope="module")
def kernel():
    short = {"JUPYTER_RING_STALL_TIMEOUT": str(STALL_TIMEOUT)}
    with ring_kernel(2, env=short) as k:
        cluster_pids(k)
        yield k


def _start(kernel, rank):
    out = kernel.ok(f"%ring debugpy {rank}")
    port = int(re.search(r"debugpy listening on 127\.0\.0\.1:(\d+)", out).group(1))
    config = json.loads(out[out.index("{"):out.rindex("}") + 1])
    return out, port, config


def _rank_pid(kernel, rank):
    out = kernel.ok("print(get_ipython().magics_manager.registry['RingMagics'].cluster"
                    f".ranks[{rank}]['pid'])")
    return int(out.strip().splitlines()[-1])


def _defined(kernel):
    """debugpy on rank 1, DEFINE run after it: (port, config, the file of DEFINE's cell)."""
    _, port, config = _start(kernel, 1)
    kernel.ok(DEFINE)
    path = _cell_file(config["pathMappings"][0]["localRoot"],
                      DEFINE.replace("%%distributed", "# %%distributed", 1))
    return port, config, path


def _cell_file(folder, source):
    """The file of ``folder`` holding the cell ``source`` (the rank's copy of its cells)."""
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as fh:
            if fh.read().rstrip("\n") == source.rstrip("\n"):
                return os.path.join(folder, name)
    raise AssertionError(f"no file of {folder} holds the cell {source!r}: {os.listdir(folder)}")


DEFINE = """%%distributed
import numpy as np
def step(seed):
    mine = seed * (ring.rank() + 1)
    doubled = mine * 2
    return doubled
"""
STOP_LINE = 5  # `doubled = mine * 2`: line 5 of the cell, as in the notebook

CALL = """%%distributed
got = step({seed})
total = ring.allreduce(np.array([float(got)]), op=ring.Sum, name="after_debugpy")
print(f"rank {{ring.rank()}} got={{got}} total={{total.tolist()}}")
"""


def test_breakpoint_set_by_file_and_line_stops_the_rank_and_its_peer_waits(kernel):
    out, port, config = _start(kernel, 1)
    # loopback only: the rank's listening socket, as the system sees it
    rank1 = psutil.Process(_rank_pid(kernel, 1))
    listening = [c for c in rank1.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert [(c.laddr.ip, c.laddr.port) for c in listening if c.laddr.port == port] == [("127.0.0.1", port)], listening
    assert "connections from other users are refused" in out, out
    assert config["request"] == "attach" and config["connect"] == {"host": "127.0.0.1", "port": port}, config
    [mapping] = config["pathMappings"]
    folder = mapping["localRoot"]
    assert os.stat(folder).st_mode & 0o777 == 0o700

    kernel.ok(DEFINE)  # run after %ring debugpy: its function is compiled from a file
    path = _cell_file(folder, DEFINE.replace("%%distributed", "# %%distributed", 1))
    with open(path) as fh:
        assert fh.read().splitlines()[STOP_LINE - 1].strip() == "doubled = mine * 2"
    assert os.stat(path).st_mode & 0o777 == 0o600

    dap = Dap(port)
    try:
        [placed] = dap.attach({path: [STOP_LINE]}, pathMappings=config["pathMappings"])
        assert placed["breakpoints"][0]["verified"], placed

        seed = random.randint(3, 10**6)
        ran = {}
        cell = threading.Thread(target=lambda: ran.update(zip(("out", "error"), kernel.execute(
            CALL.format(seed=seed), timeout=120))))
        cell.start()
        stopped = dap.event("stopped")
        assert stopped["reason"] == "breakpoint", stopped
        stopped_at = time.monotonic()
        frames = dap.request("stackTrace", threadId=stopped["threadId"], startFrame=0,
                             levels=5)["stackFrames"]
        assert frames[0]["name"] == "step" and frames[0]["line"] == STOP_LINE, frames[0]
        assert frames[0]["source"]["path"] == path, frames[0]
        scopes = dap.request("scopes", frameId=frames[0]["id"])["scopes"]
        local = next(s for s in scopes if s["name"] == "Locals")
        variables = {v["name"]: v["value"] for v in
                     dap.request("variables", variablesReference=local["variablesReference"])["variables"]}
        assert variables["mine"] == str(seed * 2), variables      # rank 1's own value
        assert variables["seed"] == str(seed), variables
        assert "doubled" not in variables, variables               # the line has not run yet
        # held: what %ring where and the Ring panel say about rank 1 meanwhile
        held = read_held(os.path.dirname(folder), 1)
        line = format_where([RankWhere(1, "vm", 1, None, (), "", 0.0, held or "")])
        assert line.startswith(f"rank 1 @ vm (pid 1): in the debugger (debugpy), stopped at "
                               f"{os.path.basename(path)}:{STOP_LINE} in step"), (held, line)
        # rank 0 waits for rank 1 in the allreduce: past the stall timeout, no StallError
        while time.monotonic() - stopped_at < STALL_TIMEOUT * 1.5:
            assert cell.is_alive(), ran
            time.sleep(0.1)
        dap.request("continue", threadId=stopped["threadId"])
        cell.join(60)
        assert not cell.is_alive()
        assert ran["error"] is None, ran
        total = float(seed * 2 + seed * 4)
        assert f"rank 0 got={seed * 2} total=[{total}]" in ran["out"], ran["out"]
        assert f"rank 1 got={seed * 4} total=[{total}]" in ran["out"], ran["out"]
        assert "StallError" not in ran["out"], ran["out"]
        dap.request("disconnect")
    finally:
        dap.close()
    # the rank runs on: the same cell again (its breakpoint went with the client)
    out = kernel.ok(CALL.format(seed=seed + 1), timeout=60)
    assert f"rank 1 got={(seed + 1) * 4}" in out, out
    # no process of debugpy's beside the rank (in-process: no adapter to leave behind)
    assert not [p for p in rank1.children(recursive=True) if "debugpy" in " ".join(p.cmdline())]
    # a second %ring debugpy names the same endpoint, and the cell just run
    again, port_again, _ = _start(kernel, 1)
    assert port_again == port and "already" in again, again
    assert re.search(rf"In\[\d+\]: {re.escape(path)}", again), again  # the cells' files are named


def _first_answer_as(uid, port):
    """Connect to ``port`` as user ``uid`` (a forked child that drops root), send DAP's
    ``initialize``, and return what came back (``b''``: the connection was closed)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no exec, so no interpreter the other user must be able to run
        try:
            os.setgid(uid)
            os.setuid(uid)
            conn = socket.create_connection(("127.0.0.1", port), timeout=10)
            body = b'{"seq": 1, "type": "request", "command": "initialize", "arguments": {}}'
            conn.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            os.write(write, repr(conn.recv(65536)).encode())
        except ConnectionResetError:  # closed with our request unread
            os.write(write, b"b''")
        except BaseException as exc:
            os.write(write, f"error {exc!r}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        answer = fh.read()
    os.waitpid(pid, 0)
    return answer


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another user needs root (setuid)")
def test_another_user_cannot_connect(kernel):
    _, port, _ = _start(kernel, 1)
    assert _first_answer_as(65534, port) == "b''"  # closed, nothing answered
    out = kernel.ok("%%distributed --ranks 1\nfrom jupyter_ring.engines import _debugpy as _jr_d\n"
                    "print('refused', len(_jr_d.refused))")
    assert "refused 1" in out, out  # by the owner check, not by chance
    # this user still can
    dap = Dap(port)
    try:
        body = dap.request("initialize", clientID="jupyter_ring-test", adapterID="debugpy")
        assert body.get("supportsConfigurationDoneRequest"), body
        dap.request("disconnect")
    finally:
        dap.close()


def test_wait_returns_once_a_client_attaches_or_at_its_timeout(kernel):
    _, port, _ = _start(kernel, 1)
    out = kernel.ok("%ring debugpy 1 --wait --timeout 0.5")
    assert "no client attached within 0.5 s; debugpy still listens" in out, out
    clients = []

    def attach_soon():
        time.sleep(1)  # the magic is waiting by then (the kernel runs one request at a time)
        dap = Dap(port)
        clients.append(dap)
        dap.attach()

    client = threading.Thread(target=attach_soon)
    client.start()
    try:
        out = kernel.ok("%ring debugpy 1 --wait --timeout 60", timeout=90)
        assert "waiting for a debugger client to attach to rank 1" in out, out
        assert "a client is attached to rank 1" in out, out
    finally:
        client.join(60)
        for dap in clients:
            dap.request("disconnect")
            dap.close()


def test_bad_rank_and_missing_debugpy_are_clear_errors(kernel):
    out, error = kernel.execute("%ring debugpy 2")
    assert error is None and "UsageError: %ring debugpy 2: no rank 2; the cluster has ranks 0..1" in out, out
    out, error = kernel.execute("%ring debugpy one")
    assert error is None and "UsageError" in out and "invalid int value: 'one'" in out, out
    # rank 0 without debugpy: an import of it fails there as in an environment without it
    kernel.ok("%%distributed --ranks 0\nimport sys\n_saved = sys.modules.get('debugpy')\n"
              "sys.modules['debugpy'] = None")
    try:
        out, error = kernel.execute("%ring debugpy 0")
        assert error is None, (error, out)
        assert "UsageError: %ring debugpy 0: debugpy is not installed on this rank" in out, out
        assert "pip install 'jupyter_ring[debug]'" in out, out
    finally:
        kernel.ok("%%distributed --ranks 0\nif _saved is None:\n    del sys.modules['debugpy']\n"
                  "else:\n    sys.modules['debugpy'] = _saved")


IDLE = """import time
_client = get_ipython().magics_manager.registry['RingMagics'].cluster.client
while any(status.get('queue', 0) for status in _client.queue_status().values()
          if isinstance(status, dict)):
    time.sleep(0.05)
"""


def test_interrupt_while_debugpy_holds_a_rank_ends_the_cell_and_the_next_stops_again(kernel):
    port, _, path = _defined(kernel)
    dap = Dap(port)
    try:
        dap.attach({path: [STOP_LINE]})
        stopped = threading.Event()
        ran = {}
        cell = threading.Thread(target=lambda: ran.update(zip(("out", "error"), kernel.execute(
            CALL.format(seed=5), timeout=120, interrupt_when=stopped.is_set))))
        cell.start()
        first = dap.event("stopped")
        stopped.set()
        cell.join(60)
        assert not cell.is_alive()
        assert ran["error"] is not None and "Interrupt" in ran["error"]["ename"] + ran["error"]["evalue"], ran
        # the next cell runs on every rank, and the breakpoint still stops rank 1 (once rank 1 has
        # finished the interrupted cell: traced by debugpy, its traceback takes a while to format
        # on a loaded machine, and a request that reaches an engine before its failed cell's reply
        # has gone out is aborted by ipykernel, as for any rank)
        kernel.ok(IDLE, timeout=60)
        ran.clear()
        cell = threading.Thread(target=lambda: ran.update(zip(("out", "error"), kernel.execute(
            CALL.format(seed=6), timeout=120))))
        cell.start()
        try:
            again = dap.event("stopped")
        except Exception:
            cell.join(60)
            raise AssertionError(ran)
        assert again["reason"] == "breakpoint", (first, again)
        dap.request("continue", threadId=again["threadId"])
        cell.join(60)
        assert ran["error"] is None and "rank 1 got=24 total=[36.0]" in ran["out"], ran
        dap.request("disconnect")
    finally:
        dap.close()


def test_after_pdb_on_the_same_rank_debugpy_stops_it_again(kernel):
    """pdb's ``breakpoint()`` prompt takes the thread's tracing from debugpy until ``c``; the next
    cell is traced by debugpy again and its breakpoint stops the rank."""
    port, _, path = _defined(kernel)
    dap = Dap(port)
    try:
        dap.attach()
        asked = []
        out, error = kernel.execute("%%distributed --ranks 1\nvalue = 41\nbreakpoint()\nvalue += 1\n"
                                    "print('after pdb', value)",
                                    answer=lambda prompt, text: asked.append(prompt) or "c", timeout=60)
        assert error is None and asked and asked[0].startswith("(Pdb rank 1)"), (error, asked, out)
        assert "after pdb 42" in out, out
        dap.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": STOP_LINE}])
        ran = {}
        cell = threading.Thread(target=lambda: ran.update(zip(("out", "error"), kernel.execute(
            CALL.format(seed=7), timeout=120))))
        cell.start()
        stopped = dap.event("stopped")
        dap.request("continue", threadId=stopped["threadId"])
        cell.join(60)
        assert ran["error"] is None and "rank 1 got=28 total=[42.0]" in ran["out"], ran
        dap.request("setBreakpoints", source={"path": path}, breakpoints=[])
        dap.request("disconnect")
    finally:
        dap.close()


def _lab_debug(kernel, command, **arguments):
    """A request of JupyterLab's debugger: DAP in a ``debug_request`` on the control channel."""
    msg = kernel.kc.session.msg("debug_request", {"seq": 1, "type": "request", "command": command,
                                                  "arguments": arguments})
    kernel.kc.control_channel.send(msg)
    while True:
        reply = kernel.kc.control_channel.get_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            assert reply["content"]["success"], reply["content"]
            return reply["content"].get("body", {})


def _debug_events(kernel, code):
    messages = []
    out, error = kernel.execute(code, messages=messages, timeout=60)
    return out, error, [m["content"] for m in messages if m["msg_type"] == "debug_event"]


def test_jupyterlab_debugger_stops_in_the_kernel_never_on_a_rank(kernel):
    """What docs/debugging.md says of JupyterLab's debugger, as Lab drives it: a breakpoint in a
    ``%%distributed`` cell is accepted (``verified``) on the kernel's copy of the cell, which the
    kernel never runs; in one of the notebook's own cells it stops."""
    _lab_debug(kernel, "initialize", clientID="jupyterlab", adapterID="python", pathFormat="path",
               linesStartAt1=True, columnsStartAt1=True)
    _lab_debug(kernel, "attach")
    try:
        distributed = "%%distributed\ndef g(x):\n    y = x * 3\n    return y\nprint('g', g(ring.rank() + 2))"
        path = _lab_debug(kernel, "dumpCell", code=distributed)["sourcePath"]
        placed = _lab_debug(kernel, "setBreakpoints", source={"path": path}, breakpoints=[{"line": 3}])
        assert placed["breakpoints"][0]["verified"], placed
        _lab_debug(kernel, "configurationDone")
        out, error, events = _debug_events(kernel, distributed)
        assert error is None and "[rank 0] g 6" in out and "[rank 1] g 9" in out, (error, out)
        assert not [e for e in events if e.get("event") == "stopped"], events
        # the notebook's own cell: Lab's debugger stops there
        local = "def h(x):\n    y = x * 3\n    return y\n"
        path = _lab_debug(kernel, "dumpCell", code=local)["sourcePath"]
        _lab_debug(kernel, "setBreakpoints", source={"path": path}, breakpoints=[{"line": 2}])
        kernel.ok(local)
        msg_id = kernel.kc.execute("h(4)")
        deadline = time.monotonic() + 30
        while True:
            message = kernel.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if message["msg_type"] == "debug_event" and message["content"].get("event") == "stopped":
                _lab_debug(kernel, "continue", threadId=message["content"]["body"]["threadId"])
                break
        while not (message["msg_type"] == "status" and message["parent_header"].get("msg_id") == msg_id
                   and message["content"]["execution_state"] == "idle"):
            message = kernel.kc.get_iopub_msg(timeout=30)
    finally:
        _lab_debug(kernel, "disconnect", restart=False, terminateDebuggee=False)


def test_nothing_is_left_after_stop(kernel):
    pids = cluster_pids(kernel)
    rank1 = psutil.Process(_rank_pid(kernel, 1))
    family = [rank1.pid] + [p.pid for p in rank1.children(recursive=True)]
    kernel.ok("%ring stop", timeout=60)
    deadline = time.monotonic() + GONE_S
    while alive(pids + family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids + family), alive(pids + family)
