"""A notebook kernel's cluster under a real Jupyter server: the Ring panel's Stop seen by the
kernel, and every way a kernel ends (stop, shutdown, shut down all, SIGKILL, cull) leaving no
process and no file in the profile (issue 21, items 1 and 3)."""

import asyncio
import functools
import json
import os
import signal
import time

import pytest

pytest.importorskip("jupyter_server")
pytest.importorskip("pytest_jupyter", reason="needs pytest-jupyter[server] (in jupyter_ring[test])")

from real_kernel import Kernel, alive, cluster_pids  # noqa: E402

pytest_plugins = ["pytest_jupyter.jupyter_server"]
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"jupyter_ring.server": True}}}


def _blocking(fn, *args, **kwargs):
    """Run the blocking kernel client off the server's event loop. Not asyncio.to_thread: it
    copies the context, whose jupyter_core loop variable would make the client run its
    requests on the server's (running) loop."""
    return asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))


def _profile_files():
    """Every file in the default profile's security and log folders (the cluster's files)."""
    profile = os.path.join(os.environ["IPYTHONDIR"], "profile_default")
    found = set()
    for sub in ("security", "log"):
        folder = os.path.join(profile, sub)
        if os.path.isdir(folder):
            found |= {os.path.join(sub, name) for name in os.listdir(folder)}
    return found


async def _ring_kernel(jp_serverapp, n=2):
    """A kernel of the server with ``%ring start -n n`` done: (kernel id, client, cluster pids)."""
    km = jp_serverapp.kernel_manager
    kernel_id = await km.start_kernel(kernel_name="python3")
    client = await _blocking(Kernel, km.get_kernel(kernel_id).connection_file)
    client.pids = []
    await _blocking(client.ok, "%load_ext jupyter_ring")
    await _blocking(client.ok, f"%ring start -n {n}", timeout=90)
    return kernel_id, client, await _blocking(cluster_pids, client)


async def _gone(pids, before, timeout=10):
    """Wait until no process of ``pids`` lives and the profile holds only the files ``before``;
    returns (processes left, files added)."""
    deadline = time.monotonic() + timeout
    while True:
        left, added = alive(pids), sorted(_profile_files() - before)
        if (not left and not added) or time.monotonic() > deadline:
            return left, added
        await asyncio.sleep(0.1)


async def test_panel_stop_is_seen_by_the_kernel_and_start_just_works(jp_fetch, jp_serverapp):
    kernel_id, k, pids = await _ring_kernel(jp_serverapp)
    try:
        response = await jp_fetch("jupyter-ring", "clusters")
        (cluster,) = [c for c in json.loads(response.body)["clusters"]
                      if c["owner"]["kernel_id"] == kernel_id]
        response = await jp_fetch("jupyter-ring", "clusters", cluster["id"], "stop",
                                  method="POST", body=b"")
        assert json.loads(response.body)["stopped"] is True
        assert alive(pids) == []
        # the kernel sees the cluster as stopped, and says who stopped it
        out = await _blocking(k.ok, "%ring status")
        assert "no cluster is running: the cluster of 2 ranks was stopped by the Ring panel" \
            in out, out
        assert "DEAD" not in out
        out = await _blocking(k.ok, "%%distributed\nprint(1)")  # IPython prints a UsageError
        assert out.startswith("UsageError: no cluster is running"), out
        assert "%ring start -n 2" in out and "restart" not in out and "DeadRankError" not in out
        # the next %ring start just works, in the same kernel, and the cluster runs cells
        out = await _blocking(k.ok, "%ring start -n 2", timeout=90)
        assert "ranks ready" in out, out
        out = await _blocking(
            k.ok, "%%distributed --output text\nprint(ring.allreduce(ring.rank() + 1.0, "
                  "op=ring.Sum, name='s'))")
        assert sorted(out.splitlines()) == ["[rank 0] 3.0", "[rank 1] 3.0"], out
        pids += await _blocking(cluster_pids, k)
    finally:
        k.close()
        await jp_serverapp.kernel_manager.shutdown_kernel(kernel_id)
        for proc in alive(pids):
            proc.kill()


