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
from typing import Any, Callable, Iterable, Iterator, TypeVar

from .trace import Trace, busbw_factor

__all__ = ["Reporter", "progress", "log", "track", "set_publisher", "flush"]

_T = TypeVar("_T")

# What the front end installs on each engine: it receives this rank's snapshot (Reporter.snapshot).
Publisher = Callable[[dict[str, Any]], object]


class Reporter:
    """This rank's progress, latest metrics, metric history and communication totals."""

    def __init__(self, max_rate: float = 10.0) -> None:
        self.publisher: Publisher | None = None
        self.min_interval = 1.0 / max_rate
        self.rank = 0
        self.trace: Trace | None = None  # the runtime's Trace, set by init(): comm figures come from it
        self.reset()

    def reset(self) -> None:
        """Forget this rank's progress, metrics and stall: a new cell (or a new run) starts."""
        self.step: int | float = 0
        self.total: int | float | None = None
        self.desc: str | None = None
        self.metrics: dict[str, float | str] = {}
        # (step, wall time, metrics) not yet published
        self.pending: list[tuple[int | float, float, dict[str, float | str]]] = []
        self.started = time.time()
        self.last_publish = 0.0
        self.dirty = False
        self.stall: dict[str, Any] | None = None
        self.stall_unsent = False
        self.rate_mark: tuple[float, int | float] = (time.perf_counter(), 0)
        self.rate = 0.0
        self.comm_mark = (time.perf_counter(), 0.0)
        self.comm_share = 0.0
        # work reported since the reset: a step made, a metric logged or a stall. Only then do
        # snapshots go out while the cell runs (a cell that only sets a total, or only runs
        # collectives, shows no dashboard)
        self.active = False
        # inside ring.track's loop body: the number (from 1) of the step the body computes, and
        # the completed step it starts from (a point logged there belongs to the step computed)
        self.in_step: tuple[int, int] | None = None
        # the trace's totals when the cell started: a snapshot's ``comm`` is the cell's own
        self.comm_base = self._comm_totals()

    def new_cell(self) -> None:
        """A cell starts (the notebook engines' publisher calls it): its dashboard shows its own
        steps, metrics and collectives only, none of an earlier cell's."""
        self.reset()

    # -------------------------------------------------------------- what users call
    def progress(self, step: int | float, total: int | float | None = None, desc: str | None = None) -> None:
        """Set the current step (and optionally the total and a label)."""
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            raise TypeError(f"ring.progress(step=...) takes a number, got {type(step).__name__}")
        if total is not None and (not isinstance(total, (int, float)) or total < 0):
            raise ValueError(f"ring.progress(total=...) must be a non-negative number or None, got {total!r}")
        if step != 0:  # a step made (0 only sets the total or the label)
            self.active = True
        self.step = step
        if total is not None:
            self.total = total
        if desc is not None:
            self.desc = str(desc)
        self._changed()

    def log(self, step: int | float | None = None, **metrics: Any) -> None:
        """Record numeric metrics (loss=..., accuracy=...) at ``step``.

        By default at the step being computed: inside ``ring.track``'s loop body the iteration's
        number counted from 1 (whether or not an optimizer counted the step already), elsewhere
        the steps reported so far."""
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
            at = step
        else:
            at = self._logged_step()
        self.active = True
        self.metrics.update(clean)
        self.pending.append((at, time.time(), clean))
        # Nobody listening: keep the newest 10,000 points. Listening, pending holds one throttle
        # interval of points; the bound only guards against a publisher that never gets to run.
        limit = 10000 if self.publisher is None else 1000000
        if len(self.pending) > limit:
            del self.pending[:limit // 2]
        self._changed()

    def _logged_step(self) -> int | float:
        """The step a point logged now belongs to: in ``track``'s body the step it computes, as
        long as nothing but an optimizer (one step ahead) reported progress meanwhile."""
        if self.in_step is not None:
            computing, start = self.in_step
            if self.step in (start, computing):
                return computing
            self.in_step = None
        return self.step

    def track(self, iterable: Iterable[_T], desc: str | None = None,
              total: int | float | None = None) -> Iterator[_T]:
        """Yield from ``iterable`` while reporting progress (tqdm-like).

        Steps count from 1: the body of the first iteration computes step 1, and a point it logs
        (``ring.log(loss=...)``) is charted at step 1, wherever in the body it is logged."""
        if total is None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.progress(0, total=total, desc=desc)
        for index, item in enumerate(iterable):
            self.in_step = (index + 1, index)
            yield item
            self.progress(index + 1)
        self.in_step = None

    # -------------------------------------------------------------- publication
    def _changed(self) -> None:
        self.dirty = True
        if (self.active and self.publisher is not None
                and time.perf_counter() - self.last_publish >= self.min_interval):
            self.publish()

    def publish(self, final: bool = False) -> None:
        """Send a snapshot now (the throttle is the caller's business)."""
        if self.publisher is None:
            self.pending.clear()
            return
        self.last_publish = time.perf_counter()
        snapshot = self.snapshot(final)
        self.pending = []
        self.dirty = False
        self.publisher(snapshot)

    def flush(self) -> None:
        """Publish whatever changed since the last snapshot, ignoring the throttle (once this
        cell reported work)."""
        if self.active and self.publisher is not None and (self.dirty or self.pending):
            self.publish()

    def _comm_totals(self) -> dict[str, dict[str, float]]:
        """The trace's totals per collective kind (count, bytes, time_s), since ``ring.init()``
        or ``ring.reset_stats()``; {} before ``init``."""
        trace = getattr(self, "trace", None)
        if trace is None:
            return {}
        return {kind: {"count": t["count"], "bytes": t["bytes"], "time_s": t["time_s"], "busbw": t["busbw"]}
                for kind, t in trace.stats().items()}

    def _cell_comm(self, totals: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """``totals`` less the cell's starting point: this cell's own collectives. A total below
        its starting point was reset (``ring.reset_stats()``): counted from the reset on."""
        size = getattr(self.trace, "size", 1)
        out = {}
        for kind, total in totals.items():
            base = self.comm_base.get(kind)
            if base is not None and all(total[k] >= base[k] for k in ("count", "bytes", "time_s")):
                count, nbytes = total["count"] - base["count"], total["bytes"] - base["bytes"]
                seconds = total["time_s"] - base["time_s"]
            else:
                count, nbytes, seconds = total["count"], total["bytes"], total["time_s"]
            if count <= 0:
                continue
            algbw = nbytes / seconds if seconds > 0 else 0.0
            out[kind] = {"count": count, "bytes": nbytes, "time_s": seconds,
                         "busbw": algbw * busbw_factor(kind, size)}
        return out

    def snapshot(self, final: bool = False) -> dict[str, Any]:
        now = time.perf_counter()
        mark_time, mark_step = self.rate_mark
        if now - mark_time >= 0.5 and isinstance(self.step, (int, float)):
            self.rate = (self.step - mark_step) / (now - mark_time)
            self.rate_mark = (now, self.step)
        totals = self._comm_totals()
        comm = self._cell_comm(totals)
        if self.trace is not None:
            comm_time = sum(total["time_s"] for total in totals.values())
            c_mark_time, c_mark_comm = self.comm_mark
            if now - c_mark_time >= 0.5:
                self.comm_share = max(0.0, min(1.0, (comm_time - c_mark_comm) / (now - c_mark_time)))
                self.comm_mark = (now, comm_time)
        return {
            "rank": self.rank, "step": self.step, "total": self.total, "desc": self.desc,
            "rate": self.rate, "metrics": dict(self.metrics),
            "history": [(step, wall, values) for step, wall, values in self.pending],
            "comm": comm, "comm_total": totals, "comm_share": self.comm_share, "stall": self.stall,
            "elapsed": time.time() - self.started, "time": time.time(), "final": final,
        }

    def stalled(self, what: str | None, missing: Iterable[int], waited: float,
                held: Sequence[int] = ()) -> None:
        """The runtime tells us who waits on what; published at once for the dashboard's banner.

        ``held``: ranks in a debugger, which make the wait no stall (the banner says so).

        The engine's background thread waits too, but a publisher (the kernel's sockets) is the
        main thread's alone: from another thread the state is kept for ``flush_stall``.
        """
        self.stall = {"what": what, "missing": list(missing), "waited": waited, "rank": self.rank,
                      "held": list(held)} if what else None
        if what:
            self.active = True
        if self.publisher is not None:
            if threading.current_thread() is threading.main_thread():
                self.publish()
            else:
                self.stall_unsent = True

    def flush_stall(self) -> None:
        """Publish a stall state the background thread recorded (called from the main thread)."""
        self.stall_unsent = False
        if self.publisher is not None:
            self.publish()


reporter = Reporter()


def progress(step: int | float, total: int | float | None = None, desc: str | None = None) -> None:
    """Report this rank's current step (and total, label) to the notebook's dashboard."""
    reporter.progress(step, total, desc)


def log(step: int | float | None = None, **metrics: Any) -> None:
    """Report numeric metrics (``ring.log(loss=0.3, accuracy=0.9)``) to the dashboard."""
    reporter.log(step, **metrics)


def track(iterable: Iterable[_T], desc: str | None = None, total: int | float | None = None) -> Iterator[_T]:
    """Iterate while reporting progress: ``for batch in ring.track(loader, desc="epoch 1")``."""
    return reporter.track(iterable, desc, total)


def set_publisher(publisher: Publisher | None, max_rate: float = 10.0) -> None:
    """Install (or, with None, remove) the function that receives snapshots, ≤ ``max_rate``/s."""
    reporter.publisher = publisher
    reporter.min_interval = 1.0 / max_rate


def flush() -> None:
    """Publish the latest state now (the front end calls it when a cell ends)."""
    reporter.flush()
