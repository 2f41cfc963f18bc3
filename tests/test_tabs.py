"""The output sinks of %%distributed: the plain text form and the static tabs (no kernel needed)."""

import html
import re

import pytest

from jupyter_ring import _tabs
from jupyter_ring._tabs import RankTabs, TextSink


def feed(sink):
    """The same cell output, as _CellRun would deliver it, into any sink."""
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


def _panels(page):
    return page.split('<div class="jr-panel">')[1:]


def test_static_html_has_a_tab_per_rank_with_its_own_output():
    tabs = RankTabs([0, 1])
    feed(tabs)
    page = tabs.html()
    labels = re.findall(r"<label[^>]*>([^<]*)</label>", page)
    assert labels == ["all ranks", "rank 0", "rank 1"]
    everyone, rank0, rank1 = _panels(page)
    assert "[rank 0] hello 0" in everyone and "[rank 1] hello 1" in everyone
    assert "[rank 0] &lt;Figure&gt; &lt;image/png&gt;" in everyone
    assert "hello 0" in rank0 and "hello 1" not in rank0
    assert '<img src="data:image/png;base64,iVBORw0KGgo=">' in rank0
    assert "hello 1" in rank1 and 'class="jr-stderr">warn 1' in rank1 and "Out: 101" in rank1
    assert "\x1b" not in page
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
    rank1 = _panels(page)[2]
    assert "ValueError: bad &lt;batch&gt;" in rank1
    assert "interrupted: a peer rank failed" in _panels(page)[3]


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
