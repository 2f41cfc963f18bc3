"""HTML and SVG for the dashboard, from a DashboardState: no widgets, no JavaScript.

The same functions draw the live widget's chart and tables and the static fallback saved in the
notebook, so a notebook reopened without a kernel shows what the widget last showed.
"""

from __future__ import annotations

import html
import math
import uuid
from typing import NamedTuple

from ._axes import CHAR_PX, COLORS, color, legend_entry, linear_ticks, log_label, log_ticks, tick_label, x_axis
from ._summary import notable_ranks, percentiles, render_summary, render_summary_chart, summarised
from ._state import (DashboardState, Point, choose_scale, format_bytes, format_rate, format_seconds,
                     format_value)

__all__ = ["render_html", "render_chart", "render_charts", "chart_series", "log_possible", "ChartData",
           "render_comm", "render_comm_totals", "render_banner", "render_rows", "render_title",
           "row_class", "rank_cells", "linear_ticks", "log_ticks", "COLORS",
           "STYLE", "COMM_CAPTION"]

STYLE = """<style>
.jr-dash{font-family:var(--jp-ui-font-family,sans-serif);font-size:12px;line-height:16px;color:var(--jp-ui-font-color1,#222)}
.jr-dash.jr-dash,.jr-dash .jupyter-widgets{margin:0}
.jr-dash .widget-html,.jr-dash .jupyter-widget-html{font-size:inherit}
.jr-dash .widget-html-content,.jr-dash .jupyter-widget-html-content{line-height:inherit}
.jr-dash table{border:none;border-collapse:collapse;margin:0;font-size:inherit;table-layout:auto;color:inherit}
.jr-dash.jr-dash.jr-dash tr:nth-child(n){background:none}
.jr-dash th,.jr-dash td{padding:2px 8px;text-align:right;white-space:nowrap;line-height:16px;vertical-align:middle;border:none}
.jr-dash td.jr-wrap{white-space:normal;max-width:360px}
.jr-dash th{font-weight:600;border-bottom:1px solid var(--jp-border-color1,#ccc)}
.jr-dash td.jr-l,.jr-dash th.jr-l{text-align:left}
.jr-title{margin:0;padding:0 0 6px 0}
.jr-bar{display:inline-block;width:200px;height:20px;background:var(--jp-layout-color2,#eee);vertical-align:middle}
.jr-bar>div{height:100%;background:var(--jp-brand-color1,#1976d2)}
.jr-nototal .jr-bar>div{background:var(--jp-info-color1,#0097a7)}
.jr-straggler td{background:rgba(242,142,43,.18)}
.jr-straggler .jr-bar>div{background:var(--jp-warn-color1,#f57c00)}
.jr-stopped .jr-bar>div{background:var(--jp-error-color1,#d32f2f)}
.jr-banner{background:#fdecea;color:#611a15;border-left:4px solid #e15759;padding:4px 8px;margin:4px 0;white-space:pre-wrap}
.jr-chart text{font-size:10px;fill:var(--jp-ui-font-color2,#555)}
.jr-chart .jr-grid{stroke:var(--jp-border-color2,#e0e0e0);stroke-width:0.5}
.jr-charts>input{display:none}
.jr-charts .jr-pick-linear:checked~.jr-chart-log,.jr-charts .jr-pick-log:checked~.jr-chart-linear{display:none}
.jr-switch{display:flex;align-items:baseline;margin:4px 0 0 0;line-height:28px;font-size:var(--jp-ui-font-size1,13px)}
.jr-switch>span{width:48px;flex-shrink:0;text-align:left;white-space:nowrap;color:var(--jp-widgets-label-color,var(--jp-ui-font-color1,#222))}
.jr-switch>label{display:inline-block;box-sizing:border-box;width:64px;height:28px;margin:0 2px;padding:0 10px;text-align:center;cursor:pointer;white-space:nowrap;color:var(--jp-ui-font-color1,#222);background:var(--jp-layout-color2,#eee)}
.jr-switch>label:hover{box-shadow:0 2px 2px 0 rgba(0,0,0,.14),0 3px 1px -2px rgba(0,0,0,.2),0 1px 5px 0 rgba(0,0,0,.12)}
.jr-pick-linear:checked~.jr-switch>.jr-for-linear,.jr-pick-log:checked~.jr-switch>.jr-for-log{background:var(--jp-layout-color3,#bdbdbd);box-shadow:0 4px 5px 0 rgba(0,0,0,.14),0 1px 10px 0 rgba(0,0,0,.12),0 2px 4px -1px rgba(0,0,0,.2)}
.jr-caption{color:var(--jp-ui-font-color2,#555);font-size:11px;line-height:1.35;margin:0;padding:2px 0 2px 8px;max-width:640px;white-space:normal}
</style>"""

