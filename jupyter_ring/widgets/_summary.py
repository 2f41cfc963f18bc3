"""The dashboard of a large world: a summary of every rank, and the few ranks worth a row.

From ``SUMMARY_FROM`` ranks on, a row per rank is more than a reader can take in (64 rows, a
chart with 64 lines and a legend taller than the chart). The dashboard then shows, as MPI tools
and NCCL's tests do for many ranks:

- one table of percentiles over the ranks that reported (min, p10, median, p90, max) of the step,
  the rate, the ETA, the share of time in collectives and each logged metric, each row naming the
  rank at its slow end (the lowest step or rate, the longest ETA, the highest share);
- a row for each *notable* rank: every rank that stopped (interrupted, stalled, failed, died, no
  reply), every straggler, every rank replaced in the cell, then the slowest ranks by progress,
  up to ``NOTABLE`` rows in all (stopped, stragglers and replaced always shown), each with why
  it is there;
- the chart of the median over the ranks per step with the min-max band, and the notable ranks'
  own lines (:func:`summary_series`).

Pure functions of a :class:`~jupyter_ring.widgets._state.DashboardState`: the live widget and the
frozen HTML draw the same summary.
"""

import html
import math
from collections.abc import Callable, Iterable, Sequence

from ._axes import CHAR_PX, color, legend_entry, linear_ticks, log_label, log_ticks, x_axis
from ._state import DashboardState, choose_scale, format_rate, format_seconds, format_value

__all__ = ["SUMMARY_FROM", "NOTABLE", "summarised", "percentiles", "notable_ranks",
           "render_summary", "render_summary_chart", "summary_series"]

# From this many ranks on the dashboard summarises (below it, a row per rank reads well).
SUMMARY_FROM = 9
# At most this many notable ranks get a row of their own (stopped ranks and stragglers always do).
NOTABLE = 5
QUANTILES = (0, 10, 50, 90, 100)


def summarised(state: DashboardState) -> bool:
    """Whether ``state``'s world is large enough to be summarised."""
    return len(state.ranks) >= SUMMARY_FROM


def percentiles(values: Sequence[float], quantiles: Iterable[float] = QUANTILES) -> list[float]:
    """The ``quantiles`` (0-100) of ``values`` by linear interpolation between the closest ranks
    (numpy's default); empty for no values."""
    ordered = sorted(values)
    if not ordered:
        return []
    out = []
    for q in quantiles:
        at = (len(ordered) - 1) * q / 100.0
        low = math.floor(at)
        high = min(low + 1, len(ordered) - 1)
        out.append(ordered[low] + (ordered[high] - ordered[low]) * (at - low))
    return out


def _progress(state: DashboardState, rank: int) -> float:
    """How far ``rank`` got: its share of the total, else its step (for ordering only)."""
    s = state.ranks[rank]
    if s.fraction is not None:
        return s.fraction
    return float(s.step) if isinstance(s.step, (int, float)) else 0.0


def notable_ranks(state: DashboardState, limit: int = NOTABLE) -> list[tuple[int, str]]:
    """``(rank, why)`` of the ranks worth a row of their own: every stopped rank ("failed",
    "interrupted", ...), every straggler, every rank replaced in the cell ("replaced at step
    12"), then the slowest by progress while room is left of ``limit`` rows (a rank that has
    not reported yet counts as the slowest)."""
    stragglers = set(state.stragglers())
    out: list[tuple[int, str]] = []
    for rank, s in state.ranks.items():
        if s.stopped:
            out.append((rank, s.stopped_as))
        elif rank in stragglers:
            out.append((rank, "straggler"))
        elif s.replaced_at or s.replaced_after:
            out.append((rank, s.change))
    chosen = {rank for rank, _ in out}
    running = [r for r, s in state.ranks.items() if r not in chosen and not s.done]
    running.sort(key=lambda r: (state.ranks[r].seen, _progress(state, r), r))
    for rank in running[:max(0, limit - len(out))]:
        out.append((rank, "slowest" if state.ranks[rank].seen else "no report yet"))
    return out


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _row(label: str, values: dict[int, float], fmt: Callable[[float], str], slow_end: str) -> str:
    """A percentile row of ``values`` {rank: value}; the rank at the ``slow_end`` ("low" or
    "high"; the lowest rank among equals) is named in the last cell."""
    if not values:
        return ""
    cells = "".join(f"<td>{_e(fmt(v))}</td>" for v in percentiles(list(values.values())))
    if slow_end == "low":
        rank = min(values, key=lambda r: (values[r], r))
    else:
        rank = max(values, key=lambda r: (values[r], -r))
    return (f'<tr class="jr-summary-row" data-what="{_e(label)}"><td class="jr-l">{_e(label)}</td>'
            f'{cells}<td class="jr-l">rank {rank}</td></tr>')


