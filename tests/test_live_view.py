"""A running cell's live view, shown again on request (``jupyter_ring._live``): what the Ring
panel's "Show live view" asks of a busy kernel, for a notebook closed and reopened while the
cell runs. A real kernel on a real 2-rank cluster; the page's part is in
tests/browser/test_live_view_browser.py."""

import re

import pytest

from jupyter_ring import _live
from real_kernel import ring_kernel

pytestmark = pytest.mark.timeout(300)

WIDGET = "application/vnd.jupyter.widget-view+json"

# ~4 s of steps, a loss each step, a line every 10 steps
CELL = """%%distributed
import time
ring.progress(0, total=80, desc="long")
for i in range(80):
    time.sleep(0.05)
    ring.progress(i + 1)
    ring.log(loss=1.0 / (i + 1))
    if i % 10 == 0:
        print(f"step {i}", flush=True)
"""


@pytest.fixture(scope="module")
def kernel():
    with ring_kernel(2) as k:
        yield k


def _views(messages):
    """{display_id: "dashboard" | "tabs"} of the live widget views displayed in ``messages``."""
    views = {}
    for m in messages:
        data = m["content"].get("data") or {}
        if m["msg_type"] == "display_data" and WIDGET in data:
            kind = "dashboard" if "jr-dash" in data.get("text/html", "") else "tabs"
            views[m["content"]["transient"]["display_id"]] = kind
    return views


def test_a_running_cell_shows_its_live_view_again_on_request(kernel):
    where = kernel.ok("print(get_ipython().magics_manager.registry['RingMagics'].cluster"
                      ".where_dir)").strip().splitlines()[-1]
    assert _live.running_cell(where) is None  # between cells
    asked = {}

    def page(messages):
        # once the cell shows its dashboard and tabs, a reopened page asks for them again
        if not asked and sorted(_views(messages).values()) == ["dashboard", "tabs"]:
            asked["cell"] = _live.running_cell(where)
            _live.request_attach(where)
            asked["at"] = len(messages)

    messages = []
    kernel.ok(CELL, messages=messages, during=page, timeout=120)
    assert asked, "the cell never showed its dashboard and tabs"
    count = next(m["content"]["execution_count"] for m in messages if m["msg_type"] == "execute_input")
    cell = asked["cell"]
    assert cell["msg_id"] == messages[0]["parent_header"]["msg_id"], cell
    assert cell["execution_count"] == count, (cell, count)
    before, after = messages[:asked["at"]], messages[asked["at"]:]
    first, again = _views(before), _views(after)
    # the same two views again, as new widgets: their models announced after the request (a
    # reopened page learns a model from its comm_open)
    assert sorted(again.values()) == ["dashboard", "tabs"] and not set(again) & set(first), again
    opened = {m["content"]["comm_id"] for m in after if m["msg_type"] == "comm_open"}
    shown = {m["content"]["data"][WIDGET]["model_id"] for m in after
             if m["msg_type"] == "display_data" and WIDGET in m["content"]["data"]}
    assert shown <= opened, (shown, opened)
    # every view ends as the cell's static view, the new ones as the first ones
    final = {m["content"]["transient"]["display_id"]: m["content"]["data"] for m in messages
             if m["msg_type"] == "update_display_data"}
    assert set(first) | set(again) <= set(final), (first, again, list(final))
    for kind in ("dashboard", "tabs"):
        texts = {final[d]["text/plain"] for d, k in {**first, **again}.items() if k == kind}
        assert len(texts) == 1, (kind, texts)
    dash = next(final[d] for d, k in again.items() if k == "dashboard")
    assert "jr-static" in dash["text/html"] and re.search(r"long: 80 / 80", dash["text/html"])
    tabs = next(final[d] for d, k in again.items() if k == "tabs")
    assert "[rank 1] step 70" in tabs["text/plain"], tabs["text/plain"]
    # the cell is over: no running cell, no request left
    assert _live.running_cell(where) is None
    with pytest.raises(LookupError, match="no cell is running"):
        _live.request_attach(where)
    assert not _live.take_attach_request(where)


def test_between_cells_no_cell_runs_and_a_request_is_refused(kernel):
    where = kernel.ok("print(get_ipython().magics_manager.registry['RingMagics'].cluster"
                      ".where_dir)").strip().splitlines()[-1]
    kernel.ok("%%distributed\nprint(ring.rank())")
    assert _live.running_cell(where) is None
    with pytest.raises(LookupError, match="no cell is running on this cluster"):
        _live.request_attach(where)
