"""Interrupts that reach a rank outside its cell's code still end the cell (issue 36).

ipykernel raises KeyboardInterrupt on SIGINT for the whole time it handles an execute request; one
that landed after the cell's code had ended (its reply being built, flushed, sent: ~0.3 s after
another rank failed, the kernel's peer interrupt often comes then on a loaded machine) escaped the
request's handler with no reply sent. The rank went idle, Where? showed every rank "idle (waiting
for a cell)", and the notebook waited for that reply for ever, then said the rank "did not stop".

Real kernel, real 2-rank cluster. The Ring panel's actions are the functions its server routes
run (``server._clusters.interrupt_cluster``, ``where_cluster``); the toolbar's interrupt is the
kernel's interrupt_request. Bounds are generous (a shared, loaded 2-core machine): what is asserted
is that every cell ends, with the right message, and that the ranks keep their variables.
"""

import asyncio
import os
import queue
import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from real_kernel import Kernel, cluster_pids, ring_kernel

from jupyter_ring.server._clusters import interrupt_cluster, where_cluster

pytestmark = pytest.mark.timeout(240)

# Seconds a cell may take to end once interrupted, under load (they take well under one).
ENDS_WITHIN = 30

# Rank 1's next execute reply is slowed (as on a loaded machine) or lost, once, when ARM exists:
# the hook replaces ipyparallel's finish_metadata, which ipykernel calls after the cell's code,
# just before it sends the reply. MARK says the rank is there.
REPLY_HOOK = """%%distributed
def _reply_hook(parent, metadata, reply_content, _kernel=get_ipython().kernel,
                _finish=type(get_ipython().kernel).finish_metadata):
    if os.path.exists({arm!r}):
        os.remove({arm!r})
        open({mark!r}, 'w').close()
        {action}
    return _finish(_kernel, parent, metadata, reply_content)
if ring.rank() == 1:
    get_ipython().kernel.finish_metadata = _reply_hook
"""
UNHOOK = "%%distributed\nget_ipython().kernel.__dict__.pop('finish_metadata', None)"


class Ring(NamedTuple):
    """The module's kernel, its cluster's file (the panel's handle on it), and the folder where
    each rank marks that its cell began."""

    kernel: Kernel
    cluster_file: str
    started: str


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ring]:
    with ring_kernel(2) as k:
        cluster_pids(k)
        cluster_file = k.ok("print(get_ipython().magics_manager.registry['RingMagics'].cluster"
                            ".ipp_cluster.cluster_file)").strip().splitlines()[-1]
        k.ok("%%distributed\nimport os, time\nimport numpy as np\nkept = 10 * ring.rank() + 7")
        # the ranks' tracebacks in one line: hundreds of interrupted cells, each formatted fast
        k.ok("%%distributed\nget_ipython().InteractiveTB.set_mode('Minimal')")
        yield Ring(k, cluster_file, str(tmp_path_factory.mktemp("started")))


def panel(action: str, ring: Ring) -> dict:
    """The Ring panel's Interrupt or Where? on the kernel's cluster, as its route runs it."""
    route = interrupt_cluster if action == "interrupt" else where_cluster
    return asyncio.run(route(ring.cluster_file))


def ends(kernel: Kernel, code: str, during: Callable[[], bool] | None = None,
         timeout: float = ENDS_WITHIN) -> tuple[str, dict | None]:
    """Run ``code``; (text, error). ``during()`` is called while it runs: True asks for the
    kernel's interrupt (the toolbar's). A cell still running after ``timeout`` s fails the test,
    after an interrupt of the kernel that frees it for the next test."""
    try:
        return kernel.execute(code, timeout=timeout, interrupt_when=during)
    except TimeoutError as exc:
        kernel.km.interrupt_kernel()
        _drain_until_idle(kernel, 60)
        pytest.fail(f"the cell did not end within {timeout} s: {exc}")


