"""Interrupting the ranks: the one path the kernel and the Ring panel share.

A signal goes to each engine's ipyparallel nanny (a ``signal_request`` on the control channel,
through the controller), and the nanny signals its own engine process. Never through mpiexec
(``ipyparallel.Cluster.signal_engines``): MPICH's mpiexec (Hydra) forwards the first SIGINT but
aborts the whole job on the second, so two quick presses of Interrupt would kill every rank and
its variables. Through the nannies any number of interrupts only interrupt, on one host or many.

The notebook's own interrupt of a cell is no bare signal (``interrupt_cells``): it names the cell,
and the rank decides, on its control thread, whether that cell runs, has not begun or has ended
(``engines/_interrupts``); a signal would interrupt whatever runs when it lands.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .._ipp import send_control
from ..engines._interrupts import REQUEST, CellId
from ..errors import ClusterError

if TYPE_CHECKING:
    # ipyparallel ships no type information (no py.typed, no stubs): mypy reads its Client as Any
    import ipyparallel as ipp

__all__ = ["signal_engines", "signal_cluster", "interrupt_cells"]


def signal_engines(client: ipp.Client, sig: int = signal.SIGINT,
                   engine_ids: Iterable[int] | None = None,
                   timeout: float | None = None) -> list[int]:
    """Send ``sig`` to the engines ``engine_ids`` (default: every registered one) of ``client``.

    Those no longer registered are skipped. ``timeout`` None: return at once; else wait that
    many seconds for every nanny to confirm, raising ClusterError if one does not. Returns the
    engine ids signalled.
    """
    alive = set(client.ids)
    targets = [e for e in (sorted(alive) if engine_ids is None else engine_ids) if e in alive]
    if not targets:
        return []
    replies = client.send_signal(sig, targets=targets, block=False)
    if timeout is not None:
        try:
            msgs = replies.result(timeout=timeout)
        except Exception as exc:  # concurrent.futures.TimeoutError, a closed client
            raise ClusterError(f"the engines' nannies did not confirm {_name(sig)} within "
                               f"{timeout:g} s ({type(exc).__name__}); the cluster may be busy "
                               "or going away: try again, or stop it") from exc
        failed = [m["content"].get("evalue", "?") for m in msgs if m["content"]["status"] != "ok"]
        if failed:
            raise ClusterError(f"{_name(sig)} could not be delivered to {len(failed)} engine(s): "
                               f"{failed[0]}")
    return targets


def interrupt_cells(client: ipp.Client, cell: CellId, engine_ids: list[int]) -> list[Any]:
    """Ask the engines ``engine_ids`` to interrupt ``cell`` and every earlier cell of its cluster
    still running there, now or as it begins; the futures of their replies, in that order."""
    return send_control(client, engine_ids, REQUEST, {"token": cell.token, "upto": cell.number})


def signal_cluster(profile_dir: str, cluster_id: str, sig: int = signal.SIGINT,
                   timeout: float = 10.0) -> list[int]:
    """Connect to cluster ``cluster_id``'s controller (from its files in ``profile_dir``), send
    ``sig`` to every engine through its nanny, and disconnect. Blocking: the Ring panel's server
    runs it in a thread. Returns the engine ids signalled; ClusterError when the controller
    cannot be reached (only Stop can end such a cluster)."""
    from ipyparallel import Client

    from ._launchers import curve_client

    url_file = os.path.join(profile_dir, "security", f"ipcontroller-{cluster_id}-client.json")
    try:
        with curve_client():
            client = Client(url_file=url_file, profile_dir=profile_dir, cluster_id=cluster_id,
                            timeout=timeout)
    except Exception as exc:  # missing file, controller gone or not answering
        raise ClusterError(f"cannot reach the controller of cluster {cluster_id!r} "
                           f"({type(exc).__name__}: {exc}); if it has died, Stop the cluster") from exc
    try:
        targets = signal_engines(client, sig, timeout=timeout)
    finally:
        client.close()
    if not targets:
        raise ClusterError("the cluster has no running engines to interrupt")
    return targets


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)
