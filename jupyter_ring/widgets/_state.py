"""The dashboard's state: every rank's latest snapshot and metric history, in pure Python.

Snapshots come from ``jupyter_ring.runtime._observe.report.Reporter.snapshot()`` on each rank (through
whatever transport the front end uses). Their ``history`` holds only the points logged since the
previous snapshot, so every snapshot must be ingested once; ingesting one twice, or out of order,
does no harm: points are de-duplicated and kept in time order, and an older snapshot never
overwrites a newer one's latest values.

Rates and the share of time in collectives are the state's own figures, measured over a sliding
window of the snapshots' (time, step, comm time) on each rank's clock, never a single snapshot's
(a snapshot's figure covers a different instant on each rank: lockstep ranks would look unequal).
None of them is shown until the window spans ``min_span`` seconds.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

__all__ = ["DashboardState", "RankState", "downsample", "ENDINGS", "reports_work"]

# How a cell ended on a rank (``DashboardState.freeze(outcomes=...)``), as its row says it.
ENDINGS = {"done": "done", "interrupted": "interrupted", "stalled": "stalled", "failed": "failed",
           "died": "died", "no reply": "no reply", "left": "left the world"}

# A rank's snapshot (``Reporter.snapshot()``, through the front end's transport): JSON values of
# every kind, hence Any.
Snapshot: TypeAlias = "Mapping[str, Any]"
# A chart point: (step, value)
Point: TypeAlias = "tuple[float, float]"

# Points kept per rank and metric before the oldest half is thinned to every other point.
_MAX_POINTS = 20000

# The chart's y-axis is logarithmic by default when max > _LOG_RATIO * min (all values > 0).
_LOG_RATIO = 10 ** 1.5


def reports_work(snapshot: Mapping[str, Any]) -> bool:
    """Whether a rank's snapshot reports work: a step (not 0), a logged metric, or a stall. A
    cell none of whose ranks reports work gets no dashboard (a total alone is no training)."""
    step = snapshot.get("step")
    return bool(snapshot.get("history") or snapshot.get("metrics") or snapshot.get("stall")
                or (isinstance(step, (int, float)) and step != 0))


class _Sample(NamedTuple):
    """One newer snapshot of a rank, as the rate and share windows use it."""

    time: float       # the rank's wall time of the snapshot
    advanced: float   # steps advanced since the rank's first snapshot (restarted counts included)
    comm: float       # seconds spent in collectives since the rank's first snapshot


class RankState:
    """What the dashboard knows about one rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seen = False          # any snapshot ingested
        self.seq: int | None = None  # highest snapshot sequence number ingested (None: unknown)
        self.seqs: set[int] = set()  # every sequence number ingested
        self.snap_time = -math.inf  # the newest snapshot's rank-side wall time
        self.step: Any = 0         # as the rank reported it (a number; anything a user passed)
        self.total: Any = None
        self.desc: Any = None
        self.rate: float | None = None  # steps/s over the window (None: not measured yet)
        self.metrics: dict[str, Any] = {}
        self.comm: dict[str, Any] = {}        # the cell's collectives, by kind
        self.comm_total: dict[str, Any] = {}  # since ring.init() or ring.reset_stats(), by kind
        self.ended: str | None = None  # once frozen: how the cell ended on this rank (ENDINGS)
        self.comm_share: float | None = None  # share of wall time in collectives over the window (None: idem)
        self.slow_since: float | None = None  # local time since which the rate stayed below the stragglers' bar
        self.samples: collections.deque[_Sample] = collections.deque()  # the window's snapshots (+1 before it)
        self.first_sample: _Sample | None = None  # the first showing work: the cell's figures start there
        self._previous: _Sample | None = None  # the newest _Sample (in the window or not)
        self._idle: _Sample | None = None      # the last _Sample before any work was seen
        self._last: tuple[float, float] = (0.0, 0.0)  # (step, comm seconds) of the newest snapshot, as reported
        self.stall: Any = None
        self.elapsed = 0.0
        self.final = False
        self.received: float | None = None  # local wall time of the last ingest
        # metric -> sorted list of (wall time, step, value); _keys mirrors it for de-duplication
        self.history: dict[str, list[tuple[float, float, float]]] = {}
        self._keys: dict[str, set[tuple[float, float, float]]] = {}
        self._charts: dict[str, _ChartBuffer | None] = {}  # metric -> its buffer (None: rebuild from history)
        # a new engine took this rank during the cell (issue 34): the step the row showed each
        # time one replaced a dead engine (None: no report before), or it joined the world then
        self.replaced_at: list[Any] = []
        self.replaced_after = False  # the cell failed here (the rank died), then it was replaced
        self.joined = False

    @property
    def fraction(self) -> float | None:
        """Progress in [0, 1], or None without a total."""
        if not self.total:
            return None
        return float(max(0.0, min(1.0, self.step / self.total)))

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate (0 when done, None when unknown)."""
        if self.total is None:
            return None
        left = self.total - self.step
        if left <= 0:
            return 0.0
        if not self.rate or self.rate <= 0:
            return None
        return float(left / self.rate)

    @property
    def done(self) -> bool:
        """Finished: the cell ended well on this rank, or the step reached the total (a rank
        the cell's end found interrupted, stalled or failed is not done)."""
        if self.ended is not None:
            return self.ended == "done"
        return self.final or self.reached_total

    @property
    def reached_total(self) -> bool:
        """The step reached a (positive) total."""
        return (isinstance(self.total, (int, float)) and self.total > 0
                and isinstance(self.step, (int, float)) and self.step >= self.total)

    @property
    def stopped(self) -> bool:
        """The cell ended on this rank without it finishing well: interrupted, stalled, failed,
        dead, or no reply."""
        return self.ended is not None and self.ended != "done"

    @property
    def stopped_as(self) -> str:
        """What a stopped rank's row says of its end (``ENDINGS``); only for a stopped rank."""
        return ENDINGS[self.ended or ""]

    @property
    def bar_fraction(self) -> float:
        """How full the progress bar is: the step's share of the total; without a total, full
        when done and empty otherwise (a stopped rank never shows a full bar it did not earn)."""
        if self.fraction is not None:
            return self.fraction
        return 1.0 if self.done else 0.0

    @property
    def change(self) -> str:
        """What the row says of new engines that took this rank in this cell: "replaced at step
        12", "replaced 2×, last at step 20", "replaced in place" (after it died, for the next
        cell), "joined during the cell"; "" for none."""
        if self.replaced_at:
            at = self.replaced_at[-1]
            where = "" if at is None else f"at step {_num(at)}"
            if len(self.replaced_at) == 1:
                return f"replaced {where}".rstrip()
            return f"replaced {len(self.replaced_at)}\u00d7" + (f", last {where}" if where else "")
        if self.replaced_after:
            return "replaced in place"
        return "joined during the cell" if self.joined else ""

    def new_engine(self) -> None:
        """A new engine reports for this rank from now on (a replacement, or a rank that left the
        world and joins again): its snapshots are numbered from 1 and its step counts from where
        it starts, so what told the old engine's snapshots apart, and the rate window, start
        again. The row keeps what it shows (step, metrics, chart) until the new engine reports."""
        self.seq = None
        self.seqs = set()
        self.snap_time = -math.inf
        self.samples = collections.deque()
        self.first_sample = self._previous = self._idle = None
        self._last = (0.0, 0.0)
        self.rate = self.comm_share = None
        self.slow_since = None
        self.stall = None
        self.final = False

    @property
    def reported_work(self) -> bool:
        """This cell made the rank report work: a step, a logged metric, or a stall (see
        :func:`reports_work`)."""
        return bool(self.history) or reports_work({"step": self.step, "metrics": self.metrics,
                                                   "stall": self.stall})

    def add_sample(self, snapshot: Snapshot, window: float, min_span: float) -> None:
        """Take the newest snapshot's time, step and comm time into the window; re-measure.

        Steps and comm seconds are accumulated as deltas, so a count that restarts (a new
        ``ring.track`` epoch, ``ring.reset_stats()``) continues from there instead of going back.
        The window opens at the first snapshot that shows work done (a step, or time in a
        collective): the time a cell spends before its first step (loading data, building a
        model) is setup, and would drag its first rates down to nothing.
        """
        step = snapshot.get("step")
        comm = sum(float(kind.get("time_s") or 0.0) for kind in (snapshot.get("comm") or {}).values()
                   if isinstance(kind, dict))
        when = snapshot.get("time")
        if not isinstance(when, (int, float)) or not isinstance(step, (int, float)):
            return
        previous = self._previous
        if previous is None:
            advanced = spent = 0.0
        else:
            if when < previous.time:
                return  # a rank's clock stepped back: keep the window as it was
            last_step, last_comm = self._last
            if step >= last_step:
                advanced = previous.advanced + step - last_step
            else:  # the count restarted: it went on to its total (if it has one), then from 0
                total = snapshot.get("total")
                rest = total - last_step if isinstance(total, (int, float)) and total >= last_step else 0
                advanced = previous.advanced + rest + step
            spent = previous.comm + (comm - last_comm if comm >= last_comm else comm)
        self._last = (step, comm)
        sample = _Sample(float(when), float(advanced), float(spent))
        if self.first_sample is None:
            if advanced <= 0 and spent <= 0:
                self._previous = self._idle = sample
                return  # no work seen yet
            self.first_sample = sample
        self._previous = sample
        samples = self.samples
        samples.append(sample)
        # invariant: samples[0] is the last sample at or before the window's start
        while len(samples) > 2 and samples[1].time <= sample.time - window:
            samples.popleft()
        self.rate, self.comm_share = _measure(samples[0], sample, min_span)

    def measure_whole(self, min_span: float) -> None:
        """Rate and comm share from the rank's first work seen to its last snapshot (the cell's
        figures); a cell whose work fits in less than ``min_span`` between two snapshots is
        measured from the snapshot before its work.

        The rate comes from the logged points instead where they cover the cell (a point carries
        its step's own time; a snapshot's time falls anywhere in its throttle window, so two
        lockstep ranks measured from their snapshots may differ by a slow step one of them saw
        inside its window and the other did not)."""
        if not self.samples:
            return
        last = self.samples[-1]
        first = self.first_sample
        assert first is not None  # (a sample in the window: work was seen)
        if last.time - first.time < min_span and self._idle is not None:
            first = self._idle
        self.rate, self.comm_share = _measure(first, last, 0.0)
        logged = self._logged_rate(min_span)
        if logged is not None:
            self.rate = logged

    def _logged_rate(self, min_span: float) -> float | None:
        """Steps/s between the first and last logged point of the metric logged most, when its
        steps only went up and they span at least ``min_span`` seconds; else None."""
        series = max(self.history.values(), key=len, default=())
        if len(series) < 2:
            return None
        (w0, s0, _), (w1, s1, _) = series[0], series[-1]
        if w1 - w0 < min_span or s1 <= s0 or any(b[1] < a[1] for a, b in zip(series, series[1:])):
            return None  # too short, or a count that restarted (ring.track per epoch)
        return (s1 - s0) / (w1 - w0)

    def add_point(self, metric: str, wall: float, step: float, value: object, check: bool = True) -> bool:
        """Insert one history point in time order; False when it was already there.

        ``check=False``: the caller knows the point is new (its snapshot's number is new).
        """
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False  # the reporter sends non-finite numbers as strings ('nan', 'inf')
        keys = self._keys.setdefault(metric, set())
        if check:
            key = (wall, step, value)
            if key in keys:
                return False
            keys.add(key)
        series = self.history.setdefault(metric, [])
        point = (wall, step, float(value))
        if metric not in self._charts:
            self._charts[metric] = _ChartBuffer()  # sees every point, before any thinning
        chart = self._charts[metric]
        if not series or series[-1] <= point:
            series.append(point)
            if chart is not None:
                chart.add(step, point[2])
        else:
            bisect.insort(series, point)
            self._charts[metric] = None  # out of order (rare): rebuilt when next drawn
        if len(series) > _MAX_POINTS:
            half = len(series) // 2
            dropped = series[:half:2]
            series[:half] = series[1:half:2]
            for w, s, v in dropped:
                keys.discard((w, s, v))
        return True

    def chart_points(self, metric: str) -> list[Point]:
        """The metric's (step, value) points decimated for drawing (at most ~1000, in order)."""
        chart = self._charts.get(metric)
        if chart is None:
            chart = self._charts[metric] = _ChartBuffer()
            for _wall, step, value in self.history.get(metric, ()):
                chart.add(step, value)
        return chart.points()


def _measure(first: _Sample, last: _Sample, min_span: float) -> tuple[float | None, float | None]:
    """(steps/s, share of time in collectives) between two samples; (None, None) over too short
    a span (a figure from a fraction of a second is noise)."""
    span = last.time - first.time
    if span <= 0 or span < min_span:
        return None, None
    # a rank that never advanced a step (it only logs metrics) has no rate, rather than 0 it/s
    rate = (last.advanced - first.advanced) / span if last.advanced > 0 else None
    share = max(0.0, min(1.0, (last.comm - first.comm) / span))
    return rate, share


class _ChartBuffer:
    """Min/max decimation of a series as its points arrive: O(1) per point, ≤ 2·limit kept.

    Points go into buckets of ``width`` consecutive points, each kept as its minimum and maximum
    (in their order). Past ``limit`` buckets, neighbouring buckets merge and the width doubles.
    The first and the latest point are always kept: the chart's x-axis runs from one to the other.
    """

    def __init__(self, limit: int = 250) -> None:
        self.limit = limit
        self.width = 1
        self.buckets: list[list[Point]] = []  # closed buckets: lists of <= 2 points
        self.count = 0             # points in the open bucket
        # its lowest and highest point: (index, x, y) (set with its first point)
        self.lo: tuple[int, float, float] = (0, 0.0, 0.0)
        self.hi: tuple[int, float, float] = (0, 0.0, 0.0)
        self.first: Point | None = None
        self.last: Point | None = None

    def add(self, x: float, y: float) -> None:
        if self.first is None:
            self.first = (x, y)
        self.last = (x, y)
        n = self.count
        if n == 0:
            self.lo = self.hi = (0, x, y)
        elif y < self.lo[2]:
            self.lo = (n, x, y)
        elif y > self.hi[2]:
            self.hi = (n, x, y)
        self.count = n + 1
        if self.count >= self.width:
            self.buckets.append(self._open())
            self.count = 0
            if len(self.buckets) > self.limit:
                pairs = self.buckets
                self.buckets = [_minmax(pairs[i] + pairs[i + 1]) if i + 1 < len(pairs) else pairs[i]
                                for i in range(0, len(pairs), 2)]
                self.width *= 2

    def _open(self) -> list[Point]:
        if self.count == 0:
            return []
        lo, hi = self.lo, self.hi
        if lo is hi:
            return [(lo[1], lo[2])]
        first, second = (lo, hi) if lo[0] < hi[0] else (hi, lo)
        return [(first[1], first[2]), (second[1], second[2])]

    def points(self) -> list[Point]:
        out = [p for bucket in self.buckets for p in bucket] + self._open()
        first, last = self.first, self.last  # (set with the first point: out is empty before)
        if out and first is not None and out[0] != first:
            out.insert(0, first)
        if out and last is not None and out[-1] != last:
            out.append(last)
        return out


def _minmax(points: Sequence[Point]) -> list[Point]:
    """The points with the lowest and highest y, in their original order (all if <= 2)."""
    if len(points) <= 2:
        return list(points)
    lo = min(range(len(points)), key=lambda i: points[i][1])
    hi = max(range(len(points)), key=lambda i: points[i][1])
    return [points[i] for i in sorted({lo, hi})]


class DashboardState:
    """Ingests rank snapshots; answers what to show: rows, stragglers, stall banner, chart series.

    ``ranks`` is the number of ranks or the list of ranks to show (snapshots from other ranks add
    rows). Rates and comm shares are measured over the last ``window`` seconds of each rank's
    snapshots, and shown once they span ``min_span`` seconds. A rank is a straggler when it is
    not done and its rate has stayed below ``straggler_ratio`` times the median rate of the
    running ranks for ``window`` seconds (one low reading is no evidence).
    """

    def __init__(self, ranks: int | Iterable[int] = (), straggler_ratio: float = 0.7, metric: str | None = None,
                 window: float = 5.0, min_span: float = 1.0) -> None:
        if isinstance(ranks, int):
            ranks = range(ranks)
        self.ranks: dict[int, RankState] = {}
        for rank in ranks:
            self.rank(rank)
        if not 0 < straggler_ratio < 1:
            raise ValueError(f"straggler_ratio must be between 0 and 1, got {straggler_ratio!r}")
        if not 0 <= min_span <= window:
            raise ValueError(f"need 0 <= min_span <= window (seconds), got min_span={min_span!r}, "
                             f"window={window!r}")
        self.straggler_ratio = straggler_ratio
        self.window = float(window)
        self.min_span = float(min_span)
        self.metric = metric       # the charted metric; None: 'loss' if logged, else the first
        self.y_scale: str | None = None  # the chart's y-axis: 'linear', 'log' or None (chosen from the data)
        self.frozen = False
        self.version = 0           # bumped on every change, for renderers to skip repaints
        self.started = time.time()
        self.now: float | None = None  # local time of the latest ingest: the straggler clock

    def rank(self, rank: int) -> RankState:
        """The RankState of ``rank`` (created if new)."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"a rank is an int >= 0, got {rank!r}")
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = RankState(rank)
            self.ranks = dict(sorted(self.ranks.items()))
        return state

    def replaced(self, rank: int, during: bool = True) -> None:
        """A new engine replaced ``rank``'s dead one: ``during`` the cell, which the new engine
        runs too (``elastic.run`` goes on), or after the cell failed there (its row stays the
        dead engine's; the new one has a fresh namespace for the next cell)."""
        state = self.rank(rank)
        if during:
            state.replaced_at.append(state.step if state.seen else None)
            state.new_engine()
        else:
            state.replaced_after = True
        self.version += 1

    def joined(self, rank: int) -> None:
        """``rank`` joined the world during the cell (host discovery grew it): a row of its own, or,
        for a rank that left the world earlier in the cell, its row taken on by the new engine."""
        state = self.rank(rank)
        if state.seen:
            state.new_engine()
        state.joined = True
        self.version += 1

    # ------------------------------------------------------------------------------ ingest
    def ingest(self, rank: int | None, snapshot: Snapshot, seq: int | None = None, received: float | None = None) -> int:
        """Merge one snapshot of ``rank``; returns the number of new history points.

        ``seq`` (the transport's sequence number, if it has one) orders snapshots and recognises
        one ingested twice; without it the snapshot's ``time`` orders them and duplicate points
        are recognised one by one. A transport numbers all its snapshots or none. A snapshot
        older than one already ingested only adds its history points.
        """
        if self.frozen:
            return 0
        who: Any = rank if rank is not None else snapshot.get("rank")  # (a snapshot's JSON value)
        state = self.rank(int(who))
        added = 0
        # numbered snapshots are recognised by their number; others point by point
        fresh = seq is not None and seq not in state.seqs
        if seq is None or fresh:
            if seq is not None and fresh:
                state.seqs.add(seq)
            for step, wall, values in snapshot.get("history") or ():
                for metric, value in (values or {}).items():
                    added += state.add_point(metric, float(wall), step, value, check=not fresh)
        snap_time = float(snapshot.get("time") or 0.0)
        if seq is not None and state.seq is not None:
            newer = seq > state.seq
        else:
            newer = snap_time >= state.snap_time
        if newer:
            if seq is not None:
                state.seq = seq
            state.snap_time = snap_time
            state.step = snapshot.get("step", state.step)
            state.total = snapshot.get("total", state.total)
            state.desc = snapshot.get("desc", state.desc)
            state.metrics = dict(snapshot.get("metrics") or {})
            state.comm = dict(snapshot.get("comm") or {})
            # engines before per-cell counts sent only the totals, as "comm"
            state.comm_total = dict(snapshot.get("comm_total") or state.comm)
            state.stall = snapshot.get("stall")
            state.elapsed = float(snapshot.get("elapsed") or 0.0)
            state.final = bool(snapshot.get("final"))
            # the snapshot's own 'rate' and 'comm_share' are ignored: each covers a different
            # instant on each rank (see the module's docstring)
            state.add_sample(snapshot, self.window, self.min_span)
        state.seen = True
        state.received = time.time() if received is None else received
        self.now = state.received if self.now is None else max(self.now, state.received)
        self._judge_stragglers()
        self.version += 1
        return added

    def freeze(self, outcomes: dict[int, str] | None = None) -> None:
        """No more snapshots: the state is final (a stall still shown is over, and the rates and
        comm shares become the whole cell's).

        ``outcomes`` {rank: how the cell ended there} (keys of ``ENDINGS``: "interrupted",
        "stalled", "failed", "died", "no reply", "left": host discovery shrank the world); a rank
        not named ended well ("done")."""
        outcomes = outcomes or {}
        for rank, ending in outcomes.items():
            if ending not in ENDINGS:
                raise ValueError(f"a cell ends on a rank as one of {sorted(ENDINGS)}, got {ending!r} "
                                 f"for rank {rank}")
        for rank, state in self.ranks.items():
            state.ended = outcomes.get(rank, "done")
            state.stall = None
            state.slow_since = None
            state.measure_whole(self.min_span)
        self.frozen = True
        self.version += 1

    def _judge_stragglers(self) -> None:
        """Start or end each running rank's slow spell against the median of the running ranks."""
        running = {r: s.rate for r, s in self.ranks.items() if s.seen and not s.done and s.rate is not None}
        median = (statistics.median(running.values()) if len(running) >= 2
                  else None)
        for rank, state in self.ranks.items():
            slow = (median is not None and median > 0 and rank in running
                    and running[rank] < self.straggler_ratio * median)
            if not slow:
                state.slow_since = None
            elif state.slow_since is None:
                state.slow_since = self.now

    # ------------------------------------------------------------------------------ queries
    def reported_work(self) -> bool:
        """Some rank reported work in this cell (a step, a metric, a stall): the rule for showing
        a dashboard at all."""
        return any(state.seen and state.reported_work for state in self.ranks.values())

    def chart_metric(self) -> str | None:
        """The metric the chart shows: the chosen one, else 'loss', else the first logged."""
        if self.metric:
            return self.metric
        names = [m for state in self.ranks.values() for m in state.history]
        if "loss" in names:
            return "loss"
        return names[0] if names else None

    def median_rate(self) -> float | None:
        """Median rate (steps/s) of the ranks still running with a measured rate, or None."""
        rates = [s.rate for s in self.ranks.values() if s.seen and not s.done and s.rate is not None]
        if len(rates) < 2 or max(rates) <= 0:
            return None
        return statistics.median(rates)

    def stragglers(self) -> list[int]:
        """Ranks still running whose rate has stayed clearly below the median of the running
        ranks for the last ``window`` seconds."""
        if self.frozen:
            return []
        return [r for r, s in self.ranks.items()
                if s.slow_since is not None and not s.done and self.now is not None
                and self.now - s.slow_since >= self.window]

    def set_y_scale(self, scale: str | None) -> None:
        """Fix the chart's y-axis to 'linear' or 'log' (None: chosen from the data again)."""
        if scale not in (None, "linear", "log"):
            raise ValueError(f"the chart's y-axis scale is 'linear', 'log' or None (automatic), "
                             f"got {scale!r}")
        self.y_scale = scale
        self.version += 1

    def chart_scale(self, series: dict[int, list[Point]] | None = None) -> str:
        """The chart's y-axis, 'linear' or 'log': the chosen one where the values allow it, else
        log when every value is positive and they span more than a decade and a half."""
        series = self.series() if series is None else series
        ys = [y for pts in series.values() for _, y in pts]
        return choose_scale(self.y_scale, min(ys), max(ys)) if ys else "linear"

    def stalls(self) -> list[dict[str, Any]]:
        """The stall of every waiting rank: [{rank, what, missing, waited, held}], by rank."""
        out = []
        for rank, state in self.ranks.items():
            stall = state.stall
            if stall and stall.get("what"):
                out.append({"rank": rank, "what": stall["what"],
                            "missing": list(stall.get("missing") or []),
                            "waited": float(stall.get("waited") or 0.0),
                            "held": list(stall.get("held") or [])})
        return out

    def banner(self) -> str:
        """One line per waiting rank naming the collective and the missing ranks, or ''."""
        lines = []
        for stall in self.stalls():
            missing = ", ".join(str(r) for r in stall["missing"]) or "?"
            line = (f"rank {stall['rank']} has waited {stall['waited']:.0f} s in "
                    f"{stall['what']} for rank(s) {missing}")
            held = stall["held"]
            if held:  # a rank at a breakpoint: a pause, not a stall
                line += (f" (rank {held[0]} is in the debugger)" if len(held) == 1 else
                         f" (ranks {', '.join(map(str, held))} are in the debugger)")
            lines.append(line)
        return "\n".join(lines)

    def series(self, metric: str | None = None, max_points: int = 500) -> dict[int, list[Point]]:
        """{rank: [(step, value), ...]} for the chart, in time order, at most ``max_points`` each."""
        metric = metric or self.chart_metric()
        out: dict[int, list[Point]] = {}
        if metric is None:
            return out
        for rank, state in self.ranks.items():
            points = state.history.get(metric)
            if not points:
                continue
            if len(points) <= max_points:
                out[rank] = [(step, value) for _wall, step, value in points]
            else:  # long runs: from the incrementally decimated copy, not the whole history
                out[rank] = downsample(state.chart_points(metric), max_points)
        return out

    def comm_totals(self, rank: int, kind: str = "allreduce", since_init: bool = False) -> dict[str, float]:
        """The rank's figures for one collective kind in this cell (``since_init``: since
        ``ring.init()`` or ``ring.reset_stats()``): count, bytes, time_s, busbw (zeros if none)."""
        state = self.ranks[rank]
        entry = (state.comm_total if since_init else state.comm).get(kind) or {}
        return {"count": int(entry.get("count", 0)), "bytes": int(entry.get("bytes", 0)),
                "time_s": float(entry.get("time_s", 0.0)), "busbw": float(entry.get("busbw", 0.0))}

    def summary(self) -> str:
        """A plain-text summary: one line per rank, the stall banner, stragglers."""
        lines = []
        stragglers = set(self.stragglers())
        metric = self.chart_metric()
        for rank, s in self.ranks.items():
            if not s.seen:
                lines.append(f"rank {rank}: no report yet" + (f", {s.change}" if s.change else ""))
                continue
            total = f"/{_num(s.total)}" if s.total is not None else ""
            pct = f" ({100 * s.fraction:.0f}%)" if s.fraction is not None else ""
            parts = [f"rank {rank}: step {_num(s.step)}{total}{pct}"]
            if s.stopped:
                parts.append(s.stopped_as)
            if s.change:
                parts.append(s.change)
            if s.rate is not None:
                parts.append(f"{format_rate(s.rate)} it/s")
            if s.eta is not None and not s.done and s.ended is None:
                parts.append(f"ETA {format_seconds(s.eta)}")
            if metric in s.metrics:
                parts.append(f"{metric} {format_value(s.metrics[metric])}")
            ar = self.comm_totals(rank)
            since_init = self.comm_totals(rank, since_init=True)["count"]
            if ar["count"]:
                parts.append(f"allreduce {ar['count']}x {format_bytes(ar['bytes'])} "
                             f"{ar['time_s']:.2f} s {format_bytes(ar['busbw'])}/s")
            if since_init > ar["count"]:
                parts.append(f"{since_init} allreduces since ring.init()")
            if s.comm_share is not None:
                parts.append(f"comm {100 * s.comm_share:.0f}%")
            line = ", ".join(parts)
            if rank in stragglers:
                line += "  <- straggler"
            lines.append(line)
        banner = self.banner()
        if banner:
            lines.append("STALL: " + banner.replace("\n", "; "))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------- helpers
def downsample(points: Sequence[Point], max_points: int = 500) -> list[Point]:
    """At most ``max_points`` of ``points`` [(x, y)], keeping order, the ends and each bucket's
    minimum and maximum y (spikes survive, unlike plain striding)."""
    n = len(points)
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    if n <= max_points:
        return list(points)
    inner = points[1:-1]
    buckets = (max_points - 2) // 2
    out = [points[0]]
    size = len(inner) / buckets
    for b in range(buckets):
        chunk = inner[int(b * size):int((b + 1) * size)]
        if not chunk:
            continue
        lo = min(range(len(chunk)), key=lambda i: chunk[i][1])
        hi = max(range(len(chunk)), key=lambda i: chunk[i][1])
        for i in sorted({lo, hi}):
            out.append(chunk[i])
    out.append(points[-1])
    return out


def _num(x: object) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def format_value(value: object) -> str:
    """A metric value, short: 4 significant digits."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.4g}"
    return str(value)


def choose_scale(chosen: str | None, lo: float, hi: float) -> str:
    """The y-axis for values in [lo, hi]: ``chosen`` ('linear', 'log' or None) where the values
    allow it; by default log when all are positive and span more than a decade and a half."""
    positive = lo > 0
    if chosen is not None:
        return "log" if chosen == "log" and positive else "linear"
    return "log" if positive and hi > _LOG_RATIO * lo else "linear"


def format_rate(rate: float) -> str:
    """Steps per second, 3 significant digits (0.04, 2.57, 31.4, 1234)."""
    if rate >= 100:
        return f"{rate:.0f}"
    return f"{rate:.3g}"


def format_bytes(n: float) -> str:
    """Bytes with a binary unit: 1.5 MiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_seconds(s: float) -> str:
    """Seconds as 42 s, 3:05 or 1:02:03."""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s} s"
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
