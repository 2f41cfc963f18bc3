"""``%ring where`` and the stacks in stall/interrupt reports, on a real kernel and a real cluster
(issue 22): a rank stuck in C code that holds the GIL with SIGINT blocked, inside a named
function, while the other rank waits for it in an allreduce."""

import asyncio
import json
import time

import pytest
from real_kernel import cluster_pids, ring_kernel

from jupyter_ring.runtime._observe.where import Activity, Doing, parse_stacks, read_doing

pytestmark = pytest.mark.slow

# Rank 1 blocks SIGINT (as a rank inside a blocking MPI or NCCL call does) and sits in C code that
# holds the GIL (libc's sleep called through PyDLL); rank 0 waits for it in an allreduce.
STUCK = """%%distributed
import ctypes, signal
import numpy as np
ring.config().stall_timeout = {stall}
def stuck_in_native_code(seconds):
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGINT}})
    try:
        ctypes.PyDLL(None).sleep(seconds)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
if ring.rank() == 1:
    stuck_in_native_code({sleep})
total = ring.allreduce(np.ones(7) * (ring.rank() + 1), op=ring.Sum, name="grads")
"""


@pytest.fixture(scope="module")
def kernel():
    with ring_kernel(2) as k:
        cluster_pids(k)
        yield k


def _cluster_file(kernel):
    out = kernel.ok("print(get_ipython().magics_manager.registry['RingMagics'].cluster"
                    ".ipp_cluster.cluster_file)")
    return out.strip().splitlines()[-1]


def test_where_on_an_idle_cluster_names_every_rank(kernel):
    out = kernel.ok("%ring where")
    for rank in (0, 1):
        assert f"rank {rank} @ " in out, out
    assert out.count("running (not in a collective)") == 2, out
    assert out.count("main thread: idle (waiting for a cell)") == 2, out


def test_where_from_a_second_client_while_a_cell_is_stuck(kernel):
    """The Ring panel's route (server._clusters.where_cluster) run from this process while the
    kernel is busy: rank 1's stack shows the function it is stuck in, rank 0 the allreduce it
    waits in and for whom."""
    from jupyter_ring.server._clusters import where_cluster

    path = _cluster_file(kernel)
    msg_id = kernel.kc.execute(STUCK.format(stall=30, sleep=6))
    try:
        time.sleep(2.5)  # rank 1 is in its sleep, rank 0 in the allreduce
        started = time.monotonic()
        result = asyncio.run(where_cluster(path))
        took = time.monotonic() - started
    finally:
        _wait_idle(kernel, msg_id, 60)
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert set(ranks) == {0, 1}, json.dumps(result, indent=1)
    stuck, waiting = ranks[1], ranks[0]
    assert not stuck["problem"] and not waiting["problem"], result["text"]
    main = stuck["threads"][0]
    assert main["main"] and main["frames"][0]["function"] == "stuck_in_native_code", result["text"]
    assert stuck["state"] == "running", result["text"]
    assert waiting["state"] == "waiting" and waiting["kind"] == "allreduce", result["text"]
    assert waiting["name"] == "grads" and waiting["waiting_for"] == [1], result["text"]
    assert "waiting for rank(s) 1" in result["text"] and "stuck_in_native_code" in result["text"]
    # a cell's frames show their source line, as the docs' example does (issue 36, item 5): the
    # rank keeps its recent cells' sources where Where? reads them
    assert main["frames"][0]["source"] == "ctypes.PyDLL(None).sleep(seconds)", main["frames"]
    assert "      stuck_in_native_code(6)" in result["text"], result["text"]
    assert took < 10, took
    # the cell then finishes normally: the allreduce is exact on both ranks
    out = kernel.ok("%%distributed\nprint(total.tolist())")
    assert out.count("[3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]") == 2, out


