"""HTML and SVG for the dashboard, from a DashboardState: no widgets, no JavaScript.

The same functions draw the live widget's chart and tables and the static fallback saved in the
notebook, so a notebook reopened without a kernel shows what the widget last showed.
"""

import html
import math
import uuid
from typing import NamedTuple

from ._state import (ENDINGS, DashboardState, choose_scale, format_bytes, format_rate, format_seconds,
                     format_value)

__all__ = ["render_html", "render_chart", "render_charts", "chart_series", "log_possible", "ChartData",
           "render_comm", "render_comm_totals", "render_banner", "render_rows", "render_title",
           "row_class", "rank_cells", "linear_ticks", "log_ticks", "COLORS",
           "STYLE", "COMM_CAPTION"]

# Tableau 10: distinguishable, and readable on light and dark themes.
COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
          "#ff9da7", "#9c755f", "#bab0ac"]

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

# Average width of a digit of the chart's 10px font: margins are sized to the longest label.
_CHAR_PX = 6.2


def _e(text):
    return html.escape(str(text), quote=True)


def color(rank):
    """The chart and legend colour of ``rank``."""
    return COLORS[rank % len(COLORS)]


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
        eta = ENDINGS[s.ended]
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


def render_banner(state):
    """The stall banner (a red box naming who waits on what and who is missing), or ''."""
    text = state.banner()
    if not text:
        return ""
    # every waiting rank waits for ranks in a debugger: paused by the user, not stalled
    head = "Waiting" if all(stall["held"] for stall in state.stalls()) else "Stalled"
    return f'<div class="jr-banner"><b>{head}:</b> {_e(text)}</div>'


def linear_ticks(lo, hi, count=5):
    """Round ticks (1, 2 or 5 x 10^k apart) covering [lo, hi]: (ticks, step); the first and last
    tick are the axis' ends."""
    if not hi > lo:
        lo, hi = lo - 0.5, hi + 0.5
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if raw <= m * magnitude * (1 + 1e-9))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)], step


def log_ticks(lo, hi):
    """Ticks for a log axis over [lo, hi] (both > 0): ([(value, labelled)], low decade, high
    decade). Decades always; 2 and 5 too over at most two decades; past six decades only every
    other decade is labelled."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    if b == a:
        b = a + 1
    ticks = []
    for k in range(a, b + 1):
        ticks.append((10.0 ** k, b - a <= 6 or (k - a) % 2 == 0))
        if b - a <= 2 and k < b:
            ticks += [(m * 10.0 ** k, True) for m in (2, 5)]
    return sorted(ticks), a, b


def _tick_label(value, step):
    """A tick value with the decimals its spacing needs: 0.002, 0.75, 1500, 1.2e-05."""
    if value == 0:
        return "0"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if decimals <= 4 and abs(value) < 1e6:
        return f"{value:.{decimals}f}"
    digits = max(1, math.floor(math.log10(abs(value))) - math.floor(math.log10(step)) + 1)
    return _short_exponent(f"{value:.{digits - 1}e}")


def _log_label(value):
    return _short_exponent(f"{value:g}")


def _short_exponent(text):
    mantissa, _, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else text


class ChartData(NamedTuple):
    """What one redraw of the chart needs, computed once for both scales."""

    metric: str
    series: dict   # rank -> [(step, value)]: numeric steps, in order, at most max_points each
    scale: str     # 'linear' or 'log': the state's choice (the user's pick, else the data's)
    x0: float      # first and last step
    x1: float
    y0: float      # lowest and highest value
    y1: float


def chart_series(state, max_points=500):
    """The chart's :class:`ChartData`, or None when there is nothing to draw."""
    metric = state.chart_metric()
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


def log_possible(data):
    """Whether a log axis can show every value of ``data`` (a ChartData): all are positive."""
    return data is not None and data.y0 > 0


