"""Reading the static rank tabs of a %%distributed output (jupyter_ring.widgets._tabs.RankTabs.html)."""

from html.parser import HTMLParser


class _Tab(HTMLParser):
    """The text a reader sees in one tab of the static view: the panel's children that the
    page's rules show for that tab (see RankTabs.html), with the [rank r] tags of the "all
    ranks" tab removed in a rank's tab. The real CSS is checked in a browser
    (tests/browser/test_rank_tabs.py)."""

    def __init__(self, page, index, ranks):
        super().__init__()
        self.index, self.ranks = index, ranks
        self.depth, self.keep, self.tag_depth = 0, None, None
        self.parts, self.in_panel = [], False
        self.feed(page)

    def _shown(self, classes):
        if self.index == 0:
            return "jr-o" not in classes
        return f"jr-r{self.ranks[self.index - 1]}" in classes and "jr-a" not in classes

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if "jr-panel" in classes:
            self.in_panel, self.depth = True, 0
            return
        if not self.in_panel:
            return
        if tag in ("img", "br", "hr", "input"):  # void elements: no end tag follows
            if tag == "img" and self.keep:
                self.parts.append(f"<img {dict(attrs)['src']}>")
            return
        self.depth += 1
        if self.depth == 1:
            self.keep = self._shown(classes)
        if tag == "i" and self.index:
            self.tag_depth = self.depth

    def handle_endtag(self, tag):
        if not self.in_panel:
            return
        if self.tag_depth == self.depth:
            self.tag_depth = None
        self.depth -= 1
        if self.depth < 0:
            self.in_panel = False

    def handle_data(self, data):
        if self.in_panel and self.depth >= 1 and self.keep and self.tag_depth is None:
            self.parts.append(data)

    def text(self):
        return "".join(self.parts)


def tab_texts(page, ranks):
    """What each tab shows: [all ranks, rank ranks[0], ...] as text."""
    return [_Tab(page, i, ranks).text() for i in range(len(ranks) + 1)]
