"""The kernel's end of ``%ring debugpy RANK``: start debugpy on a rank, print how to attach.

The rank's end is ``engines/_debugpy.py`` (debugpy on 127.0.0.1, owner-only, the cells as files).
Here: ask the rank to start it, then print the VS Code ``launch.json`` attach configuration
(:func:`attach_config`: host, port, and the ``pathMappings`` from the rank's copy of its cells,
``rank<r>.cells`` in the cluster's where folder, to the rank's cell files) and, with ``--wait``,
wait until a client attaches (the kernel's interrupt stops the wait, not debugpy).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from .engines import _debugpy as rank_side
from .engines._debugpy import Endpoint
from .runtime.internal import cells_path

__all__ = ["DebugpyError", "attach_config", "describe", "start_on_rank", "wait_for_client"]

# Seconds between two asks "is a client attached?" while --wait waits (a person clicks Attach).
_WAIT_NAP = 0.2


class DebugpyError(Exception):
    """``%ring debugpy`` could not start debugpy on the rank (the message says why and the fix)."""


def start_on_rank(cluster: Any, rank: int, timeout: float) -> Endpoint:
    """Start debugpy on ``rank`` of ``cluster`` (a RingCluster) and return where it listens."""
    if not 0 <= rank < cluster.size:
        raise DebugpyError(f"%ring debugpy {rank}: no rank {rank}; the cluster has ranks "
                           f"0..{cluster.size - 1}")
    view = cluster.client[cluster.engine_ids[rank]]
    try:
        endpoint: Endpoint = view.apply_async(rank_side.start).get(timeout)
    except Exception as exc:  # ipyparallel's RemoteError carries the rank's exception by name
        name = getattr(exc, "ename", type(exc).__name__)
        message = getattr(exc, "evalue", str(exc))
        raise DebugpyError(f"%ring debugpy {rank}: {message}" if name == "MissingDebugpy" else
                           f"%ring debugpy {rank}: starting debugpy on rank {rank} failed: "
                           f"{name}: {message}") from None
    return endpoint


def attach_config(rank: int, endpoint: Endpoint, where_dir: str) -> dict[str, object]:
    """VS Code's ``launch.json`` configuration that attaches to ``endpoint`` (rank ``rank``)."""
    config: dict[str, object] = {
        "name": f"jupyter_ring rank {rank}",
        "type": "debugpy",
        "request": "attach",
        "connect": {"host": endpoint["host"], "port": endpoint["port"]},
    }
    if endpoint["cells_dir"]:
        config["pathMappings"] = [{"localRoot": cells_path(where_dir, rank),
                                   "remoteRoot": endpoint["cells_dir"]}]
    return config


def describe(rank: int, endpoint: Endpoint, where_dir: str) -> str:
    """What ``%ring debugpy`` prints: where debugpy listens, the configuration, the cells' files."""
    config = attach_config(rank, endpoint, where_dir)
    again = "" if endpoint["new"] else " (already, since an earlier %ring debugpy)"
    lines = [f"rank {rank}: debugpy listening on {endpoint['host']}:{endpoint['port']}{again}, "
             f"pid {endpoint['pid']} on {endpoint['hostname']}; "
             + ("connections from other users are refused" if endpoint["owner_check"] else
                "this system cannot tell who connects: any local user can attach"
                " (docs/debugging.md)") + "."]
    if endpoint["hostname"] != socket.gethostname():
        lines.append(f"The rank runs on {endpoint['hostname']}: forward the port first, "
                     f"ssh -N -L {endpoint['port']}:127.0.0.1:{endpoint['port']} "
                     f"{endpoint['hostname']}")
    lines.append("VS Code: add this to .vscode/launch.json (\"configurations\"), then Run and "
                 f"Debug > \"{config['name']}\":")
    lines.append(json.dumps(config, indent=2))
    folder = cells_path(where_dir, rank)
    if endpoint["cells"]:
        lines.append(f"Set breakpoints in the rank's cells, files in {folder}{os.sep} "
                     "(a cell run again keeps its file); the latest:")
        lines.extend(f"  In[{number}]: {os.path.join(folder, name)}" for number, name in endpoint["cells"])
    else:
        lines.append(f"Set breakpoints in the rank's cells, files in {folder}{os.sep} once run.")
    return "\n".join(lines)


def wait_for_client(cluster: Any, rank: int, timeout: float | None) -> bool:
    """Wait until a client is attached to ``rank``'s debugpy (True), or ``timeout`` seconds
    (False; None: no limit). The kernel's interrupt raises KeyboardInterrupt here."""
    view = cluster.client[cluster.engine_ids[rank]]
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        if view.apply_async(rank_side.connected).get(30):
            return True
        time.sleep(_WAIT_NAP)
    return False
