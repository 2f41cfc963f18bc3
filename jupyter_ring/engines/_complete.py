"""Completion and inspection on rank 0, for cells that run on the ranks.

Called on rank 0 with ``view.apply`` by the notebook kernel's complete/inspect handlers
(``magics._KernelShim``), so that names that exist only on the ranks complete, and ``?`` /
Shift-Tab describe the rank's object. Runs inside the engine.
"""

from collections.abc import Sequence
from typing import Any

__all__ = ["complete", "inspect"]


def complete(code: str, cursor_pos: int) -> dict[str, Any]:
    """This engine's kernel's ``complete_reply`` content for ``code`` (the cell body)."""
    from IPython import get_ipython

    ip = get_ipython()
    # Jedi's first completion in a process takes 1-3 s (its warm-up), longer than the notebook
    # waits for a rank (remote_timeout); IPython's own completer answers from the namespace in ms.
    ip.Completer.use_jedi = False
    kernel = getattr(ip, "kernel", None)
    if kernel is not None:
        reply: Any = kernel.do_complete(code, cursor_pos)  # a dict, or an async handler's coroutine
        if not hasattr(reply, "close"):  # a dict; an async handler would return a coroutine
            content: dict[str, Any] = reply
            return content
        reply.close()
    text, matches = ip.complete("", code[:cursor_pos].rsplit("\n", 1)[-1])
    return {"status": "ok", "matches": matches, "cursor_start": cursor_pos - len(text),
            "cursor_end": cursor_pos, "metadata": {}}


def inspect(code: str, cursor_pos: int, detail_level: int = 0,
            omit_sections: Sequence[str] = ()) -> dict[str, Any]:
    """This engine's kernel's ``inspect_reply`` content (``?``, Shift-Tab) for ``code``."""
    from IPython import get_ipython

    kernel = get_ipython().kernel
    reply: Any = kernel.do_inspect(code, cursor_pos, detail_level, omit_sections)
    if hasattr(reply, "close"):
        reply.close()
        return {"status": "ok", "found": False, "data": {}, "metadata": {}}
    content: dict[str, Any] = reply
    return content