def _drain_until_idle(kernel: Kernel, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return


def rank_values(kernel: Kernel, expression: str) -> dict[int, str]:
    """``expression`` printed on each rank: {rank: text}."""
    out = kernel.ok(f"%%distributed\nprint({expression})")
    return {r: line.split("] ", 1)[1] for r in (0, 1) for line in out.splitlines()
            if line.startswith(f"[rank {r}] ")}


def state_kept(kernel: Kernel, tag: str) -> None:
    """The ranks kept their variables, and a collective on them is exact."""
    assert rank_values(kernel, "kept") == {0: "7", 1: "17"}
    got = rank_values(kernel, "ring.allreduce(np.arange(5.0) * (ring.rank() + 1), op=ring.Sum, "
                              f"name='after_{tag}').tolist()")
    assert got == {0: "[0.0, 3.0, 6.0, 9.0, 12.0]", 1: "[0.0, 3.0, 6.0, 9.0, 12.0]"}, got


def test_an_interrupt_while_a_rank_sends_its_reply_is_ignored_and_the_cell_ends(
        ring: Ring, tmp_path: Path) -> None:
    """The panel's Interrupt lands on rank 1 after its cell's code ended, while it sends its reply
    (held there 2 s): the cell ends without error. Before, that reply was never sent."""
    kernel = ring.kernel
    arm, mark = str(tmp_path / "arm"), str(tmp_path / "mark")
    kernel.ok(REPLY_HOOK.format(arm=arm, mark=mark, action="time.sleep(2)"))
    try:
        open(arm, "w").close()
        sent: list[dict] = []

        def interrupt_in_the_reply() -> bool:
            if not sent and os.path.exists(mark):
                sent.append(panel("interrupt", ring))
            return False

        out, error = ends(kernel, "%%distributed\nlate = ring.rank() + 1", interrupt_in_the_reply)
        assert sent, "rank 1 never reached its reply"
        assert error is None, (out, error)
        assert "did not stop" not in out and "%ring restart" not in out, out
    finally:
        kernel.ok(UNHOOK)
    assert rank_values(kernel, "late") == {0: "1", 1: "2"}
    state_kept(kernel, "reply")


@pytest.mark.parametrize("interrupt", [None, "kernel"])
def test_a_rank_that_goes_idle_without_replying_ends_the_cell(ring: Ring, tmp_path: Path,
                                                              interrupt: str | None) -> None:
    """Rank 1 loses its reply (a KeyboardInterrupt escapes ipykernel's handler, as a late SIGINT
    did): its engine goes idle, and the cell ends a moment later, saying so, instead of waiting
    for ever. The toolbar's interrupt meanwhile ends it too, and says nothing of ranks that "did
    not stop" or of %ring restart: the ranks are fine, and keep their variables."""
    kernel = ring.kernel
    arm, mark = str(tmp_path / "arm"), str(tmp_path / "mark")
    kernel.ok(REPLY_HOOK.format(arm=arm, mark=mark, action="raise KeyboardInterrupt"))
    try:
        open(arm, "w").close()
        out, error = ends(kernel, "%%distributed\nlost = ring.rank() + 1",
                          lambda: interrupt == "kernel" and os.path.exists(mark))
    finally:
        kernel.ok(UNHOOK)
    assert "rank(s) 1 finished the cell but never sent its reply" in out, out
    assert "did not stop" not in out and "%ring restart" not in out, out
    if interrupt is None:
        assert error is None, (out, error)
    else:
        assert error is not None and error["ename"] == "CellInterrupted", (out, error)
    assert rank_values(kernel, "lost") == {0: "1", 1: "2"}
    state_kept(kernel, f"lost_{interrupt}")


# ------------------------------------------------- an interrupt is its cell's, on every rank
# Rank 1 is held when the notebook's interrupt comes, its cell not begun: by an earlier request of
# its own (a slow pull, the user's own execute: a bare SIGINT interrupted that request instead), or
# between requests, its event loop busy (the request not begun yet, as on a loaded host: a bare
# SIGINT is ignored there, and the second one sent once the rank began could land in the next
# cell). The hold ends when RELEASE exists; the test makes it once the notebook has said that rank
# 1 had not begun (or, if it never says so, once it shows where the ranks are, 1 s later).
HOLDS = {
    "request": "import os, time\n"
               "while not os.path.exists({release!r}):\n"
               "    time.sleep(0.01)\n"
               "held = 'released'\n",
    "between": "import asyncio, os, time\n"
               "def _hold_the_loop():\n"
               "    open({holding!r}, 'w').close()\n"
               "    while not os.path.exists({release!r}):\n"
               "        time.sleep(0.01)\n"
               "    globals()['held'] = 'released'\n"
               "asyncio.get_running_loop().call_soon(_hold_the_loop)\n",
}

# The interrupted cell: rank 0 begins it and waits there (the kernel's interrupt), or fails in it
# (the peer interrupt, 0.3 s later, is rank 1's); rank 1 cannot end it but by an interrupt.
ADDRESSED = """%%distributed
open(os.path.join({started!r}, str(ring.rank())), 'w').close()
ran_x = ring.rank()
if ring.rank() == 0:
    {rank0}
ring.allreduce(np.ones(5), name='x_interrupted')
"""


@pytest.mark.parametrize("hold", sorted(HOLDS))
@pytest.mark.parametrize("by", ["kernel", "peer"])
def test_an_interrupt_reaches_a_rank_that_had_not_begun_the_cell_and_never_the_next_one(
        ring: Ring, tmp_path: Path, hold: str, by: str) -> None:
    """The notebook's interrupt (the toolbar's, or a failed rank's peers') comes while rank 1 has
    not begun the cell: rank 1 stops as it begins it, running none of its code; the earlier
    request that held it ends as it would have; the cell's message says where each rank stopped;
    the next cell runs clean on every rank, which kept its variables."""
    kernel = ring.kernel
    release, holding = str(tmp_path / "release"), str(tmp_path / "holding")
    started = str(tmp_path / "started")
    os.mkdir(started)
    kernel.ok("_rc = get_ipython().magics_manager.registry['RingMagics'].cluster\n"
              "_held = _rc.client[_rc.engine_ids[1]].execute("
              f"{HOLDS[hold].format(release=release, holding=holding)!r}, block=False)")
    try:
        if hold == "between":  # the loop is held once the request that set it up has ended
            kernel.ok("_held.wait(30)\nassert _held.successful(), _held.get()")
            _wait_for(lambda: os.path.exists(holding), "rank 1's loop to be held")
        rank0 = "pass" if by == "kernel" else "raise ValueError('rank 0 fails on purpose')"
        messages: list[dict] = []

        def release_once_rank_1_waits(got: list[dict]) -> None:
            text = "".join(m["content"].get("text", "") for m in got if m["msg_type"] == "stream")
            if "had not begun the cell" in text or "where the ranks are" in text:
                open(release, "w").close()

        try:
            out, error = kernel.execute(
                ADDRESSED.format(started=started, rank0=rank0), timeout=ENDS_WITHIN,
                messages=messages, during=release_once_rank_1_waits,
                interrupt_when=lambda: by == "kernel" and os.path.exists(os.path.join(started, "0")))
        except TimeoutError as exc:
            open(release, "w").close()
            kernel.km.interrupt_kernel()
            _drain_until_idle(kernel, 60)
            pytest.fail(f"the cell did not end within {ENDS_WITHIN} s: {exc}")
    finally:
        open(release, "w").close()
    # the request that held rank 1 ended as it would have: the interrupt was not its
    kernel.ok("_held.wait(30)\nprint(_held.successful() or _held.get())")
    assert rank_values(kernel, "globals().pop('held', None)") == {0: "None", 1: "released"}
    # rank 1 ran none of the interrupted cell; rank 0 ran it up to where it stopped; the next cell
    # runs clean on both, which kept their variables
    assert rank_values(kernel, "globals().pop('ran_x', None)") == {0: "0", 1: "None"}, out
    state_kept(kernel, f"addressed_{hold}_{by}")
    # the cell said so, rank by rank
    assert "(rank(s) 1 had not begun the cell when interrupted" in out, out
    assert "did not stop" not in out and "%ring restart" not in out, out
    assert error is not None, out
    if by == "kernel":
        assert error["ename"] == "CellInterrupted", (out, error)
        # (rank 0's place is unknown: this module's ranks format tracebacks in one line)
        assert error["evalue"].startswith("interrupted by you; every rank stopped: rank 0 "), error
        assert error["evalue"].endswith(", rank 1 before the cell began (none of its code ran)"), \
            error
    else:
        text = "\n".join(error["traceback"])
        assert error["ename"] == "DistributedError", (out, error)
        assert error["evalue"].startswith("[rank 0 @ ") and "ValueError: rank 0 fails on purpose" \
            in error["evalue"], error
        assert re.search(r"\[rank 1 @ [^]]+\] KeyboardInterrupt: interrupted before this cell "
                         r"began on this rank .*\(interrupted: a peer rank failed\)", text), text


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = ENDS_WITHIN) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what}")
        time.sleep(0.01)


