"""The rank-side reporting API: throttling, silence without a listener, track, errors, stalls."""

import time

import pytest

from jupyter_ring.runtime._observe.report import Reporter
from jupyter_ring.runtime._observe.trace import Trace


def make(rate=10.0):
    reporter = Reporter(max_rate=rate)
    sent = []
    reporter.publisher = sent.append
    return reporter, sent


def test_without_a_publisher_nothing_is_sent_and_memory_stays_bounded():
    reporter = Reporter()
    for step in range(30000):
        reporter.log(step=step, loss=1.0 / (step + 1))
    assert reporter.metrics["loss"] == pytest.approx(1 / 30000)
    assert len(reporter.pending) <= 10000


def test_publication_is_throttled_to_max_rate_and_keeps_every_point():
    reporter, sent = make(rate=10.0)
    start = time.perf_counter()
    step = 0
    while time.perf_counter() - start < 0.55:
        step += 1
        reporter.log(step=step, loss=float(step))
        time.sleep(0.0005)  # a fast training loop: ~2000 steps/s
    reporter.flush()
    assert 5 <= len(sent) <= 8, len(sent)  # ~0.55 s at <= 10/s, plus the first and the flush
    points = [p for snap in sent for p in snap["history"]]
    assert [p[0] for p in points] == list(range(1, step + 1))  # nothing lost, in order
    assert sent[-1]["metrics"]["loss"] == float(step)


def test_track_reports_progress_to_the_total():
    reporter, sent = make(rate=1e9)
    assert list(reporter.track(range(5), desc="epoch 1")) == [0, 1, 2, 3, 4]
    assert sent[-1]["step"] == 5 and sent[-1]["total"] == 5 and sent[-1]["desc"] == "epoch 1"
    # step 0 (the total and the label alone) is no work: it goes out with the first step
    assert [s["step"] for s in sent] == [1, 2, 3, 4, 5]
    assert sent[0]["total"] == 5 and sent[0]["desc"] == "epoch 1"


def test_bad_values_say_what_to_do():
    reporter = Reporter()
    with pytest.raises(TypeError, match=r"log \.item\(\) of a tensor"):
        reporter.log(loss=[1.0, 2.0])
    with pytest.raises(TypeError, match="takes a number"):
        reporter.progress("3")
    with pytest.raises(ValueError, match="non-negative"):
        reporter.progress(1, total=-1)
    reporter.log(loss=float("nan"))
    assert reporter.metrics["loss"] == "nan"  # kept, and JSON-safe


def test_comm_figures_and_share_come_from_the_trace():
    reporter, sent = make(rate=1e9)
    trace = Trace(rank=1, size=2, maxlen=10)
    reporter.trace = trace
    reporter.comm_mark = (time.perf_counter() - 1.0, 0.0)
    trace.record("allreduce", "w", 4 << 20, 0.0, 0.25, {})
    reporter.progress(3)
    snap = sent[-1]
    assert snap["comm"]["allreduce"]["count"] == 1 and snap["comm"]["allreduce"]["bytes"] == 4 << 20
    assert 0.2 < snap["comm_share"] < 0.3


def test_stall_is_published_at_once_and_cleared():
    reporter, sent = make(rate=0.001)
    reporter.progress(1)
    reporter.stalled("allreduce 'w.grad'", [2], 10.0)
    assert sent[-1]["stall"] == {"what": "allreduce 'w.grad'", "missing": [2], "waited": 10.0, "rank": 0,
                                 "held": []}
    reporter.stalled(None, (), 0.0)
    assert sent[-1]["stall"] is None


# ----------------------------------------------------------------------------- issue 36, item 3
def test_a_new_cell_forgets_the_previous_cells_progress_label_total_and_metrics():
    """Item 1: a cell that only steps once showed 'short: 350 / 300 · 100 % done' and the last
    cell's loss."""
    reporter, sent = make(rate=1e9)
    reporter.progress(0, total=300, desc="short")
    for step in range(1, 351):
        reporter.log(loss=1.0 / step)
        reporter.progress(step)
    reporter.new_cell()
    reporter.progress(reporter.step + 1)   # what DistributedOptimizer.step() does
    snap = sent[-1]
    assert (snap["step"], snap["total"], snap["desc"], snap["metrics"]) == (1, None, None, {})
    assert snap["history"] == []


def test_a_cell_that_reports_no_work_sends_nothing_while_it_runs():
    """Item 2: a total and a label alone, or collectives alone, are no training."""
    reporter, sent = make(rate=1e9)
    reporter.trace = Trace(rank=0, size=2, maxlen=10)
    reporter.new_cell()
    reporter.progress(0, total=100, desc="train")
    reporter.trace.record("allreduce", "x", 64, 0.0, 0.01, {})
    reporter.flush()
    assert sent == [] and not reporter.active
    reporter.log(loss=0.5)
    assert reporter.active and sent[-1]["total"] == 100


def test_track_charts_a_loss_logged_in_the_body_at_the_step_computed_from_1():
    """Item 5: with DDP (nothing counts the step inside the body) the chart started at 0, with
    DistributedOptimizer (whose step() counts it before the log) at 1."""
    def steps(optimizer_counts):
        reporter, sent = make(rate=1e9)
        for _ in reporter.track(range(4)):
            if optimizer_counts:
                reporter.progress(reporter.step + 1)
            reporter.log(loss=1.0)
        reporter.flush()
        return [p[0] for snap in sent for p in snap["history"]]

    assert steps(False) == steps(True) == [1, 2, 3, 4]


def test_a_snapshot_counts_the_cells_collectives_and_carries_the_totals_too():
    """Item 6: 1,630 allreduces shown for a 50-step cell: the count since ring.init()."""
    reporter, sent = make(rate=1e9)
    trace = reporter.trace = Trace(rank=0, size=2, maxlen=10)
    for i in range(30):
        trace.record("allreduce", "old", 100, 0.0, 0.01, {})
    reporter.new_cell()
    for i in range(5):
        trace.record("allreduce", "w", 1000, 0.0, 0.1, {})
    reporter.progress(1)
    snap = sent[-1]
    assert snap["comm"]["allreduce"]["count"] == 5 and snap["comm"]["allreduce"]["bytes"] == 5000
    assert snap["comm"]["allreduce"]["time_s"] == pytest.approx(0.5)
    assert snap["comm_total"]["allreduce"]["count"] == 35
    trace.reset()                        # ring.reset_stats() in the cell: counted from there
    trace.record("allreduce", "w", 1000, 0.0, 0.1, {})
    reporter.progress(2)
    assert sent[-1]["comm"]["allreduce"]["count"] == 1
