"""The static form of the rank tabs (``RankTabs.html``): tabs in HTML and CSS alone, every
output once in arrival order, classed by its rank, so a notebook reopened without a kernel (or
nbconvert, GitHub) shows them."""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Collection, Sequence
from typing import Any, TypeAlias

from ..cluster import rank_ranges

__all__ = ["page", "strip_ansi"]

# An output as nbformat writes it ({"output_type": "stream", "name": ..., "parts": [...]}, a
# display_data or an error) and a MIME bundle: JSON values of any kind, hence Any.
Item: TypeAlias = dict[str, Any]
Bundle: TypeAlias = dict[str, Any]
# (the rank, or the ranks of a folded line; where it shows: _BOTH, _ONE, _ALL; the item)
LogEntry: TypeAlias = tuple[int | tuple[int, ...], str, Item]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI.sub("", text)


def _tag(ranks: Sequence[int]) -> str:
    """``[rank 3] `` or ``[ranks 0-2, 5] ``."""
    return f"[rank {ranks[0]}] " if len(ranks) == 1 else f"[ranks {rank_ranges(ranks)}] "


_FOLDED = "folded"  # the budget key of the folded lines of "all ranks" in _body


# Where a logged item shows: both in "all ranks" and in its rank's tab, only in its rank's tab
# (rich output, tracebacks), only in "all ranks" (their one-line labels).
_BOTH, _ONE, _ALL = "jr-b", "jr-o", "jr-a"


def page(ranks: Sequence[int], failed: Collection[int], titles: Sequence[str], selected: int, log: Sequence[LogEntry],
         folding: bool, limit: int) -> str:
    """The rank tabs in HTML and CSS (radio buttons), no JavaScript: ``titles`` ("all ranks"
    first), the ``selected`` tab's index, the ``failed`` ranks, the ``log`` of (rank or folded
    ranks, where, item) in arrival order, each rank's stream text cut to its last ``limit``
    characters (``folding``: "all ranks" holds folded lines).

    Every output is in the page once, in arrival order, classed by its rank: the "all ranks"
    tab shows the stream lines with their ``[rank r]`` tags (and a one-line label for each
    rich output or error), a rank's tab shows that rank's items untagged (rich outputs and
    tracebacks in full). Without CSS the page reads as the tagged lines with the rich
    outputs in place.
    """
    uid = "jr" + uuid.uuid4().hex[:12]
    css = (f"#{uid}>input{{display:none}}"
           f"#{uid}>label{{display:inline-block;padding:2px 12px;margin-right:2px;"
           "cursor:pointer;border:1px solid var(--jp-border-color1,#ccc);border-bottom:none;"
           "border-radius:3px 3px 0 0;background:var(--jp-layout-color2,#eee);"
           "font-family:var(--jp-ui-font-family,sans-serif);font-size:12px}"
           f"#{uid}>input:checked+label{{background:var(--jp-layout-color0,#fff);"
           "font-weight:600}"
           f"#{uid}>label.jr-failed{{color:#c62828;border-color:#c62828}}"
           f"#{uid}>.jr-panel{{border:1px solid var(--jp-border-color1,#ccc);"
           "padding:4px 6px;max-height:32em;overflow:auto}"
           f"#{uid}>.jr-panel>*{{display:none}}"
           f"#{uid} pre{{margin:0;white-space:pre-wrap}}"
           f"#{uid} i{{font-style:normal}}"
           f"#{uid} .jr-stderr{{background:var(--jp-rendermime-error-background,#fdd)}}"
           f"#{uid} .jr-error{{color:#c62828}}"
           f"#{uid}>input:nth-of-type(1):checked~.jr-panel>:not(.{_ONE}){{display:block}}")
    for i, rank in enumerate(ranks):
        on = f"#{uid}>input:nth-of-type({i + 2}):checked~.jr-panel"
        css += f"{on}>.jr-r{rank}:not(.{_ALL}){{display:block}}{on} i{{display:none}}"
    parts = [f'<div class="jr-rank-tabs" id="{uid}"><style>{css}</style>']
    for i, title in enumerate(titles):
        checked = " checked" if i == selected else ""
        marked = ' class="jr-failed"' if i and ranks[i - 1] in failed else ""
        parts.append(f'<input type="radio" name="{uid}" id="{uid}-{i}"{checked}>'
                     f'<label for="{uid}-{i}"{marked}>{html.escape(title)}</label>')
    parts.append('<div class="jr-panel">')
    parts.extend(_body(ranks, log, folding, limit))
    parts.append("</div></div>")
    return "".join(parts)