def render_chart(state, width=640, height=220, max_points=500, drawn=None, scale=None):
    """An SVG line chart of the chart metric, one polyline per rank, overlaid; '' if no data.

    The x-axis runs from the first charted step to the last (both labelled); the y-axis is
    linear or logarithmic (``scale``; by default ``state.chart_scale``), with round ticks and grid
    lines. ``drawn``: the :func:`chart_series` of this redraw, when the caller has it already.
    """
    data = drawn or chart_series(state, max_points)
    if data is None:
        return ""
    metric, series, x0, x1 = data.metric, data.series, data.x0, data.x1
    wanted = scale or state.y_scale or data.scale
    scale = wanted if wanted == "linear" or log_possible(data) else "linear"
    if scale == "log":
        yticks, v0, v1 = log_ticks(data.y0, data.y1)
        ylabels = [(math.log10(v), _log_label(v) if labelled else "") for v, labelled in yticks]
        log10 = math.log10
        series = {rank: [(x, log10(y)) for x, y in pts] for rank, pts in series.items()}
    else:
        ticks, ystep = linear_ticks(data.y0, data.y1)
        ylabels = [(v, _tick_label(v, ystep)) for v in ticks]
        v0, v1 = ticks[0], ticks[-1]
    # room for the longest y label on the left, the legend on the right
    left = 10 + math.ceil(_CHAR_PX * max(len(label) for _, label in ylabels))
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
    parts += _x_axis(x0, x1, lambda x: ax * x + bx, left, pw, top + ph)
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
        ly = top + 12 + 14 * i
        parts.append(f'<line x1="{left + pw + 10}" y1="{ly - 4}" x2="{left + pw + 26}" y2="{ly - 4}" '
                     f'stroke="{color(rank)}" stroke-width="2"/>'
                     f'<text x="{left + pw + 30}" y="{ly}">rank {rank}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_charts(state, max_points=500, drawn=None):
    """The static chart: at both scales, with a linear | log switch made of two radio buttons and
    CSS alone (no JavaScript, no kernel), set to ``state.chart_scale``; the linear chart alone
    where a log axis cannot show the values. The switch looks like the live dashboard's y-axis
    buttons (same size, colours and place), so the output does not change when the cell ends.
    Without the CSS (a sanitized view) both charts show."""
    drawn = drawn or chart_series(state, max_points)
    if not log_possible(drawn):
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


def _x_axis(x0, x1, sx, left, pw, base):
    """Tick marks and labels of the step axis: both ends labelled with their step, round steps
    between them where their label does not run into an end's."""
    integral = float(x0).is_integer() and float(x1).is_integer()
    ticks, step = linear_ticks(x0, x1, count=6)
    if integral:
        step = max(step, 1)
    label = (lambda v: f"{v:.0f}") if integral else (lambda v: _tick_label(v, step))
    ends = [(x0, label(x0), "start"), (x1, label(x1), "end")] if x1 > x0 else [(x0, label(x0), "start")]
    out = []
    for value, text, anchor in ends:
        x = sx(value)
        out.append(f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}" stroke="#bbb"/>'
                   f'<text class="jr-xtick" x="{x:.1f}" y="{base + 14}" text-anchor="{anchor}">'
                   f"{text}</text>")
    # an end label and a round tick keep at least 3 characters between them
    room = [(sx(v) - _CHAR_PX * (len(t) + 3), sx(v) + _CHAR_PX * (len(t) + 3)) for v, t, _ in ends]
    for value in ticks:
        if not x0 < value < x1:
            continue
        text, x = label(value), sx(value)
        half = _CHAR_PX * len(text) / 2
        if any(x - half < end and x + half > start for start, end in room):
            continue
        out.append(f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}" stroke="#bbb"/>'
                   f'<text class="jr-xtick" x="{x:.1f}" y="{base + 14}" text-anchor="middle">'
                   f"{text}</text>")
    out.append(f'<text x="{left + pw / 2:.1f}" y="{base + 27}" text-anchor="middle">step</text>')
    return out


def render_comm(state: DashboardState) -> str:
    """A table per rank of this cell's allreduce count, bytes, time, busbw and the share of
    wall-clock time spent in collectives (over the state's window; the whole cell's once
    frozen), with a caption that says what that share measures, and a second line with the
    totals since ``ring.init()`` where earlier cells ran collectives too."""
    rows = []
    kinds = sorted({k for s in state.ranks.values() for k in s.comm} - {"allreduce"})
    for rank, s in state.ranks.items():
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


def _share_period(state):
    if state.frozen:
        return "over the whole cell (from each rank's first report to its last)"
    return (f"over the last {state.window:g} s (shown once {state.min_span:g} s have been "
            "measured)")


def render_title(title):
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


def render_rows(state):
    """The per-rank progress table: a bar, step/total, percent, rate, ETA, latest metrics. The
    live dashboard shows this same table, so a row looks the same before and after the cell
    ends."""
    stragglers = set(state.stragglers())
    rows = []
    for rank, s in state.ranks.items():
        cells = rank_cells(state, rank)
        note = " (straggler)" if rank in stragglers else ""
        rows.append(f'<tr class="{row_class(state, rank, rank in stragglers)}" data-rank="{rank}">'
                    f'<td class="jr-l"><span style="color:{color(rank)}">&#9632;</span> '
                    f'rank {rank}{note}</td>'
                    f'<td class="jr-l"><span class="jr-bar"><div style="width:{100 * s.bar_fraction:.1f}%">'
                    f'</div></span></td><td>{_e(cells["pct"])}</td><td>{_e(cells["step"])}</td>'
                    f'<td>{_e(cells["rate"])}</td><td>{_e(cells["eta"])}</td>'
                    f'<td class="jr-l">{_e(cells["metrics"])}</td></tr>')
    return '<table class="jr-ranks">' + "".join(rows) + "</table>"


def render_html(state, title="jupyter_ring training"):
    """The whole dashboard as one self-contained HTML fragment (the static fallback): the live
    dashboard's parts in the same order and look."""
    return (f'{STYLE}<div class="jr-dash jr-static">{render_title(title)}'
            f"{render_banner(state)}{render_rows(state)}{render_charts(state)}{render_comm(state)}"
            "</div>")
