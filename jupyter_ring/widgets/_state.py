"""The dashboard's state: every rank's latest snapshot and metric history, in pure Python.

Snapshots come from ``jupyter_ring.runtime._report.Reporter.snapshot()`` on each rank (through
whatever transport the front end uses). Their ``history`` holds only the points logged since the
previous snapshot, so every snapshot must be ingested once; ingesting one twice, or out of order,
does no harm: points are de-duplicated and kept in time order, and an older snapshot never
overwrites a newer one's latest values.
"""

import bisect
import math
import statistics
import time

__all__ = ["DashboardState", "RankState", "downsample"]

# Points kept per rank and metric before the oldest half is thinned to every other point.
_MAX_POINTS = 20000


class RankState:
    """What the dashboard knows about one rank."""

    def __init__(self, rank):
        self.rank = rank
        self.seen = False          # any snapshot ingested
        self.seq = None            # highest snapshot sequence number ingested (None: unknown)
        self.seqs = set()          # every sequence number ingested
        self.snap_time = -math.inf  # the newest snapshot's rank-side wall time
        self.step = 0
        self.total = None
        self.desc = None
        self.rate = 0.0
        self.metrics = {}
        self.comm = {}
        self.comm_share = 0.0
        self.stall = None
        self.elapsed = 0.0
        self.final = False
        self.received = None       # local wall time of the last ingest
        # metric -> sorted list of (wall time, step, value); _keys mirrors it for de-duplication
        self.history = {}
        self._keys = {}
        self._charts = {}          # metric -> _ChartBuffer (None: rebuild from history)

    @property
    def fraction(self):
        """Progress in [0, 1], or None without a total."""
        if not self.total:
            return None
        return max(0.0, min(1.0, self.step / self.total))

    @property
    def eta(self):
        """Seconds left at the current rate (0 when done, None when unknown)."""
        if self.total is None:
            return None
        left = self.total - self.step
        if left <= 0:
            return 0.0
        if self.rate <= 0:
            return None
        return left / self.rate

    @property
    def done(self):
        """Finished: the cell ended on this rank, or the step reached the total."""
        return self.final or (self.total is not None and self.total > 0 and self.step >= self.total)

    def add_point(self, metric, wall, step, value, check=True):
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

    def chart_points(self, metric):
        """The metric's (step, value) points decimated for drawing (at most ~1000, in order)."""
        chart = self._charts.get(metric)
        if chart is None:
            chart = self._charts[metric] = _ChartBuffer()
            for _wall, step, value in self.history.get(metric, ()):
                chart.add(step, value)
        return chart.points()


class _ChartBuffer:
    """Min/max decimation of a series as its points arrive: O(1) per point, ≤ 2·limit kept.

    Points go into buckets of ``width`` consecutive points, each kept as its minimum and maximum
    (in their order). Past ``limit`` buckets, neighbouring buckets merge and the width doubles.
    """

    def __init__(self, limit=250):
        self.limit = limit
        self.width = 1
        self.buckets = []          # closed buckets: lists of <= 2 points
        self.count = 0             # points in the open bucket
        self.lo = self.hi = None   # its lowest and highest point: (index, x, y)

    def add(self, x, y):
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

    def _open(self):
        if self.count == 0:
            return []
        lo, hi = self.lo, self.hi
        if lo is hi:
            return [(lo[1], lo[2])]
        first, second = (lo, hi) if lo[0] < hi[0] else (hi, lo)
        return [(first[1], first[2]), (second[1], second[2])]

    def points(self):
        return [p for bucket in self.buckets for p in bucket] + self._open()


def _minmax(points):
    """The points with the lowest and highest y, in their original order (all if <= 2)."""
    if len(points) <= 2:
        return list(points)
    lo = min(range(len(points)), key=lambda i: points[i][1])
    hi = max(range(len(points)), key=lambda i: points[i][1])
    return [points[i] for i in sorted({lo, hi})]


