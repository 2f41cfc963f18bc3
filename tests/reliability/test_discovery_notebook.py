"""``%ring start --host-discovery`` through a real notebook kernel (issue 34, item 3): a real
kernel, a real cluster under keepers, and a real discovery script that prints what a file the
test writes says. The cluster follows it between cells (grow 2 -> 3, shrink 3 -> 2, bounded by
--min-ranks/--max-ranks), a plain cell is not disturbed by a change (the resize waits for its
end, and the notebook says so), and a source that fails or prints garbage is said once and
resizes nothing. Every rank checks an allreduce of its own against the size it reports."""

import stat
import textwrap
import time

import pytest

from real_kernel import Kernel, alive, cluster_pids, ring_kernel
from reliability.test_respawn_notebook import rank_lines
from reliability.test_scale_notebook import exact

pytestmark = pytest.mark.timeout(300)


def discovery_script(folder):
    """A script that prints the file ``slots`` (what a cloud's inventory would answer)."""
    slots = folder / "slots"
    path = folder / "discover.sh"
    path.write_text(f"#!/bin/sh\ncat {slots}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path, slots


def seen(kernel, says, limit=30.0):
    """Wait until ``%ring status`` shows the discovery's answer ``says`` (the poller's thread
    asked the script since the file changed); the status line."""
    deadline = time.monotonic() + limit
    while True:
        out = kernel.ok("%ring status")
        line = [x for x in out.splitlines() if x.startswith("host discovery")]
        if line and says in line[0]:
            return line[0]
        assert time.monotonic() < deadline, out
        time.sleep(0.1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("discovery")


@pytest.fixture(scope="module")
def followed(folder):
    """A kernel whose cluster of 2 ranks follows the script (min 2, max 4)."""
    script, slots = discovery_script(folder)
    slots.write_text("localhost:2\n")
    start = (f"%ring start --host-discovery {script} --discovery-interval 0.1 --min-ranks 2 "
             "--max-ranks 4")
    with ring_kernel(start=start) as kernel:
        cluster_pids(kernel)
        yield kernel, slots


def test_the_cluster_follows_the_script_between_cells(followed):
    kernel, slots = followed
    status = kernel.ok("%ring status")
    assert "host discovery" in status and "2 slot(s) (localhost:2)" in status, status
    kernel.ok("%%distributed\nkept = ring.rank() * 10 + 1")
    slots.write_text("localhost:3\n")
    seen(kernel, "3 slot(s)")
    out = kernel.ok(EXACT_KEPT)
    assert "(host discovery: 3 slots) Scaled 2 -> 3 ranks" in out and "rank(s) 2 are new" in out, out
    assert checked(out, 3) == {0: "1", 1: "11", 2: "None"}, out
    cluster_pids(kernel)
    assert exact(kernel, 3, "grown_13", 13) == {0: True, 1: True, 2: False}

    slots.write_text("localhost:1\nlocalhost:1\n")  # one host named twice: its slots add up
    seen(kernel, "2 slot(s)")
    out = kernel.ok(EXACT_KEPT)
    assert "(host discovery: 2 slots) Scaled 3 -> 2 ranks" in out and "rank(s) 2 stopped" in out, out
    assert checked(out, 2) == {0: "1", 1: "11"}, out


def test_min_and_max_bound_what_the_script_asks(followed):
    kernel, slots = followed
    slots.write_text("localhost:1\n")
    seen(kernel, "1 slot(s)")
    out = kernel.ok(EXACT_KEPT)
    assert "host discovery reports 1 slot(s), below --min-ranks 2" in out and "Scaled" not in out, out
    assert set(checked(out, 2)) == {0, 1}, out
    out = kernel.ok(EXACT_KEPT)  # said once, not at every cell
    assert "below --min-ranks" not in out, out

    slots.write_text("localhost:7\n")
    seen(kernel, "7 slot(s)")
    out = kernel.ok(EXACT_KEPT)
    assert "--max-ranks 4 bounds the world" in out and "Scaled 2 -> 4 ranks" in out, out
    assert set(checked(out, 4)) == {0, 1, 2, 3}, out
    cluster_pids(kernel)
    slots.write_text("localhost:2\n")
    seen(kernel, "2 slot(s)")
    out = kernel.ok(EXACT_KEPT)
    assert "Scaled 4 -> 2 ranks" in out, out
    assert set(checked(out, 2)) == {0, 1}, out
    out, error = kernel.execute("%ring scale 3")
    assert "UsageError: %ring scale 3: the cluster's size follows --host-discovery" in out, (out, error)


@pytest.mark.parametrize("text, says", [
    ("localhost:two\n", "line 1 is 'localhost:two', not 'host:slots'"),
    ("", "0 slot(s), below --min-ranks 2"),
])
def test_garbage_or_nothing_resizes_nothing_and_says_why(followed, text, says):
    kernel, slots = followed
    slots.write_text(text)
    seen(kernel, "line 1" if "line" in says else "0 slot(s)")
    out = kernel.ok(EXACT_KEPT)
    assert says in out and "Scaled" not in out, out
    assert set(checked(out, 2)) == {0, 1}, out
    slots.write_text("localhost:2\n")
    seen(kernel, "2 slot(s)")


def test_a_failing_script_resizes_nothing(followed, folder):
    kernel, slots = followed
    slots.unlink()  # cat exits 1
    try:
        seen(kernel, "exited 1")
        out = kernel.ok(EXACT_KEPT)
        assert "exited 1: cat:" in out and "No such file" in out and "stays at 2 ranks" in out, out
        assert set(checked(out, 2)) == {0, 1}, out
    finally:
        slots.write_text("localhost:2\n")
    seen(kernel, "2 slot(s)")


def test_a_plain_cell_runs_undisturbed_and_the_resize_waits_for_its_end(followed, folder):
    kernel, slots = followed
    release = folder / "release"
    said = "this cell is not under elastic.run on every rank, so it runs on 2 ranks undisturbed"

    def during(messages):
        text = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
        if said in text:
            release.write_text("go")

    # rank 0 changes what the script reports while the cell runs, then every rank waits for the
    # kernel's note (the test releases them when it comes)
    cell = ("%%distributed\nimport os, time\nprint('waiting', ring.size(), flush=True)\n"
            f"if ring.rank() == 0:\n    open({str(slots)!r}, 'w').write('localhost:3\\n')\n"
            f"while not os.path.exists({str(release)!r}):\n    time.sleep(0.02)\n"
            "import numpy as np\n"
            "print('after', ring.size(), ring.allreduce(np.full(3, ring.rank() + 1.0), op=ring.Sum, "
            "name='plain').tolist())")
    messages = []
    out, error = kernel.execute(cell, messages=messages, during=during, timeout=120)
    assert error is None and said in out, out
    for r in range(2):
        assert rank_lines(out, r) == ["waiting 2", "after 2 [3.0, 3.0, 3.0]"], out
    assert out.index(said) < out.index("(host discovery: 3 slots) Scaled 2 -> 3 ranks"), out
    cluster_pids(kernel)
    assert set(checked(kernel.ok(EXACT_KEPT), 3)) == {0, 1, 2}
    release.unlink()
    slots.write_text("localhost:2\n")
    seen(kernel, "2 slot(s)")
    kernel.ok(EXACT_KEPT)


def test_a_source_that_cannot_answer_is_refused_at_start(folder):
    script = folder / "bad.sh"
    script.write_text("#!/bin/sh\necho 'bogus line'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    kernel = Kernel()
    try:
        kernel.ok("%load_ext jupyter_ring")
        for line, says in ((f"%ring start --host-discovery {folder / 'none.sh'}", "is not an executable file"),
                           (f"%ring start --host-discovery {script}", "line 1 is 'bogus line'"),
                           ("%ring start --host-discovery no_such_module_e34:f", "cannot import it"),
                           (f"%ring start --host-discovery {script} --hosts a:1,b:1", "one host only")):
            out, error = kernel.execute(line)
            assert error is None and "UsageError: %ring start --host-discovery" in out and says in out, (line, out)
        out = kernel.ok("%ring status")
        assert "no cluster is running" in out, out
    finally:
        kernel.close()


# every rank: its size, an exact allreduce (Sum) of random ints at a prime length, `kept` if it has it
EXACT_KEPT = textwrap.dedent("""\
    %%distributed
    import numpy as np
    _d = lambda q: np.random.default_rng(77 + 1000 * ring.size() + q).integers(-99, 99, 1009).astype(np.float64)
    _s = ring.allreduce(_d(ring.rank()), op=ring.Sum, name='followed')
    print(ring.size(), bool((_s == sum(_d(q) for q in range(ring.size()))).all()), globals().get('kept'))
    """)


def checked(out, size):
    """Each rank's ``kept`` (as printed), after asserting its size and its exact allreduce."""
    got = {}
    for r in range(size):
        lines = rank_lines(out, r)
        assert len(lines) == 1, out
        n, ok, kept = lines[0].split()
        assert (n, ok) == (str(size), "True"), out
        got[r] = kept
    assert rank_lines(out, size) == [], out
    return got
