"""The output sinks of %%distributed: the plain text form and the static tabs (no kernel needed)."""

import html
import re

import pytest

from jupyter_ring.widgets import _tabs
from jupyter_ring.widgets._tabs import RankTabs, TextSink
from static_tabs import tab_texts as _panels


def feed(sink):
    """The same cell output, as _cell.CellRun would deliver it, into any sink."""
    sink.text(0, "stdout", ["hello 0", "second 0"])
    sink.text(1, "stdout", ["hello 1"])
    sink.text(1, "stderr", ["\x1b[31mwarn 1\x1b[0m"])
    sink.display(0, {"text/plain": "<Figure>", "image/png": "iVBORw0KGgo="}, {})
    sink.result(1, {"text/plain": "101"}, {})


def test_plain_text_of_the_tabs_is_what_the_text_sink_prints(capsys):
    feed(TextSink())
    out = capsys.readouterr()
    printed = out.out + out.err
    tabs = RankTabs([0, 1])
    feed(tabs)
    plain = tabs.plain_text().splitlines()
    # the rich output itself goes through display() in the text form: compare the tagged lines
    tagged = sorted(line for line in _tabs.strip_ansi(printed).splitlines()
                    if line.startswith("[rank "))
    assert sorted(line for line in plain if line.startswith("[rank ")) == tagged
    assert "[rank 1] warn 1" in plain and "[rank 1] Out: 101" in plain


def test_static_html_has_a_tab_per_rank_with_its_own_output():
    tabs = RankTabs([0, 1])
    feed(tabs)
    page = tabs.html()
    labels = re.findall(r"<label[^>]*>([^<]*)</label>", page)
    assert labels == ["all ranks", "rank 0", "rank 1"]
    everyone, rank0, rank1 = _panels(page, [0, 1])
    assert everyone.splitlines() == [
        "[rank 0] hello 0", "[rank 0] second 0", "[rank 1] hello 1", "[rank 1] warn 1",
        "[rank 0] <Figure> <image/png>", "[rank 1] Out: 101"]
    assert rank0 == "hello 0\nsecond 0\n<img data:image/png;base64,iVBORw0KGgo=>"
    assert rank1 == "hello 1\nwarn 1\nOut: 101\n"
    assert '<pre class="jr-r1 jr-b jr-stderr"><i>[rank 1] </i>warn 1' in page
    assert "\x1b" not in page
    # every line of output is in the page once
    assert page.count("hello 0") == 1
    # the "all ranks" tab is selected when nothing failed
    assert re.search(r'id="jr\w+-0" checked>', page)


def test_failed_rank_is_marked_selected_and_shows_its_error():
    class RemoteError(Exception):
        ename, evalue = "ValueError", "bad <batch>"
        traceback = "Traceback ...\nValueError: bad <batch>"

    tabs = RankTabs([0, 1, 2])
    feed(tabs)
    tabs.error(2, RemoteError(), "interrupted: a peer rank failed")
    tabs.fail(2)
    tabs.error(1, RemoteError())
    tabs.fail(1)
    tabs.select(1)  # the headline rank, not the first one noticed
    page = tabs.html()
    labels = re.findall(r"<label[^>]*>([^<]*)</label>", page)
    assert labels == ["all ranks", "rank 0", "rank 1 ✗", "rank 2 ✗"]
    assert re.search(r'id="jr\w+-2" checked>', page)
    assert page.count('class="jr-failed"') == 2
    everyone, rank0, rank1, rank2 = _panels(page, [0, 1, 2])
    assert "Traceback ...\nValueError: bad <batch>" in rank1
    assert "interrupted: a peer rank failed" in rank2
    assert "Traceback" not in everyone and "Traceback" not in rank0
    assert "[rank 2] ValueError: bad <batch> (interrupted: a peer rank failed)" in everyone
    assert rank0.startswith("hello 0")
    # a rank's death diagnosed after its engine's error was noticed: the tab says so (issue 36)
    tabs.fail(1, "✗ dead")
    tabs.fail(1)  # a plain mark again does not undo it
    assert re.findall(r"<label[^>]*>([^<]*)</label>", tabs.html())[2] == "rank 1 ✗ dead"


