"""The dashboard's figures as a user reads them: rate, ETA, time in collectives, stragglers, the
loss chart's axes, in the first seconds of a run and over its course.

The ranks are simulated with the runtime's real ``Reporter`` and ``Trace`` on a shared fake clock
(their throttle, their snapshot timing, their comm totals), and their snapshots reach the state in
publication order, as the datapub transport delivers them.
"""

import math
import random
import re

import pytest

from jupyter_ring.runtime._observe.report import Reporter
from jupyter_ring.runtime._observe.trace import Trace
from jupyter_ring.widgets._render import linear_ticks, log_ticks, rank_cells, render_chart, render_html
from jupyter_ring.widgets._state import DashboardState
from test_dashboard import clock, snap  # noqa: F401 - clock is a fixture


class Rank:
    """One simulated rank: a real Reporter (5 snapshots/s) and a real Trace, created long before
    the cell runs (as the runtime's reporter is, at import)."""

    def __init__(self, rank, size):
        self.reporter = Reporter(max_rate=5.0)
        self.reporter.rank = rank
        self.reporter.trace = Trace(rank, size, maxlen=10)
        self.sent = []
        self.reporter.publisher = lambda s: self.sent.append(s)


def simulate(clock, size=2, steps=600, step_s=0.01, comm_s=lambda i: 0.004, offsets=(0.0, 0.004),
             idle=300.0, total=None, epoch=None, setup=0.0):
    """Lockstep ranks: step ``i`` takes ``step_s`` + the extra of ``comm_s(i)`` over 4 ms, of which
    ``comm_s(i)`` is spent in an allreduce; rank r runs ``offsets[r]`` s behind rank 0 within a step.
    ``epoch``: restart the step count (ring.track per epoch) every ``epoch`` steps; ``setup``: s
    between ``ring.progress(0, total)`` and the first step (loading data). Returns every
    snapshot as (publish time, rank, seq, snapshot), in publication order."""
    ranks = [Rank(r, size) for r in range(size)]
    clock.now += idle  # the reporters were created at import, minutes before the cell
    t0 = clock.cell_start = clock.now
    published = []

    def publish(r, rank):
        while rank.sent:
            published.append((clock.now, r, len(published) + 1, rank.sent.pop(0)))

    for r, rank in enumerate(ranks):
        clock.now = t0 + offsets[r]
        rank.reporter.progress(0, total=total or steps, desc="train")
        publish(r, rank)
    t = t0 + setup
    for i in range(steps):
        spent = comm_s(i)
        t += step_s + max(0.0, spent - 0.004)
        for r, rank in enumerate(ranks):
            clock.now = t + offsets[r]
            rank.reporter.trace.record("allreduce", "grads", 4096, 0.0, spent, {})
            step = i % epoch + 1 if epoch else i + 1  # ring.track: 1..epoch, then 1.. again
            rank.reporter.progress(step)
            rank.reporter.log(loss=1.0 / (i + 1))
            publish(r, rank)
    for r, rank in enumerate(ranks):  # the cell ends: post_execute publishes the final state
        rank.reporter.publish(final=True)
        publish(r, rank)
    published.sort(key=lambda item: item[0])
    return published


def replay(published, state, delay=0.02, each=None, origin=None):
    """Ingest the snapshots as they arrive (``delay`` s after publication); ``each(t)`` after each,
    ``t`` in seconds since ``origin`` (default: the first publication)."""
    origin = published[0][0] if origin is None else origin
    for when, rank, seq, snapshot in published:
        state.ingest(rank, snapshot, seq=seq, received=when + delay)
        if each is not None:
            each(when + delay - origin)


# ------------------------------------------------------------------------- the first seconds
@pytest.mark.parametrize("setup", [0.0, 3.0])
def test_first_seconds_of_lockstep_ranks_show_no_false_figure_and_no_straggler(clock, setup):
    """Issue 21 item 2: '0.0 it/s' while training, 'share 0 %', a lockstep rank called straggler.
    ``setup``: seconds before the first step (loading data): no figure then, and no low rate
    after it."""
    published = simulate(clock, steps=600, setup=setup)  # 100 it/s, 40 % in the allreduce
    state = DashboardState(2)
    seen = []

    def look(t):
        cells = [rank_cells(state, r) for r in (0, 1)]
        seen.append((t, cells, state.stragglers(), render_html(state)))

    # times from the cell's start: ring.progress(0, total) alone publishes nothing (no work yet)
    replay(published, state, each=look, origin=clock.cell_start)
    wrong = []  # every wrong reading, so that a failure shows them all
    for t, cells, stragglers, page in seen:
        if stragglers or "(straggler)" in page:
            wrong.append((t, "straggler", stragglers, [c["step"] for c in cells]))
        for cell in cells:
            if re.match(r"0(\.0*)? it/s", cell["rate"]):
                wrong.append((t, "no progress shown", cell))
            if t < setup + 1.0 and (cell["rate"] or cell["comm"] or cell["eta"]):
                wrong.append((t, "a figure before it is measured", cell))  # a reading is noise
            if cell["rate"] and not 85 <= float(cell["rate"].split()[0]) <= 115:
                wrong.append((t, "rate", cell))
            if cell["comm"] and not 30 <= int(cell["comm"].split()[0]) <= 50:
                wrong.append((t, "share", cell))
    assert not wrong, wrong[:3] + wrong[-3:]
    late = [cells for t, cells, _, _ in seen if t > setup + 1.5]
    assert late and all(c["rate"] and c["comm"] and c["eta"] for cells in late for c in cells)


