"""The dashboard of a large world (issue 33, 64 ranks): percentiles over the ranks, the notable
ranks' rows, and the chart of the median with its min-max band, from synthetic snapshots."""

import re

import numpy as np
import pytest
from test_dashboard import run_ranks, snap

from jupyter_ring.widgets._state import DashboardState
from jupyter_ring.widgets._summary import (NOTABLE, SUMMARY_FROM, notable_ranks, percentiles, render_summary,
                                           render_summary_chart, summarised, summary_series)


@pytest.mark.parametrize("size", [1, 2, 7, 64])
def test_percentiles_are_numpys(size):
    values = np.random.default_rng(size).standard_normal(size)
    assert np.allclose(percentiles(list(values)), np.percentile(values, [0, 10, 50, 90, 100]))
    assert percentiles([]) == []


def world(n=64, slow=17, seconds=6.0):
    """``n`` ranks at 10 steps/s but rank ``slow`` at 3; each logs loss = rank / 100 + 1 / step."""
    state = DashboardState(n)
    rates = {r: 10.0 for r in range(n)}
    rates[slow] = 3.0
    run_ranks(state, rates, seconds, total=500)
    for rank in range(n):
        history = [(step, 100.0 + step / 10, {"loss": rank / 100 + 1 / (step + 1)}) for step in range(0, 60, 3)]
        state.ingest(rank, snap(rank, step=state.ranks[rank].step, total=500, history=history, t=109.0,
                                metrics={"loss": rank / 100}), received=109.0)
    return state


def test_a_large_world_is_summarised_with_its_straggler_named_and_the_slowest_ranks_shown():
    assert not summarised(DashboardState(SUMMARY_FROM - 1)) and summarised(DashboardState(SUMMARY_FROM))
    state = world()
    notable = notable_ranks(state)
    assert notable[0] == (17, "straggler") and len(notable) == NOTABLE
    assert all(why == "slowest" for _, why in notable[1:])
    page = render_summary(state)
    assert page.startswith('<table class="jr-summary">') and "64 ranks: 64 reporting, 0 done" in page
    step = re.search(r'data-what="step">(.*?)</tr>', page).group(1)
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", step)
    steps = [state.ranks[r].step for r in range(64)]
    assert cells[1:6] == [f"{v:g}" for v in np.percentile(steps, [0, 10, 50, 90, 100])]
    assert cells[-1] == "rank 17"  # the slow end: the lowest step
    loss = re.search(r'data-what="loss">(.*?)</tr>', page).group(1)
    assert loss.endswith("<td class=\"jr-l\">rank 63</td>")  # the highest loss
    assert page.count("jr-summary-row") == 5  # step, rate, ETA, time in collectives, loss: not 64 rows


def test_stopped_ranks_are_always_notable_and_say_how_they_ended():
    state = world()
    state.freeze({40: "failed", 3: "interrupted"})
    notable = dict(notable_ranks(state, limit=1))
    assert notable == {3: "interrupted", 40: "failed"}  # more than the limit: every stopped rank
    assert "2 stopped" in render_summary(state)


def test_the_chart_of_a_large_world_is_the_median_and_its_band_plus_the_notable_ranks():
    state = world()
    band, own = summary_series(state, "loss", [17])
    for x, low, mid, high in band:
        assert low <= mid <= high
    # every rank logged at the same steps: the band's edges are ranks 0 and 63, the median between
    step0 = band[0]
    assert step0[1] == pytest.approx(1.0) and step0[3] == pytest.approx(1.63)
    assert step0[2] == pytest.approx(np.median([r / 100 + 1.0 for r in range(64)]))
    assert list(own) == [17]
    svg = render_summary_chart(state)
    assert 'viewBox="0 0 640 220"' in svg and 'class="jr-band"' in svg and 'class="jr-median"' in svg
    assert svg.count('class="jr-series"') == NOTABLE  # the notable ranks' lines, not 64
    assert "rank 17 (straggler)" in svg and "median (64 ranks)" in svg
    assert render_summary_chart(DashboardState(64)) == ""  # nothing logged: no chart


def test_the_dashboard_of_a_large_world_live_and_frozen_shows_the_summary_not_64_rows():
    """The live widget and the frozen HTML draw the same summary: the percentile table, the
    notable ranks' rows (why each is there), the median chart, the comm rows of the notable ranks
    with the spread over all in the caption. Below SUMMARY_FROM ranks: a row per rank, as before."""
    from jupyter_ring.widgets._render import render_html
    from jupyter_ring.widgets.dashboard import Dashboard

    state = world()
    live = Dashboard(state=state)
    live.refresh()
    for page in (live._rows.value + live._chart_linear.value + live._comm.value, render_html(state)):
        assert page.count('class="jr-summary"') == 1
        rows = re.findall(r'<tr class="[^"]*jr-rank-row[^"]*" data-rank="(\d+)">', page)
        assert rows[0] == "17" and len(rows) == NOTABLE, rows
        assert "rank 17 (straggler)" in page and 'class="jr-band"' in page
        assert len(re.findall(r'class="jr-comm-row"', page)) == NOTABLE
        assert "over all 64 ranks the share is" in page
    small = world(n=SUMMARY_FROM - 1, slow=3)
    page = render_html(small)
    assert "jr-summary" not in page and len(re.findall(r'jr-rank-row[^"]*" data-rank=', page)) == SUMMARY_FROM - 1


def test_a_replaced_rank_of_a_large_world_is_always_notable():
    from jupyter_ring.widgets._render import render_rows

    state = world(n=16, slow=5)
    at = state.ranks[11].step
    state.replaced(11)
    state.ingest(11, snap(11, step=1, t=200.0), seq=1)
    notable = dict(notable_ranks(state, limit=1))
    assert notable == {5: "straggler", 11: f"replaced at step {at}"}, notable  # both, past the limit
    assert f"rank 11 (replaced at step {at})</td>" in render_rows(state)
