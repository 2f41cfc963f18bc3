"""Allreduce algorithms chosen by size and world (issue 33, item 2): the choice, and every
algorithm forced in turn under a real mpiexec with 1 to 4 ranks, exact on every rank."""

import pytest

from jupyter_ring.runtime._engine.algorithm_choice import EAGER_FANOUT_BYTES, RD_MAX_BYTES, choose
from jupyter_ring.runtime._engine.config import Config

KiB = 1 << 10
EAGER = 64 * KiB


def auto(nbytes, ranks, hosts=1, uniform=True, shm=True):
    return choose("auto", nbytes, ranks, hosts, uniform, EAGER, shm, 64 * KiB)


def test_auto_picks_by_size_and_world():
    # small: the payload rides in the agreement while a rank sends little in all
    assert auto(4 * KiB, 2) == auto(4 * KiB, 8) == auto(0, 64) == "eager"
    assert auto(4 * KiB, 128) == "rd"                    # 127 x 4 KiB > the fan-out bound
    assert auto(EAGER, 2) == "eager" and auto(EAGER, 8) == "rd"
    assert auto(EAGER_FANOUT_BYTES // 7 + 1, 8) == "rd"
    # one host with shared-memory slots: above its threshold
    assert auto(EAGER + 1, 8) == auto(64 << 20, 8) == "shm"
    # no slots (several hosts, or switched off): recursive doubling, then the ring or the hierarchy
    assert auto(EAGER + 1, 8, shm=False) == auto(RD_MAX_BYTES, 8, shm=False) == "rd"
    assert auto(RD_MAX_BYTES + 1, 8, shm=False) == "ring"
    assert auto(RD_MAX_BYTES + 1, 16, hosts=8, shm=False) == "hier"
    assert auto(RD_MAX_BYTES + 1, 16, hosts=8, uniform=False, shm=False) == "ring"
    assert auto(RD_MAX_BYTES + 1, 8, hosts=8, shm=False) == "ring"   # one rank a host: nothing to share
    # nothing to move
    assert auto(1 << 30, 1) == "local" and choose("rd", 0, 4, 1, True, EAGER, True, EAGER) == "local"


def test_forced_algorithms_run_where_they_apply():
    for name in ("rd", "ring", "hier"):
        assert choose(name, 4, 4, 1, True, EAGER, True, EAGER) == name
        assert choose(name, 64 << 20, 4, 1, True, EAGER, True, EAGER) == name
        assert choose(name, 4, 1, 1, True, EAGER, True, EAGER) == "local"
    assert choose("shm", 4, 4, 1, True, EAGER, True, EAGER) == "shm"
    assert choose("shm", 4, 4, 2, True, EAGER, False, EAGER) == "eager"     # no slots: auto decides
    assert choose("eager", EAGER, 512, 1, True, EAGER, True, EAGER) == "eager"
    assert choose("eager", EAGER + 1, 4, 1, True, EAGER, True, EAGER) == "shm"  # does not fit: auto


def test_the_setting_is_read_from_the_environment_and_checked(monkeypatch):
    monkeypatch.setenv("JUPYTER_RING_ALLREDUCE", "RD")
    assert Config.from_env().allreduce == "rd"
    monkeypatch.setenv("JUPYTER_RING_ALLREDUCE", "tree")
    with pytest.raises(ValueError, match="allreduce must be one of auto, eager, rd, ring, shm, hier "
                                         r"\(JUPYTER_RING_ALLREDUCE\), got 'tree'"):
        Config.from_env()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_algorithm_forced_in_turn_is_exact_on_every_rank(mpirun, n):
    result = mpirun("rt_algorithms.py", n, timeout=240)
    ok = sorted(int(line.split()[1]) for line in result.lines("RANK_OK"))
    assert ok == list(range(n)), result.stdout[-3000:]


@pytest.mark.parametrize("algorithm", ["rd", "hier"])
@pytest.mark.parametrize("mode", ["stall", "interrupt"])
def test_the_failure_contract_holds_inside_the_new_algorithms(mpirun, mode, algorithm):
    """3 ranks (recursive doubling folds one in): a rank that skips a collective is named in a
    StallError, an interrupt ends every rank's wait; the next collectives are exact."""
    env = {"JUPYTER_RING_ALLREDUCE": algorithm, "JUPYTER_RING_STALL_TIMEOUT": "2"}
    result = mpirun("rt_failures.py", 3, mode, env=env, timeout=120)
    ok = sorted(int(line.split()[1]) for line in result.lines("RANK_OK"))
    assert ok == [0, 1, 2], result.stdout[-3000:]
    assert len(result.lines("STALL" if mode == "stall" else "INTERRUPTED")) == (2 if mode == "stall" else 9)


@pytest.mark.parametrize("algorithm", ["ring", "rd", "hier"])
def test_ranks_that_joined_are_left_out_of_every_algorithm(mpirun, algorithm):
    """3 ranks out of data at different steps (rt_engine.py join), every allreduce forced onto
    one algorithm: the ring indexed its blocks by global rank and raised IndexError once a rank
    had joined (main before issue 33's item 2: reachable on several hosts or with shared memory off)."""
    result = mpirun("rt_engine.py", 3, "join", env={"JUPYTER_RING_ALLREDUCE": algorithm}, timeout=120)
    ok = sorted(int(line.split()[1]) for line in result.lines("RANK_OK"))
    assert ok == [0, 1, 2], result.stdout[-3000:]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_kept_choice_follows_every_change_of_its_inputs(mpirun, n):
    """The eager limit and each size's algorithm are worked out once and kept (issue 32, item 7:
    the small collectives' cost): a setting or a threshold changed while running, a join, a
    process set and shutdown + init each change which algorithm runs, on every rank, exactly."""
    result = mpirun("rt_algorithm_kept.py", n, env={"JUPYTER_RING_STALL_TIMEOUT": "20"}, timeout=120)
    ok = sorted(int(line.split()[1]) for line in result.lines("RANK_OK"))
    assert ok == list(range(n)), result.stdout[-3000:]
