"""Fair share on a shared host: rank count and threads per rank follow CPU_LIMIT / MEM_LIMIT.

JupyterHub's spawners put a student's share in CPU_LIMIT and MEM_LIMIT. ``%ring start`` without
-n starts min(cores, CPU_LIMIT, MEM_LIMIT / 2 GiB) ranks and gives every rank CPU_LIMIT / ranks
threads (OpenMP, MKL, OpenBLAS, torch, TensorFlow); an -n beyond the share starts and says so.
The real hub with two students is in tests/hub/test_teaching_hub.py.
"""

import os

import pytest
from IPython.core.interactiveshell import InteractiveShell

from jupyter_ring.cluster import THREAD_VARS, share_note, threads_per_rank
from jupyter_ring.cluster._sizing import cpu_count as _cpu_count

GiB = 1 << 30


def test_threads_per_rank_divides_the_cpu_share():
    cores = _cpu_count()
    assert threads_per_rank(1, environ={}) == cores
    assert threads_per_rank(cores, environ={}) == 1
    assert threads_per_rank(cores + 3, environ={}) == 1              # never 0
    assert threads_per_rank(1, environ={"CPU_LIMIT": "1"}) == 1
    assert threads_per_rank(1, environ={"CPU_LIMIT": "0.5"}) == 1    # a fraction of a core: 1
    assert threads_per_rank(1, environ={"CPU_LIMIT": str(cores + 8)}) == cores  # no more than cores
    assert threads_per_rank(1, environ={"CPU_LIMIT": "lots"}) == cores  # ignored, as default_size


def test_share_note_names_the_limit_and_the_overrides():
    assert share_note(1, [], environ={"CPU_LIMIT": "1"}) == ""
    hub = {"JUPYTERHUB_USER": "student1", "JUPYTERHUB_API_TOKEN": "t"}
    note = share_note(2, [], environ={"CPU_LIMIT": "1", "MEM_LIMIT": str(4 * GiB), **hub})
    for part in ("-n 2 is more than this server's share", "CPU_LIMIT=1,", "MEM_LIMIT=4.0 GiB: 1 rank)",
                 "starting 2 anyway with 1 thread each", "%ring start without -n",
                 "OMP_NUM_THREADS", "c.Spawner.cpu_limit"):
        assert part in note, (part, note)
    # no hub, no hub admin to ask (issue 36: a laptop's user was sent to c.Spawner.cpu_limit)
    note = share_note(3, [], environ={}, cpus=2)
    assert "-n 3 is more than this server's share (2 cores: 2 ranks)" in note, note
    assert "admin" not in note and "Spawner" not in note and note.endswith("overrides the threads."), note
    # memory binds too: 3 GiB is one rank's worth (2 GiB each)
    assert "MEM_LIMIT=3.0 GiB: 1 rank)" in share_note(2, [], environ={"MEM_LIMIT": str(3 * GiB)})
    assert "CPU_LIMIT=half" in share_note(9, [], environ={"CPU_LIMIT": "half"})  # shown as given
    assert "share GPUs" in share_note(3, ["0", "1"], environ={})
    assert share_note(2, ["0", "1"], environ={"CPU_LIMIT": "1"}) == ""   # GPU ranks: one per GPU


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "jupyter_ring")
    magics = ip.magics_manager.registry["RingMagics"]
    try:
        yield ip
    finally:
        if magics.cluster is not None:
            magics.cluster.stop()
        ip.run_line_magic("unload_ext", "jupyter_ring")


@pytest.mark.timeout(180)
def test_ranks_and_threads_follow_cpu_limit(shell, monkeypatch, capsys):
    """A real cluster under CPU_LIMIT=1: 1 rank with 1 thread; -n 2 says it is over the share."""
    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CPU_LIMIT", "1")
    monkeypatch.delenv("MEM_LIMIT", raising=False)
    magics = shell.magics_manager.registry["RingMagics"]
    probe = ("import os, torch\n"
             "print('threads', {v: os.environ.get(v) for v in %r}, torch.get_num_threads())"
             % (THREAD_VARS,))

    shell.run_line_magic("ring", "start --gpus none")
    out = capsys.readouterr().out
    assert "1 ranks ready" in out and "more than this server's share" not in out, out
    ar = magics.cluster.view.execute(probe, block=True)
    assert ar.stdout == ["threads " + str({v: "1" for v in THREAD_VARS}) + " 1\n"], ar.stdout
    shell.run_line_magic("ring", "stop")

    shell.run_line_magic("ring", "start -n 2 --gpus none")
    out = capsys.readouterr().out
    assert "-n 2 is more than this server's share" in out and "2 ranks ready" in out, out
    ar = magics.cluster.view.execute(probe, block=True)
    assert all(line.endswith(" 1\n") for line in ar.stdout) and len(ar.stdout) == 2, ar.stdout


@pytest.mark.timeout(180)
def test_kernel_thread_setting_wins(shell, monkeypatch, capsys):
    """OMP_NUM_THREADS set in the kernel before %ring start is what the ranks get."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("CPU_LIMIT", raising=False)
    shell.run_line_magic("ring", "start -n 1 --gpus none")
    magics = shell.magics_manager.registry["RingMagics"]
    ar = magics.cluster.view.execute("import os; print(os.environ['OMP_NUM_THREADS'], "
                                     "os.environ['MKL_NUM_THREADS'])", block=True)
    assert ar.stdout == [f"3 {_cpu_count()}\n"], ar.stdout
