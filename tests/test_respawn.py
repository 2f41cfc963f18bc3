"""A rank replaced in place (issue 34, item 1), at the runtime's level: a real ``mpiexec.gforker``
job whose ranks run under the keeper (``engines._keeper``), a real SIGKILL, a real newcomer job."""

import os
import subprocess
import sys

import pytest

from jupyter_ring.launch import local_mpiexec, mpi_env

MPI_SCRIPTS = os.path.join(os.path.dirname(__file__), "mpi")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not local_mpiexec().endswith("gforker"), reason="needs MPICH's mpiexec.gforker")
@pytest.mark.parametrize("n", [2, 3])
def test_a_killed_rank_is_replaced_and_the_survivors_keep_their_state(n, tmp_path):
    env = mpi_env()
    env.update(PYTHONUNBUFFERED="1", MPIR_CVAR_NO_COLLECTIVE_FINALIZE="1",
               PYTHONPATH=os.pathsep.join([ROOT, MPI_SCRIPTS]))
    cmd = [local_mpiexec(), "-exitinfo", "-n", str(n), sys.executable, "-m", "jupyter_ring.engines._keeper",
           sys.executable, os.path.join(MPI_SCRIPTS, "respawn_world.py"), "1", str(tmp_path / "port")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"respawn on {n} ranks did not finish in 120 s (a hang)\n{exc.stdout}\n{exc.stderr}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # every rank of the new world checked its own results: the survivors and the newcomer
    assert sorted(line.split()[1] for line in proc.stdout.splitlines()
                  if line.startswith("RANK_OK")) == [str(r) for r in range(n)], out
    assert "RANK_OK 1 newcomer" in proc.stdout, out
    assert "jupyter_ring keeper: rank 1 engine" in proc.stderr and "Killed" in proc.stderr, out
    # the survivors were not ended by gforker (its report names no rank but the killed one)
    assert "signaled with Quit" not in out and "signaled with Interrupt" not in out, out


def test_the_keeper_passes_a_normal_exit_status_through():
    code = "import sys; sys.exit(3)"
    proc = subprocess.run([sys.executable, "-m", "jupyter_ring.engines._keeper", sys.executable, "-c", code],
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 3
