"""tests/mpi/batch.py and conftest's ``run_batch``: several scripts in one MPI job, each judged on
its own. A batch must never let a failed script pass, nor hide the scripts that ran after it."""

import pytest


def _scripts(tmp_path, **bodies):
    paths = {}
    for name, body in bodies.items():
        path = tmp_path / f"{name}.py"
        path.write_text("import sys\nfrom mpi4py import MPI\nr = MPI.COMM_WORLD.rank\n" + body)
        paths[name] = str(path)
    return paths


def test_a_failed_check_fails_its_script_only_and_the_next_script_runs(tmp_path, mpibatch_runner):
    s = _scripts(tmp_path,
                 first="print(f'FIRST_OK {r}', flush=True)\n",
                 failing="if r == 1:\n    print('rank 1: 1 failures', flush=True)\n    sys.exit(1)\n",
                 after="print(f'AFTER_OK {r}', flush=True)\nsys.exit(0)\n")
    job = (s["first"], s["failing"], s["after"])
    assert sorted(line.split()[1] for line in mpibatch_runner(job, 2, s["first"]).lines("FIRST_OK")) == ["0", "1"]
    with pytest.raises(pytest.fail.Exception, match=r"failing\.py on 2 ranks.*rank 1 exited 1"):
        mpibatch_runner(job, 2, s["failing"])
    assert len(mpibatch_runner(job, 2, s["after"]).lines("AFTER_OK")) == 2


def test_a_script_that_raises_aborts_the_job_and_fails_every_script_after_it(tmp_path, mpibatch_runner):
    s = _scripts(tmp_path,
                 raising="if r == 0:\n    raise ValueError('boom on rank 0')\nMPI.COMM_WORLD.Barrier()\n",
                 after="print(f'AFTER_OK {r}', flush=True)\n")
    job = (s["raising"], s["after"])
    with pytest.raises(pytest.fail.Exception, match=r"(?s)raising\.py on 2 ranks.*never ended it.*boom on rank 0"):
        mpibatch_runner(job, 2, s["raising"])
    with pytest.raises(pytest.fail.Exception, match=r"after\.py on 2 ranks.*never ended it"):
        mpibatch_runner(job, 2, s["after"])