def test_each_rank_keeps_its_last_characters_in_the_static_view(monkeypatch):
    monkeypatch.setattr(_tabs, "FINAL_MAX", 100)
    tabs = RankTabs([0, 1])
    tabs.text(1, "stdout", ["early 1"])
    for i in range(50):
        tabs.text(0, "stdout", [f"line {i}"])
    everyone, rank0, rank1 = _panels(tabs.html(), [0, 1])
    assert rank0.endswith("line 49\n") and "line 0\n" not in rank0
    assert "earlier output of rank 0 not shown" in rank0
    assert rank1 == "early 1\n"  # a quiet rank keeps its output whatever the others printed
    assert "[rank 1] early 1" in everyone


def test_a_rank_without_output_says_so():
    tabs = RankTabs([0, 1])
    tabs.text(0, "stdout", ["only 0"])
    everyone, rank0, rank1 = _panels(tabs.html(), [0, 1])
    assert rank1 == "(no output)" and everyone == "[rank 0] only 0\n"


def test_nothing_is_displayed_for_a_silent_successful_cell(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: shown.append(a))
    tabs = RankTabs([0, 1])
    tabs.flush()
    tabs.finish()
    assert shown == [] and tabs.tab is None


@pytest.mark.parametrize("limit", [10, 1000])
def test_live_tail_keeps_the_last_characters_and_says_so(limit):
    panel = _tabs._Panel("rank 0")
    for i in range(200):
        panel.add_stream("stdout", f"line {i}\n")
    items = panel.tail(limit)
    text = "".join(item["text"] for item in items)
    assert text.endswith("line 199\n")
    assert "earlier output not shown" in items[0]["text"]
    assert len(text) < limit + 100


def test_html_escapes_rank_text():
    tabs = RankTabs([0])
    tabs.text(0, "stdout", ["<script>alert(1)</script>"])
    page = tabs.html()
    assert "<script>" not in page and html.escape("<script>") in page


def test_a_line_every_rank_prints_alike_is_held_until_all_came_then_leaves_once():
    """The fold (issue 33, 64 ranks): a line joins the oldest held group of its text that lacks
    its rank; groups leave oldest first, once complete or after the hold; one held group keeps
    the later ones back, so lines keep their order."""
    fold = _tabs.LineFold(range(8), hold=0.5)
    for rank in range(8):
        fold.add(rank, "stdout", ["epoch 1", f"loss {rank}"], now=10.0)
    assert fold.take(10.1) == [("stdout", tuple(range(8)), "epoch 1")]  # complete: at once
    assert fold.take(10.2) == []  # "loss 0" waits for the hold, and every line behind it
    assert fold.take(10.5) == [("stdout", (r,), f"loss {r}") for r in range(8)]
    fold.add(3, "stdout", ["."], now=20.0)
    fold.add(3, "stdout", ["."], now=20.0)  # printed twice by one rank: two lines
    fold.add(5, "stderr", ["."], now=20.0)  # another stream: another line
    fold.add(0, "stdout", ["."], now=20.1)
    assert fold.take(None) == [("stdout", (0, 3), "."), ("stdout", (3,), "."), ("stderr", (5,), ".")]
    assert not fold and fold.open == {}