# ----------------------------------------------------------------------- stress: many sequences
SEQUENCES = int(os.environ.get("JUPYTER_RING_RACE_SEQUENCES", "100"))

CELLS = {
    # the cell: one rank sleeps inside a function, the other waits for it in an allreduce
    "sleeper": """%%distributed
def load_batch():
    time.sleep(45)
if ring.rank() == {slow}:
    load_batch()
g = ring.allreduce(np.ones(10), name='grads')
""",
    # both ranks in a training loop: a step's work, then its allreduce. (Back to back, with no
    # work between, about one interrupt in 50 lands where the runtime's executor lock has been
    # taken but not yet guarded, which leaks it: a runtime bug of its own, reported separately.)
    "training": """%%distributed
for step in range(10**9):
    time.sleep(0.005)
    g = ring.allreduce(np.ones(100), name='grads')
""",
    # ends by itself: an interrupt lands as it ends, while a rank replies, or after
    "short": """%%distributed
time.sleep({seconds})
print('done', ring.rank(), flush=True)
""",
}

# Rank 0's and rank 1's debuggers, scripted (an engine has no stdin): stop, step, continue (which
# leaves pdb's own SIGINT handler installed for the rest of the cell).
PDB_ON_RANKS = """%%distributed
import io, pdb
pdb.Pdb(stdin=io.StringIO('p kept\\nn\\nc\\n'), stdout=io.StringIO()).set_trace()
after_pdb = kept
"""