# What "time in collectives" measures: the comm table's caption and its column's tooltip.
COMM_CAPTION = ("time in collectives: the share of wall-clock time each rank spent inside "
                "collectives (allreduce, broadcast, ...; waiting for the other ranks included)")

def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def rank_cells(state: DashboardState, rank: int) -> dict[str, str]:
    """The text of one rank's row: step, percent, rate, ETA (or how it ended), metrics, comm share.

    A frozen row says how the cell ended on the rank: "done" (the total reached, or no total),
    "ended" (it ended well short of its total), else "interrupted", "stalled", "failed", "died"
    or "no reply", next to the step the rank last reported."""
    s = state.ranks[rank]
    if not s.seen:
        return {"step": "waiting for the first report", "pct": "", "rate": "", "eta": "",
                "metrics": "", "comm": ""}
    total = f" / {s.total:g}" if isinstance(s.total, (int, float)) else ""
    step = f"{s.step:g}" if isinstance(s.step, (int, float)) else str(s.step)
    pct = f"{100 * s.fraction:.0f} %" if s.fraction is not None else ""
    if s.stopped:
        eta = s.stopped_as
    elif s.done:
        eta = "done" if s.fraction in (None, 1.0) else "ended"
    else:
        eta = f"ETA {format_seconds(s.eta)}" if s.eta is not None else ""
    metrics = "  ".join(f"{k} {format_value(v)}" for k, v in sorted(s.metrics.items()))
    desc = f"{s.desc}: " if s.desc else ""
    # no figure before it is measured (the window spans min_span): a first reading is noise
    rate = f"{format_rate(s.rate)} it/s" if s.rate is not None else ""
    comm = f"{100 * s.comm_share:.0f} %" if s.comm_share is not None else ""
    return {"step": f"{desc}{step}{total}", "pct": pct, "rate": rate, "eta": eta,
            "metrics": metrics, "comm": comm}


def render_banner(state: DashboardState) -> str:
    """The stall banner (a red box naming who waits on what and who is missing), or ''."""
    text = state.banner()
    if not text:
        return ""
    # every waiting rank waits for ranks in a debugger: paused by the user, not stalled
    head = "Waiting" if all(stall["held"] for stall in state.stalls()) else "Stalled"
    return f'<div class="jr-banner"><b>{head}:</b> {_e(text)}</div>'


class ChartData(NamedTuple):
    """What one redraw of the chart needs, computed once for both scales."""

    metric: str
    series: dict[int, list[Point]]  # rank -> [(step, value)]: numeric steps, in order, at most max_points each
    scale: str     # 'linear' or 'log': the state's choice (the user's pick, else the data's)
    x0: float      # first and last step
    x1: float
    y0: float      # lowest and highest value
    y1: float


def chart_series(state: DashboardState, max_points: int = 500) -> ChartData | None:
    """The chart's :class:`ChartData`, or None when there is nothing to draw."""
    metric = state.chart_metric()
    if metric is None:  # (no metric logged: no series either)
        return None
    series = {}
    for rank, pts in state.series(metric, max_points=max_points).items():
        pts = [(x, y) for x, y in pts if isinstance(x, (int, float))]
        if pts:
            series[rank] = pts
    if not series:
        return None
    x0 = min(pts[0][0] for pts in series.values())   # each series is in step order
    x1 = max(pts[-1][0] for pts in series.values())
    y0 = min(min(y for _, y in pts) for pts in series.values())
    y1 = max(max(y for _, y in pts) for pts in series.values())
    return ChartData(metric, series, choose_scale(state.y_scale, y0, y1), x0, x1, y0, y1)


