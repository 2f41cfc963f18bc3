"""A rank replaced in place (issue 34, item 1), at the runtime's level: a real ``mpiexec.gforker``
job whose ranks run under the keeper (``engines._keeper``), a real SIGKILL, a real newcomer job."""

import os
import re
import subprocess
import sys

import pytest
from bounds import GONE_S

from jupyter_ring.cluster._procs import sweep_mpich_segments
from jupyter_ring.launch import local_mpiexec, mpi_env

MPI_SCRIPTS = os.path.join(os.path.dirname(__file__), "mpi")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not local_mpiexec().endswith("gforker"), reason="needs MPICH's mpiexec.gforker")
@pytest.mark.parametrize("n", [2, 3])
def test_a_killed_rank_is_replaced_and_the_survivors_keep_their_state(n, tmp_path):
    # the environment a one-host cluster's plan gives ranks that may be replaced (_respawn_layer)
    env = mpi_env()
    env.update(PYTHONUNBUFFERED="1", MPIR_CVAR_NO_COLLECTIVE_FINALIZE="1",
               PYTHONPATH=os.pathsep.join([ROOT, MPI_SCRIPTS]))
    cmd = [local_mpiexec(), "-exitinfo", "-n", str(n), sys.executable, "-m", "jupyter_ring.engines._keeper",
           sys.executable, os.path.join(MPI_SCRIPTS, "respawn_world.py"), "1", str(tmp_path / "port")]
    sweep_mpich_segments()  # as run_mpi: a killed job's segment named as this job's breaks it
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"respawn on {n} ranks did not finish in 120 s (a hang)\n{exc.stdout}\n{exc.stderr}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # every rank of the new world checked its own results: the survivors and the newcomer
    # (mpiexec may glue two ranks' lines together: split before each RANK_OK)
    oks = [line.split()[1] for line in re.sub(r"(?=RANK_OK \d)", "\n", proc.stdout).splitlines()
           if line.startswith("RANK_OK")]
    assert sorted(oks) == [str(r) for r in range(n)], out
    assert "RANK_OK 1 newcomer" in proc.stdout, out
    assert "jupyter_ring keeper: rank 1 engine" in proc.stderr and "Killed" in proc.stderr, out
    # the survivors were not ended by gforker (its report names no rank but the killed one)
    assert "signaled with Quit" not in out and "signaled with Interrupt" not in out, out


