"""A rank's keeper: the process ``mpiexec.gforker`` starts for a rank when ranks may be replaced.

Run as ``python -m jupyter_ring.engines._keeper COMMAND...``: it starts COMMAND (the engine) as
its child, with the rank's PMI socket, forwards SIGINT/SIGTERM/SIGQUIT to it and exits with its
status. When the engine is killed by a signal (SIGKILL, a segfault), the keeper instead
finishes the rank's PMI session for it (``cmd=finalize``) and exits 0: gforker ends every
other rank of the job when one exits abnormally (its ``OnAbend``), and a rank that exits having
finalized is a normal exit. The survivors keep running and re-form their world
(``engines._respawn``); how the engine ended is written to stderr, one line
(``KEEPER_LINE``), for the death diagnosis.

Imports only the standard library: it is the first thing of every rank to start.
"""

import os
import signal
import subprocess
import sys

__all__ = ["KEEPER_LINE", "main"]

# "jupyter_ring keeper: rank 1 engine 4242 signaled with Killed"; read by cluster._death
KEEPER_LINE = "jupyter_ring keeper: rank {rank} engine {pid} signaled with {how}"


def main(argv: list[str]) -> int:
    """Run ``argv`` as the rank's engine; return the keeper's exit status (see the module)."""
    if not argv:
        print("usage: python -m jupyter_ring.engines._keeper COMMAND [ARG...]", file=sys.stderr)
        return 2
    pmi_fd = int(os.environ.get("PMI_FD", "-1"))
    child = subprocess.Popen(argv, pass_fds=(pmi_fd,) if pmi_fd >= 0 else ())
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    status = child.wait()
    if status >= 0 or pmi_fd < 0:
        return status
    try:
        how = signal.Signals(-status).name
    except ValueError:
        how = str(-status)
    line = KEEPER_LINE.format(rank=os.environ.get("PMI_RANK", "?"), pid=child.pid,
                              how=signal.strsignal(-status) or how)
    # one write(), newline included: print() writes the line and its end apart (stderr is
    # write-through), and the engine's nanny, writing to the same stderr as it dies, then put
    # its own line between them, into the signal's name that the death diagnosis reads
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode(errors="backslashreplace"))
    try:  # the rank's PMI session, finished for it: gforker then sees a normal exit
        os.write(pmi_fd, b"cmd=finalize\n")
        os.read(pmi_fd, 256)  # cmd=finalize_ack
    except OSError:
        return 128 - status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
