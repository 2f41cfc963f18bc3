"""Where a ``%%distributed`` cell's output goes: rank-tagged text, or a tab per rank.

Two sinks with the same methods, chosen by the magics:

- :class:`TextSink` writes each line to the kernel's stdout/stderr tagged ``[rank r]`` (the
  plain form: terminals, plain IPython, ``--output text``).
- :class:`RankTabs` shows, while the cell runs, an ipywidgets ``Tab`` with an "all ranks" tab
  (the rank-tagged lines) and an ``Output`` per rank (that rank's stdout, stderr, rich output and
  error). When the cell ends, the same display is replaced (``update_display``) by a static
  bundle: ``text/html`` tabs that switch with CSS alone (every output is in the page once, classed
  by rank; each tab's rule shows its part), and ``text/plain`` holding exactly the rank-tagged
  lines of the plain form. The widgets are then closed.

From ``FOLD_FROM`` ranks on, a line that several ranks print alike shows once in "all ranks" and
in the text form, tagged with its ranks (``[ranks 0-63] epoch 1 done``): :class:`LineFold` holds
each line back until every rank printed it or ``FOLD_HOLD`` seconds passed. The rank tabs keep
every rank's own lines, untouched and at once.

Why replace the widget at the end: a saved notebook reopened without a kernel cannot render a
widget whose state was not saved (JupyterLab shows "Error displaying widget"), while HTML and
plain text render everywhere (JupyterLab, Notebook 7, VS Code, nbconvert, GitHub) and nbclient,
nbconvert ``--to script``/``markdown`` and terminals read the ``text/plain``. One output holds
both forms, so nothing is shown twice. Nothing at all is displayed for a cell that prints
nothing and succeeds, so a trivial cell creates no widget.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias, cast

from ..cluster import rank_ranges
from ._tabs_html import _ALL, _BOTH, _ONE, Bundle, Item, LogEntry, _join, _tag, page, strip_ansi

__all__ = ["TextSink", "RankTabs", "strip_ansi"]

# The live widget shows at most this many characters per tab (the tail); the final static view
# and the text/plain keep everything up to FINAL_MAX characters per tab.
LIVE_MAX = 256 * 1024
FINAL_MAX = 8 * 1024 * 1024
# Seconds between widget updates while output flows. The live widget itself appears no sooner
# than this after the cell starts (a failure shows at once): a cell that prints and ends sooner
# goes straight to its static view, without a widget made and thrown away (for a cell printing
# 1 MB per rank, that was ~15 % of its time).
LIVE_PERIOD = 0.1
# From this many ranks on, identical lines of several ranks are folded into one (see LineFold);
# a line waits FOLD_HOLD seconds for its copies from the other ranks, and as long again after
# each copy that came, FOLD_HOLD_MAX seconds at most: 64 ranks on 2 cores under load print one
# line over more than FOLD_HOLD, and a fixed hold cut it into two folded lines.
FOLD_FROM = 5
FOLD_HOLD = 0.5
FOLD_HOLD_MAX = 5.0

# One live display of the tabs: (ipywidgets Tab, its Output per tab, the display id); ipywidgets
# ships no annotations, hence Any.
_View: TypeAlias = "tuple[Any, list[Any], str]"


class _Group:
    """One line (of one stream) as printed by ``ranks`` so far; ``since``: its first arrival,
    ``last``: its latest."""

    __slots__ = ("name", "line", "ranks", "since", "last")

    def __init__(self, name: str, line: str, rank: int, since: float) -> None:
        self.name, self.line, self.ranks, self.since, self.last = name, line, {rank}, since, since


class LineFold:
    """Identical lines of several ranks as one line tagged with their ranks.

    A rank's line joins the oldest held group of the same stream and text that lacks that rank
    (so a rank printing one line twice makes two groups), else starts a group. Groups leave in
    the order of their first line, once every rank is in, or once ``hold`` seconds passed without
    a copy coming (a line no other rank prints waits that long), or ``hold_max`` seconds after
    their first line; ``take(None)`` empties it.
    """

    def __init__(self, ranks: Iterable[int], hold: float = FOLD_HOLD, hold_max: float = FOLD_HOLD_MAX) -> None:
        self.size = len(set(ranks))
        self.hold, self.hold_max = hold, hold_max
        self.groups: deque[_Group] = deque()  # held groups, oldest first
        self.open: dict[tuple[str, str], list[_Group]] = {}  # (stream, line) -> its held groups, oldest first

    def add(self, rank: int, name: str, lines: Iterable[str], now: float) -> None:
        for line in lines:
            key = (name, line)
            for group in self.open.get(key, ()):
                if rank not in group.ranks:
                    group.ranks.add(rank)
                    group.last = now
                    break
            else:
                group = _Group(name, line, rank, now)
                self.groups.append(group)
                self.open.setdefault(key, []).append(group)

    def take(self, now: float | None) -> list[tuple[str, tuple[int, ...], str]]:
        """The groups that may leave at ``now`` (all of them when ``now`` is None), oldest first,
        as ``(stream, sorted ranks, line)``; a held group keeps every later one back."""
        out = []
        groups = self.groups
        while groups:
            group = groups[0]
            if (now is not None and len(group.ranks) < self.size and now - group.last < self.hold
                    and now - group.since < self.hold_max):
                break  # copies still coming
            groups.popleft()
            held = self.open[group.name, group.line]
            held.remove(group)
            if not held:
                del self.open[group.name, group.line]
            out.append((group.name, tuple(sorted(group.ranks)), group.line))
        return out

    def __bool__(self) -> bool:
        return bool(self.groups)


class TextSink:
    """The plain form: each line to stdout/stderr, tagged ``[rank r] `` unless ``tag`` is False.

    Given ``ranks`` (``FOLD_FROM`` or more), lines that several ranks print alike are folded."""

    def __init__(self, tag: bool = True, ranks: Sequence[int] = ()) -> None:
        self.tag = tag
        self.fold = LineFold(ranks) if tag and len(ranks) >= FOLD_FROM else None

    def text(self, rank: int, name: str, lines: Sequence[str]) -> None:
        if self.fold is not None:
            self.fold.add(rank, name, lines, time.monotonic())
            self._release(time.monotonic())
            return
        stream = sys.stdout if name == "stdout" else sys.stderr
        stream.write(_tagged(rank, lines) if self.tag else "\n".join(lines) + "\n")
        stream.flush()

    def _release(self, now: float | None) -> None:
        """Print the folded lines that may leave (all of them when ``now`` is None)."""
        if not self.fold:
            return
        for name, ranks, line in self.fold.take(now):
            stream = sys.stdout if name == "stdout" else sys.stderr
            stream.write(f"{_tag(ranks)}{line}\n")
            stream.flush()

    def add_rank(self, rank: int) -> None:
        """A rank that joined while the cell runs (host discovery grew the world)."""
        if self.fold is not None:
            self.fold.size += 1

    def display(self, rank: int, data: Bundle, metadata: dict[str, Any]) -> None:
        from IPython.display import display

        self._release(None)
        print(f"[rank {rank}]")
        display(data, raw=True, metadata=metadata)

    def result(self, rank: int, data: Bundle, metadata: dict[str, Any]) -> None:
        from IPython.display import display

        self._release(None)
        if set(data) <= {"text/plain"}:
            print(f"[rank {rank}] Out: {data.get('text/plain', '')}")
        else:
            print(f"[rank {rank}] Out:")
            display(data, raw=True, metadata=metadata)

    def error(self, rank: int, error: object, label: str = "", lines: Iterable[str] | None = None) -> None:
        pass  # the DistributedError below the output names every failed rank

    def fail(self, rank: int, label: str = "✗") -> None:
        pass

    def select(self, rank: int) -> None:
        pass

    def attach(self) -> None:
        pass  # the text goes out as it comes: a reopened page shows it from now on

    def flush(self, force: bool = False) -> None:
        self._release(None if force else time.monotonic())

    def finish(self) -> None:
        self._release(None)


class _Panel:
    """One live tab's outputs, as nbformat-like dicts (consecutive stream text merged).

    Stream text is kept as a list of parts and joined only for the tail that is shown: appending
    to one growing string would copy it on every batch (quadratic in the cell's output).
    """

    def __init__(self, title: str) -> None:
        self.title = title
        self.items: list[Item] = []
        self.chars = 0

    def add_stream(self, name: str, text: str) -> None:
        self.chars += len(text)
        last = self.items[-1] if self.items else None
        if last is not None and last["output_type"] == "stream" and last["name"] == name:
            last["parts"].append(text)
            last["chars"] += len(text)
        else:
            self.items.append({"output_type": "stream", "name": name, "parts": [text],
                               "chars": len(text)})

    def add(self, item: Item) -> None:
        self.items.append(item)

    def tail(self, limit: int) -> list[Item]:
        """The items, with stream text cut to the last ``limit`` characters in all."""
        out, budget = [], limit
        for item in reversed(self.items):
            if item["output_type"] != "stream":
                out.append(dict(item))
                continue
            if budget <= 0:
                continue
            parts, taken = [], 0
            for part in reversed(item["parts"]):
                parts.append(part)
                taken += len(part)
                if taken >= budget:
                    break
            text = "".join(reversed(parts))
            if len(text) > budget:
                text = text[len(text) - budget:]
                text = text[text.find("\n") + 1:] if "\n" in text else text
            budget -= len(text)
            out.append({"output_type": "stream", "name": item["name"], "text": text})
        if self.chars > limit:
            out.append({"output_type": "stream", "name": "stdout",
                        "text": f"… earlier output not shown here ({self.chars - limit:,} "
                                "characters or more)\n"})
        return out[::-1]


class RankTabs:
    """A tab per rank plus "all ranks": live ipywidgets while the cell runs, static at the end."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks = list(ranks)
        self.all = _Panel("all ranks")
        self.panels = {r: _Panel(f"rank {r}") for r in self.ranks}
        self.plain: list[str] = []       # the rank-tagged lines, as the text form prints them
        self.log: list[LogEntry] = []    # (rank, where, item) in arrival order, for the static view
        self.failed: dict[int, str] = {}  # rank -> title mark, in order of failure
        self.selected: int | None = None  # rank whose tab is selected (None: "all ranks")
        self.display_id: str | None = None
        self.tab: Any = None             # the live ipywidgets Tab (untyped package)
        self.outputs: list[Any] | None = None
        self._more: list[_View] = []     # (tab, outputs, display_id) shown again for a reopened page
        self._dirty = False
        self._last_push = time.monotonic()  # the cell's start: the first push waits a period
        self._finished = False
        self.fold = LineFold(self.ranks) if len(self.ranks) >= FOLD_FROM else None

    def add_rank(self, rank: int) -> None:
        """A tab for a rank that joined while the cell runs (host discovery grew the world)."""
        if rank in self.panels:
            return
        self.ranks.append(rank)
        self.panels[rank] = _Panel(f"rank {rank}")
        if self.fold is not None:
            self.fold.size += 1
        if self.tab is not None:
            from ipywidgets import Layout, Output

            for tab, outputs, _ in self._views():
                out = Output(layout=Layout(max_height="32em", overflow="auto"))
                outputs.append(out)
                tab.children = (*tab.children, out)
        self._changed(force=True)

    # ------------------------------------------------------------------------------ content
    def text(self, rank: int, name: str, lines: Sequence[str]) -> None:
        text = "\n".join(lines) + "\n"
        self.panels[rank].add_stream(name, text)
        if self.fold is not None:  # "all ranks" gets them folded, as they leave the fold
            self._log(rank, _ONE, {"output_type": "stream", "name": name, "text": text})
            self.fold.add(rank, name, lines, time.monotonic())
            self._release(time.monotonic())
            return
        tagged = _tagged(rank, lines)
        self.all.add_stream(name, tagged)
        self.plain.append(tagged)
        self._log(rank, _BOTH, {"output_type": "stream", "name": name, "text": text})
        self._changed()

    def _release(self, now: float | None) -> None:
        """Folded lines that may leave (all when ``now`` is None) into "all ranks" and the text."""
        if not self.fold:
            return
        for name, ranks, line in self.fold.take(now):
            tagged = f"{_tag(ranks)}{line}\n"
            self.all.add_stream(name, tagged)
            self.plain.append(tagged)
            self._log(ranks, _ALL, {"output_type": "stream", "name": name, "text": line + "\n"})
            self._changed()

    def display(self, rank: int, data: Bundle, metadata: dict[str, Any]) -> None:
        self._release(None)  # what came before it leaves first
        self.panels[rank].add({"output_type": "display_data", "data": data,
                               "metadata": metadata})
        label = _short_repr(data)
        self.all.add_stream("stdout", f"[rank {rank}] {label}\n")
        self.plain.append(f"[rank {rank}]\n{data.get('text/plain', label)}\n")
        self._log(rank, _ONE, {"output_type": "display_data", "data": data})
        self._log(rank, _ALL, {"output_type": "stream", "name": "stdout", "text": f"{label}\n"})
        self._changed()

    def result(self, rank: int, data: Bundle, metadata: dict[str, Any]) -> None:
        self._release(None)
        text = data.get("text/plain", "")
        if set(data) <= {"text/plain"}:
            self.panels[rank].add_stream("stdout", f"Out: {text}\n")
            line = f"[rank {rank}] Out: {text}\n"
            self.all.add_stream("stdout", line)
            self.plain.append(line)
            self._log(rank, _BOTH, {"output_type": "stream", "name": "stdout",
                                    "text": f"Out: {text}\n"})
        else:
            self.panels[rank].add_stream("stdout", "Out:\n")
            self.panels[rank].add({"output_type": "display_data", "data": data,
                                   "metadata": metadata})
            self.all.add_stream("stdout", f"[rank {rank}] Out: {_short_repr(data)}\n")
            self.plain.append(f"[rank {rank}] Out:\n{text}\n")
            self._log(rank, _ONE, {"output_type": "stream", "name": "stdout", "text": "Out:\n"})
            self._log(rank, _ONE, {"output_type": "display_data", "data": data})
            self._log(rank, _ALL, {"output_type": "stream", "name": "stdout",
                                   "text": f"Out: {_short_repr(data)}\n"})
        self._changed()

    def error(self, rank: int, error: object, label: str = "", lines: Iterable[str] | None = None) -> None:
        """Put a rank's remote error (ipyparallel RemoteError or any exception) in its tab;
        ``lines``: what to show instead of its whole traceback."""
        self._release(None)
        ename = getattr(error, "ename", None) or type(error).__name__
        evalue = str(getattr(error, "evalue", error))
        tb = getattr(error, "traceback", None)
        if lines is None:
            lines = str(tb).splitlines() if tb else [f"{ename}: {evalue}"]
        lines = list(lines)
        if label:
            lines.append(label)
        error_item = {"output_type": "error", "ename": ename, "evalue": evalue,
                      "traceback": lines}
        self.panels[rank].add(error_item)
        summary = f"{ename}: {_first_line(evalue)}{' (' + label + ')' if label else ''}\n"
        self.all.add_stream("stderr", f"[rank {rank}] {summary}")
        self._log(rank, _ONE, error_item)
        self._log(rank, _ALL, {"output_type": "stream", "name": "stderr", "text": summary})
        self._changed()

    def _log(self, rank: int | tuple[int, ...], where: str, item: Item) -> None:
        """Note an item for the static view; a stream continuing the last one is merged."""
        if item["output_type"] == "stream":
            if self.log:
                last_rank, last_where, last = self.log[-1]
                if (last_rank, last_where, last["output_type"], last.get("name")) == (
                        rank, where, "stream", item["name"]):
                    last["parts"].append(item["text"])
                    return
            item = {"output_type": "stream", "name": item["name"], "parts": [item["text"]]}
        self.log.append((rank, where, item))

    def fail(self, rank: int, label: str = "✗") -> None:
        """Mark a rank's tab (title ``rank r ✗``); the first marked rank's tab is selected. A
        rank marked plainly (its engine's error came first) takes a later, more telling label
        (``✗ dead`` once its death is diagnosed)."""
        if rank not in self.panels or self.failed.get(rank) == label or (rank in self.failed and label == "✗"):
            return
        self.failed[rank] = label
        if self.selected is None:
            self.selected = rank
        self._changed(force=True)

    def select(self, rank: int) -> None:
        """Select this rank's tab (the headline failure) instead of the first marked one."""
        if rank in self.panels:
            self.selected = rank
            self._changed(force=True)

    # --------------------------------------------------------------------------- live view
    def _changed(self, force: bool = False) -> None:
        self._dirty = True
        if force:
            self._last_push = 0.0

    def _titles(self) -> list[str]:
        titles = ["all ranks"]
        for r in self.ranks:
            titles.append(f"rank {r} {self.failed[r]}" if r in self.failed else f"rank {r}")
        return titles

    def _index(self) -> int:
        return 0 if self.selected is None else 1 + self.ranks.index(self.selected)

    def flush(self, force: bool = False) -> None:
        """Push new output to the live widget (at most every LIVE_PERIOD seconds; ``force``: now,
        with every folded line held, as before a debugger's prompt, while which nothing else is
        pushed)."""
        self._release(None if force else time.monotonic())
        if not self._dirty or self._finished:
            return
        now = time.monotonic()
        if now - self._last_push < LIVE_PERIOD and not force:
            return
        self._last_push = now
        self._dirty = False
        if self.tab is None:
            self.tab, self.outputs, self.display_id = self._create()
        panels = [self.all] + [self.panels[r] for r in self.ranks]
        for tab, outputs, _ in self._views():
            with tab.hold_sync():
                for out, panel in zip(outputs, panels):
                    items = tuple(panel.tail(LIVE_MAX))
                    if items != out.outputs:
                        out.outputs = items
                tab.titles = tuple(self._titles())
                tab.selected_index = self._index()

    def attach(self) -> None:
        """Show the live tabs again, as new widgets with the same content (a notebook reopened
        while the cell runs asked for its live view: see ``jupyter_ring._live``); nothing before
        the tabs are first shown, which then reach the page as they come."""
        if self.tab is None or self._finished:
            return
        self._more.append(self._create())
        self._changed(force=True)
        self.flush()

    def _views(self) -> list[_View]:
        """Each live display of the tabs: (tab, outputs, display_id)."""
        first = cast("_View", (self.tab, self.outputs, self.display_id))  # (set together by _create)
        return [first] + self._more if self.tab else []

    def _create(self) -> _View:
        from IPython.display import display
        from ipywidgets import Layout, Output, Tab

        outputs = [Output(layout=Layout(max_height="32em", overflow="auto"))
                   for _ in range(len(self.ranks) + 1)]
        tab = Tab(children=outputs, titles=self._titles(), selected_index=self._index())
        tab.add_class("jr-rank-tabs")
        display_id = uuid.uuid4().hex
        bundle = {"text/plain": f"(output of ranks {rank_ranges(self.ranks)}: shown when the cell "
                                "ends)",
                  "application/vnd.jupyter.widget-view+json": {
                      "version_major": 2, "version_minor": 0, "model_id": tab.model_id}}
        display(bundle, raw=True, display_id=display_id)
        return tab, outputs, display_id

    # ------------------------------------------------------------------------------- finish
    def finish(self) -> None:
        """Replace the live widget with the static HTML + plain-text bundle; close the widgets."""
        if self._finished:
            return
        self._release(None)
        self._finished = True
        if self.tab is None and not self._has_content():
            return  # nothing printed, nothing failed: no output at all
        from IPython.display import display, update_display

        bundle = {"text/plain": self.plain_text(), "text/html": self.html()}
        metadata = {"jupyter_ring": {"ranks": self.ranks, "failed": sorted(self.failed),
                                     "selected": self.selected}}
        if self.tab is None:
            display(bundle, raw=True, metadata=metadata)
            return
        for tab, outputs, display_id in self._views():
            update_display(bundle, raw=True, metadata=metadata, display_id=display_id)
            try:
                with tab.hold_sync():  # nbclient keeps closed widgets' state: keep it small
                    for out in outputs:
                        out.outputs = ()
                for out in outputs:
                    out.close()
                tab.close()
            except Exception:  # a closed comm must not turn a finished cell into an error
                pass

    def html(self) -> str:
        """The static tabs, in HTML and CSS (radio buttons), no JavaScript: ``_tabs_html.page``."""
        return page(self.ranks, self.failed, self._titles(), self._index(), self.log, self.fold is not None,
                    FINAL_MAX)

    def _has_content(self) -> bool:
        return bool(self.plain or self.failed
                    or any(p.items for p in self.panels.values()))

    def plain_text(self) -> str:
        """The rank-tagged lines (what TextSink would have printed), for text/plain."""
        text = "".join(self.plain)
        if len(text) > FINAL_MAX:
            text = (f"… {len(text) - FINAL_MAX:,} earlier characters not kept\n"
                    + text[-FINAL_MAX:])
        return strip_ansi(text).rstrip("\n") or f"(no output from ranks {rank_ranges(self.ranks)})"

def _tagged(rank: int, lines: Sequence[str]) -> str:
    """``lines`` (without their newlines) as text, each line led by ``[rank r] ``."""
    tag = f"[rank {rank}] "
    return tag + f"\n{tag}".join(lines) + "\n"


def _short_repr(data: Bundle) -> str:
    """``<image/png>``-style label of a rich output for the "all ranks" tab."""
    text = _first_line(_join(data.get("text/plain", "")))
    rich = [m for m in data if m != "text/plain"]
    if rich:
        return f"{text} <{rich[0]}>".strip() if text else f"<{rich[0]}>"
    return text


def _first_line(text: object) -> str:
    text = str(text).strip()
    return text.splitlines()[0] if text else ""