def render_summary(state: DashboardState) -> str:
    """The percentile table over the ranks that reported, and the notable ranks' rows."""
    seen = {r: s for r, s in state.ranks.items() if s.seen}
    header = "".join(f"<th>{'min' if q == 0 else 'max' if q == 100 else 'median' if q == 50 else f'p{q}'}</th>"
                     for q in QUANTILES)
    rows = [
        _row("step", {r: float(s.step) for r, s in seen.items() if isinstance(s.step, (int, float))},
             lambda v: f"{v:g}", "low"),
        _row("rate (it/s)", {r: s.rate for r, s in seen.items() if s.rate is not None},
             format_rate, "low"),
        _row("ETA", {r: s.eta for r, s in seen.items() if s.eta is not None and not s.stopped},
             format_seconds, "high"),
        _row("time in collectives", {r: 100 * s.comm_share for r, s in seen.items()
                                     if s.comm_share is not None}, lambda v: f"{v:.0f} %", "high"),
    ]
    metrics = sorted({k for s in seen.values() for k in s.metrics})
    for metric in metrics:
        values = {r: float(s.metrics[metric]) for r, s in seen.items()
                  if isinstance(s.metrics.get(metric), (int, float))}
        rows.append(_row(metric, values, format_value, "high"))
    done = sum(1 for s in state.ranks.values() if s.done)
    stopped = sum(1 for s in state.ranks.values() if s.stopped)
    head = (f"{len(state.ranks)} ranks: {len(seen)} reporting, {done} done"
            + (f", {stopped} stopped" if stopped else ""))
    table = (f'<table class="jr-summary"><tr><th class="jr-l">{_e(head)}</th>{header}'
             f'<th class="jr-l">slow end</th></tr>{"".join(rows)}</table>')
    return table


def summary_series(state: DashboardState, metric: str, ranks: Iterable[int],
                   bins: int = 200) -> tuple[list[tuple[float, float, float, float]],
                                             dict[int, list[tuple[float, float]]]]:
    """The chart of a large world: ``(step, min, median, max)`` of ``metric`` over the ranks, in
    at most ``bins`` bins of the step axis (each rank's points in a bin averaged first, so ranks
    that logged at other steps still meet); and the own lines of ``ranks`` (the notable ones)."""
    series = {r: [(x, y) for x, y in pts if isinstance(x, (int, float))]
              for r, pts in state.series(metric, max_points=10 * bins).items()}
    series = {r: pts for r, pts in series.items() if pts}
    if not series:
        return [], {}
    x0 = min(pts[0][0] for pts in series.values())
    x1 = max(pts[-1][0] for pts in series.values())
    width = (x1 - x0) / bins or 1.0
    sums: dict[int, dict[int, list[float]]] = {}  # bin -> rank -> [sum, count]
    for rank, pts in series.items():
        for x, y in pts:
            slot = sums.setdefault(min(bins - 1, int((x - x0) / width)), {}).setdefault(rank, [0.0, 0.0])
            slot[0] += y
            slot[1] += 1
    band = []
    for b in sorted(sums):
        means = [total / count for total, count in sums[b].values()]
        low, mid, high = percentiles(means, (0, 50, 100))
        band.append((x0 + (b + 0.5) * width if x1 > x0 else x0, low, mid, high))
    return band, {r: series[r] for r in ranks if r in series}