class DashboardState:
    """Ingests rank snapshots; answers what to show: rows, stragglers, stall banner, chart series.

    ``ranks`` is the number of ranks or the list of ranks to show (snapshots from other ranks add
    rows). A rank is a straggler when it is not done and its rate is below ``straggler_ratio``
    times the median rate of the ranks still running.
    """

    def __init__(self, ranks=(), straggler_ratio=0.7, metric=None):
        if isinstance(ranks, int):
            ranks = range(ranks)
        self.ranks = {}
        for rank in ranks:
            self.rank(rank)
        if not 0 < straggler_ratio < 1:
            raise ValueError(f"straggler_ratio must be between 0 and 1, got {straggler_ratio!r}")
        self.straggler_ratio = straggler_ratio
        self.metric = metric       # the charted metric; None: 'loss' if logged, else the first
        self.frozen = False
        self.version = 0           # bumped on every change, for renderers to skip repaints
        self.started = time.time()

    def rank(self, rank):
        """The RankState of ``rank`` (created if new)."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"a rank is an int >= 0, got {rank!r}")
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = RankState(rank)
            self.ranks = dict(sorted(self.ranks.items()))
        return state

    # ------------------------------------------------------------------------------ ingest
    def ingest(self, rank, snapshot, seq=None, received=None):
        """Merge one snapshot of ``rank``; returns the number of new history points.

        ``seq`` (the transport's sequence number, if it has one) orders snapshots and recognises
        one ingested twice; without it the snapshot's ``time`` orders them and duplicate points
        are recognised one by one. A transport numbers all its snapshots or none. A snapshot
        older than one already ingested only adds its history points.
        """
        if self.frozen:
            return 0
        if rank is None:
            rank = snapshot.get("rank")
        state = self.rank(int(rank))
        added = 0
        # numbered snapshots are recognised by their number; others point by point
        fresh = seq is not None and seq not in state.seqs
        if seq is None or fresh:
            if fresh:
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
            state.rate = float(snapshot.get("rate") or 0.0)
            state.metrics = dict(snapshot.get("metrics") or {})
            state.comm = dict(snapshot.get("comm") or {})
            state.comm_share = float(snapshot.get("comm_share") or 0.0)
            state.stall = snapshot.get("stall")
            state.elapsed = float(snapshot.get("elapsed") or 0.0)
            state.final = bool(snapshot.get("final"))
        state.seen = True
        state.received = time.time() if received is None else received
        self.version += 1
        return added

    def freeze(self):
        """No more snapshots: the state is final (a stall still shown is over)."""
        for state in self.ranks.values():
            state.stall = None
        self.frozen = True
        self.version += 1

    # ------------------------------------------------------------------------------ queries
    def chart_metric(self):
        """The metric the chart shows: the chosen one, else 'loss', else the first logged."""
        if self.metric:
            return self.metric
        names = [m for state in self.ranks.values() for m in state.history]
        if "loss" in names:
            return "loss"
        return names[0] if names else None

    def median_rate(self):
        """Median rate (steps/s) of the ranks still running with a measured rate, or None."""
        rates = [s.rate for s in self.ranks.values() if s.seen and not s.done]
        if len(rates) < 2 or max(rates) <= 0:
            return None
        return statistics.median(rates)

    def stragglers(self):
        """Ranks still running whose rate is clearly below the median of the running ranks."""
        median = self.median_rate()
        if median is None or median <= 0:
            return []
        return [r for r, s in self.ranks.items()
                if s.seen and not s.done and s.rate < self.straggler_ratio * median]

    def stalls(self):
        """The stall of every waiting rank: [{rank, what, missing, waited}], by rank."""
        out = []
        for rank, state in self.ranks.items():
            stall = state.stall
            if stall and stall.get("what"):
                out.append({"rank": rank, "what": stall["what"],
                            "missing": list(stall.get("missing") or []),
                            "waited": float(stall.get("waited") or 0.0)})
        return out

    def banner(self):
        """One line per waiting rank naming the collective and the missing ranks, or ''."""
        lines = []
        for stall in self.stalls():
            missing = ", ".join(str(r) for r in stall["missing"]) or "?"
            lines.append(f"rank {stall['rank']} has waited {stall['waited']:.0f} s in "
                         f"{stall['what']} for rank(s) {missing}")
        return "\n".join(lines)

    def series(self, metric=None, max_points=500):
        """{rank: [(step, value), ...]} for the chart, in time order, at most ``max_points`` each."""
        metric = metric or self.chart_metric()
        out = {}
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

    def comm_totals(self, rank, kind="allreduce"):
        """The rank's totals for one collective kind: count, bytes, time_s, busbw (zeros if none)."""
        entry = self.ranks[rank].comm.get(kind) or {}
        return {"count": int(entry.get("count", 0)), "bytes": int(entry.get("bytes", 0)),
                "time_s": float(entry.get("time_s", 0.0)), "busbw": float(entry.get("busbw", 0.0))}

    def summary(self):
        """A plain-text summary: one line per rank, the stall banner, stragglers."""
        lines = []
        stragglers = set(self.stragglers())
        metric = self.chart_metric()
        for rank, s in self.ranks.items():
            if not s.seen:
                lines.append(f"rank {rank}: no report yet")
                continue
            total = f"/{_num(s.total)}" if s.total is not None else ""
            pct = f" ({100 * s.fraction:.0f}%)" if s.fraction is not None else ""
            parts = [f"rank {rank}: step {_num(s.step)}{total}{pct}", f"{s.rate:.1f} it/s"]
            if s.eta is not None and not s.done:
                parts.append(f"ETA {format_seconds(s.eta)}")
            if metric in s.metrics:
                parts.append(f"{metric} {format_value(s.metrics[metric])}")
            ar = self.comm_totals(rank)
            if ar["count"]:
                parts.append(f"allreduce {ar['count']}x {format_bytes(ar['bytes'])} "
                             f"{ar['time_s']:.2f} s {format_bytes(ar['busbw'])}/s")
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
def downsample(points, max_points=500):
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


def _num(x):
    return f"{x:g}" if isinstance(x, float) else str(x)


def format_value(value):
    """A metric value, short: 4 significant digits."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.4g}"
    return str(value)


def format_bytes(n):
    """Bytes with a binary unit: 1.5 MiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_seconds(s):
    """Seconds as 42 s, 3:05 or 1:02:03."""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s} s"
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