def test_the_keeper_passes_a_normal_exit_status_through():
    code = "import sys; sys.exit(3)"
    proc = subprocess.run([sys.executable, "-m", "jupyter_ring.engines._keeper", sys.executable, "-c", code],
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 3


def test_the_keepers_line_is_written_whole_in_one_write():
    """The engine's nanny writes its own line to the same stderr as the engine dies: the keeper's
    line and its newline written apart let the nanny's land between them, and the death
    diagnosis read "died (signal: Killed2026-... [KernelNanny.0] Parent ... exited ...)". A
    datagram socket as stderr keeps each write() apart, so the test sees how it was written."""
    import signal
    import socket

    out, err = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    pmi, pmi_peer = socket.socketpair()  # the rank's PMI session, which the keeper finishes
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    with out, err, pmi, pmi_peer:
        proc = subprocess.Popen([sys.executable, "-m", "jupyter_ring.engines._keeper", sys.executable, "-c", code],
                                stderr=err.fileno(), pass_fds=(pmi.fileno(),),
                                env=dict(os.environ, PYTHONPATH=ROOT, PMI_FD=str(pmi.fileno()), PMI_RANK="1"))
        pmi_peer.settimeout(GONE_S)
        assert pmi_peer.recv(256) == b"cmd=finalize\n"
        pmi_peer.sendall(b"cmd=finalize_ack\n")
        assert proc.wait(timeout=GONE_S) == 0
        out.setblocking(False)
        writes = []
        while True:
            try:
                writes.append(out.recv(65536).decode())
            except BlockingIOError:
                break
    pid = int(re.search(r"engine (\d+) ", "".join(writes))[1])
    assert writes == [f"jupyter_ring keeper: rank 1 engine {pid} signaled with "
                      f"{signal.strsignal(signal.SIGKILL)}\n"], writes


def test_death_diagnosis_reads_the_keepers_line_and_skips_engines_replaced_before():
    from jupyter_ring.cluster._death import describe_death

    rows = [{"rank": 0, "host": "h", "pid": 100, "device": "cpu", "local_rank": 0, "size": 2},
            {"rank": 1, "host": "h", "pid": 201, "device": "cpu", "local_rank": 1, "size": 2}]
    # engine 9 was rank 1 before it was replaced by engine 11 (pid 201); then 11 died
    output = ("[KernelNanny.9] Pipe closed, parent 150 has status: None\n"
              "jupyter_ring keeper: rank 1 engine 150 signaled with Killed\n"
              "[KernelNanny.11] Pipe closed, parent 201 has status: None\n"
              "jupyter_ring keeper: rank 0 engine 201 signaled with Segmentation fault\n")
    message = describe_death([1], rows, [10, 11], output, fix="Replaced.")
    assert message == "rank 1 @ h died (signal: Segmentation fault). Replaced."
    assert "%ring restart" in describe_death([1], rows, [10, 11], output)
    # before the keeper's line is written the message cannot say how yet: RingCluster reads the
    # output again for a moment (describe_death's settle) while says_how is False
    from jupyter_ring.cluster._death import says_how

    early = describe_death([1], rows, [10, 11], output.rsplit("jupyter_ring keeper", 1)[0])
    assert "died (engine process exited)" in early and not says_how(early)
    assert not says_how(describe_death([0, 1], rows, [10, 11], ""))  # no nanny line yet
    assert says_how(message)
    # another process's log line glued to the keeper's (seen when the keeper printed in two
    # writes): the signal's name alone is read
    glued = output.replace("Segmentation fault\n", "Segmentation fault2026-11-29 18:58:44.654 "
                           "[KernelNanny.1] Parent 26143 exited with status None.\n")
    assert describe_death([1], rows, [10, 11], glued, fix="Replaced.") == message
    # the keeper's line before any nanny's (the nanny logs the death later under load): it
    # alone names the rank (by its engine's pid) and the signal
    keeper_only = "jupyter_ring keeper: rank 0 engine 201 signaled with Killed\n"
    assert describe_death([1], rows, [10, 11], keeper_only, fix="Replaced.") == \
        "rank 1 @ h died (signal: Killed). Replaced."
    # an earlier engine's keeper line (pid 150, replaced since) names no rank of today's
    assert not says_how(describe_death([1], rows, [10, 11], output.split("[KernelNanny.11]")[0]))


def test_death_diagnosis_names_a_host_that_went_silent_before_an_engine_mpi_ended():
    """Host b died whole (its nannies with it); Hydra then ended rank 1 on a, whose nanny logged
    a plain exit: b's ranks are named first, as the host gone, and a's as what MPI ended (CI
    saw "rank 1 @ a died (engine process exited)" when a's nanny wrote first)."""
    from jupyter_ring.cluster._death import describe_death, says_how

    rows = [{"rank": r, "host": "ab"[r // 2], "pid": 100 + r, "device": "cpu", "local_rank": r % 2,
             "size": 2} for r in range(4)]
    exited = "[KernelNanny.11] Pipe closed, parent 101 has status: None\n"
    message = describe_death([0, 1, 2, 3], rows, [10, 11, 12, 13], exited, fix="Restart.")
    assert message == ("ranks 2, 3 @ b stopped answering (died, or the host is down or cut off "
                       "from this one); MPI then ended rank(s) 0, 1. Restart."), message
    assert says_how(message)
    # a's rank killed by a signal is the first death's story, b's silence notwithstanding
    killed = exited + "jupyter_ring keeper: rank 1 engine 101 signaled with Killed\n"
    assert describe_death([0, 1, 2, 3], rows, [10, 11, 12, 13], killed, fix="Restart.") == \
        "rank 1 @ a died (signal: Killed); MPI then ended rank(s) 0, 2-3. Restart."
    # one rank of b gone, its host-mate alive: no host is gone, the nanny's word stands
    assert describe_death([1, 2], rows, [10, 11, 12, 13], exited, fix="Restart.") == \
        "rank 1 @ a died (engine process exited); MPI then ended rank(s) 2. Restart."


def test_a_replacement_that_fails_says_so_and_stop_leaves_nothing(tmp_path, monkeypatch):
    """The newcomer does not register in time: ClusterError naming the step and %ring restart;
    no second try; every process of the cluster, the newcomers' job too, gone after stop()."""
    import signal
    import time

    import psutil

    from jupyter_ring.cluster import RingCluster
    from jupyter_ring.errors import ClusterError

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    cluster = RingCluster(n=2, gpus="none")
    cluster.start()
    try:
        assert cluster.can_respawn([1])
        os.kill(cluster.ranks[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60  # a precondition, not a promise: room for a loaded host
        while cluster.dead_ranks() != [1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cluster.dead_ranks() == [1]
        cluster.engine_timeout = 0.01  # no engine registers that fast
        with pytest.raises(ClusterError, match=r"did not register in 0.01 s; run %ring restart"):
            cluster.respawn([1])
        assert not cluster.can_respawn([1])
        time.sleep(1.0)  # the newcomers' job is starting meanwhile: stop() must take it too
        pids = [p.pid for p in cluster.processes()]
        assert len(cluster.ipp_cluster.engines) == 2  # the first job and the newcomers'
    finally:
        cluster.stop()
    deadline = time.monotonic() + GONE_S
    left = pids
    while left and time.monotonic() < deadline:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert left == [], [psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]


def test_the_ring_panel_counts_an_engine_not_its_keeper():
    from jupyter_ring.server._clusters import _is_engine

    engine = [sys.executable, "-m", "ipyparallel.engine", "--mpi"]
    assert _is_engine(engine)
    assert not _is_engine([sys.executable, "-m", "jupyter_ring.engines._keeper", *engine])


@pytest.mark.parametrize("device,planned,want", [
    ("cuda:0 (GPU 2)", ("0", "2"), ["2"]),   # the dead rank's own GPU
    ("cpu", ("0", "1"), ["0", "1"]),          # no GPU of its own: what the plan gave every rank
    ("cpu", (), []),                           # --gpus none: hidden
    ("cpu", None, None),                       # no GPU on the machine: left alone
])
def test_a_newcomer_binds_the_dead_ranks_gpu(device, planned, want):
    from jupyter_ring.cluster._respawn import newcomer_gpus

    row = {"rank": 1, "host": "h", "pid": 1, "device": device, "local_rank": 1, "size": 2}
    assert newcomer_gpus(row, planned) == want


def test_the_notes_after_ranks_are_replaced_or_resized_fold_many_ranks_into_ranges():
    """At many ranks the notebook's notes name ranges ("ranks 3-7, 9"), as the cell's error does
    (``errors._rank_list``); two ranks still read "0, 1"."""
    from jupyter_ring.cluster._death import describe_death
    from jupyter_ring.cluster._elastic_resize import ElasticResize
    from jupyter_ring.cluster._respawn import Replacement, elastic_note, replaced_note
    from jupyter_ring.cluster._scale import Scaled, scaled_note

    dead = [3, 4, 5, 6, 7, 9]
    note = replaced_note(Replacement(dead, [], 2.5), 16, 6, 8)
    assert note.startswith("Rank(s) 3-7, 9 replaced in place in 2.5 s (restart 6 of --max-restarts 8)"), note
    assert "rank(s) 0-2, 8, 10-15 kept their variables" in note and "--from 0;" in note, note
    assert elastic_note(Replacement(dead, [], 1.0), 6, 8).startswith("Rank(s) 3-7, 9 replaced"), dead
    assert "rank(s) 0 kept" in replaced_note(Replacement([1], [], 1.0), 2, 1, 3)
    assert "Rank(s) 0, 1 replaced" in replaced_note(Replacement([0, 1], [], 1.0), 3, 2, 3)

    grown = scaled_note(Scaled(4, 13, list(range(4, 13)), [], 3.0, []))
    assert "rank(s) 4-12 are new" in grown and "rank(s) 0-3 kept their variables" in grown, grown
    shrunk = scaled_note(Scaled(13, 5, [], list(range(5, 13)), 1.0, []))
    assert "rank(s) 5-12 stopped, their variables gone; rank(s) 0-4 kept theirs" in shrunk, shrunk

    resize = ElasticResize.__new__(ElasticResize)
    resize.old, resize.n, resize.slots, resize.t0 = 11, 4, 4, 0.0
    resize.added, resize.removed = [], list(range(4, 11))
    assert "rank(s) 4-10 left the world at that commit (their engines are shutting down); training goes on on rank(s) 0-3." \
        in resize.note(), resize.note()

    rows = [{"rank": r, "host": "h", "pid": 100 + r, "device": "cpu", "local_rank": r, "size": 12}
            for r in range(12)]
    first = "jupyter_ring keeper: rank 2 engine 102 signaled with Killed\n"
    message = describe_death([2, 3, 4, 5, 8], rows, list(range(12)), first, fix="Replaced.")
    assert message == "rank 2 @ h died (signal: Killed); MPI then ended rank(s) 3-5, 8. Replaced.", message
    assert describe_death([1, 2, 3, 6], rows, list(range(12)), "", fix="X.") == "ranks 1-3, 6 @ h died. X."