def log_possible(data: ChartData | None) -> bool:
    """Whether a log axis can show every value of ``data`` (a ChartData): all are positive."""
    return data is not None and data.y0 > 0


def render_chart(state: DashboardState, width: int = 640, height: int = 220, max_points: int = 500,
                 drawn: ChartData | None = None, scale: str | None = None) -> str:
    """An SVG line chart of the chart metric, one polyline per rank, overlaid; '' if no data.

    The x-axis runs from the first charted step to the last (both labelled); the y-axis is
    linear or logarithmic (``scale``; by default ``state.chart_scale``), with round ticks and grid
    lines. ``drawn``: the :func:`chart_series` of this redraw, when the caller has it already.
    A large world (``_summary.summarised``) is drawn as the median with its band instead.
    """
    if summarised(state):
        return render_summary_chart(state, width, height, scale=scale)
    data = drawn or chart_series(state, max_points)
    if data is None:
        return ""
    metric, series, x0, x1 = data.metric, data.series, data.x0, data.x1
    wanted = scale or state.y_scale or data.scale
    scale = wanted if wanted == "linear" or log_possible(data) else "linear"
    ylabels, v0, v1 = _y_axis(data, scale)
    if scale == "log":
        log10 = math.log10
        series = {rank: [(x, log10(y)) for x, y in pts] for rank, pts in series.items()}
    # room for the longest y label on the left, the legend on the right
    left = 10 + math.ceil(CHAR_PX * max(len(label) for _, label in ylabels))
    right, top, bottom = 80, 20, 32
    pw, ph = width - left - right, height - top - bottom
    # screen coordinates are linear in the step and in the (log of the) value: px = ax * x + bx
    ax = pw / ((x1 - x0) or 1)
    bx = left - x0 * ax
    ay = -ph / (v1 - v0)
    by = top + ph - v0 * ay

    note = {"log": " · log scale", "linear": ""}[scale]
    if wanted == "log" and scale == "linear":
        note = " · linear (a log scale needs values > 0)"
    parts = [f'<svg class="jr-chart" data-metric="{_e(metric)}" data-scale="{scale}" '
             f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             'xmlns="http://www.w3.org/2000/svg">',
             f'<text x="{left}" y="12">{_e(f"{metric} per step, all ranks{note}")}</text>']
    for value, label in ylabels:
        y = ay * value + by
        parts.append(f'<line class="jr-grid" x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}"/>')
        if label:
            parts.append(f'<text class="jr-ytick" x="{left - 4}" y="{y + 3.5:.1f}" '
                         f'text-anchor="end">{label}</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" '
                 'stroke="#bbb" stroke-width="0.5"/>')
    parts += x_axis(x0, x1, lambda x: ax * x + bx, left, pw, top + ph)
    for i, (rank, pts) in enumerate(sorted(series.items())):
        # the costly part of a redraw (~1000 points): one formatting per point, no calls
        coords = " ".join(["%.1f,%.1f" % (ax * x + bx, ay * v + by) for x, v in pts])
        parts.append(f'<polyline class="jr-series" data-rank="{rank}" data-points="{len(pts)}" '
                     f'data-first="{pts[0][0]:g}" data-last="{pts[-1][0]:g}" '
                     f'fill="none" stroke="{color(rank)}" stroke-width="1.5" points="{coords}"/>')
        if len(pts) == 1:  # a lone point draws no line: mark it
            x, v = pts[0]
            parts.append(f'<circle cx="{ax * x + bx:.1f}" cy="{ay * v + by:.1f}" r="2.5" '
                         f'fill="{color(rank)}"/>')
        parts.append(legend_entry(left + pw, i, top, color(rank), f"rank {rank}"))
    parts.append("</svg>")
    return "".join(parts)