def test_a_stall_shows_where_the_missing_rank_is_without_being_asked(kernel):
    """Rank 0's allreduce stalls after 2 s; the cell interrupts rank 1, which cannot stop: the
    output names rank 1 and shows stuck_in_native_code within 15 s of the stall."""
    messages = []
    started = time.monotonic()
    msg_id = kernel.kc.execute(STUCK.format(stall=2, sleep=12))
    shown_at = None
    deadline = started + 60
    text = ""
    while time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=0.1)
        except Exception:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "stream":
            text += msg["content"]["text"]
            if shown_at is None and "stuck_in_native_code" in text:
                shown_at = time.monotonic()
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert shown_at is not None, text
    # the stall fires 2 s after rank 0 entered the allreduce, right after the cell started
    assert shown_at - started < 2 + 15, shown_at - started
    report = text[text.index("a collective stalled"):]
    assert report.index("rank 1 @ ") < report.index("rank 0 @ "), report  # the missing rank first
    assert "stuck_in_native_code" in report.split("rank 0 @ ")[0], report
    errors = [m["content"] for m in messages if m["msg_type"] == "error"]
    assert errors and "StallError" in errors[0]["ename"] + errors[0]["evalue"], errors
    print(f"stall -> stacks shown: {shown_at - started - 2:.2f} s after the 2 s stall timeout")


def test_restart_after_a_stuck_rank_gives_a_working_cluster(kernel):
    kernel.ok("%ring restart", timeout=120)
    cluster_pids(kernel)
    out = kernel.ok("%%distributed\nimport numpy as np\n"
                    "v = ring.allreduce(np.arange(13.0) * (ring.rank() + 1), op=ring.Sum, name='after')\n"
                    "print(bool((v == np.arange(13.0) * 3).all()))")
    assert out.count("True") == 2, out
    assert "running (not in a collective)" in kernel.ok("%ring where")


def _wait_idle(kernel, msg_id, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=0.2)
        except Exception:
            continue
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            return
    raise TimeoutError(f"the cell {msg_id} did not end in {timeout} s")


# ---------------------------------------------------------------- the record and the dump format
def test_activity_record_round_trips_through_the_file(tmp_path):
    activity = Activity()
    activity.arm(str(tmp_path), 3)
    try:
        path = str(tmp_path / "rank3.doing")
        assert read_doing(path).state == "running"
        name = "fc1.weight.grad ✓"
        activity.begin("allreduce", name)
        activity.waiting([0, 2])
        record = read_doing(path)
        assert record == activity.doing()
        assert record.waiting_for == (0, 2) and record.name == "fc1.weight.grad ✓"
        assert "waiting for rank(s) 0, 2" in record.describe()
        activity.end()
        assert read_doing(path).state == "running"
        # a loop's next collective of the same name rewrites only the times; the waits are cleared
        activity.begin("allreduce", name)
        again = read_doing(path)
        assert (again.state, again.kind, again.name, again.waiting_for) == ("collective", "allreduce", name, ())
        activity.begin("broadcast", "w")
        assert read_doing(path)[1:3] == ("broadcast", "w") == activity.doing()[1:3]
        activity.end()
        assert read_doing(path).state == "running"
    finally:
        activity.disarm()
    assert read_doing(str(tmp_path / "rank9.doing")) is None


def test_parse_stacks_reads_faulthandlers_all_threads_dump():
    text = ('Thread 0x00007f0000000001 (most recent call first):\n'
            '  File "/x/threading.py", line 320 in wait\n\n'
            'Current thread 0x00007f0000000002 (most recent call first):\n'
            '  File "/tmp/cell.py", line 6 in stuck_in_native_code\n'
            '  File "/tmp/cell.py", line ??? in <module>\n')
    threads = parse_stacks(text)
    assert [t.thread for t in threads] == [0x7f0000000001, 0x7f0000000002]
    assert [t.current for t in threads] == [False, True]
    assert threads[1].frames[0].function == "stuck_in_native_code"
    assert threads[1].frames[1].line == 0


