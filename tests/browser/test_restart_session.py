"""A whole session under a real JupyterLab: a cell cut off by a restart, and the server's log.

One notebook in Playwright + Debian's chromium: ``%ring start -n 2``; a ``%%distributed`` cell
that reports progress and a loss (the live dashboard); a long cell cut off by a kernel restart
(Kernel > Restart, by its shortcut); in the new kernel ``%ring start``,
the dashboard again, the Ring panel's Stop (through the server's route), ``%ring start`` and
``%ring stop``. The server's log, where the kernels' and their controllers'
stdout and stderr land, must hold nothing alarming: no ipyparallel controller log, no
"unhandled iopub msg_type", no traceback, no "Failed to remove".
Reuses the JupyterLab fixture of test_lab_panel.
"""

import json
import re
import time

import pytest

from bounds import GONE_S
from conftest import screenshot_path
from test_dashboard_browser import _open_notebook
from test_lab_panel import _get, _run_cell, lab, playwright_api  # noqa: F401

SCREENSHOT = screenshot_path("cut-off-cell.png")  # docs/img only with JUPYTER_RING_SCREENSHOTS=docs/img

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

DASHBOARD_CELL = """\
%%distributed
import time
ring.progress(0, total=40, desc="train")
for i in range(40):
    ring.allreduce(ring.rank() + i * 1.0, name="x")
    ring.log(loss=1.0 / (i + 1))
    time.sleep(0.05)
print("trained", flush=True)
"""

LONG_CELL = """\
%%distributed
import time
print("sleeping", flush=True)
ring.progress(0, total=600, desc="long")
for i in range(600):
    ring.allreduce(float(i), name="tick")
    ring.log(loss=1.0 / (i + 1))
    ring.progress(i + 1)
    time.sleep(0.1)
"""

# What must never appear in a healthy session's server log (issue 21, item 10).
ALARMING = [
    re.compile(r"\[IPController\]|\[IPEngine\]|\[IPEngineApp\]|\[IPControllerApp\]"),
    re.compile(r"unhandled iopub msg_type"),
    re.compile(r"Traceback \(most recent call last\)"),
    re.compile(r"ZMQError"),
    re.compile(r"Failed to (remove|load)"),
    re.compile(r"Message signing is disabled"),
]


def _alarming(text):
    return [line for line in text.splitlines() if any(p.search(line) for p in ALARMING)]


def _saved(lab):
    return _get(f"{lab['base']}/api/contents/ring.ipynb?content=1", lab["token"])["content"]


def _start(page, index):
    from playwright.sync_api import expect

    cell = _run_cell(page, index, "%load_ext jupyter_ring\n%ring start -n 2")
    expect(cell.locator(".jp-Cell-outputArea")).to_contain_text("ranks ready", timeout=90_000)


def _dashboard(page, index):
    from playwright.sync_api import expect

    cell = _run_cell(page, index, DASHBOARD_CELL)
    expect(cell.locator(".jr-rank-tabs")).to_be_visible(timeout=60_000)
    expect(cell.locator(".jp-Cell-outputArea")).to_contain_text("trained")


def _wait_idle(page):
    page.wait_for_function(
        "() => document.querySelector('.jp-Notebook-ExecutionIndicator[data-status=\"idle\"]')",
        timeout=60_000)


def _xfail_on_heartbeat_loss(output):
    """The known defect (rehearsals 32 and 39, 2 in about 10 whole-suite runs, never alone): the
    ``%ring start`` right after the Ring panel's Stop started engines that got no heartbeat from the
    new controller for 30 s and shut down ("Maximum number of heartbeats misses reached"), so the
    start failed naming them. Its cause is not found; any other failure of the step fails the test."""
    if "Maximum number of heartbeats misses reached" in output and "did not start" in output:
        pytest.xfail("known defect: after the Ring panel's Stop the next %ring start's engines got no "
                     "heartbeat from the new controller and shut down (cause not found)")


