"""What the runtime shows of itself: the trace, the reporter, where a rank is, a held debugger.

- ``trace``: per-collective records, aggregate statistics, Chrome-trace export;
- ``report``: progress, metrics and steps, handed to the notebook's publisher as snapshots;
- ``where``: the collective in progress and the ranks it waits on (a shared record), every
  thread's stack on a signal (read by ``%ring where``);
- ``debugger``: the mark of a rank held in a debugger, and the records its prompt travels in.

The bottom of the runtime: imports the standard library (and ``trace`` from ``report``) only, so
the engine and the kernel's side (``jupyter_ring.cluster._where``, ``jupyter_ring._debug``, which
read the records) may import it.
"""
