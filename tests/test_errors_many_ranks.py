"""A cell's failure as 64 ranks report it: ranks that say the same thing share a line, rank lists
read as ranges (issue 33 item 4). Built from ipyparallel's own RemoteError, as the ranks send it."""

import random

import pytest
from ipyparallel.error import RemoteError

from jupyter_ring.errors import CellInterrupted, DistributedError, _rank_list

INTERRUPTED = "a peer rank failed"


def remote(ename, evalue, line=None):
    tb = f"Cell In[3], line {line}\n----> {line} time.sleep(600)\n\n{ename}: {evalue}" if line else ""
    return RemoteError(ename, evalue, tb)


@pytest.mark.parametrize("ranks, text", [
    ([], ""), ([3], "3"), ([0, 1], "0, 1"), (list(range(64)), "0-63"),
    ([0, 1, 2, 3, 4, 5, 7, 9, 10], "0-5, 7, 9-10"), ([63, 0, 62, 61], "0, 61-63"),
])
def test_rank_lists_read_as_ranges_beyond_two_ranks(ranks, text):
    assert _rank_list(ranks) == text


@pytest.mark.parametrize("n", [5, 16, 64, 67])
def test_one_rank_raising_among_many_shows_its_traceback_and_one_line_for_the_rest(n):
    bad = random.Random(n).randrange(n)
    others = [r for r in range(n) if r != bad]
    error = DistributedError(bad, "vm", remote("ValueError", "bad batch", 4),
                             [(r, "vm", remote("KeyboardInterrupt", "")) for r in others],
                             reasons={r: INTERRUPTED for r in others})
    assert str(error) == f"[rank {bad} @ vm] ValueError: bad batch; also ranks {_rank_list(others)}: KeyboardInterrupt"
    lines = error._render_traceback_()
    assert lines[0] == f"[rank {bad} @ vm] ValueError: bad batch"
    tail = lines[lines.index(f"other ranks ({n - 1}), probably as a consequence:") + 1:]
    assert tail == [f"  [ranks {_rank_list(others)} @ vm] KeyboardInterrupt (interrupted: {INTERRUPTED})"]


def test_ranks_that_raised_differently_or_on_other_hosts_keep_lines_of_their_own():
    n = 64
    others = [(r, "a" if r < 32 else "b", remote("KeyboardInterrupt", "")) for r in range(1, n)]
    others[10] = (11, "a", remote("StallError", "waited 2.0 s for rank(s) [0]"))
    error = DistributedError(0, "a", remote("ValueError", "x"), others)
    tail = error._render_traceback_()[-3:]
    assert tail == ["  [ranks 1-10, 12-31 @ a] KeyboardInterrupt",
                    "  [rank 11 @ a] StallError: waited 2.0 s for rank(s) [0]",
                    "  [ranks 32-63 @ b] KeyboardInterrupt"]
    assert str(error).endswith("; also ranks 1-10, 12-63: KeyboardInterrupt, rank 11: StallError")


def test_an_error_every_rank_raised_alike_names_them_as_ranges():
    n = 64
    same = remote("ValueError", "everywhere")
    error = DistributedError(5, "vm", same, [(r, "vm", remote("ValueError", "everywhere"))
                                             for r in range(n) if r != 5])
    assert str(error) == "[ranks 0-63 @ vm] ValueError: everywhere"


def test_an_interrupt_of_many_ranks_says_where_they_stopped_once_per_place():
    n = 64
    errors = {r: remote("KeyboardInterrupt", "", 2) for r in range(n)}
    errors[17] = None  # had finished
    text = str(CellInterrupted("you", errors))
    assert text == ("interrupted by you; every rank stopped: ranks 0-16, 18-63 at line 2: "
                    "time.sleep(600), rank 17 had finished"), text
    text = str(CellInterrupted("you", errors, unstopped=[3, 4, 5, 9]))
    assert text.startswith("interrupted by you; rank(s) 3-5, 9 did not stop: "), text
