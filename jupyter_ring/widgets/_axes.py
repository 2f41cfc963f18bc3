"""The chart's axes and colours, shared by the dashboard's chart (``_render``) and the chart of a
large world (``_summary``): round ticks, the step axis, a colour per rank."""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["COLORS", "color", "linear_ticks", "log_ticks", "tick_label", "log_label", "x_axis", "legend_entry", "CHAR_PX"]

# Tableau 10: distinguishable, and readable on light and dark themes.
COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
          "#ff9da7", "#9c755f", "#bab0ac"]

# Average width of a digit of the chart's 10px font: margins are sized to the longest label.
CHAR_PX = 6.2


def color(rank: int) -> str:
    """The chart and legend colour of ``rank``."""
    return COLORS[rank % len(COLORS)]


def linear_ticks(lo: float, hi: float, count: int = 5) -> tuple[list[float], float]:
    """Round ticks (1, 2 or 5 x 10^k apart) covering [lo, hi]: (ticks, step); the first and last
    tick are the axis' ends."""
    if not hi > lo:
        lo, hi = lo - 0.5, hi + 0.5
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if raw <= m * magnitude * (1 + 1e-9))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)], step


def log_ticks(lo: float, hi: float) -> tuple[list[tuple[float, bool]], int, int]:
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


def tick_label(value: float, step: float) -> str:
    """A tick value with the decimals its spacing needs: 0.002, 0.75, 1500, 1.2e-05."""
    if value == 0:
        return "0"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if decimals <= 4 and abs(value) < 1e6:
        return f"{value:.{decimals}f}"
    digits = max(1, math.floor(math.log10(abs(value))) - math.floor(math.log10(step)) + 1)
    return _short_exponent(f"{value:.{digits - 1}e}")


def log_label(value: float) -> str:
    return _short_exponent(f"{value:g}")


def _short_exponent(text: str) -> str:
    mantissa, _, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else text


def x_axis(x0: float, x1: float, sx: Callable[[float], float], left: float, pw: float, base: float) -> list[str]:
    """Tick marks and labels of the step axis: both ends labelled with their step, round steps
    between them where their label does not run into an end's."""
    integral = float(x0).is_integer() and float(x1).is_integer()
    ticks, step = linear_ticks(x0, x1, count=6)
    if integral:
        step = max(step, 1)
    label: Callable[[float], str] = (lambda v: f"{v:.0f}") if integral else (lambda v: tick_label(v, step))
    ends = [(x0, label(x0), "start"), (x1, label(x1), "end")] if x1 > x0 else [(x0, label(x0), "start")]
    out = []
    for value, text, anchor in ends:
        x = sx(value)
        out.append(f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}" stroke="#bbb"/>'
                   f'<text class="jr-xtick" x="{x:.1f}" y="{base + 14}" text-anchor="{anchor}">'
                   f"{text}</text>")
    # an end label and a round tick keep at least 3 characters between them
    room = [(sx(v) - CHAR_PX * (len(t) + 3), sx(v) + CHAR_PX * (len(t) + 3)) for v, t, _ in ends]
    for value in ticks:
        if not x0 < value < x1:
            continue
        text, x = label(value), sx(value)
        half = CHAR_PX * len(text) / 2
        if any(x - half < end and x + half > start for start, end in room):
            continue
        out.append(f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}" stroke="#bbb"/>'
                   f'<text class="jr-xtick" x="{x:.1f}" y="{base + 14}" text-anchor="middle">'
                   f"{text}</text>")
    out.append(f'<text x="{left + pw / 2:.1f}" y="{base + 27}" text-anchor="middle">step</text>')
    return out


def legend_entry(x: float, index: int, top: float, stroke: str, label: str, width: float = 2) -> str:
    """The chart's legend line ``index`` at ``x`` (right of the plot): a stroke sample and its
    label (already HTML-escaped)."""
    ly = top + 12 + 14 * index
    return (f'<line x1="{x + 10}" y1="{ly - 4}" x2="{x + 26}" y2="{ly - 4}" stroke="{stroke}" '
            f'stroke-width="{width:g}"/><text x="{x + 30}" y="{ly}">{label}</text>')