def _y_axis(data: ChartData, scale: str) -> tuple[list[tuple[float, str]], float, float]:
    """The y-axis' ticks as (position, label: '' for an unlabelled one) and its ends, on the
    ``scale`` ('log': positions are log10 of the values)."""
    if scale == "log":
        yticks, low, high = log_ticks(data.y0, data.y1)
        return [(math.log10(v), log_label(v) if labelled else "") for v, labelled in yticks], low, high
    ticks, ystep = linear_ticks(data.y0, data.y1)
    return [(v, tick_label(v, ystep)) for v in ticks], ticks[0], ticks[-1]


def render_charts(state: DashboardState, max_points: int = 500, drawn: ChartData | None = None) -> str:
    """The static chart: at both scales, with a linear | log switch made of two radio buttons and
    CSS alone (no JavaScript, no kernel), set to ``state.chart_scale``; the linear chart alone
    where a log axis cannot show the values. The switch looks like the live dashboard's y-axis
    buttons (same size, colours and place), so the output does not change when the cell ends.
    Without the CSS (a sanitized view) both charts show."""
    drawn = drawn or chart_series(state, max_points)
    if drawn is None or not log_possible(drawn):
        return render_chart(state, drawn=drawn, scale="linear")
    scale = drawn.scale
    group = f"jr-scale-{uuid.uuid4().hex[:12]}"  # one switch per output, however many on a page
    parts = ['<div class="jr-charts">']
    for option in ("linear", "log"):
        checked = " checked" if option == scale else ""
        parts.append(f'<input type="radio" class="jr-pick-{option}" name="{group}" '
                     f'id="{group}-{option}"{checked}>')
    parts.append('<div class="jr-switch"><span>y-axis</span>')
    parts += [f'<label class="jr-for-{option}" for="{group}-{option}">{option}</label>'
              for option in ("linear", "log")]
    parts.append("</div>")
    for option in ("linear", "log"):
        parts.append(f'<div class="jr-chart-{option}">'
                     f'{render_chart(state, drawn=drawn, scale=option)}</div>')
    parts.append("</div>")
    return "".join(parts)


def render_comm(state: DashboardState) -> str:
    """A table per rank of this cell's allreduce count, bytes, time, busbw and the share of
    wall-clock time spent in collectives (over the state's window; the whole cell's once
    frozen), with a caption that says what that share measures, and a second line with the
    totals since ``ring.init()`` where earlier cells ran collectives too."""
    rows = []
    kinds = sorted({k for s in state.ranks.values() for k in s.comm} - {"allreduce"})
    large = summarised(state)  # a large world: the notable ranks' rows, the others in the caption
    shown = [rank for rank, _ in notable_ranks(state)] if large else list(state.ranks)
    for rank in shown:
        s = state.ranks[rank]
        if not s.seen:
            continue
        ar = state.comm_totals(rank)
        other = ", ".join(f"{k} {state.comm_totals(rank, k)['count']}x" for k in kinds
                          if state.comm_totals(rank, k)["count"])
        share = f"{100 * s.comm_share:.0f} %" if s.comm_share is not None else "–"
        rows.append(f'<tr class="jr-comm-row" data-rank="{rank}"><td class="jr-l">rank {rank}</td>'
                    f'<td>{ar["count"]}</td><td>{format_bytes(ar["bytes"])}</td>'
                    f'<td>{ar["time_s"]:.3f} s</td><td>{format_bytes(ar["busbw"])}/s</td>'
                    f'<td class="jr-share">{share}</td><td class="jr-l jr-wrap">{_e(other)}</td></tr>')
    if not rows:
        return ""
    caption = _e(f"{COMM_CAPTION}, {_share_period(state)}.")
    if large:
        shares = {r: 100 * s.comm_share for r, s in state.ranks.items() if s.comm_share is not None}
        if shares:
            low, mid, high = percentiles(list(shares.values()), (0, 50, 100))
            top = max(shares, key=lambda r: (shares[r], -r))
            caption += _e(f" Rows: the notable ranks; over all {len(state.ranks)} ranks the share is "
                          f"{low:.0f}-{high:.0f} %, median {mid:.0f} % (highest: rank {top}).")
    return ('<table class="jr-comm"><tr><th class="jr-l">communication in this cell</th>'
            '<th>allreduces</th><th>bytes</th><th>time</th><th>busbw</th>'
            f'<th title="{caption}">time in collectives</th>'
            '<th class="jr-l">other collectives</th></tr>' + "".join(rows) + "</table>"
            f'<div class="jr-caption">{caption}</div>{render_comm_totals(state)}')


