"""The one module that uses ipyparallel's private API: a cell's execution on the ranks, with each
iopub message handed over as it arrives.

ipyparallel's public ``AsyncResult`` says when requests finish and accumulates their output, but
only its own ``stream_output()`` gets a message the moment it arrives, through the per-request
``MessageFuture.iopub_callbacks`` (it then prints ``[stdout:N]`` blocks itself, and registers
after the request is sent, replaying what came meanwhile: a race it notes as a FIXME).
:class:`CellExecution` sends the execute requests itself (``Client.send_execute_request`` with a
``message_future_hook``, as ``DirectView.execute`` does), so its callbacks are registered before
the request leaves: no message can come first, none is seen twice.

The callbacks run on ipyparallel's IO thread and only queue a record and wake the notebook's
thread, which takes them in order (:meth:`CellExecution.take`) and draws them. Everything else
the front end does with ipyparallel goes through its public API (views, ``Client.ids``,
``send_signal``, launchers' ``pid``/``state``/``output_file``), except the notebook's interrupt of
a cell, a control-channel request of our own (:func:`send_control`), the text a launcher kept
of its output file once its process ended (:func:`launcher_output`), and the end of the event-loop
thread a Cluster's ``*_sync`` methods start in a kernel (:func:`end_sync_thread`). If an ipyparallel release
changes these internals, this file is the one to change.
"""

import collections
import functools
import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from ipyparallel import Client

__all__ = ["Arrival", "CellExecution", "end_sync_thread", "launcher_output", "send_control"]

# Seconds a rank's engine may be idle after a request (its iopub status for it said so) before a
# reply that has not come counts as lost: the engine sends the reply first, but the two travel
# different paths through the controller.
REPLY_GRACE = 2.0

# the iopub messages a cell's output is made of (``data_message``: a datapub publication, merged
# by ipyparallel into the request's ``data`` dict before the callback runs)
DELIVERED = frozenset({"stream", "display_data", "execute_result", "data_message"})


class Arrival(NamedTuple):
    """One iopub message from one rank, in arrival order."""

    rank: int
    kind: str        # one of DELIVERED
    content: dict[str, Any]  # the message's content (stream: name, text; display_data: data, metadata)


