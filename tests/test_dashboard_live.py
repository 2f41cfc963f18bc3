"""The dashboard's transport on a real 2-rank cluster: datapub snapshots reach the notebook side.

No kernel: the test process is the client (as the notebook kernel is), polling the AsyncResult
the way ``%%distributed`` does.
"""

import time

import pytest

from jupyter_ring.cluster import RingCluster
from jupyter_ring.widgets.live import ENGINE_SETUP, LiveDashboard, set_publishing
from bounds import SNAPSHOT_S

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def cluster():
    """Two ranks with the dashboard publisher installed; stopped at the end, even on failure."""
    c = RingCluster(n=2)
    try:
        c.start()
        c.view.execute(ENGINE_SETUP, block=True)
        yield c
    finally:
        c.stop()


def run(cluster, code, ranks=None, live=None):
    view = cluster.view if ranks is None else cluster.client[[cluster.engine_ids[r] for r in ranks]]
    live = live or LiveDashboard(ranks or cluster.size, display=False)
    ar = view.execute(code, block=False)
    while not ar.wait(0.02):
        live.poll(ar)
    ar.wait_for_output(2.0)
    ar.get()  # raise a rank's error here
    return live.finish(ar)


def test_every_point_arrives_and_the_last_state_is_final(cluster):
    state = run(cluster, """
import time, numpy as np
ring.progress(0, total=400, desc='train')
for i in range(400):
    time.sleep(0.002)
    ring.log(loss=1.0 / (i + 1) + ring.rank())
    ring.progress(i + 1)
g = ring.allreduce(np.ones(4096, np.float32), name='g')
""")
    for rank in (0, 1):
        s = state.ranks[rank]
        assert s.final and s.step == 400 and s.total == 400 and s.desc == "train"
        series = state.series("loss", max_points=10_000)[rank]
        assert len(series) == 400
        assert series[0][1] == pytest.approx(1.0 + rank)
        assert s.comm["allreduce"]["count"] >= 1 and s.comm["allreduce"]["bytes"] >= 4096 * 4
        assert s.rate > 0


def test_a_cell_on_a_subset_of_ranks(cluster):
    state = run(cluster, "ring.progress(7, total=7)\nring.log(loss=0.5)", ranks=[1])
    assert list(state.ranks) == [1] and state.ranks[1].step == 7 and state.ranks[1].final


def test_a_cell_that_reports_nothing_publishes_nothing(cluster):
    live = LiveDashboard(2, display=False)
    run(cluster, "x = 1", live=live)
    assert live.received == 0 and not live.shown


def test_torch_optimizer_steps_are_reported_without_user_code(cluster):
    pytest.importorskip("torch")
    state = run(cluster, """
import torch
import jupyter_ring.runtime.torch as hvd
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
ring.progress(0, total=25)
for i in range(25):
    opt.zero_grad()
    model(torch.ones(8, 4)).pow(2).mean().backward()
    opt.step()
""")
    assert [state.ranks[r].step for r in (0, 1)] == [25, 25]
    assert [state.ranks[r].fraction for r in (0, 1)] == [1.0, 1.0]


def test_paused_publishing_sends_nothing(cluster):
    set_publishing(cluster.view, False)
    try:
        live = LiveDashboard(2, display=False)
        run(cluster, "ring.log(loss=1.0)\nring.progress(3)", live=live)
        assert live.received == 0
    finally:
        set_publishing(cluster.view, True)


def test_update_latency_from_ring_log_to_the_notebook_state(cluster):
    """ring.log on a rank -> the state here, same machine, wall clocks: well under 0.5 s."""
    live = LiveDashboard(2, display=False)
    ar = cluster.view.execute("""
import time
for i in range(30):
    ring.log(sent=time.time())
    time.sleep(0.05)
""", block=False)
    delays = []
    while not ar.wait(0.01):
        if live.poll(ar):
            now = time.time()
            for s in live.state.ranks.values():
                if "sent" in s.metrics:
                    delays.append(now - s.metrics["sent"])
    ar.get()
    delays.sort()
    assert delays, "no snapshot arrived while the cell ran"
    assert max(delays) < SNAPSHOT_S, delays  # the typical delay: benchmarks/dashboard.py
