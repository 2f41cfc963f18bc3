"""``%ring timeline`` drawn in a real browser (Playwright + Debian's chromium), JavaScript off.

A real kernel and a 2-rank cluster run 5 allreduces and 2 broadcasts, rank 1 arriving 30 ms
late at each; the HTML the kernel displays (what a saved notebook keeps) is opened in chromium
with scripts disabled: a track per rank, a bar per collective on each track, rank 1 marked as
the straggler, a phase strip under the bars. Then ``%ring restart`` gives a working cluster.
"""

import pytest
from real_kernel import cluster_pids, ring_kernel
from test_lab_panel import CHROMIUM, CHROMIUM_ARGS, playwright_api  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CELL = """%%distributed
import time
import numpy as np
ring.reset_stats()
for step in range(5):
    if ring.rank() == 1:
        time.sleep(0.03)   # the straggler
    ring.allreduce(np.ones(1000 + step) * ring.rank(), name=f"grad{step}")
    if step % 2:
        ring.broadcast(np.arange(17.0), root_rank=0, name=f"params{step}")
"""


def test_timeline_draws_a_track_per_rank_and_a_bar_per_collective(tmp_path):
    with ring_kernel(2) as kernel:
        cluster_pids(kernel)
        kernel.ok(CELL)
        messages = []
        kernel.execute("%ring timeline --last 60", messages=messages)
        shown = [m["content"]["data"] for m in messages if m["msg_type"] == "display_data"]
        assert shown and "text/html" in shown[0], messages
        assert "<- straggler" in shown[0]["text/plain"].split("rank 1:")[1], shown[0]["text/plain"]
        page_file = tmp_path / "timeline.html"
        page_file.write_text(f"<!doctype html><meta charset='utf-8'><body>{shown[0]['text/html']}")

        with playwright_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                context = browser.new_context(java_script_enabled=False)  # a saved notebook
                page = context.new_page()
                page.goto(page_file.as_uri())
                tracks = page.locator("svg g.track")
                assert tracks.count() == 2
                for rank in (0, 1):
                    track = page.locator(f'svg g.track[data-rank="{rank}"]')
                    bars = track.locator("g.bar")
                    assert bars.count() == 7, rank  # 5 allreduces + 2 broadcasts
                    names = sorted(bars.nth(i).get_attribute("data-name") for i in range(7))
                    assert names == sorted([f"grad{s}" for s in range(5)] + ["params1", "params3"])
                    box = bars.first.locator("rect").first.bounding_box()
                    assert box and box["width"] >= 1 and box["height"] > 10, box
                    assert track.locator("rect.phase").count() >= 5  # every allreduce: its agreement at least
                straggler = page.locator('svg g.track[data-straggler="true"]')
                assert straggler.count() == 1 and straggler.get_attribute("data-rank") == "1"
                assert "straggler" in straggler.text_content()
            finally:
                browser.close()

        kernel.ok("%ring restart", timeout=120)
        cluster_pids(kernel)
        out = kernel.ok("%%distributed\nimport numpy as np\nprint(ring.allreduce(np.ones(3), "
                        "op=ring.Sum, name='after').tolist())")
        assert out.count("[2.0, 2.0, 2.0]") == 2, out
