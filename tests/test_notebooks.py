"""Real Jupyter kernels: the quickstart notebook under nbclient, interrupt, and a killed kernel."""

import json
import os
import queue
import signal
import time

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

from jupyter_ring import demo

pytestmark = pytest.mark.timeout(150)


def _alive(pids):
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            pass
    return out


def test_quickstart_notebook_runs_headless():
    nb = demo.run_notebook(demo.NOTEBOOK, timeout=120)
    text = demo.format_outputs(nb)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, text
    sums = [line.split(" ", 3)[3] for line in text.splitlines()
            if line.startswith(("[rank 0] 0 [", "[rank 1] 1 ["))]
    assert len(sums) == 2 and sums[0] == sums[1], text  # both ranks hold the same allreduce
    assert "[rank 0] rank 0 of 2:" in text and "[rank 1] rank 1 of 2:" in text
    assert text.count("sum matches: True") == 2
    assert "Out[5]: array([" in text
    assert "stopped 2 ranks" in text


class Kernel:
    """A real IPython kernel (jupyter_client) with helpers to run code and collect output."""

    def __init__(self):
        self.km, self.kc = start_new_kernel(kernel_name="python3")

    def execute(self, code, timeout=60, interrupt_after=None):
        msg_id = self.kc.execute(code)
        deadline = time.monotonic() + timeout
        interrupt_at = None if interrupt_after is None else time.monotonic() + interrupt_after
        stdout, error = [], None
        while True:
            if interrupt_at is not None and time.monotonic() >= interrupt_at:
                self.km.interrupt_kernel()
                interrupt_at = None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply in {timeout} s to {code!r}; output so far: {stdout}")
            try:
                msg = self.kc.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                stdout.append(content["text"])
            elif kind == "execute_result":
                stdout.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                error = content
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(stdout), error

    def ok(self, code, **kwargs):
        out, error = self.execute(code, **kwargs)
        assert error is None, f"{code!r} failed: {error and error['ename']}: {error and error['evalue']}\n{out}"
        return out

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    """A kernel with a 2-rank cluster; its finalizer kills the kernel and anything left over."""
    k = Kernel()
    pids = []
    try:
        k.ok("%load_ext jupyter_ring")
        k.ok("%ring start -n 2", timeout=90)
        k.pids = pids
        yield k
    finally:
        try:
            k.close()
        finally:
            for proc in _alive(pids):
                proc.kill()


def _cluster_pids(kernel):
    out = kernel.ok("import json\nprint(json.dumps([p.pid for p in get_ipython().magics_manager"
                    ".registry['RingMagics'].cluster.processes()]))")
    pids = json.loads(out.strip().splitlines()[-1])
    kernel.pids[:] = pids
    return pids


def test_interrupt_in_kernel_during_collective_keeps_state(kernel):
    kernel.ok("%%distributed\nimport numpy as np, time\nkept = ring.rank() + 1")
    t0 = time.monotonic()
    # rank 0 waits in the barrier for rank 1, which sleeps: only the interrupt ends this
    out, error = kernel.execute("%%distributed\nif ring.rank() == 1:\n    time.sleep(60)\n"
                                "ring.barrier()", timeout=30, interrupt_after=2.0)
    assert error is not None and error["ename"] == "KeyboardInterrupt", (out, error)
    assert time.monotonic() - t0 < 10
    out = kernel.ok("%%distributed\nprint('total', ring.allreduce(np.array([kept]), op=ring.Sum, "
                    "name='kept')[0])")
    assert sorted(out.splitlines()) == ["[rank 0] total 3", "[rank 1] total 3"]


def test_error_in_notebook_names_first_failing_rank(kernel):
    out, error = kernel.execute("%%distributed\nif ring.rank() == 1:\n    time.sleep(0.2)\n"
                                "    raise RuntimeError('only rank one')\nring.barrier()")
    assert error is not None and error["ename"] == "DistributedError"
    text = "\n".join(error["traceback"])
    assert text.startswith("[rank 1 @ ") and "RuntimeError: only rank one" in text
    assert text.index("[rank 1 @") < text.index("[rank 0 @")


# Kills the kernel: keep it last.
def test_sigkilled_kernel_leaves_no_cluster_processes(kernel):
    pids = _cluster_pids(kernel)
    names = " ".join(" ".join(p.cmdline()) for p in _alive(pids))
    assert "ipyparallel.controller" in names and "mpiexec" in names and "--mpi" in names
    kernel_pid = kernel.km.provisioner.process.pid
    t0 = time.monotonic()
    os.kill(kernel_pid, signal.SIGKILL)
    survivors = _alive(pids)
    while survivors and time.monotonic() - t0 < 10:
        time.sleep(0.05)
        survivors = _alive(pids)
    elapsed = time.monotonic() - t0
    assert survivors == [], [p.cmdline() for p in survivors]
    assert elapsed < 2.5, f"cluster outlived the kernel by {elapsed:.1f} s"
