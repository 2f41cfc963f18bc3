"""The Ring panel in a real JupyterLab driven by a real browser (Playwright + Debian's chromium).

One notebook: ``%ring start -n 2``; the panel lists the cluster with both ranks and the status bar
shows it; while a long ``%%distributed`` cell runs (rank 1 asleep in a named function, rank 0
waiting for it in an allreduce), Where? shows both ranks' stacks (and, later, an error when its
route fails), and the cell is interrupted
from the panel (through the server, while the kernel is busy) and stops within seconds; the cluster is stopped from the panel. Also runs
``python -m jupyterlab.browser_check`` (its browser part in Debian's chromium too) against the
installed extension.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import screenshot_path
from lab_server import get as _get
from jupyter_ring.cluster._sidecar import sidecar_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCREENSHOT = screenshot_path("lab-panel.png")
WHERE_SCREENSHOT = screenshot_path("lab-where.png")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="the browser test needs playwright: pip install playwright")
if not os.path.exists(CHROMIUM):
    pytest.skip("the browser test needs chromium: apt-get install -y chromium (scripts/setup.sh "
                "does this when run as root)", allow_module_level=True)


@pytest.fixture
def lab(lab_server):
    """The process's JupyterLab (tests/browser/lab_server.py), fresh for this test: a new
    ``ring.ipynb`` with its kernel started, nothing left of earlier tests. Afterwards its kernels
    are shut down; a process of theirs (a cluster's) still alive then fails the teardown."""
    offset = lab_server.fresh()
    yield {"base": lab_server.base, "token": lab_server.token, "proc": lab_server.proc,
           "log_text": lambda: lab_server.log_text(offset), "wait_quiet": lab_server.wait_quiet}
    left = lab_server.clear()
    assert not left, ("alive after the test's kernels were shut down (killed now):\n"
                      + "\n".join(left))


def _run_cell(page, index, code):
    """Type ``code`` into cell ``index`` (creating it) and run it with Shift+Enter."""
    cells = page.locator(".jp-Notebook .jp-Cell")
    if cells.count() <= index:
        page.locator(".jp-Notebook").click()
        page.keyboard.press("Escape")
        page.keyboard.press("b")
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    editor = cell.locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(code)
    page.keyboard.press("Shift+Enter")
    return cell


def _prompt(cell):
    return cell.locator(".jp-InputPrompt").inner_text()


def test_ring_panel_interrupts_and_stops_a_cluster(lab):
    from playwright.sync_api import expect

    url = f"{lab['base']}/lab/tree/ring.ipynb?token={lab['token']}"
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        errors = []
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 850})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.wait_for_selector(".jp-RingStatus", timeout=30_000)  # our plugin activated
            news = page.locator(".jp-Notification-Toast-Close, .jp-toast-button:has-text('No')")
            if news.count():
                news.first.click()
            # Wait for the kernel before typing, so that the first run is not lost.
            page.wait_for_function(
                "() => { const s = document.querySelector('.jp-Notebook'); return s && "
                "document.querySelector('.jp-Notebook-ExecutionIndicator[data-status=\"idle\"]'); }",
                timeout=60_000)

            start = _run_cell(page, 0, "%load_ext jupyter_ring\n%ring start -n 2")
            expect(start.locator(".jp-Cell-outputArea")).to_contain_text("ranks ready",
                                                                           timeout=90_000)

            page.locator('.jp-SideBar [data-id="jupyter-ring-panel"]').click()
            card = page.locator(".jp-RingPanel-cluster")
            expect(card).to_have_count(1, timeout=15_000)
            expect(card.locator("tr.jp-RingPanel-rank")).to_have_count(2, timeout=15_000)
            expect(card.locator(".jp-RingPanel-state")).to_have_text("running")
            expect(card.locator("tr.jp-RingPanel-rank").first).to_contain_text("alive")
            expect(page.locator(".jp-RingStatus")).to_have_text("Ring: running · 2 ranks",
                                                                 timeout=15_000)
            # the owner is named by its notebook; the kernel id and pid come second
            expect(card.locator(".jp-RingPanel-ownerName")).to_have_text("ring.ipynb")
            expect(card.locator(".jp-RingPanel-ownerId")).to_have_text(
                re.compile(r"kernel [0-9a-f]{8} · pid \d+"))
            assert _status_text_offset(page) <= 1, "Ring: sits off its neighbours' text line"

            # rank 1 naps in a named function; rank 0 waits for it in an allreduce
            long = _run_cell(page, 1, "%%distributed\nimport time\nimport numpy as np\n"
                                      "def nap_on_rank_1():\n    time.sleep(60)\n"
                                      "print('sleeping', flush=True)\n"
                                      "if ring.rank() == 1:\n    nap_on_rank_1()\n"
                                      "ring.allreduce(np.ones(3), name='grads')")
            expect(long.locator(".jp-InputPrompt")).to_contain_text("*", timeout=10_000)
            expect(long.locator(".jp-OutputArea-output").first).to_contain_text("sleeping",
                                                                                 timeout=30_000)
            # the panel shows the running cell, with its live view on offer (docs/lab.md)
            expect(card.locator(".jp-RingPanel-cell")).to_contain_text(
                re.compile(r"cell \[2\] running for \d+"), timeout=15_000)
            page.screenshot(path=SCREENSHOT)

            # Where? while the cell is busy: every rank's stack, read through the server
            card.locator("button[data-action=where]").click()
            report = page.locator(".jp-Dialog .jp-RingPanel-where")
            expect(report).to_be_visible(timeout=15_000)
            expect(report.locator("li[data-rank='0']")).to_contain_text(
                "inside allreduce 'grads'", timeout=5_000)
            expect(report.locator("li[data-rank='0']")).to_contain_text("waiting for rank(s) 1")
            expect(report.locator("li[data-rank='1']")).to_contain_text("running")
            text = report.locator("pre.jp-RingPanel-whereText")
            expect(text).to_contain_text("rank 0 @")
            expect(text).to_contain_text("rank 1 @")
            expect(text).to_contain_text("in nap_on_rank_1")
            assert "monospace" in text.evaluate("n => getComputedStyle(n).fontFamily")
            # the picture shows the end: rank 0's cell line, then rank 1's stack
            text.evaluate("n => { n.scrollTop = n.scrollHeight; }")
            page.screenshot(path=WHERE_SCREENSHOT)
            page.locator(".jp-Dialog .jp-mod-accept").click()
            expect(report).to_have_count(0)
            t0 = time.monotonic()
            card.locator("button[data-action=interrupt]").click()
            expect(long.locator(".jp-InputPrompt")).not_to_contain_text("*", timeout=10_000)
            took = time.monotonic() - t0
            assert took < 10, f"the cell ran on for {took:.1f} s after Interrupt"
            expect(long.locator(".jp-OutputArea")).to_contain_text("KeyboardInterrupt")

            # Restart runs %ring restart in the owning kernel: a new cluster with 2 live ranks.
            old_id = card.get_attribute("data-cluster-id")
            card.locator("button[data-action=restart]").click()
            expect(card).not_to_have_attribute("data-cluster-id", old_id, timeout=60_000)
            expect(card.locator(".jp-RingPanel-state")).to_have_text("running", timeout=15_000)
            expect(card.locator("tr.jp-RingPanel-rank.jp-mod-alive")).to_have_count(2)

            cluster_id = card.get_attribute("data-cluster-id")
            info = _get(f"{lab['base']}/jupyter-ring/clusters/{cluster_id}", lab["token"])

            # Where? when the route fails: without the cluster's rank table (its sidecar) the
            # server cannot reach the ranks; an error dialog and the panel say why
            sidecar = sidecar_path(info["profile_dir"], cluster_id)
            deadline = time.monotonic() + 60  # %ring restart writes it once the ranks are ready
            while not os.path.exists(sidecar) and time.monotonic() < deadline:
                time.sleep(0.2)
            os.rename(sidecar, sidecar + ".away")
            try:
                card.locator("button[data-action=where]").click()
                failed = page.locator(".jp-Dialog")
                expect(failed).to_contain_text("could not read the ranks' stacks", timeout=15_000)
                expect(failed).to_contain_text("has no rank table")
                expect(failed.locator(".jp-RingPanel-where")).to_have_count(0)
                page.keyboard.press("Escape")  # showErrorMessage has only a Dismiss button
                expect(failed).to_have_count(0)
                expect(page.locator(".jp-RingPanel-error")).to_contain_text(f"where {cluster_id}")
            finally:
                os.rename(sidecar + ".away", sidecar)
            pids = [r["pid"] for r in info["ranks"]] + [info["controller"]["pid"]]
            card.locator("button[data-action=stop]").click()
            page.locator(".jp-Dialog .jp-mod-accept").click()
            expect(page.locator(".jp-RingPanel-empty")).to_be_visible(timeout=20_000)
            expect(page.locator(".jp-RingStatus")).to_have_text("Ring: no cluster",
                                                                 timeout=10_000)
            deadline = time.monotonic() + 5
            while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not [pid for pid in pids if _alive(pid)], "cluster processes survived Stop"
        finally:
            browser.close()
    ours = [e for e in errors if "ring" in e.lower()]
    assert not ours, f"JavaScript errors from the extension: {ours}"