class CellExecution:
    """``code`` executed on ``engine_ids`` (one per rank of ``ranks``), messages queued as they come.

    ``metadata``: added to each request's (the cell's id: ``engines._interrupts.METADATA``).
    ``ar`` is the public ``AsyncResult`` of the requests (``wait``, ``wait_for_output``, ``data``).
    """

    def __init__(self, client: "Client", engine_ids: list[int], ranks: list[int], code: str,
                 metadata: dict[str, Any] | None = None) -> None:
        from ipyparallel.client.asyncresult import AsyncResult

        self.ranks = list(ranks)
        self._index = {rank: i for i, rank in enumerate(self.ranks)}
        self._arrivals: collections.deque[Arrival] = collections.deque()  # IO thread appends, ours takes
        self._wake = threading.Event()
        self.last_arrival = time.monotonic()   # when the last message came (IO thread writes)
        self._idle_at: dict[int, float] = {}   # rank -> when its engine went idle (IO thread)
        self._client, self._code = client, code
        self._dropped: set[int] = set()  # ids of requests resubmit() replaced
        self._kept: list[Any] = []
        self._engine_ids = list(engine_ids)
        self._metadata = dict(metadata or {})
        self._futures: list[Any] = []  # ipyparallel's MessageFuture, one per rank
        # one lookup of the engines' routing identities for the whole world (a view per rank,
        # as client[[id]] makes, cost the notebook ~2 ms of CPU a rank and cell)
        idents = client._build_targets(self._engine_ids)[0]
        for rank, ident in zip(self.ranks, idents):
            self._futures.append(self._send(rank, ident))
        # copies: ipyparallel's multi_future reads the list it was given when its last child is
        # done, and resubmit() replaces an item of ours (read then, the new request's future
        # blocked the client's IO thread for good)
        self.ar = AsyncResult(client, list(self._futures), fname="execute", targets=list(self._engine_ids),
                              owner=True)

    def _ident(self, engine_id: int) -> bytes:
        """The routing identity of one engine (a request to one rank: resubmit, add)."""
        return self._client._build_targets([engine_id])[0][0]  # type: ignore[no-any-return]

    def _send(self, rank: int, ident: bytes) -> Any:
        # what DirectView.execute sends for each of its targets, on the same socket
        client = self._client
        return client.send_execute_request(
            client._mux_stream, self._code, silent=False, ident=ident, metadata={"label": None, **self._metadata},
            message_future_hook=functools.partial(self._hook, rank))

    def resubmit(self, rank: int, engine_id: int) -> None:
        """Send the cell again, to ``engine_id``, as ``rank``'s request: a rank replaced while the
        cell runs under ``elastic.run`` runs it from its start (its old request, to the dead
        engine, is forgotten: nothing it still brings counts)."""
        from ipyparallel.client.asyncresult import AsyncResult

        index = self._index[rank]
        self._idle_at.pop(rank, None)
        self._engine_ids[index] = engine_id
        old = self._futures[index]
        self._dropped.add(id(old))
        self._kept.append(old)  # alive, so that its id is never another future's
        self._futures[index] = self._send(rank, self._ident(engine_id))
        self.ar.owner = False  # the survivors' requests are the new result's now
        self.ar = AsyncResult(self._client, list(self._futures), fname="execute",
                              targets=list(self._engine_ids), owner=True)
        self._wake.set()

    def add(self, rank: int, engine_id: int) -> None:
        """Send the cell to ``engine_id`` as a new rank ``rank`` (host discovery grew the world
        while the cell runs under ``elastic.run``: the new rank runs it from its start); a rank
        that left the world earlier in the cell takes its old place (:meth:`resubmit`)."""
        from ipyparallel.client.asyncresult import AsyncResult

        if rank in self._index:  # it left the world earlier in this cell, and comes back
            self.resubmit(rank, engine_id)
            return
        self.ranks.append(rank)
        self._index[rank] = len(self.ranks) - 1
        self._engine_ids.append(engine_id)
        self._futures.append(self._send(rank, self._ident(engine_id)))
        self.ar.owner = False
        self.ar = AsyncResult(self._client, list(self._futures), fname="execute",
                              targets=list(self._engine_ids), owner=True)
        self._wake.set()

    def _hook(self, rank: int, future: Any) -> None:
        # before the request is handed to the IO thread: nothing of it can have arrived yet
        future.iopub_callbacks.append(functools.partial(self._on_iopub, rank, future))
        future.add_done_callback(self._on_done)
        future.output.add_done_callback(functools.partial(self._on_idle, rank, future))

    def _on_iopub(self, rank: int, request: Any, msg: dict[str, Any]) -> None:
        if id(request) in self._dropped:
            return  # the replaced request of a dead engine
        kind = msg["header"]["msg_type"]
        if kind in DELIVERED:
            self._arrivals.append(Arrival(rank, kind, msg["content"]))
            self.last_arrival = time.monotonic()
            self._wake.set()

    def _on_done(self, _future: Any) -> None:
        self._wake.set()

    def _on_idle(self, rank: int, request: Any, _future: Any) -> None:
        if id(request) in self._dropped:
            return  # the replaced request of a dead engine
        self._idle_at[rank] = time.monotonic()
        self._wake.set()

    # ------------------------------------------------------------------ the notebook's thread
    def wait(self, timeout: float) -> None:
        """Block until a message or a reply arrives, or ``timeout`` seconds pass."""
        if self._wake.wait(timeout):
            self._wake.clear()  # before take(): whatever comes after wakes the next wait

    def take(self) -> list[Arrival]:
        """The messages that arrived since the last call, oldest first."""
        out: list[Arrival] = []
        while self._arrivals:
            out.append(self._arrivals.popleft())
        return out

    def wait_done(self, timeout: float) -> bool:
        """Block until :meth:`done`, at most ``timeout`` seconds; whether it is."""
        deadline = time.monotonic() + timeout
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.wait(min(0.1, left))
        return True

    def done(self) -> bool:
        """Whether every rank has replied (finished, failed or been failed by the controller), or
        went idle without a reply (:meth:`lost`)."""
        lost = self.lost()
        return all(f.done() or r in lost for r, f in zip(self.ranks, self._futures))

    def lost(self) -> list[int]:
        """Ranks whose engine went idle after this request ``REPLY_GRACE`` s ago with no reply.

        Their cell has ended; the reply will not come (an engine that lost it: ipykernel sends
        none when a KeyboardInterrupt escapes its handler outside the cell's code). What the
        rank raised, if anything, is in its output (:meth:`error`).
        """
        now = time.monotonic()
        return [r for r, f in zip(self.ranks, self._futures) if not f.done() and self._lost(r, now)]

    def _lost(self, rank: int, now: float) -> bool:
        # the rank's engine went idle REPLY_GRACE s ago (its reply not looked at here)
        return now - self._idle_at.get(rank, now) >= REPLY_GRACE

    def running(self) -> list[int]:
        """Ranks without a reply whose engine has not gone idle either: still in the cell."""
        return [r for r, f in zip(self.ranks, self._futures)
                if not f.done() and not f.output.done()]

    def output_done(self, rank: int | None = None) -> bool:
        """Whether the rank's (every rank's) output is complete: its engine went idle."""
        futures = self._futures if rank is None else [self._futures[self._index[rank]]]
        return all(f.output.done() for f in futures)

    def pending(self) -> list[int]:
        """Ranks that have not replied yet (those whose reply is :meth:`lost` aside)."""
        lost = self.lost()
        return [r for r, f in zip(self.ranks, self._futures) if not f.done() and r not in lost]

    def error(self, rank: int) -> BaseException | None:
        """The rank's remote error (ipyparallel's RemoteError, EngineError ...), else None; for a
        rank whose reply is :meth:`lost`, the error its output showed (its iopub ``error``)."""
        future = self._futures[self._index[rank]]
        if not future.done():
            if not self._lost(rank, time.monotonic()):  # one rank's check: this runs per rank
                return None
            shown: BaseException | None = future.output.metadata["error"]
            return shown
        exc: BaseException | None = future.exception()
        if exc is not None:
            return exc
        result = future.result()
        return result if isinstance(result, BaseException) else None

    def stderr(self) -> list[str]:
        """Each rank's stderr so far, as ipyparallel accumulated it (rank order)."""
        return [f.output.metadata["stderr"] or "" for f in self._futures]

    def finished_at(self, rank: int) -> datetime | None:
        """When the rank's reply says its cell ended (or was received), or None."""
        md = self._futures[self._index[rank]].output.metadata
        when: datetime | None = md["completed"] or md["received"]
        return when


