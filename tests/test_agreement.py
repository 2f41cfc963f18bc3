"""The agreement relayed in log2(n) steps (issue 33, item 2): Bruck's schedule, the setting, and
the relayed agreement forced at small worlds under a real mpiexec (1 to 8 ranks): every
collective exact, mismatches, poison, interrupts, stalls and joins as with the direct one."""

import pytest

from jupyter_ring.runtime._engine.algorithm_choice import LOG_AGREEMENT_RANKS, agreement
from jupyter_ring.runtime._engine.config import Config
from jupyter_ring.runtime._engine.log_agreement import bruck_steps

LOG = {"JUPYTER_RING_AGREEMENT": "log"}


def all_ranks_ok(result, n):
    ok = sorted(int(line.split()[1]) for line in result.lines("RANK_OK"))
    assert ok == list(range(n)), result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.parametrize("size", list(range(1, 18)) + [31, 64, 100])
def test_bruck_steps_give_every_rank_every_row_in_ceil_log2_steps(size):
    """Run the schedule on plain lists: after the steps, rank r's row i is rank (r+i) % size's."""
    tables = {r: [r] for r in range(size)}
    schedules = {r: bruck_steps(r, size) for r in range(size)}
    assert all(len(s) == (size - 1).bit_length() for s in schedules.values())
    for step in range(len(schedules[0])):
        sent = {}
        for r in range(size):
            to, _src, count = schedules[r][step]
            assert len(tables[r]) >= count  # a rank sends only rows it holds
            sent[(r, to)] = tables[r][:count]
        for r in range(size):
            _to, src, count = schedules[r][step]
            assert schedules[src][step][0] == r  # the sender's 'to' is this rank: the messages pair up
            tables[r] = tables[r] + sent[(src, r)]
    for r in range(size):
        assert tables[r] == [(r + i) % size for i in range(size)]


def test_the_setting_is_read_checked_and_auto_keeps_small_worlds_direct(monkeypatch):
    monkeypatch.setenv("JUPYTER_RING_AGREEMENT", "LOG")
    assert Config.from_env().agreement == "log"
    monkeypatch.setenv("JUPYTER_RING_AGREEMENT", "tree")
    with pytest.raises(ValueError, match=r"agreement must be one of auto, all, log \(JUPYTER_RING_AGREEMENT\), got 'tree'"):
        Config.from_env()
    assert agreement("log", 2) == "log" and agreement("all", 512) == "all"
    assert agreement("log", 1) == agreement("auto", 1) == "all"  # nobody to tell
    assert agreement("auto", 2) == agreement("auto", LOG_AGREEMENT_RANKS - 1) == "all"
    assert agreement("auto", LOG_AGREEMENT_RANKS) == "log"


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_relayed_agreement_every_collective_mismatch_and_poison_on_every_rank(mpirun, n):
    result = mpirun("rt_agreement.py", n, env={**LOG, "JUPYTER_RING_STALL_TIMEOUT": "30"}, timeout=240)
    all_ranks_ok(result, n)


@pytest.mark.parametrize("n", [3, 4])
def test_relayed_agreement_interrupts_then_exact_collectives(mpirun, n):
    result = mpirun("rt_failures.py", n, "interrupt", env=LOG, timeout=120)
    all_ranks_ok(result, n)
    assert len(result.lines("INTERRUPTED")) == 3 * n


@pytest.mark.parametrize("n", [3, 5])
def test_relayed_agreement_names_the_rank_that_skipped_a_collective(mpirun, n):
    """A waiting rank knows only that its partner's rows are missing: the presence notes of a
    long wait name the rank that never arrived (rank 0), not the partners waiting on it."""
    result = mpirun("rt_failures.py", n, "stall", env={**LOG, "JUPYTER_RING_STALL_TIMEOUT": "2"}, timeout=90)
    all_ranks_ok(result, n)
    assert len(result.lines("STALL")) == n - 1


@pytest.mark.parametrize("n", [3, 5])
def test_relayed_agreement_joins_with_ranks_out_of_data_at_different_steps(mpirun, n):
    all_ranks_ok(mpirun("rt_engine.py", n, "join", env=LOG, timeout=180), n)


def test_relayed_agreement_in_process_sets_with_failures_named_by_global_rank(mpirun):
    """Process sets run their own relayed agreement; a bad root on every member poisons alike."""
    all_ranks_ok(mpirun("rt_engine.py", 3, "sets", env={**LOG, "JUPYTER_RING_STALL_TIMEOUT": "2"}, timeout=120), 3)


def test_relayed_agreement_resyncs_after_abandoned_rounds_and_async_failures(mpirun):
    """rt_engine's async mode: background interrupts and stalls, and resyncs in a row announced
    by a rank whose peers are still finishing the collective before (``Recovery.must_restart``)."""
    result = mpirun("rt_engine.py", 4, "async", env={**LOG, "JUPYTER_RING_STALL_TIMEOUT": "2"}, timeout=150)
    all_ranks_ok(result, 4)
    assert len(result.lines("STALL")) == 3


@pytest.mark.parametrize("env", [LOG, {"JUPYTER_RING_ALLREDUCE": "rd"}], ids=["log", "rd"])
def test_a_resync_announced_after_a_collective_its_peers_still_finish_restarts_nothing(mpirun, env):
    """A rank completes a collective and announces a resync at its next one while a peer still
    waits for the last messages of the first (the relay's later steps, recursive doubling's):
    the peer completes it (``Recovery.must_restart``) instead of running it again alone on the
    fresh communicator, where the others run the next one (a mismatch, then a stall)."""
    all_ranks_ok(mpirun("rt_agreement.py", 4, "resyncs", env={**env, "JUPYTER_RING_STALL_TIMEOUT": "5"}, timeout=120), 4)