def _status_text_offset(page):
    """Pixels between the vertical position of the Ring status text and that of the status-bar
    text items beside it (JupyterLab's own, e.g. the kernel's name)."""
    tops = page.evaluate("""() => {
      const textTop = node => {
        const range = document.createRange();
        range.selectNodeContents(node);
        const rects = Array.from(range.getClientRects()).filter(r => r.height > 0);
        return rects.length ? Math.min(...rects.map(r => r.top)) : null;
      };
      const ring = document.querySelector('.jp-RingStatus');
      const others = Array.from(document.querySelectorAll('.jp-StatusBar-TextItem'))
        .filter(node => node.offsetParent !== null && node.textContent.trim());
      return [textTop(ring), others.map(textTop)];
    }""")
    ring, others = tops
    assert ring is not None and others, f"no status-bar text to compare: {tops}"
    return max(abs(ring - other) for other in others)


def _alive(pid):
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# browser_check drives Playwright for node from <app dir>/browser_test and asks it to download
# its own chromium, which is not reachable here: the folder gets this Playwright (the browser
# layout below is this version's) and PLAYWRIGHT_BROWSERS_PATH a tree in which each browser it
# would download is Debian's chromium, marked installed.
PLAYWRIGHT_NODE = "1.65.1"
_BROWSER_FILES = {  # Playwright's name -> (folder, executable inside it), linux-x64
    "chromium": ("chromium-{}", "chrome-linux64/chrome"),
    "chromium-headless-shell": ("chromium_headless_shell-{}",
                                "chrome-headless-shell-linux64/chrome-headless-shell"),
    "ffmpeg": ("ffmpeg-{}", "ffmpeg-linux"),  # video capture only; browser_check records none
}


