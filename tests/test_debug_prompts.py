"""The debugger's two ends without a cluster (issue 35): ranks played by threads of this process,
each stopping in the ranks' real pdb (``engines/_debugger.py``), talking through the records in
a temporary folder to the kernel's end (``_debug.Debuggers``) with a scripted ``input()``."""

import bdb
import threading
import time

import pytest

from jupyter_ring._debug import Debuggers
from jupyter_ring.engines._debugger import RankDebugger
from jupyter_ring.runtime._observe import debugger as records


class Ranks:
    """Threads that each set ``value``, stop at a breakpoint, and report ``value`` afterwards."""

    def __init__(self, folder, ranks):
        self.folder = folder
        self.values = {}
        self.quit = set()
        self.threads = [threading.Thread(target=self._rank, args=(r,), daemon=True) for r in ranks]

    def _rank(self, rank):
        debugger = RankDebugger(self.folder, rank)
        value = rank * 10
        try:
            debugger.breakpointhook()
            self.values[rank] = value
        except bdb.BdbQuit:
            self.quit.add(rank)

    def start(self, wait_for=()):
        for thread in self.threads:
            thread.start()
        deadline = time.monotonic() + 20
        while set(records.waiting_prompts(self.folder)) != set(wait_for):
            assert time.monotonic() < deadline, "the ranks never reached their prompts"
            time.sleep(0.01)

    def join(self):
        for thread in self.threads:
            thread.join(20)
            assert not thread.is_alive(), "a rank is still in its debugger"


def converse(folder, ranks, lines):
    """Serve the ranks' prompts with ``lines`` (a line, or an exception to raise); return what
    was shown and the prompts asked."""
    shown, asked = [], []

    def ask(prompt):
        asked.append(prompt)
        line = lines.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line

    debuggers = Debuggers(str(folder), ranks, ask=ask, show=shown.append)
    deadline = time.monotonic() + 20
    while lines and time.monotonic() < deadline:
        debuggers.attend()
        time.sleep(0.01)
    return "".join(shown), asked


@pytest.fixture
def folder(tmp_path):
    Debuggers(str(tmp_path), []).listen()
    return tmp_path


def test_two_ranks_listed_switched_and_cast_to(folder):
    ranks = Ranks(str(folder), [0, 1])
    ranks.start(wait_for={0, 1})
    text, asked = converse(folder, [0, 1, 2], [
        "ranks", "p value", "rank 1", "p value", "rank 2", "rank 7", "cast 1,2 p value + 1",
        "cast all value = 5", "cast all c"])
    ranks.join()
    assert "ranks stopped in the debugger: 0 at test_debug_prompts.py:" in text, text
    assert "rank 0: at the prompt" in text and "rank 1: at the prompt" in text, text
    assert "rank 2: running" in text, text
    assert asked[0].startswith("(Pdb rank 0; stopped: 0,1)"), asked
    assert asked[3].startswith("(Pdb rank 1; stopped: 0,1)"), asked
    assert "\n0\n" in text and "\n10\n" in text, text                 # p value on 0, then on 1
    assert "rank 2 is not at a debugger prompt (running)" in text, text
    assert "no rank 7 in this cell (ranks 0, 1, 2)" in text, text
    assert "(not at a prompt, skipped: rank(s) 2)" in text and "[rank 1]\n11\n" in text, text
    assert ranks.values == {0: 5, 1: 5}  # the assignment cast to both stuck; `c` let both go


def test_a_front_end_without_input_lets_the_ranks_go_on(folder):
    ranks = Ranks(str(folder), [0])
    ranks.start(wait_for={0})
    text, _ = converse(folder, [0], [NotImplementedError("no stdin")])
    ranks.join()
    assert "does not answer input requests" in text and ranks.values == {0: 0}


def test_end_of_input_quits_as_in_pdb(folder):
    ranks = Ranks(str(folder), [0])
    ranks.start(wait_for={0})
    converse(folder, [0], [EOFError()])
    ranks.join()
    assert ranks.values == {} and ranks.quit == {0}  # pdb's EOF quits: BdbQuit
    assert not records.waiting_prompts(str(folder))


def test_a_breakpoint_without_a_listening_cell_is_skipped(tmp_path, capsys):
    ranks = Ranks(str(tmp_path), [3])
    ranks.start()
    ranks.join()
    assert ranks.values == {3: 30}
    assert "breakpoint() on rank 3 skipped" in capsys.readouterr().err


def test_pythonbreakpoint_0_is_honoured(folder, monkeypatch):
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    ranks = Ranks(str(folder), [0])
    ranks.start()
    ranks.join()
    assert ranks.values == {0: 0}


def test_ring_where_says_a_rank_is_in_the_debugger(tmp_path):
    """``%ring where`` (and the Ring panel's Where?) read the held mark: the state line says so."""
    from jupyter_ring.cluster._where import RankWhere, format_where, where_json
    from jupyter_ring.runtime._observe.debugger import Hold

    hold = Hold()
    hold.arm(str(tmp_path), 1)
    hold.enter("12.py:3 in <module>")
    assert records.held_ranks(str(tmp_path)) == [1] and hold.anyone()
    item = RankWhere(1, "vm", 124, None, (), "", 0.01, records.read_held(str(tmp_path), 1) or "")
    assert format_where([item]).startswith("rank 1 @ vm (pid 124): in the debugger (pdb), stopped "
                                           "at 12.py:3 in <module>")
    assert where_json([item])[0]["debugger"] == "12.py:3 in <module>"
    hold.leave()
    assert records.held_ranks(str(tmp_path)) == [] and not hold.anyone()


def test_the_mark_of_a_killed_rank_holds_nobody(tmp_path):
    """A rank killed at its prompt leaves its mark: its peers must still be able to stall."""
    import json
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    with open(records.held_path(str(tmp_path), 2), "w") as fh:
        json.dump({"pid": int(gone.stdout), "host": socket.gethostname(), "where": "x.py:1"}, fh)
    assert records.held_ranks(str(tmp_path)) == []


def test_post_mortem_before_any_failed_cell_says_so():
    """``%ring debug`` in a session where no distributed cell has failed: a clear UsageError
    (checked before anything of the cluster is touched)."""
    from IPython.core.error import UsageError

    from jupyter_ring._postmortem import PostMortem

    with pytest.raises(UsageError, match=r"no %%distributed cell has failed in this session yet"):
        PostMortem(None).debug(None)
