"""The live training dashboard in a real JupyterLab driven by a real browser (Playwright + chromium).

A notebook starts 2 ranks and trains a small PyTorch MLP on them. While it trains, the dashboard
shows one row per rank (ipywidgets progress bars); when the cell ends it becomes its static final
HTML: both rows at 100 %, a loss chart with one polyline of points per rank, and the allreduce
figures. The screenshot (docs/img/dashboard.png) is refreshed with
``JUPYTER_RING_SCREENSHOTS=docs/img``.

``test_dashboard_renders_in_jupyterlab`` feeds the dashboard from the notebook itself, the way the
front end does (``LiveDashboard.poll`` while the cell runs); ``test_distributed_shows_the_dashboard``
checks that a plain ``%%distributed`` cell shows it, once the front end shows it by default.

Reuses the JupyterLab fixture and chromium settings of tests/browser/test_lab_panel.py.
"""

import os
import time

import pytest

from conftest import screenshot_path
from test_lab_panel import CHROMIUM, CHROMIUM_ARGS, ROOT, _run_cell, lab, playwright_api  # noqa: F401

SCREENSHOT = screenshot_path("dashboard.png")  # docs/img only with JUPYTER_RING_SCREENSHOTS=docs/img

pytestmark = pytest.mark.timeout(240)

# ~4 s of training on each rank: 120 steps with a loss logged each step.
TRAIN = """\
import time, torch
import jupyter_ring.runtime.torch as hvd
torch.set_num_threads(1)
torch.manual_seed(0)
x = torch.rand(2048, 2) * 2 - 1
y = (x[:, 0] * x[:, 1] > 0).float()
x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
model = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.02))
ring.progress(0, total=120, desc="train")
for i in range(120):
    idx = torch.randint(0, len(x), (64,))
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x[idx]).squeeze(1), y[idx])
    loss.backward()
    opt.step()
    ring.log(loss=loss.item())
    time.sleep(0.03)
print("trained", flush=True)
"""

# What the front end does around a cell (jupyter_ring.widgets.live), run here by hand.
FEED = f"""\
from jupyter_ring.widgets.live import ENGINE_SETUP, LiveDashboard
_cluster = get_ipython().magics_manager.registry["RingMagics"].cluster
_cluster.view.execute(ENGINE_SETUP, block=True)
ar = _cluster.view.execute({TRAIN!r}, block=False)
live = LiveDashboard(2)
while not ar.wait(0.02):
    live.poll(ar)
ar.wait_for_output(2.0)
live.finish(ar)
ar.get()
"""


def _wired():
    """True once ``%%distributed`` shows the dashboard (the front end imports LiveDashboard)."""
    with open(os.path.join(ROOT, "jupyter_ring", "magics.py")) as f:
        return "LiveDashboard" in f.read()


def _open_notebook(p, lab):
    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(f"{lab['base']}/lab/tree/ring.ipynb?token={lab['token']}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    news = page.locator(".jp-Notification-Toast-Close, .jp-toast-button:has-text('No')")
    if news.count():
        news.first.click()
    page.wait_for_function(
        "() => !document.querySelector('.jp-Toolbar-kernelStatus[data-status=\"busy\"]')",
        timeout=60_000)
    return browser, page


def _start_ranks(page):
    from playwright.sync_api import expect

    start = _run_cell(page, 0, "%load_ext jupyter_ring\n%ring start -n 2")
    expect(start.locator(".jp-OutputArea-output")).to_contain_text("ranks ready", timeout=90_000)


def _check_final_dashboard(cell):
    """The frozen dashboard: 2 rows at 100 %, a chart with points for each rank, comm figures."""
    from playwright.sync_api import expect

    static = cell.locator(".jr-static")
    expect(static).to_have_count(1, timeout=30_000)
    rows = static.locator("tr.jr-rank-row")
    expect(rows).to_have_count(2)
    for i in range(2):
        expect(rows.nth(i)).to_contain_text("100 %")
        expect(rows.nth(i)).to_contain_text("120 / 120")
        expect(rows.nth(i)).to_contain_text("loss")
    lines = static.locator("svg.jr-chart polyline.jr-series")
    expect(lines).to_have_count(2)
    for i in range(2):
        points = lines.nth(i).get_attribute("points").split()
        assert len(points) >= 100, f"rank {i}: only {len(points)} points charted"
    comm = static.locator("table.jr-comm")
    expect(comm).to_contain_text("busbw")
    comm_rows = comm.locator("tr.jr-comm-row")
    expect(comm_rows).to_have_count(2)
    for i in range(2):
        cells = comm_rows.nth(i).locator("td")
        assert int(cells.nth(1).inner_text()) >= 120  # at least one allreduce per step
        assert cells.nth(4).inner_text().endswith("/s")


def test_dashboard_renders_in_jupyterlab(lab):
    from playwright.sync_api import expect

    with playwright_api.sync_playwright() as p:
        browser, page = _open_notebook(p, lab)
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        try:
            _start_ranks(page)
            cell = _run_cell(page, 1, FEED)
            # live: the ipywidgets view, a row per rank with a progress bar that moves
            live_rows = cell.locator(".jr-dashboard .jr-rank-row")
            expect(live_rows).to_have_count(2, timeout=60_000)
            expect(live_rows.first.locator(".widget-hprogress, .jupyter-widgets.widget-progress")
                   ).to_have_count(1)
            expect(cell.locator(".jr-dashboard svg.jr-chart")).to_have_count(1, timeout=15_000)
            # final: replaced by its static HTML
            _check_final_dashboard(cell)
            expect(cell.locator(".jr-dashboard")).to_have_count(0)
            cell.locator(".jr-static").scroll_into_view_if_needed()
            time.sleep(0.5)
            cell.locator(".jr-static").screenshot(path=SCREENSHOT)
        finally:
            browser.close()
    assert not [e for e in errors if "widget" in e.lower() or "jr-" in e], errors


@pytest.mark.xfail(not _wired(), strict=False,
                   reason="%%distributed does not show the dashboard yet (front end to wire "
                          "jupyter_ring.widgets.live.LiveDashboard into _CellRun)")
def test_distributed_shows_the_dashboard(lab):
    with playwright_api.sync_playwright() as p:
        browser, page = _open_notebook(p, lab)
        try:
            _start_ranks(page)
            cell = _run_cell(page, 1, "%%distributed\n" + TRAIN)
            _check_final_dashboard(cell)
        finally:
            browser.close()
