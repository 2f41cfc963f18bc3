"""Interrupts addressed to a cell: the rank, not the moment a signal lands, decides what stops.

A bare SIGINT interrupts whatever the engine runs when it arrives. The notebook's interrupt of a
``%%distributed`` cell once missed a rank whose request had not begun yet (an engine ignores
SIGINT between requests), and its second signal, sent once the rank began, could land in the
next cell instead. So the notebook names the cell: each cell's requests carry a ``CellId`` in
their metadata, and an interrupt is a control-channel request "interrupt cells up to n" (the
control channel is served by the engine's control thread, also while a cell runs; it travels
through the controller and the rank's nanny, as a signal does, to any host). On the rank:

- running one of those cells: SIGINT to the main thread, at once (a polled wait, a sleep, the
  debugger's prompt end with KeyboardInterrupt, as with the nanny's SIGINT);
- not begun yet (busy with an earlier request, or the request still travelling): the note is
  kept, and the cell ends with KeyboardInterrupt as it begins, before any of its code;
- ended already, or running a later cell: nothing happens.

The SIGINT is sent only while the cell runs (under the lock the cell's end takes), and Python
handles it at the main thread's next bytecode: within that request, never in the next one (one
that comes as the cell's code ends costs no reply: ``_setup.reply_always``). A SIGINT from
elsewhere (the Ring panel's Interrupt, ``kill -INT``, a replaced rank's survivors) interrupts
whatever cell runs, as before. Installed once per engine by the setup code.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Literal, NamedTuple, TypedDict

__all__ = ["CellId", "InterruptReply", "REQUEST", "REPLY", "METADATA", "BEFORE_IT_BEGAN", "install",
           "interrupted_reply"]

# the control request's type, and the key of a cell's id in its execute requests' metadata
REQUEST = "jupyter_ring_interrupt_request"
REPLY = "jupyter_ring_interrupt_reply"
METADATA = "jupyter_ring_cell"

# the evalue of the reply of a cell interrupted before it began on the rank (errors.where_stopped)
BEFORE_IT_BEGAN = "interrupted before this cell began on this rank"


class CellId(NamedTuple):
    """A cell of one kernel's cluster: ``token`` names the cluster's start, ``number`` counts
    its cells from 1 (an interrupt of cell n is one of every cell up to n still running)."""

    token: str
    number: int

    def wire(self) -> list[Any]:
        """The id as it travels in a request's metadata (JSON)."""
        return [self.token, self.number]

    @classmethod
    def from_wire(cls, value: object) -> CellId | None:
        """The id in a request's metadata, or None (a request that is no cell of the notebook's)."""
        if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
                and isinstance(value[1], int)):
            return cls(value[0], value[1])
        return None


class InterruptReply(TypedDict):
    """The rank's answer to an interrupt: what it found."""

    status: str
    # interrupted: it was running the cell (SIGINT sent); waiting: it has not begun it and will
    # stop as it begins; ended: the cell had ended there
    state: Literal["interrupted", "waiting", "ended"]


class _Cells:
    """One engine's record of its running cell and of the cells it was asked to interrupt."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self._lock = threading.Lock()   # running and the notes change together, on two threads
        self._upto: dict[str, int] = {}   # token -> every cell up to this number is interrupted
        self._begun: dict[str, int] = {}  # token -> the last cell number that began here
        self._running: CellId | None = None
        self._main = threading.main_thread().ident or 0

    def _wanted(self, cell: CellId | None) -> bool:
        return cell is not None and cell.number <= self._upto.get(cell.token, 0)

    def on_request(self, stream: Any, idents: list[bytes], msg: dict[str, Any]) -> None:
        """The control thread's handler of an interrupt: note it, signal the cell if it runs."""
        content = msg["content"]
        token, upto = str(content["token"]), int(content["upto"])
        with self._lock:
            self._upto[token] = max(upto, self._upto.get(token, 0))
            state: Literal["interrupted", "waiting", "ended"]
            if self._wanted(self._running) and threading.get_ident() != self._main:
                # while the cell runs (end() waits for this lock): the main thread's handler
                # (ipykernel's, KeyboardInterrupt) runs at its next bytecode, inside this request
                signal.pthread_kill(self._main, signal.SIGINT)
                state = "interrupted"
            elif self._begun.get(token, 0) >= upto:
                state = "ended"
            else:
                state = "waiting"
        reply = InterruptReply(status="ok", state=state)
        self._kernel.session.send(stream, REPLY, dict(reply), parent=msg, ident=idents)

    def begin(self, cell: CellId | None) -> bool:
        """The main thread, as a request begins: False if its cell was interrupted already."""
        with self._lock:
            if cell is not None:
                self._begun[cell.token] = max(cell.number, self._begun.get(cell.token, 0))
            if self._wanted(cell):
                return False
            self._running = cell
        return True

    def end(self) -> None:
        """The main thread, once the request's code has run: the cell no longer runs here."""
        with self._lock:  # a C lock: no KeyboardInterrupt between its acquire and release
            self._running = None


def install() -> None:
    """Serve the notebook's interrupts on this engine (see the module). Registered once per
    engine, before ``_setup.reply_always`` (whose wrapper then encloses this one)."""
    from IPython import get_ipython

    kernel = get_ipython().kernel
    if getattr(kernel, "_jupyter_ring_cells", None) is not None:
        return
    cells = _Cells(kernel)
    kernel.control_handlers[REQUEST] = cells.on_request
    run: Callable[..., Awaitable[dict[str, Any]]] = kernel.do_execute

    async def do_execute(*args: Any, **kwargs: Any) -> dict[str, Any]:
        parent = kernel.get_parent("shell") or {}
        cell = CellId.from_wire((parent.get("metadata") or {}).get(METADATA))
        if not cells.begin(cell):
            return _before_reply(kernel)
        try:
            return await run(*args, **kwargs)
        finally:
            # whatever interrupt lands meanwhile: one sent as the cell's code ended raises here
            # (as end() begins, or in its wait for the lock on_request holds), and is this
            # cell's, which is over; a cell left recorded as running would let a later interrupt
            # of it signal whatever request runs next
            while True:
                try:
                    cells.end()
                    break
                except KeyboardInterrupt:
                    pass

    kernel.do_execute = do_execute
    kernel._jupyter_ring_cells = cells


def _before_reply(kernel: Any) -> dict[str, Any]:
    """The execute reply of a cell interrupted before it began on this rank: none of its code ran."""
    return interrupted_reply(kernel, f"{BEFORE_IT_BEGAN} (the interrupt came first: the rank was "
                                     "busy with an earlier request, or slow to start); none of its "
                                     "code ran here")


def interrupted_reply(kernel: Any, why: str) -> dict[str, Any]:
    """An execute reply saying KeyboardInterrupt, ``why``, for a request whose cell's code did
    not raise it (as ipykernel's reply of an interrupted cell)."""
    return {"status": "error", "ename": "KeyboardInterrupt", "evalue": why,
            "traceback": [f"KeyboardInterrupt: {why}"],
            "execution_count": kernel.execution_count, "user_expressions": {}, "payload": [],
            "engine_info": kernel.get_engine_info(method="execute")}
