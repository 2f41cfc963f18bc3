"""A tab per rank in a real JupyterLab (Playwright + Debian's chromium), and a killed kernel.

One notebook: ``%ring start -n 2``; a ``%%distributed`` cell prints on both ranks, sleeps, then
fails on rank 1. While it runs, the output is an ipywidgets Tab ("all ranks", "rank 0",
"rank 1") streaming live; when it ends, the same output is static HTML tabs with "rank 1 ✗"
selected and each rank's text in its own tab. Then the kernel is SIGKILLed and every cluster
process is counted with psutil until gone. Reuses the JupyterLab fixture of test_lab_panel.
"""

import json
import os
import signal
import time

import psutil
import pytest

from conftest import screenshot_path
from bounds import GONE_S
from test_lab_panel import CHROMIUM, CHROMIUM_ARGS, _run_cell, lab, playwright_api  # noqa: F401

SCREENSHOT = screenshot_path("rank-tabs.png")  # docs/img only with JUPYTER_RING_SCREENSHOTS=docs/img
LIVE_SCREENSHOT = screenshot_path("rank-tabs-live.png")

pytestmark = pytest.mark.timeout(240)


def _boxes(locator):
    return [locator.nth(i).bounding_box() for i in range(locator.count())]


def _alive(pids):
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def test_rank_tabs_live_then_static_and_killed_kernel_cleans_up(lab):
    from playwright.sync_api import expect

    url = f"{lab['base']}/lab/tree/ring.ipynb?token={lab['token']}"
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            news = page.locator(".jp-Notification-Toast-Close, .jp-toast-button:has-text('No')")
            if news.count():
                news.first.click()
            page.wait_for_function(
                "() => document.querySelector('.jp-Notebook') && "
                "document.querySelector('.jp-Notebook-ExecutionIndicator[data-status=\"idle\"]')",
                timeout=60_000)
            start = _run_cell(page, 0, "%load_ext jupyter_ring\n%ring start -n 2")
            expect(start.locator(".jp-Cell-outputArea")).to_contain_text("ranks ready",
                                                                           timeout=90_000)

            cell = _run_cell(page, 1, "%%distributed\nimport time\n"
                                      "print(f'hello from rank {ring.rank()}', flush=True)\n"
                                      "time.sleep(3)\n"
                                      "if ring.rank() == 1:\n"
                                      "    raise ValueError('rank one failed')\n"
                                      "print(f'done on rank {ring.rank()}')")
            # live: an ipywidgets Tab with a tab per rank, streaming before the cell ends
            live = cell.locator(".widget-tab")
            expect(live).to_be_visible(timeout=20_000)
            labels = live.locator(".lm-TabBar-tab .lm-TabBar-tabLabel")
            expect(labels).to_have_text(["all ranks", "rank 0", "rank 1"])
            expect(live).to_contain_text("hello from rank", timeout=10_000)
            expect(cell.locator(".jp-InputPrompt")).to_contain_text("*")
            live.locator(".lm-TabBar-tab", has_text="rank 1").click()
            expect(live).to_contain_text("hello from rank 1")
            live_tabs = _boxes(live.locator(".lm-TabBar-tab"))
            live_panel = live.locator(".widget-tab-contents").bounding_box()
            page.screenshot(path=LIVE_SCREENSHOT, clip={"x": 0, "y": 0, "width": 1200, "height": 800})

            # the end: static tabs, the failing rank's tab marked and selected
            tabs = cell.locator(".jr-rank-tabs")
            expect(tabs).to_be_visible(timeout=30_000)
            expect(cell.locator(".widget-tab")).to_have_count(0)
            expect(tabs.locator("label")).to_have_text(["all ranks", "rank 0", "rank 1 ✗"])
            # one look: the static tabs sit where the live ones were, at their size (no jump)
            static_tabs = _boxes(tabs.locator("label"))
            for live_box, static_box in zip(live_tabs[:2], static_tabs[:2]):  # "rank 1" got "✗"
                for key in ("x", "y", "width", "height"):
                    assert abs(live_box[key] - static_box[key]) <= 2, (key, live_tabs, static_tabs)
            assert abs(live_tabs[2]["x"] - static_tabs[2]["x"]) <= 2, (live_tabs, static_tabs)
            static_panel = tabs.locator("div.jr-panel").bounding_box()
            for key in ("x", "y", "width"):
                assert abs(live_panel[key] - static_panel[key]) <= 2, (key, live_panel, static_panel)
            # one panel holds every output once; the selected tab's CSS shows its part: read
            # what is rendered (innerText), not what is in the page
            panel = tabs.locator("div.jr-panel")
            expect(panel).to_have_count(1)

            def shown(text):
                expect(panel).to_contain_text(text, use_inner_text=True)

            def hidden(text):
                expect(panel).not_to_contain_text(text, use_inner_text=True)

            shown("hello from rank 1")
            shown("rank one failed")
            shown("the traceback is below the tabs")  # one traceback per rank: the red block's
            expect(cell.locator(".jp-OutputArea-output").last).to_contain_text("Traceback")
            hidden("hello from rank 0")
            hidden("[rank ")  # a rank's own tab is untagged
            expect(cell.locator(".jp-OutputArea-output").last).to_contain_text("[rank 1 @")
            page.screenshot(path=SCREENSHOT, clip={"x": 0, "y": 0, "width": 1200, "height": 800})
            tabs.locator("label", has_text="rank 0").click()
            shown("done on rank 0")
            hidden("rank one failed")
            hidden("hello from rank 1")
            tabs.locator("label", has_text="all ranks").click()
            shown("[rank 0] hello from rank 0")
            shown("[rank 1] hello from rank 1")
            shown("[rank 1] ValueError: rank one failed")
            hidden("Traceback")  # the "all ranks" tab names the error in one line

            # a killed kernel: every controller, mpiexec, engine and nanny gone within 2 s
            info = _run_cell(page, 2, "import os, json\nprint(json.dumps([os.getpid()] + "
                                      "[p.pid for p in get_ipython().magics_manager.registry"
                                      "['RingMagics'].cluster.processes()]))")
            expect(info.locator(".jp-OutputArea-output")).to_contain_text("[", timeout=30_000)
            kernel_pid, *pids = json.loads(info.locator(".jp-OutputArea-output").inner_text())
            assert len(pids) >= 5 and len(_alive(pids)) == len(pids)
            t0 = time.monotonic()
            os.kill(kernel_pid, signal.SIGKILL)
            while _alive(pids) and time.monotonic() - t0 < 10:
                time.sleep(0.02)
            took = time.monotonic() - t0
            assert not _alive(pids), f"survived the kernel: {_alive(pids)}"
            assert took < GONE_S, f"the cluster outlived the kernel by {took:.2f} s"
        finally:
            browser.close()
