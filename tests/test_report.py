"""The rank-side reporting API: throttling, silence without a listener, track, errors, stalls."""

import time

import pytest

from jupyter_ring.runtime._report import Reporter
from jupyter_ring.runtime._trace import Trace


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
    assert [s["step"] for s in sent] == [0, 1, 2, 3, 4, 5]


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
    assert sent[-1]["stall"] == {"what": "allreduce 'w.grad'", "missing": [2], "waited": 10.0, "rank": 0}
    reporter.stalled(None, (), 0.0)
    assert sent[-1]["stall"] is None
