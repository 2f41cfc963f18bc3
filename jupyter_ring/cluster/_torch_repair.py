"""torch.distributed groups re-created after a failed cell: the kernel's side of
``engines._torch.repair``, a collective over the ranks sent to every engine.

The ranks run requests in order, so a repair always runs before the next cell; its note for the
user comes once every rank has answered (``note``), now or when the next cell starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # ipyparallel ships no type information (no py.typed, no stubs): mypy reads its classes as
    # Any, and the names say which object is meant
    import ipyparallel as ipp

__all__ = ["TorchRepair"]


class TorchRepair:
    """The repair in flight on a cluster's engines, and the answers of those finished."""

    def __init__(self, client: Callable[[], ipp.Client]) -> None:
        self._client = client     # the cluster's running client (ClusterError when none runs)
        # engine id -> its re-creation of aborted torch groups, in flight
        self._pending: dict[int, ipp.AsyncResult] | None = None
        self._notes: list[str | None] = []  # the answers of those finished (None: no note)

    def send(self, engine_ids: list[int]) -> None:
        """Ask every engine to re-create the groups some rank aborted."""
        self._pending = {eid: self._send(eid) for eid in engine_ids}
        self._notes = []

    def forget(self) -> None:
        """The cluster is gone: no repair to wait for."""
        self._pending = None

    def _send(self, engine_id: int) -> ipp.AsyncResult:
        from ..engines import _torch

        return self._client()[engine_id].apply_async(_torch.repair)

    def note(self, wait: float = 0.0) -> str:
        """The note of the last repair once it has finished (waiting up to ``wait`` s), else "".

        An engine whose cell just failed aborts the requests that reach it before it has finished
        "aborting its queue" (ipykernel's stop_on_error): a repair aborted there is sent again to
        that engine alone (the others wait for it inside the repair's collective)."""
        import ipyparallel as ipp

        pending = self._pending
        if not pending:
            return ""
        deadline = time.monotonic() + wait
        notes = self._notes
        while True:
            for eid, ar in list(pending.items()):
                if not ar.ready():
                    continue
                try:
                    notes.append(ar.get())
                except ipp.error.TaskAborted:
                    pending[eid] = self._send(eid)
                    continue
                except Exception as exc:  # the cell's error stands; this says what is left to do
                    self._pending = None
                    return (f"(torch.distributed groups could not be re-created after the failure: "
                            f"{type(exc).__name__}: {exc}; run %ring restart)")
                del pending[eid]
            if not pending:
                self._pending = None
                return next((note for note in notes if note), "")
            if time.monotonic() >= deadline:
                return ""
            time.sleep(0.02)
