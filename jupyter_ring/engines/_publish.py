"""Engine side of the dashboard's transport: rank snapshots over ipyparallel's datapub channel.

Runs inside each ipyparallel engine (the front end executes :data:`jupyter_ring.widgets.live.
ENGINE_SETUP` once, after ``ring.init()``). ipyparallel merges each engine's published dicts into
the client's ``AsyncResult.data`` with ``dict.update``; snapshots carry *deltas* of the metric
history, so each one goes under a key of its own (``jupyter_ring/<seq>``) and the notebook pops
the keys it has read: none overwrites another between two polls.

What travels is a :class:`Snapshot`: the runtime's reporter (``runtime._observe.report.Reporter.snapshot``)
builds it, this publisher numbers it and sends it, ``widgets._state.DashboardState.ingest`` reads it.

Imports no widget library: only ipyparallel's ``publish_data`` and the runtime's reporter.
"""

from typing import TYPE_CHECKING, Any, Callable, TypedDict

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from ..runtime.internal import Reporter

__all__ = ["KEY_PREFIX", "MAX_RATE", "Snapshot", "CommTotals", "Stall", "Publisher",
           "snapshot_key", "install", "uninstall", "enable"]

KEY_PREFIX = "jupyter_ring/"


class CommTotals(TypedDict):
    """One kind of collective's totals on this rank: over the cell (``Snapshot.comm``) or since
    ``ring.init()``/``ring.reset_stats()`` (``Snapshot.comm_total``)."""

    count: int
    bytes: int
    time_s: float
    busbw: float          # bytes/s, NCCL's bus-bandwidth convention


class Stall(TypedDict):
    """What this rank is stuck waiting for (the dashboard's banner names the missing ranks)."""

    what: str
    missing: list[int]
    waited: float         # seconds
    rank: int
    held: list[int]       # ranks in a debugger: then the wait is no stall (issue 35)


class Snapshot(TypedDict):
    """One rank's state, sent at most MAX_RATE times a second under ``snapshot_key(seq)``."""

    rank: int
    step: int | float
    total: int | float | None
    desc: str | None
    rate: float                                   # steps per second
    metrics: dict[str, float | str]               # latest value of each ring.log() metric
    # points logged since the previous snapshot: (step, wall time, {metric: value})
    history: list[tuple[int | float, float, dict[str, float | str]]]
    comm: dict[str, CommTotals]                   # this cell's, by collective ("allreduce", ...)
    comm_total: dict[str, CommTotals]             # since ring.init() or ring.reset_stats()
    comm_share: float                             # fraction of the last ~0.5 s spent in comm
    stall: Stall | None
    elapsed: float                                # seconds since the cell started
    time: float                                   # wall time of the snapshot
    final: bool                                   # the cell ended: the last word for this cell


def snapshot_key(seq: int) -> str:
    """The datapub key of snapshot number ``seq`` (zero-padded: keys sort in publication order)."""
    return f"{KEY_PREFIX}{seq:010d}"


class Publisher:
    """The reporter's publisher on one engine: numbers snapshots and sends each under its own key.

    Registered for IPython's ``pre_execute``/``post_execute`` events too: when a cell starts the
    reporter forgets the previous cell's steps, total, label, metrics and collectives (each
    cell's dashboard shows its own); when a cell that reported anything ends, the latest state
    is published at once, marked ``final``.
    """

    def __init__(self, send: Callable[[dict[str, Snapshot]], object], reporter: "Reporter") -> None:
        self.send = send            # ipyparallel.datapub.publish_data, or a stand-in in tests
        self.reporter = reporter
        self.seq = 0
        self.enabled = True
        self.sent_in_cell = False

    def __call__(self, snapshot: dict[str, Any]) -> None:
        """Send ``snapshot`` (a :class:`Snapshot`, built by the runtime's reporter, which types it
        as a plain dict) under the next key; nothing while paused (:func:`enable`)."""
        if not self.enabled:
            return
        self.seq += 1
        self.sent_in_cell = True
        self.send({snapshot_key(self.seq): snapshot})  # type: ignore[dict-item]  # the reporter's dict is a Snapshot

    def pre_execute(self) -> None:
        """A cell starts: the reporter forgets the previous cell's state (if this publishes)."""
        self.sent_in_cell = False
        reporter = self.reporter
        if reporter.publisher is self:
            reporter.new_cell()

    def post_execute(self) -> None:
        """A cell ended: publish its latest state at once, marked final (if it reported any)."""
        reporter = self.reporter
        if reporter.publisher is not self or not self.enabled:
            return
        if self.sent_in_cell or reporter.dirty or reporter.pending:
            # the parent header is still the cell's: this reaches the cell's AsyncResult.data
            reporter.publish(final=True)


# Snapshots per second per rank. Each one costs Python time in three processes besides the
# rank's: ipyparallel's controller relays it, the notebook kernel's client thread unpacks it and
# the dashboard ingests it. 5/s keeps that near 1 % of one core for 2 ranks (docs/benchmarks.md)
# while the notebook still sees a ring.log within ~0.2 s (p95).
MAX_RATE = 5.0


def install(max_rate: float = MAX_RATE, shell: "InteractiveShell | None" = None) -> Publisher:
    """Install a :class:`Publisher` on this engine (replacing an earlier one); returns it."""
    from ipyparallel.datapub import publish_data

    from ..runtime.internal import report as _report

    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    uninstall(shell)
    # points logged while nobody listened belong to no cell's dashboard: do not send them now
    _report.reporter.pending.clear()
    publisher = Publisher(publish_data, _report.reporter)
    _report.set_publisher(publisher, max_rate)
    if shell is not None:
        shell.events.register("pre_execute", publisher.pre_execute)
        shell.events.register("post_execute", publisher.post_execute)
    return publisher


def uninstall(shell: "InteractiveShell | None" = None) -> None:
    """Remove this module's publisher (and its cell events) from this engine, if installed."""
    from ..runtime.internal import report as _report

    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    old = _report.reporter.publisher
    if not isinstance(old, Publisher):
        return
    _report.set_publisher(None)
    if shell is not None:
        for event, callback in (("pre_execute", old.pre_execute), ("post_execute", old.post_execute)):
            try:
                shell.events.unregister(event, callback)
            except ValueError:
                pass


def enable(on: bool = True) -> bool:
    """Pause (False) or resume publishing on this engine; the reporter keeps counting."""
    from ..runtime.internal import report as _report

    publisher = _report.reporter.publisher
    if isinstance(publisher, Publisher):
        publisher.enabled = bool(on)
    return isinstance(publisher, Publisher)