def debug_in_kernel(kernel: Kernel, commands: list[str], timeout: float = 30) -> None:
    """``%debug`` in the notebook kernel, post mortem on the last failed cell, answering its
    prompts with ``commands`` (then ``q``)."""
    msg_id = kernel.kc.execute("%debug", allow_stdin=True, stop_on_error=False)
    answers = list(commands)
    prompts = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kernel.kc.get_stdin_msg(timeout=0.02)
            kernel.kc.input(answers.pop(0) if answers else "q")
            prompts += 1
        except queue.Empty:
            pass
        try:
            msg = kernel.kc.get_iopub_msg(timeout=0.02)
        except queue.Empty:
            continue
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            assert prompts >= len(commands), f"%debug prompted {prompts} times"
            return
    pytest.fail(f"%debug did not end within {timeout} s")


def use_debuggers(kernel: Kernel, i: int) -> None:
    """pdb on the ranks, then %debug in the kernel on a failed cell (as the issue's notebook did)."""
    kernel.ok(PDB_ON_RANKS)
    _, error = kernel.execute(f"%%distributed\nraise ValueError('for %debug {i}')")
    assert error is not None and error["ename"] == "DistributedError", error
    debug_in_kernel(kernel, ["where", "up", "c"] if i % 2 else ["p 1 + 1", "q"])