def test_a_restarted_step_count_keeps_the_rate(clock):
    """ring.track per epoch: the step goes back to 0 every 50 steps; the rate stays ~100 it/s."""
    state = DashboardState(2)
    rates = []
    replay(simulate(clock, steps=500, epoch=50, total=50), state,
           each=lambda t: rates.append(state.ranks[0].rate) if t > 1.5 else None)
    assert rates and all(80 <= r <= 120 for r in rates), (min(rates), max(rates))


def test_a_cell_whose_work_fits_between_two_snapshots_gets_its_final_figures():
    state = DashboardState(1)
    state.ingest(0, snap(0, step=0, total=50, t=100.0), seq=1)
    state.ingest(0, snap(0, step=50, total=50, t=100.1, final=True,
                         comm={"allreduce": {"time_s": 0.05, "count": 50, "bytes": 0, "busbw": 0}}),
                 seq=2)
    assert state.ranks[0].rate is None  # live: one reading, no figure
    state.freeze()
    assert state.ranks[0].rate == pytest.approx(500) and state.ranks[0].comm_share == pytest.approx(0.5)


# ------------------------------------------------------------------------------- stragglers
def test_a_real_straggler_is_called_after_a_window_and_stays_called():
    state = DashboardState(3)
    called = []
    for tick in range(61):  # 12 s at 5 snapshots/s; rank 2 runs at half speed
        t = 100 + tick / 5
        for rank, rate in ((0, 20.0), (1, 21.0), (2, 10.0)):
            state.ingest(rank, snap(rank, step=int(rate * (t - 100)), total=1000, t=t), received=t)
        called.append((t - 100, state.stragglers()))
    assert all(ranks == [] for t, ranks in called if t < state.min_span + state.window)
    assert all(ranks == [2] for t, ranks in called if t >= state.min_span + state.window + 0.2)


def test_one_slow_window_is_not_a_straggler():
    """A rank that pauses for 2 s (a checkpoint, a GC) and goes on is not called a straggler."""
    state = DashboardState(2)
    steps = {0: 0.0, 1: 0.0}
    for tick in range(76):
        t = 100 + tick / 5
        for rank in (0, 1):
            paused = rank == 1 and 106 <= t < 108
            steps[rank] += 0 if paused else 20 / 5
            state.ingest(rank, snap(rank, step=int(steps[rank]), total=10_000, t=t), received=t)
        assert state.stragglers() == [], t


# ---------------------------------------------------------------- share of time in collectives
def test_time_in_collectives_is_smoothed_and_the_final_figure_is_the_whole_cell(clock):
    """Issue 21 item 8: 55, 60, 62, 82, then 47 % final. A slow allreduce (0.2 s waiting) in one
    step of 45, at random, makes half-second readings jump; the window's do not, and the final
    figure is the whole cell's."""
    rng = random.Random(3)
    comm = [0.2 if rng.random() < 1 / 45 else 0.004 for _ in range(1500)]
    published = simulate(clock, steps=1500, comm_s=comm.__getitem__)
    state = DashboardState(2)
    shares = []
    replay(published, state, each=lambda t: shares.append(state.ranks[0].comm_share)
           if t > state.window + 1 else None)
    raw = [s["comm_share"] for _, r, _, s in published if r == 0][10:]

    def jumps(figures):
        return max(abs(b - a) for a, b in zip(figures, figures[1:]))

    assert jumps(raw) > 0.2  # the rank's own half-second reading jumps from one to the next...
    assert shares and jumps(shares) < 0.05, jumps(shares)  # ...the window's moves smoothly
    state.freeze()
    spent = sum(comm)
    wall = sum(0.01 + max(0.0, c - 0.004) for c in comm)
    assert state.ranks[0].comm_share == pytest.approx(spent / wall, abs=0.01)
    assert state.ranks[0].rate == pytest.approx(1500 / wall, rel=0.02)
    page = render_html(state)
    assert "time in collectives" in page and "over the whole cell" in page
    assert re.search(r'<th title="time in collectives: the share of wall-clock time[^"]*">', page)