def send_control(client: "Client", engine_ids: list[int], msg_type: str,
                 content: dict[str, Any]) -> list[Any]:
    """Send a control-channel request of ``msg_type`` to each engine of ``engine_ids``; the
    futures of their replies (the reply message once done), in that order. The engine's control
    thread answers it while a cell runs; the controller and the engine's nanny relay it to any
    host, as they relay ``send_signal``."""
    idents = client._build_targets(list(engine_ids))[0]
    return [client._send(client._control_stream, msg_type, content=content, ident=ident)
            for ident in idents]


def launcher_output(launcher: object) -> str:
    """What an engine set's launcher (mpiexec's job) wrote: its output file while the job runs;
    once its process has ended, ipyparallel reads the file into the launcher's ``_output`` and
    removes it (``_log_output``), so that text then. "" where there is neither."""
    path = getattr(launcher, "output_file", "") or ""
    if path:
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            pass
    kept = getattr(launcher, "_output", None)
    return kept if isinstance(kept, str) else ""


def end_sync_thread(cluster: object, timeout: float = 5.0) -> None:
    """End the thread that runs an ipyparallel Cluster's ``*_sync`` methods, if it has one.

    Called where an asyncio loop runs (a kernel), ``start_controller_sync`` and the others run on
    a thread with an event loop of its own (``AsyncFirst._in_thread``), which ipyparallel starts
    once per Cluster and never stops: each ``%ring start`` or ``restart`` left one idle thread in
    the kernel. Stopping its loop ends it; a later ``*_sync`` call on the same Cluster starts a
    new one (``_async_thread`` is None again). Nothing to do outside a running loop (a script),
    where those methods run on a loop of their own that they close."""
    thread = getattr(cluster, "_async_thread", None)
    loop = getattr(cluster, "_thread_loop", None)
    if thread is None or loop is None or thread is threading.current_thread():
        return
    loop.add_callback(loop.stop)
    thread.join(timeout)
    if thread.is_alive():  # a call still running on it: leave the thread, do not hang a stop
        return
    loop.close(all_fds=False)
    cluster._async_thread = None  # type: ignore[attr-defined]
