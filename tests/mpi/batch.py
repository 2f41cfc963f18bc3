"""Several scripts of this folder, one after another, in one MPI job: ``tests/conftest.py``'s
``mpibatch`` runs them so that each rank imports torch once for all of them (1.4-3 CPU-s a rank
and script on a 2-core host: issue 32's suite time), not once a script.

    mpiexec -n N python batch.py SCRIPT [SCRIPT ...]

Each script runs as ``__main__`` in a namespace of its own, with ``sys.argv`` its own, after
every rank ended the one before (a barrier) and the runtime was shut down, so its own ``init()``
starts the runtime anew. After each, every rank prints ``BATCH_END <script> <rank> <exit
status>``: a script that ends with ``sys.exit(1)`` (the scripts' way to report failed checks, on
each rank after its collectives) lets the next one run. A script that raises on a rank cannot
let the next one run (its peers may be inside a collective it left): that rank prints
``BATCH_RAISED <script> <rank>`` with its traceback and the job is aborted, so the scripts after it
have no ``BATCH_END`` and their tests fail naming it.
"""

import os
import runpy
import sys
import time
import traceback

from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))


def _barrier(comm: MPI.Comm, script: str, bound: float = 120.0) -> None:
    """Every rank done with ``script``, or the job aborted after ``bound`` seconds (a rank that
    never came: the test's own timeout would end it later and say less)."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + bound
    while not request.Test():
        if time.monotonic() > deadline:
            print(f"BATCH_RAISED {script} {comm.rank}\nno barrier after {script} in {bound:.0f} s: a rank "
                  "never ended it", flush=True)
            comm.Abort(4)
        time.sleep(0.005)


def main() -> None:
    import jupyter_ring.runtime as ring

    comm = MPI.COMM_WORLD
    status = 0
    for script in sys.argv[1:]:
        path = os.path.join(HERE, script)
        sys.argv = [path]
        code = 0
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported, then the whole job ends
            print(f"BATCH_RAISED {script} {comm.rank}\n{traceback.format_exc()}", flush=True)
            sys.stderr.flush()
            comm.Abort(3)
        ring.shutdown()
        _barrier(comm, script)
        print(f"BATCH_END {script} {comm.rank} {code}", flush=True)
        status = status or code
    sys.exit(status)


if __name__ == "__main__":
    main()
