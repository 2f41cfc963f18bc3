"""``%ring timeline``: every rank's recent collectives drawn as static SVG in the cell's output.

A track per rank, each collective a bar (kind and name, bytes and time in its tooltip), its
top-level phases (agreement, reduce-scatter, allgather, shared-memory copies) as a strip under
it; the gaps between bars are the rank's compute. The straggler is the rank that arrived last, by
more than 1 ms, at more than half of the collectives every rank ran (matched across ranks by
kind, name and order): its track is marked; where no rank is, none is. Plain HTML/SVG, no
script, scaled to the output's width (a viewBox): a saved notebook shows it as it was.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ..runtime.internal import RecentRecord

__all__ = ["TimelineSummary", "summarize", "timeline_html", "timeline_text"]

# a rank is the straggler when it arrived last at more than this share of the matched collectives
STRAGGLER_SHARE = 0.5
LATE_S = 1e-3  # ... by more than this: arriving within it is arriving together

_KIND_COLOURS = {"allreduce": "#4c78a8", "allgather": "#59a14f", "broadcast": "#f28e2b",
                 "reducescatter": "#b07aa1", "alltoall": "#76b7b2", "barrier": "#9c755f"}
_PHASE_COLOURS = {"negotiate": "#bab0ac", "reduce_scatter": "#e15759", "allgather": "#59a14f",
                  "shm-copy-in": "#b07aa1", "shm-reduce": "#ff9da7", "shm-copy-out": "#edc948"}
# what the legend calls a phase (a strip), apart from the collectives (bars) of the same name
_PHASE_LABELS = {"negotiate": "agreement", "reduce_scatter": "ring reduce-scatter",
                 "allgather": "ring allgather", "shm-copy-in": "shared-memory copy in",
                 "shm-reduce": "shared-memory reduce", "shm-copy-out": "shared-memory copy out"}
_LABEL_W, _PLOT_W, _TRACK_H, _BAR_H, _PHASE_H, _AXIS_H = 230, 820, 40, 20, 6, 26


class TimelineSummary(NamedTuple):
    """Who arrived last, and by how much: the straggler, if any, is the rank that arrived last
    at more than ``STRAGGLER_SHARE`` of the matched collectives."""

    late_count: dict[int, int]       # rank -> collectives it arrived at last (by more than LATE_S)
    late_seconds: dict[int, float]   # rank -> summed lateness behind the first rank to arrive
    matched: int          # collectives seen on every rank
    straggler: int | None


def summarize(ranks: Mapping[int, Sequence[RecentRecord]]) -> TimelineSummary:
    """``ranks``: ``{rank: [record, ...]}`` (``Trace.recent``), matched across ranks by kind,
    name and occurrence."""
    seen: dict[tuple[str, str, int], dict[int, float]] = {}
    for rank, records in ranks.items():
        counter: dict[tuple[str, str], int] = {}
        for rec in records:
            key = (rec["kind"], rec["name"])
            counter[key] = counter.get(key, 0) + 1
            seen.setdefault((*key, counter[key]), {})[rank] = rec["start"]
    late_count = {r: 0 for r in ranks}
    late_seconds = {r: 0.0 for r in ranks}
    matched = 0
    for starts in seen.values():
        if len(starts) != len(ranks) or len(ranks) < 2:
            continue
        matched += 1
        first = min(starts.values())
        last_rank = max(starts, key=lambda r: starts[r])
        for r, t in starts.items():
            late_seconds[r] += t - first
        if starts[last_rank] - first > LATE_S:
            late_count[last_rank] += 1
    straggler = max(late_count, key=lambda r: (late_count[r], late_seconds[r]), default=None)
    if straggler is not None and late_count[straggler] <= STRAGGLER_SHARE * matched:
        straggler = None  # last now and then, as every rank is: nobody holds the others back
    return TimelineSummary(late_count, late_seconds, matched, straggler)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _top_phases(phases: Mapping[str, Sequence[float]]) -> list[tuple[str, float, float]]:
    """The phases worth a strip: agreement and each algorithm's stages, not per-step hops."""
    return [(name, s, e) for name, (s, e) in phases.items() if "[" not in name and "piece" not in name]