def test_where_hides_the_runtimes_own_frames_above_the_users_call():
    """As tracebacks do: the frames inside jupyter_ring (the collective waiting) above the user's
    call are one line; the user's frames and the state line say where and in what; --all-threads
    shows everything."""
    from jupyter_ring.cluster._where import RankWhere, format_where, where_json

    text = ('Current thread 0x00007f0000000002 (most recent call first):\n'
            '  File "/venv/site-packages/jupyter_ring/runtime/_engine/core.py", line 410 in _wait\n'
            '  File "/venv/site-packages/jupyter_ring/runtime/_engine/collectives.py", line 88 in allreduce\n'
            '  File "/venv/site-packages/jupyter_ring/runtime/_api.py", line 300 in allreduce\n'
            '  File "/tmp/cell.py", line 12 in train_step\n'
            '  File "/tmp/cell.py", line 20 in <module>\n'
            '  File "/venv/site-packages/IPython/core/interactiveshell.py", line 3600 in run_code\n'
            '  File "/venv/site-packages/jupyter_ring/engines/_runner.py", line 50 in run\n')
    item = RankWhere(0, "vm", 123, None, tuple(parse_stacks(text)), "", 0.01)
    report = format_where([item])
    assert "... 3 frame(s) inside jupyter_ring above (--all-threads shows them)" in report
    assert "_engine/core.py" not in report and "_engine/collectives.py" not in report
    assert report.index("inside jupyter_ring above") < report.index("in train_step") < report.index("in <module>")
    assert "_runner.py" in report  # only the innermost run is hidden, not the engine below the cell
    assert "... 1 frame(s) of the engine (IPython, ipyparallel) below" in report
    full = format_where([item], all_threads=True)
    assert "_engine/core.py" in full and "inside jupyter_ring above" not in full
    (thread,) = where_json([item])[0]["threads"]
    assert thread["hidden_inside"] == 3 and thread["frames"][0]["function"] == "train_step"
    # a thread of ours (the progress engine, the torch monitor) is not the user's: shown only
    # with --all-threads; the main thread keeps its frames even when they are all ours
    ours = ('Thread 0x00007f0000000003 (most recent call first):\n'
            '  File "/venv/site-packages/jupyter_ring/engines/_torch.py", line 167 in _monitor\n'
            '  File "/usr/lib/python3.12/threading.py", line 1010 in run\n\n'
            'Current thread 0x00007f0000000004 (most recent call first):\n'
            '  File "/venv/site-packages/jupyter_ring/runtime/_api.py", line 90 in barrier\n')
    doing = Doing(state="running", main_thread=0x7f0000000004)
    lone = RankWhere(1, "vm", 124, doing, tuple(reversed(parse_stacks(ours))), "", 0.01)  # main first
    report = format_where([lone])
    assert "_monitor" not in report and "_monitor" in format_where([lone], all_threads=True)
    assert "in barrier" in report


def test_where_groups_ranks_whose_state_and_frames_read_the_same_at_many_ranks():
    """64 ranks' answer in a few blocks (issue 33): ranks waiting in the same collective at the
    same line share one block headed by their ranks as ranges and the span of their wait; a rank
    elsewhere keeps its own block with its pid; below GROUP_FROM ranks every rank has its own."""
    from jupyter_ring.cluster._where import GROUP_FROM, RankWhere, format_where, rank_ranges

    assert rank_ranges([5, 0, 1, 2, 7, 8, 63]) == "0-2, 5, 7-8, 63" and rank_ranges([4]) == "4"
    waiting = ('Current thread 0x00007f00000000{t:02x} (most recent call first):\n'
               '  File "/venv/site-packages/jupyter_ring/runtime/_engine/core.py", line 410 in _wait\n'
               '  File "/tmp/cell.py", line 12 in train_step\n'
               '  File "/tmp/cell.py", line 20 in <module>\n')
    slow = ('Current thread 0x00007f00000000aa (most recent call first):\n'
            '  File "/tmp/cell.py", line 7 in load_batch\n'
            '  File "/tmp/cell.py", line 19 in <module>\n')
    now = 1000.0
    items = []
    for rank in range(64):
        if rank == 3:
            doing = Doing(state="running", main_thread=0x7f00000000aa)
            items.append(RankWhere(rank, "vm", 500 + rank, doing, tuple(parse_stacks(slow)), "", 0.01))
            continue
        doing = Doing(state="waiting", kind="allreduce", name="grads", since=now - 4.0 - rank / 100,
                      waiting_for=(3,), waiting_since=now - 3.9, main_thread=0x7f0000000000 + rank)
        items.append(RankWhere(rank, "vm" if rank < 32 else "vm2", 500 + rank, doing,
                               tuple(parse_stacks(waiting.format(t=rank))), "", 0.01))
    report = format_where(items, now=now)
    heads = [line for line in report.splitlines() if not line.startswith(" ")]
    assert heads == ["ranks 0-2, 4-63 @ 2 hosts: inside allreduce 'grads' for 4.0-4.6 s, waiting for "
                     "rank(s) 3 for 3.9 s",
                     "rank 3 @ vm (pid 503): running (not in a collective)"], report
    assert report.count("in train_step") == 1 and report.count("in load_batch") == 1, report
    few = format_where(items[:GROUP_FROM - 1], now=now)
    assert [line.split(" @")[0] for line in few.splitlines() if not line.startswith(" ")] == [
        "rank 0", "rank 1", "rank 2", "rank 3"], few