def render_comm_totals(state: DashboardState) -> str:
    """One line with each rank's allreduces since ``ring.init()`` (or ``ring.reset_stats()``),
    where they are more than the cell's own; '' otherwise."""
    parts = []
    for rank, s in state.ranks.items():
        if not s.seen:
            continue
        total, cell = state.comm_totals(rank, since_init=True), state.comm_totals(rank)
        if total["count"] > cell["count"]:
            parts.append(f'rank {rank}: {total["count"]} allreduces, {format_bytes(total["bytes"])}, '
                         f'{total["time_s"]:.3f} s')
    if not parts:
        return ""
    return ('<div class="jr-caption jr-comm-totals">since ring.init() (or ring.reset_stats()): '
            + _e("; ".join(parts)) + "</div>")


def _share_period(state: DashboardState) -> str:
    if state.frozen:
        return "over the whole cell (from each rank's first report to its last)"
    return (f"over the last {state.window:g} s (shown once {state.min_span:g} s have been "
            "measured)")


def render_title(title: str) -> str:
    """The dashboard's heading line."""
    return f'<div class="jr-title"><b>{_e(title)}</b></div>'


def row_class(state: DashboardState, rank: int, straggler: bool) -> str:
    """The classes of one rank's row, which colour its bar: stopped (interrupted, stalled,
    failed: red), straggler (orange), no total (the bar only fills when done), else plain."""
    s = state.ranks[rank]
    cls = "jr-rank-row"
    if straggler:
        cls += " jr-straggler"
    if s.stopped:
        cls += " jr-stopped"
    elif s.fraction is None and not s.done:
        cls += " jr-nototal"
    return cls


def render_rows(state: DashboardState) -> str:
    """The per-rank progress table: a bar, step/total, percent, rate, ETA, latest metrics. The
    live dashboard shows this same table, so a row looks the same before and after the cell
    ends. A rank a new engine took in this cell says so by its number ("rank 1 (replaced at
    step 12)", "rank 2 (joined during the cell)"). A large world (``_summary.summarised``): the percentiles over the ranks first, then a
    row for each notable rank only, saying why it is there."""
    stragglers = set(state.stragglers())
    why = dict(notable_ranks(state)) if summarised(state) else {}
    rows = []
    for rank in (why or state.ranks):
        s = state.ranks[rank]
        cells = rank_cells(state, rank)
        notes = [why[rank]] if rank in why else ["straggler"] if rank in stragglers else []
        if s.change and s.change not in notes:  # a new engine took the rank in this cell
            notes.append(s.change)
        note = f" ({'; '.join(notes)})" if notes else ""
        rows.append(f'<tr class="{row_class(state, rank, rank in stragglers)}" data-rank="{rank}">'
                    f'<td class="jr-l"><span style="color:{color(rank)}">&#9632;</span> '
                    f'rank {rank}{note}</td>'
                    f'<td class="jr-l"><span class="jr-bar"><div style="width:{100 * s.bar_fraction:.1f}%">'
                    f'</div></span></td><td>{_e(cells["pct"])}</td><td>{_e(cells["step"])}</td>'
                    f'<td>{_e(cells["rate"])}</td><td>{_e(cells["eta"])}</td>'
                    f'<td class="jr-l">{_e(cells["metrics"])}</td></tr>')
    return (render_summary(state) if why else "") + '<table class="jr-ranks">' + "".join(rows) + "</table>"


def render_html(state: DashboardState, title: str = "jupyter_ring training") -> str:
    """The whole dashboard as one self-contained HTML fragment (the static fallback): the live
    dashboard's parts in the same order and look."""
    return (f'{STYLE}<div class="jr-dash jr-static">{render_title(title)}'
            f"{render_banner(state)}{render_rows(state)}{render_charts(state)}{render_comm(state)}"
            "</div>")