@pytest.mark.parametrize("how", ["ring_stop", "shutdown", "shutdown_all", "sigkill", "cull"])
async def test_every_way_a_kernel_ends_leaves_no_process_and_no_file(jp_serverapp, how):
    km = jp_serverapp.kernel_manager
    before = _profile_files()
    kernel_id, k, pids = await _ring_kernel(jp_serverapp)
    kernel_pid = km.get_kernel(kernel_id).provisioner.pid
    pids = pids + [p.pid for p in alive([kernel_pid])[0].children(recursive=True)]  # + watchdog
    assert _profile_files() - before, "the cluster wrote no file: this test would see nothing"
    try:
        if how == "ring_stop":
            await _blocking(k.ok, "%ring stop")
        elif how == "shutdown":      # the notebook's "Shut Down Kernel" (DELETE /api/kernels/id)
            await km.shutdown_kernel(kernel_id)
        elif how == "shutdown_all":  # "Shut Down All Kernels", and the server's own exit
            await km.shutdown_all()
        elif how == "sigkill":
            os.kill(kernel_pid, signal.SIGKILL)
        elif how == "cull":          # an idle kernel culled by the server
            km.cull_idle_timeout = 1
            await asyncio.sleep(1.5)
            await km.cull_kernels()
            assert kernel_id not in km.list_kernel_ids(), "the culler left the kernel running"
        left, added = await _gone(pids, before)
        assert left == [], f"{how}: processes left: {[p.cmdline() for p in left]}"
        assert added == [], f"{how}: files left in the profile: {added}"
    finally:
        k.close()
        if kernel_id in km.list_kernel_ids():
            await km.shutdown_kernel(kernel_id, now=True)
        for proc in alive(pids):
            proc.kill()


def test_a_cell_cut_off_by_a_restart_ends_static_with_a_note():
    """A restart requested while a %%distributed cell runs (not from the page: another client,
    the server): the kernel ends the cell's tabs as static output and says the kernel is
    restarting, then holds the cell (its reply would go to a closed socket: a ZMQError traceback
    in the server's log) until it is ended; the restart completes and no cluster process is left."""
    from real_kernel import ring_kernel

    with ring_kernel() as k:
        pids = cluster_pids(k)
        msg_id = k.kc.execute("%%distributed\nimport time\nprint('sleeping', flush=True)\n"
                              "for i in range(600):\n    ring.allreduce(float(i), name='tick')\n"
                              "    time.sleep(0.1)\n")
        seen = []
        deadline = time.monotonic() + 60
        while not any(m["msg_type"] == "display_data" for m in seen):  # the live tabs are up
            assert time.monotonic() < deadline, [m["msg_type"] for m in seen]
            m = k.kc.get_iopub_msg(timeout=30)
            if m["parent_header"].get("msg_id") == msg_id:
                seen.append(m)
        time.sleep(1.0)
        t0 = time.monotonic()
        k.km.restart_kernel(now=False)
        took = time.monotonic() - t0
        while True:  # what the old kernel sent before it ended is in the client's socket
            try:
                m = k.kc.get_iopub_msg(timeout=2)
            except Exception:
                break
            if m["parent_header"].get("msg_id") == msg_id:
                seen.append(m)
        final = [m["content"] for m in seen if m["msg_type"] == "update_display_data"]
        assert final and 'class="jr-rank-tabs"' in final[-1]["data"]["text/html"]
        assert "[rank 1] sleeping" in final[-1]["data"]["text/plain"]
        notes = "".join(m["content"]["text"] for m in seen if m["msg_type"] == "stream")
        assert "(cut off: the kernel is restarting; the ranks of this cell stopped" in notes
        assert took < 10, f"the restart took {took:.1f} s"
        assert not alive(pids), f"survived the restart: {alive(pids)}"
        k.ok("print('fresh')")  # the new kernel answers