# --------------------------------------------------------------------------------- the chart
def loss_state(values, ranks=1, start=1, total=None):
    """A state whose ranks logged ``values`` at steps start, start+1, ..."""
    state = DashboardState(ranks)
    for rank in range(ranks):
        hist = [(start + i, 100 + i * 0.01, {"loss": v * (1 + 0.01 * rank)})
                for i, v in enumerate(values)]
        last = start + len(values) - 1
        state.ingest(rank, snap(rank, step=last, total=total, history=hist, t=200))
    return state


def ticks_of(svg, cls):
    return re.findall(rf'<text class="{cls}"[^>]*>([^<]*)</text>', svg)


def test_log_axis_by_default_when_the_loss_spans_decades_with_round_labels():
    """Issue 21 item 7: only min/max labelled, clipped ('.003267', '0009594'), linear axis flat."""
    values = [0.69 * math.exp(-i / 300) + 0.003 for i in range(2560)]
    state = loss_state(values, ranks=2)
    svg = render_chart(state)
    assert 'data-scale="log"' in svg and "log scale" in svg
    assert ticks_of(svg, "jr-ytick") == ["0.001", "0.01", "0.1", "1"]
    # a loss that stays within a decade stays linear, with round ticks
    svg = render_chart(loss_state([2.3 - 1.8 * i / 999 for i in range(1000)]))
    assert 'data-scale="linear"' in svg
    assert ticks_of(svg, "jr-ytick") == ["0.5", "1.0", "1.5", "2.0", "2.5"]


def test_labels_fit_the_left_margin():
    for values in ([0.003267 + i * 1e-6 for i in range(100)], [0.0009594, 0.0012],
                   [1e-7, 3e-2], [123456.0, 9876543.0], [-0.5, 0.25]):
        svg = render_chart(loss_state(values))
        left = float(re.search(r'<rect x="(\d+)"', svg).group(1))
        for label in ticks_of(svg, "jr-ytick"):
            x = float(re.search(rf'x="([\d.]+)"[^>]*>{re.escape(label)}<', svg).group(1))
            assert x - 6.2 * len(label) >= 0 and x < left, (values, label)
        assert len(ticks_of(svg, "jr-ytick")) >= 3, values


def test_x_axis_runs_from_the_first_step_to_the_last_of_a_long_run():
    """'2' to 'step 2554' of 2560: the decimation dropped the ends. Noisy values so that neither
    end is its bucket's minimum or maximum."""
    values = [0.5 + 0.1 * math.sin(i * 1.7) for i in range(2560)]
    values[0] = values[-1] = 0.5
    state = loss_state(values, ranks=2)
    svg = render_chart(state)
    for first, last in re.findall(r'data-first="([\d.]+)" data-last="([\d.]+)"', svg):
        assert (first, last) == ("1", "2560")
    labels = ticks_of(svg, "jr-xtick")
    assert labels[0] == "1" and labels[1] == "2560" and len(labels) > 3, labels
    assert all(re.fullmatch(r"\d+", label) for label in labels)


def test_chosen_scale_holds_and_log_needs_positive_values():
    state = loss_state([1.0, 0.5, 0.2])
    assert state.chart_scale() == "linear"
    state.set_y_scale("log")
    assert 'data-scale="log"' in render_chart(state)
    negative = loss_state([1.0, -0.5])
    negative.set_y_scale("log")
    svg = render_chart(negative)
    assert 'data-scale="linear"' in svg and "a log scale needs values &gt; 0" in svg
    with pytest.raises(ValueError, match="'linear', 'log' or None"):
        state.set_y_scale("logarithmic")


def test_tick_helpers():
    assert linear_ticks(0.003, 0.69) == ([0.0, 0.2, 0.4, 0.6, 0.8], 0.2)
    assert linear_ticks(5, 5)[0][0] <= 4.5 and linear_ticks(5, 5)[0][-1] >= 5.5
    ticks, lo, hi = log_ticks(0.03, 0.7)
    assert (lo, hi) == (-2, 0) and [v for v, _ in ticks][:3] == [0.01, 0.02, 0.05]
    ticks, lo, hi = log_ticks(1e-9, 10)
    assert [labelled for _, labelled in ticks].count(True) == 6  # every other decade of 10


