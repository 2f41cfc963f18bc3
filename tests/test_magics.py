"""%ring and %%distributed in a real IPython shell against a real 2-rank MPI cluster."""

import os
import re
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import psutil
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from jupyter_ring.cluster._procs import shm_files
from jupyter_ring.errors import DeadRankError, DistributedError

pytestmark = pytest.mark.timeout(120)


class _Recorder:
    """A stdout stand-in that records when each piece of text arrived."""

    def __init__(self):
        self.parts = []

    def write(self, text):
        self.parts.append((time.monotonic(), text))
        return len(text)

    def flush(self):
        pass

    @property
    def text(self):
        return "".join(text for _, text in self.parts)


@pytest.fixture(scope="module")
def ip():
    """A real IPython shell with the extension loaded and a 2-rank cluster; stopped at the end."""
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "jupyter_ring")
    try:
        shell.run_line_magic("ring", "start -n 2")
        shell.run_cell_magic("distributed", "", "import numpy as np")
        yield shell
    finally:
        magics = shell.magics_manager.registry.get("RingMagics")
        if magics is not None and magics.cluster is not None:
            magics.cluster.stop()
        shell.run_line_magic("unload_ext", "jupyter_ring")


def plain(lines):
    """Rendered traceback lines without ANSI colours."""
    return [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines]


def cell(ip, code, line=""):
    """Run a %%distributed cell through run_cell (as a notebook does); return the result."""
    return ip.run_cell(f"%%distributed {line}\n{code}")


def raises_in_cell(ip, code, line=""):
    result = cell(ip, code, line)
    assert result.error_in_exec is not None, "the cell should have failed"
    return result.error_in_exec