def _body(ranks: Sequence[int], log: Sequence[LogEntry], folding: bool, limit: int) -> list[str]:
    """The logged items as HTML, each rank's stream text (and the folded lines of "all
    ranks", together) cut to its last ``limit`` characters."""
    budget: dict[int | str, int] = dict.fromkeys([*ranks, _FOLDED], limit)
    cut: dict[int | str, int] = dict.fromkeys([*ranks, _FOLDED], 0)
    out = []
    for rank, where, item in reversed(log):
        folded = isinstance(rank, tuple)  # a folded line: its ranks
        cls = f"jr-fold {where}" if folded else f"jr-r{rank} {where}"
        if item["output_type"] != "stream":
            out.append(_item_html(item, cls))
            continue
        text = "".join(item["parts"])
        tag = _tag(rank) if isinstance(rank, tuple) else f"[rank {rank}] "
        if where == _ALL and not folded:  # a one-line label in the "all ranks" tab: not counted
            out.append(_stream_html(item["name"], text, cls, tag))
            continue
        key = _FOLDED if isinstance(rank, tuple) else rank
        if budget[key] <= 0:
            cut[key] += len(text)
            continue
        if len(text) > budget[key]:
            keep = text[len(text) - budget[key]:]
            keep = keep[keep.find("\n") + 1:] if "\n" in keep[:-1] else keep
            cut[key] += len(text) - len(keep)
            text = keep
        budget[key] -= len(text)
        out.append(_stream_html(item["name"], text, cls, tag))
    shown = {rank for rank, where, _ in log if where != _ALL}
    for rank in ranks:
        if cut[rank]:
            note = (f"… earlier output of rank {rank} not shown here ({cut[rank]:,} "
                    "characters; the text/plain form of this output keeps more)\n")
            where = _ONE if folding else _BOTH
            out.append(_stream_html("stdout", note, f"jr-r{rank} {where}", f"[rank {rank}] "))
        elif rank not in shown:
            out.append(f'<pre class="jr-r{rank} {_ONE}">(no output)</pre>')
    if cut[_FOLDED]:
        note = (f"… earlier output not shown here ({cut[_FOLDED]:,} characters; the text/plain "
                "form of this output keeps more)\n")
        out.append(_stream_html("stdout", note, f"jr-fold {_ALL}", ""))
    if not log:
        out.append(f'<pre class="{_ALL}">(no output)</pre>')
    return out[::-1]


def _stream_html(name: str, text: str, cls: str, tag: str) -> str:
    """Stream text as one <pre>, each line led by ``tag`` (``[rank r] ``; shown in "all ranks")."""
    if name == "stderr":
        cls += " jr-stderr"
    body = html.escape(strip_ansi(text))
    tag = f"<i>{html.escape(tag)}</i>" if tag else ""
    trail = body.endswith("\n")
    if trail:
        body = body[:-1]
    body = tag + body.replace("\n", "\n" + tag) + ("\n" if trail else "")
    return f'<pre class="{cls}">{body}</pre>'


def _item_html(item: Item, cls: str) -> str:
    if item["output_type"] == "error":
        tb = strip_ansi("\n".join(item["traceback"]))
        return f'<pre class="{cls} jr-error">{html.escape(tb)}</pre>'
    return f'<div class="{cls}">{_data_html(item.get("data") or {})}</div>'


def _data_html(data: Bundle) -> str:
    """One display bundle as HTML: the richest format a static page can show."""
    if "text/html" in data:
        return f"<div>{_join(data['text/html'])}</div>"
    if "image/svg+xml" in data:
        return f"<div>{_join(data['image/svg+xml'])}</div>"
    for mime in ("image/png", "image/jpeg", "image/gif"):
        if mime in data:
            return f'<img src="data:{mime};base64,{_join(data[mime]).strip()}">'
    if "text/markdown" in data:
        return f"<pre>{html.escape(_join(data['text/markdown']))}</pre>"
    return f"<pre>{html.escape(strip_ansi(_join(data.get('text/plain', ''))))}</pre>"


def _join(value: object) -> str:
    return "".join(value) if isinstance(value, list) else str(value)
