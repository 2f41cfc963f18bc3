"""A running cell's live view, shown again in a notebook closed and reopened while the cell runs.

A notebook tab closed during a long ``%%distributed`` cell and opened again gets the notebook as
last saved: the running cell's output is the old one, and nothing the kernel sends for the cell
reaches it. JupyterLab files a kernel's messages under the request that caused them, and the
reopened page never made that request (the server drops what it had buffered for the closed
page: "Discarding N buffered messages"); the live widgets' models were announced to the closed
page only ("Comm not found").

What works while the kernel is busy with the cell:

- the kernel notes the running cell (its notebook cell id, request id and execution count) in a
  file of the cluster (``live-cell.json`` in the cluster's owner-only where folder), from the
  cell's start to its end; the server adds it to the cluster's description, so the Ring panel
  shows the running cell and offers "Show live view";
- that button asks the server (``POST /jupyter-ring/clusters/<id>/attach``), which writes
  ``live-attach.json`` beside it (a shell message would wait for the cell to end);
- the cell's loop (``_cell.CellRun``) looks for that file a few times a second and shows the live
  dashboard and the rank tabs again, as new widgets fed from the same state (every message
  the kernel sends goes to every page connected to it, and a page learns a widget model when
  the kernel announces it);
- the page (``labextension/src/livecell.ts``) puts every output of the running request into the
  cell from then on, in place of its old output, and updates them as the kernel does; when the
  cell ends they become the static views the cell would have shown anyway.
"""

import json
import os
import time
from typing import Any, TypedDict

__all__ = ["RunningCell", "CELL_FILE", "ATTACH_FILE", "note_running_cell", "clear_running_cell",
           "running_cell", "request_attach", "take_attach_request"]

CELL_FILE = "live-cell.json"
ATTACH_FILE = "live-attach.json"


class RunningCell(TypedDict):
    """The ``%%distributed`` cell a kernel is running, as the Ring panel shows it."""

    cell_id: str | None        # the notebook's cell id (JupyterLab sends it with the request)
    msg_id: str | None         # the execute request's id: the parent of every output it makes
    execution_count: int | None
    started: float             # time.time() of the cell's start
    kernel_pid: int


def note_running_cell(where_dir: str, parent: dict[str, Any] | None,
                      execution_count: int | None) -> None:
    """Record that this kernel runs the cell of the execute request ``parent`` (ipykernel's
    ``get_parent("shell")``); nothing without a request (a terminal IPython) or a folder."""
    if not parent or not os.path.isdir(where_dir):
        return
    metadata = parent.get("metadata") or {}
    cell = RunningCell(cell_id=metadata.get("cellId"), msg_id=(parent.get("header") or {}).get("msg_id"),
                       execution_count=execution_count, started=time.time(), kernel_pid=os.getpid())
    _write(os.path.join(where_dir, CELL_FILE), dict(cell))


def clear_running_cell(where_dir: str) -> None:
    """The cell has ended: no running cell, and no request left for it."""
    for name in (CELL_FILE, ATTACH_FILE):
        try:
            os.remove(os.path.join(where_dir, name))
        except OSError:
            pass


def running_cell(where_dir: str) -> RunningCell | None:
    """The running cell recorded in ``where_dir``, or None (none runs, or its kernel is gone)."""
    try:
        with open(os.path.join(where_dir, CELL_FILE)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    from .cluster import live_process

    if not isinstance(data, dict) or live_process(data.get("kernel_pid")) is None:
        return None
    return RunningCell(cell_id=data.get("cell_id"), msg_id=data.get("msg_id"),
                       execution_count=data.get("execution_count"),
                       started=float(data.get("started") or 0.0), kernel_pid=int(data["kernel_pid"]))


def request_attach(where_dir: str) -> RunningCell:
    """Ask the kernel running a cell in this cluster to show the cell's live view again (the
    server does, for the Ring panel). Raises LookupError when no cell runs."""
    cell = running_cell(where_dir)
    if cell is None:
        raise LookupError("no cell is running on this cluster: its output is all in the notebook")
    _write(os.path.join(where_dir, ATTACH_FILE), {"time": time.time(), "msg_id": cell["msg_id"]})
    return cell


def take_attach_request(where_dir: str) -> bool:
    """Whether a page asked for the running cell's live view since the last call (the request is
    taken: removed)."""
    try:
        os.remove(os.path.join(where_dir, ATTACH_FILE))
    except OSError:
        return False
    return True


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # readers never see half a file
