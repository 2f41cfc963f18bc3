"""``%ring timeline``'s drawing and summary (issue 36, item 4), from made-up records."""

import re

from jupyter_ring.widgets._timeline import STRAGGLER_SHARE, summarize, timeline_html, timeline_text


def _records(lateness, count, kind="allreduce", phases=("negotiate", "reduce_scatter", "allgather")):
    """Two ranks' records of ``count`` collectives; ``lateness(i)`` is rank 1's start minus rank 0's."""
    ranks = {0: [], 1: []}
    for i in range(count):
        for rank in (0, 1):
            start = i * 0.1 + (lateness(i) if rank == 1 else 0.0)
            ranks[rank].append({"kind": kind, "name": f"g{i}", "bytes": 4096, "start": start,
                                "end": i * 0.1 + 0.05,
                                "phases": {p: (start, start + 0.01) for p in phases}})
    return ranks


def test_a_rank_last_now_and_then_is_no_straggler():
    # the walk's case (rank 1 last at 19 of 307, rank 0 at 10): nobody holds the others back
    lateness = lambda i: 0.004 if i % 16 == 0 else (-0.004 if i % 31 == 0 else 0.0)  # noqa: E731
    summary = summarize(_records(lateness, 307))
    assert summary.matched == 307 and summary.late_count == {0: 9, 1: 20}, summary.late_count
    assert summary.straggler is None
    page = timeline_html(_records(lateness, 307), 10)
    assert 'data-straggler="true"' not in page and "no straggler: a straggler arrives last" in page
    assert "straggler" not in timeline_text(_records(lateness, 307), 10).split("\n", 1)[1]


def test_a_rank_last_at_most_collectives_is_the_straggler_and_the_rule_is_said():
    ranks = _records(lambda i: 0.03 if i % 4 else 0.0, 40)  # last at 30 of 40
    summary = summarize(ranks)
    assert summary.late_count[1] == 30 > STRAGGLER_SHARE * 40 and summary.straggler == 1
    page = timeline_html(ranks, 10)
    assert re.search(r'<g class="track" data-rank="1" data-straggler="true">', page)
    assert "straggler: rank 1, last at 30 of 40 (a straggler arrives last (by more than 1 ms) at more than 50%" in page


def test_the_drawing_scales_to_the_output_width_and_the_legend_names_each_colour_once():
    ranks = _records(lambda i: 0.0, 5)
    ranks[0].append({"kind": "allgather", "name": "a", "bytes": 8, "start": 0.6, "end": 0.61,
                     "phases": {"negotiate": (0.6, 0.605)}})
    ranks[1].append(dict(ranks[0][-1]))
    page = timeline_html(ranks, 10)
    svg = re.search(r"<svg [^>]*>", page).group(0)
    width, height = map(int, re.search(r'viewBox="0 0 (\d+) (\d+)"', svg).groups())
    assert 'width="100%"' in svg and f"max-width:{width}px" in svg and height > 0, svg
    legend = page.rsplit("gaps: compute.", 1)[1]
    labels = re.findall(r"■ ([^<]+)</span>", legend)
    assert len(labels) == len(set(labels)), labels
    assert labels == ["allreduce", "allgather", "agreement", "ring reduce-scatter", "ring allgather"], labels
    assert "reducescatter" not in legend and "broadcast" not in legend  # only what was drawn