def timeline_html(ranks: Mapping[int, Sequence[RecentRecord]], seconds: float) -> str:
    """The SVG (in a div) of ``{rank: [record, ...]}`` over their time span."""
    starts = [rec["start"] for records in ranks.values() for rec in records]
    ends = [rec["end"] for records in ranks.values() for rec in records]
    order = sorted(ranks)
    summary = summarize(ranks)
    height = _AXIS_H + _TRACK_H * len(order) + 8
    width = _LABEL_W + _PLOT_W + 10
    # scaled to the output area's width (no wider than drawn): nothing is cut off at the right
    out = [f'<div class="jr-timeline"><svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'width="100%" style="max-width:{width}px" preserveAspectRatio="xMinYMin meet" '
           'font-family="sans-serif" font-size="11">']
    if not starts:
        out.append(f'<text x="4" y="16">no collectives on any rank in the last {seconds:g} s</text>')
        return "".join(out) + "</svg></div>"
    t0, t1 = min(starts), max(ends)
    span = max(t1 - t0, 1e-6)

    def x(t: float) -> float:
        return _LABEL_W + (t - t0) / span * _PLOT_W

    out += _axis_html(span, height)
    for index, rank in enumerate(order):
        out += _track_html(_AXIS_H + index * _TRACK_H, rank, ranks[rank], summary, x)
    out.append("</svg>")
    out.append(f'<div style="font:11px sans-serif;color:#555">last {seconds:g} s, '
               f'{_fmt_s(span)} shown; gaps: compute. {_legend(ranks)}<br>{_straggler_note(summary)}'
               '</div></div>')
    return "".join(out)


def _axis_html(span: float, height: float) -> list[str]:
    """The time axis over ``span`` seconds: ~6 ticks at a round step, with grid lines."""
    out: list[str] = []
    step = 10 ** len(str(int(span / 6 * 1e6))) / 1e6 / 10
    for mult in (1, 2, 5, 10):
        if span / (step * mult) <= 8:
            step *= mult
            break
    tick = 0.0
    while tick <= span + 1e-12:
        xi = _LABEL_W + tick / span * _PLOT_W
        out.append(f'<line x1="{xi:.1f}" y1="{_AXIS_H - 6}" x2="{xi:.1f}" y2="{height - 8}" '
                   'stroke="#e6e6e6"/>'
                   f'<text x="{xi:.1f}" y="{_AXIS_H - 10}" text-anchor="middle" fill="#666">'
                   f'{_fmt_s(tick) if tick else "0"}</text>')
        tick += step
    return out


