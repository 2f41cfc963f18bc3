"""Training progress and metrics reported from each rank, for the notebook's dashboard.

The runtime knows nothing of the notebook: the front end installs a *publisher* on each engine
(a function taking a dict), and the reporter calls it at most ``max_rate`` times a second with a
snapshot of this rank's state. With no publisher (a plain ``mpiexec`` run) reporting only updates
a few local fields, and nothing is printed.
"""

import math
import threading
import time
from collections.abc import Sequence

__all__ = ["Reporter", "progress", "log", "track", "set_publisher", "flush"]


class Reporter:
    """This rank's progress, latest metrics, metric history and communication totals."""

    def __init__(self, max_rate=10.0):
        self.publisher = None
        self.min_interval = 1.0 / max_rate
        self.rank = 0
        self.trace = None       # the runtime's Trace, set by init(): comm figures come from it
        self.reset()

    def reset(self):
        self.step = 0
        self.total = None
        self.desc = None
        self.metrics = {}
        self.pending = []       # (step, wall time, metrics) not yet published
        self.started = time.time()
        self.last_publish = 0.0
        self.dirty = False
        self.stall = None
        self.stall_unsent = False
        self.rate_mark = (time.perf_counter(), 0)
        self.rate = 0.0
        self.comm_mark = (time.perf_counter(), 0.0)
        self.comm_share = 0.0

    # -------------------------------------------------------------- what users call
    def progress(self, step, total=None, desc=None):
        """Set the current step (and optionally the total and a label)."""
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            raise TypeError(f"ring.progress(step=...) takes a number, got {type(step).__name__}")
        if total is not None and (not isinstance(total, (int, float)) or total < 0):
            raise ValueError(f"ring.progress(total=...) must be a non-negative number or None, got {total!r}")
        self.step = step
        if total is not None:
            self.total = total
        if desc is not None:
            self.desc = str(desc)
        self._changed()

    def log(self, step=None, **metrics):
        """Record numeric metrics (loss=..., accuracy=...) at ``step`` (default: current step)."""
        clean = {}
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"ring.log({key}=...) takes a number (or a 0-d tensor), got "
                                f"{type(value).__name__}; log .item() of a tensor") from None
            clean[key] = number if math.isfinite(number) else repr(number)
        if step is not None:
            self.step = step
        self.metrics.update(clean)
        self.pending.append((self.step, time.time(), clean))
        # Nobody listening: keep the newest 10,000 points. Listening, pending holds one throttle
        # interval of points; the bound only guards against a publisher that never gets to run.
        limit = 10000 if self.publisher is None else 1000000
        if len(self.pending) > limit:
            del self.pending[:limit // 2]
        self._changed()

    def track(self, iterable, desc=None, total=None):
        """Yield from ``iterable`` while reporting progress (tqdm-like)."""
        if total is None:
            try:
                total = len(iterable)
            except TypeError:
                total = None
        self.progress(0, total=total, desc=desc)
        for index, item in enumerate(iterable):
            yield item
            self.progress(index + 1)

    # -------------------------------------------------------------- publication
    def _changed(self):
        self.dirty = True
        if self.publisher is not None and time.perf_counter() - self.last_publish >= self.min_interval:
            self.publish()

    def publish(self, final=False):
        """Send a snapshot now (the throttle is the caller's business)."""
        if self.publisher is None:
            self.pending.clear()
            return
        self.last_publish = time.perf_counter()
        snapshot = self.snapshot(final)
        self.pending = []
        self.dirty = False
        self.publisher(snapshot)

    def flush(self):
        """Publish whatever changed since the last snapshot, ignoring the throttle."""
        if self.publisher is not None and (self.dirty or self.pending):
            self.publish()

    def snapshot(self, final=False):
        now = time.perf_counter()
        mark_time, mark_step = self.rate_mark
        if now - mark_time >= 0.5 and isinstance(self.step, (int, float)):
            self.rate = (self.step - mark_step) / (now - mark_time)
            self.rate_mark = (now, self.step)
        comm = {}
        if self.trace is not None:
            comm_time = 0.0
            for kind, total in self.trace.stats().items():
                comm[kind] = {"count": total["count"], "bytes": total["bytes"], "time_s": total["time_s"],
                              "busbw": total["busbw"]}
                comm_time += total["time_s"]
            c_mark_time, c_mark_comm = self.comm_mark
            if now - c_mark_time >= 0.5:
                self.comm_share = max(0.0, min(1.0, (comm_time - c_mark_comm) / (now - c_mark_time)))
                self.comm_mark = (now, comm_time)
        return {
            "rank": self.rank, "step": self.step, "total": self.total, "desc": self.desc,
            "rate": self.rate, "metrics": dict(self.metrics),
            "history": [(step, wall, values) for step, wall, values in self.pending],
            "comm": comm, "comm_share": self.comm_share, "stall": self.stall,
            "elapsed": time.time() - self.started, "time": time.time(), "final": final,
        }

    def stalled(self, what, missing, waited, held: Sequence[int] = ()) -> None:
        """The runtime tells us who waits on what; published at once for the dashboard's banner.

        ``held``: ranks in a debugger, which make the wait no stall (the banner says so).

        The engine's background thread waits too, but a publisher (the kernel's sockets) is the
        main thread's alone: from another thread the state is kept for ``flush_stall``.
        """
        self.stall = {"what": what, "missing": list(missing), "waited": waited, "rank": self.rank,
                      "held": list(held)} if what else None
        if self.publisher is not None:
            if threading.current_thread() is threading.main_thread():
                self.publish()
            else:
                self.stall_unsent = True

    def flush_stall(self):
        """Publish a stall state the background thread recorded (called from the main thread)."""
        self.stall_unsent = False
        if self.publisher is not None:
            self.publish()


reporter = Reporter()


def progress(step, total=None, desc=None):
    """Report this rank's current step (and total, label) to the notebook's dashboard."""
    reporter.progress(step, total, desc)


def log(step=None, **metrics):
    """Report numeric metrics (``ring.log(loss=0.3, accuracy=0.9)``) to the dashboard."""
    reporter.log(step, **metrics)


def track(iterable, desc=None, total=None):
    """Iterate while reporting progress: ``for batch in ring.track(loader, desc="epoch 1")``."""
    return reporter.track(iterable, desc, total)


def set_publisher(publisher, max_rate=10.0):
    """Install (or, with None, remove) the function that receives snapshots, ≤ ``max_rate``/s."""
    reporter.publisher = publisher
    reporter.min_interval = 1.0 / max_rate


def flush():
    """Publish the latest state now (the front end calls it when a cell ends)."""
    reporter.flush()