def test_front_end_imports_no_framework():
    import subprocess

    code = ("import sys, jupyter_ring\nassert 'jupyter_ring.magics' not in sys.modules\n"
            "import jupyter_ring.magics, jupyter_ring.cluster\n"
            "print(sorted(m for m in ('torch', 'tensorflow', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_help_has_usage_and_example():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "jupyter_ring")
    ring_doc = shell.find_line_magic("ring").__doc__
    dist_doc = shell.find_cell_magic("distributed").__doc__
    assert "%ring start [-n N]" in ring_doc and "In [2]: %ring start -n 2" in ring_doc
    assert "%ring pull NAME [--rank R | --all]" in ring_doc
    assert "--ranks" in dist_doc and "--timeout" in dist_doc and "--rank0-output" in dist_doc
    assert "[rank 0] [3. 3. 3.]" in dist_doc


def test_start_prints_table_and_status(ip, capsys):
    ip.run_line_magic("ring", "status")
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["rank", "host", "pid", "device"]
    rows = [line.split() for line in out[1:3]]
    assert [r[0] for r in rows] == ["0", "1"]
    assert all(psutil.pid_exists(int(r[2])) for r in rows)
    assert all(r[3] == "cpu" for r in rows)
    assert "2 ranks alive" in out[3]


def test_start_twice_says_running_and_how_to_restart(ip):
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("ring", "start -n 2")
    message = str(info.value)
    assert "already running" in message and "%ring restart" in message


def test_bad_subcommands_are_usage_errors(ip):
    for line in ("", "launch", "start -n x", "start --launcher pbs", "pull"):
        with pytest.raises(UsageError):
            ip.run_line_magic("ring", line)
    # issue 36: '--n 2' was "ambiguous option: --n could match --nodes, --ntasks-per-node"
    for line, hint in (("start --n 2", "-n"), ("start --gpu 0", "--gpus"), ("where --all-thread", "--all-threads")):
        with pytest.raises(UsageError, match=f"unrecognized arguments: {line.split(' ', 1)[1]} .did you mean {hint}.") as info:
            ip.run_line_magic("ring", line)
        assert "ambiguous" not in str(info.value)
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("ring", "stop --force")
    assert "did you mean" not in str(info.value)  # nothing near: no guess


def test_state_persists_and_output_is_tagged(ip, capsys):
    assert cell(ip, "import numpy as np\nx = np.arange(3) * (ring.rank() + 1)").success
    capsys.readouterr()
    assert cell(ip, "print('x =', x.tolist())\nprint('size', ring.size())").success
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == ["[rank 0] size 2", "[rank 0] x = [0, 1, 2]",
                             "[rank 1] size 2", "[rank 1] x = [0, 2, 4]"]


def test_allreduce_cell_matches_numpy(ip, capsys):
    code = ("x = np.random.default_rng(ring.rank()).standard_normal(5)\n"
            "s = ring.allreduce(x, op=ring.Sum, name='x')\n")
    assert cell(ip, code).success
    ip.run_line_magic("ring", "pull s --all")
    want = sum(np.random.default_rng(r).standard_normal(5) for r in range(2))
    assert len(ip.user_ns["s"]) == 2
    for got in ip.user_ns["s"]:
        np.testing.assert_allclose(got, want)


def test_output_streams_while_the_cell_runs(ip, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    t0 = time.monotonic()
    result = cell(ip, "import time\nprint('before', flush=True)\ntime.sleep(2)\nprint('after')")
    end = time.monotonic()
    monkeypatch.undo()
    assert result.success
    first = next(t for t, text in recorder.parts if "[rank 0] before" in text)
    assert first - t0 < 1.5 and end - first > 1.0, "'before' was not shown until the cell ended"
    assert "[rank 1] after" in recorder.text


def test_error_shows_first_failing_rank_first_and_peers_are_interrupted(ip):
    t0 = time.monotonic()
    err = raises_in_cell(ip, "import time\nif ring.rank() == 1:\n    time.sleep(0.3)\n"
                             "    raise ValueError('bad batch on rank one')\nring.barrier()")
    elapsed = time.monotonic() - t0
    assert isinstance(err, DistributedError)
    assert err.rank == 1 and err.ename == "ValueError"
    assert elapsed < 6, f"rank 0 stayed blocked in the barrier for {elapsed:.1f} s"
    lines = plain(err._render_traceback_())
    assert lines[0].startswith("[rank 1 @ ") and "ValueError: bad batch on rank one" in lines[0]
    assert any("raise ValueError" in line for line in lines)
    tail = "\n".join(lines[lines.index(""):])
    assert "[rank 0 @ " in tail and "KeyboardInterrupt (interrupted: a peer rank failed)" in tail
    assert [r for r, _, _ in err.others] == [0]
    # the runtime resyncs: the next collective is exact on every rank
    assert cell(ip, "y = ring.allreduce(np.full(4, ring.rank() + 1.0), op=ring.Sum, name='y')").success
    ip.run_line_magic("ring", "pull y --all")
    assert [v.tolist() for v in ip.user_ns["y"]] == [[3.0] * 4, [3.0] * 4]


def test_same_error_everywhere_is_one_headline_naming_every_rank(ip):
    # issue 21: an error every rank raised alike is everybody's, shown once, blaming no rank
    err = raises_in_cell(ip, "undefined_name_123")
    assert err.ename == "NameError" and err.rank in (0, 1)
    assert err.others == [] and [r for r, _ in err.same] == [0, 1]
    lines = plain(err._render_traceback_())
    assert lines[0].startswith("[ranks 0, 1 @ ") and "NameError" in lines[0]
    assert not any("probably as a consequence" in line for line in lines)
    assert sum("Traceback (most recent call last)" in line for line in lines) == 1, lines


def test_a_rank_still_formatting_its_own_error_keeps_it(ip: InteractiveShell,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Every rank raises; rank 1 takes 1.5 s to format its error (IPython formatting frames of a
    large file for the first time took 0.5 s on a loaded host), so the notebook interrupts it
    meanwhile as a peer of the failed rank 0: that interrupt must not land in the formatting
    (IPython then shows KeyboardInterrupt instead, or, in the copy it stores for the history,
    replaces the rank's error with it)."""
    err = raises_in_cell(ip, "import time\nclass SlowToShow(Exception):\n"
                             "    def __str__(self):\n"
                             "        if ring.rank() == 1:\n            time.sleep(1.5)\n"
                             "        return 'every rank fails'\nraise SlowToShow()")
    shown = capsys.readouterr()
    assert "KeyboardInterrupt" not in shown.out + shown.err, shown
    assert err.ename == "SlowToShow" and err.others == [] and [r for r, _ in err.same] == [0, 1]
    lines = plain(err._render_traceback_())
    assert lines[0].startswith("[ranks 0, 1 @ ")
    assert "interrupted rank(s) 1: a peer rank failed" in lines, lines  # it was interrupted
    assert cell(ip, "ok = ring.allreduce(np.ones(2), op=ring.Sum, name='after_slow')").success


def _interrupt_in(seconds: float) -> threading.Timer:
    """A timer that sends this process SIGINT in ``seconds`` (as the kernel's Interrupt does)."""
    # the process's own handler: a test that left another one would hide this test's interrupt
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGINT)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_interrupt_during_collective_keeps_state(ip: InteractiveShell) -> None:
    assert cell(ip, "import numpy as np\nkept = ring.rank() * 10").success
    t0 = time.monotonic()
    timer = _interrupt_in(1.5)
    try:
        # rank 0 waits in the barrier for rank 1, which sleeps: only the interrupt ends this
        result = cell(ip, "import time\nif ring.rank() == 1:\n    time.sleep(60)\nring.barrier()")
    finally:
        timer.cancel()
    elapsed = time.monotonic() - t0
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert "every rank stopped" in str(result.error_in_exec), str(result.error_in_exec)
    assert elapsed < 10, f"the interrupt took {elapsed:.1f} s"
    assert cell(ip, "z = ring.allreduce(np.array([kept + 1.0]), op=ring.Sum, name='z')").success
    ip.run_line_magic("ring", "pull z --all")
    assert [v.tolist() for v in ip.user_ns["z"]] == [[12.0], [12.0]]
    ip.run_line_magic("ring", "pull kept --rank 1")
    assert ip.user_ns["kept"] == 10


def test_interrupt_before_a_rank_began_the_cell_still_stops_it(ip: InteractiveShell) -> None:
    """Rank 1 is still busy with another request (a completion, a pull, or a slow start on a
    loaded host) when the interrupt comes: a bare SIGINT landed in that request, or was ignored
    between requests, so rank 1 ran the whole cell and its barrier met the next cell's allreduce.
    The first interrupt must stop every rank: the interrupt names the cell, and rank 1 stops as it
    begins it, leaving the earlier request alone (engines/_interrupts.py)."""
    cluster = ip.magics_manager.registry["RingMagics"].cluster
    busy = cluster.client[cluster.engine_ids[1]].execute("import time; time.sleep(2.5)", block=False)
    t0 = time.monotonic()
    timer = _interrupt_in(1.5)
    try:
        result = cell(ip, "import time\nif ring.rank() == 1:\n    time.sleep(20)\nring.barrier()")
    finally:
        timer.cancel()
    elapsed = time.monotonic() - t0
    busy.wait(10)
    assert busy.successful(), busy.get()  # the request that held rank 1 was not interrupted
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert "every rank stopped" in str(result.error_in_exec), str(result.error_in_exec)
    assert "rank 1 before the cell began" in str(result.error_in_exec), str(result.error_in_exec)
    assert elapsed < 10, f"the interrupt took {elapsed:.1f} s"
    t1 = time.monotonic()
    assert cell(ip, "late = ring.allreduce(np.ones(3), op=ring.Sum, name='after_late')").success
    assert time.monotonic() - t1 < 5


def test_interrupt_while_the_cell_is_being_sent_stops_the_ranks(ip: InteractiveShell,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The interrupt lands in the notebook while the cell's requests go out (the kernel's main
    thread slowed down on a loaded host: 2 s here, after the requests left): the ranks that got
    theirs must be interrupted too, not left running the cell."""
    from jupyter_ring import _cell

    class SlowToSend(_cell.CellExecution):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            time.sleep(2.0)

    monkeypatch.setattr(_cell, "CellExecution", SlowToSend)
    t0 = time.monotonic()
    timer = _interrupt_in(1.0)
    try:
        result = cell(ip, "import time\nif ring.rank() == 1:\n    time.sleep(20)\nring.barrier()")
    finally:
        timer.cancel()
    assert isinstance(result.error_in_exec, KeyboardInterrupt), result.error_in_exec
    assert "every rank stopped" in str(result.error_in_exec), str(result.error_in_exec)
    assert time.monotonic() - t0 < 10
    monkeypatch.undo()
    t1 = time.monotonic()
    assert cell(ip, "sent = ring.allreduce(np.ones(3), op=ring.Sum, name='after_sent')").success
    assert time.monotonic() - t1 < 5


def test_timeout_interrupts_and_names_it(ip):
    t0 = time.monotonic()
    err = raises_in_cell(ip, "import time\ntime.sleep(60)", "--timeout 1")
    assert time.monotonic() - t0 < 8
    assert isinstance(err, DistributedError) and err.ename == "KeyboardInterrupt"
    assert "--timeout 1 s" in err.note
    assert cell(ip, "ok = 1").success


def test_push_pull_round_trip(ip):
    ip.user_ns["lr"] = 0.25
    ip.user_ns["table"] = {"a": [1, 2], "b": np.arange(4.0)}
    ip.run_line_magic("ring", "push lr table")
    assert cell(ip, "out = (lr * (ring.rank() + 1), table['a'], float(table['b'].sum()))").success
    ip.run_line_magic("ring", "pull out")
    assert ip.user_ns["out"] == (0.25, [1, 2], 6.0)
    ip.run_line_magic("ring", "pull out --rank 1")
    assert ip.user_ns["out"] == (0.5, [1, 2], 6.0)
    ip.run_line_magic("ring", "pull out --all")
    assert ip.user_ns["out"] == [(0.25, [1, 2], 6.0), (0.5, [1, 2], 6.0)]


def test_push_pull_errors(ip):
    with pytest.raises(UsageError, match="no variable 'not_here_42'"):
        ip.run_line_magic("ring", "push not_here_42")
    with pytest.raises(UsageError, match="'never_defined' is not defined on rank"):
        ip.run_line_magic("ring", "pull never_defined")
    with pytest.raises(UsageError, match="ranks 0..1"):
        ip.run_line_magic("ring", "pull lr --rank 7")
    with pytest.raises(UsageError):
        ip.run_line_magic("ring", "pull lr --rank 1 --all")


@pytest.mark.parametrize("ranks,needle", [
    ("5", "rank 5 does not exist; the cluster has ranks 0..1"),
    ("1-0", "runs backwards"),
    ("x", "'x' is not a rank or a range"),
    ("0,", "'' is not a rank"),
])
def test_bad_ranks_are_clear_usage_errors(ip, ranks, needle):
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("distributed", f"--ranks {ranks}", "print(1)")
    assert needle in str(info.value)


def test_ranks_subset_and_rank0_output(ip, capsys):
    assert cell(ip, "print('only', ring.rank())", "--ranks 1").success
    assert capsys.readouterr().out.splitlines() == ["[rank 1] only 1"]
    assert cell(ip, "print('from', ring.rank())", "--rank0-output").success
    assert capsys.readouterr().out.splitlines() == ["from 0"]


def test_rich_output_and_results_carry_the_rank(ip, capsys):
    published = []
    original = ip.display_pub.publish

    def publish(data, metadata=None, **kwargs):
        published.append((data, metadata))
        return original(data, metadata=metadata, **kwargs)

    ip.display_pub.publish = publish
    try:
        assert cell(ip, "from IPython.display import HTML, display\n"
                        "display(HTML(f'<b>rank {ring.rank()}</b>'))\nring.rank() + 100").success
    finally:
        del ip.display_pub.publish
    out = capsys.readouterr().out
    html = sorted((md or {}).get("jupyter_ring_rank") for data, md in published
                  if "<b>rank" in data.get("text/html", ""))
    assert html == [0, 1]
    assert "[rank 0] Out: 100" in out and "[rank 1] Out: 101" in out


# Leaves the shared cluster restarted: keep these last.
def test_dead_engine_is_reported_by_rank_and_restart_works(ip, capsys):
    magics = ip.magics_manager.registry["RingMagics"]
    old = magics.cluster
    shm = shm_files([row["pid"] for row in old.ranks])
    assert shm, "the ranks map no file in /dev/shm: this test no longer sees MPI's segments"
    old.max_restarts = 0  # replacing dead ranks turned off on a running cluster: the old way
    victim = old.ranks[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while not old.dead_ranks() and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(DeadRankError) as info:
        ip.run_cell_magic("distributed", "", "print(1)")
    message = str(info.value)
    assert "rank 1" in message and "%ring restart" in message
    assert 1 in info.value.ranks
    capsys.readouterr()
    ip.run_line_magic("ring", "status")
    assert "DEAD" in capsys.readouterr().out
    old_pids = [p.pid for p in old.processes()]
    ip.run_line_magic("ring", "restart")
    assert magics.cluster is not old and magics.cluster.size == 2
    assert cell(ip, "import numpy as np\nr = ring.allreduce(np.ones(2), op=ring.Sum, name='r')").success
    ip.run_line_magic("ring", "pull r")
    assert ip.user_ns["r"].tolist() == [2.0, 2.0]
    survivors = [p for p in old_pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert survivors == []
    # the killed ranks never ran MPI_Finalize, which unlinks MPI's shared-memory files
    assert [f for f in shm if os.path.exists(f)] == [], "the dead cluster's /dev/shm files are left"


def test_stop_then_restart_then_stop(ip, capsys):
    magics = ip.magics_manager.registry["RingMagics"]
    pids = [p.pid for p in magics.cluster.processes()]
    ip.run_line_magic("ring", "stop")
    assert "stopped 2 ranks" in capsys.readouterr().out
    with pytest.raises(UsageError, match="no cluster is running"):
        ip.run_cell_magic("distributed", "", "print(1)")
    time.sleep(0.5)
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    ip.run_line_magic("ring", "restart")
    out = capsys.readouterr().out
    assert "2 ranks ready" in out
    assert cell(ip, "print(ring.size())").success