def _track_html(y: float, rank: int, records: Sequence[RecentRecord], summary: TimelineSummary,
                x: Callable[[float], float]) -> list[str]:
    """One rank's track at height ``y``: its label and lateness, a bar per collective (``x``:
    time to position) with a strip per phase."""
    out: list[str] = []
    straggler = rank == summary.straggler
    label = f"rank {rank}: {len(records)} collectives"
    note = (f"straggler: last in {summary.late_count[rank]}/{summary.matched}" if straggler
            else f"last in {summary.late_count.get(rank, 0)}/{summary.matched}")
    colour = "#c0392b" if straggler else "#333"
    flag = ' data-straggler="true"' if straggler else ""
    out.append(f'<g class="track" data-rank="{rank}"{flag}>'
               f'<rect x="{_LABEL_W}" y="{y + 2}" width="{_PLOT_W}" height="{_TRACK_H - 4}" '
               f'fill="{"#fdecea" if straggler else "#f7f7f7"}"/>'
               f'<text x="4" y="{y + 16}" fill="{colour}" font-weight="bold">{label}</text>'
               f'<text x="4" y="{y + 30}" fill="{colour}">{note}</text>')
    for rec in records:
        bx, bw = x(rec["start"]), max(1.0, x(rec["end"]) - x(rec["start"]))
        phases = _top_phases(rec["phases"])
        tip = (f'{rec["kind"]} \'{rec["name"]}\': {_fmt_bytes(rec["bytes"])}, '
               f'{_fmt_s(rec["end"] - rec["start"])}' +
               "".join(f"\n  {p} {_fmt_s(e - s)}" for p, s, e in phases))
        fill = _KIND_COLOURS.get(rec["kind"], "#888")
        out.append(f'<g class="bar" data-kind="{html.escape(rec["kind"])}" '
                   f'data-name="{html.escape(rec["name"], quote=True)}">'
                   f'<title>{html.escape(tip)}</title>'
                   f'<rect x="{bx:.2f}" y="{y + 6}" width="{bw:.2f}" height="{_BAR_H}" '
                   f'fill="{fill}"/>')
        for p, s, e in phases:
            out.append(f'<rect class="phase" x="{x(s):.2f}" y="{y + 6 + _BAR_H + 1}" '
                       f'width="{max(0.5, x(e) - x(s)):.2f}" height="{_PHASE_H}" '
                       f'fill="{_PHASE_COLOURS.get(p, "#999")}"/>')
        if bw > 60:
            text = f'{rec["name"]} {_fmt_bytes(rec["bytes"])}'
            out.append(f'<text x="{bx + 3:.2f}" y="{y + 20}" fill="white" '
                       f'clip-path="inset(0)">{html.escape(text[:int(bw / 6.5)])}</text>')
        out.append("</g>")
    out.append("</g>")
    return out


def _legend(ranks: Mapping[int, Sequence[RecentRecord]]) -> str:
    """The colours drawn, each once: the collectives' (bars), then their phases' (strips)."""
    kinds: set[str] = set()
    phases: set[str] = set()
    for records in ranks.values():
        for rec in records:
            kinds.add(rec["kind"])
            phases.update(name for name, _s, _e in _top_phases(rec["phases"]))

    def swatches(table: dict[str, str], present: set[str], label: Callable[[str], str] = lambda k: k) -> str:
        return " ".join(f'<span style="color:{c}">■ {html.escape(label(k))}</span>'
                        for k, c in table.items() if k in present)
    parts = [f"bars: {swatches(_KIND_COLOURS, kinds)}" if kinds & set(_KIND_COLOURS) else "",
             f"strips: {swatches(_PHASE_COLOURS, phases, _PHASE_LABELS.__getitem__)}" if phases & set(_PHASE_COLOURS) else ""]
    return "; ".join(p for p in parts if p)


def _straggler_note(summary: TimelineSummary) -> str:
    """What makes a straggler, and who is one (or that nobody is)."""
    rule = (f"a straggler arrives last (by more than {LATE_S * 1e3:g} ms) at more than "
            f"{STRAGGLER_SHARE:.0%} of the {summary.matched} collectives every rank ran")
    if summary.straggler is None:
        return f"no straggler: {rule}"
    return (f"straggler: rank {summary.straggler}, last at {summary.late_count[summary.straggler]} of "
            f"{summary.matched} ({rule})")


def timeline_text(ranks: Mapping[int, Sequence[RecentRecord]], seconds: float) -> str:
    """A plain-text summary (the output's text/plain): per rank, collectives, time, lateness."""
    summary = summarize(ranks)
    lines = [f"timeline of the last {seconds:g} s ({summary.matched} collectives on every rank)"]
    for rank in sorted(ranks):
        records = ranks[rank]
        busy = sum(r["end"] - r["start"] for r in records)
        mark = "  <- straggler" if rank == summary.straggler else ""
        lines.append(f"rank {rank}: {len(records)} collectives, {_fmt_s(busy)} in them, last in "
                     f"{summary.late_count.get(rank, 0)}, {_fmt_s(summary.late_seconds.get(rank, 0.0))} "
                     f"late in all{mark}")
    return "\n".join(lines)