def test_widget_offers_the_scale_and_keeps_the_users_choice():
    from jupyter_ring.widgets import Dashboard

    dash = Dashboard(state=loss_state([0.69 * math.exp(-i / 100) for i in range(600)]))
    # both scales drawn, the log one shown: the buttons switch them in the browser (jslink)
    assert 'data-scale="linear"' in dash._chart_linear.value
    assert 'data-scale="log"' in dash._chart_log.value
    assert dash._scale.layout.display == "flex" and dash._scale.value == "log"
    assert dash._chart.selected_index == 1
    assert {dash._link.source, dash._link.target} == {(dash._scale, "index"),
                                                      (dash._chart, "selected_index")}
    dash._scale.value = "linear"  # a click, as the kernel hears it
    assert dash.state.y_scale == "linear" and dash._chart.selected_index == 0
    dash.state.ingest(0, snap(0, step=700, t=300, history=[(700, 300.0, {"loss": 1e-5})]))
    dash.refresh()
    assert dash._scale.value == "linear" and dash._chart.selected_index == 0
    assert dash.state.chart_scale() == "linear"
    empty = Dashboard(ranks=2)
    assert empty._scale.layout.display == "none"


def test_the_data_sets_the_scale_once_not_over_a_click_the_kernel_has_not_heard():
    """The buttons follow the data only when the scale it asks for changes: a loss that comes to
    span decades turns the chart to log once; redraws after that leave the buttons alone (a click
    in the browser may be waiting for the busy kernel)."""
    from jupyter_ring.widgets import Dashboard

    state = loss_state([1.0 - i / 2000 for i in range(100)])
    dash = Dashboard(state=state)
    assert dash._scale.value == "linear"
    state.ingest(0, snap(0, step=200, t=300, history=[(200, 300.0, {"loss": 0.001})]))
    dash.refresh()
    assert dash._scale.value == "log" and dash._chart.selected_index == 1
    dash._scale_syncing = True  # what the browser shows after a click the kernel has not heard
    dash._scale.value, dash._chart.selected_index = "linear", 0
    dash._scale_syncing = False
    state.ingest(0, snap(0, step=201, t=301, history=[(201, 301.0, {"loss": 0.0009})]))
    dash.refresh()
    assert dash._scale.value == "linear" and dash._chart.selected_index == 0


def test_a_loss_with_values_below_zero_offers_no_log_scale():
    from jupyter_ring.widgets import Dashboard

    dash = Dashboard(state=loss_state([0.5, -0.2, 0.1]))
    assert dash._scale.layout.display == "none" and dash._chart_log.value == ""
    assert dash._chart.selected_index == 0
    page = render_html(dash.state)
    assert 'class="jr-pick-log"' not in page and page.count('class="jr-series"') == 1


def test_the_static_chart_switches_scale_without_a_kernel():
    state = loss_state([0.69 * math.exp(-i / 100) for i in range(600)])
    page = render_html(state)
    picks = re.findall(r'<input type="radio" class="jr-pick-(\w+)" name="(jr-scale-\w+)" '
                       r'id="[^"]+"( checked)?>', page)
    assert [(p, bool(c)) for p, _, c in picks] == [("linear", False), ("log", True)]
    assert picks[0][1] == picks[1][1] != re.findall(r'name="(jr-scale-\w+)"', render_html(state))[0]
    assert re.search(r'<div class="jr-chart-linear"><svg[^>]*data-scale="linear"', page)
    assert re.search(r'<div class="jr-chart-log"><svg[^>]*data-scale="log"', page)
    assert ".jr-pick-linear:checked~.jr-chart-log" in page and "<script" not in page


def test_lockstep_ranks_end_with_the_same_rate_whatever_their_snapshots_phase(clock):
    """Seen in notebook 04 (Keras): two lockstep ranks ended at 80.2 and 91.6 it/s. The first
    steps are slow (tracing: 3 s, then 0.6 s); a rank's first snapshot showing work lands before or
    after the slow second step depending on its throttle's phase, so measured from the snapshots
    the whole-cell rates differ by that step. Each logged point carries its step's own time: the
    final rate comes from those, the same on every lockstep rank."""
    slow = {0: 3.0, 1: 0.6}
    for offsets in ((0.0, 0.004), (0.0, 0.15), (0.1, 0.0)):
        published = simulate(clock, steps=384, step_s=0.012, offsets=offsets,
                             comm_s=lambda i: slow.get(i, 0.004))
        state = DashboardState(2)
        replay(published, state)
        state.freeze()
        rates = [state.ranks[r].rate for r in (0, 1)]
        expected = 383 / (0.6 + 382 * 0.012)  # from the end of step 1 to the end of step 384
        assert rates == [pytest.approx(expected, rel=0.01)] * 2, (offsets, rates, expected)
