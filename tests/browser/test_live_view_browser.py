"""A notebook closed and reopened while its long cell runs gets the cell's live view back.

Issue 36's rough edge: the reopened notebook showed its old saved output and never the live one
(the server discards what it buffered for the closed page; the browser console says "Comm not
found" for the old widgets). In a real JupyterLab with chromium: 2 ranks run a ~60 s training
cell; the notebook is saved and its tab closed mid-cell, then reopened from the file browser:
the cell shows its old output, not moving. The Ring panel shows the running cell; its "Show
live view" brings the live dashboard and rank tabs back into that cell while the kernel is
busy, and the progress advances there; when the cell ends they are its static views, as if the
notebook had never been closed, and the notebook saves them.
"""

import json
import re
import time
import urllib.error

import pytest

from test_lab_panel import CHROMIUM, CHROMIUM_ARGS, _get, _run_cell, lab, playwright_api  # noqa: F401
from test_dashboard_browser import _open_notebook, _start_ranks

pytestmark = pytest.mark.timeout(300)

# up to ~60 s of steps on each rank, a loss each step, a line printed every 50 steps; once the
# test has seen what it came for it creates the file FINISH and the remaining steps run at once
LONG = """\
%%distributed
import os
import time
import numpy as np
ring.progress(0, total=600, desc="long")
for i in range(600):
    ring.allreduce(np.ones(16), name="g")
    time.sleep(0 if os.path.exists(FINISH) else 0.1)
    ring.progress(i + 1)
    ring.log(loss=1.0 / (i + 1))
    if i % 50 == 0:
        print(f"step {i}", flush=True)
print("long done", flush=True)
"""


def _saved_outputs(lab, index):
    """The outputs of cell ``index`` in the notebook as saved; [] while the file is being
    written (the server answers 400 for a notebook it cannot read) or has no such cell yet."""
    try:
        notebook = _get(f"{lab['base']}/api/contents/ring.ipynb?content=1", lab["token"])
    except urllib.error.HTTPError:
        return []
    cells = notebook["content"]["cells"]
    return cells[index].get("outputs", []) if index < len(cells) else []


def _step(row_text):
    match = re.search(r"long: (\d+) / 600", row_text)
    return int(match.group(1)) if match else -1


def test_a_reopened_notebook_gets_the_running_cells_live_view_back(lab, tmp_path):
    from playwright.sync_api import expect

    finish = tmp_path / "finish"

    with playwright_api.sync_playwright() as p:
        browser, page = _open_notebook(p, lab)
        try:
            _start_ranks(page)
            long = _run_cell(page, 1, LONG.replace("FINISH", repr(str(finish))))
            expect(long.locator(".jr-dashboard .jr-rank-row")).to_have_count(2, timeout=60_000)
            expect(long.locator(".jp-InputPrompt")).to_contain_text("*")
            page.keyboard.press("Control+s")
            deadline = time.monotonic() + 20   # saved with the running cell's output
            while not _saved_outputs(lab, 1):
                assert time.monotonic() < deadline, "Control+S did not save the notebook"
                time.sleep(0.1)
            # close the notebook's tab mid-cell (discarding what changed since the save)
            page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current "
                         ".lm-TabBar-tabCloseIcon").click()
            discard = page.locator(".jp-Dialog button", has_text="Discard")
            try:
                discard.click(timeout=3_000)
            except Exception:  # saved and unchanged: no dialog
                pass
            expect(page.locator(".jp-Notebook")).to_have_count(0, timeout=10_000)
            time.sleep(2.0)  # the kernel's messages for the closed page are dropped meanwhile

            # reopen it from the file browser: the old output, no live view
            item = page.locator(".jp-DirListing-item", has_text="ring.ipynb")
            if not item.is_visible():  # the sidebar's tab shows the file browser, or hides it
                page.locator('.jp-SideBar [data-id="filebrowser"]').click()
            item.dblclick()
            cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
            expect(cell).to_be_visible(timeout=30_000)
            time.sleep(2.0)
            assert cell.locator(".jr-dashboard .jr-rank-row").count() == 0, \
                "a live view without asking: the test shows nothing"

            # the Ring panel knows the running cell and offers its live view
            page.locator('.jp-SideBar [data-id="jupyter-ring-panel"]').click()
            running = page.locator(".jp-RingPanel-cell")
            expect(running).to_contain_text(re.compile(r"cell \[2\] running for \d+"),
                                            timeout=15_000)
            running.locator("button[data-action=live]").click()
            rows = cell.locator(".jr-dashboard .jr-rank-row")
            expect(rows).to_have_count(2, timeout=15_000)
            assert "*" in cell.locator(".jp-InputPrompt").inner_text()
            first = _step(rows.first.inner_text())
            deadline = time.monotonic() + 30
            while _step(rows.first.inner_text()) < first + 10:
                assert time.monotonic() < deadline, f"the live view stays at step {first}"
                time.sleep(0.2)
            # the rank tabs come back too, with what the ranks print from now on
            tabs = cell.locator(".jr-rank-tabs")
            expect(tabs).to_have_count(1, timeout=15_000)
            expect(tabs).to_contain_text("step", timeout=15_000)
            finish.touch()  # seen live: the cell may end now

            # the end: the cell's own static views, in place of the live ones, saved
            static = cell.locator(".jr-static")
            expect(static).to_have_count(1, timeout=120_000)
            expect(static.locator("tr.jr-rank-row").first).to_contain_text("600 / 600")
            expect(cell.locator(".jr-dashboard")).to_have_count(0)
            expect(cell.locator(".jr-rank-tabs")).to_contain_text("long done", timeout=15_000)
            expect(cell.locator(".jp-InputPrompt")).to_have_text("[2]:")
            expect(running).to_have_count(0, timeout=15_000)  # the panel: no cell runs
            page.locator(".jp-Notebook").first.click()
            page.keyboard.press("Control+s")
            deadline = time.monotonic() + 20
            while True:
                outputs = _saved_outputs(lab, 1)
                html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
                if "jr-static" in html and "long done" in html:
                    break
                assert time.monotonic() < deadline, f"not saved: {json.dumps(outputs)[:2000]}"
                time.sleep(0.5)
        finally:
            browser.close()