def one_sequence(ring: Ring, rng: random.Random) -> tuple[str, str, float]:
    """A cell, maybe the panel's Where?, then the panel's or the toolbar's Interrupt, at random
    moments once every rank has begun the cell (an interrupt that reaches a rank before its cell
    is not that cell's, by design); the cell must end, with an interrupt's message only.
    (kind, by, seconds to end)."""
    kind = rng.choice(sorted(CELLS))
    marks = [os.path.join(ring.started, str(r)) for r in (0, 1)]
    for mark in marks:
        if os.path.exists(mark):
            os.remove(mark)
    code = CELLS[kind].format(slow=rng.randrange(2), seconds=round(rng.uniform(0, 0.15), 3))
    code = code.replace("%%distributed\n", "%%distributed\nopen(os.path.join("
                        f"{ring.started!r}, str(ring.rank())), 'w').close()\n", 1)
    where_at = rng.uniform(0, 0.1) if rng.random() < 0.5 else None
    interrupt_at = rng.uniform(0, 0.2)
    by = rng.choice(["panel", "kernel"])
    started = time.monotonic()
    begun: list[float] = []  # when every rank had begun the cell
    done = {"where": where_at is None, "interrupt": False}

    def during() -> bool:
        if not begun:
            if not all(os.path.exists(mark) for mark in marks):
                return False
            begun.append(time.monotonic())
        elapsed = time.monotonic() - begun[0]
        if not done["where"] and where_at is not None and elapsed >= where_at:
            done["where"] = True
            panel("where", ring)
        if not done["interrupt"] and elapsed >= interrupt_at:
            done["interrupt"] = True
            if by == "kernel":
                return True
            panel("interrupt", ring)
        return False

    out, error = ends(ring.kernel, code, during)
    took = time.monotonic() - started
    context = f"{kind} cell, Where? at {where_at}, {by} interrupt at {interrupt_at:.2f} s"
    assert "did not stop" not in out and "%ring restart" not in out, (context, out)
    if error is not None:
        text = "\n".join(error["traceback"])
        assert error["ename"] in ("CellInterrupted", "DistributedError", "KeyboardInterrupt"), \
            (context, out, error)
        assert "KeyboardInterrupt" in text or "Interrupt" in error["evalue"], (context, text)
    else:  # only a cell that ends by itself may end without the interrupt's error
        assert kind == "short", (context, out)
    return kind, by, took


def test_hundreds_of_where_and_interrupt_sequences_end_every_cell_with_state_kept(
        ring: Ring) -> None:
    """Issue 36's stress: SEQUENCES cells, each with the panel's Where? (half of them) and the
    panel's or the toolbar's Interrupt at a random moment, on the issue's cell, on a training
    loop, or on a cell that ends by itself; every 50th after pdb on the ranks and %debug in the
    kernel. Every cell ends, none blames a rank, and the ranks keep their variables."""
    kernel, rng = ring.kernel, random.Random(36)
    t0 = time.monotonic()
    times = []
    for i in range(SEQUENCES):
        if i % 50 == 10:
            use_debuggers(kernel, i)
        _kind, _by, took = one_sequence(ring, rng)
        times.append(took)
        if i % 30 == 29:
            state_kept(kernel, f"stress{i}")
    state_kept(kernel, "stress_end")
    wall = time.monotonic() - t0
    print(f"FIGURE issue 36 stress: {SEQUENCES} sequences in {wall:.1f} s, cell ends: median "
          f"{sorted(times)[len(times) // 2]:.2f} s, max {max(times):.2f} s, total {sum(times):.1f} s")