def _playwright_for_browser_check(env):
    from jupyterlab.commands import get_app_dir

    target = os.path.join(get_app_dir(), "browser_test")
    browsers_json = os.path.join(target, "node_modules", "playwright-core", "browsers.json")
    if not os.path.exists(browsers_json):
        if not shutil.which("npm"):
            pytest.skip("jupyterlab.browser_check needs npm (Node.js) to install Playwright for "
                        "node: apt-get install -y npm")
        os.makedirs(target, exist_ok=True)
        for cmd in (["npm", "init", "-y"], ["npm", "install", f"playwright@{PLAYWRIGHT_NODE}"]):
            proc = subprocess.run(cmd, cwd=target, capture_output=True, text=True, timeout=300,
                                  env=env)
            assert proc.returncode == 0, f"{' '.join(cmd)} in {target}:\n{proc.stderr[-3000:]}"
    with open(browsers_json) as f:
        return {b["name"]: b["revision"] for b in json.load(f)["browsers"]}


def _debian_chromium_as_playwright_browsers(revisions, into):
    for name, (folder, exe) in _BROWSER_FILES.items():
        base = os.path.join(into, folder.format(revisions[name]))
        os.makedirs(os.path.dirname(os.path.join(base, exe)), exist_ok=True)
        os.symlink(CHROMIUM if name != "ffmpeg" else shutil.which("true"), os.path.join(base, exe))
        for marker in ("INSTALLATION_COMPLETE", "DEPENDENCIES_VALIDATED"):
            open(os.path.join(base, marker), "w").close()


def test_jupyterlab_browser_check_passes():
    """``python -m jupyterlab.browser_check``, browser part included: JupyterLab with the
    installed extension loads in (Debian's) chromium and reports no error."""
    with tempfile.TemporaryDirectory() as tmp:
        runtime, browsers = os.path.join(tmp, "runtime"), os.path.join(tmp, "browsers")
        env = dict(os.environ, JUPYTER_RUNTIME_DIR=runtime, PLAYWRIGHT_BROWSERS_PATH=browsers,
                   npm_config_cache=os.path.join(tmp, "npm-cache"),
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        _debian_chromium_as_playwright_browsers(_playwright_for_browser_check(env), browsers)
        proc = subprocess.run([sys.executable, "-m", "jupyterlab.browser_check", "--allow-root"],
                              capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "jupyter_ring.server | extension was successfully loaded" in out, out[-6000:]
    assert "Browser test complete" in out, out[-6000:]  # the page loaded, no error parsed