def test_a_session_with_a_restart_during_a_cell_logs_nothing_alarming(lab):
    from playwright.sync_api import expect

    with playwright_api.sync_playwright() as p:
        browser, page = _open_notebook(p, lab)
        try:
            _start(page, 0)
            _dashboard(page, 1)
            long = _run_cell(page, 2, LONG_CELL)
            expect(long.locator(".jp-Cell-outputArea")).to_contain_text("sleeping", timeout=30_000)
            expect(long.locator(".jr-dashboard.widget-vbox")).to_be_visible(timeout=30_000)
            expect(long.locator(".jp-InputPrompt")).to_contain_text("*")
            time.sleep(1.0)  # the cell is well into its allreduces
            # Kernel > Restart Kernel..., as a user does (keyboard: 0 0, then the dialog)
            page.keyboard.press("Escape")
            page.keyboard.press("0")
            page.keyboard.press("0")
            page.locator(".jp-Dialog .jp-mod-accept").click()
            _wait_idle(page)
            # the cut-off cell: static tabs with what the ranks printed, and a note; no widget
            # left to lose its kernel (broken-link icons)
            frozen = long.locator(".jr-rank-tabs.jr-cut-off")
            expect(frozen).to_be_visible(timeout=10_000)
            expect(long.locator(".widget-tab")).to_have_count(0)
            expect(long.locator(".jupyter-widgets-disconnected")).to_have_count(0)
            expect(frozen.locator("label")).to_have_text(["all ranks", "rank 0", "rank 1"])
            expect(frozen.locator(".jr-panel:visible")).to_have_count(1)
            expect(frozen.locator(".jr-panel:visible")).to_contain_text("[rank 1] sleeping")
            expect(frozen.locator(".jr-note")).to_contain_text("cut off: the kernel was restarted")
            # the live dashboard too: its rows and chart as they showed, static, with the note
            dash = long.locator(".jr-dashboard.jr-cut-off")
            expect(dash).to_be_visible()
            expect(dash).to_contain_text("rank 1")
            expect(dash.locator("svg")).to_have_count(1)
            expect(dash.locator(".jr-note")).to_contain_text("cut off: the kernel was restarted")
            expect(long.locator(".jr-dashboard:not(.jr-cut-off)")).to_have_count(0)
            frozen.locator("label", has_text="rank 1").click()
            expect(frozen.locator(".jr-panel:visible")).to_have_text("sleeping")
            page.screenshot(path=SCREENSHOT)
            page.keyboard.press("Control+s")  # the static form is what the notebook keeps
            deadline = time.monotonic() + 20
            while "cut off: the kernel was restarted" not in json.dumps(_saved(lab)):
                assert time.monotonic() < deadline, "the cut-off cell's static form was not saved"
                time.sleep(0.5)
            saved = _saved(lab)["cells"][2]["outputs"]
            assert not [o for o in saved if "application/vnd.jupyter.widget-view+json" in o.get("data", {})], \
                f"the cut-off cell still saves widget views: {json.dumps(saved)[:2000]}"
            assert sum("jr-cut-off" in o.get("data", {}).get("text/html", "") for o in saved) == 2

            # the new kernel: a cluster, the dashboard again, then the Ring panel's Stop (the
            # server stops it: ipyparallel's stop of the controller, in the server's process)
            _start(page, 3)
            _dashboard(page, 4)
            clusters = _get(f"{lab['base']}/jupyter-ring/clusters", lab["token"])
            running = [c for c in clusters["clusters"] if c["state"] == "running"]
            assert len(running) == 1, clusters
            _get(f"{lab['base']}/jupyter-ring/clusters/{running[0]['id']}/stop", lab["token"],
                 "POST", b"")
            status = _run_cell(page, 5, "%ring start -n 2\n%ring stop")
            try:
                expect(status.locator(".jp-Cell-outputArea")).to_contain_text("stopped 2 ranks",
                                                                                timeout=90_000)
            except AssertionError:
                _xfail_on_heartbeat_loss(status.locator(".jp-Cell-outputArea").inner_text())
                raise
            # anything the old clusters' processes still had to say: said once they are gone
            loud = lab["wait_quiet"](GONE_S)
            assert not loud, f"still writing to the server's log {GONE_S} s after the stop: {loud}"
        finally:
            browser.close()
    bad = _alarming(lab["log_text"]())
    assert not bad, "the server's log holds alarming lines:\n" + "\n".join(bad[:40])
