"""Completion and inspection from rank 0 for the cells that run on the ranks.

``%load_ext jupyter_ring`` wraps this kernel's ``do_complete``/``do_inspect`` with
:class:`KernelShim`; ``%unload_ext`` restores them.
"""

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._cell import routes_to_ranks
from ._held_cluster import connected_client

if TYPE_CHECKING:
    from .magics import RingMagics

# A complete_reply's or inspect_reply's content (Jupyter's messaging protocol), as the kernel
# or rank 0 answered it: passed on, with positions shifted.
Reply = dict[str, Any]

__all__ = ["KernelShim"]


class KernelShim:
    """Answers the kernel's complete and inspect requests from rank 0 for cells that run there.

    Wraps ``kernel.do_complete`` and ``kernel.do_inspect`` of this kernel instance (the
    documented override points of ipykernel): for a ``%%distributed`` cell, or any cell that
    auto mode sends to the ranks, the request goes to rank 0's kernel with ``view.apply``
    (``jupyter_ring.engines._complete.complete`` / ``inspect``), so names that exist only on the ranks
    complete and ``?``/Shift-Tab describe the rank's object; nothing is copied into this
    kernel. Other cells, a cursor on the ``%%distributed`` line itself, no cluster, or no answer
    within ``RingMagics.remote_timeout`` seconds: this kernel answers as usual.
    """

    # kernel: ipykernel's Kernel; its do_complete/do_inspect are replaced on the instance, which
    # its type does not allow
    def __init__(self, magics: "RingMagics", kernel: Any) -> None:
        self.magics = magics
        self.kernel = kernel
        self._complete = kernel.do_complete
        self._inspect = kernel.do_inspect
        kernel.do_complete = self.do_complete
        kernel.do_inspect = self.do_inspect

    def remove(self) -> None:
        """Give the kernel its own handlers back (if nobody replaced ours meanwhile)."""
        if self.kernel.do_complete == self.do_complete:
            self.kernel.do_complete = self._complete
        if self.kernel.do_inspect == self.do_inspect:
            self.kernel.do_inspect = self._inspect

    async def do_complete(self, code: str, cursor_pos: int | None) -> Reply:
        """Rank 0's completions for a cell that runs there, else this kernel's."""
        if cursor_pos is None:
            cursor_pos = len(code)
        reply = self._remote("complete", code, cursor_pos)
        if reply is None:
            local = self._complete(code, cursor_pos)
            if inspect.isawaitable(local):
                local = await local
            reply = local
        return reply

    async def do_inspect(self, code: str, cursor_pos: int | None, detail_level: int = 0,
                         omit_sections: Sequence[str] = ()) -> Reply:
        """Rank 0's description of the object at the cursor for a cell that runs there, unless
        it found none and this kernel does."""
        if cursor_pos is None:
            cursor_pos = len(code)
        reply = self._remote("inspect", code, cursor_pos, detail_level, list(omit_sections))
        if reply is None or not reply.get("found"):
            local = self._inspect(code, cursor_pos, detail_level, omit_sections)
            if inspect.isawaitable(local):
                local = await local
            if reply is None or local.get("found"):
                reply = local
        return reply

    def _remote(self, what: str, code: str, cursor_pos: int, *args: object) -> Reply | None:
        """Rank 0's reply with positions shifted back into the cell, or None (answer here)."""
        from .engines import _complete

        body_start = _remote_body_start(code, self.magics.auto)
        if body_start is None or cursor_pos < body_start:
            return None
        cluster = self.magics.cluster
        if cluster is None or not cluster.running or not cluster.engine_ids:
            return None
        try:
            view = connected_client(cluster)[cluster.engine_ids[0]]
            func = _complete.complete if what == "complete" else _complete.inspect
            reply: Reply = view.apply_async(func, code[body_start:], cursor_pos - body_start,
                                            *args).get(timeout=self.magics.remote_timeout)
        except Exception:  # busy, dead or slow rank: this kernel's own answer is better than none
            return None
        if what == "complete":
            reply = dict(reply)
            reply["cursor_start"] = reply.get("cursor_start", 0) + body_start
            reply["cursor_end"] = reply.get("cursor_end", 0) + body_start
            meta = dict(reply.get("metadata") or {})
            for key, items in meta.items():
                if key.endswith("_jupyter_types_experimental") and isinstance(items, list):
                    meta[key] = [dict(item, start=item.get("start", 0) + body_start,
                                      end=item.get("end", 0) + body_start) for item in items]
            reply["metadata"] = meta
        return reply


def _remote_body_start(code: str, auto: bool) -> int | None:
    """Where the part of ``code`` that runs on the ranks starts, or None if it runs here."""
    stripped = code.lstrip()
    if stripped.startswith("%%distributed"):
        newline = code.find("\n", len(code) - len(stripped))
        return len(code) + 1 if newline == -1 else newline + 1
    if auto and routes_to_ranks(code.splitlines(keepends=True)):
        return 0
    return None
