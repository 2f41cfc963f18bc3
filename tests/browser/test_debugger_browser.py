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
from test_lab_panel import CHROMIUM, CHROMIUM_ARGS, _run_cell, lab, playwright_api  # noqa: F401

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


def _answer(page, cell, label, line):
    """Wait for the stdin box labelled ``label`` under ``cell``; type ``line`` and Enter."""
    from playwright.sync_api import expect

    box = cell.locator(".jp-Stdin-input").last  # answered ones stay, read-only
    expect(box).to_be_visible(timeout=60_000)
    expect(box).to_be_editable()
    expect(cell.locator(".jp-Stdin-prompt").last).to_contain_text(label)
    box.fill(line)
    box.press("Enter")


def test_typing_into_a_ranks_pdb_prompt_in_jupyterlab(lab):
    from playwright.sync_api import expect

    url = f"{lab['base']}/lab/tree/ring.ipynb?token={lab['token']}"
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 760})
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            news = page.locator(".jp-Notification-Toast-Close, .jp-toast-button:has-text('No')")
            if news.count():
                news.first.click()
            page.wait_for_function(
                "() => document.querySelector('.jp-Notebook-ExecutionIndicator[data-status=\"idle\"]')",
                timeout=60_000)
            start = _run_cell(page, 0, "%load_ext jupyter_ring\n%ring start -n 2")
            expect(start.locator(".jp-OutputArea-output")).to_contain_text("ranks ready",
                                                                           timeout=90_000)

            cell = _run_cell(page, 1, BREAKPOINT)
            outputs = cell.locator(".jp-Cell-outputArea")
            expect(cell.locator(".jp-Stdin-input")).to_be_visible(timeout=60_000)
            # what the rank printed before it stopped is shown above its prompt, not after it
            expect(outputs).to_contain_text("rank 1 drew", timeout=5_000)
            expect(outputs).to_contain_text("rank 1 stopped in the debugger at")
            drawn = int(re.search(r"rank 1 drew (\d+)", outputs.inner_text()).group(1))
            _answer(page, cell, "(Pdb rank 1)", "p x")
            expect(outputs).to_contain_text(re.compile(rf"\(Pdb rank 1\)\s*p x\s+{drawn}\s"),
                                            timeout=20_000)
            # the next prompt, still rank 1's: the value shown above it
            expect(cell.locator(".jp-Stdin-input")).to_have_count(2, timeout=20_000)
            page.screenshot(path=BREAKPOINT_SCREENSHOT)
            _answer(page, cell, "(Pdb rank 1)", "c")
            expect(outputs).to_contain_text(f"rank 1 goes on with y={drawn + 1}", timeout=30_000)
            expect(outputs).to_contain_text("rank 0 goes on with y=", timeout=30_000)
            expect(cell.locator(".jp-InputPrompt")).not_to_contain_text("*", timeout=30_000)

            failed = _run_cell(page, 2, FAILING)
            expect(failed.locator(".jp-Cell-outputArea")).to_contain_text("ZeroDivisionError",
                                                                     timeout=60_000)
            debug = _run_cell(page, 3, "%ring debug")
            outputs = debug.locator(".jp-Cell-outputArea")
            expect(outputs).to_contain_text("post-mortem of In[", timeout=60_000)
            _answer(page, debug, "(Pdb rank 1)", "p values, total")
            expect(outputs).to_contain_text(re.compile(r"p values, total\s+\(\[0, 0\], 0\)"),
                                            timeout=20_000)
            expect(debug.locator(".jp-Stdin-input")).to_have_count(2, timeout=20_000)
            page.screenshot(path=POST_MORTEM_SCREENSHOT)
            _answer(page, debug, "(Pdb rank 1)", "q")
            expect(debug.locator(".jp-InputPrompt")).not_to_contain_text("*", timeout=30_000)
            after = _run_cell(page, 4, "%%distributed\nprint('still here', ring.rank(), x > 999)")
            expect(after.locator(".jp-Cell-outputArea")).to_contain_text("still here 1 True",
                                                                    timeout=60_000)
        finally:
            browser.close()
