"""The dashboard's state, rendering and datapub transport, from synthetic snapshot streams.

Snapshots are made by the real ``Reporter`` of the runtime where the shape matters (deltas,
throttling), and by hand where a test needs an exact situation (a stall, a slow rank).
"""

import random
import re
import time

import pytest

from jupyter_ring.runtime._observe.report import Reporter
from jupyter_ring.widgets._render import rank_cells, render_chart, render_html
from jupyter_ring.widgets._state import DashboardState, downsample, format_seconds


def snap(rank, step=0, total=None, rate=0.0, history=(), t=0.0, final=False, stall=None,
         metrics=None, comm=None, comm_share=0.0, comm_total=None):
    out = {"rank": rank, "step": step, "total": total, "desc": None, "rate": rate,
           "metrics": metrics or {}, "history": list(history), "comm": comm or {},
           "comm_share": comm_share, "stall": stall, "elapsed": t, "time": t, "final": final}
    if comm_total is not None:
        out["comm_total"] = comm_total
    return out


def run_ranks(state, rates, seconds, start=100.0, hz=5.0, total=None, share=0.0, offsets=None,
              steps=None):
    """Snapshots of ranks advancing at ``rates`` {rank: steps/s}, ``hz`` per second each for
    ``seconds``, spending ``share`` of the time in collectives; ingested in time order (each
    rank's snapshot ``offsets[rank]`` s after the tick, its clock = the local clock).

    ``steps`` {rank: (step, comm seconds)} continues an earlier call and is updated. Returns the
    strugglers seen after each tick: [(time, [ranks])].
    """
    offsets = offsets or {}
    steps = {} if steps is None else steps
    seen = []
    for tick in range(int(round(seconds * hz)) + 1):
        for rank in sorted(rates, key=lambda r: offsets.get(r, 0.0)):
            t = start + tick / hz + offsets.get(rank, 0.0)
            step, spent = steps.get(rank, (0, 0.0))
            if tick:
                step, spent = step + rates[rank] / hz, spent + share / hz
            steps[rank] = (step, spent)
            comm = {"allreduce": {"count": int(step), "bytes": 4096 * int(step), "time_s": spent,
                                  "busbw": 1e6}}
            state.ingest(rank, snap(rank, step=int(step), total=total, t=t, comm=comm), received=t)
        seen.append((start + tick / hz, state.stragglers()))
    return seen