def render_summary_chart(state: DashboardState, width: int = 640, height: int = 220,
                         scale: str | None = None) -> str:
    """An SVG of the chart metric over a large world: the median over the ranks per step, the
    min-max band around it, and the notable ranks' own lines, with a legend; '' without data.
    ``scale``: 'linear' or 'log' (where the values allow it), else the state's choice."""
    metric = state.chart_metric()
    if metric is None:
        return ""
    notable = notable_ranks(state)
    band, own = summary_series(state, metric, [rank for rank, _ in notable])
    if not band:
        return ""
    x0, x1 = band[0][0], band[-1][0]
    for pts in own.values():
        x0, x1 = min(x0, pts[0][0]), max(x1, pts[-1][0])
    ys = [v for _, low, _, high in band for v in (low, high)] + [y for pts in own.values() for _, y in pts]
    scale = choose_scale(scale or state.y_scale, min(ys), max(ys))
    fy, v0, v1, labels = _y_axis(scale, min(ys), max(ys))
    left = 10 + math.ceil(CHAR_PX * max(len(label) for _, label in labels))
    right, top, bottom = 130, 20, 32
    pw, ph = width - left - right, height - top - bottom
    ax = pw / ((x1 - x0) or 1)
    ay = -ph / ((v1 - v0) or 1)

    def sx(x: float) -> float:
        return left + (x - x0) * ax

    def sy(y: float) -> float:
        return top + ph + (fy(y) - v0) * ay
    parts = [f'<svg class="jr-chart jr-summary-chart" data-metric="{_e(metric)}" data-scale="{scale}" '
             f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
             f'<text x="{left}" y="12">{_e(f"{metric} per step: median of {len(state.ranks)} ranks, min-max band")}'
             f'{" · log scale" if scale == "log" else ""}</text>']
    for value, label in labels:
        y = top + ph + (value - v0) * ay
        parts.append(f'<line class="jr-grid" x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}"/>')
        if label:
            parts.append(f'<text class="jr-ytick" x="{left - 4}" y="{y + 3.5:.1f}" text-anchor="end">{label}</text>')
    parts += x_axis(x0, x1, sx, left, pw, top + ph)
    upper = " ".join(f"{sx(x):.1f},{sy(high):.1f}" for x, _, _, high in band)
    lower = " ".join(f"{sx(x):.1f},{sy(low):.1f}" for x, low, _, _ in reversed(band))
    parts.append(f'<polygon class="jr-band" points="{upper} {lower}" fill="#4e79a7" fill-opacity="0.18" stroke="none"/>')
    median = " ".join(f"{sx(x):.1f},{sy(mid):.1f}" for x, _, mid, _ in band)
    parts.append(f'<polyline class="jr-median" fill="none" stroke="#4e79a7" stroke-width="2" points="{median}"/>')
    legend = [("#4e79a7", f"median ({len(state.ranks)} ranks)"), ("rgba(78,121,167,.35)", "min-max")]
    why = dict(notable)
    for rank, pts in sorted(own.items()):
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline class="jr-series" data-rank="{rank}" fill="none" stroke="{color(rank)}" '
                     f'stroke-width="1.2" stroke-dasharray="4 2" points="{coords}"/>')
        legend.append((color(rank), f"rank {rank} ({why[rank]})"))
    for i, (stroke, text) in enumerate(legend):
        parts.append(legend_entry(left + pw, i, top, stroke, _e(text), 6 if text == "min-max" else 2))
    parts.append("</svg>")
    return "".join(parts)


def _y_axis(scale: str, low: float, high: float) -> tuple[Callable[[float], float], float, float,
                                                          list[tuple[float, str]]]:
    """The value axis over [low, high] at ``scale``: the value's position function (the log for
    'log'), the axis' ends in that position, and the ticks (position, label; '' unlabelled)."""
    if scale == "log":
        ticks, a, b = log_ticks(low, high)
        return math.log10, float(a), float(b), [(math.log10(v), log_label(v) if labelled else "")
                                                for v, labelled in ticks]
    values, _step = linear_ticks(low, high)
    return float, values[0], values[-1], [(v, f"{v:g}") for v in values]