def test_a_line_whose_copies_keep_coming_is_held_for_them_up_to_the_longest_hold():
    """64 ranks on 2 cores under load print one line over more than the hold: it stays one line
    as long as its copies keep coming (each within the hold of the one before), up to hold_max."""
    fold = _tabs.LineFold(range(64), hold=0.5, hold_max=5.0)
    left = []
    for rank in range(64):  # a copy every 0.07 s: 4.4 s from the first to the last
        now = 10.0 + 0.07 * rank
        fold.add(rank, "stdout", ["same line"], now=now)
        left += fold.take(now + 0.05)
        assert left == [] or rank == 63, (rank, left)
    assert left == [("stdout", tuple(range(64)), "same line")]  # one line, once all came
    left = []
    for rank in range(20):  # copies every 0.3-0.4 s for ever: the line leaves 5 s after the first
        now = 30.0 + 0.3 * rank + 0.1 * min(rank, 4)
        fold.add(rank, "stdout", ["slow"], now=now)
        left += [(round(now, 2), out) for out in fold.take(now)]
    assert left == [(35.2, ("stdout", tuple(range(17)), "slow"))], left
    assert fold.take(None) == [("stdout", (17, 18, 19), "slow")]
    fold.add(0, "stdout", ["alone"], now=20.0)
    fold.add(1, "stdout", ["alone"], now=20.4)
    assert fold.take(20.8) == []  # 0.4 s after its last copy
    assert fold.take(20.9) == [("stdout", (0, 1), "alone")]


def test_many_ranks_fold_identical_lines_in_all_ranks_and_the_text_and_keep_their_own_tabs(capsys):
    ranks = list(range(_tabs.FOLD_FROM + 3))
    n = len(ranks)

    def feed_many(sink):
        for rank in ranks:
            sink.text(rank, "stdout", ["loading data", f"loss {rank * 0.5}"])
        sink.text(2, "stderr", ["warning: slow disk"])
        for rank in ranks:
            if rank != 4:
                sink.text(rank, "stdout", ["done"])
        sink.finish()

    feed_many(TextSink(ranks=ranks))
    printed = capsys.readouterr()
    assert printed.out.splitlines() == (
        [f"[ranks 0-{n - 1}] loading data"] + [f"[rank {r}] loss {r * 0.5}" for r in ranks]
        + [f"[ranks 0-3, 5-{n - 1}] done"])
    assert printed.err == "[rank 2] warning: slow disk\n"
    tabs = RankTabs(ranks)
    feed_many(tabs)
    plain = tabs.plain_text().splitlines()
    assert plain[0] == f"[ranks 0-{n - 1}] loading data" and plain.count(f"[ranks 0-{n - 1}] loading data") == 1
    assert f"[ranks 0-3, 5-{n - 1}] done" in plain and "[rank 2] warning: slow disk" in plain
    everyone, *own = _panels(tabs.html(), ranks)
    assert everyone.splitlines()[0] == f"[ranks 0-{n - 1}] loading data"
    assert everyone.count("loading data") == 1 and everyone.count("done") == 1
    for rank, text in zip(ranks, own):  # each rank's tab: its own lines, untagged, in order
        want = ["loading data", f"loss {rank * 0.5}"] + (["warning: slow disk"] if rank == 2 else []) \
            + ([] if rank == 4 else ["done"])
        assert text.splitlines() == want, (rank, text)
    # below FOLD_FROM ranks nothing is folded
    few = RankTabs(ranks[:_tabs.FOLD_FROM - 1])
    for rank in few.ranks:
        few.text(rank, "stdout", ["same"])
    assert few.plain_text().splitlines() == [f"[rank {r}] same" for r in few.ranks]


def test_folded_lines_of_all_ranks_keep_their_last_characters(monkeypatch):
    monkeypatch.setattr(_tabs, "FINAL_MAX", 100)
    ranks = list(range(_tabs.FOLD_FROM))
    tabs = RankTabs(ranks)
    for i in range(40):
        for rank in ranks:
            tabs.text(rank, "stdout", [f"step {i}"])
    everyone, *_ = _panels(tabs.html(), ranks)
    assert everyone.rstrip().endswith(f"[ranks 0-{len(ranks) - 1}] step 39") and "step 0\n" not in everyone
    assert "earlier output not shown here" in everyone
