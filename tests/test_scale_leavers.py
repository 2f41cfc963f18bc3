"""A shrink's leavers (``cluster._scale.Leavers``): the cluster is cut at once, and their processes
are followed out without blocking the kernel's cell loop (the cell's output, interrupts and
dashboard go on while they exit), with the stragglers killed at the bound."""

import subprocess
import sys
import time

import psutil

from jupyter_ring.cluster import _scale


class _Client:
    """The ipyparallel client's part a shrink uses: a view per engine list and shutdown requests
    (recorded; the leavers here are plain processes that exit or not as the test says)."""

    def __init__(self):
        self.shutdowns = []

    def __getitem__(self, ids):
        return type("View", (), {"block": True, "targets": list(ids)})()

    def shutdown(self, targets, hub, block):
        self.shutdowns.append(list(targets))


class _Cluster:
    def __init__(self, pids):
        self.ranks = [{"rank": r, "pid": pid, "size": len(pids)} for r, pid in enumerate(pids)]
        self.engine_ids = [10 + r for r in range(len(pids))]
        self.size = len(pids)
        self._running_client = _Client()
        self.replaced = {r: 1 for r in range(len(pids))}
        self.steps = {r: 5 for r in range(len(pids))}
        self.view = None


def _sleeper(seconds):
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_leavers_are_followed_out_without_waiting_and_stragglers_are_killed_at_the_bound(monkeypatch):
    monkeypatch.setattr(_scale, "_EXIT_BOUND", 1.5)
    kept, quick, slow = _sleeper(60), _sleeper(0.5), _sleeper(60)
    try:
        cluster = _Cluster([kept.pid, quick.pid, slow.pid])
        t0 = time.monotonic()
        leavers = _scale.Leavers(cluster, 1)
        # the cluster is cut at once, and the leavers' engines were asked to shut down
        assert cluster.size == 1 and [row["pid"] for row in cluster.ranks] == [kept.pid]
        assert cluster.engine_ids == [10] and cluster.replaced == {0: 1} and cluster.steps == {0: 5}
        assert cluster._running_client.shutdowns == [[11, 12]]
        assert leavers.gone() is None                  # both still run: no wait
        assert time.monotonic() - t0 < 0.5
        quick.wait(5)
        assert leavers.gone() is None                  # the slow one still runs, before the bound
        while (notes := leavers.gone()) is None:
            assert time.monotonic() - t0 < 10
            time.sleep(0.05)
        assert time.monotonic() - t0 >= 1.5            # killed at the bound, not before
        assert notes == [f"(killed 1 process(es) of the removed rank(s) that did not exit within 1.5 s: "
                         f"{slow.pid})"], notes
        assert slow.wait(5) is not None and kept.poll() is None   # the kept rank is untouched
    finally:
        for proc in (kept, quick, slow):
            proc.kill()
            proc.wait()


def test_leavers_that_exit_leave_no_note_and_a_wait_ends_when_they_do():
    gone = _sleeper(0.3)
    try:
        cluster = _Cluster([psutil.Process().pid, gone.pid])
        t0 = time.monotonic()
        assert _scale.Leavers(cluster, 1).wait() == []
        assert time.monotonic() - t0 < 5
    finally:
        gone.kill()
        gone.wait()