class Clock:
    """Stands in for time.time/perf_counter so the reporter's throttle is deterministic."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    import jupyter_ring.runtime._observe.report as report

    monkeypatch.setattr(report.time, "time", c)
    monkeypatch.setattr(report.time, "perf_counter", c)
    return c


# ------------------------------------------------------------------------------------ history
def test_history_points_are_kept_in_time_order_whatever_the_arrival_order():
    state = DashboardState(1)
    points = [(i, 100.0 + i * 0.1, {"loss": 1.0 / (i + 1)}) for i in range(50)]
    chunks = [points[i:i + 7] for i in range(0, 50, 7)]
    random.Random(0).shuffle(chunks)
    for n, chunk in enumerate(chunks):
        state.ingest(0, snap(0, history=chunk, t=200 + n))
    steps = [s for s, _ in state.series("loss")[0]]
    assert steps == list(range(50))


@pytest.mark.parametrize("seq", [None, 7])
def test_a_snapshot_ingested_twice_adds_no_points(seq):
    state = DashboardState(1)
    s = snap(0, step=3, history=[(1, 10.0, {"loss": 0.5}), (2, 10.1, {"loss": 0.4})], t=11)
    assert state.ingest(0, s, seq=seq) == 2
    assert state.ingest(0, s, seq=seq) == 0
    assert len(state.series()[0]) == 2


def test_an_older_snapshot_does_not_overwrite_the_latest_values_but_adds_its_points():
    state = DashboardState(1)
    state.ingest(0, snap(0, step=20, t=20, history=[(20, 20.0, {"loss": 0.2})]), seq=2)
    state.ingest(0, snap(0, step=10, t=10, history=[(10, 10.0, {"loss": 0.3})]), seq=1)
    assert state.ranks[0].step == 20
    assert [s for s, _ in state.series()[0]] == [10, 20]


def test_throttled_deltas_from_the_real_reporter_lose_no_point(clock):
    """A rank logs 1000 steps at 1 ms each; the reporter publishes ~10/s; all 1000 arrive."""
    published = []
    reporter = Reporter(max_rate=10)
    reporter.publisher = published.append
    reporter.rank = 1
    reporter.reset()
    for step in range(1000):
        clock.now += 0.001
        reporter.progress(step + 1, total=1000)
        reporter.log(loss=1000.0 - step)
    reporter.flush()
    assert 5 <= len(published) <= 15  # throttled: about one snapshot per 0.1 s of the 1 s run
    state = DashboardState([0, 1])
    random.Random(1).shuffle(published)  # whatever order they arrive in
    for seq, s in enumerate(published):
        state.ingest(s["rank"], s)
    series = state.series("loss", max_points=5000)[1]
    assert [step for step, _ in series] == list(range(1, 1001))
    assert [v for _, v in series] == [1000.0 - s for s in range(1000)]
    assert state.ranks[1].step == 1000 and state.ranks[1].fraction == 1.0
    assert not state.ranks[0].seen


def test_non_finite_metrics_are_shown_but_not_charted():
    state = DashboardState(1)
    state.ingest(0, snap(0, history=[(1, 1.0, {"loss": "nan"}), (2, 2.0, {"loss": 0.5})],
                         metrics={"loss": "nan"}, t=3))
    assert state.series()[0] == [(2, 0.5)]
    assert "loss nan" in state.summary()


def test_downsample_keeps_ends_spikes_and_the_bound():
    pts = [(i, 1.0) for i in range(10000)]
    pts[4321] = (4321, 50.0)
    out = downsample(pts, 500)
    assert len(out) <= 500
    assert out[0] == pts[0] and out[-1] == pts[-1]
    assert (4321, 50.0) in out
    assert [x for x, _ in out] == sorted(x for x, _ in out)
    assert downsample(pts[:3], 500) == pts[:3]


def test_chart_has_one_polyline_per_rank_with_at_most_500_points():
    state = DashboardState(2)
    for rank in (0, 1):
        hist = [(i, i * 0.01, {"loss": 2.0 - i / 3000 + rank}) for i in range(3000)]
        state.ingest(rank, snap(rank, step=3000, history=hist, t=40))
    svg = render_chart(state)
    lines = re.findall(r'<polyline class="jr-series" data-rank="(\d)" data-points="(\d+)"[^>]*'
                       r'points="([^"]*)"', svg)
    assert [r for r, _, _ in lines] == ["0", "1"]
    for _rank, n, coords in lines:
        assert int(n) <= 500 and len(coords.split()) == int(n)
    assert 'data-metric="loss"' in svg


# ---------------------------------------------------------------------------------- stragglers
def test_straggler_is_a_running_rank_below_0_7_of_the_median_rate_for_a_whole_window():
    state = DashboardState(4)
    seen = run_ranks(state, {0: 10.0, 1: 9.5, 2: 10.2, 3: 5.0}, seconds=8, total=1000)
    assert state.stragglers() == [3]
    # called once its rate is measured (min_span) and has stayed low for the window, not before
    first = min(t for t, ranks in seen if ranks) - 100.0
    assert state.min_span + state.window <= first <= state.min_span + state.window + 0.5, seen
    html_text = render_html(state)
    assert re.search(r'class="jr-rank-row jr-straggler" data-rank="3"', html_text)
    assert "straggler" in state.summary().splitlines()[3]
    # a rank that finished is no straggler, and does not count towards the median
    state.ingest(3, snap(3, step=1000, total=1000, t=109, final=True), received=109)
    assert state.stragglers() == []


def test_no_straggler_at_the_start_or_with_one_rank():
    state = DashboardState(2)
    state.ingest(0, snap(0, step=1, total=100, rate=0.0, t=1))
    state.ingest(1, snap(1, step=1, total=100, rate=0.0, t=1))
    assert state.stragglers() == []
    one = DashboardState(1)
    assert not any(ranks for _, ranks in run_ranks(one, {0: 0.1}, seconds=10, total=100))


def test_mild_differences_are_not_stragglers():
    state = DashboardState(3)
    seen = run_ranks(state, {0: 10.0, 1: 8.0, 2: 7.5}, seconds=10, total=1000)
    assert not any(ranks for _, ranks in seen)


# --------------------------------------------------------------------------------- stall, ETA
def test_stall_banner_names_the_waiting_rank_the_tensor_and_the_missing_ranks():
    state = DashboardState(3)
    state.ingest(0, snap(0, t=5, stall={"what": "allreduce 'fc1.weight.grad'", "missing": [2],
                                        "waited": 12.3, "rank": 0}))
    state.ingest(1, snap(1, t=5, stall={"what": "allreduce 'fc1.weight.grad'", "missing": [2],
                                        "waited": 12.1, "rank": 1}))
    state.ingest(2, snap(2, t=5))
    banner = state.banner()
    assert banner.splitlines() == [
        "rank 0 has waited 12 s in allreduce 'fc1.weight.grad' for rank(s) 2",
        "rank 1 has waited 12 s in allreduce 'fc1.weight.grad' for rank(s) 2"]
    page = render_html(state)
    assert 'class="jr-banner"' in page and "for rank(s) 2" in page
    assert "&#x27;fc1.weight.grad&#x27;" in page  # escaped
    # the stall ends: the next snapshot has stall None, and the banner goes
    state.ingest(0, snap(0, t=6))
    state.ingest(1, snap(1, t=6))
    assert state.banner() == "" and 'class="jr-banner"' not in render_html(state)


def test_a_wait_on_a_rank_in_the_debugger_is_a_pause_not_a_stall():
    state = DashboardState(2)
    state.ingest(0, snap(0, t=5, stall={"what": "allreduce 'grads'", "missing": [1], "waited": 12.0,
                                        "rank": 0, "held": [1]}))
    state.ingest(1, snap(1, t=5))
    assert state.banner() == ("rank 0 has waited 12 s in allreduce 'grads' for rank(s) 1 "
                              "(rank 1 is in the debugger)")
    page = render_html(state)
    assert "<b>Waiting:</b>" in page and "Stalled" not in page


def test_eta_from_rate_and_total():
    state = DashboardState(1)
    run_ranks(state, {0: 20.0}, seconds=2, total=100)
    assert state.ranks[0].step == 40 and state.ranks[0].rate == pytest.approx(20.0)
    assert state.ranks[0].eta == pytest.approx(3.0)
    assert "ETA 3 s" in state.summary()
    state.ingest(0, snap(0, step=40, total=None, t=102.1))  # the reporter dropped the total
    assert state.ranks[0].eta is None and state.ranks[0].fraction is None
    unknown = DashboardState(1)
    unknown.ingest(0, snap(0, step=40, total=100, rate=5.0, t=1))  # one snapshot: no rate yet
    assert unknown.ranks[0].rate is None and unknown.ranks[0].eta is None
    assert format_seconds(3725) == "1:02:05" and format_seconds(125) == "2:05"


# ------------------------------------------------------------------------------- freeze, HTML
def _trained_state():
    """Two ranks, 60 steps in 2 s (30 it/s) with 12 % of the time in allreduces, reported at
    5 snapshots a second."""
    state = DashboardState(2)
    for rank in (0, 1):
        for k in range(11):
            t = 100 + k / 5
            comm = {"allreduce": {"count": 12 * k, "bytes": 3 * 2**20 * k // 10,
                                  "time_s": 0.024 * k, "busbw": 12.5 * 2**20},
                    "broadcast": {"count": 4, "bytes": 1024, "time_s": 0.01, "busbw": 1e5}}
            hist = [(i, 100 + i / 30, {"loss": 1.0 / (i + 1) + 0.01 * rank})
                    for i in range(6 * k - 5, 6 * k + 1) if i > 0]
            state.ingest(rank, snap(rank, step=6 * k, total=60, rate=99.0, history=hist, t=t,
                                    final=k == 10, metrics={"loss": 1.0 / (6 * k + 1) + 0.01 * rank},
                                    comm=comm, comm_share=0.99), seq=k + 1)
    return state


def test_freeze_gives_final_static_html_with_each_rank_row_and_the_chart():
    state = _trained_state()
    state.freeze()
    assert state.ingest(0, snap(0, step=1, t=999)) == 0 and state.ranks[0].step == 60
    page = render_html(state)
    assert len(re.findall(r'<tr class="jr-rank-row[^"]*" data-rank="\d"', page)) == 2
    assert page.count('class="jr-series"') == 4  # the chart at both scales, one shown (CSS)
    assert page.count("100 %") == 2 and page.count(">done<") == 2
    assert "<script" not in page  # static: shows without a kernel or JavaScript
    comm_rows = re.findall(r'<tr class="jr-comm-row" data-rank="(\d)">(.*?)</tr>', page)
    assert [r for r, _ in comm_rows] == ["0", "1"]
    assert ('<td>120</td><td>3.0 MiB</td><td>0.240 s</td><td>12.5 MiB/s</td>'
            '<td class="jr-share">12 %</td>') in page
    assert "over the whole cell" in page  # the caption says what the share covers
    summary = state.summary()
    assert summary.splitlines()[0].startswith("rank 0: step 60/60 (100%), 30 it/s")
    assert "allreduce 120x 3.0 MiB 0.24 s 12.5 MiB/s" in summary


def test_freeze_clears_a_stall_that_was_still_shown():
    state = DashboardState(2)
    state.ingest(0, snap(0, t=1, stall={"what": "barrier", "missing": [1], "waited": 6, "rank": 0}))
    state.freeze()
    assert state.banner() == ""


def test_unknown_ranks_get_a_row_and_bad_ranks_are_refused():
    state = DashboardState([0])
    state.ingest(None, snap(3, step=1, t=1))
    assert list(state.ranks) == [0, 3]
    with pytest.raises(ValueError, match="a rank is an int >= 0"):
        state.ingest(-1, snap(0))
    with pytest.raises(ValueError, match="straggler_ratio"):
        DashboardState(2, straggler_ratio=1.5)


# ------------------------------------------------------------------------------------- widget
def _live_rows(dash):
    """(class, bar width, row HTML) of each row the live widget shows."""
    return [(cls, width, row) for cls, row, width in re.findall(
        r'<tr class="([^"]*)" data-rank="\d+">(.*?width:([\d.]+%).*?)</tr>', dash._rows.value)]


def test_widget_has_a_row_per_rank_and_marks_the_straggler():
    from jupyter_ring.widgets import Dashboard

    dash = Dashboard(ranks=3)
    assert dash._rows.value.count('<tr class="jr-rank-row') == 3
    assert "waiting for the first report" in dash._rows.value
    run_ranks(dash.state, {0: 10.0, 1: 10.0, 2: 3.0}, seconds=8, total=160)
    for rank in range(3):  # an older snapshot: adds its points, changes nothing else
        dash.state.ingest(rank, snap(rank, t=50, history=[(1, 50.0, {"loss": 0.5})]), received=108)
    dash.refresh()
    rows = _live_rows(dash)
    assert [width for _, width, _ in rows] == ["50.0%", "50.0%", "15.0%"]
    assert [("jr-straggler" in cls) for cls, _, _ in rows] == [False, False, True]
    assert "rank 2 (straggler)" in rows[2][2]
    # the live rows are the static view's (the output keeps its look when the cell ends)
    assert dash._rows.value in dash.to_html()
    assert "jr-series" in dash._chart_linear.value
    version = dash._drawn
    dash.refresh()  # unchanged state: nothing redrawn
    assert dash._drawn == version


def test_widget_mimebundle_carries_a_static_fallback():
    from jupyter_ring.widgets import Dashboard

    dash = Dashboard(state=_trained_state())
    bundle = dash._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/html"].count('class="jr-rank-row') == 2
    assert bundle["text/plain"].startswith("rank 0: step 60/60 (100%)")


def test_freeze_replaces_the_displayed_widget_by_its_final_html():
    from jupyter_ring.widgets import Dashboard

    class Handle:
        updates = []

        def update(self, obj, raw=False):
            self.updates.append((obj, raw))

    dash = Dashboard(state=_trained_state())
    dash._handle = Handle()
    dash.freeze()
    (bundle, raw), = Handle.updates
    assert raw and set(bundle) == {"text/html", "text/plain"}
    assert bundle["text/html"].count('class="jr-series"') == 4
    assert dash.state.frozen and dash.comm is None  # the widget was closed


# ------------------------------------------------------------------- datapub transport (unit)
def test_unique_keys_survive_ipyparallels_dict_update_and_are_consumed_once(clock):
    """Snapshots merged into one dict (as ipyparallel's client does) between two polls: none
    overwrites another, each is read exactly once, in publication order."""
    from jupyter_ring.engines._publish import Publisher
    from jupyter_ring.widgets.live import LiveDashboard, take_snapshots

    engine_data = {}                 # what the client's AsyncResult.data holds for one engine
    reporter = Reporter(max_rate=10)
    publisher = Publisher(engine_data.update, reporter)
    reporter.publisher = publisher
    reporter.rank = 0
    reporter.reset()
    live = LiveDashboard(1, display=False)
    for step in range(300):
        clock.now += 0.01
        reporter.log(step=step, loss=float(step))
        if step % 70 == 69:          # the notebook polls rarely: several snapshots pile up
            assert len([k for k in engine_data if k.startswith("jupyter_ring/")]) > 1
            live.poll([engine_data])
            assert not engine_data   # consumed keys are deleted
    publisher.post_execute()         # the cell ends: the rest, marked final
    engine_data["other"] = 1         # keys of others are left alone
    live.poll([engine_data])
    assert engine_data == {"other": 1}
    assert take_snapshots(engine_data) == []
    series = live.state.series("loss", max_points=1000)[0]
    assert [s for s, _ in series] == list(range(300))
    assert live.state.ranks[0].final and live.state.ranks[0].seq == publisher.seq


def test_take_snapshots_orders_by_sequence_number():
    from jupyter_ring.engines._publish import snapshot_key
    from jupyter_ring.widgets.live import take_snapshots

    data = {snapshot_key(n): {"rank": 0, "n": n} for n in (12, 3, 100, 7)}
    assert [seq for seq, _ in take_snapshots(data)] == [3, 7, 12, 100]
    assert data == {}


def test_post_execute_publishes_final_only_for_cells_that_reported(clock):
    from jupyter_ring.engines._publish import Publisher

    sent = []
    reporter = Reporter()
    publisher = Publisher(sent.append, reporter)
    reporter.publisher = publisher
    reporter.reset()
    publisher.pre_execute()
    publisher.post_execute()          # a cell that reported nothing: nothing sent
    assert sent == []
    publisher.pre_execute()
    reporter.progress(5, total=10)    # published at once (first in the throttle window)
    publisher.post_execute()
    assert [next(iter(s.values()))["final"] for s in sent] == [False, True]
    publisher.enabled = False
    publisher.pre_execute()
    clock.now += 1
    reporter.progress(6)
    publisher.post_execute()
    assert len(sent) == 2 and not reporter.pending


def test_live_dashboard_polls_a_subset_of_ranks_and_draws_at_most_every_min_interval(clock):
    from jupyter_ring.engines._publish import snapshot_key
    from jupyter_ring.widgets.live import LiveDashboard

    live = LiveDashboard([0, 1, 2, 3], display=False, min_interval=3600)
    engine2 = {snapshot_key(1): snap(2, step=1, total=4, t=1, history=[(1, 1.0, {"loss": 2.0})])}
    assert live.poll([engine2]) == 1
    drawn = live.dashboard._drawn
    engine2[snapshot_key(2)] = snap(2, step=2, total=4, t=2, history=[(2, 2.0, {"loss": 1.0})])
    assert live.poll([engine2]) == 1
    assert live.dashboard._drawn == drawn  # throttled: not redrawn yet
    state = live.finish([engine2])
    assert live.dashboard._drawn == state.version and state.frozen
    assert state.ranks[2].step == 2 and not state.ranks[0].seen
    assert "rank 0: no report yet" in state.summary()


def test_long_runs_are_charted_from_an_incremental_decimation():
    """100,000 points per rank: the chart keeps ≤ 500 of them, in order, spikes included,
    without re-reading the whole history on every redraw."""
    state = DashboardState(1)
    rng = random.Random(2)
    for chunk in range(100):
        hist = [(i, 1.0 + i * 1e-3, {"loss": rng.random()}) for i in range(chunk * 1000, (chunk + 1) * 1000)]
        if chunk == 77:
            hist[500] = (77500, 1.0 + 77500 * 1e-3, {"loss": 9.0})
        state.ingest(0, snap(0, step=(chunk + 1) * 1000, history=hist, t=chunk), seq=chunk)
    assert len(state.ranks[0].history["loss"]) <= 20000  # the history is thinned...
    series = state.series("loss")[0]
    assert series[0][0] < 1000 and series[-1][0] > 99000  # ...the chart's decimation saw it all
    assert len(series) <= 500 and (77500, 9.0) in series
    assert [x for x, _ in series] == sorted(x for x, _ in series)
    state.ingest(0, snap(0, step=100001, history=[(100001, 1e6, {"loss": -1.0})], t=101), seq=101)
    assert state.series("loss")[0][-1] == (100001, -1.0)  # appended to the decimation


def test_has_and_discard_snapshots_for_cells_without_a_dashboard():
    from jupyter_ring.engines._publish import snapshot_key
    from jupyter_ring.widgets.live import discard_snapshots, has_snapshots

    engines = [{"other": 1}, {}]
    assert not has_snapshots(engines)
    engines[1][snapshot_key(1)] = snap(1)
    engines[1][snapshot_key(2)] = snap(1)
    assert has_snapshots(engines)
    assert discard_snapshots(engines) == 2
    assert engines == [{"other": 1}, {}] and not has_snapshots(engines)


def test_public_names():
    import subprocess
    import sys

    import jupyter_ring.widgets as widgets
    import jupyter_ring.widgets.live as live

    assert set(widgets.__all__) == {"Dashboard", "DashboardState"}
    assert set(live.__all__) == {"ENGINE_SETUP", "LiveDashboard", "take_snapshots", "has_snapshots",
                                 "discard_snapshots", "set_publishing"}
    assert all(getattr(m, n).__doc__ for m in (widgets, live) for n in m.__all__)
    # the widgets import neither a framework nor, until a cell is polled, ipyparallel
    code = ("import sys, jupyter_ring.widgets.live; print(sorted(m for m in ('torch', 'tensorflow', "
            "'ipyparallel') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out
    # what every rank imports at %ring start (ENGINE_SETUP) brings no ipywidgets (~0.18 s each)
    code = ("import sys, jupyter_ring.engines._publish; print(sorted(m for m in ('ipywidgets', "
            "'jupyter_ring.widgets.dashboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


def test_live_chart_keeps_up_with_the_rows_while_it_is_cheap_and_backs_off_when_it_is_not(
        clock, monkeypatch):
    """Issue 21, item 7: the live chart trailed the progress bar (step 458 while the bar showed
    565) because it was redrawn once a second. By default it is now redrawn with the rows while
    its redraws cost ≤ 1 % of a core, and at most a second apart when they cost more."""
    from jupyter_ring.engines._publish import snapshot_key
    from jupyter_ring.widgets.live import LiveDashboard

    import jupyter_ring.widgets.live as live_module

    cpu = iter(range(1000))                                 # every redraw costs 1 ms of CPU
    monkeypatch.setattr(live_module, "_cpu_time", lambda: next(cpu) * 0.001 / 2)
    live = LiveDashboard(1, display=False, min_interval=0.2)
    dash = live.dashboard
    engine = {}
    for step in range(1, 6):  # a cheap chart (few points): redrawn on every poll
        engine[snapshot_key(step)] = snap(0, step=step, total=10, t=step,
                                          history=[(step, float(step), {"loss": 1.0 / step})])
        live._last_draw -= 0.2            # 0.2 s later: the rows are due, and so is the chart
        live._last_chart -= 0.2
        assert live.poll([engine]) == 1
        assert dash._chart_drawn == dash._drawn == live.state.version
    assert live._chart_cost == pytest.approx(0.0005)
    assert live.current_chart_interval() == 0.2             # 0.05 s of CPU a second: the rows'

    live._chart_cost = 0.004              # a 4 ms chart (30,000 points on a loaded VM): 0.4 s
    assert live.current_chart_interval() == pytest.approx(0.4)
    live._chart_cost = 0.5                # never more than a second behind
    assert live.current_chart_interval() == 1.0
    live._last_chart = time.monotonic()   # just drawn: the rows go on, the chart waits
    engine[snapshot_key(6)] = snap(0, step=6, total=10, t=6, history=[(6, 6.0, {"loss": 0.1})])
    live._last_draw -= 0.2
    live.poll([engine])
    assert dash._drawn == live.state.version and dash._chart_drawn != live.state.version
    live._last_chart -= 1.0               # a second later: the chart catches up
    live._last_draw -= 0.2
    engine[snapshot_key(7)] = snap(0, step=7, total=10, t=7, history=[(7, 7.0, {"loss": 0.1})])
    live.poll([engine])
    assert dash._chart_drawn == live.state.version

    fixed = LiveDashboard(1, display=False, chart_interval=0.5)  # an explicit interval holds
    fixed._chart_cost = 0.0
    assert fixed.current_chart_interval() == 0.5


# ------------------------------------------------------------------ issue 36, item 3: what is so
def test_each_cell_starts_from_nothing_on_the_engines(clock):
    """Item 1: the publisher's pre_execute starts the reporter's new cell: an opt.step()-only
    cell after a 350-step run reports step 1, no label, no total, no loss."""
    from jupyter_ring.engines._publish import Publisher

    sent = []
    reporter = Reporter()
    publisher = Publisher(sent.append, reporter)
    reporter.publisher = publisher
    publisher.pre_execute()
    reporter.progress(0, total=300, desc="short")
    for step in range(1, 351):
        reporter.log(loss=1.0 / step)
        reporter.progress(step)
    publisher.post_execute()
    publisher.pre_execute()
    reporter.progress(reporter.step + 1)   # DistributedOptimizer.step()
    publisher.post_execute()
    last = next(iter(sent[-1].values()))
    assert (last["step"], last["total"], last["desc"], last["metrics"]) == (1, None, None, {})


def test_no_dashboard_is_shown_until_a_rank_reports_work():
    """Item 2: a total alone (ring.progress(0, total=N)), or only a final word, is no training."""
    from jupyter_ring.engines._publish import snapshot_key
    from jupyter_ring.widgets.live import LiveDashboard

    live = LiveDashboard(2, min_interval=0.0)
    shown = []
    live.dashboard.display = lambda: shown.append(True)
    engine = {snapshot_key(1): snap(0, step=0, total=100, t=1),
              snapshot_key(2): snap(0, step=0, total=100, t=2, final=True)}
    live.poll([engine])
    live.finish([engine])
    assert not live.shown and not shown and not live.state.reported_work()
    for work in ({"step": 1}, {"metrics": {"loss": 0.5}, "history": [(0, 1.0, {"loss": 0.5})]},
                 {"stall": {"what": "barrier", "missing": [1], "waited": 11.0, "rank": 0}}):
        live = LiveDashboard(2, min_interval=0.0)
        live.dashboard.display = lambda: shown.append(True)
        live.poll([{snapshot_key(1): {**snap(0, total=100, t=1), **work}}])
        assert live.shown, work


def _interrupted_state():
    """Rank 0 finished its 40 steps; rank 1 reported step 17 of 40, rank 2 no total and step 0
    (it stalled before its first step); the final words of 1 and 2 came after the interrupt."""
    state = DashboardState(3)
    state.ingest(0, snap(0, step=40, total=40, t=1, final=True))
    state.ingest(1, snap(1, step=17, total=40, t=1, final=True))
    state.ingest(2, snap(2, step=0, t=1, final=True))
    state.freeze({1: "interrupted", 2: "stalled"})
    return state


def test_an_interrupted_or_stalled_rank_shows_so_at_its_real_step_never_done():
    """Item 3: such a rank showed '0 … done' with a full bar."""
    from jupyter_ring.widgets import Dashboard

    state = _interrupted_state()
    cells = [rank_cells(state, r) for r in range(3)]
    assert [c["eta"] for c in cells] == ["done", "interrupted", "stalled"]
    assert [c["step"] for c in cells] == ["40 / 40", "17 / 40", "0"]
    assert [state.ranks[r].bar_fraction for r in range(3)] == [1.0, 17 / 40, 0.0]
    page = render_html(state)
    assert 'width:42.5%' in page and 'width:0.0%' in page and page.count('width:100.0%') == 1
    assert page.count("jr-rank-row jr-stopped") == 2
    rows = _live_rows(Dashboard(state=state))
    assert [width for _, width, _ in rows] == ["100.0%", "42.5%", "0.0%"]
    assert [cls for cls, _, _ in rows] == ["jr-rank-row", "jr-rank-row jr-stopped",
                                           "jr-rank-row jr-stopped"]
    assert "rank 1: step 17/40 (42%), interrupted" in state.summary()
    with pytest.raises(ValueError, match="interrupted"):
        DashboardState(1).freeze({0: "crashed"})


def test_a_cell_that_ended_well_short_of_its_total_says_ended():
    state = DashboardState(1)
    state.ingest(0, snap(0, step=1279, total=3000, t=1, final=True))
    state.freeze()
    assert rank_cells(state, 0)["eta"] == "ended"


def test_the_comm_table_counts_the_cells_collectives_and_gives_the_totals_on_a_second_line():
    """Item 6: 1,630 allreduces shown for a 50-step cell (the count since ring.init())."""
    state = DashboardState(2)
    for rank in (0, 1):
        cell = {"allreduce": {"count": 50, "bytes": 50 * 4096, "time_s": 0.5, "busbw": 1e6}}
        total = {"allreduce": {"count": 1630, "bytes": 1630 * 4096, "time_s": 9.0, "busbw": 1e6}}
        state.ingest(rank, snap(rank, step=50, t=1, comm=cell, comm_total=total, final=True))
    state.freeze()
    page = render_html(state)
    rows = re.findall(r'<tr class="jr-comm-row" data-rank="(\d)"><td class="jr-l">rank \d</td><td>(\d+)</td>',
                      page)
    assert rows == [("0", "50"), ("1", "50")]
    assert "communication in this cell" in page
    assert "since ring.init() (or ring.reset_stats()): rank 0: 1630 allreduces" in page
    assert "1630 allreduces since ring.init()" in state.summary()


def test_only_snapshots_that_report_work_make_a_cell_a_dashboard():
    """Item 2: %%distributed makes its LiveDashboard (widgets) once a snapshot reports work."""
    from jupyter_ring.engines._publish import snapshot_key
    from jupyter_ring.widgets.live import has_snapshots

    engines = [{snapshot_key(1): snap(0, step=0, total=10, t=1)}, {}]
    assert has_snapshots(engines) and not has_snapshots(engines, work=True)
    engines[1][snapshot_key(1)] = snap(1, step=0, t=1, history=[(0, 1.0, {"loss": 1.0})],
                                       metrics={"loss": 1.0})
    assert has_snapshots(engines, work=True)


def test_a_rank_replaced_during_the_cell_shows_its_new_engine_and_says_it_was_replaced():
    """Issue 34: a dead rank's replacement runs the cell under elastic.run; its snapshots are
    numbered from 1 again and its steps count from where it starts. Its reports are taken (not
    dropped as already seen, not older than the dead engine's), its row says "replaced at step
    N", the chart keeps the dead engine's points and adds the new one's."""
    state = DashboardState([0, 1, 2])
    rng = random.Random(34)
    losses = {r: [rng.uniform(0.5, 2.0) for _ in range(40)] for r in range(3)}
    for seq in range(1, 8):  # 7 snapshots of 3 ranks, 2 steps each: the dead rank 1 reached step 13
        for rank in range(3):
            step = 2 * seq - (1 if rank == 1 else 0)
            state.ingest(rank, snap(rank, step=step, total=37, t=100.0 + seq / 5,
                                    history=[(step, 100.0 + seq / 5, {"loss": losses[rank][step]})],
                                    metrics={"loss": losses[rank][step]}), seq=seq)
    dead_points = len(state.ranks[1].history["loss"])
    state.replaced(1)
    row = state.ranks[1]
    assert row.change == "replaced at step 13" and row.step == 13  # kept until the new engine reports
    for seq in range(1, 4):  # the new engine from the last commit (step 10), numbered from 1
        step = 10 + seq
        state.ingest(1, snap(1, step=step, total=37, t=110.0 + seq / 5, metrics={"loss": losses[1][step]},
                             history=[(step, 110.0 + seq / 5, {"loss": losses[1][step]})]), seq=seq)
        assert row.step == step and row.metrics == {"loss": losses[1][step]}, (seq, row.step)
    assert len(row.history["loss"]) == dead_points + 3
    assert state.series()[1][-1] == (13, losses[1][13])
    line = state.summary().splitlines()[1]
    assert line.startswith("rank 1: step 13/37 (35%), replaced at step 13, "), line
    assert "replaced" not in state.summary().splitlines()[0] + state.summary().splitlines()[2]
    assert "rank 1 (replaced at step 13)</td>" in render_html(state)
    # replaced again: the count and the last step; a rank that never reported before says none
    state.replaced(1)
    assert row.change == "replaced 2\u00d7, last at step 13"
    state.replaced(4)
    assert state.ranks[4].change == "replaced" and "rank 4: no report yet, replaced" in state.summary()
    state.freeze({})
    assert "rank 1 (replaced 2\u00d7, last at step 13)</td>" in render_html(state)


def test_a_rank_that_joins_during_the_cell_gets_a_row_and_one_replaced_after_it_died_says_so():
    state = DashboardState([0, 1])
    for seq in (1, 2):
        for rank in (0, 1):
            state.ingest(rank, snap(rank, step=seq, t=float(seq)), seq=seq)
    state.joined(2)  # host discovery grew the world: the newcomer's row before its first report
    assert "rank 2: no report yet, joined during the cell" in state.summary()
    state.ingest(2, snap(2, step=1, t=3.0), seq=1)
    assert state.ranks[2].step == 1 and "rank 2 (joined during the cell)</td>" in render_html(state)
    # rank 1 left in a shrink, then joins again: the new engine's snapshots from 1 are taken
    state.joined(1)
    state.ingest(1, snap(1, step=1, t=4.0), seq=1)
    assert state.ranks[1].step == 1 and state.ranks[1].change == "joined during the cell"
    # the cell failed with rank 0 dead, then rank 0 was replaced for the next cell
    state.replaced(0, during=False)
    state.freeze({0: "died"})
    line = state.summary().splitlines()[0]
    assert line.startswith("rank 0: step 2, died, replaced in place"), line
    assert "rank 0 (replaced in place)</td>" in render_html(state)
