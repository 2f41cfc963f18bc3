"""A rank's pdb prompt typed into in a real JupyterLab (Playwright + Debian's chromium).

One notebook, a 2-rank cluster: ``breakpoint()`` on rank 1 brings up JupyterLab's stdin box
labelled ``(Pdb rank 1)`` under the cell; ``p x`` typed there shows rank 1's value of ``x`` (random,
printed by the rank first), ``c`` lets it go and the cell ends with both ranks' output. Then a cell
that fails on rank 1 and ``%ring debug``: the box opens in the raising frame, ``p`` of a local
there, ``q``. The two screenshots are the docs' (docs/img only with JUPYTER_RING_SCREENSHOTS).
Reuses the JupyterLab fixture of test_lab_panel.
"""

import re

import pytest

from conftest import screenshot_path
from test_dashboard_browser import _open_notebook
from test_lab_panel import _run_cell, lab, playwright_api  # noqa: F401

BREAKPOINT_SCREENSHOT = screenshot_path("debugger-prompt.png")
POST_MORTEM_SCREENSHOT = screenshot_path("debugger-post-mortem.png")

pytestmark = pytest.mark.timeout(300)

BREAKPOINT = """%%distributed
import random

def step(x):
    y = x + 1
    if ring.rank() == 1:
        breakpoint()
    return y

x = random.randint(1000, 9999)
print(f"rank {ring.rank()} drew {x}")
y = step(x)
print(f"rank {ring.rank()} goes on with y={y}")
"""

FAILING = """%%distributed
def share(values):
    total = sum(values)
    return values[-1] / total

weight = share([0, 1 - ring.rank()])   # rank 1's values sum to 0
"""


def _answer(cell, line):
    """Wait for the stdin box labelled ``(Pdb rank 1)`` under ``cell``; type ``line``, Enter."""
    from playwright.sync_api import expect

    box = cell.locator(".jp-Stdin-input").last  # answered ones stay, read-only
    expect(box).to_be_visible(timeout=60_000)
    expect(box).to_be_editable()
    expect(cell.locator(".jp-Stdin-prompt").last).to_contain_text("(Pdb rank 1)")
    box.fill(line)
    box.press("Enter")


def _inspect(page, cell, line, shown, screenshot, then):
    """Type ``line``, see ``shown`` (a pattern) above the next prompt, shoot, then type ``then``
    and wait for the cell's end."""
    from playwright.sync_api import expect

    _answer(cell, line)
    expect(cell.locator(".jp-Cell-outputArea")).to_contain_text(shown, timeout=20_000)
    expect(cell.locator(".jp-Stdin-input")).to_have_count(2, timeout=20_000)  # the next prompt
    page.screenshot(path=screenshot)
    _answer(cell, then)
    expect(cell.locator(".jp-InputPrompt")).not_to_contain_text("*", timeout=30_000)


def test_typing_into_a_ranks_pdb_prompt_in_jupyterlab(lab):
    from playwright.sync_api import expect

    with playwright_api.sync_playwright() as p:
        browser, page = _open_notebook(p, lab)
        try:
            start = _run_cell(page, 0, "%load_ext jupyter_ring\n%ring start -n 2")
            expect(start.locator(".jp-Cell-outputArea")).to_contain_text("ranks ready",
                                                                           timeout=90_000)

            cell = _run_cell(page, 1, BREAKPOINT)
            outputs = cell.locator(".jp-Cell-outputArea")
            expect(cell.locator(".jp-Stdin-input")).to_be_visible(timeout=60_000)
            # what the rank printed before it stopped is shown above its prompt, not after it
            expect(outputs).to_contain_text("rank 1 drew", timeout=5_000)
            expect(outputs).to_contain_text("rank 1 stopped in the debugger at")
            drawn = int(re.search(r"rank 1 drew (\d+)", outputs.inner_text()).group(1))
            _inspect(page, cell, "p x", re.compile(rf"\(Pdb rank 1\)\s*p x\s+{drawn}\s"),
                     BREAKPOINT_SCREENSHOT, "c")
            expect(outputs).to_contain_text(f"rank 1 goes on with y={drawn + 1}")
            expect(outputs).to_contain_text("rank 0 goes on with y=")

            failed = _run_cell(page, 2, FAILING)
            expect(failed.locator(".jp-Cell-outputArea")).to_contain_text("ZeroDivisionError",
                                                                          timeout=60_000)
            debug = _run_cell(page, 3, "%ring debug")
            expect(debug.locator(".jp-Cell-outputArea")).to_contain_text("post-mortem of In[",
                                                                         timeout=60_000)
            _inspect(page, debug, "p values, total",
                     re.compile(r"p values, total\s+\(\[0, 0\], 0\)"), POST_MORTEM_SCREENSHOT, "q")
            after = _run_cell(page, 4, "%%distributed\nprint('still here', ring.rank(), x > 999)")
            expect(after.locator(".jp-Cell-outputArea")).to_contain_text("still here 1 True",
                                                                         timeout=60_000)
        finally:
            browser.close()
