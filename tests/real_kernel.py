"""A real IPython kernel driven over jupyter_client, and process checks, shared by the notebook
and reliability tests (tests/ is on sys.path: ``from real_kernel import Kernel, alive``)."""

import contextlib
import json
import os
import queue
import time

import psutil
from jupyter_client import BlockingKernelClient
from jupyter_client.manager import start_new_kernel


def alive(pids):
    """The processes among ``pids`` that still exist and are not zombies."""
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            pass
    return out


def alive_after(pids, within):
    """The processes among ``pids`` still there ``within`` seconds from now (returns as soon as
    none is): a rank that is exiting when ``%ring stop`` returns (its cmdline already empty) has
    that long to be gone."""
    deadline = time.monotonic() + within
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = alive(pids)
    return left


class Kernel:
    """A real IPython kernel (jupyter_client) with helpers to run code and collect output."""

    def __init__(self, connection_file=None):
        """A new kernel, or (``connection_file``) a client of one started elsewhere (a Jupyter
        server's: ``self.km`` is then None, and the server shuts it down)."""
        if connection_file is None:
            self.km, self.kc = start_new_kernel(kernel_name="python3")
            return
        self.km, self.kc = None, BlockingKernelClient(connection_file=connection_file)
        self.kc.load_connection_file()
        self.kc.start_channels()
        # not wait_for_ready: without a manager it reads a heartbeat not yet beating as death
        self.kc.kernel_info(reply=True, timeout=60)

    def execute(self, code, timeout=60, interrupt_after=None, messages=None, interrupt_when=None,
                answer=None, during=None):
        """Run ``code``; return (text, error). The text is what a reader of the saved notebook
        sees: streams, execute results and each display's final text/plain (an
        update_display_data replaces the display it names). ``messages`` collects every iopub
        message of the request. With ``interrupt_after`` the kernel gets an interrupt_request
        that many seconds after the request (or once ``interrupt_when()`` is true);
        ``self.interrupted_at`` (monotonic) and
        ``self.interrupted_wall`` (time.time) note when. ``answer(prompt, text)`` answers the
        kernel's input requests (``input()``; text: the output so far): it returns the line, or
        None to leave the request unanswered for now (it is asked again). ``during(messages)``
        is called after each message of the request (what a page does while the cell runs)."""
        # stop_on_error=False: ipykernel 7 aborts (empty reply, no error) a request that reaches
        # the kernel right after a failed one, before it has finished "aborting the queue"; this
        # harness sends one request at a time and never wants one aborted
        msg_id = self.kc.execute(code, stop_on_error=False, allow_stdin=answer is not None)
        deadline = time.monotonic() + timeout
        interrupt_at = None if interrupt_after is None else time.monotonic() + interrupt_after
        parts, error = [], None  # [display_id or None, text]
        request = None  # the input request not answered yet
        while True:
            if answer is not None:
                if request is None:
                    try:
                        request = self.kc.get_stdin_msg(timeout=0.005)
                    except queue.Empty:
                        pass
                if request is not None:
                    line = answer(request["content"]["prompt"], "".join(t for _, t in parts))
                    if line is not None:
                        self.kc.input(line)
                        request = None
            if interrupt_when is not None and interrupt_when():
                interrupt_at, interrupt_when = time.monotonic(), None
            if interrupt_at is not None and time.monotonic() >= interrupt_at:
                self.km.interrupt_kernel()
                self.interrupted_at, self.interrupted_wall = time.monotonic(), time.time()
                interrupt_at = None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply in {timeout} s to {code!r}; output so far: {parts}")
            # how long to wait for a message: an interrupt still to send is sent on time (its
            # condition looked at every 10 ms, as the panel's and the toolbar's users would)
            wait = 0.1 if answer is None else 0.005
            if interrupt_when is not None:
                wait = 0.01
            elif interrupt_at is not None:
                wait = min(wait, max(0.001, interrupt_at - time.monotonic()))
            try:
                msg = self.kc.get_iopub_msg(timeout=wait)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if messages is not None:
                messages.append(msg)
            if during is not None:
                during(messages)
            kind, content = msg["msg_type"], msg["content"]
            display_id = (content.get("transient") or {}).get("display_id")
            if kind == "stream":
                parts.append([None, content["text"]])
            elif kind in ("execute_result", "display_data"):
                text = content["data"].get("text/plain", "")
                parts.append([display_id, text + "\n" if kind == "display_data" else text])
            elif kind == "update_display_data":
                for part in parts:
                    if part[0] == display_id:
                        part[1] = content["data"].get("text/plain", "") + "\n"
            elif kind == "error":
                error = content
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(text for _, text in parts), error

    def ok(self, code, **kwargs):
        out, error = self.execute(code, **kwargs)
        assert error is None, f"{code!r} failed: {error and error['ename']}: {error and error['evalue']}\n{out}"
        return out

    def close(self):
        self.kc.stop_channels()
        if self.km is not None:
            self.km.shutdown_kernel(now=True)


@contextlib.contextmanager
def ring_kernel(n=2, start=None, env=None):
    """A kernel with ``%ring start -n n`` (or the ``start`` line given) done; on exit the kernel
    is shut down and every process recorded in ``kernel.pids`` (see cluster_pids) that is left
    is killed. ``env``: variables the kernel (and so its ranks) starts with, not this process."""
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        k = Kernel()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    k.pids = []
    try:
        k.ok("%load_ext jupyter_ring")
        k.ok(start or f"%ring start -n {n}", timeout=180 if start else 90)
        yield k
    finally:
        try:
            k.close()
        finally:
            for proc in alive(k.pids):
                proc.kill()


def cluster_pids(kernel):
    """Pids of the kernel's controller, mpiexec and engines (also noted in ``kernel.pids``)."""
    out = kernel.ok("import json\nprint(json.dumps([p.pid for p in get_ipython().magics_manager"
                    ".registry['RingMagics'].cluster.processes()]))")
    pids = json.loads(out.strip().splitlines()[-1])
    kernel.pids[:] = sorted(set(kernel.pids) | set(pids))
    return pids


def sigkill_during(kernel, pid, code, after=1.5, timeout=120):
    """Run ``code`` in ``kernel`` and SIGKILL process ``pid`` ``after`` seconds into it;
    (text, error, time.monotonic() of the kill)."""
    import signal
    import threading

    killed = []
    timer = threading.Timer(after, lambda: (killed.append(time.monotonic()), os.kill(pid, signal.SIGKILL)))
    timer.start()
    try:
        out, error = kernel.execute(code, timeout=timeout)
    finally:
        timer.cancel()
    assert killed, f"the cell ended before the kill at {after} s: {out} {error}"
    return out, error, killed[0]
